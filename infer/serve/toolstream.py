"""Tool calls streamed as vLLM streams them: a call's id, type and name in a first delta, then its arguments as
string pieces (`delta.tool_calls[i].function.arguments`), each call at its own `index`. The pieces are what the
whole reply's parse (serve/tools.py, `split`) writes, so that a client that joins them gets exactly the
non-streamed call: the model's JSON is written again as that parse writes it (json.dumps), a piece going out only
once no later text can change it (a number, true/false/null when whole; a string's characters as they come, an
escape when whole). A call's header goes out only once the reply has shown it is one (hermes: its "arguments" key
seen after its name), nothing that a reply that turns out to be text would have to take back. What cannot be known
early stays held: pythonic's and (qwen3_coder, seed_oss) a parameter's typed value until it is whole; a call whose
arguments are not written in the usual order (hermes: "arguments" before "name") until it is whole. A forced call
streams as vLLM's: a named tool_choice's arguments as the constrained reply writes them (they are its text),
"required"'s list a call at a time. Each read goes on from where the last one stopped (the stream's memo): a call
whose text has ended is read once, tags are looked for in the new text alone.
Known limits, as in vLLM's streaming: a call that later turns out malformed (the model writes garbage after its
arguments, max_tokens cuts it), or whose arguments repeat a key, has already sent what it wrote before that."""

from __future__ import annotations

import itertools
import json
import logging
import re
from typing import Any

from . import tools as t
from .reasoning import harmony_messages

log = logging.getLogger("infer.serve")

_WS = re.compile(r"\s*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_WORDS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_HEX = re.compile(r"[0-9a-fA-F]{4}")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')


def _dumped(raw: str) -> str:
    """json.dumps's text (no quotes) of the JSON string body `raw` (whole escapes only): written a character at a
    time, so the texts of a string's pieces join to the whole string's."""
    return json.dumps(json.loads('"' + raw + '"'), ensure_ascii=False)[1:-1]


def _string(raw: str, at: int, k: int | None = None, head: str = '"') -> tuple[str, int | None, int]:
    """(the JSON text json.dumps writes for the string starting at raw[at] == '"', so far; the index after its
    closing quote, None while it is open; where its text so far ends in `raw`). A partial escape, or a high
    surrogate's escape whose pair may follow, is held. Resumed at `k` (an earlier read's end of the same string,
    `head` its text). ValueError when it is not a JSON string (a raw control character, a bad escape)."""
    k = safe = at + 1 if k is None else k
    start = k
    while k < len(raw):
        c = raw[k]
        if c == '"':
            return head + _dumped(raw[start:k]) + '"', k + 1, k + 1
        if c == "\\":
            if k + 1 >= len(raw):
                break
            if raw[k + 1] == "u":
                if len(raw) < k + 6:
                    break
                if not _HEX.fullmatch(raw[k + 2:k + 6]):
                    raise ValueError("a bad \\u escape")
                k += 6
                if 0xD800 <= int(raw[k - 4:k], 16) <= 0xDBFF and len(raw) < k + 6:
                    break  # a pair's first half: the next escape may join it
            elif raw[k + 1] in '"\\/bfnrt':
                k += 2
            else:
                raise ValueError("a bad escape")
        elif ord(c) < 0x20:
            raise ValueError("a control character in a string")
        else:
            k = _PLAIN.match(raw, k).end()  # (the characters that need no care, at once)
        safe = k
    return head + _dumped(raw[start:safe]), None, safe


def json_prefix(raw: str, at: int = 0, nan: bool = False, memo: dict | None = None) -> tuple[str, int | None]:
    """(what json.dumps(json.loads(raw[at:...]), ensure_ascii=False) of the JSON value starting at raw[at] (after
    blanks) surely starts with, so far; the index after the value when it is whole, else None). A piece of `raw`
    that is not JSON (yet or for good) stops it there, as do NaN, Infinity and a number too large for a float (1e400:
    the whole reply's parse refuses them, serve/tools.py) unless `nan` (Python's json.loads reads them).
    `memo`: where a read of the same text, shorter, stopped, kept there: a read that starts with its text goes on
    from there (a streamed reply read again at each token, in time linear in its length)."""
    state = memo.get((at, nan)) if memo is not None else None
    if state is not None and (raw is state[0] or len(raw) >= state[6] and raw.startswith(state[0])):
        k, stack, expect, out, opened = state[1], list(state[2]), state[3], [state[4]], state[5]
        if expect == "done":
            return out[0], k
    else:
        k, stack, expect, out, opened = at, [], "value", [], None  # expect: value, item (a value or "]"), key (a
        # key or "}"), name (a key), colon, next

    def stop(end: int | None, string: tuple | None = None) -> tuple[str, int | None]:
        text = "".join(out)
        if memo is not None:  # (string: an open one's (start, read so far, its text); the read goes on from there)
            # (the text read is kept as given, no copy: a later read goes on from it when its text starts with it)
            memo[(at, nan)] = (raw, k, tuple(stack), "done" if end is not None else expect, text, string, len(raw))
        return text + (string[2] if string else ""), end

    while True:
        if opened is None:
            k = _WS.match(raw, k).end()
            if k >= len(raw):
                return stop(None)
            c = raw[k]
        else:
            c = '"'
        if expect == "colon":
            if c != ":":
                return stop(None)
            out.append(": ")
            k, expect = k + 1, "value"
            continue
        if expect == "next":
            if c == "," and stack:
                out.append(", ")
                k, expect = k + 1, "value" if stack[-1] == "[" else "name"
                continue
            if c in "]}" and stack and c == {"[": "]", "{": "}"}[stack[-1]]:
                out.append(c)
                stack.pop()
                k += 1
                if not stack:
                    return stop(k)
                continue
            return stop(None)
        if c in "]}" and expect in ("item", "key") and c == {"item": "]", "key": "}"}[expect]:
            out.append(c)
            stack.pop()
            k, expect = k + 1, "next"
            if not stack:
                return stop(k)
            continue
        if c == '"':
            try:
                text, end, safe = _string(raw, k) if opened is None else _string(raw, k, opened[1], opened[2])
            except ValueError:
                return stop(None)
            opened = None
            if end is None:
                return stop(None, (k, safe, text))
            out.append(text)
            k = end
            if expect in ("key", "name"):
                expect = "colon"
                continue
        elif expect in ("key", "name"):
            return stop(None)
        elif c in "[{":
            out.append(c)
            stack.append(c)
            k, expect = k + 1, "item" if c == "[" else "key"
            continue
        else:
            number = _NUMBER.match(raw, k)
            word = next((w for w in _WORDS if raw.startswith(w, k)), None) if nan else next(
                (w for w in _WORDS[:3] if raw.startswith(w, k)), None)
            end = k + len(word) if word else number.end() if number else None
            if end is None or end >= len(raw):  # not a value, or one that may still grow ("12" of "123", "Infinit")
                return stop(None)
            if raw[end].isalnum() or raw[end] in ".+-_":
                return stop(None)
            value = json.loads(raw[k:end])
            if not nan and value in (float("inf"), float("-inf")):
                return stop(None)
            out.append(json.dumps(value, ensure_ascii=False))
            k = end
        if not stack:
            return stop(k)
        expect = "next"


# the usual head of a JSON call: its name first, then its arguments' key
_HEAD = {"hermes": re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"arguments"\s*:\s*'),
         "llama3_json": re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"parameters"\s*:\s*'),
         "mistral": re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"arguments"\s*:\s*'),
         "phi4_mini_json": re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*'
                                      r'"(?:arguments|parameters)"\s*:\s*')}
