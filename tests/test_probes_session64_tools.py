"""Session 64 (p64tools): the tool-call parsers vLLM has for families infer runs that infer lacked (granite,
glm45, olmo3, ernie45, phi4_mini_json; vLLM's granite4 and glm47 names), whole and streamed (the same calls and
content at every cut, each ended call read once), a reply that is no call left text with the whole reply's finish,
the names taken by --tool-call-parser, each served end to end on a tiny model with a forced reply; and the granite
and ernie45 reasoning markers as vLLM reads them."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.cli.serve import _tool_parser  # noqa: E402
from infer.errors import ConfigError, RequestError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.reasoning import ReasoningRequest, parts  # noqa: E402
from infer.serve.reasoning import split as reasoning_split  # noqa: E402
from infer.serve.tools import parse_tools, split, visible  # noqa: E402
from infer.serve.toolstream import CallStream, partial_calls  # noqa: E402

from helpers import (check_stream_adds_up, forced_chat_body, joined_deltas, joined_tool_calls,  # noqa: E402
                     streamed_chat_choices, tiny_chat_engine)
from test_probes_session62_stream import MESSAGES, TOOLS  # noqa: E402
from test_probes_session63_tstream import _joined, _streamed  # noqa: E402

GLM = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>007 \u00e9</arg_value>\n<arg_key>days</arg_key>\n"
       "<arg_value>3</arg_value>\n<arg_key>o</arg_key>\n<arg_value>{\"a\": [1, true, null]}</arg_value>\n</tool_call>")
# (parser, reply, content, [(name, arguments as JSON values)]) as vLLM's parser reads the whole reply
CALLS = [
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": 3}}, '
                '{"name": "get_time", "arguments": {}}]', None,
     [("get_weather", {"city": 'Pa"ris', "days": 3}), ("get_time", {})]),
    ("granite", ' <tool_call> [{"name": "get_time", "arguments": {"zone": "\u00e9"}}]', None,
     [("get_time", {"zone": "\u00e9"})]),  # Granite 3.1's tag as text, blanks around it
    ("granite", '[{"name": "get_time", "arguments": {"zone": "x"}}]', None, [("get_time", {"zone": "x"})]),
    # a string parameter stays text ("007"), the others read as JSON; GLM-4.7: no newline after the name
    ("glm45", "Sure." + GLM + "<tool_call>get_time</tool_call>", "Sure.",
     [("get_weather", {"city": "007 \u00e9", "days": 3, "o": {"a": [1, True, None]}}), ("get_time", {})]),
    ("glm45", "<tool_call>get_time<arg_key>zone</arg_key><arg_value>null</arg_value></tool_call>", None,
     [("get_time", {"zone": "null"})]),
    ("glm45", "<tool_call>get_time\n<arg_key>extra</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>", None,
     [("get_time", {"extra": [1, 2]})]),  # a parameter the schema does not name: read as JSON (vLLM's)
    ("olmo3", '<function_calls>get_weather(city="Paris", days=3, o={"a": true, "b": null})\nget_time()'
              '</function_calls>', None,
     [("get_weather", {"city": "Paris", "days": 3, "o": {"a": True, "b": None}}), ("get_time", {})]),
    ("olmo3", "\n<function_calls>\nget_time(zone='UTC')\n</function_calls>", None, [("get_time", {"zone": "UTC"})]),
    ("ernie45", 'Ok\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>\n'
                '<tool_call>{"name": "get_time"}</tool_call>', "Ok",  # the content's last newlines dropped
     [("get_weather", {"city": "P"}), ("get_time", {})]),
    ("ernie45", '<tool_call>{"name": "get_time", "arguments": {"zone": "x"}}</tool_call><tool_call>{"name": "get_',
     None, [("get_time", {"zone": "x"})]),  # a block left open at the end is no call (vLLM's)
    # a list among the arguments (vLLM's regex ended the list at its first "]"), "parameters" for "arguments"
    ("phi4_mini_json", 'Ok. functools[{"name": "get_weather", "arguments": {"o": {"a": [1, 2]}, "city": "\u00e9"}}, '
                       '{"name": "get_time", "parameters": {"zone": "x"}}] done', "Ok. ",
     [("get_weather", {"o": {"a": [1, 2]}, "city": "\u00e9"}), ("get_time", {"zone": "x"})]),
]
# replies that are no call: the whole reply is the content, no call goes out at any cut
NOT_CALLS = {
    "granite": ["[1] First, this.", "Hello [", '<|tool_call|>[{"name": "get_time"}]', "[]"],
    "glm45": ["<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
              "<tool_call>\n<arg_key>zone</arg_key>", "I use <tool_c tags."],
    "olmo3": ["Call get_time()", "<function_calls>get_time(zone=x)</function_calls>", "<function_calls>get_time("],
    # (glm45, ernie45: a block left open at the reply's end is no call of the whole reply's, but its stream has sent
    # the call's start, as vLLM's: session65_tools)
    "ernie45": ['<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{not json}</tool_call>", "Plain.\n"],
    "phi4_mini_json": ["import functools", 'functools[{"name": "get_time"}]', "functools[]"],
}


def _req(parser: str):
    return parse_tools({"tools": TOOLS}, parser)


def _content_streamed(req, reply: str, cuts=None) -> str:
    """The content a stream sends (visible at each cut, every length unless `cuts`, each a start of the next and a
    fresh read's), checked to be a start of the whole reply's content; the whole reply's content."""
    memo, sent = {}, ""
    for k in range(len(reply) + 1) if cuts is None else cuts:
        now = visible(req, reply[:k], memo)
        assert now.startswith(sent) and now == visible(req, reply[:k]), (reply[:k], sent, now)
        sent = now
    whole = split(req, reply)[0]
    assert whole.startswith(sent), (whole, sent)
    return whole


@pytest.mark.parametrize("parser,reply,content,calls", CALLS)
def test_each_new_parser_reads_a_whole_reply_as_vllms(parser, reply, content, calls):
    got_content, got = split(_req(parser), reply)
    assert (got_content or None) == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


@pytest.mark.parametrize("parser,reply,content,calls", CALLS)
def test_each_new_parser_streams_the_whole_replys_calls_and_content(parser, reply, content, calls):
    """A character at a time with the stream's memo (each read the same as a fresh one's): the pieces join to the
    whole reply's calls; the content sent is the whole reply's."""
    req = _req(parser)
    pieces, whole = _streamed(req, reply, 1)
    assert [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole] and len(whole) == len(calls)
    assert (_content_streamed(req, reply) or None) == content


@pytest.mark.parametrize("parser,reply", [(p, r) for p, replies in NOT_CALLS.items() for r in replies])
def test_a_reply_that_is_no_call_is_text_and_sends_no_call(parser, reply):
    req = _req(parser)
    assert split(req, reply) == (reply, None)
    pieces, whole = _streamed(req, reply, 1)
    assert pieces == [] and whole == []
    assert _content_streamed(req, reply) == reply


@pytest.mark.parametrize("parser,reply", [
    ("glm45", "<tool_call>get_time\n<arg_key>zone</arg_key><arg_value>" + "[" * 5000 + "</arg_value></tool_call>"),
    ("ernie45", '<tool_call>{"name": "get_time", "arguments": ' + "[" * 5000 + "}</tool_call>"),
    ("olmo3", "<function_calls>get_time(zone=" + "[" * 5000 + ")</function_calls>"),
    ("granite", '[{"name": "get_time", "arguments": ' + "[" * 5000 + "}]")])
def test_an_ended_call_nested_too_deep_is_read_as_vllm_reads_it_not_a_crash(parser, reply):
    """A value nested deeper than Python's JSON and AST readers go (RecursionError): glm45's value stays text (its
    JSON and literal reads fail), the other replies are text; streamed the same (granite's list and ernie45's open
    block aside: what a JSON call's stream sent before the reply turned out no call stands, toolstream's known
    limit)."""
    req = _req(parser)
    content, calls = split(req, reply)
    if parser == "glm45":
        assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "[" * 5000}
    else:
        assert (content, calls) == (reply, None)
    if parser in ("granite", "ernie45"):
        return
    pieces, whole = _streamed(req, reply, 997)
    assert [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]


