"""`infer serve` with OpenAI's `n` and `logit_bias` and vLLM's sampling extensions (min_p, min_tokens,
allowed_token_ids, include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens): each reply equals the
Python API's for the same SamplingParams on the same engine, `n` choices are indexed as OpenAI indexes them
(prompt i's sample j is choice i * n + j), sample j of a seeded request draws with seed + j as vLLM's parallel
sampling does, and usage counts each prompt once."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine

CONTEXT = 64


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=CONTEXT, max_num_seqs=8, block_size=4))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base, engine


def _post(base, path, body) -> dict:
    r = httpx.post(f"{base}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def direct():
    """The Python API on an engine of the same model and options (the served one is the server's alone)."""
    from infer import LLM
    with LLM("tiny-llama", max_model_len=CONTEXT, max_num_seqs=8, block_size=4) as llm:
        yield llm


def _tokens(base, body, path="/v1/completions") -> list[list[int]]:
    out = _post(base, path, {**body, "return_token_ids": True})
    return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def test_n_choices_are_seed_plus_j_and_usage_counts_each_prompt_once(served):
    base, engine = served
    prompts = [[5, 9, 14, 20], [7, 7, 30]]
    out = _post(base, "/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 6, "temperature": 1.0,
                                          "seed": 11, "return_token_ids": True})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(6))
    for c in choices:
        i, j = divmod(c["index"], 3)
        alone = _post(base, "/v1/completions", {"prompt": prompts[i], "max_tokens": 6, "temperature": 1.0,
                                                "seed": 11 + j, "return_token_ids": True})["choices"][0]
        assert c["token_ids"] == alone["token_ids"] and c["text"] == alone["text"], c["index"]
    assert len({tuple(c["token_ids"]) for c in choices[:3]}) > 1  # the samples of one prompt differ
    assert out["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


def test_n_streamed_chat_has_every_index_and_counts_the_prompt_once(served):
    base, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    indices = {c["index"] for e in events for c in e["choices"]}
    finished = {c["index"] for e in events for c in e["choices"] if c.get("finish_reason")}
    assert indices == finished == {0, 1}
    whole = _post(base, "/v1/chat/completions", {**body, "stream": False, "stream_options": None})
    assert events[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] < \
        2 * whole["usage"]["prompt_tokens"]


@pytest.mark.parametrize("n, status", [(0, 400), (129, 400), ("2", 400), (1, 200)])
def test_n_out_of_range_is_a_400_naming_n(served, n, status):
    base, _ = served
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "n": n, "max_tokens": 1}, timeout=60)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "n"


EXTRAS = [
    dict(logit_bias={"40": 6.0, "97": -100}, ignore_eos=True),
    dict(min_tokens=5, stop_token_ids=[40, 41, 42, 43], max_tokens=8),
    dict(allowed_token_ids=[11, 40, 97, 260], ignore_eos=True),
    dict(min_p=0.2, temperature=1.3, seed=4, ignore_eos=True),
    dict(truncate_prompt_tokens=3, ignore_eos=True),
]


@pytest.mark.parametrize("extra", EXTRAS, ids=[next(iter(e)) for e in EXTRAS])
def test_the_extensions_reply_as_the_python_api(served, direct, extra):
    base, _ = served
    prompt = [5, 9, 14, 20, 33, 8]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    got = _tokens(base, body)[0]
    fields = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens")}
    params = SamplingParams(max_new_tokens=body["max_tokens"], **fields)
    want = direct.generate([prompt], params)[0].token_ids
    assert got == want


def test_stop_string_kept_and_special_tokens_shown(served):
    base, engine = served
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = _post(base, "/v1/completions", {"prompt": [5, 9, 14], "max_tokens": 3, "logit_bias": {str(eos): 100},
                                          "skip_special_tokens": False, "include_stop_str_in_output": True})
    assert out["choices"][0]["text"] == "<|im_end|>" and out["choices"][0]["finish_reason"] == "stop"
    plain = _post(base, "/v1/completions", {"prompt": [5, 9, 14], "max_tokens": 3, "logit_bias": {str(eos): 100}})
    assert plain["choices"][0]["text"] == ""


def test_a_truncated_prompt_longer_than_the_context_is_served(served):
    base, _ = served
    long = [5 + (i % 50) for i in range(3 * CONTEXT)]
    r = httpx.post(f"{base}/v1/completions", json={"prompt": long, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    out = _post(base, "/v1/completions", {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 10})
    assert out["usage"]["prompt_tokens"] == 10
    text = "hello " * (8 * CONTEXT)
    out = _post(base, "/v1/completions", {"prompt": text, "max_tokens": 2, "truncate_prompt_tokens": 10})
    assert out["usage"]["prompt_tokens"] == 10


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 300}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"), ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"allowed_token_ids": "5"}, "allowed_token_ids"), ({"min_p": 2}, "min_p"),
])
def test_bad_extension_values_are_400s(served, body, param):
    base, _ = served
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