_HEAD["internlm"] = _HEAD["phi4_mini_json"]  # (InternLM2's object: its name, then its parameters or arguments)


def _json_call(kind: str, raw: str, at: int = 0, memo: dict | None = None) -> tuple[tuple[str, str] | None,
                                                                                  int | None]:
    """((name, arguments so far) of the JSON call at raw[at], or None before its head is whole; the index after the
    call's object when it is whole). `memo`: json_prefix's, for this `raw`."""
    head = _HEAD[kind].match(raw, at)
    if head is None:
        return None, None
    try:
        name = json.loads(head.group(1))
    except ValueError:
        return None, None
    k = _WS.match(raw, head.end()).end()
    if kind == "hermes" and k < len(raw) and raw[k] == '"':
        return (name, ""), None  # (a string: its text when it is JSON, else the string as JSON: known when whole)
    args, end = json_prefix(raw, k, memo=memo)
    if end is None:
        return (name, args), None
    return (name, args), json_prefix(raw, at, memo=memo)[1]  # (the call's other keys, if any, leave its arguments)


def _json_calls(kind: str, body: str, at: int, memo: dict, sep: str) -> list[tuple[str, str]]:
    """The JSON calls from body[at], one after another with `sep` between them (llama3_json's ";", the "," of
    mistral's list), as far as they are read."""
    out = []
    while True:
        call, end = _json_call(kind, body, at, memo)
        if call is None:
            return out
        out.append(call)
        if end is None:
            return out
        rest = _WS.match(body, end).end()
        if not body.startswith(sep, rest):
            return out
        at = rest + len(sep)


