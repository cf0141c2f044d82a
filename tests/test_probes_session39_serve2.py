"""Probes of session 39 (serve, second part): vLLM's CORS options (--allowed-origins, --allowed-methods,
--allowed-headers as JSON lists, --allow-credentials) were missing, so a browser's preflight OPTIONS got a 405; and
vLLM V1's request metrics (inter-token latency, queue / prefill / decode / inference times, prompt and generation
token histograms, preemptions, prefix cache queries and hits) were not in /metrics."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.cli.main import app  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.errors import ConfigError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.cors import CorsOptions, cors_options  # noqa: E402

runner = CliRunner()
KEY = "sekrit"
PAGE = "http://page.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4))


def _server(engine, **kw):
    return serve_in_thread(Server(AsyncEngine(engine), "tiny", **kw))


# ----------------------------------------------------------------------------------------------------- CORS
def test_a_preflight_is_answered_before_the_api_key_as_vllm_does(engine):
    with _server(engine, api_key=KEY) as base:
        r = httpx.options(f"{base}/v1/chat/completions", headers={**PREFLIGHT, "X-Request-Id": "pre-1"})
        assert r.status_code == 200, r.text  # was a 405
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["x-request-id"] == "pre-1"  # the echo middleware still wraps it
        # the real request still needs the key; its 401 carries the CORS header, so the page can read it
        r = httpx.post(f"{base}/v1/chat/completions", headers={"Origin": PAGE},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.post(f"{base}/v1/completions", headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"},
                       json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert 'infer:http_requests_total{route="/v1/chat/completions",status="401"} 1.0' in text
        assert 'infer:http_requests_total{route="/v1/completions",status="200"} 1.0' in text


def test_allowed_origins_limit_who_may_call(engine):
    cors = CorsOptions(allowed_origins=(PAGE,), allowed_methods=("POST",), allowed_headers=("content-type",),
                       allow_credentials=True)
    with _server(engine, cors=cors) as base:
        r = httpx.options(f"{base}/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers":
                                                             "content-type"})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == PAGE
        assert r.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(f"{base}/v1/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = httpx.get(f"{base}/health", headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_serve_reads_the_cors_options(monkeypatch):
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda engine, *a, **kw: seen.update(**kw))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", "--allowed-origins", f'["{PAGE}"]',
                              "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["x-a"]',
                              "--allow-credentials"])
    assert res.exit_code == 0, res.output
    assert seen["cors"] == CorsOptions((PAGE,), ("GET", "POST"), ("x-a",), True)
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0"])
    assert res.exit_code == 0, res.output
    assert seen["cors"] == CorsOptions()  # vLLM's defaults: every origin, method and header, no credentials


@pytest.mark.parametrize("option", ["--allowed-origins", "--allowed-methods", "--allowed-headers"])
@pytest.mark.parametrize("value", ["http://a.example", '"*"', '["a", 1]', '{"a": 1}'])
def test_a_cors_value_not_a_json_list_of_strings_is_refused_naming_the_option(option, value, monkeypatch):
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **kw: pytest.fail("served"))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", option, value])
    assert res.exit_code != 0 and option in res.output and "JSON list of strings" in res.output, res.output
    with pytest.raises(ConfigError, match=option):
        cors_options(*[value if o == option else '["*"]' for o in
                       ("--allowed-origins", "--allowed-methods", "--allowed-headers")], False)


def test_data_parallel_serving_gets_the_cors_options_too(monkeypatch):
    import types

    import infer.parallel.serve as ps
    seen = {}
    monkeypatch.setattr("infer.cli.serve_parallel.serve_data_parallel", lambda *a, **kw: seen.update(cli=kw["cors"]))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", "--data-parallel", "2", "--allowed-origins",
                              f'["{PAGE}"]'])
    assert res.exit_code == 0, res.output
    assert seen["cli"] == CorsOptions((PAGE,))

    class FakeServer:
        def __init__(self, aengine, model_id, **kw):
            seen.update(server=kw.get("cors"))
            self.metrics = types.SimpleNamespace(registry=types.SimpleNamespace(register=lambda c: None))
    monkeypatch.setattr("infer.serve.app.Server", FakeServer)
    monkeypatch.setattr("infer.models.resolve.resolve_model", lambda m: m)
    monkeypatch.setattr("infer.engine.setup.load_tokenizer", lambda *a: None)
    monkeypatch.setattr(ps, "start_replicas", lambda *a: ([], [{}]))
    monkeypatch.setattr("infer.parallel.serve_engine.RayAsyncEngine", lambda *a: None)
    monkeypatch.setattr("infer.parallel.serve_engine.ReplicaView", lambda *a: None)
    ps.build_server(types.SimpleNamespace(get=lambda refs: refs), EngineConfig("tiny-llama"), 2, "m", None, 8, 1.0,
                    cors=CorsOptions((PAGE,)))
    assert seen["server"] == CorsOptions((PAGE,))
