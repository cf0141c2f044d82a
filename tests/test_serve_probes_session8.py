"""`infer serve` against requests found by probing as a hostile client (session 8): vLLM and OpenAI parameters
that change the reply but were silently dropped, top_logprobs without logprobs, OpenAI's model retrieve
(`GET /v1/models/{id}`) and HEAD probes of /health."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def url():
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, max_num_seqs=8))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base


def _error(r, status: int, param: str | None, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["message"], err
    return err["message"]


def _chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


@pytest.mark.parametrize("field,value,message", [
    ("best_of", 2, "only best_of=1 is supported"),
    ("suffix", "x", "suffix is not supported"),
    ("guided_whitespace_pattern", "\\s*", "guided_whitespace_pattern is not supported"),
    ("response_format", {"type": "structural_tag"}, "type 'structural_tag' is not supported"),
    ("tool_choice", "required", "the request has no tools"),
    ("chat_template_kwargs", {"tokenize": False}, "chat_template_kwargs cannot set tokenize"),
    ("continue_final_message", True, "needs add_generation_prompt=false"),
    ("modalities", ["text", "audio"], "only text output"),
])
def test_parameters_that_change_the_reply_are_400_not_dropped(url, field, value, message):
    """vLLM clients send min_tokens, guided_json, ...: infer answered 200 with a reply that ignored them."""
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(**{field: value}), timeout=60)
    assert message in _error(r, 400, field)


@pytest.mark.parametrize("field,value", [("min_tokens", 0), ("min_p", 0.0), ("skip_special_tokens", True),
                                         ("tool_choice", "none"), ("tool_choice", "auto"), ("modalities", ["text"]),
                                         ("guided_json", None), ("user", "bob"), ("store", False)])
def test_their_defaults_are_accepted(url, field, value):
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(**{field: value}), timeout=60)
    assert r.status_code == 200, r.text


def test_top_logprobs_without_logprobs_is_400_as_in_vllm(url):
    """The reply came back with logprobs null and no word why."""
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(top_logprobs=2), timeout=60)
    assert "logprobs must be set to true" in _error(r, 400, "top_logprobs")
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(top_logprobs=2, logprobs=True), timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_a_model_can_be_retrieved_by_id(url):
    """`client.models.retrieve("tiny-llama")` (GET /v1/models/{id}) was a bare 404 'Not Found'."""
    r = httpx.get(f"{url}/v1/models/tiny-llama")
    assert r.status_code == 200 and r.json()["id"] == "tiny-llama" and r.json()["object"] == "model"
    r = httpx.get(f"{url}/v1/models/gpt-4")
    assert "the model 'gpt-4' does not exist; available: tiny-llama" in _error(r, 404, "model", "model_not_found")


def test_head_probes_of_health_and_models(url):
    """Load balancers and uptime checks send HEAD: it was 405 Method Not Allowed."""
    for path in ("/health", "/v1/models"):
        r = httpx.head(f"{url}{path}")
        assert r.status_code == 200 and r.content == b"", path


def test_http_details_a_client_or_proxy_relies_on(url):
    """A 405 had no Allow header, HEAD /metrics was 405, a gzip body got 400 'not valid JSON', and stream_options
    without stream was accepted silently (vLLM refuses it)."""
    r = httpx.put(f"{url}/v1/models")
    assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
    r = httpx.head(f"{url}/metrics")
    assert r.status_code == 200 and r.content == b""
    import gzip
    import json
    raw = gzip.compress(json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    r = httpx.post(f"{url}/v1/completions", content=raw,
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    message = _error(r, 415, None, "unsupported_content_encoding")
    assert "Content-Encoding 'gzip' is not supported: send the body uncompressed" in message
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                   "stream_options": {"include_usage": True}}, timeout=60)
    assert "stream_options can only be given with stream: true" in _error(r, 400, "stream_options")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream_options": None}, timeout=60)
    assert r.status_code == 200


def _in_thread(fn):
    import threading
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    t.start()
    return t, box


def test_requests_still_running_at_the_shutdown_timeout_are_answered_not_cut():
    """At --shutdown-timeout uvicorn cancelled the handlers: a plain-text "500 Internal Server Error", a stream cut
    without an error event or [DONE], and a traceback per request in the log."""
    import json
    import time
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=4096, max_num_seqs=4))
    server = Server(AsyncEngine(engine), "tiny-llama")
    body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}
    with serve_in_thread(server, graceful_timeout=0.5) as base:
        plain, plain_box = _in_thread(lambda: httpx.post(f"{base}/v1/completions", json=body, timeout=120))

        def stream():
            with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                return [line for line in r.iter_lines() if line]
        streamed, stream_box = _in_thread(stream)
        deadline = time.monotonic() + 60
        while server.aengine.num_in_flight() < 2 or engine.stats()["num_running"] < 2:
            assert time.monotonic() < deadline, "the two requests never ran"
            time.sleep(0.05)
    plain.join(30), streamed.join(30)
    r = plain_box["r"]
    message = _error(r, 503, None, "server_shutting_down")
    assert r.json()["error"]["type"] == "server_unavailable"
    assert "the server shut down before this request finished (--shutdown-timeout 0.5 s passed)" in message
    assert r.headers["retry-after"] == "1"
    lines = stream_box["r"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "server_shutting_down"
    assert engine.block_manager.num_used_blocks == 0


def test_every_refusal_during_a_shutdown_is_the_same_503():
    """A request refused once the shutdown began said `shutting_down`, an adapter load `shutting_down`, a request
    ended by it `server_shutting_down`: a client retrying on one code missed the others."""
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=256, enable_lora=True, max_lora_rank=8))
    server = Server(AsyncEngine(engine), "tiny-llama", runtime_lora=True)
    with serve_in_thread(server) as base:
        server.aengine.stop_accepting()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert "shutting down" in _error(r, 503, None, "server_shutting_down") and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "server_unavailable"
        r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=60)
        assert "shutting down" in _error(r, 503, None, "server_shutting_down") and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "server_unavailable"


def test_a_second_ctrl_c_ends_the_running_requests_and_a_third_quits():
    """A second Ctrl-C made uvicorn drop every handler at once (tracebacks, bare 500s)."""
    import asyncio
    import signal
    from types import SimpleNamespace

    from infer.serve.lifecycle import uvicorn_server
    cut = []
    fake = SimpleNamespace(aengine=SimpleNamespace(cut_off=lambda message: cut.append(message) or 3))
    uv = uvicorn_server(fake, None, 30.0)
    uv.loop = asyncio.new_event_loop()
    try:
        uv.handle_exit(signal.SIGINT, None)  # the first: a graceful shutdown, nothing ended
        assert uv.should_exit and not uv.force_exit
        uv.handle_exit(signal.SIGINT, None)
        uv.loop.run_until_complete(asyncio.sleep(0))
        assert cut == ["the server shut down before this request finished (a second Ctrl-C)"] and not uv.force_exit
        uv.handle_exit(signal.SIGINT, None)
        assert uv.force_exit
    finally:
        uv.loop.close()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello world " * 40_000}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world " * 40_000}]}, "messages")])
def test_a_prompt_far_longer_than_the_context_is_400_without_tokenizing(url, path, body, param):
    """A body under the 8 MB limit kept a parse thread 6 s and 1.4 GB busy before its 400 (the message is the
    size check's, made before tokenizing)."""
    r = httpx.post(f"{url}{path}", json={**body, "max_tokens": 2}, timeout=60)
    assert "leaves no room under the context of 128 tokens" in _error(r, 400, param, "context_length_exceeded")
