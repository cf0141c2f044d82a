"""Probes of the twenty-first session's serve features (tool-call parsers, reasoning, chat templates): a reply or a
request template nested deeper than Python's recursive readers go was a 500 (or a stream cut without [DONE]); the
hermes parser dropped the blanks before a call from the whole message while a stream had already sent them."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import load_chat_template  # noqa: E402
from infer.engine.inputs import reads_content_parts  # noqa: E402
from infer.errors import ConfigError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.tools import PARSERS, ToolRequest, hermes_calls, split, tool_calls  # noqa: E402

from helpers import tiny_chat_engine  # noqa: E402

DEEP = "[" * 5000  # deeper than json.loads / ast.parse recurse (Python's default recursion limit is 1000)
PREFIX = {"hermes": "<tool_call>", "llama3_json": '{"name": "f", "parameters": ', "mistral": "[TOOL_CALLS]",
          "pythonic": "[f(a=", "qwen3_coder": "<tool_call><function=", "seed_oss": "<seed:tool_call><function=",
          "openai": "", "granite": "<|tool_call|>", "glm45": "<tool_call>f\n<arg_key>a</arg_key><arg_value>",
          "olmo3": "<function_calls>f(a=", "ernie45": "<tool_call>", "phi4_mini_json": "functools[",
          "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n",
          "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>",
          "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>",
          "internlm": '<|action_start|><|plugin|>{"name": "f", "parameters": ', "xlam": '[{"name": "f", "arguments": ',
          "hunyuan_a13b": '<tool_calls>[{"name": "f", "arguments": ',
          "minimax_m2": '<minimax:tool_call><invoke name="f"><parameter name="a">'}
# (openai: a reply without harmony's markers is content; its deep calls: session61_tools)
DEEP_TEMPLATE = "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}"


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_a_reply_nested_too_deep_for_the_parser_stays_text(parser):
    """vLLM's parsers catch any error of a reply they cannot read: the reply is text, not a RecursionError."""
    text = PREFIX[parser] + DEEP
    req = ToolRequest([], "auto", name=parser)
    assert split(req, text) == (text, None)


@pytest.mark.parametrize("mode", ["named", "required"])
def test_a_constrained_call_nested_too_deep_stays_text(mode):
    req = ToolRequest([], mode, name="f" if mode == "named" else None, schema={})
    assert tool_calls(req, DEEP) is None
    assert split(req, DEEP) == (DEEP, None)


def test_a_template_nested_too_deep_for_jinja_is_a_config_error_not_a_crash():
    assert reads_content_parts(None, DEEP_TEMPLATE) is False  # rendering reports it (a 400 per request)
    with pytest.raises(ConfigError) as e:
        load_chat_template(DEEP_TEMPLATE)
    assert "not a valid Jinja template" in str(e.value)


def test_hermes_keeps_the_blanks_before_a_call_as_vllm_does():
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert hermes_calls("\n\n" + call)[0] == "\n\n"  # vLLM: model_output[:find(<tool_call>)] or None
    assert hermes_calls(call)[0] is None


# ------------------------------------------------------------------------------------------- end to end
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_chat_engine(tmp_path_factory, "probes_s21")  # (ChatML)


def _body(reply: str, **extra) -> dict:
    return {"messages": MESSAGES, "max_tokens": 1500, "temperature": 0, "guided_regex": re.escape(reply),
            "tools": TOOLS, **extra}


def _stream(base: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as s:
        return [line[6:] for line in s.iter_lines() if line.startswith("data: ")]


def test_a_server_answers_a_deep_reply_and_a_deep_template_without_a_500(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser="hermes",
                                trust_request_chat_template=True)) as base:
        reply = "<tool_call>" + "[" * 1100  # a model that repeats "[" until max_tokens
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(reply), timeout=300)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["message"]["content"] == reply and "tool_calls" not in c["message"]
        lines = _stream(base, _body(reply))
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]) == reply
        # blanks before a call: the stream and the whole message agree (vLLM's content, "\n\n")
        call = '\n\n<tool_call>{"name": "add", "arguments": {}}</tool_call>'
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(call), timeout=300)
        message = r.json()["choices"][0]["message"]
        deltas = [json.loads(x)["choices"][0]["delta"] for x in _stream(base, _body(call))[:-1]]
        assert message["content"] == "".join(d.get("content") or "" for d in deltas) == "\n\n"
        assert message["tool_calls"][0]["function"]["name"] == "add"
        # a request's own template nested deeper than Jinja parses: the template's fault, a 400
        for route, body in [("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
                            ("/tokenize", {"messages": MESSAGES})]:
            r = httpx.post(f"{base}{route}", json={**body, "chat_template": DEEP_TEMPLATE}, timeout=60)
            assert r.status_code == 400, (route, r.text)
            assert "chat template" in r.json()["error"]["message"]
