"""Probes of `infer serve`, session 38: a context-length 400 named max_tokens when the client had sent
max_completion_tokens (the field chat clients send now); vLLM's logits_processors and prompt_embeds, which vLLM
refuses unless started with an option infer lacks, were silently dropped (a 200 whose reply ignored them); a --host
that is no address of the machine was answered "pick another --port"; a forced tool call (named or "required")
whose string argument has a length bound came back as text when the model wrote a tab or another control character
in it (xgrammar allows them there, strict JSON does not)."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from helpers import joined_tool_calls  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=256, block_size=4, max_num_seqs=4))


@pytest.fixture(scope="module")
def base(engine):
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=64), "tiny")) as url:
        yield url


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "hi"}),
])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_reply_longer_than_the_context_names_the_length_field_sent(base, path, body, field):
    r = httpx.post(f"{base}{path}", json={**body, field: 1000}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == field
    assert f"{field} asks for 1000 more" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "hi"}),
])
@pytest.mark.parametrize("field, value", [
    ("logits_processors", ["my_module.MyProcessor"]),
    ("logits_processors", [{"qualname": "my_module.MyProcessor", "args": [1]}]),
    ("prompt_embeds", "AAAA"),
])
def test_vllm_extensions_vllm_refuses_by_default_are_400_not_dropped(base, path, body, field, value):
    r = httpx.post(f"{base}{path}", json={**body, field: value, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text  # was a 200 whose reply had ignored them
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("field, value", [("logits_processors", []), ("logits_processors", None),
                                          ("prompt_embeds", None)])
def test_their_empty_values_are_accepted(base, field, value):
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", field: value, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["192.0.2.1"])  # TEST-NET-1: an address of no interface here
def test_a_host_that_cannot_be_bound_is_blamed_not_the_port(host):
    from infer.cli.serve import _bind
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match=f"cannot listen on {host}:0") as e:
        _bind(host, 0)
    assert "--host" in e.value.hint and "--port" not in e.value.hint  # was "pick another --port"


LENGTH_BOUND = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"]}}}]
CONTROL_TOKENS = {"194": 100, "200": 100}  # tiny-llama's U+0003 and tab: the reply's string is made of them


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "f"}}, "required"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_whose_string_holds_control_characters_is_still_a_call(base, engine, choice, stream):
    assert engine.tokenizer.decode([194]) == "\x03" and engine.tokenizer.decode([200]) == "\t"
    # xgrammar lets a string with maxLength hold raw control characters, which strict JSON refuses: the call came
    # back as content (finish_reason stop, no tool_calls)
    body = {"messages": MESSAGES, "max_tokens": 100, "tools": LENGTH_BOUND, "tool_choice": choice,
            "parallel_tool_calls": False, "temperature": 0, "logit_bias": CONTROL_TOKENS, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]  # the call in pieces, then the finish alone
        calls, reason = joined_tool_calls(deltas), deltas[-1]["finish_reason"]
    else:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        only = r.json()["choices"][0]
        calls, reason = only["message"].get("tool_calls"), only["finish_reason"]
        assert only["message"]["content"] is None
    assert reason == "tool_calls" and calls and len(calls) == 1
    arguments = json.loads(calls[0]["function"]["arguments"])  # strict: what a client's reader takes
    # since session 38 (struct) the grammar keeps raw control characters out of such a string (the bias cannot
    # force them in): the call is whatever else the model writes, still one strict-JSON call
    assert arguments["city"] and not any(ch < " " for ch in arguments["city"])


@pytest.mark.parametrize("mode", ["named", "required"])
def test_the_constrained_reply_reader_takes_raw_control_characters_and_escapes_them(mode):
    from infer.serve.tools import ToolRequest, split
    req = ToolRequest(LENGTH_BOUND, mode, name="f" if mode == "named" else None, schema={})
    text = '{"city": "a\tb\x03"}' if mode == "named" else '[{"name": "f", "parameters": {"city": "a\tb\x03"}}]'
    content, calls = split(req, text)
    assert content == "" and len(calls) == 1
    assert calls[0]["function"]["arguments"] == '{"city": "a\\tb\\u0003"}'
    assert split(req, '{"city": "ab"}' if mode == "named" else '[{"name": "f", "parameters": {"city": "ab"}}]'
                 )[1][0]["function"]["arguments"] == '{"city": "ab"}'  # valid JSON as the model wrote it
