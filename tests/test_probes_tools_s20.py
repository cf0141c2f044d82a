"""Probes of tool calls on the chat endpoint (session 20): parallel_tool_calls false with tool_choice "auto" gives at
most one call (as vLLM's maybe_filter_parallel_tool_calls and OpenAI do; before, every call the model wrote came
back); a `tools` that is not a list is a 400 naming tools (before, {} / 0 / false read as "no tools"); and
tool_choice "required" compiles parameters that use $defs/$ref, as pydantic writes them (before, a 400: the $ref
pointed at the root of the array schema, where there were no $defs); a function whose parameters schema says no
type (`{}`) is still called with an object (before, a forced call's arguments could be `9819...` or `true`)."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.tools import parse_tools, split  # noqa: E402

from helpers import joined_tool_calls, tiny_llama_with_template  # noqa: E402

TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
            "{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "weather in Paris and Rome?"}]
TWO = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
       '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
LLAMA_TWO = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_weather", "parameters": {"city": "Rome"}}')


def _cities(calls):
    return [json.loads(c["function"]["arguments"])["city"] for c in calls]


@pytest.mark.parametrize("parser,text", [("hermes", TWO), ("llama3_json", LLAMA_TWO)])
def test_auto_keeps_only_the_first_call_without_parallel_calls(parser, text):
    """OpenAI's parallel_tool_calls: false means at most one call; "required" puts it in its schema (maxItems), and
    "auto", whose calls the model writes freely, drops those after the first, as vLLM does."""
    assert _cities(split(parse_tools({"tools": TOOLS}, parser), text)[1]) == ["Paris", "Rome"]
    assert _cities(split(parse_tools({"tools": TOOLS, "parallel_tool_calls": True}, parser), text)[1]) == [
        "Paris", "Rome"]
    one = parse_tools({"tools": TOOLS, "parallel_tool_calls": False}, parser)
    assert _cities(split(one, text)[1]) == ["Paris"]


@pytest.mark.parametrize("tools", [{}, 0, False, "get_weather"])
def test_tools_that_are_not_a_list_are_refused_naming_tools(tools):
    """A malformed `tools` must not read as "no tools" (the request then silently runs without them, or its
    tool_choice is blamed)."""
    for choice in (None, "required"):
        body = {"tools": tools} if choice is None else {"tools": tools, "tool_choice": choice}
        with pytest.raises(RequestError, match="tools must be a non-empty list") as e:
            parse_tools(body, "hermes")
        assert e.value.field == "tools"
    assert parse_tools({"tools": []}) is None and parse_tools({"tools": None}) is None  # absent, as vLLM


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny_llama_with_template(tmp_path_factory.mktemp("tools20") / "tiny-tools", TEMPLATE)
    engine = LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=4))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="hermes")) as base:
        yield base


def _body(**extra):
    return {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, "temperature": 0,
            "guided_regex": re.escape(TWO), **extra}


def test_the_server_sends_one_call_with_parallel_tool_calls_false(served):
    url = f"{served}/v1/chat/completions"
    c = httpx.post(url, json=_body(), timeout=120).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and _cities(c["message"]["tool_calls"]) == ["Paris", "Rome"]
    c = httpx.post(url, json=_body(parallel_tool_calls=False), timeout=120).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and _cities(c["message"]["tool_calls"]) == ["Paris"]
    with httpx.stream("POST", url, json=_body(parallel_tool_calls=False, stream=True), timeout=120) as s:
        deltas = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
    assert {x["index"] for d in deltas for x in d["delta"].get("tool_calls") or []} == {0}
    assert _cities(joined_tool_calls(deltas)) == ["Paris"]
    r = httpx.post(url, json=_body(tools={}), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert httpx.post(url, json=_body(), timeout=120).status_code == 200  # the server still answers


# what pydantic writes for a model with an Enum field (openai.pydantic_function_tool)
UNIT = {"enum": ["c", "f"], "title": "Unit", "type": "string"}
PYDANTIC = {"$defs": {"Unit": UNIT}, "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
            "title": "W", "type": "object", "additionalProperties": False}
DEFS_TOOLS = [{"type": "function", "function": {"name": "w", "parameters": PYDANTIC}}]


def test_required_lifts_the_parameters_defs_to_the_root():
    """A $ref is resolved from the root of the schema that is compiled: for "required" that is the array of calls,
    so each function's $defs go there; the tools the template renders keep theirs."""
    tools = json.loads(json.dumps(DEFS_TOOLS))
    req = parse_tools({"tools": tools, "tool_choice": "required"})
    assert req.schema["$defs"] == {"Unit": UNIT}
    assert "$defs" not in req.schema["items"]["properties"]["parameters"]
    assert tools == DEFS_TOOLS and req.tools[0]["function"]["parameters"]["$defs"] == {"Unit": UNIT}
    other = {"type": "function", "function": {"name": "v", "parameters": {
        "$defs": {"Unit": {"enum": ["k"]}}, "properties": {"u": {"$ref": "#/$defs/Unit"}}, "type": "object"}}}
    with pytest.raises(RequestError, match="define \\$defs/Unit differently") as e:
        parse_tools({"tools": DEFS_TOOLS + [other], "tool_choice": "required"})
    assert e.value.field == "tools"
    same = {"type": "function", "function": {"name": "v", "parameters": PYDANTIC}}
    assert parse_tools({"tools": DEFS_TOOLS + [same], "tool_choice": "required"}).schema["$defs"] == {"Unit": UNIT}


def test_the_server_answers_required_with_pydantic_parameters(served):
    body = {"messages": MESSAGES, "tools": DEFS_TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 60, "temperature": 0}
    r = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    (call,) = c["message"]["tool_calls"]
    assert c["finish_reason"] == "tool_calls" and call["function"]["name"] == "w"
    assert json.loads(call["function"]["arguments"])["unit"] in ("c", "f")


def test_parameters_without_a_type_are_an_object():
    """OpenAI's arguments are a JSON object; `"parameters": {}` constrained as is lets the reply be any JSON value."""
    tools = [{"type": "function", "function": {"name": "now", "parameters": {}}}]
    named = parse_tools({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert named.schema == {"type": "object"} and tools[0]["function"]["parameters"] == {}
    required = parse_tools({"tools": tools, "tool_choice": "required"})
    assert required.schema["items"]["properties"]["parameters"] == {"type": "object"}
    # a type given that is no object is refused for a forced call (its arguments would be no object), named
    with pytest.raises(RequestError, match=r"tools\[0\]\.function\.parameters has type \"string\""):
        parse_tools({"tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}],
                     "tool_choice": "required"})


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "now"}}, "required"])
def test_the_server_starts_a_forced_call_of_untyped_parameters_with_an_object(served, choice):
    tools = [{"type": "function", "function": {"name": "now", "parameters": {}}}]
    body = {"messages": MESSAGES, "tools": tools, "tool_choice": choice, "max_tokens": 40, "temperature": 0}
    c = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    calls = c["message"].get("tool_calls")  # a random model may not close the object before max_tokens
    text = json.dumps([{"parameters": json.loads(calls[0]["function"]["arguments"])}]) if calls else \
        c["message"]["content"]
    if choice != "required" and not calls:
        text = '[{"parameters": ' + text
    assert re.match(r'\[\{.*"parameters":\s*\{', text), text