def _grown(text: str, memo: dict) -> dict:
    """The reads of `memo` kept for `text`: those of the text the last read had, which `text` goes on (a streamed
    reply); none when it does not. (The last text is kept as it was given: no copy.)"""
    last = memo.get("text")
    if last is None or len(text) < len(last) or not text.startswith(last):
        memo.clear()
    memo["text"] = text
    return memo.setdefault("whole", {})


def _hermes(text: str, memo: dict) -> list[tuple[str, str]]:
    """Each <tool_call> block's call: a block that has ended read once (kept), the open one in place (no copy of
    the reply at each token)."""
    out, whole = [], _grown(text, memo)
    at, n = _found(text, memo, "first", t.HERMES_START), 0
    while at >= 0:
        start = at + len(t.HERMES_START)
        if ("next", start) in whole:  # (a block the next one's tag ended: where that one starts, its own end)
            at, end = whole[("next", start)]
        else:  # the last block: its tags looked for in the text it did not have (the last read's: `seen`)
            last, seen, end = memo.get("last", (None, 0, -1))
            seen, end = (max(start, seen - len(t.HERMES_END)), end) if last == start else (start, -1)
            at = text.find(t.HERMES_START, seen)
            end = end if end >= 0 else text.find(t.HERMES_END, seen, len(text) if at < 0 else at)
            if at >= 0:
                whole[("next", start)] = (at, end)
            else:
                memo["last"] = (start, len(text), end)
        stop = len(text) if at < 0 else at
        if end < 0 and at < 0:  # the open block: the reply's end
            call, _ = _json_call("hermes", text, start, memo=memo.setdefault(n, {}))
        else:  # (a block cut by the next <tool_call> reads as far as it)
            if (start, end) not in whole:
                whole[(start, end)] = _json_call("hermes", text[start:end if end >= 0 else stop])[0]
            call = whole[(start, end)]
        if call is None:
            break
        out.append(call)
        if end < 0:
            break
        n += 1
    return out


def _llama3(text: str, memo: dict) -> list[tuple[str, str]]:
    # (read in place after the tag: no copy of the reply at each token)
    return _json_calls("llama3_json", text, len(t.LLAMA_START) if text.startswith(t.LLAMA_START) else 0, memo, ";")


def _found(text: str, memo: dict, key: str, tag: str, start: int = 0) -> int:
    """text.find(tag, start), looked for in the text the last read (of a text `text` goes on: _grown) did not have."""
    seen, at = memo.get(key, (0, -1))
    if at < 0:
        at = text.find(tag, max(start, seen - len(tag) + 1))
    memo[key] = (len(text), at)
    return at


def _all_found(text: str, memo: dict, key: Any, tag: str, start: int) -> list[int]:
    """Where each `tag` from `start` is in `text`, looked for in the text the last read (of a text `text` goes on:
    _grown) did not have."""
    k, found = memo.get(key, (start, []))
    at = text.find(tag, k)
    while at >= 0:
        found.append(at)
        k = at + len(tag)
        at = text.find(tag, k)
    memo[key] = (max(k, len(text) - len(tag) + 1), found)
    return found


def _mistral(text: str, memo: dict) -> list[tuple[str, str]]:
    _grown(text, memo)
    first = _found(text, memo, "first", t.MISTRAL_START)
    if first < 0:
        return []
    k = _WS.match(text, first + len(t.MISTRAL_START)).end()
    if text.startswith("[", k):  # the JSON list (read in place: no copy of the reply at each token)
        if _found(text, memo, "second", t.MISTRAL_START, k) >= 0:
            return []
        return _json_calls("mistral", text, k + 1, memo, ",")
    # `[TOOL_CALLS]name[ARGS]{...}` per call: a call the next one's tag ended read once (kept), the open one in place
    out, whole, starts = [], memo["whole"], _all_found(text, memo, "starts", t.MISTRAL_START, first)
    for n, at in enumerate(starts):
        at += len(t.MISTRAL_START)
        if n + 1 < len(starts) and ("call", at) in whole:
            call = whole[("call", at)]
        else:
            stop = starts[n + 1] if n + 1 < len(starts) else len(text)
            args = text.find(t.MISTRAL_ARGS, at, stop) if stop < len(text) else _found(
                text, memo, ("args", at), t.MISTRAL_ARGS, at)
            call = None
            if args >= 0:
                name = text[at:args].split(t.MISTRAL_CALL_ID, 1)[0].strip()
                k = _WS.match(text, args + len(t.MISTRAL_ARGS), stop).end()
                if t._MISTRAL_NAME.fullmatch(name) is not None and k < stop and text[k] == "{":
                    call = (name, json_prefix(text, k, memo=memo.setdefault(n, {}))[0] if stop == len(text) else
                            json_prefix(text[k:stop])[0])
            if stop < len(text):
                whole[("call", at)] = call
        if call is None:
            break
        out.append(call)
    return out


