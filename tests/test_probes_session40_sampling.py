"""Session 40 probes of sampling parameters and logprobs (vLLM's and OpenAI's semantics)."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.errors import RequestError


@pytest.mark.parametrize("key", [True, False])
def test_logit_bias_refuses_a_bool_key(key):
    """{True: 5.0} passed as token 1 (a bool is an int to isinstance), where every other token id field refuses it."""
    with pytest.raises(RequestError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={key: 5.0})


def _served(max_model_len: int):
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=max_model_len, max_num_seqs=4, block_size=4))
    return serve_in_thread(Server(AsyncEngine(engine), "tiny-llama"))


def test_min_tokens_without_max_tokens_is_checked_against_the_endpoints_default():
    """min_tokens was checked against SamplingParams' own default of 256 new tokens, which neither endpoint uses: a
    chat without max_tokens (up to the context) was refused min_tokens 300 ("at most max_tokens (256)", a
    max_tokens it never sent), and a completion (16) was told "at most max_new_tokens", a field it cannot send.
    A chat's min_tokens past what the context leaves after the prompt is refused naming min_tokens."""
    httpx = pytest.importorskip("httpx")
    with _served(512) as base:
        chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "min_tokens": 300}
        r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 300
        r = httpx.post(f"{base}/v1/chat/completions", json={**chat, "min_tokens": 600}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        assert "min_tokens (600)" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "min_tokens": 20}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "min_tokens (20) must be at most max_tokens (16)"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "min_tokens": 16, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


def test_a_dead_end_of_the_requests_own_token_rules_names_its_field():
    """allowed_token_ids that min_tokens leaves empty was a 400 with param "prompt" (the prompt was fine), and a
    bad word that bans the only allowed token mid-reply (no_token_left) a 400 with param null."""
    httpx = pytest.importorskip("httpx")
    with _served(64) as base:
        body = {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": [2]}  # 2: the tiny EOS
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
        body = {"prompt": "hi", "max_tokens": 4, "allowed_token_ids": [8], "bad_words": ["&&"]}  # "&&": [8, 8]
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "no_token_left", r.text
        assert error["param"] == "bad_words"
