"""tool_choice "auto" with --tool-call-parser pythonic and mistral, read as vLLM's parsers read them
(pythonic_tool_parser.py and llama4_pythonic_tool_parser.py's extract_tool_calls; mistral_tool_parser.py's, both of
its syntaxes): the calls with their arguments as the JSON text vLLM writes (json.dumps, ensure_ascii=False), the
content before them, and a reply that does not parse, or a call cut short, left as text; a stream holds back what
may start a call; and a server started with each parser reads a call the model writes (forced with a regex), whole
and streamed."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.tools import parse_tools, split, visible  # noqa: E402

from helpers import TOOLS_TEMPLATE, forced_chat_body, joined_tool_calls, tiny_llama_with_template  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]


def _read(parser: str, text: str):
    """(content, [(name, arguments text)]) of `text` as the server's parser reads it, or None (text)."""
    from infer.serve.tools import PARSERS
    parsed = PARSERS[parser](text)
    if parsed is None:
        return None
    content, calls = parsed
    # mistral's ids are 9 letters and digits (what Mistral's templates accept back), as vLLM's
    assert all(c["type"] == "function" and (c["id"].isalnum() and len(c["id"]) == 9 if parser == "mistral" else
                                            c["id"].startswith("chatcmpl-tool-")) for c in calls)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


# ------------------------------------------------------------------------------------------------------- pythonic
@pytest.mark.parametrize("text,want", [
    ('[get_weather(city="Paris", unit="c")]', [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ('[get_weather(city="Paris", unit="c"), add(a=1, b=2)]',
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 1, "b": 2}')]),
    # Llama 4 wraps it in <|python_start|> ... <|python_end|> (vLLM's llama4_pythonic drops them)
    ('<|python_start|>[add(a=1, b=2)]<|python_end|>', [("add", '{"a": 1, "b": 2}')]),
    # literals become JSON: None/True/False, nested lists and dicts, floats, non-ASCII kept, quotes escaped
    ('[f(x=[1, 2.5, {"k": None, "t": True}], y=False, s=\'it\\\'s "q"\', u="Zürich ☀")]',
     [("f", '{"x": [1, 2.5, {"k": null, "t": true}], "y": false, "s": "it\'s \\"q\\"", "u": "Zürich ☀"}')]),
    ('[f(d={1: "one", "two": [None]})]', [("f", '{"d": {"1": "one", "two": [null]}}')]),  # keys as JSON writes them
    ('[now()]', [("now", "{}")]),
    ('[now(), later()]', [("now", "{}"), ("later", "{}")]),
    ('[f(a=1), g(2)]', [("f", '{"a": 1}'), ("g", "{}")]),  # vLLM reads keyword arguments only
    ('[f(a="x)]")]', [("f", '{"a": "x)]"}')]),
    ('[f(a=1, a=2)]', [("f", '{"a": 2}')]),  # Python parses a repeated keyword; the last one stays
    # a signed number is a unary operation in Python's AST, which vLLM leaves text (a call to go back 2 days lost)
    ('[f(a=-1, b=+2.5, c=[-3, {"d": -0.5}])]', [("f", '{"a": -1, "b": 2.5, "c": [-3, {"d": -0.5}]}')]),
    ('[get_weather(city="Paris",\n  unit="c"\n)]', [("get_weather", '{"city": "Paris", "unit": "c"}')]),
])
def test_the_pythonic_parser_reads_what_vllms_reads(text, want):
    assert _read("pythonic", text) == (None, want)


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    "[1, 2, 3]",  # a list, not of calls
    "[]",
    '[get_weather(city="Paris"',  # cut short
    '[get_weather(city="Paris")',
    '[get_weather(city="Pa',
    ' [f(a=1)]',  # vLLM's pattern is matched at the reply's start
    'Sure: [f(a=1)]',  # no content before the list
    '[f(a=1)] and some text',
    '[f(1)]',  # positional arguments only
    '[f(a=1, 2)]',
    '[f(a=-x)]',  # not a literal (an operation)
    '[f(a=x)]',
    '[f(a=g(b=1))]',
    '[f(a=(1, 2))]',
    '[f(a={1, 2})]',
    "[f(a=b'x')]",  # bytes: not JSON
    '[_f(a=1)]',  # a name must start with a letter
    '[m.f(a=1)]',
    '[f() g()]',
    '[get_weather(\n  city="Paris")]',  # vLLM's pattern wants a keyword (or ")") right after "("
    '[f(a=1)',
    '<|python_start|>[f(a=1)',
    '[f(a=' + ', b='.join(["1"] * 40),  # many arguments, cut short: answered at once
])
def test_what_vllms_pythonic_parser_leaves_as_text_stays_text(text):
    assert _read("pythonic", text) is None
    req = parse_tools({"tools": TOOLS}, "pythonic")
    assert split(req, text) == (text, None)


def test_a_pythonic_stream_holds_back_a_reply_that_may_be_calls():
    req = parse_tools({"tools": TOOLS}, "pythonic")
    assert req.mode == "auto" and req.name == "pythonic"
    for text in ("[", "[get_wea", '[get_weather(city="Paris")]', "<|py", "<|python_start|>[add(", ""):
        assert visible(req, text) == "", text
    for text in ("The weather", "Sure [add(a=1)]", "a[0]"):
        assert visible(req, text) == text
    one = parse_tools({"tools": TOOLS, "parallel_tool_calls": False}, "pythonic")
    assert [c["function"]["name"] for c in split(one, "[now(), later()]")[1]] == ["now"]


