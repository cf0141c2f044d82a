"""`infer serve` against oracles the other server tests do not pin down: usage counts from the tokenizer and the
engine's tokens for several prompts at once (stream and not), OpenAI's max_tokens defaults, the context boundary,
streamed logprobs equal to the non-streamed ones, and the SSE framing of the last event."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers import hf_greedy

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine

MAX_LEN = 64


@pytest.fixture(scope="module")
def model_path():
    from infer.models.tiny import ensure_builtin
    return ensure_builtin("tiny-llama")


@pytest.fixture(scope="module")
def url(model_path):
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=MAX_LEN))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path)


def _post(url, path, body):
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url, path, body) -> tuple[bytes, list[dict]]:
    """The raw bytes of an SSE answer and its JSON events (without [DONE])."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        raw = r.read()
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return raw, [json.loads(e[6:]) for e in events[:-1]]


# ---------------------------------------------------------------------------------------------- usage
PROMPTS = ["the rain in spain", "a much longer prompt about the weather in the mountains", "hi"]


def test_usage_of_several_prompts_counts_every_prompt_and_every_token(url, tokenizer, model_path):
    """prompt_tokens from the tokenizer, completion_tokens = every choice's tokens, total = their sum; each choice
    holds transformers' greedy tokens for its own prompt, at its own index."""
    body = {"prompt": PROMPTS, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True, "temperature": 0}
    r = _post(url, "/v1/completions", body)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for c, prompt in zip(r["choices"], ids):
        assert c["prompt_token_ids"] == prompt and c["token_ids"] == hf_greedy(str(model_path), prompt, 5)
        assert c["finish_reason"] == "length"
    want = {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 15, "total_tokens": sum(map(len, ids)) + 15}
    assert r["usage"] == want

    raw, events = _stream(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert raw.endswith(b"data: [DONE]\n\n")  # an SSE event ends with a blank line, [DONE] too
    assert events[-1]["choices"] == [] and events[-1]["usage"] == want
    assert all(e["usage"] is None for e in events[:-1])
    for c in r["choices"]:
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == c["index"]]
        assert "".join(m["text"] for m in mine) == c["text"]
        assert sum((m.get("token_ids") or [] for m in mine), []) == c["token_ids"]
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["length"]


def test_chat_usage_counts_the_templated_prompt(url, tokenizer):
    msgs = [{"role": "user", "content": "tell me about the sea"}]
    r = _post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "ignore_eos": True})
    prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt = list(prompt["input_ids"])
    assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4, "total_tokens": len(prompt) + 4}
    _, events = _stream(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "ignore_eos": True,
                                                      "stream_options": {"include_usage": True}})
    assert events[-1]["usage"] == r["usage"] and events[-1]["object"] == "chat.completion.chunk"


# ---------------------------------------------------------------------------------------------- defaults, limits
@pytest.mark.parametrize("given", [{}, {"max_tokens": None}, {"max_completion_tokens": None}])
def test_completion_without_max_tokens_generates_openais_default_16(url, given):
    """Absent or null (what OpenAI's clients send for None): the default, 16 for completions."""
    r = _post(url, "/v1/completions", {"prompt": [5, 6, 7], "ignore_eos": True, **given})
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("given", [{}, {"max_tokens": None}])
def test_chat_without_max_tokens_runs_to_the_context_limit(url, given):
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}], "ignore_eos": True,
                                            **given})
    assert r["usage"]["total_tokens"] == MAX_LEN and r["choices"][0]["finish_reason"] == "length"


def test_prompt_plus_max_tokens_may_fill_the_context_exactly(url):
    prompt = list(range(10, 30))
    r = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_LEN - len(prompt), "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == MAX_LEN - len(prompt)
    over = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_LEN - len(prompt) + 1})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    full = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(10, 10 + MAX_LEN)), "max_tokens": 1})
    assert full.status_code == 400 and full.json()["error"]["param"] == "prompt"


def test_stop_string_ends_the_text_before_it_with_finish_reason_stop(url):
    """OpenAI: the returned text does not contain the stop sequence; finish_reason is "stop"; a stream says the
    same in its deltas."""
    body = {"prompt": [11, 12, 13, 14], "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    full = _post(url, "/v1/completions", body)["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    want = full[:full.index(stop)]
    r = _post(url, "/v1/completions", {**body, "stop": [stop]})
    assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 24
    _, events = _stream(url, "/v1/completions", {**body, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events) == want
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"


# ---------------------------------------------------------------------------------------------- logprobs
def test_streamed_logprobs_are_the_non_streamed_ones_each_sent_once(url):
    body = {"prompt": "abc def", "max_tokens": 6, "logprobs": 2, "ignore_eos": True, "temperature": 0}
    want = _post(url, "/v1/completions", body)["choices"][0]["logprobs"]
    _, events = _stream(url, "/v1/completions", body)
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert sum((p["tokens"] for p in parts), []) == want["tokens"] and len(want["tokens"]) == 6
    # the same values up to float noise (the second request may reuse the first one's cached prefix)
    assert sum((p["token_logprobs"] for p in parts), []) == pytest.approx(want["token_logprobs"], abs=1e-4)
    tops = sum((p["top_logprobs"] for p in parts), [])
    assert [list(t) for t in tops] == [list(t) for t in want["top_logprobs"]]
    # text_offset counts characters from the start of the choice's text, chunk after chunk
    starts = [sum(len(t) for t in want["tokens"][:k]) for k in range(6)]
    assert want["text_offset"] == starts
    assert sum((p["text_offset"] for p in parts), []) == starts and len(parts) > 1

    chat = {"messages": [{"role": "user", "content": "x y"}], "max_tokens": 5, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True, "temperature": 0}
    want = _post(url, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    _, events = _stream(url, "/v1/chat/completions", chat)
    got = sum((e["choices"][0]["logprobs"]["content"] for e in events if e["choices"][0]["logprobs"]), [])
    assert [g["token"] for g in got] == [w["token"] for w in want] and len(got) == 5
    assert [g["logprob"] for g in got] == pytest.approx([w["logprob"] for w in want], abs=1e-4)


# ---------------------------------------------------------------------------------------------- /metrics
def _samples(url) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # vLLM's labels left out


def test_metrics_counters_follow_the_usage(url):
    """The token counters grow by the usage of the answer; TTFT and latency get one sample each, TTFT the
    smaller one (a request of 24 tokens has its first token well before its last)."""
    before = _samples(url)
    r = _post(url, "/v1/completions", {"prompt": ["one two", "three"], "max_tokens": 24, "ignore_eos": True})
    after = _samples(url)

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    assert grew("infer:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert grew("infer:generation_tokens_total") == r["usage"]["completion_tokens"] == 48
    assert grew("infer:request_finished_total", (("finished_reason", "length"),)) == 2
    assert grew("infer:time_to_first_token_seconds_count") == grew("infer:e2e_request_latency_seconds_count") == 2
    assert 0 <= grew("infer:time_to_first_token_seconds_sum") < grew("infer:e2e_request_latency_seconds_sum")