def _harmony(text: str, memo: dict) -> list[tuple[str, str]]:
    out = []
    for n, (header, body, ended) in enumerate(harmony_messages(text, False, memo)):
        recipient = t._HARMONY_RECIPIENT.search(header)
        if recipient is None:
            continue
        k = _WS.match(body).end()
        # a text that is not JSON is a call of that text as a JSON string, known when it ends: held until then
        args = json_prefix(body, k, nan=False, memo=memo.setdefault(n, {}))[0] if body[k:k + 1] in "{[" else ""
        out.append((recipient.group(1), args))
        if not ended:
            break
    return out


_PY_CALL_END = re.compile(r"\)(?=\s*[,\]])")
_PY_TRIES = 16  # (a ")" inside a string argument is no call's end: the ones before it are tried, a few)


def _pythonic(text: str, memo: dict) -> list[tuple[str, str]]:
    """The calls whose `)` has come (each whole: a literal is typed once whole)."""
    if text.startswith(t.PYTHON_START):
        text = text[len(t.PYTHON_START):].replace(t.PYTHON_END, "")
    reads = _grown(text, memo)  # (each end's read, kept: the same calls are not parsed again at each token)
    ends, at = memo.get("ends", ([], 0))  # (the ends found, where the text may still make one: read on from there)
    ends = ends + [m.start() for m in _PY_CALL_END.finditer(text, at)]
    at = len(text)
    while at > 0 and text[at - 1].isspace():
        at -= 1
    memo["ends"] = (ends, at - 1 if text[at - 1:at] == ")" else at)  # (a ")" that blanks alone follow: not known)
    for k in reversed(ends[-_PY_TRIES:]):  # the last end that closes a list of whole calls
        if k not in reads:
            parsed = t.pythonic_calls(text[:k + 1] + "]")
            reads[k] = None if parsed is None else [(x["function"]["name"], x["function"]["arguments"])
                                                    for x in parsed[1]]
        if reads[k] is not None:
            return list(reads[k])
    return []


def _xml_arguments(raw: str, functions: dict[str, Any], family: str) -> str | None:
    try:
        return t._xml_call(raw, functions, family)["function"]["arguments"]
    except ValueError:
        return None


def _xml(family: str, text: str, functions: dict[str, Any], memo: dict) -> list[tuple[str, str]]:
    """The calls whose `<function=NAME>` has come, each with its parameters whole so far (a parameter's value is
    typed once whole: one followed by the next <parameter= or by </function>). Each call's parameters read once
    (kept, `memo`); the open call's tags looked for in its new text alone."""
    out, whole, body = [], _grown(text, memo), 0
    if family == "seed_oss" and _found(text, memo, "think", t.SEED_THINK_START) >= 0:
        body = _found(text, memo, "thought", t.SEED_THINK_END)
        if body < 0:
            return []
        body += len(t.SEED_THINK_END)
    at = _found(text, memo, ("function", body), t.XML_FUNCTION, body)
    while at >= 0:
        start = at + len(t.XML_FUNCTION)
        # the last call: (its start, how far its text was read, its last <parameter=, whether its end came)
        # the last call: (its start, how far its text was read, its last <parameter=, where its </function> is)
        last, seen, cut, end = memo.get("last", (None, 0, -1, -1))
        if last != start:
            seen, cut, end = start, -1, -1
        seen = max(start, seen - len(t.XML_FUNCTION) - 1)
        if ("next", start) in whole:  # (a call the next one's tag ended: where that one starts)
            at = whole[("next", start)]
        else:
            at = text.find(t.XML_FUNCTION, seen)
            if at >= 0:
                whole[("next", start)] = at
        stop = len(text) if at < 0 else at
        name_end = text.find(">", start, stop)
        name = text[start:name_end]
        if name_end < 0 or not name or "<" in name or any(c.isspace() for c in name):
            break
        if at >= 0:  # (a call the next one's tag ended: up to its </function> if it has one, kept)
            if ("end", start) not in whole:
                found = text.find("</function>", name_end + 1, stop)
                whole[("end", start)] = found if found >= 0 else stop
            key = whole[("end", start)]
        else:
            seen = max(seen, name_end + 1)
            end = end if end >= 0 else text.find("</function>", seen)
            new = text.rfind("<parameter=", seen)
            cut = new if new >= 0 else cut
            memo["last"] = (start, len(text), cut, end)
            # the call's parameters up to its </function> (the text after it is no call's, as the whole reply
            # reads it), else before its open parameter ("{}" before its first)
            key = end if end >= 0 else cut if cut >= 0 else name_end + 1
        done = end >= 0 or at >= 0
        if (start, key) not in whole:  # (each call's text up to `key` read once: whether a parameter is open in it
            params = text[name_end + 1:key]  # (seed_oss: a parameter ends at its end tag alone), its arguments)
            whole[(start, key)] = (family == "seed_oss" and "<parameter=" in params and not params.rstrip().endswith(
                "</parameter>"), _xml_arguments(f"{name}>{params}", functions, family))
        held, args = whole[(start, key)]
        if not done and held:
            break
        if args is None:
            break
        out.append((name, args if done else args[:-1]))
        if not done:
            break
    return out


