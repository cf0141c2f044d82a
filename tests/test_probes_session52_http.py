"""Probes of the fifty-second session: the HTTP edge of `infer serve` as an operator exposes it (--api-key, CORS,
body limits, request ids): every error an OpenAI-style JSON body with the right status."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.cors import CorsOptions  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=128))


def _is_openai_error(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def test_a_refused_cors_preflight_is_an_openai_error_body(engine):
    """A preflight from an origin (or asking a method or header) the CORS options do not allow was answered by
    Starlette's bare text/plain "Disallowed CORS origin" 400: the one error of the server not in OpenAI's shape. It
    is now a JSON error body with the same 400 and headers; an allowed preflight is unchanged."""
    cors = CorsOptions(allowed_origins=("http://a.example",), allowed_methods=("GET", "POST"),
                       allowed_headers=("authorization", "content-type"), allow_credentials=True)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama", api_key="k", cors=cors)) as base:
        def preflight(origin, method="POST", headers="authorization"):
            return httpx.options(f"{base}/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": method,
                "Access-Control-Request-Headers": headers, "X-Request-Id": "rid-1"})
        ok = preflight("http://a.example")
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://a.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        for r, what in [(preflight("http://evil.example"), "origin"),
                        (preflight("http://a.example", "DELETE"), "method"),
                        (preflight("http://a.example", headers="x-secret"), "headers")]:
            error = _is_openai_error(r, 400)
            assert what in error["message"] and error["code"] == "cors_disallowed", error
            assert r.headers["x-request-id"] == "rid-1"
            assert "access-control-allow-origin" not in r.headers or what != "origin"


def _raw(base: str, data: bytes) -> bytes:
    import socket
    host, port = base.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
    b"HELLO\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"])
def test_a_request_uvicorn_cannot_parse_gets_an_openai_error_body(engine, request_bytes):
    """A request whose framing uvicorn could not parse (a Content-Length that is not a number, a request line or a
    header that is not HTTP) was answered by uvicorn's own text/plain "Invalid HTTP request received.": now the
    server's HTTP protocol answers it as every other error, a 400 with an OpenAI-style JSON body, and closes."""
    import json
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        out = _raw(base, request_bytes)
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), out
        assert b"content-type: application/json" in head.lower() and b"connection: close" in head.lower(), out
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_http_request", error
        assert httpx.get(f"{base}/health").status_code == 200  # the server goes on


def test_a_body_that_stops_arriving_is_answered_408_and_the_connection_closed(engine):
    """A client that sent its headers and half its body, then nothing (a slow-loris, a client that hung), held its
    connection and its handler for ever: uvicorn has no limit on how long a body may take. Now a body none of whose
    bytes arrive for BodyLimits.body_idle_timeout seconds is answered with an OpenAI-style 408 and the connection is
    closed; a whole body is still read as before."""
    import json
    import socket
    from infer.serve.body import BodyLimits, DEFAULT_BODY_IDLE_TIMEOUT_S
    assert BodyLimits().body_idle_timeout == DEFAULT_BODY_IDLE_TIMEOUT_S == 60.0
    server = Server(AsyncEngine(engine), "tiny-llama", limits=BodyLimits(body_idle_timeout=0.3))
    with serve_in_thread(server) as base:
        host, port = base.split("//")[1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": \"x")
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except socket.timeout:
                pass
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), out
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "13 bytes came" in error["message"], error
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200, ok.text
