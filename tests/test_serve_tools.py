"""Tool calls on `infer serve`'s chat endpoint, as vLLM answers them without a model-specific parser: the tools reach
the chat template exactly as transformers' `apply_chat_template(tools=...)` renders them; a named tool_choice and
"required" constrain the reply to a call (the same tokens as the Python API with that JSON schema as structured
outputs on the same prompt ids), which comes back as OpenAI's tool_calls, whole or streamed, through the openai
client too; "auto" (the default with tools) reads the calls a model writes in the hermes syntax with
--tool-call-parser hermes (vLLM's parser's rules), and is refused with what to send instead without a parser; every
malformed field is a 400 naming it."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from transformers import AutoTokenizer  # noqa: E402

from infer import LLM, SamplingParams, StructuredOutputsParams as S  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.tools import parse_tools  # noqa: E402

from helpers import TOOLS_TEMPLATE, joined_tool_calls, tiny_llama_with_template  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
# small enums: a random model would write digits up to max_tokens in a free integer
ADD = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [10, 20]}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_llama_with_template(tmp_path_factory.mktemp("tools") / "tiny-tools", TOOLS_TEMPLATE))


@pytest.fixture(scope="module")
def served(model):
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=8))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools")) as base:
        yield base


@pytest.fixture(scope="module")
def direct(model):
    with LLM(model, block_size=4, max_num_seqs=8) as llm:
        yield llm


def _chat(base, **extra):
    body = {"messages": MESSAGES, "max_tokens": 48, "temperature": 0, "tools": TOOLS, "return_token_ids": True,
            **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def _prompt(model) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model)
    return list(tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


def test_the_tools_reach_the_template_as_transformers_renders_them(served, model):
    r = _chat(served, tool_choice="none")
    assert r.status_code == 200, r.text
    ids = _prompt(model)
    assert r.json()["choices"][0]["prompt_token_ids"] == ids
    plain = httpx.post(f"{served}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
    assert plain.json()["usage"]["prompt_tokens"] < len(ids)  # the tools' system turn is in it
    assert "tool_calls" not in r.json()["choices"][0]["message"]


# "required" with parallel calls allowed: a random model never closes the list (each call is followed by another)
@pytest.mark.parametrize("choice,extra", [(NAMED, {}), ("required", {"parallel_tool_calls": False})])
def test_a_forced_call_is_the_constrained_reply_as_tool_calls(served, direct, model, choice, extra):
    r = _chat(served, tool_choice=choice, **extra)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    tool = parse_tools({"tools": TOOLS, "tool_choice": choice, **extra})
    want = direct.generate(_prompt(model), SamplingParams(max_new_tokens=48, structured_outputs=S(
        json=tool.schema, disable_any_whitespace=True)))[0]
    assert c["token_ids"] == want.token_ids and want.finish_reason == "stop"
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    calls = c["message"]["tool_calls"]
    if choice == NAMED:
        assert [x["function"]["name"] for x in calls] == ["get_weather"]
        assert calls[0]["function"]["arguments"] == want.text
    else:
        assert [{"name": x["function"]["name"], "parameters": json.loads(x["function"]["arguments"])}
                for x in calls] == json.loads(want.text)
    for x in calls:
        args = json.loads(x["function"]["arguments"])
        assert x["type"] == "function" and x["id"].startswith("chatcmpl-tool-")
        if x["function"]["name"] == "get_weather":
            assert args["city"] in ("Paris", "Rome", "Oslo") and args["unit"] in ("c", "f") and len(args) == 2
        else:
            assert args["a"] in (1, 2, 3) and args["b"] in (10, 20)


def test_streamed_forced_call_comes_in_pieces_then_the_finish_alone(served):
    whole = _chat(served, tool_choice=NAMED).json()["choices"][0]
    with httpx.stream("POST", f"{served}/v1/chat/completions",
                      json={"messages": MESSAGES, "max_tokens": 48, "temperature": 0, "tools": TOOLS,
                            "tool_choice": NAMED, "stream": True}, timeout=120) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not "".join(d["delta"].get("content") or "" for d in deltas)  # no JSON text before the call
    last = deltas[-1]  # the finish alone, after the calls (as OpenAI streams them)
    assert last["finish_reason"] == "tool_calls" and last["delta"] == {}
    pieces = [d for d in deltas if d["delta"].get("tool_calls")]  # its name first, then its arguments as they come
    assert len(pieces) > 1 and pieces[0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    (call,) = joined_tool_calls(deltas)
    assert call["function"] == whole["message"]["tool_calls"][0]["function"]


def test_a_call_cut_short_by_max_tokens_stays_text(served):
    c = _chat(served, tool_choice=NAMED, max_tokens=3).json()["choices"][0]
    assert c["finish_reason"] == "length" and "tool_calls" not in c["message"]
    assert c["message"]["content"].startswith("{")


def test_parallel_tool_calls_false_gives_one_call_and_the_openai_client_reads_them(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x")
    for choice, parallel in ((NAMED, None), ("required", False)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        reply = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               max_tokens=64, temperature=0, **extra)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        assert calls[0].function.name in ("get_weather", "add") and json.loads(calls[0].function.arguments)
    one = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert one.schema["maxItems"] == 1
    assert "maxItems" not in parse_tools({"tools": TOOLS, "tool_choice": "required"}).schema


@pytest.mark.parametrize("extra,param,message", [
    ({"tool_choice": "auto"}, "tool_choice", "needs a parser of the model's own tool-call syntax"),
    ({}, "tool_choice", "tool_choice 'auto' (the default with tools)"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names 'nope', which is not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "tools",
     "tools[0].function.name must be a non-empty string"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "a second function named 'get_weather'"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools", "does not compile"),
    ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format", "constrains the reply"),
    ({"tool_choice": NAMED, "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "the request has no tools"),
])
def test_bad_tool_fields_are_400_naming_them(served, extra, param, message):
    r = _chat(served, **extra)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["param"] == param


def test_completions_still_refuse_tools(served):
    """(OpenAI batch lines in `infer run` refuse them too: tests/test_probes_session5.py.)"""
    r = httpx.post(f"{served}/v1/completions", json={"prompt": "hi", "tools": TOOLS, "tool_choice": "required"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_llm_chat_renders_the_tools_as_the_server_does(served, direct, model):
    """vLLM's LLM.chat(tools=...): the same prompt as the server's and transformers' apply_chat_template(tools=)."""
    out = direct.chat(MESSAGES, SamplingParams(max_new_tokens=2), tools=TOOLS)[0]
    assert out.prompt_token_ids == _prompt(model)
    assert direct.chat(MESSAGES, SamplingParams(max_new_tokens=2))[0].prompt_token_ids != _prompt(model)
    from infer.errors import RequestError
    with pytest.raises(RequestError, match="tools must be a list of function definitions"):
        direct.chat(MESSAGES, tools="get_weather")


