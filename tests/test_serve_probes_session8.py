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
    ("min_tokens", 5, "min_tokens is not supported"),
    ("min_p", 0.1, "min_p is not supported"),
    ("use_beam_search", True, "beam search"),
    ("include_stop_str_in_output", True, "include_stop_str_in_output"),
    ("skip_special_tokens", False, "special tokens are always skipped"),
    ("guided_json", {"type": "object"}, "guided decoding"),
    ("guided_choice", ["yes", "no"], "guided decoding"),
    ("allowed_token_ids", [1, 2], "allowed_token_ids"),
    ("tool_choice", "required", "tool calls"),
    ("chat_template_kwargs", {"enable_thinking": False}, "chat_template_kwargs"),
    ("continue_final_message", True, "continue_final_message"),
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
