"""Probes of the forty-fourth session (tools: tool calls on `infer serve`'s chat endpoint, streamed and whole, as
the official OpenAI SDK reads them and as vLLM answers them)."""

from __future__ import annotations

import re
import shutil

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from helpers import tiny_llama_with_template  # noqa: E402

MESSAGES = [{"role": "user", "content": "add 1 and 2"}]


class Add(pydantic.BaseModel):
    a: int
    b: int


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools44") / "tiny-tools"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    return LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=4))


def test_the_sdks_stream_helper_ends_each_streamed_call_and_parses_its_arguments(engine):
    """openai-python's `chat.completions.stream` (the helper its docs show for tools) emits
    `tool_calls.function.arguments.done`, with the parsed arguments of a strict (pydantic) tool, for a call it saw in
    a chunk before the choice's finish. infer sent the calls and finish_reason "tool_calls" in one chunk, so the
    helper never ended the last call: a client waiting for that event got none, though the final completion had it.
    OpenAI streams the finish alone, with an empty delta."""
    tool = openai.pydantic_function_tool(Add, name="add")
    reply = ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="hermes")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        kw = dict(model="tiny-tools", messages=MESSAGES, max_tokens=200, temperature=0, tools=[tool],
                  extra_body={"guided_regex": re.escape(reply)})
        whole = client.chat.completions.parse(**kw).choices[0]
        with client.chat.completions.stream(**kw) as stream:
            done = [(e.index, e.name, e.parsed_arguments) for e in stream
                    if e.type == "tool_calls.function.arguments.done"]
            final = stream.get_final_completion().choices[0]
    assert done == [(0, "add", Add(a=1, b=2)), (1, "add", Add(a=3, b=4))]
    assert whole.finish_reason == final.finish_reason == "tool_calls"
    assert whole.message.content == final.message.content == "Sure. "
    assert [c.function.parsed_arguments for c in final.message.tool_calls] == [
        c.function.parsed_arguments for c in whole.message.tool_calls]


ADD_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}}}]


@pytest.mark.parametrize("choice,reply", [({"type": "function", "function": {"name": "add"}}, '{"a": 1}'),
                                          ("required", '[{"name": "add", "parameters": {"a": 1}}]')],
                         ids=["named", "required"])
def test_a_forced_call_on_a_mistral_server_has_a_mistral_call_id(choice, reply):
    """With --tool-call-parser mistral, "auto"'s calls have 9-letter-and-digit ids, which Mistral's chat templates
    demand of a call sent back; a forced call (a named tool_choice, "required") had a chatcmpl-tool-... id, so the
    conversation's next turn was a 400 (the template's "Tool call IDs should be alphanumeric strings with length
    9!"). vLLM gives forced calls Mistral's ids too on a Mistral model."""
    from infer.serve.tools import parse_tools, tool_calls
    (call,) = tool_calls(parse_tools({"tools": ADD_TOOLS, "tool_choice": choice}, "mistral"), reply)
    assert call["id"].isalnum() and len(call["id"]) == 9
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    (call,) = tool_calls(parse_tools({"tools": ADD_TOOLS, "tool_choice": choice}, "hermes"), reply)
    assert call["id"].startswith("chatcmpl-tool-")


def test_a_named_call_on_a_mistral_server_can_be_sent_back_with_the_tools_reply(tmp_path):
    from test_probes_session39_tools import MISTRAL_TEMPLATE
    path = tiny_llama_with_template(tmp_path / "tiny-mistral-tools", MISTRAL_TEMPLATE)
    engine = LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=2))
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "tools": ADD_TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "add"}}}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="mistral")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        turn = [*MESSAGES, message, {"role": "tool", "tool_call_id": call["id"], "content": "3"}]
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": turn, "max_tokens": 2, "tools": ADD_TOOLS,
                                                             "tool_choice": "none"}, timeout=120)
        assert r.status_code == 200, r.text


# what Hermes 2 Pro's tool_use template does with each tool's parameters (NousResearch's, also vLLM's
# examples/tool_chat_template_hermes.jinja)
PARAMETERS_TEMPLATE = (
    "{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters | tojson }}\n{% endfor %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_a_function_sent_without_parameters_reaches_the_template_with_null_parameters(tmp_path, choice):
    """OpenAI lets a function leave `parameters` out (it takes none). vLLM hands the template its tools as its
    FunctionDefinition model dumps them, `parameters: null` included; infer handed them as sent, so a template that
    reads each tool's parameters (`| tojson`) failed on the missing key: the request was a 400 "the chat template
    cannot render these messages: Object of type Undefined is not JSON serializable"."""
    path = tiny_llama_with_template(tmp_path / "tiny-tools", PARAMETERS_TEMPLATE)
    engine = LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=2))
    tools = [{"type": "function", "function": {"name": "now"}}]
    body = {"messages": MESSAGES, "max_tokens": 20, "temperature": 0, "tools": tools, "tool_choice": choice,
            "return_token_ids": True}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="hermes")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["prompt_token_ids"]
        assert engine.tokenizer.decode(ids).startswith("now: null\n")
        r = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, "tools": tools}, timeout=120)
        assert r.status_code == 200 and r.json()["tokens"] == ids



@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "add"}}, "required"],
                         ids=["named", "required"])
def test_the_sdks_stream_helper_ends_a_forced_call_sent_at_the_finish(engine, choice):
    """A forced call (named, "required") streams whole at the reply's end: its chunk must come before the finish's
    own chunk (empty delta), or the SDK's stream helper never emits the call's arguments.done."""
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="hermes")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        kw = dict(model="tiny-tools", messages=MESSAGES, max_tokens=40, temperature=0, tools=ADD_TOOLS,
                  tool_choice=choice)
        whole = client.chat.completions.create(**kw).choices[0]
        with client.chat.completions.stream(**kw) as stream:
            done = [(e.index, e.name, e.arguments) for e in stream if e.type == "tool_calls.function.arguments.done"]
    assert whole.message.tool_calls, whole
    assert done == [(k, c.function.name, c.function.arguments) for k, c in enumerate(whole.message.tool_calls)]
