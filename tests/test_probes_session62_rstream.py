"""Session 62 (p62rstream): a review of streamed tool calls. A streamed reply is read again at each token: its
calls' JSON goes on from where the last read stopped (linear in the reply's length, not quadratic), the pieces the
same as a fresh read's; NaN, Infinity and 1e400 neither stream nor reach a whole call's arguments; the Responses
stream of a call that turns out malformed keeps its items apart; several choices, logprobs, parallel_tool_calls
false and tool_choice none streamed as their whole messages."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.serve import toolstream  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.tools import parse_tools, split  # noqa: E402
from infer.serve.toolstream import CallStream, json_prefix, partial_calls  # noqa: E402

from helpers import forced_chat_body, joined_deltas, joined_tool_calls, tiny_chat_engine  # noqa: E402
from test_probes_session62_stream import ARGS, MESSAGES, REPLIES, TOOLS  # noqa: E402

CODE = {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"}}}
LONG = "x = 1\\n\\tprint(\\\"\\u00e9\\\")\\n" * 300  # a long argument, an escape every few characters
LONG_REPLIES = {
    "hermes": '<tool_call>{"name": "run", "arguments": {"code": "' + LONG + '", "n": 3}}</tool_call>',
    "llama3_json": '{"name": "run", "parameters": {"code": "' + LONG + '", "n": 3}}',
    "mistral": '[TOOL_CALLS][{"name": "run", "arguments": {"n": 3, "code": "' + LONG + '"}}]',
    "openai": '<|start|>assistant to=functions.run<|channel|>commentary json<|message|>{"code": "' + LONG + '"}',
}


@pytest.mark.parametrize("parser,reply", [(p, r) for p, replies in REPLIES.items() for r in replies])
def test_a_read_that_goes_on_from_the_last_one_is_a_fresh_read(parser, reply):
    """partial_calls with the stream's memo (the read going on where the last, shorter one stopped), at every cut
    and at uneven steps: the same calls as a fresh read of the text so far."""
    req = parse_tools({"tools": TOOLS}, parser)
    for step in (1, 3, 7):
        memo = {}
        for k in range(0, len(reply) + step, step):
            assert partial_calls(req, reply[:k], memo) == partial_calls(req, reply[:k]), (step, reply[:k])


def test_json_prefix_goes_on_from_its_memo_and_a_changed_text_reads_afresh():
    raw = ARGS + " trailing"
    for step in (1, 2, 5):
        memo = {}
        for k in range(0, len(raw) + step, step):
            assert json_prefix(raw[:k], memo=memo) == json_prefix(raw[:k]), raw[:k]
    memo = {}
    json_prefix('{"a": "bc', memo=memo)
    assert json_prefix('{"a": 1}', memo=memo) == ('{"a": 1}', 8)  # (not the text the memo read: read afresh)


@pytest.mark.parametrize("parser", sorted(LONG_REPLIES))
def test_a_long_argument_streamed_is_read_once(monkeypatch, parser):
    """A call whose string argument is long (thousands of characters, many escapes) streamed a token at a time:
    each character of it is decoded about once in all (it was again at every token: 6,000 characters took a
    second and a half), and the pieces still join to the whole reply's arguments."""
    reply, decoded = LONG_REPLIES[parser], []
    real = toolstream._dumped
    monkeypatch.setattr(toolstream, "_dumped", lambda raw: decoded.append(len(raw)) or real(raw))
    req = parse_tools({"tools": [{"type": "function", "function": {"name": "run", "parameters": CODE}}]}, parser)
    stream, pieces = CallStream(req), []
    for k in range(0, len(reply), 3):
        pieces += stream.deltas(partial_calls(req, reply[:k], stream.memo))
    whole = split(req, reply)[1]
    pieces += stream.deltas(whole, finished=True)
    assert "".join(p["function"]["arguments"] for p in pieces) == whole[0]["function"]["arguments"]
    assert json.loads(whole[0]["function"]["arguments"])["code"].startswith("x = 1\n\tprint(\"\u00e9\")")
    assert sum(decoded) < 2 * len(reply)


# a call whose arguments hold what JSON has not: Python's NaN and Infinity, a number too large for a float
NOT_JSON = {"hermes": '<tool_call>{{"name": "get_time", "arguments": {{"days": {}, "zone": "x"}}}}</tool_call>',
            "llama3_json": '{{"name": "get_time", "parameters": {{"days": {}, "zone": "x"}}}}',
            "mistral": '[TOOL_CALLS][{{"name": "get_time", "arguments": {{"days": {}, "zone": "x"}}}}]'}


@pytest.mark.parametrize("parser", sorted(NOT_JSON))
@pytest.mark.parametrize("number", ["1e400", "-1e999", "NaN", "-Infinity"])
def test_a_call_with_a_number_json_has_not_is_text_whole_and_never_streams_it(parser, number):
    """1e400 (json.loads reads it as inf) made the whole reply's arguments '{"days": Infinity, ...}', which no
    client's JSON reader takes (NaN and Infinity were already text); and the stream sent NaN and Infinity as they
    came (its read took them) though the whole reply is text. Now the whole reply is text and no piece holds them."""
    reply = NOT_JSON[parser].format(number)
    req = parse_tools({"tools": TOOLS}, parser)
    assert split(req, reply) == (reply, None)
    stream = CallStream(req)
    for k in range(len(reply) + 1):
        for piece in stream.deltas(partial_calls(req, reply[:k], stream.memo)):
            assert not any(word in piece["function"]["arguments"] for word in ("NaN", "Infinity", "inf")), piece
    assert json_prefix('{"a": 1e400}') == ('{"a": ', None) and json_prefix('[1e400]', nan=True)[0] == "[Infinity]"