def _granite(text: str, memo: dict) -> list[tuple[str, str]]:
    """Granite's list of calls, read as mistral's (its calls are {"name", "arguments"} objects)."""
    at = t.granite_list(text)
    return [] if at is None else _json_calls("mistral", text, at + 1, memo, ",")


def _phi4_mini(text: str, memo: dict) -> list[tuple[str, str]]:
    """Phi-4-mini's list after its "functools[" (looked for in the new text alone), read as mistral's."""
    _grown(text, memo)
    at = _found(text, memo, "start", t.PHI4_START)
    return [] if at < 0 else _json_calls("phi4_mini_json", text, at + len(t.PHI4_START), memo, ",")


def _ernie45(text: str, memo: dict) -> list[tuple[str, str]]:
    """ERNIE's calls: each ended block's (read once: serve/tools.py's tagged_blocks, read on from where the last read
    stopped), then the open block's arguments as they come, read as hermes' (vLLM's ernie45 streams them; the whole
    reply drops a block the reply leaves open)."""
    state = _grown(text, memo)
    calls, bad = t.tagged_blocks(text, t._ernie_block, state)
    start = state["at"][1]
    if not bad and start >= 0:
        call, _ = _json_call("hermes", text, start + len(t.HERMES_START), memo=memo.setdefault(("open", start), {}))
        calls += [] if call is None else [call]
    return calls


def _glm45(text: str, functions: dict[str, Any], memo: dict) -> list[tuple[str, str]]:
    """GLM's calls: each ended block's (read once), then the open block's, its arguments as they come (vLLM's glm45
    streams them; the whole reply drops a block the reply leaves open)."""
    state = _grown(text, memo)
    calls, bad = t.tagged_blocks(text, lambda body: t._glm_block(body, functions), state)
    start = state["at"][1]
    if not bad and start >= 0:
        call = _glm_open(text, start + len(t.HERMES_START), functions, memo.setdefault(("open", start), {}))
        calls += [] if call is None else [call]
    return calls


_GLM_KEY_END, _GLM_VALUE, _GLM_VALUE_END = "</arg_key>", "<arg_value>", "</arg_value>"


def _glm_open(text: str, body: int, functions: dict[str, Any], memo: dict) -> tuple[str, str] | None:
    """(name, arguments so far) of the GLM block open at text[body:] once its name is whole: each key and value
    that ended as the whole reply writes it (typed by the schema), then a string parameter's value as it comes (a
    tail that may be its end tag held); any other value is held until it ends, and so is all that follows a key
    not followed by its value. `memo`: the block's, its tags looked for in the new text alone."""
    if "name" not in memo:
        ends = [k for k in (_found(text, memo, "line", "\n", body), _found(text, memo, "key", t.GLM_KEY, body))
                if k >= 0]
        if not ends:
            return None
        name = text[body:min(ends)].strip()
        if not name or "<" in name or any(c.isspace() for c in name):
            return None
        memo["name"] = (name, min(ends))
    name, pos = memo["name"]
    schema = functions.get(name)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    done, pos = memo.get("done", ((), pos))
    pieces = list(done)
    while True:
        key = _found(text, memo, ("key", pos), t.GLM_KEY, pos)
        key_end = _found(text, memo, ("key_end", key), _GLM_KEY_END, key) if key >= 0 else -1
        if key_end < 0:
            break
        start = _WS.match(text, key_end + len(_GLM_KEY_END)).end()
        if not text.startswith(_GLM_VALUE, start):
            break
        start += len(_GLM_VALUE)
        end = _found(text, memo, ("value_end", start), _GLM_VALUE_END, start)
        key_name = text[key + len(t.GLM_KEY):key_end].strip()
        head = json.dumps(key_name, ensure_ascii=False) + ": "
        if end >= 0:
            value = t._glm_typed(text[start:end], properties.get(key_name), key_name in properties, schema)
            pieces.append(head + json.dumps(value, ensure_ascii=False))
            pos = end + len(_GLM_VALUE_END)
            memo["done"] = (tuple(pieces), pos)
            continue
        if key_name in properties and t._kind(properties[key_name], schema) in t._STRING_KINDS:
            safe = len(text) - next((k for k in range(min(len(_GLM_VALUE_END) - 1, len(text) - start), 0, -1)
                                     if _GLM_VALUE_END.startswith(text[-k:])), 0)
            seen, escaped = memo.get(("text", start), (start, ""))
            if safe > seen:  # (the value's new characters written as json.dumps writes them, once)
                escaped += json.dumps(text[seen:safe], ensure_ascii=False)[1:-1]
                memo[("text", start)] = (safe, escaped)
            pieces.append(head + '"' + escaped)
        break
    return name, "{" + ", ".join(pieces)


