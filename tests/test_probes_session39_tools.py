"""Probes of the thirty-ninth session (tools: the chat endpoint's tool calls and reasoning, against vLLM's parsers
and OpenAI's wire format)."""

from __future__ import annotations

import re
import shutil

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.tools import parse_tools, split  # noqa: E402

from helpers import joined_tool_calls, tiny_llama_with_template  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "add 2 and 10"}]
# what Mistral 7B Instruct v0.3's chat template does with a call sent back, and with the tool's reply to it
MISTRAL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }}[/INST]"
    "{% elif message.tool_calls is defined and message.tool_calls is not none %}[TOOL_CALLS] ["
    "{% for tool_call in message.tool_calls %}{% if tool_call.id is not defined or tool_call.id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ tool_call.function|tojson }}{% endfor %}]</s>"
    "{% elif message['role'] == 'tool' %}{% if message.tool_call_id is not defined or "
    "message.tool_call_id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{% endif %}[TOOL_RESULTS] {{ message['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}")


@pytest.mark.parametrize("text", ['Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                                  '{"name": "add", "arguments": {"b": 2}}]',
                                  '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"b": 2}'])
def test_mistral_call_ids_are_nine_letters_and_digits_as_vllms(text):
    """vLLM's mistral parser gives each call a MistralToolCall id, 9 letters and digits, because Mistral's chat
    templates (and mistral_common) refuse any other id in the assistant's tool_calls and the tool's tool_call_id that
    a client sends back; infer gave "chatcmpl-tool-<32 hex>", so the conversation's next turn failed to render."""
    _, calls = split(parse_tools({"tools": TOOLS}, "mistral"), text)
    assert len(calls) == 2 and len({c["id"] for c in calls}) == 2
    assert all(c["id"].isalnum() and len(c["id"]) == 9 and c["type"] == "function" for c in calls)


def test_a_mistral_call_can_be_sent_back_with_the_tools_reply(tmp_path):
    path = tiny_llama_with_template(tmp_path / "tiny-mistral-tools", MISTRAL_TEMPLATE)
    engine = LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=2))
    reply = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 10}}]'
    body = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "tools": TOOLS,
            "guided_regex": re.escape(reply)}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="mistral")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        call = message["tool_calls"][0]
        assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 10}'}
        turn = [*MESSAGES, message, {"role": "tool", "tool_call_id": call["id"], "content": "12"}]
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": turn, "max_tokens": 2, "tools": TOOLS,
                                                             "tool_choice": "none"}, timeout=120)
        assert r.status_code == 200, r.text


# Qwen3's chat template, as far as it concerns an assistant's reasoning: the turns after the last user message
# (a tool loop's) show theirs in a think block
QWEN3_REASONING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% set r = '' %}"
    "{% if message.reasoning_content is defined and message.reasoning_content is not none %}"
    "{% set r = message.reasoning_content %}{% endif %}<think>\n{{ r }}\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_assistants_reasoning_sent_back_reaches_the_template_as_reasoning_content(tmp_path):
    """A reply's reasoning comes back in the message's `reasoning` field (vLLM's name); a client that appends that
    message to the conversation (a tool loop) sends `reasoning`, and vLLM copies it to `reasoning_content`, the
    field chat templates (Qwen3's) read. infer passed `reasoning` alone: the template rendered an empty think block,
    a different prompt from vLLM's."""
    from infer.engine.inputs import chat_messages
    sent = {"role": "assistant", "content": "", "reasoning": "I should add them.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    out = chat_messages([*MESSAGES, sent, {"role": "tool", "tool_call_id": "c1", "content": "12"}])
    assert out[1]["reasoning_content"] == "I should add them." and out[1]["reasoning"] == "I should add them."
    assert "reasoning_content" not in sent and "reasoning_content" not in out[0]
    kept = chat_messages([{"role": "assistant", "content": "x", "reasoning_content": "old field"}])
    assert kept[0]["reasoning_content"] == "old field"

    path = tiny_llama_with_template(tmp_path / "tiny-think", QWEN3_REASONING_TEMPLATE)
    engine = LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=2))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-think", reasoning_parser="qwen3")) as base:
        r = httpx.post(f"{base}/tokenize", json={"messages": [*MESSAGES, sent], "add_generation_prompt": False},
                       timeout=60)
        assert r.status_code == 200, r.text
        prompt = httpx.post(f"{base}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60).json()["prompt"]
        assert "<think>\nI should add them.\n</think>" in prompt


@pytest.mark.parametrize("text", ['<tool_call>{"name": "add", "parameters": {"a": 2, "b": 10}}</tool_call>',
                                  '<tool_call>{"name": "add"}</tool_call>',
                                  'Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
                                  '<tool_call>{"name": "add", "params": {"b": 2}}</tool_call>'])
def test_a_hermes_call_without_arguments_stays_text_as_in_vllm(text):
    """vLLM's hermes parser reads each call's "arguments" (a call without them leaves the reply text, as infer's
    mistral parser does too); infer made the call with arguments "{}", so a model that wrote Llama's "parameters"
    got a call to add() with its arguments silently dropped."""
    req = parse_tools({"tools": TOOLS}, "hermes")
    assert split(req, text) == (text, None)
    content, calls = split(req, '<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert content == "" and calls[0]["function"] == {"name": "add", "arguments": "{}"}


@pytest.fixture(scope="module")
def hermes_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("hermes") / "tiny-tools"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    return LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=2))


