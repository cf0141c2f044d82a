"""Probes of the fifty-first session: ways to block, stall or leak the server (slow and vanishing clients, bodies
built to be expensive, failures inside the engine loop, shutdown)."""

from __future__ import annotations

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