def _olmo3(text: str, memo: dict) -> list[tuple[str, str]]:
    """Olmo 3's calls, each line's once the line has ended (a call whole: its literals are typed once whole), read
    once; all of them as the whole reply reads them once the </function_calls> after its <function_calls> has come
    (each tag looked for in the new text alone). A line that is no call stops the read there (the whole reply is
    then text)."""
    whole = _grown(text, memo)
    at = _found(text, memo, "start", t.OLMO_START)
    if at < 0:
        return []
    if _found(text, memo, "end", t.OLMO_END, at + len(t.OLMO_START)) < 0:
        pos, scan, calls, bad = whole.get("lines", (at + len(t.OLMO_START), at + len(t.OLMO_START), (), False))
        line_end = text.rfind("\n", scan) if not bad else -1
        if line_end >= pos:
            for line in text[pos:line_end].splitlines():  # (the lines as the whole reply splits them)
                parsed = t._python_calls("[" + line.strip() + "]", json_names=True) if line.strip() else []
                if parsed is None:
                    bad = True
                    break
                calls += tuple((c["function"]["name"], c["function"]["arguments"]) for c in parsed)
            pos = line_end + 1
        whole["lines"] = (pos, len(text), calls, bad)
        return list(calls)
    if "calls" not in whole:
        parsed = t.olmo3_calls(text)
        whole["calls"] = [] if parsed is None else [(c["function"]["name"], c["function"]["arguments"])
                                                    for c in parsed[1]]
    return list(whole["calls"])


def _between(text: str, memo: dict, sections: tuple[str, ...], begin: str, end: str, read, read_open) -> list:
    """The calls of a reply whose calls follow the first of its `sections` tokens, each between `begin` and `end`:
    each ended call's `read(its text)` (read once, kept), then the open one's `read_open(text, where its text
    starts)` (None: nothing yet), the tokens looked for in the new text alone. A call that does not read
    (ValueError), or a begin inside a call, stops the read there (the whole reply reads no call after it either)."""
    whole = _grown(text, memo)
    at = min((k for k in (_found(text, memo, ("section", s), s) for s in sections) if k >= 0), default=-1)
    if at < 0:
        return []
    done, k = whole.get("done", ((), at))
    out = list(done)
    while True:
        start = _found(text, memo, ("begin", k), begin, k)
        if start < 0:
            break
        body = start + len(begin)
        stop = _found(text, memo, ("end", body), end, body)
        inner = _found(text, memo, ("begin", body), begin, body)
        if stop >= 0 and not 0 <= inner < stop:  # an ended call: read once
            try:
                out.append(read(text[body:stop]))
            except (ValueError, RecursionError):
                break
            k = stop + len(end)
            whole["done"] = (tuple(out), k)
            continue
        call = read_open(text, body) if stop < 0 and inner < 0 else None
        out += [] if call is None else [call]
        break
    return out


def _sectioned(family: str, text: str, memo: dict) -> list[tuple]:
    """(name, arguments so far[, the id its text writes: Kimi's]) of each call of a DeepSeek or Kimi reply
    (serve/tools.py's SECTIONED; _between): the open one's arguments as they come once its head is whole and they
    open with "{"."""
    spec = t.SECTIONED[family]

    def read(raw: str) -> tuple:
        name, args, call_id = t.sectioned_block(spec, raw)
        return (name, args) if call_id is None else (name, args, call_id)

    def read_open(text: str, body: int) -> tuple | None:
        head = spec.head.match(text, body)
        if head is None:
            return None
        try:
            name, call_id = t.sectioned_head(spec, head)
        except ValueError:
            return None
        args = _WS.match(text, head.end()).end()
        if not text.startswith("{", args):
            return None
        args = json_prefix(text, args, memo=memo.setdefault(("args", body), {}))[0]
        return (name, args) if call_id is None else (name, args, call_id)

    return _between(text, memo, spec.sections, spec.begin, spec.end, read, read_open)