# ------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_chat_engine(tmp_path_factory, "rstream62")


def _responses_events(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}, timeout=120) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]


def test_responses_stream_of_a_call_that_turns_out_malformed_keeps_its_items_apart(engine):
    """/v1/responses streamed, the second call's text broken after its arguments went out (the known limit: they
    cannot be taken back): each item added once at its own output_index (the reply's text after the calls a message
    of its own after them, not the closed message again at the first call's index), each item done, the response's
    output those items in that order, and the messages' texts joined the whole reply's text."""
    reply = ('Ok.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
             '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}} oops</tool_call>')
    body = {"input": "time?", "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "guided_regex": re.escape(reply), "max_output_tokens": 300, "temperature": 0}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser="hermes")) as base:
        whole = httpx.post(f"{base}/v1/responses", json=body, timeout=120).json()
        events = _responses_events(base, body)
    assert [o["type"] for o in whole["output"]] == ["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == list(range(len(added)))
    assert [e["item"]["id"] for e in added] == [e["item"]["id"] for e in done]
    assert [e["item"]["type"] for e in added] == ["message", "function_call", "function_call", "message"]
    final = events[-1]["response"]["output"]
    assert events[-1]["type"] == "response.completed" and [o["id"] for o in final] == [e["item"]["id"] for e in done]
    assert [o["status"] for o in final] == ["completed", "incomplete", "incomplete", "completed"]
    for e in events:  # every delta lands on the item at its output_index
        if e["type"].endswith(".delta"):
            assert e["item_id"] == added[e["output_index"]]["item"]["id"], e
    texts = "".join(o["content"][0]["text"] for o in final if o["type"] == "message")
    assert texts == whole["output"][0]["content"][0]["text"] == reply
    assert [json.loads(o["arguments"]) for o in final[1:3]] == [{"zone": "UTC"}, {"zone": "CET"}]


def _chat_chunks(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("extra,n_calls", [({"n": 2, "logprobs": True, "top_logprobs": 1}, 2),
                                           ({"parallel_tool_calls": False}, 1), ({"tool_choice": "none"}, 0)],
                         ids=["n2-logprobs", "not-parallel", "none"])
def test_streamed_calls_of_each_choice_join_to_its_whole_message(engine, extra, n_calls):
    """Streamed with several choices and logprobs, parallel_tool_calls false, tool_choice none: each choice's
    chunks (its own call indexes from 0, a call's id, type and name in its first delta only) join to that choice's
    whole message (content, calls, finish_reason, logprobs); a second call never streams when calls are not
    parallel; "none" streams the calls' text as content. (The arguments are written otherwise than json.dumps
    writes them: the pieces join to the whole message's arguments all the same.)"""
    reply = ('Ok.<tool_call>{"name": "get_weather", "arguments": {"city":"Paris" ,"days": 2}}</tool_call>'
             '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    body = forced_chat_body(MESSAGES, reply, 300, tools=TOOLS, **extra)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser="hermes")) as base:
        whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"]
        chunks = _chat_chunks(base, body)
    assert len(whole) == extra.get("n", 1)
    for c in whole:
        assert len(c["message"].get("tool_calls") or []) == n_calls
        assert c["message"]["content"] == ("Ok." if n_calls else reply)
        deltas = [x for chunk in chunks for x in chunk["choices"] if x["index"] == c["index"]]
        calls = joined_tool_calls(deltas)
        assert [x["function"] for x in calls] == [x["function"] for x in c["message"].get("tool_calls") or []]
        assert joined_deltas(deltas, "content") == c["message"]["content"]
        assert deltas[-1]["finish_reason"] == c["finish_reason"] == ("tool_calls" if n_calls else "stop")
        assert all(p["type"] == "function" and p["function"]["name"] for d in deltas
                   for p in d["delta"].get("tool_calls") or [] if "id" in p)
        if "logprobs" in extra:
            streamed = [t for d in deltas if d.get("logprobs") for t in d["logprobs"]["content"]]
            assert [t["token"] for t in streamed] == [t["token"] for t in c["logprobs"]["content"]]


def test_responses_stream_of_reasoning_then_calls_is_the_whole_responses_items_in_order(engine):
    """/v1/responses streamed with a reasoning parser: the reasoning item, the message, then each call, added and
    done in that order at consecutive output_index values (sequence_number counting every event), the completed
    response's output the whole (non-streamed) response's items."""
    reply = ('<think>Hmm.</think>Ok.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
             '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    body = {"input": "time?", "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "guided_regex": re.escape(reply), "max_output_tokens": 300, "temperature": 0}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser="hermes",
                                reasoning_parser="deepseek_r1")) as base:
        whole = httpx.post(f"{base}/v1/responses", json=body, timeout=120).json()
        events = _responses_events(base, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = ["reasoning", "message", "function_call", "function_call"]
    assert [o["type"] for o in whole["output"]] == kinds
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["type"] for e in added] == [e["item"]["type"] for e in done] == kinds
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == [0, 1, 2, 3]
    assert events.index(done[0]) < events.index(added[1]) and events.index(done[1]) < events.index(added[2])
    final = events[-1]["response"]["output"]
    assert [o["id"] for o in final] == [e["item"]["id"] for e in done]
    strip = ("id", "call_id")  # (each response its own ids)
    assert [{k: v for k, v in o.items() if k not in strip} for o in final] == [
        {k: v for k, v in o.items() if k not in strip} for o in whole["output"]]
