"""Reasoning on the chat endpoint, split from the answer as vLLM's `--reasoning-parser` splits it: the text a
thinking model writes between <think> and </think> goes to the message's `reasoning` field (the name current vLLM
writes, in a whole message and in a streamed delta; older vLLM wrote `reasoning_content`), what follows the tags to
`content`, which alone the tool-call parser then reads (serve/tools.py). /v1/completions is left as it is.
- deepseek_r1: the chat template opens the block (it ends the prompt with <think>), so a reply that does not start
  with the tag is reasoning from its first character; a reply without </think> (cut short) is all reasoning.
- qwen3: the same rules (Qwen3.5 and the thinking releases open the block in the prompt too), except that with
  `chat_template_kwargs: {"enable_thinking": false}` the reply is all content (the template closed the block).
  SmolLM3's <think> block splits so too (its template reads enable_thinking; with thinking off it closes the block).
- deepseek_v3: deepseek_r1's rules when `chat_template_kwargs` `thinking` (or `enable_thinking`) is true
  (DeepSeek-V3.1's template thinks only when asked), else the reply is all content, as vLLM's deepseek_v3 splits it.
- kimi_k2: the same, thinking unless `thinking` is false (Kimi-K2 Thinking's default), and the "(no content)" Kimi
  writes before calls left out of the content (a content of blanks alone is null), as vLLM's kimi_k2 parser.
- exaone4: deepseek_r1's rules when `chat_template_kwargs: {"enable_thinking": true}` asks EXAONE 4.0 to think; without
  it (its template's default) the reply is all content, as vLLM's exaone4 parser splits it.
- mistral: Magistral's [THINK]...[/THINK] (special tokens), reasoning only in a reply that starts with [THINK] (a
  reply without it is all content, as vLLM's mistral parser reads it; one cut short in the block all reasoning).
- hunyuan_a13b: Hunyuan's `<think>\n...\n</think>\n<answer>\n...\n</answer>` (see _hunyuan_parts).
- seed_oss: deepseek_r1's rules with Seed-OSS's tags, <seed:think> and </seed:think> (vLLM's SeedOSSReasoningParser).
- olmo3: deepseek_r1's rules (Olmo 3 Think's template may open the block), a reasoning or content left empty null.
- ernie45: deepseek_r1's rules for ERNIE 4.5 Thinking's `abc\n</think>\n\n<response>\ndef\n</response>\n`: an
  answer wrapped in <response>...</response> is the text inside (what follows </response> dropped, as vLLM's).
- glm45: GLM-4.5's <think>...</think>, reasoning only in a reply that starts with <think> (vLLM's glm45 stream: a
  reply without it is all content); with thinking off its template closes the block in the prompt. With this rule
  (glm45, mistral, apertus, cohere_command) a block the prompt's last turn left open (a continued final message's
  "<think>ab") makes the reply reasoning up to the closing tag.
- apertus: Apertus's <|inner_prefix|>...<|inner_suffix|> (special tokens), mistral's rules: a reply that writes no
  block (a plain answer, a tool call) is all content.
- cohere_command: Command A Reasoning's <|START_THINKING|>...<|END_THINKING|> (special tokens), mistral's rules,
  and the answer's <|START_RESPONSE|>...<|END_RESPONSE|> wrapper left out of the content.
- granite: Granite 3.x's plain-text markers: a reply that starts with "Here is my thought process:" (or "Here's")
  reasons up to "Here is my response:" (or "Here's"), the rest is the content; a reply that does not start so is
  all content, one cut short before its response marker all reasoning (vLLM's stream; its whole reply made it
  content).
A prompt that already ends its think block (its last tag is </think>, as Qwen3's with thinking off) leaves the reply
all content too, with either parser (vLLM's prompt_is_reasoning_end; the prompt's last turn only, after its last
special token: GLM-4.5's template closes a block in each earlier assistant turn), and so does a reply constrained to
JSON or a choice (response_format, structured_outputs, a named or "required" tool_choice): the constraint holds from
its first token (vLLM's waits for the end of the reasoning), so it is all answer; a regex or a grammar may write the
think block itself and is split as any reply. The opening tag is read at the start of the reply only (after
whitespace: GLM-4.5 writes "\\n<think>"), so that the streamed deltas add up to the whole reply's fields (vLLM's
whole-reply parsers also drop whatever came before a <think> found further on).
- openai_gptoss: gpt-oss's harmony format, whose reply is messages on channels rather than a think block:
  `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...` (the template's
  prompt ends with `<|start|>assistant`). The analysis channel's text is the reasoning (several analysis messages
  joined by a newline, as vLLM joins them), the other channels' the content; its markers are special tokens, which
  stay in the text with this parser (the split reads them). A reply cut short in a message keeps what it wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..engine.structured import StructuredOutputsParams

THINK_START, THINK_END = "<think>", "</think>"  # the tags of deepseek_r1 and qwen3
PROMPT_TAIL_TOKENS = 16  # how much of the prompt's end is read for a think block it opens or closes


@dataclass(frozen=True)
class ReasoningRequest:
    parser: str  # a key of PARSERS
    ended: bool = False  # the reply is all content: thinking off (qwen3), or the prompt closed the block
    include: bool = True  # vLLM's include_reasoning: false leaves the reasoning out (the content is split from it)
    # a parser whose block opens in the reply (needs_start): the prompt's last turn (a continued final message) opened
    # it, so the reply is reasoning from its first character, up to the closing tag
    opened: bool = False


# harmony's markers (openai_gptoss): a message's header opens with <|start|> (the role) or <|channel|>, its text follows
# <|message|> and ends at <|end|> (or the reply's last token: <|return|>, a tool call's <|call|>)
_H_START, _H_CHANNEL, _H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_H_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_H_MARKERS = (_H_START, _H_CHANNEL, _H_MESSAGE, "<|constrain|>", *_H_ENDS)
_H_LONGEST = max(map(len, _H_MARKERS))
_H_TO = "to="  # a header's recipient (the reply's first header may start with it)
_H_NEXT = re.compile("|".join(re.escape(m) for m in (*_H_ENDS, _H_START, _H_CHANNEL)))  # where a message's text ends
_H_SPACES = re.compile(" *")
_BLANKS = re.compile(r"\s*")  # (str.lstrip's whitespace)


def _read_on(text: str, memo: dict | None, key: tuple) -> dict | None:
    """The state kept in `memo` under `key` for a read of a text that `text` goes on (a stream's reply, read again
    at each token), cleared when `text` does not go on the last text (read fresh); None without a memo."""
    if memo is None:
        return None
    state = memo.setdefault(key, {})
    last = state.get("text")
    if last is None or not (text is last or len(text) >= len(last) and text.startswith(last)):
        state.clear()
    state["text"] = text
    return state


def _find(text: str, tag: str, start: int, state: dict | None, last: bool = False) -> int:
    """text.find(tag, start) (text.rfind with `last`), looked for in the text the last read (`state`'s: _read_on) did
    not have: no scan of the whole reply at each token."""
    if state is None:
        return text.rfind(tag, start) if last else text.find(tag, start)
    seen, at = state.get((tag, start, last), (start, -1))
    if at < 0 or last:
        k = text.rfind(tag, max(start, seen - len(tag) + 1)) if last else text.find(
            tag, max(start, seen - len(tag) + 1))
        at = k if k >= 0 else at
    state[(tag, start, last)] = (len(text), at)
    return at


def harmony_messages(text: str, finished: bool, memo: dict | None = None) -> list[tuple[str, str, bool]]:
    """(header, text, ended) of each message of a harmony reply, in order: the header is what precedes <|message|>
    ("<|channel|>final", "<|start|>assistant to=functions.f<|channel|>commentary json"; "" for text outside any
    message), `ended` whether an end marker (<|end|>, <|return|>, <|call|>) closed it. The reply's first header may
    be " to=functions.f<|channel|>commentary json" (after the prompt's `<|start|>assistant`). Not `finished`: a tail
    that may still become a marker ("<|en") held back, a header not yet closed by <|message|> left out. `memo`: see
    harmony_read."""
    return harmony_read(text, finished, memo)[0]


def harmony_read(text: str, finished: bool, memo: dict | None = None) -> tuple[list[tuple[str, str, bool]], int,
                                                                                dict]:
    """(harmony_messages's messages, how many of the first ones are closed (no longer text can change them), the
    read's state, where a reader keeps what it made of those closed messages). `memo`: a dict a stream keeps for its
    reply (the same one at each token): a read of a text that goes on the last one's goes on from where that one
    stopped (the closed messages kept, markers looked for in the new text alone); any other text is read fresh. A
    memo read equals a fresh one."""
    end, lead = len(text), _H_SPACES.match(text).end()
    if not finished:
        if end - lead <= len(_H_TO) and _H_TO.startswith(text[lead:]):  # (" to": the first header's " to=f" yet)
            if memo is not None:
                memo.pop(("harmony", finished), None)
            return [], 0, {}
        at = text.find("<", max(0, end - _H_LONGEST + 1))  # (every marker starts with "<")
        while at >= 0:
            if any(m.startswith(text[at:]) for m in _H_MARKERS):
                end = at  # (read up to it: no copy of the reply)
                break
            at = text.find("<", at + 1)
    state = memo.setdefault(("harmony", finished), {}) if memo is not None else {}
    last = state.get("text")
    if last is not None and len(text) == len(last) and end == state["end"] and text.startswith(last):
        return list(state["messages"]), len(state["done"]), state  # (the same text read again)
    if last is None or len(text) < len(last) or end < state["end"] or not text.startswith(last):
        state.clear()  # (not the last text grown: read fresh)
        state.update(done=[], at=0, head=None, scan=0)
    done, at, head, scan, opened = state["done"], state["at"], state["head"], state["scan"], None
    while at < end:
        found = head
        if found is None:  # (the message's header, its text's start)
            # (the reply's first header may start with its recipient, the prompt having written `<|start|>assistant`)
            if text.startswith((_H_START, _H_CHANNEL), at, end) or (at == 0 and text.startswith(_H_TO, lead, end)):
                k = text.find(_H_MESSAGE, max(at, scan), end)
                if k < 0:
                    scan = max(at, end - len(_H_MESSAGE) + 1)
                    break  # a header without its text (yet)
                found = (text[at:k], k + len(_H_MESSAGE))
            else:
                found = ("", at)
            scan = found[1]
        stop = _H_NEXT.search(text, max(found[1], scan), end)  # (one scan: a find per marker for each message)
        if stop is None:  # the reply's last message, open
            opened = (found[0], text[found[1]:end], False)
            # (its start kept unless a longer text may still make it a header: "<|chan", the first " t")
            rest = text[at:end] if end - at < _H_LONGEST else ""
            if not (rest and (_H_START.startswith(rest) or _H_CHANNEL.startswith(rest)) or (
                    at == 0 and end - lead < len(_H_TO) and _H_TO.startswith(text[lead:end]))):
                head, scan = found, max(found[1], end - _H_LONGEST + 1)
            else:
                scan = at
            break
        n = len(stop.group()) if stop.group() in _H_ENDS else 0
        done.append((found[0], text[found[1]:stop.start()], n > 0))
        at, head, scan = stop.start() + n, None, stop.start() + n
    state.update(text=text, end=end, at=at, head=head, scan=scan, messages=done + ([opened] if opened else []))
    return list(state["messages"]), len(done), state


def harmony_channel(header: str) -> str:
    """The channel a harmony message's header names ("" without one)."""
    channel = header.split(_H_CHANNEL, 1)[1] if _H_CHANNEL in header else ""
    return channel.split("<|", 1)[0].strip().split(" ", 1)[0]  # (" to=functions.f", <|constrain|>)


def _harmony_parts(text: str, finished: bool, memo: dict | None = None) -> tuple[str, str]:
    """(reasoning, content) of a harmony reply: each message's text by its channel (analysis: reasoning, joined by
    newlines; the others: content); text outside any message (no header) is content (see harmony_messages). `memo`:
    harmony_read's; the closed messages' parts are kept in it."""
    messages, closed, kept = harmony_read(text, finished, memo)
    n, reasoning, content = kept.get("parts", (0, None, ""))  # (reasoning None: no analysis message yet)
    for k in range(n, len(messages)):
        header, body, _ = messages[k]
        if header and harmony_channel(header) == "analysis":
            reasoning = body if reasoning is None else reasoning + "\n" + body
        else:
            content += body
        if k < closed:
            kept["parts"] = (k + 1, reasoning, content)
    return reasoning or "", content


# hunyuan_a13b: Hunyuan's reply "<think>\n...\n</think>\n<answer>\n...\n</answer>" (vLLM's HunyuanA13BReasoningParser)
_HY_THINK, _HY_ANSWER, _HY_END = "<think>\n", "\n</think>\n<answer>\n", "\n</answer>"


def _less_tag_start(text: str, tag: str | tuple[str, ...], finished: bool) -> str:
    """`text` less an end that may still become `tag` ("\n</th"; one of the tags, a tuple), while the reply goes on
    (held as stop strings are)."""
    if not finished:
        alike = (tag,) if isinstance(tag, str) else tag
        for k in range(min(max(map(len, alike)) - 1, len(text)), 0, -1):
            if any(t.startswith(text[-k:]) for t in alike):
                return text[:-k]
    return text


def _hunyuan_parts(text: str, finished: bool, memo: dict | None = None) -> tuple[str, str]:
    """(reasoning, content) of a Hunyuan reply, as vLLM's hunyuan_a13b parser reads a whole one: a reply that starts
    with "<think>\n" reasons up to "\n</think>\n<answer>\n" (its no-think form, "<think>\n\n</think>\n<answer>\n",
    none), and the answer after it is the content, up to "\n</answer>" (what follows that is dropped, as vLLM's
    regex drops it); a reply that does not start so is content up to "\n</answer>". Two differences keep the streamed
    deltas adding up to the whole reply's fields (vLLM's stream and whole reply disagree there): a think block is
    read at the reply's start only, and one cut short (no answer tag) is all reasoning, as deepseek_r1's (vLLM's
    whole reply makes it content, tags included; its stream, reasoning)."""
    reasoning, rest, state = "", 0, _read_on(text, memo, ("parts", finished))  # (rest: where the answer starts)
    if text.startswith(_HY_THINK):
        at = _find(text, _HY_ANSWER, len(_HY_THINK), state)
        if at < 0:
            return _less_tag_start(text[len(_HY_THINK):], _HY_ANSWER, finished), ""
        reasoning, rest = text[len(_HY_THINK):at], at + len(_HY_ANSWER)
    elif not finished and _HY_THINK.startswith(text):
        return "", ""
    end = _find(text, _HY_END, rest, state)
    return reasoning, text[rest:end] if end >= 0 else _less_tag_start(text[rest:] if rest else text, _HY_END, finished)


# granite: Granite 3.x writes its reasoning and its answer after plain-text markers (vLLM's GraniteReasoningParser)
_GR_THINK = ("Here is my thought process:", "Here's my thought process:")
_GR_RESPONSE = ("Here is my response:", "Here's my response:")


def _granite_parts(text: str, finished: bool, memo: dict | None = None) -> tuple[str, str]:
    """(reasoning, content) of a Granite reply: one that starts with a thought-process marker reasons up to the
    first response marker, whose rest is the content; one that does not start so is all content. The markers are
    read at the reply's start, after blanks (the thought's), and anywhere after it (the response's), so that a
    stream's parts only grow: vLLM's whole reply finds the thought marker anywhere (dropping what came before it),
    its stream at the reply's very first character only (a thought marker mid-reply is content there, as here), and
    its whole reply makes a reply without a response marker all content (its stream: reasoning, as here)."""
    lead = _BLANKS.match(text).end()  # (blanks before the marker: vLLM's whole reply finds it after them too)
    opener = next((m for m in _GR_THINK if text.startswith(m, lead)), None)
    if opener is None:
        head = text[lead:lead + max(map(len, _GR_THINK)) + 1]  # (a text longer than a marker is none of its starts)
        return ("", "") if not finished and any(m.startswith(head) for m in _GR_THINK) else ("", text)
    body, state = lead + len(opener), _read_on(text, memo, ("parts", finished))
    found = min(((at, m) for m in _GR_RESPONSE for at in [_find(text, m, body, state)] if at >= 0), default=None)
    if found is None:
        return _less_tag_start(text[body:], _GR_RESPONSE, finished), ""
    return text[body:found[0]], text[found[0] + len(found[1]):]


def _unwrapped(parser: str, content: str, finished: bool, state: dict | None = None, k: int = 0) -> str:
    """The answer `content` less the wrapper its parser's model writes around it (PARSERS' "wrap": ERNIE's
    <response>...</response>, Command A's <|START_RESPONSE|>...<|END_RESPONSE|>): where it opens the answer (after
    whitespace) the text inside, up to the closing tag (what follows that dropped, as vLLM's); an answer that does
    not open with it stays as written. Not `finished`: a start that may still become the wrapper held back. `k`:
    the answer is content[k:] (read in place); `state`: a stream's (_read_on), whose tags are looked for in the
    text its last read did not have."""
    wrap = PARSERS[parser].get("wrap")
    if wrap is None:
        return _dropped(parser, content, finished, state, k)
    start, end = wrap
    lead = _BLANKS.match(content, k).end()
    if not content.startswith(start, lead):
        head = content[lead:lead + len(start) + 1]  # (a text longer than the tag is none of its starts)
        return "" if not finished and start.startswith(head) else content[k:] if k else content
    inner = lead + len(start)
    if PARSERS[parser].get("wrap_last"):  # up to the last closing tag (ERNIE: vLLM's rfind), what follows one held
        at = _find(content, end, inner, state, last=True)
        if not finished:
            return _less_tag_start(content[inner:at] if at >= 0 else content[inner:], end, False)
        return content[inner:at] if at >= 0 else content[inner:]
    at = _find(content, end, inner, state)
    return content[inner:at] if at >= 0 else _less_tag_start(content[inner:], end, finished)


def _dropped(parser: str, content: str, finished: bool, state: dict | None, k: int) -> str:
    """The answer content[k:] less each of its parser's "drop" texts (Kimi's "(no content)"), as vLLM's kimi_k2
    cleans it; an answer of blanks alone is none (null, as vLLM's). Not `finished`: a tail that may still become one
    held back. `state`: a stream's (_read_on): each drop looked for in the text its last read did not have."""
    drop = PARSERS[parser].get("drop")
    if drop is None:
        return content[k:] if k else content
    seen, found = state.get(("drop", k), (k, ())) if state is not None else (k, ())
    found = list(found)
    at = content.find(drop, max(k, seen - len(drop) + 1, found[-1] + len(drop) if found else k))
    while at >= 0:
        found.append(at)
        at = content.find(drop, at + len(drop))
    if state is not None:
        state[("drop", k)] = (len(content), tuple(found))
    ends = [k] + [at + len(drop) for at in found]
    out = "".join(content[a:b] for a, b in zip(ends, found + [len(content)]))
    out = _less_tag_start(out, drop, finished)
    return "" if out.isspace() else out


# --reasoning-parser: the parsers vLLM names so, whether chat_template_kwargs.enable_thinking false turns thinking
# off (vLLM's qwen3 reads it; the others do not), and the tags that open and close the block; a parser of no think
# block (tags None) has its own split of the reply (text, finished) -> (reasoning, content): openai_gptoss reads
# gpt-oss's harmony channels, whose markers are special tokens ("keeps_special": kept in the text with it), granite
# its plain-text markers
PARSERS = {"deepseek_r1": {"reads_enable_thinking": False, "tags": (THINK_START, THINK_END)},
           "qwen3": {"reads_enable_thinking": True, "tags": (THINK_START, THINK_END)},
           "seed_oss": {"reads_enable_thinking": False, "tags": ("<seed:think>", "</seed:think>")},
           "openai_gptoss": {"reads_enable_thinking": False, "tags": None, "split": _harmony_parts,
                             "keeps_special": True, "memo": True},  # (memo: its split takes a stream's memo)
           # EXAONE 4.0: deepseek_r1's rules with chat_template_kwargs enable_thinking true, else all content (its
           # template thinks only when asked: vLLM's exaone4 reads enable_thinking, false when absent)
           "exaone4": {"reads_enable_thinking": True, "thinking_by_default": False, "tags": (THINK_START, THINK_END)},
           # Magistral (vLLM's mistral parser): [THINK]...[/THINK], a reply without [THINK] all content (no template
           # opens the block); the tags are special tokens of its tokenizer, kept in the text for the split
           "mistral": {"reads_enable_thinking": False, "tags": ("[THINK]", "[/THINK]"), "needs_start": True},
           # (the tags a prompt may close the block with: Hunyuan's no-think template)
           "hunyuan_a13b": {"reads_enable_thinking": False, "tags": (THINK_START, THINK_END), "split": _hunyuan_parts,
                            # (its reply's other tags: no turn's boundary)
                            "marks": ("<answer>", "</answer>"), "memo": True},
           # Olmo 3 Think: deepseek_r1's rules; an empty reasoning or content is null, as vLLM's olmo3 writes them
           "olmo3": {"reads_enable_thinking": False, "tags": (THINK_START, THINK_END), "empty_is_null": True},
           # ERNIE 4.5 Thinking: deepseek_r1's rules, its answer in <response>...</response> ("wrap": the content's
           # own wrapper, left out; its tags are read as the think tags are, special tokens or not)
           "ernie45": {"reads_enable_thinking": False, "tags": (THINK_START, THINK_END),
                       "wrap": ("<response>", "</response>"), "wrap_last": True},
           # GLM-4.5/4.6: <think> opens the block in the reply (its template closes it in the prompt with thinking off)
           "glm45": {"reads_enable_thinking": False, "tags": (THINK_START, THINK_END), "needs_start": True},
           # Apertus: its tokenizer's special tokens; a reply that writes no block is content (vLLM's apertus)
           "apertus": {"reads_enable_thinking": False, "tags": ("<|inner_prefix|>", "<|inner_suffix|>"),
                       "needs_start": True},
           # Command A Reasoning: its thinking tokens, the answer wrapped in its response tokens (special tokens)
           "cohere_command": {"reads_enable_thinking": False, "tags": ("<|START_THINKING|>", "<|END_THINKING|>"),
                              "needs_start": True, "wrap": ("<|START_RESPONSE|>", "<|END_RESPONSE|>")},
           # Granite 3.x: plain-text markers, no think block (the template asks for them with thinking true)
           "granite": {"reads_enable_thinking": False, "tags": None, "split": _granite_parts, "memo": True},
           # DeepSeek-V3.1/V3.2 (vLLM's deepseek_v3): deepseek_r1's rules when chat_template_kwargs thinking (or
           # enable_thinking) is true, else all content ("thinking_keys": the kwargs read, either true thinks)
           "deepseek_v3": {"reads_enable_thinking": True, "thinking_keys": ("thinking", "enable_thinking"),
                           "thinking_by_default": False, "tags": (THINK_START, THINK_END)},
           # Kimi-K2 Thinking (vLLM's kimi_k2): the same, thinking unless chat_template_kwargs thinking is false, and
           # the "(no content)" Kimi writes for an answer that is only calls left out of the content ("drop")
           "kimi_k2": {"reads_enable_thinking": True, "thinking_keys": ("thinking",), "thinking_by_default": True,
                       "tags": (THINK_START, THINK_END), "drop": "(no content)"}}


def tags(parser: str) -> tuple[str, str] | None:
    """The (opening, closing) tags of the reasoning block `parser` splits (None: a parser of no think block)."""
    return PARSERS[parser]["tags"]


def prompt_ends_reasoning(prompt_ids: list[int], tokenizer, parser: str = "deepseek_r1") -> bool:
    """Whether the prompt's last think tag (the parser's) closes the block (Qwen3's template with thinking off
    writes "<think>\\n\\n</think>\\n\\n" where the reply starts): the model then writes no reasoning."""
    if tags(parser) is None:
        return False  # no think block (harmony: the template closes each message of an earlier turn)
    start, end = tags(parser)
    text = _last_turn(prompt_ids, tokenizer, parser)
    return text.rfind(end) > text.rfind(start)


def prompt_opens_reasoning(prompt_ids: list[int], tokenizer, parser: str) -> bool:
    """Whether the prompt's last turn leaves a think block (the parser's) open: its last tag opens it."""
    if tags(parser) is None:
        return False
    start, end = tags(parser)
    text = _last_turn(prompt_ids, tokenizer, parser)
    return text.rfind(start) > text.rfind(end)


def _last_turn(prompt_ids: list[int], tokenizer, parser: str) -> str:
    """The text of the prompt's end (its last PROMPT_TAIL_TOKENS tokens) where the reply's turn starts."""
    tail = prompt_ids[-PROMPT_TAIL_TOKENS:]
    # the last turn only: what follows the tail's last special token that is not a tag (GLM-4.5's <|assistant|>,
    # Qwen3's <|im_start|>), as vLLM's glm45 reads back to <|assistant|>: an earlier turn's closed block
    # (GLM-4.5's template writes "<think></think>" in each earlier assistant turn) does not end this reply's
    named = _special_tokens(tokenizer) - {*tags(parser), *PARSERS[parser].get("wrap", ()),
                                          *PARSERS[parser].get("marks", ())}
    if named:
        pieces = tokenizer.convert_ids_to_tokens(tail)
        turn = max((k + 1 for k, piece in enumerate(pieces) if piece in named), default=0)
        tail = tail[turn:]
    return tokenizer.decode(tail, skip_special_tokens=False)


def _special_tokens(tokenizer) -> set[str]:
    """The tokenizer's special tokens (named, and the added tokens it marks special)."""
    named = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    try:
        named.update(t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
                     if getattr(t, "special", False))
    except Exception:  # no added-token table to read: the named special tokens
        pass
    return named


def tags_are_skipped(tokenizer, parser: str = "deepseek_r1") -> bool:
    """Whether the tokenizer's opening or closing tag (the parser's: <think>, </think>) is a special token, which
    the reply's text (skip_special_tokens) leaves out: the split could not see where the block ends (a fine-tune's
    tokenizer that added them as special)."""
    named = _special_tokens(tokenizer)
    return any(tag in named for tag in (*(tags(parser) or ()), *PARSERS[parser].get("wrap", ())))


def keeps_special_tokens(parser: str, tokenizer) -> bool:
    """Whether the reply's text must keep its special tokens for `parser` to split it: harmony's markers always
    (they are gpt-oss's special tokens), think tags (and an answer's wrapper: ERNIE's <response>) where the tokenizer
    made them special (`tags_are_skipped`); granite's plain-text markers never."""
    if PARSERS[parser].get("keeps_special"):
        return True
    return tags(parser) is not None and tags_are_skipped(tokenizer, parser)


def reasoning_request(parser: str | None, body: dict, prompt_ids: list[int], tokenizer,
                      structured=None) -> ReasoningRequest | None:
    """The request's reasoning split (None without --reasoning-parser, where include_reasoning changes nothing, as
    in vLLM). `body`: the chat body, its chat_template_kwargs already checked to be an object (or absent), its
    include_reasoning a boolean (or absent); `structured`: the reply's constraint (StructuredOutputsParams or its
    dict), if any."""
    if parser is None:
        return None
    include = body.get("include_reasoning") is not False
    kwargs = body.get("chat_template_kwargs") or {}
    # the template's enable_thinking: chat_template_kwargs', else reasoning_effort's (as vLLM passes it); a parser
    # of its own keys (deepseek_v3's thinking) reads them alone, thinking when one of those sent is true
    keys = [k for k in PARSERS[parser].get("thinking_keys", ()) if k in kwargs]
    if "thinking_keys" in PARSERS[parser]:
        thinking = any(bool(kwargs[k]) for k in keys) if keys else PARSERS[parser]["thinking_by_default"]
    else:
        thinking = kwargs["enable_thinking"] if "enable_thinking" in kwargs else body.get(
            "reasoning_effort") != "none" and PARSERS[parser].get("thinking_by_default", True)
    off = PARSERS[parser]["reads_enable_thinking"] and not thinking
    kind = StructuredOutputsParams.of(structured).kind if structured is not None else None
    off = off or kind in ("json", "json_object", "choice")
    ended = off or prompt_ends_reasoning(prompt_ids, tokenizer, parser) or continues_content(body, parser)
    # (a block the reply need not open: the prompt, or the final message continued, left one open)
    opened = bool(PARSERS[parser].get("needs_start")) and not ended and (
        prompt_opens_reasoning(prompt_ids, tokenizer, parser) or _continued(body, parser) is False)
    return ReasoningRequest(parser, ended=ended, include=include, opened=opened)


def continues_content(body: dict, parser: str = "deepseek_r1") -> bool:
    """Whether the reply continues a final assistant message's content (continue_final_message; a Responses
    `incomplete` message sent back): content written, no think block left open in it, means the reasoning is over
    (a template that leaves the message's reasoning out shows no closing tag for prompt_ends_reasoning to see), so
    the continuation is content, not reasoning."""
    return _continued(body, parser) is True


def _continued(body: dict, parser: str) -> bool | None:
    """Of a reply that continues a final assistant message with content: True where that content closed its think
    block or opened none (the continuation is answer), False where it left one open (reasoning); None for any other
    reply."""
    messages = body.get("messages")
    if not body.get("continue_final_message") or not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    content = last.get("content")
    if isinstance(content, list):
        content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    if not isinstance(content, str) or not content.strip():
        return None
    if tags(parser) is None:
        return True  # no think block to leave open: content written is the answer
    start, end = tags(parser)
    return content.rfind(start) <= content.rfind(end)


def parts(req: ReasoningRequest, text: str, finished: bool = True, memo: dict | None = None) -> tuple[str, str]:
    """(reasoning, content) of the reply `text`. Not `finished` (a stream): only what can go out now, less a start
    that may still become the opening tag ("<thi") and an end of the reasoning that may be the start of the
    closing one ("</th"), held back as stop strings are; each part only grows as the text does. `memo`: a dict the
    stream keeps for this reply, read on from at each token (harmony's messages; the others' tags looked for in the
    text the last read did not have)."""
    own = PARSERS[req.parser].get("split")
    if own is not None and not req.ended:
        return own(text, finished, memo) if PARSERS[req.parser].get("memo") else own(text, finished)
    state = _read_on(text, memo, ("parts", finished))  # (each tag looked for in the new text alone)
    if req.ended:
        return "", _unwrapped(req.parser, text, finished, state)
    start, end = tags(req.parser)
    lead = _BLANKS.match(text).end()  # (whitespace before the opening tag: GLM-4.5 writes "\n<think>")
    body = 0  # (where the reasoning starts)
    if req.opened:
        pass  # the prompt opened the block: reasoning from the first character
    elif text.startswith(start, lead):
        body = lead + len(start)
    elif not finished and start.startswith(text[lead:lead + len(start) + 1]):  # (a longer text: none of its starts)
        return "", ""
    elif PARSERS[req.parser].get("needs_start"):
        return "", _unwrapped(req.parser, text, finished, state)  # no block opened: all content
    at = _find(text, end, body, state)
    if at >= 0:
        return text[body:at], _unwrapped(req.parser, text, finished, state, at + len(end))
    # no closing tag (yet, or the reply was cut short): reasoning
    return _less_tag_start(text[body:] if body else text, end, finished), ""


def split(req: ReasoningRequest, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished reply as vLLM's message has them: reasoning null when there is none;
    content null when the reply stops at (or before) the closing tag."""
    if req.ended:
        content = _unwrapped(req.parser, text, True)
        return None, content or None if PARSERS[req.parser].get("drop") else content
    reasoning, content = parts(req, text)
    # (a parser of its own split, or olmo3's: an empty reasoning null, as vLLM's)
    own = tags(req.parser) is None or "split" in PARSERS[req.parser] or PARSERS[req.parser].get("empty_is_null")
    unopened = PARSERS[req.parser].get("needs_start") and not req.opened and not text.lstrip().startswith(
        tags(req.parser)[0])  # (no block: null)
    return (reasoning or None) if own or unopened else reasoning, content or None
