"""Session 62 (p62rstream): a review of streamed tool calls. A streamed reply is read again at each token: its
calls' JSON goes on from where the last read stopped (linear in the reply's length, not quadratic), the pieces the
same as a fresh read's; ..."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from infer.serve import toolstream  # noqa: E402
from infer.serve.tools import parse_tools, split  # noqa: E402
from infer.serve.toolstream import CallStream, json_prefix, partial_calls  # noqa: E402

from test_probes_session62_stream import ARGS, REPLIES, TOOLS  # noqa: E402

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
