"""Streaming a reply with tools or a reasoning parser reads each step's new text alone: the characters a step scans
(str.find and its kin) or copies (a slice of the reply) stay within the new text plus a constant, at replies of 1k
and 32k characters, for every --tool-call-parser, the forced calls and every --reasoning-parser (they looked for
their tags from the reply's start, and copied it into their memos, at each token: time quadratic in the reply). The
reply is a str subclass that counts what each step does with it; a memo's check that the text goes on the last one
(one comparison with that text, at C speed) is counted apart, a few a step. Each memo read equals a fresh one."""

from __future__ import annotations

import random

import pytest

from infer.bench.toolstream import FORCED, TOOLS, replies
from infer.serve import reasoning as r
from infer.serve.tools import parse_tools, split, visible
from infer.serve.toolstream import CallStream, partial_calls

SLACK = 400  # what a step may read beyond its new text: a tag's width (its starts tried at the text's end), a name


class Counted(str):
    """A reply whose reads are counted: `scanned` the characters its searches went over (up to the hit), `copied`
    those its slices copied (each slice a Counted too), `checks` its comparisons with an earlier step's text (a
    memo's)."""

    scanned = copied = checks = 0

    @classmethod
    def reset(cls) -> None:
        cls.scanned = cls.copied = cls.checks = 0

    def _span(self, start, end) -> tuple[int, int]:
        return slice(start, end).indices(len(self))[:2]

    def find(self, sub, start=None, end=None):
        a, b = self._span(start, end)
        at = str.find(self, sub, a, b)
        Counted.scanned += (at + len(sub) if at >= 0 else b) - a
        return at

    def rfind(self, sub, start=None, end=None):
        a, b = self._span(start, end)
        at = str.rfind(self, sub, a, b)
        Counted.scanned += b - (at if at >= 0 else a)
        return at

    def index(self, sub, start=None, end=None):
        at = self.find(sub, start, end)
        if at < 0:
            raise ValueError("substring not found")
        return at

    def __contains__(self, sub):
        return self.find(sub) >= 0

    def startswith(self, prefix, start=None, end=None):
        if isinstance(prefix, Counted):  # (an earlier step's text: a memo's check)
            Counted.checks += 1
        else:
            Counted.scanned += max(map(len, prefix)) if isinstance(prefix, tuple) else len(prefix)
        return str.startswith(self, prefix, *(x for x in (start, end) if x is not None))

    def endswith(self, suffix, *a):
        Counted.scanned += max(map(len, suffix)) if isinstance(suffix, tuple) else len(suffix)
        return str.endswith(self, suffix, *a)

    def __getitem__(self, k):  # (a slice is counted too: what is read in it counts)
        out = str.__getitem__(self, k)
        Counted.copied += len(out)
        return Counted(out) if isinstance(k, slice) else out

    def _whole(self, out):
        Counted.scanned += len(self)
        return out

    def split(self, *a):
        return [Counted(x) for x in self._whole(str.split(self, *a))]

    def replace(self, *a):
        return Counted(self._whole(str.replace(self, *a)))

    def __add__(self, other):  # (a copy: what is read in it counts)
        Counted.copied += len(self) + len(other)
        return Counted(str.__add__(self, other))

    def __radd__(self, other):
        Counted.copied += len(self) + len(other)
        return Counted(str(other) + str(self))

    def _stripped(self, out):
        Counted.scanned += len(self) - len(out) + 1
        Counted.copied += len(out) if len(out) < len(self) else 0
        return Counted(out)

    def strip(self, *a):
        return self._stripped(str.strip(self, *a))

    def lstrip(self, *a):
        return self._stripped(str.lstrip(self, *a))

    def rstrip(self, *a):
        return self._stripped(str.rstrip(self, *a))

    def isspace(self):
        Counted.scanned += len(self) - len(str.lstrip(self)) + 1
        return str.isspace(self)


def _steps(reply: str, step: int, read) -> list[tuple[int, int, int]]:
    """(characters scanned, copied, memo checks) of each step of a stream of `reply`, `step` characters at a time,
    each step's text read by `read`."""
    out = []
    for k in range(step, len(reply) + step, step):
        text = Counted(reply[:k])
        Counted.reset()
        read(text)
        out.append((Counted.scanned, Counted.copied, Counted.checks))
    return out


