"""Probes of the fifty-first session: ways to block, stall or leak the server (slow and vanishing clients, bodies
built to be expensive, failures inside the engine loop, shutdown)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")


def test_an_open_string_is_matched_to_the_end_of_the_body_not_rescanned():
    """json_depth blanks the body's strings with a regex before it counts brackets. A string left open did not match
    at all, so the regex was tried again from every later quote, each scan running to the end of the body: a body of
    escaped quotes after an open one ('"a\\"\\"\\"...') cost quadratic time inside `re`, which never lets go of the
    GIL; a 40 kB body stalled the whole server (event loop and engine thread) for 14 s, an 8 MiB one for days. An
    open string now runs to the end of the body, so each byte is scanned once."""
    from infer.serve.body import _STRING, json_depth
    for raw in [b'"ab', b'"a\\"\\"\\"', b'"a\\', b'"']:
        m = _STRING.match(raw)
        assert m is not None and m.end() == len(raw), raw
    assert _STRING.match(b'"a\\"b" ]').group() == b'"a\\"b"'  # a closed string still ends at its quote
    assert json_depth(b'[["]]\\"[", [1]]') == 3  # brackets in strings, escaped quotes: as before
    assert json_depth(b'[["ab') == 2 and json_depth(b'["a\\\\"]') == 1


def test_a_body_of_escaped_quotes_after_an_open_string_is_refused_at_once():
    """The whole check on an 8 MiB body built that way, in a process of its own (the GIL is held, so no thread can
    time it out): it answered after hours, now at once (the bound only catches the hang)."""
    code = ("from infer.serve.body import load_json\n"
            "from infer.serve.protocol import ApiError\n"
            "raw = b'{\"prompt\": \"a' + b'\\\\\"' * (4 * 2**20) + b'}'\n"
            "try:\n    load_json(raw, 64)\nexcept ApiError as e:\n    print(e.status, e.message)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("400 the request body is not valid JSON: Unterminated string"), done.stdout


@pytest.mark.parametrize("grammar, shown", [('start: "ab', '"ab'), ("start: 'ab\\'", "'ab\\'"),
                                            ("start: /ab\\/", "/ab\\/"),
                                            ('start: "a" | "b' + '\\"' * 30, '"b' + '\\"' * 19 + "...")])
def test_a_lark_string_left_open_is_named_as_such(grammar, shown):
    """A Lark string or regex left open was scanned again from each of its later quotes (see below); it is now one
    token to the end of its line, named as never closed (it was "'\\"' is not supported here")."""
    from infer.engine.structured import lark_to_ebnf
    from infer.errors import RequestError
    with pytest.raises(RequestError) as e:
        lark_to_ebnf(grammar)
    assert e.value.message == (f"structured_outputs.grammar is read as Lark (it has no ::=): line 1: {shown} is "
                               f"never closed (no unescaped {shown[0]} after it on its line)"), e.value.message
    assert lark_to_ebnf('start: "a\\"" | "b" // "c') == 'root ::= start\nstart ::= "a\\"" | "b"'


def test_a_lark_grammar_of_escaped_quotes_after_an_open_string_is_refused_at_once():
    """The tokenizer of a Lark grammar (a request's structured_outputs.grammar without ::=) tried its string token at
    every quote of a line: after a quote left open, a line of escaped quotes was scanned again from each of them,
    quadratic inside `re`, which holds the GIL: a 40 kB grammar stalled the server (event loop and engine) 10 s, one
    of 200 kB (the most a request may send) minutes. Checked in a process of its own (no thread can time out a call
    that holds the GIL)."""
    code = ("from infer.engine.structured import lark_to_ebnf\n"
            "from infer.errors import RequestError\n"
            "try:\n    lark_to_ebnf('start: \"' + '\\\\\"' * 99_990)\n"
            "except RequestError as e:\n    print(e.message[:90])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "is read as Lark (it has no ::=): line 1: \"\\\"" in done.stdout, done.stdout


def test_a_pattern_beside_enum_that_backtracks_for_ever_is_checked_within_a_bound():
    """Each enum or const value beside a pattern is checked against it (xgrammar ignores the pattern there), with
    Python's `re`: the request's own pattern, which backtracks: "^(a|aa)+$" against 40 a's and a "!" ran for hours
    holding the GIL, so one request's schema stalled the whole server (event loop and engine thread). The checks
    now stop at a bound of the schema's and count as not met: the 400 names the pattern (checked in a process of
    its own: no thread can time out a call that holds the GIL)."""
    code = ("import json\n"
            "from infer.engine.structured import _check_enforced\n"
            "from infer.errors import RequestError\n"
            "s = {'type': 'object', 'properties': {f'k{i}': {'type': 'string', 'pattern': '^(a|aa)+$',\n"
            "     'enum': ['a' * 40 + '!']} for i in range(20)}}\n"
            "try:\n    _check_enforced(json.dumps(s))\n"
            "except RequestError as e:\n    print(e.message)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "uses pattern at #/properties/k0/pattern beside enum" in done.stdout, done.stdout


@pytest.mark.parametrize("values, held", [(["ab", "cd"], True), (["ab", "C"], False), ([5, "x"], True)])
def test_a_pattern_beside_enum_still_checks_each_value(values, held):
    from infer.engine.structured import _check_enforced
    from infer.errors import RequestError
    schema = json.dumps({"type": ["string", "integer"], "pattern": "^[a-z]+$", "enum": values})
    if held:
        _check_enforced(schema)
    else:
        with pytest.raises(RequestError, match="uses pattern at #/pattern beside enum"):
            _check_enforced(schema)
    with pytest.raises(RequestError, match="beside enum"):  # a pattern Python cannot read: not surely held
        _check_enforced(json.dumps({"type": "string", "pattern": "(", "enum": ["a"]}))


def test_an_engine_loop_that_dies_ends_its_requests_and_says_so_on_health():
    """The engine thread's loop catches what a step raises, but something raising past its handlers (here the
    engine's has_unfinished_requests, which the loop calls outside them while it waits) ended the thread without a
    word: /health kept answering ok, the request in flight waited for ever, and so did every later one. Now the
    requests in flight end with a 500 that says the loop stopped, /health is 503 and new requests a 503."""
    import threading

    import httpx

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=256, max_num_seqs=4))
    real, broken = engine.has_unfinished_requests, threading.Event()

    def has_unfinished_requests():
        if broken.is_set():
            raise RuntimeError("a bug in the engine")
        return real()

    engine.has_unfinished_requests = has_unfinished_requests
    server = Server(AsyncEngine(engine), "tiny")
    with serve_in_thread(server) as url:
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # running
            broken.set()
            rest = [line for line in lines if line]  # (a hang is the 30 s read timeout)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "engine_error" and error["message"] == (
            "the engine loop stopped (RuntimeError: a bug in the engine); restart the server"), error
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503 and "the engine loop stopped" in health.json()["error"], health.text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine_replica", r.text
        # a control (an adapter load, a prefix-cache reset) says so too, not "the server is shutting down"
        r = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine_replica", r.text
        assert "the engine loop stopped" in r.json()["error"]["message"], r.text
        assert server.stats()["num_in_flight"] == 0
