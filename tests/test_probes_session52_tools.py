"""Probes of the fifty-second session (tools: tool calling and reasoning on `infer serve` as agent frameworks and vLLM
users set them up)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("flag, words", [
    (["--enable-reasoning"], "--reasoning-parser"),
    (["--tool-parser-plugin", "my_parser.py"], "no parser plugins"),
    (["--reasoning-parser-plugin", "my_parser.py"], "no parser plugins"),
    (["--exclude-tools-when-tool-choice-none"], "without tools"),
    (["--expand-tools-even-if-tool-choice-none"], "renders the tools"),
    (["--tool-server", "demo"], "function tools only"),
], ids=["enable-reasoning", "tool-parser-plugin", "reasoning-parser-plugin", "exclude-tools", "expand-tools",
        "tool-server"])
def test_vllms_tool_and_reasoning_options_say_what_to_do(flag, words):
    """vLLM's tool-calling and reasoning options of `vllm serve` were click's guesses: `--enable-reasoning` (which
    vLLM setups of DeepSeek-R1 and QwQ type beside --reasoning-parser) got "Possible options: --enable-lora,
    --enable-prefix-caching", `--tool-parser-plugin` "Possible options: --tool-call-parser" (a Python file is not a
    parser's name). They now say what infer does instead, as vLLM's other options do."""
    res = runner.invoke(app, ["serve", "tiny-llama", *flag])
    assert res.exit_code == 2
    assert "is vLLM's option" in res.output and words in res.output, res.output
    assert "Possible options" not in res.output


def test_the_plugin_hints_name_every_parser_infer_has():
    from infer.cli.vllm_flags import VLLM_HINTS
    from infer.serve import reasoning, tools
    for name in [*tools.PARSERS, *tools.PARSER_ALIASES]:
        assert name in VLLM_HINTS["--tool-parser-plugin"]
    for name in reasoning.PARSERS:
        assert name in VLLM_HINTS["--reasoning-parser-plugin"] and name in VLLM_HINTS["--enable-reasoning"]


def test_enable_reasoning_typed_to_infer_run_names_runs_own_reasoning_parser():
    res = runner.invoke(app, ["run", "tiny-llama", "in.jsonl", "--enable-reasoning"])
    assert res.exit_code == 2
    assert "infer run splits the reasoning" in res.output and "vllm serve" not in res.output, res.output


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import shutil

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.models.tiny import ensure_builtin
    path = tmp_path_factory.mktemp("tools52") / "tiny-tools"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    return LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=4))


FUNCTION = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


@pytest.mark.parametrize("field, value, instead", [("functions", [FUNCTION], '"tools"'),
                                                    ("function_call", {"name": "add"}, '"tool_choice"')])
def test_openais_deprecated_function_fields_on_chat_name_tools_and_tool_choice(engine, field, value, instead):
    """A client written for OpenAI's deprecated `functions` / `function_call` (the SDK still takes them) got "function
    calls are not supported" from the chat endpoint, which does call functions: through tools and tool_choice. The
    400 now names the field to send instead (a batch line, where no tools are taken, keeps its words)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="hermes")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-tools", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, **{field: value})
    error = e.value.body
    assert error["param"] == field
    assert "deprecated" in error["message"] and instead in error["message"], error


@pytest.mark.parametrize("parser, reply", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": ""}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": "city=Paris"}'),
], ids=["hermes-text", "hermes-empty", "llama3_json-text"])
def test_arguments_a_model_writes_as_text_that_is_not_json_come_back_as_json(parser, reply):
    """A call whose arguments the model wrote as a JSON string that holds no JSON ("Paris") had that text as its
    `arguments`, which is not JSON: a client's json.loads(arguments) (the SDK's parse helpers, every agent loop)
    raised. vLLM writes such a value as JSON ('"Paris"'); arguments given as JSON text still stay that text."""
    import json

    from infer.serve.tools import parse_tools, split
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = parse_tools({"tools": tools}, parser)
    _, (call,) = split(req, reply)
    value = json.loads(call["function"]["arguments"])
    assert isinstance(value, str) and call["function"]["name"] == "get_weather"
    _, (call,) = split(req, reply.replace('"Paris"', '"{\\"city\\": \\"Paris\\"}"').replace(
        '"city=Paris"', '"{\\"city\\": \\"Paris\\"}"'))
    if "Paris" in reply:
        assert call["function"]["arguments"] == '{"city": "Paris"}'


def test_a_pythonic_stream_sends_a_reply_that_starts_with_a_bracket_but_no_call_as_it_comes(engine):
    """With --tool-call-parser pythonic, every reply that started with "[" was held back to its end, though "[1]",
    "[Paris]" or "[ " can never become a list of calls: a markdown answer ("[1] First, ...") streamed nothing and then
    all of it in the last chunk. It now streams once the opening cannot be a call (`[name(` held until it reads)."""
    from infer.serve.tools import parse_tools, split, visible
    req = parse_tools({"tools": [{"type": "function", "function": {"name": "add"}}]}, "pythonic")
    for text in ("[1] First, the", "[Paris] is", "[ add(a=1)]", "[add, then", "[[add(a=1)]]"):
        assert visible(req, text) == text and split(req, text) == (text, None), text
    for text in ("[", "[add", "[add(", "[add(a=1)", "[add(a=1)]"):
        assert visible(req, text) == "", text
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import re

    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    reply = "[1] First, the sum is 3 and that is all."
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="pythonic")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        chunks = [c.choices[0] for c in client.chat.completions.create(
            model="tiny-tools", messages=[{"role": "user", "content": "hi"}], max_tokens=100, temperature=0,
            tools=[{"type": "function", "function": {"name": "add"}}], stream=True,
            extra_body={"guided_regex": re.escape(reply)})]
    texts = [c.delta.content for c in chunks if c.delta.content]
    assert "".join(texts) == reply and len(texts) > 2, texts
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "walk"}}, "required"],
                         ids=["named", "required"])
def test_a_forced_call_of_parameters_whose_root_is_a_ref_is_answered(engine, choice):
    """pydantic's model_json_schema() of a recursive model (what LlamaIndex, pydantic-ai... send as a function's
    parameters) is {"$defs": {...}, "$ref": "#/$defs/Node"}, with no type at its root. infer added "type": "object"
    to parameters without a type, and then refused its own addition: a named or "required" tool_choice was a 400
    "structured_outputs.json uses type at #/type beside $ref, which xgrammar ignores there". vLLM constrains the
    reply with the schema as sent."""
    httpx = pytest.importorskip("httpx")
    pydantic = pytest.importorskip("pydantic")
    pytest.importorskip("fastapi")
    pytest.importorskip("xgrammar")
    from typing import Optional

    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine

    class Node(pydantic.BaseModel):
        v: int = pydantic.Field(ge=0, le=9)
        next: Optional["Node"] = None

    params = Node.model_json_schema()
    assert params.get("$ref") == "#/$defs/Node" and "type" not in params
    tools = [{"type": "function", "function": {"name": "walk", "parameters": params}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 0, "tools": tools,
            "tool_choice": choice}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    for call in message.get("tool_calls") or []:
        Node.model_validate_json(call["function"]["arguments"])