def _internlm(text: str, memo: dict) -> list[tuple[str, str]]:
    """InternLM2's one call, from the first "{" after its tags (each looked for in the new text alone); none once a
    second call's tags come (the whole reply is then text)."""
    _grown(text, memo)
    at = _found(text, memo, "start", t.INTERNLM_START)
    if at < 0 or _found(text, memo, "second", t.INTERNLM_START, at + len(t.INTERNLM_START)) >= 0:
        return []
    brace = _found(text, memo, "brace", "{", at + len(t.INTERNLM_START))
    end = _found(text, memo, "end", t.INTERNLM_END, at + len(t.INTERNLM_START))
    if brace < 0 or 0 <= end < brace:
        return []
    call, _ = _json_call("internlm", text, brace, memo=memo.setdefault("call", {}))
    return [] if call is None else [call]


def _xlam(text: str, memo: dict) -> list[tuple[str, str]]:
    """xLAM's calls as they come where the reply is (after blanks) its JSON list, read as mistral's, up to a call
    whose arguments are no object (kept as text by the whole reply: sent whole at the end); its other forms (a code
    block, a <tool_call>, after </think>) go out whole at the reply's end."""
    at = t._BLANKS.match(text).end()
    if not text.startswith("[", at):
        return []
    calls = _json_calls("mistral", text, at + 1, memo, ",")
    return list(itertools.takewhile(lambda call: not call[1] or call[1].startswith("{"), calls))


def _hunyuan(text: str, memo: dict) -> list[tuple[str, str]]:
    """Hunyuan's list after its first <tool_calls> (looked for in the new text alone), read as mistral's, up to a
    call whose arguments are no object; none where a <think> before it is still open (the whole reply looks for
    the calls outside think blocks)."""
    _grown(text, memo)
    at = _found(text, memo, "start", t.HUNYUAN_START)
    if at < 0:
        return []
    think = _found(text, memo, "think", "<think>")
    if 0 <= think < at and not 0 <= _found(text, memo, "thought", "</think>", think) < at:
        return []
    k = _WS.match(text, at + len(t.HUNYUAN_START)).end()
    if not text.startswith("[", k):
        return []
    calls = _json_calls("mistral", text, k + 1, memo, ",")
    return list(itertools.takewhile(lambda call: not call[1] or call[1].startswith("{"), calls))


def _minimax(text: str, functions: dict[str, Any], memo: dict) -> list[tuple[str, str]]:
    """MiniMax-M2's calls after its first <minimax:tool_call> (_between): each invoke that ended, then the open one's
    parameters that ended (each typed once whole)."""
    return _between(text, memo, (t.MINIMAX_START,), t.MINIMAX_INVOKE, t.MINIMAX_INVOKE_END,
                    lambda raw: t.minimax_invoke(raw, functions),
                    lambda text, body: _minimax_open(text, body, functions, memo.setdefault(("open", body), {})))


def _minimax_open(text: str, body: int, functions: dict[str, Any], memo: dict) -> tuple[str, str] | None:
    """(name, arguments so far) of the invoke open at text[body:] once its name's ">" has come: "{" and each
    parameter that ended, as the whole reply writes it (read once, kept)."""
    head = _found(text, memo, "head", ">", body)
    name = t._unquoted(text[body:head]) if head >= 0 else ""
    if not name:
        return None
    schema = functions.get(name)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    pieces, pos = memo.get("done", ((), head + 1))
    pieces = list(pieces)
    while True:
        start = _found(text, memo, ("param", pos), t.MINIMAX_PARAM, pos)
        end = _found(text, memo, ("param_end", start), t.MINIMAX_PARAM_END, start) if start >= 0 else -1
        if end < 0:
            break
        key, sep, value = text[start + len(t.MINIMAX_PARAM):end].partition(">")
        if sep and key:
            key = t._unquoted(key)
            pieces.append(json.dumps(key, ensure_ascii=False) + ": " + json.dumps(
                t.minimax_value(value, properties.get(key)), ensure_ascii=False))
        pos = end + len(t.MINIMAX_PARAM_END)
        memo["done"] = (tuple(pieces), pos)
    return name, "{" + ", ".join(pieces)


