"""Session 65 (tools): vLLM's tool-call parsers of DeepSeek-V3/R1 (deepseek_v3), DeepSeek-V3.1 (deepseek_v31) and
Kimi-K2 (kimi_k2, whose calls keep the ids they write), whole and streamed (the same calls, ids and content at every
cut, the arguments in pieces), a malformed or cut call left text; its deepseek_v3 reasoning parser (thinking per
chat_template_kwargs thinking) and kimi_k2's (thinking by default, its "(no content)" dropped); the names taken by
the CLI; DeepSeek's tokens served end to end on a tiny model (and by `infer run --output-format openai`)."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings, strategies as st

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.cli.serve import _reasoning_parser, _tool_parser  # noqa: E402
from infer.errors import ConfigError, RequestError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.reasoning import ReasoningRequest, parts, reasoning_request  # noqa: E402
from infer.serve.reasoning import split as reasoning_split  # noqa: E402
from infer.serve.tools import parse_tools, split, tool_calls  # noqa: E402
from infer.serve.toolstream import CallStream, partial_calls  # noqa: E402

from helpers import (check_stream_adds_up, forced_chat_body, joined_deltas, joined_tool_calls,  # noqa: E402
                     streamed_chat_choices, tiny_chat_engine, tiny_llama_with_added_tokens)
from test_probes_session64_tools import _content_streamed  # noqa: E402

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                           "zone": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": PARAMS}} for n in ("get_weather", "get_time")]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]

# DeepSeek's tokens (written out here, not taken from the code under test)
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KB, KA, KE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# arguments JSON writes again (2.50, 1e2), a string's escapes and a brace in it
ARGS = '{"city": "Pa\\"ri{s}] \\u00e9\\ud83d\\ude00 \u00fc", "days": 3, "o": {"a": [1, 2.50, true, null], "e": 1e2}}'
ARGS_VALUE = json.loads(ARGS)


def v3(name: str, args: str) -> str:
    return f"{BEGIN}function{SEP}{name}\n```json\n{args}\n```{END}"


def v31(name: str, args: str) -> str:
    return f"{BEGIN}{name}{SEP}{args}{END}"


def kimi(call_id: str, args: str) -> str:
    return f"{KB}{call_id}{KA}{args}{KE}"


# (parser, reply, content, [(name, arguments as JSON values, id the text writes or None)]), as vLLM's reads them
CALLS = [
    ("deepseek_v3", "Let me check." + CALLS_BEGIN + v3("get_weather", ARGS) + "\n" + v3("get_time", "{}") + CALLS_END,
     "Let me check.", [("get_weather", ARGS_VALUE, None), ("get_time", {}, None)]),
    # JSON over several lines (vLLM's regex reads one line), an open call after an ended one (no call: vLLM's)
    ("deepseek_v3", CALLS_BEGIN + v3("get_time", '{\n  "zone": "UTC"\n}') + BEGIN + "function" + SEP + "get_w",
     None, [("get_time", {"zone": "UTC"}, None)]),
    ("deepseek_v31", "Ok." + CALLS_BEGIN + v31("get_weather", ARGS) + v31("get_time", '{"zone": "\u00e9t\u00e9"}')
     + CALLS_END, "Ok.", [("get_weather", ARGS_VALUE, None), ("get_time", {"zone": "\u00e9t\u00e9"}, None)]),
    ("kimi_k2", "I will look." + KIMI + kimi("functions.get_weather:0", ARGS) + kimi("functions.get_time:1", "{}")
     + KIMI_END, "I will look.", [("get_weather", ARGS_VALUE, "functions.get_weather:0"),
                                  ("get_time", {}, "functions.get_time:1")]),
    # the singular section token (vLLM's stream takes it), blanks around the id and the arguments
    ("kimi_k2", "<|tool_call_section_begin|>\n" + KB + " get_time:3 " + KA + ' {"zone": "x"} ' + KE
     + "\n<|tool_call_section_end|>", None, [("get_time", {"zone": "x"}, "get_time:3")]),
    ("internlm", 'Sure.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": ' + ARGS + '}<|action_end|>',
     "Sure.", [("get_weather", ARGS_VALUE, None)]),
    # "arguments" for "parameters", no <|action_end|> (a stop string's cut); a call without arguments: {}
    ("internlm", '<|action_start|><|plugin|>{"name": "get_time", "arguments": {"zone": "x"}}', None,
     [("get_time", {"zone": "x"}, None)]),
    ("internlm", '<|action_start|><|plugin|>{"name": "get_time"}<|action_end|>', None, [("get_time", {}, None)]),
    # the whole reply a list (arguments as JSON text kept), or in a code block, after </think>, in a <tool_call>
    ("xlam", '[{"name": "get_weather", "arguments": ' + ARGS + '}, {"name": "get_time", "arguments": "{\\"zone\\": '
     '\\"x\\"}"}]', None, [("get_weather", ARGS_VALUE, None), ("get_time", {"zone": "x"}, None)]),
    ("xlam", 'Let me see.\n```json\n[{"name": "get_time", "arguments": {"zone": "x"}}]\n```\nDone.',
     "Let me see.\n\nDone.", [("get_time", {"zone": "x"}, None)]),
    ("xlam", '<think>hmm</think>\n[{"name": "get_time", "arguments": {}}]', "<think>hmm</think>",
     [("get_time", {}, None)]),
    ("xlam", 'a <tool_call>[{"name": "get_time", "arguments": {}}, {"bad": 1}]</tool_call> b', "a  b",
     [("get_time", {}, None)]),
    ("hunyuan_a13b", 'Sure.<tool_calls>[{"name": "get_weather", "arguments": ' + ARGS + '}, {"name": "get_time", '
     '"arguments": "{}"}]</tool_calls>', "Sure.", [("get_weather", ARGS_VALUE, None), ("get_time", {}, None)]),
    # blank content is none; a list in a think block is no call, the first outside one is
    ("hunyuan_a13b", '\n<think>no <tool_calls>[{"name": "get_weather", "arguments": {}}]</tool_calls></think>\n'
     '<tool_calls>\n[{"name": "get_time", "arguments": {"zone": "x"}}]\n</tool_calls>',
     '\n<think>no <tool_calls>[{"name": "get_weather", "arguments": {}}]</tool_calls></think>\n',
     [("get_time", {"zone": "x"}, None)]),
    ("hunyuan_a13b", '\n<tool_calls>[{"name": "get_time", "arguments": {}}]</tool_calls>', None,
     [("get_time", {}, None)]),
    # values typed by the schema's type (a string keeps its text less blanks, an unknown parameter stays text)
    ("minimax_m2", 'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">\n Pa"ris \u00e9 \n'
     '</parameter>\n<parameter name="days">3</parameter><parameter name="extra">[1, 2]</parameter>\n</invoke>\n'
     "<invoke name='get_time'>\n<parameter name=\"zone\">null</parameter></invoke>\n</minimax:tool_call>", "Sure.\n",
     [("get_weather", {"city": 'Pa"ris \u00e9', "days": 3, "extra": "[1, 2]"}, None),
      ("get_time", {"zone": None}, None)]),
]
# replies no call reads: the whole reply is the content, and no piece of a call goes out at any cut
NOT_CALLS = {
    "deepseek_v3": ["Plain text, no call.", v3("get_time", "{}"),  # no section token
                    CALLS_BEGIN + f"{BEGIN}function{SEP}get_time\n" + '{"zone": "x"}' + END,  # no code block
                    CALLS_BEGIN + v3("get_time", "[1, 2]"), "A < b <\uff5c tool"],  # arguments no object
    "deepseek_v31": [CALLS_BEGIN + v31("get time", "{}"), CALLS_BEGIN + v31("", "{}"), CALLS_BEGIN + BEGIN],
    "kimi_k2": [KIMI + kimi("functions.get_time", "{}"),  # an id without its index
                KIMI + kimi("functions.:0", "{}"), kimi("functions.get_time:0", "{}"), "I use <|tool_calls tags."],
    "internlm": ["<|action_start|><|interpreter|>print(1)<|action_end|>", "Plain <|action_start|> text",
                 "<|action_start|><|plugin|>no call here<|action_end|>"],
    "xlam": ["[1] First point.", "Plain text.", "```python\nprint(1)\n```", '[{"answer": 1}]', "<think>a</think>b"],
    "hunyuan_a13b": ['<think><tool_calls>[{"name": "get_time", "arguments": {}}]</tool_calls></think>',
                     "I use <tool_calls> tags", '<tool_calls>{"name": "get_time"}</tool_calls>'],
    "minimax_m2": ['<minimax:tool_call><invoke name="">x</invoke></minimax:tool_call>', "Plain <minimax:tool_ text"],
}
# replies whose call turns out malformed after it showed itself: the whole reply is text (the stream sent the call's
# start: toolstream's known limit, vLLM's too)
MALFORMED = {
    "deepseek_v3": [CALLS_BEGIN + v3("get_time", "{not json}"), CALLS_BEGIN + v3("get_time", '{"zone": "x"'),
                    CALLS_BEGIN + BEGIN + "function" + SEP + "get_time\n```json\n{\"zone\": \"x\"}"],  # cut
    "deepseek_v31": [CALLS_BEGIN + v31("get_time", '{"zone": NaN}'),
                     CALLS_BEGIN + v31("get_time", '{"zone": "' + BEGIN + '"}')],  # a begin token inside a call
    "kimi_k2": [KIMI + kimi("functions.get_time:0", '{"zone": 1e400}'), KIMI + kimi("functions.get_time:0", "{}")
                + kimi("functions.get_time:1", '{"zone": "x"} trailing')],
    "internlm": ['<|action_start|><|plugin|>{"name": "get_time", "parameters": {}}<|action_end|>'
                 '<|action_start|><|plugin|>{"name": "get_weather", "parameters": {}}<|action_end|>'],  # (one only)
    "xlam": ['[{"name": "get_time", "arguments": {}}] and more'],
    "hunyuan_a13b": ['<tool_calls>[{"name": "get_time", "arguments": {}}] oops</tool_calls>'],
    "minimax_m2": ['<minimax:tool_call><invoke name="get_time"><parameter name="days">5</parameter></invoke>'],  # open
}


def _req(parser: str, **body):
    return parse_tools({"tools": TOOLS, **body}, parser)


def _streamed(req, reply: str, cuts) -> tuple[list[dict], list[dict]]:
    """(the delta.tool_calls pieces of `reply` cut at each of `cuts` with the stream's memo, then finished; the whole
    reply's calls). Each read equals a fresh one's; each call so far is the whole's, its arguments a start of the
    whole's, its id (a third item) the whole's."""
    stream, pieces, whole = CallStream(req), [], split(req, reply)[1] or []
    for k in cuts:
        now = partial_calls(req, reply[:k], stream.memo)
        assert now == partial_calls(req, reply[:k]) and len(now) <= len(whole), (reply[:k], now)
        for call, want in zip(now, whole):
            assert call[0] == want["function"]["name"] and want["function"]["arguments"].startswith(call[1]), call
            assert len(call) == 2 or call[2] == want["id"], (call, want["id"])
        pieces += stream.deltas(now)
    return pieces + stream.deltas(whole, finished=True), whole


def _joined(pieces: list[dict]) -> list[dict]:
    return joined_tool_calls([{"delta": {"tool_calls": [p]}} for p in pieces])


@pytest.mark.parametrize("parser,reply,content,calls", CALLS)
def test_each_parser_reads_a_whole_reply_as_vllms(parser, reply, content, calls):
    got_content, got = split(_req(parser), reply)
    assert (got_content or None) == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [c[:2] for c in calls]
    for call, (_, _, call_id) in zip(got, calls):  # Kimi's ids as written; the others vLLM's chatcmpl-tool-...
        assert call["id"] == call_id if call_id else call["id"].startswith("chatcmpl-tool-")
        assert call["type"] == "function"


@pytest.mark.parametrize("parser,reply,content,calls", CALLS)
def test_each_parser_streams_the_whole_replys_calls_ids_and_content(parser, reply, content, calls):
    """A character at a time: the pieces join to the whole reply's calls (Kimi's ids the ones its text writes, in
    the call's first piece), the arguments in pieces as they come; the content sent is the whole reply's."""
    req = _req(parser)
    pieces, whole = _streamed(req, reply, range(len(reply) + 1))
    joined = _joined(pieces)
    assert [c["function"] for c in joined] == [c["function"] for c in whole] and len(whole) == len(calls)
    assert [c["id"] for c in joined if calls[0][2]] == [c[2] for c in calls if c[2]]
    assert (_content_streamed(req, reply, range(len(reply) + 1)) or None) == content


@settings(max_examples=40, deadline=None)
@given(st.integers(0, len(CALLS) - 1), st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_pieces_streamed_at_any_cuts_join_to_the_whole_reply(case, steps):
    """Cut where the steps fall (tokens of any width, the tokens split anywhere): the same calls and content."""
    parser, reply, content, _ = CALLS[case]
    cuts, k = [], 0
    for step in steps * (1 + len(reply) // sum(steps)):
        k = min(len(reply), k + step)
        cuts.append(k)
    req = _req(parser)
    pieces, whole = _streamed(req, reply, cuts)
    assert [(c["id"] if parser == "kimi_k2" else None, c["function"]) for c in _joined(pieces)] == [
        (c["id"] if parser == "kimi_k2" else None, c["function"]) for c in whole]
    assert (_content_streamed(req, reply, cuts) or None) == content


@pytest.mark.parametrize("parser,reply", [(p, r) for p, replies in NOT_CALLS.items() for r in replies])
def test_a_reply_that_is_no_call_is_text_and_sends_no_call(parser, reply):
    req = _req(parser)
    assert split(req, reply) == (reply, None)
    pieces, whole = _streamed(req, reply, range(len(reply) + 1))
    assert pieces == [] and whole == []
    assert _content_streamed(req, reply, range(len(reply) + 1)) == reply


@pytest.mark.parametrize("parser,reply", [(p, r) for p, replies in MALFORMED.items() for r in replies])
def test_a_call_that_turns_out_malformed_leaves_the_whole_reply_text(parser, reply, caplog):
    """As vLLM's parsers, a call that does not read (JSON that is none, NaN, a number too large, a begin token in it,
    cut before its end token) leaves the reply text; its stream never raises, and says what went out."""
    req = _req(parser)
    assert split(req, reply) == (reply, None)
    _stream_what_goes_out(req, reply, caplog, range(len(reply) + 1))


def _stream_what_goes_out(req, reply: str, caplog, cuts) -> None:
    """Stream `reply`, whose whole reads no call: whatever went out is no call of the whole's, and is said so."""
    stream = CallStream(req)
    with caplog.at_level(logging.WARNING, logger="infer.serve"):
        for k in cuts:
            assert partial_calls(req, reply[:k], stream.memo) == partial_calls(req, reply[:k])
            stream.deltas(partial_calls(req, reply[:k], stream.memo))
        assert stream.deltas([], finished=True) == []
    assert bool(stream.sent) == ("went out streamed" in caplog.text)


