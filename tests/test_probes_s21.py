"""Twenty-first session: a request whose own constraints reach a dead end mid-reply (a grammar rule that never
ends, bad_words that ban every token the rest allows) is the client's to change: the server answers 400 with the
engine's message, whole or streamed, not a 500 "engine_error" that says infer failed; the server goes on."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

DEAD = 'root ::= "a" b\nb ::= b "x"'  # compiles; after "a" no token can follow


@pytest.fixture(scope="module")
def served():
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=8, block_size=4))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base


BODIES = {
    "grammar": {"structured_outputs": {"grammar": DEAD}},
    # allowed_token_ids [3] ("!") with the bad word "!!": after one "!" nothing is left
    "bad_words": {"allowed_token_ids": [3], "bad_words": ["!!"]},
}


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_a_dead_end_of_the_requests_own_constraints_is_a_400(served, kind):
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 6, "temperature": 0, **BODIES[kind]}
    r = httpx.post(f"{served}/v1/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "no_token_left"
    assert ("allows no token after the reply so far" if kind == "grammar" else "bad_words leave no token") \
        in err["message"]
    with httpx.stream("POST", f"{served}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    (error,) = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert error["code"] == "no_token_left" and error["type"] == "invalid_request_error"
    ok = httpx.post(f"{served}/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3},
                    timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_an_engine_failure_stays_a_500():
    """Only the request's own dead end is a 400: an error finish without it is infer's, a 500 engine_error."""
    from infer.engine.outputs import RequestOutput
    from infer.serve.app import _error
    out = RequestOutput("r", [1], finished=True, finish_reason="error", error="internal engine error: boom")
    assert (_error(out).status, _error(out).code) == (500, "engine_error")
    out = RequestOutput("r", [1], finished=True, finish_reason="error", error="dead", bad_request=True)
    assert (_error(out).status, _error(out).code) == (400, "no_token_left")