def _named(text: str, memo: dict) -> str:
    """The arguments so far of a reply constrained to a named function's arguments: its text as it comes (the whole
    reply's arguments are its text), a raw control character in a string escaped as the whole reply escapes it
    (serve/tools.py's _read), a backslash that ends the text held until its escape is whole. `memo`: where the last
    read stopped."""
    state = memo.get("named")
    if state is None or not (text is state[0] or len(text) >= len(state[0]) and text.startswith(state[0])):
        state = ("", 0, False, "")
    out, k, in_string = t.control_escaped(text, state[1], state[2])
    out = state[3] + out
    memo["named"] = (text, k, in_string, out)  # (the text kept as given: no copy; a backslash at its end unread)
    return out


def _required(text: str, memo: dict) -> list[tuple[str, str]]:
    """The calls so far of a reply constrained to a JSON list of {"name", "parameters"} objects (tool_choice
    "required"), as llama3_json's calls read: a call's name once its "parameters" key has come, then its
    parameters as json.dumps writes them (the whole reply's arguments)."""
    k = _WS.match(text).end()
    if not text.startswith("[", k):
        return []
    return _json_calls("llama3_json", text, k + 1, memo, ",")


def partial_calls(req: t.ToolRequest, text: str, memo: dict | None = None) -> list[tuple[str, str]]:
    """(name, arguments so far) of each call of a streamed reply (`text`: what the parser reads) that has shown
    itself a call: each name final, each arguments text a start of the whole reply's (`split`); a third item, the
    call's id, where its text writes one (kimi_k2's `functions.NAME:IDX`). A forced call (a
    named tool_choice, "required") streams as vLLM's does: the named function's arguments as the reply writes them,
    "required"'s list a call at a time. `memo`: where the read of the same reply, shorter, stopped (CallStream's):
    this one goes on from there."""
    if req is None or req.mode == "none":
        return []
    memo = {} if memo is None else memo
    if req.mode == "named":
        return [(req.name, _named(text, memo))] if text else []
    try:
        if req.mode == "required":
            calls = _required(text, memo)
        elif req.name == "glm45":
            calls = _glm45(text, {x["function"]["name"]: x["function"].get("parameters") for x in req.tools}, memo)
        elif req.name in t.SECTIONED:
            calls = _sectioned(req.name, text, memo)
        elif req.name == "minimax_m2":
            calls = _minimax(text, {x["function"]["name"]: x["function"].get("parameters") for x in req.tools}, memo)
        elif req.name in t.TYPED_PARSERS:
            calls = _xml(req.name, text, {x["function"]["name"]: x["function"].get("parameters") for x in req.tools},
                         memo)
        else:
            calls = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral, "openai": _harmony,
                     "pythonic": _pythonic, "granite": _granite, "ernie45": _ernie45,
                     "olmo3": _olmo3, "phi4_mini_json": _phi4_mini, "internlm": _internlm,
                     "xlam": _xlam, "hunyuan_a13b": _hunyuan}[req.name](text, memo)
    except RecursionError:
        return []
    return calls if req.parallel else calls[:1]


class CallStream:
    """What of a choice's calls has gone out: `deltas(calls)` the delta.tool_calls entries that send the rest of
    `calls` ([(name, arguments so far)] or, finished, `split`'s calls), only ever adding to what went out."""

    def __init__(self, req: t.ToolRequest):
        self.req, self.sent = req, []  # sent: [id, name, arguments sent]
        self.memo = {}  # partial_calls's, for this choice's reply

    def deltas(self, calls: list, finished: bool = False) -> list[dict]:
        if finished:
            self.check_whole(calls)
        out = []
        for k, call in enumerate(calls):
            name, args = (call["function"]["name"], call["function"]["arguments"]) if finished else call[:2]
            if k >= len(self.sent):
                # (a call's id: the whole reply's, or the one its text writes (Kimi's), else one made as the whole
                # reply's parse makes them)
                call_id = call["id"] if finished else call[2] if len(call) > 2 and call[2] else t.call_id(
                    self.req, name, k)
                self.sent.append([call_id, name, args])
                out.append({"index": k, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": args}})
                continue
            _, sent_name, sent_args = self.sent[k]
            if name != sent_name or not args.startswith(sent_args):
                if finished:  # (the whole reply disagrees with what went out: see the module's known limits)
                    log.warning("streamed tool call %d (%s) is not the whole reply's: what went out stands", k, name)
                continue
            if len(args) > len(sent_args):
                self.sent[k][2] = args
                out.append({"index": k, "function": {"arguments": args[len(sent_args):]}})
        return out

    def check_whole(self, calls: list | None) -> None:
        """Warn when the whole reply has fewer calls than went out (a call that turned out malformed)."""
        if len(calls or []) < len(self.sent):
            log.warning("%d tool call(s) went out streamed that the whole reply does not read: its text follows as "
                        "content", len(self.sent) - len(calls or []))

    def ids(self) -> list[str]:
        return [s[0] for s in self.sent]
