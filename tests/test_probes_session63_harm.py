"""gpt-oss (harmony) replies streamed with the stream's memo (serve/reasoning.py's harmony_read): each read goes on
from where the last one stopped, and reads as a fresh read of the same text would, at every prefix, however the
reply is cut (markers split across steps, uneven pieces) or rewritten (a tail that changes, a shorter text)."""

from __future__ import annotations

import random

import pytest

from infer.serve import reasoning as r
from infer.serve.reasoning import ReasoningRequest, harmony_messages, parts
from infer.serve.tools import harmony_calls, parse_tools, split, visible

from test_probes_session62_stream import ARGS, TOOLS  # noqa: E402
from test_probes_session63_tstream import _joined, _streamed  # noqa: E402

REPLIES = {
    # analysis, a commentary preamble, two calls (parallel), the final answer
    "whole": "<|channel|>analysis<|message|>Think <about> it.<|end|><|start|>assistant<|channel|>commentary"
             "<|message|>Let me check.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
             "<|message|>" + ARGS + "<|call|><|start|>assistant<|channel|>commentary to=functions.get_time"
             '<|constrain|>json<|message|>{"zone": "x"}<|call|><|start|>assistant<|channel|>final<|message|>'
             "It is <|sunny|>.<|return|>",
    # the first header's recipient (after the prompt's <|start|>assistant), the call open at the reply's end
    "first": ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "Europe/Paris", "n": [1, 2.5]}',
    # headers of <|channel|> alone, each message closed by the next header (no end marker)
    "channels": "<|channel|>analysis<|message|>a < b<|channel|>final<|message|>b<|end|><|channel|>analysis"
                "<|message|>more<|end|><|channel|>final<|message|>c",
    # a call closed by the next message's header, not by <|call|>; a call of text that is not JSON
    "unended": '<|channel|>commentary to=functions.get_time<|message|>{"zone": "x"}<|start|>assistant<|channel|>'
               "commentary to=functions.get_weather<|message|>not json<|call|><|start|>assistant<|channel|>final"
               "<|message|>done",
    "plain": "No markers here: a < b and c <| d.",
}
REQ = ReasoningRequest("openai_gptoss")
TOOLS_REQ = parse_tools({"tools": TOOLS}, "openai")


def _cuts(text: str, how) -> list[int]:
    """Where a stream of `text` stops at each step: every `how` characters, or uneven pieces (a seed)."""
    if isinstance(how, int):
        return list(range(0, len(text) + 1, how)) + [len(text)]
    rng, ends, k = random.Random(how), [], 0
    while k < len(text):
        k = min(len(text), k + rng.choice((1, 2, 3, 5, 8, 13)))
        ends.append(k)
    return ends


def _reads(text: str, finished: bool, memo: dict | None) -> tuple:
    """Every harmony read of a stream's step: the messages, the reasoning split, the calls (ids left out: each
    call made gets a new one) and content, what goes out as content."""
    content, calls = harmony_calls(text, finished, memo)
    return (harmony_messages(text, finished, memo), parts(REQ, text, finished, memo), content,
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
            None if finished else visible(TOOLS_REQ, text, memo))


def _check_memo_reads(texts: list[str], finished: bool) -> None:
    memo = {}
    for text in texts:
        assert _reads(text, finished, memo) == _reads(text, finished, None), (text, finished)


@pytest.mark.parametrize("name", REPLIES)
@pytest.mark.parametrize("how", [1, 3, 7, "seed0", "seed1"])
@pytest.mark.parametrize("finished", [False, True])
def test_a_memo_read_equals_a_fresh_read_at_every_prefix(name, how, finished):
    text = REPLIES[name]
    _check_memo_reads([text[:k] for k in _cuts(text, how)], finished)


@pytest.mark.parametrize("name", REPLIES)
@pytest.mark.parametrize("finished", [False, True])
def test_a_rewritten_tail_or_a_shorter_text_is_read_fresh(name, finished):
    text, rng, texts = REPLIES[name], random.Random(name), []
    for k in _cuts(text, 2):
        texts.append(text[:k])
        if rng.random() < 0.3:  # (a tail the next step writes otherwise: a detokenizer's held character, a marker)
            texts.append(text[:max(0, k - rng.choice((1, 3, 9)))] + rng.choice(("\ufffd", "<|end|>", "<|chan", "x")))
        if rng.random() < 0.1:
            texts.append(text[:k // 2])
    _check_memo_reads(texts, finished)


# ("unended" left out: its first call, closed by the next header without <|call|>, streams as a call while the
# whole reply reads it as content, as before the memo)
@pytest.mark.parametrize("name", [n for n in REPLIES if n != "unended"])
@pytest.mark.parametrize("how", [1, 4, "seed2"])
def test_streamed_pieces_join_to_the_whole_reply(name, how):
    """The calls' pieces join to the whole reply's calls (each step's read checked against a fresh one); the
    content and reasoning read with the memo only grow, and end as the whole reply's."""
    text = REPLIES[name]
    pieces, whole = _streamed(TOOLS_REQ, text, _cuts(text, how))
    assert [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]
    memo, sent, shown = {}, ("", ""), ""
    for k in _cuts(text, how):
        now, content = parts(REQ, text[:k], False, memo), visible(TOOLS_REQ, text[:k], memo)
        assert now[0].startswith(sent[0]) and now[1].startswith(sent[1]) and content.startswith(shown), text[:k]
        sent, shown = now, content
    finished = parts(REQ, text, True, memo)
    assert finished == tuple(x or "" for x in r.split(REQ, text)) and finished[0].startswith(sent[0])
    assert (split(TOOLS_REQ, text)[0] or "").startswith(shown)


NEXT = r._H_NEXT


class _Searches:
    """_H_NEXT, recording where each search starts."""

    def __init__(self):
        self.starts = []

    def search(self, text, at, end):
        self.starts.append(at)
        return NEXT.search(text, at, end)


def test_each_step_looks_for_markers_in_the_new_text_alone(monkeypatch):
    """A stream's reads (the reasoning split, the content, the calls) go on from the last one: no step searches
    the text the last one read again (a closed message is not read again, the open one from its new text)."""
    from infer.serve.toolstream import CallStream, partial_calls
    searches = _Searches()
    monkeypatch.setattr(r, "_H_NEXT", searches)
    text = REPLIES["whole"] + "<|start|>assistant<|channel|>final<|message|>" + "long answer " * 200
    memo, stream, last = {}, CallStream(TOOLS_REQ), 0
    for k in range(1, len(text) + 1):
        searches.starts.clear()
        parts(REQ, text[:k], False, memo), visible(TOOLS_REQ, text[:k], memo)
        partial_calls(TOOLS_REQ, text[:k], stream.memo)
        # (from the last text's end, less its tail held back as a marker's start and a marker that may cross it)
        assert min(searches.starts, default=last) >= last - 2 * r._H_LONGEST, (text[:k], searches.starts)
        last = k