def _stream(base: str, body: dict) -> list[dict]:
    import json
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        return [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]


def test_calls_read_whole_before_max_tokens_cut_the_text_after_them_finish_as_tool_calls(hermes_engine):
    """A model that writes its call, then runs on to max_tokens: the call is read (the text after it is dropped, as
    vLLM's hermes parser does), and vLLM's finish_reason is "tool_calls" (it is so whenever the parser made calls);
    infer said "length", which a client that acts on the finish_reason takes for a reply cut short, not a call."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    body = {"messages": MESSAGES, "max_tokens": 100, "temperature": 0, "tools": TOOLS,
            "guided_regex": re.escape(call + " and then" * 40)}
    with serve_in_thread(Server(AsyncEngine(hermes_engine), "tiny-tools", tool_parser="hermes")) as base:
        c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert c["message"]["content"] is None
        assert [x["function"] for x in c["message"]["tool_calls"]] == [{"name": "add", "arguments": '{"a": 1}'}]
        assert c["finish_reason"] == "tool_calls" and c["stop_reason"] is None
        deltas = _stream(base, body)
        assert deltas[-1]["finish_reason"] == "tool_calls"
        assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in c["message"]["tool_calls"]]
        # cut inside the call: text, and "length"
        c = httpx.post(f"{base}/v1/chat/completions", json={**body, "max_tokens": 20}, timeout=120).json()
        c = c["choices"][0]
        assert c["finish_reason"] == "length" and "tool_calls" not in c["message"]


@pytest.mark.parametrize("parser,reply", [
    ("hermes", '<tool_call>{"name": "add", "arguments": {"s": "\\ud800x"}}</tool_call>'),
    ("pythonic", '[add(s="\\ud800x")]'),
])
def test_a_call_whose_arguments_hold_a_lone_surrogate_streams_as_it_answers_whole(hermes_engine, parser, reply):
    """A model that writes a lone surrogate's escape ("\\ud800") in a call's arguments: the parser reads it and writes
    the arguments again, holding the lone surrogate, which UTF-8 cannot encode. The whole response writes it escaped;
    the stream raised UnicodeEncodeError in its last chunk and the connection was cut without [DONE]."""
    import json
    body = {"messages": MESSAGES, "max_tokens": 100, "temperature": 0, "tools": TOOLS,
            "guided_regex": re.escape(reply)}
    with serve_in_thread(Server(AsyncEngine(hermes_engine), "tiny-tools", tool_parser=parser)) as base:
        c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) == {"s": "\ud800x"}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])["choices"][0]
        assert last["finish_reason"] == "tool_calls"
        deltas = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
        assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in c["message"]["tool_calls"]]


def test_thinking_token_budget_is_refused_not_ignored(hermes_engine, tmp_path):
    """vLLM's thinking_token_budget ends a reasoning model's think block after that many tokens; infer does not cap
    it, and answered as if the field had not been sent (a reply thinking far past the budget). It is refused, with
    the field named, as the other parameters infer does not do; null is its default."""
    from infer.engine.inputs import parse_request
    from infer.engine.setup import load_tokenizer
    from infer.errors import RequestError
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with serve_in_thread(Server(AsyncEngine(hermes_engine), "tiny-tools", reasoning_parser="qwen3")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "thinking_token_budget": 10}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
        assert "thinking_token_budget is not supported" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "thinking_token_budget": None}, timeout=60)
        assert r.status_code == 200, r.text
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {**body, "thinking_token_budget": 10}}
    with pytest.raises(RequestError, match="body.thinking_token_budget"):
        parse_request(line, load_tokenizer(ensure_builtin("tiny-llama")), "a")