NEW = ("deepseek_v3", "deepseek_v31", "kimi_k2", "internlm", "xlam", "hunyuan_a13b", "minimax_m2")


@pytest.mark.parametrize("parser", [p for p in (*NEW, "glm45", "ernie45") if p != "minimax_m2"])
def test_arguments_go_out_in_pieces_as_they_come(parser):
    """The bench's reply of each parser (a long string argument): its arguments go out a few characters at a time,
    not whole at the reply's end (minimax_m2's each parameter once whole, its value typed: below). (The bench's
    replies: tests/test_probes_session64_lin.py checks each step reads its new text alone.)"""
    from infer.bench.toolstream import TOOLS as BENCH_TOOLS, replies
    reply = replies(400)[parser]
    req = parse_tools({"tools": BENCH_TOOLS}, parser)
    pieces, whole = _streamed(req, reply, range(len(reply) + 1))
    assert len([p for p in pieces if p["index"] == 0]) > 100
    assert [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole] and len(whole) == 1


def test_a_call_too_deep_for_pythons_json_is_text_not_a_crash(caplog):
    reply = CALLS_BEGIN + v31("get_time", '{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    req = _req("deepseek_v31")
    assert split(req, reply) == (reply, None)
    _stream_what_goes_out(req, reply, caplog, range(0, len(reply) + 1, 997))


def test_parallel_tool_calls_false_keeps_the_first_call():
    req = _req("kimi_k2", parallel_tool_calls=False)
    reply = CALLS[3][1]
    assert [c["id"] for c in split(req, reply)[1]] == ["functions.get_weather:0"]
    assert [call[0] for call in partial_calls(req, reply)] == ["get_weather"]


def test_an_ended_call_is_read_once_not_at_each_token(monkeypatch):
    from infer.serve import tools
    reply = CALLS_BEGIN + "".join(v3("get_time", f'{{"zone": "z{k}"}}') for k in range(6)) + CALLS_END
    counted, real = [], tools.sectioned_block
    monkeypatch.setattr(tools, "sectioned_block", lambda *a: counted.append(1) or real(*a))
    req = _req("deepseek_v3")
    pieces, whole = _streamed(req, reply, range(len(reply) + 1))
    assert len(whole) == 6 and [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]
    # (each block once in the memo's stream, once in each check's fresh read, and the whole reply's 6)
    assert sum(counted) <= 6 + 6 * len(reply) // 2, sum(counted)
    counted.clear()
    stream = CallStream(req)
    for k in range(len(reply) + 1):
        stream.deltas(partial_calls(req, reply[:k], stream.memo))
    assert sum(counted) == 6


# ------------------------------------------------------------------------------------------- forced calls' ids
def test_kimis_forced_calls_are_numbered_on_from_the_conversations_calls():
    """vLLM's kimi_k2 ids for a named or "required" call: functions.NAME:IDX, IDX counting the calls of the
    conversation's assistant messages (the ids Kimi's template takes back), streamed the same."""
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "functions.get_time:0", "type": "function",
                                                     "function": {"name": "get_time", "arguments": "{}"}}] * 2},
               {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "12:00"}]
    req = _req("kimi_k2", tool_choice="required", messages=history)
    reply = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "P"}}]'
    assert [c["id"] for c in tool_calls(req, reply)] == ["functions.get_time:2", "functions.get_weather:3"]
    pieces, whole = _streamed(req, reply, range(len(reply) + 1))
    assert [c["id"] for c in _joined(pieces)] == ["functions.get_time:2", "functions.get_weather:3"]
    named = _req("kimi_k2", tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_calls(named, '{"city": "P"}')[0]["id"] == "functions.get_weather:0"
    assert tool_calls(_req("hermes", tool_choice="required"), reply)[0]["id"].startswith("chatcmpl-tool-")


# ------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("name", NEW)
def test_the_cli_takes_the_new_tool_parser_names_and_lists_them(name):
    assert _tool_parser(True, name) == name
    with pytest.raises(ConfigError) as e:
        _tool_parser(True, "deepseek_v4")
    assert name in e.value.hint
    with pytest.raises(RequestError) as e:
        parse_tools({"tools": TOOLS})
    assert name in e.value.hint


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"])
def test_the_cli_takes_the_new_reasoning_parser_names_and_lists_them(name):
    from typer.testing import CliRunner

    from infer.cli.main import app
    assert _reasoning_parser(name) == name
    with pytest.raises(ConfigError) as e:
        _reasoning_parser("kimi_k3")
    assert name in e.value.hint
    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert name in res.output and all(parser in res.output for parser in NEW)


# ------------------------------------------------------------------------------------------- reasoning
class _Tokenizer:  # (a prompt that neither opens nor closes a think block)
    all_special_tokens = []

    def decode(self, ids, skip_special_tokens=False):
        return ""

    def convert_ids_to_tokens(self, ids):
        return []


@pytest.mark.parametrize("kwargs,thinks", [
    ({}, False), ({"thinking": True}, True), ({"enable_thinking": True}, True), ({"thinking": False}, False),
    ({"thinking": False, "enable_thinking": True}, True), ({"thinking": 0}, False)])
def test_deepseek_v3_thinks_only_when_chat_template_kwargs_ask(kwargs, thinks):
    """vLLM's deepseek_v3: deepseek_r1's split when thinking (or enable_thinking) is true, else all content
    (reasoning_effort changes nothing: vLLM's reads the kwargs alone)."""
    req = reasoning_request("deepseek_v3", {"chat_template_kwargs": kwargs, "reasoning_effort": "high"}, [],
                            _Tokenizer())
    reply = "abc</think>xyz"
    assert reasoning_split(req, reply) == (("abc", "xyz") if thinks else (None, reply))
    check_stream_adds_up(req, reply)


@pytest.mark.parametrize("kwargs,thinks", [({}, True), ({"thinking": True}, True), ({"thinking": False}, False),
                                           ({"enable_thinking": False}, True)])
def test_kimi_k2_thinks_unless_thinking_is_false(kwargs, thinks):
    req = reasoning_request("kimi_k2", {"chat_template_kwargs": kwargs}, [], _Tokenizer())
    reply = "<think>abc</think>xyz"
    assert reasoning_split(req, reply) == (("abc", "xyz") if thinks else (None, reply))


@pytest.mark.parametrize("reply,want", [
    ("abc</think>(no content)", ("abc", None)),
    ("abc</think>(no content)" + KIMI, ("abc", KIMI)),
    ("abc</think>Sure(no content). (no c", ("abc", "Sure. (no c")),
    ("abc</think> \n", ("abc", None)),
    ("abc</think>(no content)(no content)x", ("abc", "x")),
    ("abc(no content)", ("abc(no content)", None)),  # the reasoning is left as written
])
def test_kimi_k2_drops_its_no_content_placeholder_whole_and_streamed(reply, want):
    """vLLM's kimi_k2 leaves the "(no content)" Kimi writes before its calls out of the content (null when only blanks
    remain); a stream holds a tail that may become it, and blanks alone, so its deltas add up to the whole reply's."""
    req = ReasoningRequest("kimi_k2")
    assert reasoning_split(req, reply) == want
    check_stream_adds_up(req, reply)
    memo = {}
    for k in range(len(reply) + 1):
        assert parts(req, reply[:k], False, memo) == parts(req, reply[:k], False), reply[:k]
    ended = ReasoningRequest("kimi_k2", ended=True)
    assert reasoning_split(ended, "(no content)" + KIMI) == (None, KIMI)
    assert reasoning_split(ended, "(no content)") == (None, None)


# ------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_chat_engine(tmp_path_factory, "tools65")


def _served(base: str, body: dict) -> tuple[dict, list[dict]]:
    c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert c.status_code == 200, c.text
    return c.json()["choices"][0], streamed_chat_choices(base, body)


def test_kimi_calls_served_whole_and_streamed_keep_their_ids(engine):
    """Through the server, the reply forced token by token: the whole message's calls (finish "tool_calls") and the
    streamed chunks' joined calls, ids and content are the same, the ids Kimi wrote; a malformed call stays the whole
    reply's text (finish "stop"), streamed and whole."""
    reply = CALLS[3][1]
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser="kimi_k2")) as base:
        c, deltas = _served(base, forced_chat_body(MESSAGES, reply, 600, tools=TOOLS))
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "I will look."
        assert [(x["id"], x["function"]["name"], json.loads(x["function"]["arguments"])) for x in
                c["message"]["tool_calls"]] == [(i, n, a) for n, a, i in CALLS[3][3]]
        assert joined_deltas(deltas, "content") == "I will look."
        assert joined_tool_calls(deltas) == c["message"]["tool_calls"] and deltas[-1]["finish_reason"] == "tool_calls"
        bad = MALFORMED["kimi_k2"][1]
        c, deltas = _served(base, forced_chat_body(MESSAGES, bad, 600, tools=TOOLS))
        assert c["finish_reason"] == "stop" and "tool_calls" not in c["message"] and c["message"]["content"] == bad
        assert joined_deltas(deltas, "content") == bad and deltas[-1]["finish_reason"] == "stop"