@pytest.mark.parametrize("parser,good,bad", [
    ("glm45", "<tool_call>get_time\n</tool_call>", "<tool_call>\n<arg_key>a</arg_key></tool_call>"),
    ("ernie45", '<tool_call>{"name": "get_time"}</tool_call>', "<tool_call>{not json}</tool_call>")])
def test_a_block_that_does_not_read_makes_the_whole_reply_text(parser, good, bad):
    """As vLLM's parsers: any block that does not read (no name, no JSON) leaves the whole reply text, the calls
    before it too (the stream has sent those: toolstream's known limit)."""
    req = _req(parser)
    assert len(split(req, good + good)[1]) == 2
    assert split(req, good + bad) == (good + bad, None) and split(req, bad + good) == (bad + good, None)


def test_parallel_tool_calls_false_keeps_the_first_call():
    req = parse_tools({"tools": TOOLS, "parallel_tool_calls": False}, "glm45")
    reply = CALLS[3][1]
    assert [c["function"]["name"] for c in split(req, reply)[1]] == ["get_weather"]
    assert [name for name, _ in partial_calls(req, reply)] == ["get_weather"]


# ------------------------------------------------------------------------------------------- linear reading
MANY = {"glm45": ("_glm_block", "".join(f"<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>z{k}</arg_value>"
                                        "\n</tool_call>" for k in range(6))),
        "ernie45": ("_ernie_block", "".join(f'<tool_call>\n{{"name": "get_time", "arguments": {{"zone": "z{k}"}}}}'
                                            "\n</tool_call>\n" for k in range(6))),
        "olmo3": ("olmo3_calls", "<function_calls>" + "\n".join(f'get_time(zone="z{k}")' for k in range(6))
                  + "</function_calls>")}


