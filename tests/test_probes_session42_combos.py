"""Probes of feature combinations (session 42): structured outputs with logprobs, in the Python API and the server."""

from __future__ import annotations

import json
import math

import pytest

from infer import LLM, SamplingParams

CHOICE = {"choice": ["yes", "no"]}


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", block_size=4, max_model_len=64) as llm:
        yield llm


def test_a_structured_replys_logprobs_are_over_the_tokens_its_grammar_allows(llm):
    """vLLM masks a structured output's logits with the grammar's bitmask before its sampler, so the (raw) logprobs
    it reports are those of the distribution over the tokens the grammar allows: the token a grammar forces (EOS
    once the choice is complete) has logprob 0, and a position's top tokens that the grammar allows hold all the
    probability. infer reported the unmasked distribution (EOS at about -8, the choice's first token far below the
    tokens no reply could have), so a client scoring `choice` by its logprobs read nonsense."""
    params = SamplingParams(max_new_tokens=4, logprobs=3, structured_outputs=CHOICE)
    out = llm.generate(["Is it?"], params)[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    for rec in out.logprobs:
        assert rec["top_logprobs"][0]["token_id"] == rec["token_id"]  # greedy: the most likely allowed token
        assert sum(math.exp(x["logprob"]) for x in rec["top_logprobs"]) == pytest.approx(1.0, abs=1e-5)
    assert out.logprobs[-1]["logprob"] == pytest.approx(0.0, abs=1e-6)  # EOS: the only token left
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(r["logprob"] for r in out.logprobs))
    # a request without a grammar in the same batch still reports the raw distribution
    free, constrained = llm.generate(["Is it?", "Is it?"], [SamplingParams(max_new_tokens=2, logprobs=3), params])
    alone = llm.generate(["Is it?"], SamplingParams(max_new_tokens=2, logprobs=3))[0]
    assert [r["logprob"] for r in free.logprobs] == pytest.approx([r["logprob"] for r in alone.logprobs], abs=1e-5)
    assert [r["logprob"] for r in constrained.logprobs] == pytest.approx([r["logprob"] for r in out.logprobs],
                                                                        abs=1e-5)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_server_shows_a_masked_top_token_as_vllm_does_in_valid_json(chat, stream):
    """A structured reply's top_logprobs list tokens its grammar masked (logprob -inf); the server wrote them as
    `-Infinity`, which is not JSON (a JavaScript client's JSON.parse, or any strict parser, fails on the whole
    response). vLLM shows them as -9999.0; so does infer now."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4))
    body = {"max_tokens": 4, "temperature": 0, "structured_outputs": CHOICE, "stream": stream}
    if chat:
        url, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Is it?"}],
                                             "logprobs": True, "top_logprobs": 5}
    else:
        url, body = "/v1/completions", {**body, "prompt": "Is it?", "logprobs": 5}
    with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama"))) as client:
        r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [_strict(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        choices = [c for e in events for c in e["choices"] if c.get("logprobs")]
    else:
        choices = _strict(r.text)["choices"]
    if chat:
        tops = [x["logprob"] for c in choices for t in c["logprobs"]["content"] for x in t["top_logprobs"]]
    else:
        tops = [v for c in choices for top in c["logprobs"]["top_logprobs"] for v in top.values()]
    assert -9999.0 in tops and all(v == -9999.0 or v > -100 for v in tops)