# ------------------------------------------------------------------ tool_choice "auto" with --tool-call-parser hermes
from infer.serve.tools import hermes_calls, visible  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def test_the_hermes_parser_reads_what_vllms_reads():
    """vLLM's hermes parser: every <tool_call>...</tool_call> (the last may be unterminated), arguments re-written as
    JSON text, the content before the first call (None if blank); any call that is not JSON with a name leaves the
    whole reply as text."""
    content, calls = hermes_calls("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    assert content == "Let me look.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_weather", {"city": "Rome", "unit": "c"})]
    assert len({c["id"] for c in calls}) == 2
    content, calls = hermes_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}')  # cut before its end tag
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert hermes_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')[1][0]["function"][
        "arguments"] == '{"a": 1}'  # arguments given as text stay that text
    for text in ("no call here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 "<tool_call>[1, 2]</tool_call>"):
        assert hermes_calls(text) is None


def test_a_stream_holds_back_what_may_start_a_call():
    req = parse_tools({"tools": TOOLS}, "hermes")
    assert req.mode == "auto"
    assert visible(req, "Sure, <tool_c") == "Sure, " and visible(req, "Sure, <tool_call>{") == "Sure, "
    assert visible(req, "Sure <") == "Sure " and visible(req, "a < b") == "a < b"
    assert visible(None, "Sure, <tool_c") == "Sure, <tool_c"


@pytest.fixture(scope="module")
def served_auto(model):
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=8))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="hermes")) as base:
        yield base