DEEPSEEK_TOKENS = ["<think>", "</think>", CALLS_BEGIN, CALLS_END, BEGIN, END, SEP]


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory):
    """tiny-llama with DeepSeek-V3.1's think and tool tokens added as tokens of their own (not special, as its
    tokenizer has them)."""
    return tiny_llama_with_added_tokens(tmp_path_factory.mktemp("s65") / "deepseek", DEEPSEEK_TOKENS, special=False)


def test_deepseek_v31_served_with_its_reasoning_parser_whole_and_streamed(deepseek_model):
    """--tool-call-parser deepseek_v31 --reasoning-parser deepseek_v3: with thinking the reasoning is split first and
    the calls read from the answer; without it the reply is all answer; the streamed chunks add up to the whole
    message, each token of DeepSeek's its own."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    eng = LLMEngine(EngineConfig(deepseek_model, block_size=4, max_num_seqs=4))
    calls = CALLS_BEGIN + v31("get_weather", '{"city": "Paris", "days": 2}') + v31("get_time", "{}") + CALLS_END
    want = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    server = Server(AsyncEngine(eng), "ds", tool_parser="deepseek_v31", reasoning_parser="deepseek_v3")
    with serve_in_thread(server) as base:
        for thinking, reply, reasoning, content in [(True, "abc</think>Ok." + calls, "abc", "Ok."),
                                                    (False, "Ok." + calls, None, "Ok.")]:
            body = forced_chat_body(MESSAGES, reply, 600, tools=TOOLS, return_token_ids=True,
                                    chat_template_kwargs={"thinking": thinking})
            c, deltas = _served(base, body)
            assert eng.tokenizer.convert_tokens_to_ids(BEGIN) in c["token_ids"]
            m = c["message"]
            assert (m["reasoning"], m["content"], c["finish_reason"]) == (reasoning, content, "tool_calls")
            assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in m["tool_calls"]] == want
            assert joined_deltas(deltas, "reasoning") == (reasoning or "")
            assert joined_deltas(deltas, "content") == content
            assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in m["tool_calls"]]


def test_infer_run_splits_deepseek_v3s_reasoning_per_line(deepseek_model, tmp_path):
    """`infer run --output-format openai --reasoning-parser deepseek_v3` reads each line's chat_template_kwargs
    thinking as the server does."""
    from helpers import infer_run_records

    def line(custom_id: str, **extra) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": forced_chat_body(MESSAGES, "abc</think>xyz", 40, **extra)}
    recs, out = infer_run_records(tmp_path, [line("on", chat_template_kwargs={"thinking": True}), line("off")],
                                  "--output-format", "openai", "--reasoning-parser", "deepseek_v3",
                                  key="custom_id", model=deepseek_model)
    message = {k: r["response"]["body"]["choices"][0]["message"] for k, r in recs.items()}
    assert (message["on"]["reasoning"], message["on"]["content"]) == ("abc", "xyz"), out
    assert (message["off"]["reasoning"], message["off"]["content"]) == (None, "abc</think>xyz"), out


# ------------------------------------------------------------------------------------------- the known gaps closed
GLM = "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>12</arg_value>\n<arg_key>city</arg_key>\n<arg_value>"


def test_glm_streams_a_string_value_as_it_comes_and_holds_a_typed_one_until_whole():
    """vLLM's glm45 streams a call's arguments: a string parameter's text as it comes (a tail that may be its end
    tag held), a typed value (an integer: "12" may grow) once its end tag has come; they went out whole at
    </tool_call>."""
    req = _req("glm45")
    assert partial_calls(req, GLM[:GLM.index("12") + 2]) == [("get_weather", "{")]
    assert partial_calls(req, GLM) == [("get_weather", '{"days": 12, "city": "')]
    assert partial_calls(req, GLM + 'Pa"ris\n</arg_v') == [("get_weather", '{"days": 12, "city": "Pa\\"ris\\n')]
    reply = GLM + 'Pa"ris\n</arg_v</arg_value>\n</tool_call>'
    pieces, whole = _streamed(req, reply, range(len(reply) + 1))
    assert json.loads(whole[0]["function"]["arguments"]) == {"days": 12, "city": 'Pa"ris\n</arg_v'}
    assert [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]


@pytest.mark.parametrize("parser,reply", [
    ("glm45", GLM + "Paris"), ("ernie45", '<tool_call>{"name": "get_time", "arguments": {"zone": "x"}}')])
def test_a_call_left_open_at_the_end_is_text_though_its_start_went_out(parser, reply, caplog):
    """As vLLM's glm45 and ernie45: only a block that ended is a call; a stream has sent the open one's start (cut by
    max_tokens), and says so."""
    req = _req(parser)
    assert split(req, reply) == (reply, None)
    _stream_what_goes_out(req, reply, caplog, range(len(reply) + 1))
    assert "went out streamed" in caplog.text


@pytest.mark.parametrize("reply,args", [
    ("[get_weather(days=-2, city='P')]", {"days": -2, "city": "P"}),
    ("[get_time(zone=[-1.5, +2, {'a': -0.0}])]", {"zone": [-1.5, 2, {"a": -0.0}]})])
def test_pythonic_reads_a_signed_number_whole_and_streamed(reply, args):
    """A signed number is a unary minus in Python's AST: the whole reply was text (as vLLM's pythonic reads it)."""
    req = _req("pythonic")
    content, calls = split(req, reply)
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == args
    pieces, whole = _streamed(req, reply, range(len(reply) + 1))
    assert [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]


OLMO = ('I will.\n<function_calls>\nget_weather(city="Paris", days=-2)\nget_time(zone=\'x\'), get_time()\n'
        + "".join(f'get_time(zone="z{k}")\n' for k in range(5)) + "</function_calls>")


def test_olmo3_sends_each_call_as_its_line_ends_each_line_read_once(monkeypatch):
    """Olmo 3's calls went out all at once at </function_calls>: each goes out once its line has ended (a call
    whole: its literals typed once whole), each line parsed once, the same calls as the whole reply's."""
    from infer.serve import tools
    req = _req("olmo3")
    first = OLMO.index(")\n") + 2
    assert partial_calls(req, OLMO[:first - 1]) == []
    assert partial_calls(req, OLMO[:first]) == [("get_weather", '{"city": "Paris", "days": -2}')]
    counted, real = [], tools._python_calls
    monkeypatch.setattr(tools, "_python_calls", lambda *a, **k: counted.append(1) or real(*a, **k))
    stream, pieces = CallStream(req), []
    for k in range(len(OLMO) + 1):
        pieces += stream.deltas(partial_calls(req, OLMO[:k], stream.memo))
    whole = split(req, OLMO)[1]
    pieces += stream.deltas(whole, finished=True)
    assert len(whole) == 8 and [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]
    assert sum(counted) <= 7 + 2, sum(counted)  # (each line once, the whole list at its end tag, split's)


def test_minimax_sends_each_parameter_once_it_has_ended():
    req = _req("minimax_m2")
    head = '<minimax:tool_call><invoke name="get_weather"><parameter name="days">1'
    assert partial_calls(req, head[:head.index('">') + 1]) == []
    assert partial_calls(req, head[:head.index('">') + 2]) == [("get_weather", "{")]
    assert partial_calls(req, head) == [("get_weather", "{")]  # ("1" may grow)
    assert partial_calls(req, head + '2</parameter><parameter name="city">Par') == [("get_weather", '{"days": 12')]