def _check_linear(costs: list[tuple[int, int, int]], step: int, copies: bool = True) -> None:
    """Each step reads its new text and a constant, but for a few: a call that ended, read whole once (a few copies
    of its text), and the steps a call's tag takes to come (the content before it, less the tag's start, goes out
    as a copy at each); the whole stream reads each character a few times (a read of each step's whole text made
    it about the reply's length times the steps over 2)."""
    work = [s + (c if copies else 0) for s, c, _ in costs]
    over = [k for k, w in enumerate(work) if w > step + SLACK]
    assert len(over) <= 4 + 16 // step, (len(over), max(work), len(costs))
    assert sum(work) <= 16 * step * len(costs) + SLACK * len(costs), sum(work)
    assert max(n for _, _, n in costs) <= 6, max(n for _, _, n in costs)


STEPS = {1000: 2, 32000: 16}  # (characters a step: a token's few, more at 32k to keep the test short)
CALLS = [p for p in replies(1) if p != "reasoning"]  # (the bench's replies of a call: "reasoning" thinks first)


@pytest.mark.parametrize("chars", sorted(STEPS))
@pytest.mark.parametrize("parser", CALLS)
def test_a_tool_stream_step_reads_its_new_text_alone(parser, chars):
    """visible (what goes out as content) and partial_calls (the calls so far) at each step of the bench's reply
    of `parser` (a long string argument): no step scans or copies the reply again."""
    reply = replies(chars)[parser]
    body = {"tools": TOOLS, **({"tool_choice": FORCED[parser]} if parser in FORCED else {})}
    req = parse_tools(body, "hermes" if parser in FORCED else parser)
    stream, memo = CallStream(req), {}

    def read(text):
        if req.mode == "auto":
            visible(req, text, memo)
        stream.deltas(partial_calls(req, text, stream.memo))

    # (openai: harmony_read hands each message's text out, the open one's a copy of it at each step: its searches
    # alone are counted, as the reasoning split's)
    _check_linear(_steps(reply, STEPS[chars], read), STEPS[chars], copies=parser != "openai")
    assert stream.sent  # (the call streamed)