# the reply forced with a regex, as if the model had written a call in its own syntax
FORCED = r'Sure\.' + re.escape(CALL).replace("Paris", "(Paris|Rome)")


def test_auto_reads_the_calls_the_model_writes(served_auto):
    r = _chat(served_auto, guided_regex=FORCED, max_tokens=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Sure."
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) in ({"city": "Paris", "unit": "c"}, {"city": "Rome", "unit": "c"})
    with httpx.stream("POST", f"{served_auto}/v1/chat/completions",
                      json={"messages": MESSAGES, "max_tokens": 120, "temperature": 0, "tools": TOOLS,
                            "guided_regex": FORCED, "stream": True}, timeout=120) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Sure."  # no tag text streamed as content
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert joined_tool_calls(deltas)[0]["function"] == call["function"]


def test_auto_without_a_call_is_text_and_none_renders_only(served_auto):
    r = _chat(served_auto, max_tokens=8)  # tool_choice left out: auto
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and "tool_calls" not in c["message"] and c["message"]["content"]
    r = _chat(served_auto, tool_choice="none", guided_regex=FORCED, max_tokens=120)
    assert "tool_calls" not in r.json()["choices"][0]["message"]  # "none": the text is the reply


def test_the_parser_options_only_work_together():
    from typer.testing import CliRunner
    from infer.cli.main import app
    from infer.cli.serve import _tool_parser
    from infer.errors import ConfigError
    assert _tool_parser(True, "hermes") == "hermes" and _tool_parser(False, None) is None
    for enable, parser, message in ((True, None, "needs --tool-call-parser"), (True, "jamba", "not available"),
                                    (False, "hermes", "needs --enable-auto-tool-choice")):
        with pytest.raises(ConfigError, match=message):
            _tool_parser(enable, parser)
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--enable-auto-tool-choice"])
    assert res.exit_code != 0 and "needs --tool-call-parser" in res.output


def test_the_llama3_json_parser_reads_what_vllms_reads():
    """vLLM's llama3_json parser: a reply that starts with <|python_tag|> or "{" is JSON objects with a name and
    parameters (or arguments) separated by ";", all of it calls (no content); anything else is text."""
    from infer.serve.tools import llama3_calls
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    content, calls = llama3_calls(one)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    content, calls = llama3_calls('<|python_tag|>' + one + '; {"name": "add", "arguments": {"a": 1, "b": 10}}')
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 10}
    for text in ("Paris is sunny. " + one, '{"name": "add"}', "{not json}", one + " and then some text", "[1]", ""):
        assert llama3_calls(text) is None, text
    req = parse_tools({"tools": TOOLS}, "llama3_json")
    assert visible(req, '{"na') == "" and visible(req, "<|pyth") == "" and visible(req, "Paris is") == "Paris is"


def test_a_llama3_json_server_reads_a_forced_call(model):
    forced = re.escape('{"name": "add", "parameters": {"a": 2, "b": 10}}')
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=4))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="llama3_json")) as base:
        c = _chat(base, guided_regex=forced, max_tokens=120).json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in c["message"]["tool_calls"]] \
            == [("add", {"a": 2, "b": 10})]
        with httpx.stream("POST", f"{base}/v1/chat/completions",
                          json={"messages": MESSAGES, "max_tokens": 120, "temperature": 0, "tools": TOOLS,
                                "guided_regex": forced, "stream": True}, timeout=120) as s:
            deltas = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
        assert not "".join(d["delta"].get("content") or "" for d in deltas)
        assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in c["message"]["tool_calls"]]