@pytest.mark.parametrize("parser", sorted(MANY))
def test_an_ended_call_is_read_once_not_at_each_token(monkeypatch, parser):
    from infer.serve import tools
    name, reply = MANY[parser]
    counted, real = [], getattr(tools, name)
    monkeypatch.setattr(tools, name, lambda *a, **k: counted.append(1) or real(*a, **k))
    req, pieces = _req(parser), []
    stream = CallStream(req)
    for k in range(len(reply) + 1):
        pieces += stream.deltas(partial_calls(req, reply[:k], stream.memo))
    assert sum(counted) <= 6, sum(counted)  # (each block once; olmo3's list once, at its end tag)
    whole = split(req, reply)[1]
    pieces += stream.deltas(whole, finished=True)
    assert len(whole) == 6 and [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]


@pytest.mark.parametrize("parser,tag", [("granite", "<|tool_call|>"), ("phi4_mini_json", "Ok. functools")])
def test_a_json_list_streams_its_arguments_as_they_come_read_on_from_the_last_read(monkeypatch, parser, tag):
    """Granite's and Phi-4-mini's JSON lists are read as mistral's: a string's characters go out as they come, each
    read going on from where the last one stopped (the text json.dumps writes again, in all, about the reply's
    length)."""
    from infer.serve import toolstream
    code = "x = 1\\n" * 200
    reply = tag + '[{"name": "get_time", "arguments": {"zone": "' + code + '"}}]'
    dumped, real = [], toolstream._dumped
    monkeypatch.setattr(toolstream, "_dumped", lambda raw: dumped.append(len(raw)) or real(raw))
    req = _req(parser)
    stream, pieces = CallStream(req), []
    for k in range(len(reply)):
        pieces += stream.deltas(partial_calls(req, reply[:k], stream.memo))
    assert len([p for p in pieces if p["index"] == 0]) > 100  # in pieces, not whole at the end
    assert sum(dumped) < 3 * len(reply), sum(dumped)
    assert [c["function"] for c in _joined(pieces + stream.deltas(split(req, reply)[1], finished=True))] == [
        c["function"] for c in split(req, reply)[1]]


# ------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("name,reads", [("granite", "granite"), ("glm45", "glm45"), ("olmo3", "olmo3"),
                                        ("ernie45", "ernie45"), ("phi4_mini_json", "phi4_mini_json"),
                                        ("granite4", "hermes"), ("glm47", "glm45")])
def test_the_cli_takes_the_new_parser_names(name, reads):
    assert _tool_parser(True, name) == reads
    with pytest.raises(ConfigError, match="granite4 as hermes") as e:
        _tool_parser(True, "granite5")
    assert "glm45" in e.value.hint and "olmo3" in e.value.hint