# -------------------------------------------------------------------------------------------------------- mistral
@pytest.mark.parametrize("text,want", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]',
     (None, [("get_weather", '{"city": "Paris", "unit": "c"}')])),
    ('Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}}, '
     '{"name": "add", "arguments": {"a": 1, "b": [2, null, true], "c": {"d": "say \\"hi\\""}}}]',
     ("Let me check.", [("get_weather", '{"city": "Zürich"}'),
                        ("add", '{"a": 1, "b": [2, null, true], "c": {"d": "say \\"hi\\""}}')])),
    # compact JSON is re-written as json.dumps writes it
    ('[TOOL_CALLS][{"name":"add","arguments":{"a":1,"b":2}}]', (None, [("add", '{"a": 1, "b": 2}')])),
    # arguments given as a JSON string are dumped again, as vLLM does
    ('[TOOL_CALLS][{"name": "add", "arguments": "{\\"a\\": 1}"}]', (None, [("add", '"{\\"a\\": 1}"')])),
    # vLLM's fallback: the first [{...}] when the whole is not JSON
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}] (that is all)', (None, [("add", '{"a": 1}')])),
    ('  [TOOL_CALLS][{"name": "add", "arguments": {}}]', ("  ", [("add", "{}")])),  # content kept as it is
    # the newer syntax: name[ARGS]{...} after each [TOOL_CALLS] (or name{...}, or with a [CALL_ID])
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
     (None, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')])),
    ('Sure.[TOOL_CALLS]get_weather{"city": "Zürich", "unit": null}',
     ("Sure.", [("get_weather", '{"city": "Zürich", "unit": null}')])),
    ('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a":1}', (None, [("add", '{"a": 1}')])),
])
def test_the_mistral_parser_reads_what_vllms_reads(text, want):
    assert _read("mistral", text) == want


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '[{"name": "add", "arguments": {}}]',  # no [TOOL_CALLS]
    '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1',  # cut short
    '[TOOL_CALLS][{"name": "add", "argu',
    "[TOOL_CALLS]",
    "[TOOL_CALLS][{not json}]",
    '[TOOL_CALLS][{"arguments": {}}]',  # no name
    '[TOOL_CALLS][{"name": "add"}]',  # no arguments
    '[TOOL_CALLS]{"name": "add", "arguments": {}}',  # not a list
    '[TOOL_CALLS][{"name": "a", "arguments": {}}][TOOL_CALLS][{"name": "b", "arguments": {}}]',  # one only
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # newer syntax, cut short
    "[TOOL_CALLS]get_weather",
    '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}',
    "[TOOL_CALLS]add[ARGS][1, 2]",
])
def test_what_vllms_mistral_parser_leaves_as_text_stays_text(text):
    assert _read("mistral", text) is None
    assert split(parse_tools({"tools": TOOLS}, "mistral"), text) == (text, None)


def test_a_mistral_stream_holds_back_from_tool_calls():
    req = parse_tools({"tools": TOOLS}, "mistral")
    assert visible(req, "Let me check.[TOOL_CALLS][{") == "Let me check."
    assert visible(req, "Let me check.[TOOL_") == "Let me check." and visible(req, "Sure [") == "Sure "
    assert visible(req, "a [1] b") == "a [1] b" and visible(req, "[TOOL_CALLS]") == ""
    assert visible(req, "<tool_c") == "<tool_c"  # hermes' tag means nothing here
    assert split(req, 'Hi[TOOL_CALLS][{"name": "add", "arguments": {}}]')[0] == "Hi"


def test_the_refusal_and_the_cli_name_the_new_parsers():
    with pytest.raises(RequestError) as e:
        parse_tools({"tools": TOOLS})
    assert "--tool-call-parser hermes | llama3_json | pythonic | mistral" in e.value.hint
    from infer.cli.serve import _tool_parser
    assert _tool_parser(True, "pythonic") == "pythonic" and _tool_parser(True, "mistral") == "mistral"
    from typer.testing import CliRunner
    from infer.cli.main import app
    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "pythonic" in res.output and "mistral" in res.output


# ----------------------------------------------------------------------------------------- end to end, per parser
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_llama_with_template(tmp_path_factory.mktemp("parsers") / "tiny-tools", TOOLS_TEMPLATE))


def _served_reads(model, parser, reply, content, want):
    """A server started with `parser` reads `reply`, forced with a regex as if the model had written it."""
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=4))
    body = forced_chat_body(MESSAGES, reply, 160, tools=TOOLS)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser=parser)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == content
        calls = c["message"]["tool_calls"]
        assert [(x["function"]["name"], x["function"]["arguments"]) for x in calls] == want
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
            deltas = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == (content or "")
        assert deltas[-1]["finish_reason"] == "tool_calls"
        assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in calls]
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=120)
        assert r.json()["choices"][0]["message"]["content"] == reply  # "none": the same reply is text


def test_a_pythonic_server_reads_a_forced_call(model):
    _served_reads(model, "pythonic", '[get_weather(city="Paris", unit="c"), add(a=2, b=10)]', None,
                  [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 2, "b": 10}')])


def test_a_mistral_server_reads_a_forced_call(model):
    _served_reads(model, "mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 10}}]', "Sure.",
                  [("add", '{"a": 2, "b": 10}')])