# a reply of each reasoning parser: its reasoning, its closing tag, its answer (each `n` characters)
def _thinking(parser: str, n: int) -> str:
    body = "think about <it>. " * (n // 18)
    if parser == "openai_gptoss":
        return "<|channel|>analysis<|message|>" + body + "<|end|><|start|>assistant<|channel|>final<|message|>" + body
    if parser == "granite":
        return "Here is my thought process:" + body + "Here is my response:" + body
    if parser == "hunyuan_a13b":
        return "<think>\n" + body + "\n</think>\n<answer>\n" + body + "\n</answer>"
    start, end = r.tags(parser)
    wrap = r.PARSERS[parser].get("wrap", ("", ""))
    return start + body + end + "\n" + wrap[0] + body + wrap[1]


@pytest.mark.parametrize("chars", sorted(STEPS))
@pytest.mark.parametrize("parser", list(r.PARSERS))
def test_a_reasoning_stream_step_looks_for_its_tags_in_the_new_text_alone(parser, chars):
    """The reasoning split (serve/reasoning.py's parts) at each step of a long reasoning then a long answer: no
    step looks for a tag over the reply again. (The parts it returns are the whole reasoning and content so far,
    copies of the reply: only the searches are counted.)"""
    reply, memo = _thinking(parser, chars), {}
    req = r.ReasoningRequest(parser)
    costs = _steps(reply, STEPS[chars], lambda text: r.parts(req, text, False, memo))
    _check_linear(costs, STEPS[chars], copies=False)
    assert r.parts(req, reply, True, memo) == r.parts(req, reply)


def _cuts(n: int, seed: int) -> list[int]:
    rng, ends, k = random.Random(seed), [], 0
    while k < n:
        k = min(n, k + rng.choice((1, 2, 3, 5, 8, 13)))
        ends.append(k)
    return ends


def _variants(parser: str) -> list[str]:
    """Short replies of `parser` whose tags may be split across steps: the usual one, one cut in its reasoning, one
    with blanks before its tag, one without any tag, and a tag written twice."""
    whole = _thinking(parser, 60)
    return [whole, whole[:len(whole) // 2], "\n " + whole, "just an answer </think> here", whole + whole]


@pytest.mark.parametrize("how", ["plain", "opened", "ended"])
@pytest.mark.parametrize("parser", list(r.PARSERS))
def test_a_memo_read_of_the_reasoning_split_equals_a_fresh_one(parser, how):
    """At every prefix, cut unevenly, a stream's read (its memo) splits as a fresh read of the same text does, and
    a memo of another text is not read on (a shorter text, one whose tail changed)."""
    req = r.ReasoningRequest(parser, ended=how == "ended", opened=how == "opened" and r.tags(parser) is not None)
    for seed, reply in enumerate(_variants(parser)):
        memo = {}
        for k in _cuts(len(reply), seed):
            for finished in (False, True):
                assert r.parts(req, reply[:k], finished, memo) == r.parts(req, reply[:k], finished), reply[:k]
        other = reply[:len(reply) // 3] + "</answer></response>" + reply[len(reply) // 3:]
        for k in (len(reply) // 2, len(other), 3):
            assert r.parts(req, other[:k], False, memo) == r.parts(req, other[:k], False), other[:k]


@pytest.mark.parametrize("parser", [p for p in CALLS if p not in FORCED])
def test_a_memo_read_of_the_content_equals_a_fresh_one(parser):
    """visible with the stream's memo goes out as a fresh read of the same text at every prefix (content before a
    call's tag, a tail that may be its start held), and reads a text that is not the last one grown afresh."""
    req = parse_tools({"tools": TOOLS}, parser)
    call = replies(40)[parser]
    for seed, reply in enumerate(("Some text first. " + call, "a < b <tool_c then " + call + " after", call)):
        memo = {}
        for k in _cuts(len(reply), seed):
            assert visible(req, reply[:k], memo) == visible(req, reply[:k]), reply[:k]
        assert visible(req, "other text", memo) == "other text"


@pytest.mark.parametrize("chars", sorted(STEPS))
@pytest.mark.parametrize("parser", ["hermes", "mistral", "qwen3_coder", "seed_oss", "phi4_mini_json", "olmo3",
                                    "ernie45", "glm45"])
def test_long_content_before_a_call_is_looked_through_once(parser, chars):
    """A reply that writes `chars` characters of text before its call: what goes out as content (visible) and the
    calls (none yet) look for the call's tag in each step's new text alone, the content before the tag kept once
    the tag has come."""
    req = parse_tools({"tools": TOOLS}, parser)
    reply = "Let me run it, as asked. " * (chars // 25) + replies(200)[parser]
    stream, memo = CallStream(req), {}

    def read(text):
        visible(req, text, memo)
        stream.deltas(partial_calls(req, text, stream.memo))

    _check_linear(_steps(reply, STEPS[chars], read), STEPS[chars])
    assert stream.sent and visible(req, reply, memo) == visible(req, reply)


@pytest.mark.parametrize("chars", sorted(STEPS))
def test_mistrals_calls_of_their_own_tags_are_read_on(chars):
    """Mistral's newer syntax, `[TOOL_CALLS]name[ARGS]{...}` a call: each tag looked for in the new text alone, the
    open call's arguments read in place (the reply was split at its tags at each token), a call the next one's tag
    ended read once."""
    code = replies(chars)["named"][len('{"code": "'):-len('", "n": 3}')]
    reply = '[TOOL_CALLS]run[ARGS]{"n": 1}[TOOL_CALLS]run[ARGS]{"code": "' + code + '", "n": 3}'
    req = parse_tools({"tools": TOOLS}, "mistral")
    stream = CallStream(req)
    _check_linear(_steps(reply, STEPS[chars], lambda text: stream.deltas(partial_calls(req, text, stream.memo))),
                  STEPS[chars])
    assert [s[2] for s in stream.sent] == [c["function"]["arguments"] for c in split(req, reply)[1]]
    assert len(stream.sent) == 2