def test_auto_without_a_parser_names_the_new_ones():
    with pytest.raises(RequestError) as e:
        parse_tools({"tools": TOOLS})
    assert all(name in e.value.hint for name in ("granite", "glm45", "olmo3", "ernie45", "phi4_mini_json"))


def test_glm47s_call_without_a_newline_reads_as_glm45s():
    req = parse_tools({"tools": TOOLS}, _tool_parser(True, "glm47"))
    reply = "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>"
    assert [c["function"]["arguments"] for c in split(req, reply)[1]] == ['{"zone": "UTC"}']


# ------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_chat_engine(tmp_path_factory, "tools64")


SERVED = {"granite": CALLS[0][1], "glm45": CALLS[3][1], "olmo3": CALLS[6][1], "ernie45": CALLS[8][1],
          "phi4_mini_json": CALLS[10][1]}
MALFORMED = {"granite": '<|tool_call|>[{"name": "get_time", "arguments": {}}] oops',
             "glm45": "<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
             "olmo3": "<function_calls>get_time(zone=x)</function_calls>",
             "ernie45": 'Hm.<tool_call>{"name": "get_time", "arguments": {"zone": 1} oops}</tool_call>',
             "phi4_mini_json": 'Hm. functools[{"name": "get_time", "arguments": {"zone": 1} oops}]'}


@pytest.mark.parametrize("parser", sorted(SERVED))
def test_served_calls_whole_and_streamed_are_the_same_message(engine, parser):
    """Through the server, the reply forced token by token: the whole message's calls (finish "tool_calls") and the
    streamed chunks' joined calls and content are the same; a malformed call stays the whole reply's text, its
    finish "stop", streamed and whole."""
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser=parser)) as base:
        body = forced_chat_body(MESSAGES, SERVED[parser], 600, tools=TOOLS)
        c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        want = split(_req(parser), SERVED[parser])
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == (want[0] or None)
        assert [x["function"] for x in c["message"]["tool_calls"]] == [x["function"] for x in want[1]]
        deltas = streamed_chat_choices(base, body)
        assert joined_deltas(deltas, "content") == (c["message"]["content"] or "")
        assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in c["message"]["tool_calls"]]
        assert deltas[-1]["finish_reason"] == "tool_calls"
        body = forced_chat_body(MESSAGES, MALFORMED[parser], 600, tools=TOOLS)
        c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert c["finish_reason"] == "stop" and "tool_calls" not in c["message"]
        assert c["message"]["content"] == MALFORMED[parser]
        deltas = streamed_chat_choices(base, body)
        assert joined_deltas(deltas, "content") == MALFORMED[parser] and deltas[-1]["finish_reason"] == "stop"


# ------------------------------------------------------------------------------------------- reasoning markers
REASONING = [  # (parser, reply, (reasoning, content))
    # blanks before Granite's thought marker: vLLM's whole reply finds it after them (they were content here)
    ("granite", "\n Here is my thought process: a Here is my response: b", (" a ", " b")),
    # a thought marker mid-reply is content, as vLLM's stream reads it (its whole reply drops the text before it)
    ("granite", "Sure. Here is my thought process: a Here is my response: b",
     (None, "Sure. Here is my thought process: a Here is my response: b")),
    # ERNIE's answer runs to the last </response> (vLLM's rfind), what follows it dropped
    ("ernie45", "abc</think><response>x</response> y <response>z</response>\n",
     ("abc", "x</response> y <response>z")),
    ("ernie45", "abc</think><response>x</response> tail", ("abc", "x")),
]


@pytest.mark.parametrize("parser,reply,want", REASONING)
def test_granite_and_ernie_markers_split_as_vllms_and_stream_to_the_same(parser, reply, want):
    req = ReasoningRequest(parser)
    assert reasoning_split(req, reply) == want
    check_stream_adds_up(req, reply)


def test_a_stream_holds_what_follows_ernies_closing_tag_until_it_is_known():
    req = ReasoningRequest("ernie45")
    assert parts(req, "a</think><response>x</response> y", finished=False) == ("a", "x")
    assert parts(req, "a</think><response>x</response> y</response>", finished=False) == ("a", "x</response> y")
    assert parts(ReasoningRequest("granite"), "\n Here is my tho", finished=False) == ("", "")
