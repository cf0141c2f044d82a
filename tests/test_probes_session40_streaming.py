"""Probes of the OpenAI server's streaming, session 40: an unexpected error once a stream had started cut the
connection (the client's reader failed with an incomplete chunked read, and saw neither an error nor `[DONE]`),
where vLLM ends such a stream with an error event and then `data: [DONE]`; `stream_options` without
`include_usage` (`{"continuous_usage_stats": true}`, `{}`) gave no usage at all, where vLLM's include_usage defaults
to true once stream_options is sent (and continuous_usage_stats alone puts the usage in every chunk, as the README
says), and an `include_usage: null` was a 400; `echo` in a stream was a 400, where vLLM streams the prompt (and its
logprobs) in each choice's first chunk, also with max_tokens 0; with `return_token_ids` no chunk carried the prompt's token
ids, which the whole reply has and vLLM streams in a choice's first chunk."""

from __future__ import annotations

import json
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import infer.serve.protocol as p  # noqa: E402
from test_probes_session38_serve import base, engine  # noqa: E402,F401 (the tiny server, per module)

ROUTES = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
          ("/v1/completions", {"prompt": "hi"})]


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def _in_flight(base: str) -> int:
    for _ in range(100):
        n = httpx.get(base + "/health", timeout=10).json()["engine"]["num_in_flight"]
        if n == 0:
            return 0
        time.sleep(0.05)
    return n


@pytest.mark.parametrize("path, body", ROUTES, ids=["chat", "completions"])
def test_an_error_after_the_stream_started_is_an_error_event_then_done(base, path, body, monkeypatch):
    choice, calls = p.choice, []

    def failing(*args, **kwargs):  # a bug of the server on the stream's second chunk
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return choice(*args, **kwargs)

    monkeypatch.setattr(p, "choice", failing)
    r = httpx.post(base + path, json={**body, "max_tokens": 40, "ignore_eos": True, "stream": True}, timeout=60)
    assert r.status_code == 200
    events = _events(r.text)  # was: httpx.RemoteProtocolError, the connection cut without an end
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    monkeypatch.setattr(p, "choice", choice)
    assert _in_flight(base) == 0  # the request the stream was for is aborted, its KV blocks freed


def _usages(base: str, path: str, body: dict, options) -> list:
    r = httpx.post(base + path, json={**body, "max_tokens": 4, "stream": True, "stream_options": options}, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(e).get("usage", "absent") for e in _events(r.text)[:-1]]


@pytest.mark.parametrize("path, body", ROUTES, ids=["chat", "completions"])
def test_continuous_usage_stats_alone_puts_the_usage_in_every_chunk(base, path, body):
    usages = _usages(base, path, body, {"continuous_usage_stats": True})  # was: no usage in any chunk
    assert all(isinstance(u, dict) for u in usages), usages
    assert usages[-1]["completion_tokens"] == 4 and usages[-1]["total_tokens"] == usages[-1]["prompt_tokens"] + 4


@pytest.mark.parametrize("path, body", ROUTES, ids=["chat", "completions"])
@pytest.mark.parametrize("options, last", [({}, True), ({"include_usage": None}, False),
                                           ({"include_usage": False, "continuous_usage_stats": True}, False),
                                           (None, False)], ids=["empty", "null", "false", "no-options"])
def test_stream_options_include_usage_defaults_to_true_as_vllm(base, path, body, options, last):
    usages = _usages(base, path, body, options)
    if last:
        assert usages[-1]["completion_tokens"] == 4 and all(u is None for u in usages[:-1]), usages
    else:
        assert all(u == "absent" for u in usages), usages


def _streamed_choices(text: str) -> dict:
    """{index: (text, logprobs lists joined, finish_reason)} of a completions stream."""
    out: dict = {}
    for event in _events(text)[:-1]:
        for c in json.loads(event)["choices"]:
            t, lp, reason = out.get(c["index"], ("", None, None))
            if c["logprobs"] is not None:
                lp = lp or {k: [] for k in c["logprobs"]}
                for k in lp:
                    lp[k] += c["logprobs"][k]
            out[c["index"]] = (t + c["text"], lp, c["finish_reason"] or reason)
    return out


@pytest.mark.parametrize("body", [{"prompt": ["hi there", "a b"], "n": 2, "max_tokens": 5, "logprobs": 1},
                                  {"prompt": "hi there", "max_tokens": 0, "logprobs": 1},
                                  {"prompt": [1, 5, 9], "max_tokens": 3}], ids=["n", "max-tokens-0", "token-ids"])
def test_echo_streams_the_prompt_first_as_the_whole_reply_has_it(base, body):
    body = {**body, "echo": True, "temperature": 0}
    whole = httpx.post(base + "/v1/completions", json=body, timeout=60)
    r = httpx.post(base + "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                   timeout=60)
    assert r.status_code == 200, r.text  # was a 400 "echo is only supported in a response that is not streamed"
    streamed = _streamed_choices(r.text)
    for c in whole.json()["choices"]:
        text, lp, reason = streamed[c["index"]]
        assert text == c["text"] and reason == c["finish_reason"]
        if c["logprobs"] is None:
            assert lp is None
            continue
        assert lp["tokens"] == c["logprobs"]["tokens"] and lp["text_offset"] == c["logprobs"]["text_offset"]
        assert lp["token_logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4)
    assert json.loads(_events(r.text)[-2])["usage"] == whole.json()["usage"]


@pytest.mark.parametrize("path, body", ROUTES, ids=["chat", "completions"])
@pytest.mark.parametrize("n", [1, 2])
def test_return_token_ids_streams_each_choices_prompt_token_ids_once(base, path, body, n):
    body = {**body, "max_tokens": 4, "n": n, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(base + path, json=body, timeout=60).json()
    r = httpx.post(base + path, json={**body, "stream": True}, timeout=60)
    prompts: dict = {}
    for event in _events(r.text)[:-1]:
        for c in json.loads(event)["choices"]:
            if "prompt_token_ids" in c:
                prompts.setdefault(c["index"], []).append(c["prompt_token_ids"])
    # was: none in any chunk, where the whole reply (and vLLM's stream) has them
    assert prompts == {c["index"]: [c["prompt_token_ids"]] for c in whole["choices"]}
