"""Session 63 (p63rtstream): review of forced-call streaming and the incremental (memo) reads of
serve/toolstream.py. A named call whose reply holds a raw control character in a string (xgrammar lets a string
with a length bound hold one) sent its text raw up to it, while the whole reply's arguments were that JSON written
again by json.dumps (another layout): the pieces did not join to the whole call. The whole reply now escapes such a
character in place (its layout kept) and the stream sends the same escape. And json_prefix's memo kept the text up
to a number it had read as whole, not the character after it that told it so: a later text that changed that
character (not a continuation of the last one: a tail rewritten) went on from the memo and read otherwise than a
fresh read."""

from __future__ import annotations

import json
import random

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.serve.tools import parse_tools  # noqa: E402
from infer.serve.toolstream import partial_calls  # noqa: E402

from helpers import joined_tool_calls  # noqa: E402
from test_probes_session62_stream import REPLIES, TOOLS  # noqa: E402
from test_probes_session63_tstream import (LONG_TOOLS, _chat, _forced, _joined, _streamed,  # noqa: E402,F401
                                           base, engine)

# arguments with escaped quotes and backslashes, unicode escapes (a surrogate pair), "\/", numbers json.dumps writes
# otherwise (2.50, -0, 1E3), nested objects and arrays, empty ones
HARD = ('{"city": "P\\"a\\\\r\\u00e9\\ud83d\\ude00 x\\/y", "o": {"a": [1, 2.50, -0, 1E3, true, null, {"b": []}], '
        '"c": {}}}')
FORCED = {"named": [HARD, " \n" + HARD + "\n ", '{\t"city": "a\tb\x03", "zone": "c"}',
                    '{ "city" : "\u00e9\t" ,"o":{"a":[1,{"b":"\\u0041\t"}]}}'],
          "required": ['[{"name": "get_weather", "parameters": ' + HARD + '}\n ,\n{"name":"get_time","parameters":'
                       '{"zone":"x"}}]', ' [ {"name":"get_time" , "parameters" : { } } ] ',
                       '[{"name": "get_weather", "parameters": {"city": "a\tb"}}, {"name": "get_time", "parameters":'
                       ' {"zone": "\\u00e9"}}]']}


def _cuts(reply: str, seed: int) -> list[int]:
    """Uneven ends of a streamed reply's text: a tag, an escape or a call over many pieces, two calls in one."""
    rng, out, k = random.Random(seed), [], 0
    while k < len(reply):
        out.append(k)
        k += rng.choice([1, 1, 2, 3, 5, 9, 30, 70])
    return out


@pytest.mark.parametrize("mode,reply", [(m, r) for m, replies in FORCED.items() for r in replies])
def test_a_forced_calls_uneven_pieces_join_to_the_whole_call(mode, reply):
    """Pieces cut anywhere (an escape, a surrogate pair, a number, a raw control character) join to the whole
    reply's calls, as the OpenAI SDK joins them; a raw control character in a string is escaped as the whole reply
    escapes it (strict JSON), the named reply's layout kept."""
    req = _forced(mode)
    for seed in range(4):
        pieces, whole = _streamed(req, reply, _cuts(reply, seed))
        assert whole and [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]
        assert len(whole) == (1 if mode == "named" else reply.count('"name"'))
    args = whole[0]["function"]["arguments"]
    value = json.loads(reply, strict=False)
    assert json.loads(args) == (value if mode == "named" else value[0]["parameters"])  # (strict)
    if mode == "named":  # the reply's own layout, its raw control characters (in strings alone) escaped in place
        assert args.replace("\\t", "\t").replace("\\u0003", "\x03") == reply


def _rewritten(reply: str, seed: int) -> list[str]:
    """The texts of a stream whose tail is not always final: now and then the text so far less a few characters, or
    with one character that a later text has otherwise (a partial character's U+FFFD, a stray byte)."""
    rng, out = random.Random(seed), []
    for k in _cuts(reply, seed):
        out.append(reply[:k])
        x = rng.random()
        if x < 0.2:
            out.append(reply[:max(0, k - rng.randint(1, 8))])
        elif x < 0.5:
            out.append(reply[:k] + rng.choice(["\ufffd", "}", "]", ",", "\\", '"', " "]))
    return out


READS = [(_forced(m), r) for m, replies in FORCED.items() for r in replies] + [
    (parse_tools({"tools": TOOLS}, p), r) for p, replies in sorted(REPLIES.items()) for r in replies]


@pytest.mark.parametrize("req,reply", READS, ids=[f"{q.name or q.mode}-{k}" for k, (q, _) in enumerate(READS)])
def test_a_memo_reads_a_text_whose_tail_was_rewritten_as_a_fresh_read(req, reply):
    """The stream's memo, read on by a text that is not the last one grown (its tail rewritten: a number the last
    text ended with a character after, now followed by more digits or a ".", "1\ufffd" then "1.5"): each read is a
    fresh read's."""
    for seed in range(6):
        memo = {}
        for text in _rewritten(reply, seed):
            assert partial_calls(req, text, memo) == partial_calls(req, text), text


def test_a_number_read_whole_by_the_character_after_it_is_read_again_when_that_character_changes():
    req = _forced("required")
    head = '[{"name": "get_weather", "parameters": {"city": "x", "days": 2'
    memo = {}
    partial_calls(req, head + "\ufffd", memo)  # (the "2" read whole: a character that is no digit follows)
    assert partial_calls(req, head + ".5}}]", memo) == partial_calls(req, head + ".5}}]") == [
        ("get_weather", '{"city": "x", "days": 2.5}')]
    named = _forced("named")
    partial_calls(named, '{"city": "a\t', memo := {})
    assert partial_calls(named, '{"city": "a\\', memo) == [("get_weather", '{"city": "a')]  # (an escape not whole)


# ------------------------------------------------------------------------------------------- served
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_served_forced_calls_of_several_choices_each_stream_their_own_calls(base, choice):
    """n 2, parallel calls allowed: each choice's calls at indexes from 0, a call's id, type and name in its first
    delta only, each id its own, the pieces joined as the SDK joins them the whole choice's calls."""
    body = {"messages": [{"role": "user", "content": "Time?"}], "max_tokens": 200, "temperature": 0,
            "tools": LONG_TOOLS, "tool_choice": choice, "n": 2}
    whole, deltas = _chat(base, body)
    ids = []
    for c in whole:
        mine = [d for d in deltas if d["index"] == c["index"]]
        calls = c["message"]["tool_calls"]
        assert calls and c["finish_reason"] == mine[-1]["finish_reason"] == "tool_calls"
        pieces = [p for d in mine for p in d["delta"].get("tool_calls") or []]
        firsts = [p for p in pieces if "id" in p]
        assert [p["index"] for p in firsts] == list(range(len(calls)))
        assert all(p["type"] == "function" and p["function"]["name"] for p in firsts)
        assert all("name" not in p["function"] and "type" not in p for p in pieces if "id" not in p)
        assert [x["function"] for x in joined_tool_calls(mine)] == [x["function"] for x in calls]
        ids += [p["id"] for p in firsts]
    assert len(set(ids)) == len(ids)
