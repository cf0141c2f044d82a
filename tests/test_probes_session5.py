"""`infer run` against inputs found by probing as a hostile user (session 5): a byte order mark, UTF-16 or binary
files, OpenAI batch lines with fields that would be silently dropped, null and duplicate ids, an output that is the
input, cannot be opened or fills the disk, Ctrl-C, a plain re-run over an unfinished output, and a request the
engine fails on. The other commands and the Python API are in test_probes_session5_tools.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import fail_steps_of
from typer.testing import CliRunner

from infer.cli.batch_io import read_inputs
from infer.cli.main import app

runner = CliRunner()


class _Tok:
    """Enough of a tokenizer for the reader: one id per byte."""
    chat_template = None

    def __call__(self, text):
        return {"input_ids": list(text.encode("utf-8"))[:50] or [0]}


def _read(tmp_path, data: bytes):
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    return {item.id: item for item in read_inputs(path, _Tok(), {"max_new_tokens": 4})}


def _lines(*objs) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def test_a_byte_order_mark_does_not_cost_the_first_line(tmp_path):
    """Windows editors save UTF-8 with a BOM; json.loads refused the first line ('Unexpected UTF-8 BOM')."""
    items = _read(tmp_path, b"\xef\xbb\xbf" + _lines({"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}))
    assert items["a"].error is None and items["a"].request.prompt_token_ids == list(b"hi")
    assert items["b"].error is None
    items = _read(tmp_path, _lines({"id": "a", "prompt": "hi"}) + b"\xef\xbb\xbf" + _lines({"id": "b", "prompt": "x"}))
    assert items["a"].error is None and "line 2" in items["line2"].error  # only the file's first bytes are a BOM


@pytest.mark.parametrize("field,value", [("n", 3), ("best_of", 2), ("echo", True),
                                         ("tools", [{"type": "function"}]),
                                         ("suffix", "the end")])
def test_batch_line_fields_that_would_change_the_reply_are_refused_not_dropped(tmp_path, field, value):
    """`n: 3` used to give one reply and no word about the two others."""
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi", "max_tokens": 2, field: value}}
    ok = {"custom_id": "d", "body": {"prompt": "hi", "max_tokens": 2, "n": 1, "model": "anything"}}
    items = _read(tmp_path, _lines(line, ok))
    assert f"line 1: body.{field}" in items["c"].error and "remove it" in items["c"].error
    assert items["d"].error is None


def test_a_batch_line_without_its_body_says_so(tmp_path):
    """A batch line missing `body` was read as our own format: "unknown field(s) ['custom_id', 'method', 'url']"."""
    items = _read(tmp_path, _lines({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"},
                                   {"custom_id": "y", "body": "hi"}, {"body": {"prompt": "hi"}}))
    assert "needs a 'body' object" in items["x"].error and "unknown field" not in items["x"].error
    assert "'body' must be an object, got str" in items["y"].error
    assert items["3"].error is None and items["3"].request.prompt_token_ids == list(b"hi")  # no custom_id: line number


def test_a_null_custom_id_or_id_falls_back_to_the_line_number(tmp_path):
    items = _read(tmp_path, _lines({"custom_id": None, "body": {"prompt": "a"}}, {"custom_id": None, "body":
                                   {"prompt": "b"}}, {"id": None, "prompt": "c"}))
    assert sorted(items) == ["1", "2", "3"] and all(it.error is None for it in items.values())
    assert [items[k].request.id for k in "123"] == ["1", "2", "3"]


def test_a_duplicate_id_names_the_line_that_has_it(tmp_path):
    """An id that equals an earlier line's number clashes with that line's default id: say so."""
    items = _read(tmp_path, _lines({"prompt": "no id"}, {"id": "x", "prompt": "a"}, {"id": 1, "prompt": "b"},
                                   {"id": "x", "prompt": "c"}))
    assert items["1"].error is None and items["x"].error is None
    assert "line 3: duplicate id '1': line 1 already has it (a line without an id has its line number" \
        in items["1#line3"].error
    assert "line 4: duplicate id 'x': line 2 already has it; give every line its own id" == items["x#line4"].error


def _ctrl_c_when(cmd: list[str], ready, timeout: float = 240, sig: int = signal.SIGINT, code: int = 130) -> str:
    """Start `cmd`, send it SIGINT (or `sig`) once `ready(proc)` holds, and return its stderr; it must exit 130
    (or `code`)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env={**os.environ},
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    while not ready(proc):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == code, err[-2000:]
    return err


def test_ctrl_c_says_how_many_records_are_safe_and_how_to_resume(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines(*({"id": f"r{i}", "prompt": "hello", "max_new_tokens": 400, "ignore_eos": True}
                             for i in range(40))))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "infer.cli", "run", "tiny-llama", str(inp), "-o", str(out), "--max-num-seqs", "1"]

    def records() -> int:
        return out.read_bytes().count(b"\n") if out.exists() else 0

    err = _ctrl_c_when(cmd, lambda _: records() >= 2)
    written = records()
    assert err.strip().splitlines()[-1] == f"interrupted: {written} of 40 records written to {out}; run the same " \
        "command with --resume to complete the rest" and "Traceback" not in err
    # interrupted again while resuming: the count is this run's and the whole file's (it said "1 of 37" only)
    err = _ctrl_c_when(cmd + ["--resume"], lambda _: records() >= written + 1)
    total = records()
    assert err.strip().splitlines()[-1] == (
        f"interrupted: {total - written} of the {40 - written} records still to do ({total} of 40 in all) written "
        f"to {out}; run the same command with --resume to complete the rest")


def test_output_that_is_the_input_file_is_refused_before_anything_is_written(tmp_path):
    """`-o` naming the input (or a link to it) used to overwrite the prompts with the records, exit 0."""
    inp = tmp_path / "in.jsonl"
    data = _lines({"id": "a", "prompt": "hi", "max_new_tokens": 2})
    inp.write_bytes(data)
    (tmp_path / "link.jsonl").symlink_to(inp)
    for out in (inp, tmp_path / "link.jsonl"):
        for extra in ([], ["--resume"]):
            res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", *extra])
            assert res.exit_code == 2 and "is the input file" in res.output and "hint:" in res.output, res.output
    assert inp.read_bytes() == data


def test_a_full_disk_is_one_error_line_and_keeps_what_was_written(tmp_path, monkeypatch):
    """/dev/full (ENOSPC on every write) gave two chained tracebacks; a regular file that fills up keeps its
    records and is resumable."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines(*({"id": f"r{i}", "prompt": "hi", "max_new_tokens": 2} for i in range(4))))
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", "/dev/full", "-q"])
    assert res.exit_code == 2 and not isinstance(res.exception, OSError), res.output
    assert "error: cannot write to /dev/full after 0 records: No space left on device" in res.output
    from infer.cli import batch_io
    real, calls = os.fsync, []

    def fsync(fd):  # the third record does not fit
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(fd)
    monkeypatch.setattr(batch_io.os, "fsync", fsync)
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 2 and "after 2 records" in res.output and "--resume" in res.output, res.output
    monkeypatch.setattr(batch_io.os, "fsync", real)
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume"])
    assert res.exit_code == 0, res.output
    assert sorted(json.loads(l)["id"] for l in out.read_text().splitlines()) == [f"r{i}" for i in range(4)]


def test_a_plain_rerun_does_not_delete_the_records_of_an_unfinished_run(tmp_path, monkeypatch):
    """The same command again without --resume truncated the output of a run that had stopped half-way: hours of
    records gone. Now it is refused with both ways out named; a finished output may still be started over."""
    from infer.engine.llm_engine import LLMEngine
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines(*({"id": f"r{i}", "prompt": "hi", "max_new_tokens": 2 + i} for i in range(6))))
    out = tmp_path / "out.jsonl"
    real, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(LLMEngine, "step", step)
    cmd = ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--max-num-seqs", "1"]
    res = runner.invoke(app, cmd)
    assert res.exit_code == 130 and "interrupted: " in res.output, res.output
    monkeypatch.setattr(LLMEngine, "step", real)
    kept = out.read_bytes()
    assert kept.count(b"\n") >= 1
    res = runner.invoke(app, cmd)
    assert res.exit_code == 2 and "records of a run that did not finish" in res.output and "--resume" in res.output
    assert out.read_bytes() == kept
    assert runner.invoke(app, [*cmd, "--resume"]).exit_code == 0
    assert sorted(json.loads(l)["id"] for l in out.read_text().splitlines()) == [f"r{i}" for i in range(6)]
    res = runner.invoke(app, cmd)  # finished: a plain run starts it over
    assert res.exit_code == 0 and out.read_bytes().count(b"\n") == 6, res.output


@pytest.mark.parametrize("encoding,message", [("utf-16", "UTF-16 or UTF-32"), ("utf-16-be", "UTF-16 or UTF-32"),
                                              ("utf-32", "UTF-16 or UTF-32"), ("utf-16-le", "bytes are NUL"),
                                              ("binary", "bytes are NUL")])
def test_a_utf16_or_binary_input_is_named_before_the_model_loads(tmp_path, monkeypatch, encoding, message):
    """PowerShell's `>` writes UTF-16, and a weights file passed by mistake is binary: every line failed with 'not
    valid UTF-8' or 'bad JSON', one error record per fragment."""
    from infer.engine import llm_engine
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    inp = tmp_path / "in.jsonl"
    text = '{"prompt": "hi there, how are you"}\n' * 3
    if encoding == "binary":
        inp.write_bytes(bytes(range(256)) * 4 + b"\x00" * 1024)
    else:
        inp.write_bytes(("\ufeff" + text).encode(encoding) if encoding == "utf-16-be" else text.encode(encoding))
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"), "-q"])
    assert res.exit_code == 2 and message in res.output and "hint:" in res.output, res.output


def test_one_line_with_a_nul_byte_still_lets_the_others_run(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines({"id": "a", "prompt": "hi", "max_new_tokens": 2}) + b'{"id": "b\x00"}\n'
                    + _lines({"id": "c", "prompt": "yo", "max_new_tokens": 2}))
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["a"]["error"] is None and recs["c"]["error"] is None and "line 2" in recs["line2"]["error"]


def test_a_request_the_engine_fails_on_gets_an_error_record_and_the_run_goes_on(tmp_path, monkeypatch):
    """An exception inside a step ended `infer run` with a traceback, and --resume ran into it again: the server
    already failed only the running requests and went on; the CLI now does the same."""
    fail_steps_of(monkeypatch, "poison")
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines(*({"id": i, "prompt": "hi", "max_new_tokens": 3} for i in ("a", "poison", "b", "c"))))
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--max-num-seqs", "1"])
    assert res.exit_code == 1 and "3 ok, 1 failed" in res.output, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == ["a", "b", "c", "poison"]
    assert recs["poison"]["finish_reason"] == "error" and "simulated kernel failure" in recs["poison"]["error"]
    assert all(recs[i]["error"] is None and recs[i]["usage"]["completion_tokens"] == 3 for i in "abc")


@pytest.mark.parametrize("out", ["/proc/infer-probe.jsonl", "/sys/infer-probe.jsonl"])
def test_an_output_nobody_can_write_fails_before_the_model_loads(tmp_path, monkeypatch, out):
    """os.access says yes to root everywhere: -o /sys/x.jsonl loaded the model, then died in open() with a
    traceback."""
    from infer.engine import llm_engine
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines({"prompt": "hi"}))
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", out, "-q"])
    assert res.exit_code == 2 and f"-o {out}" in res.output and "hint:" in res.output, res.output


def test_an_input_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    from infer.cli import batch_io
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines({"prompt": "hi"}))

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(batch_io, "open", denied, raising=False)
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"), "-q"])
    assert res.exit_code == 2 and "cannot read input" in res.output and "Permission denied" in res.output


def _maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/PID/maps (Linux)")
def test_ctrl_c_while_the_commands_are_imported_says_interrupted(tmp_path):
    """torch and transformers take a second or more to import: Ctrl-C then is the same one line and exit 130 as
    during a run, not a traceback from inside an import."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines({"id": "a", "prompt": "hello"}))
    cmd = [sys.executable, "-m", "infer.cli", "run", "tiny-llama", str(inp), "-o", str(tmp_path / "out.jsonl")]
    # Sent once torch's library is mapped: the handler is installed before the commands' imports start, and the
    # interpreter's own start (before any code of ours runs) is over. A fixed sleep raced a slow machine's start.
    err = _ctrl_c_when(cmd, lambda proc: _maps_torch(proc.pid), timeout=120)
    assert "interrupted" in err and "Traceback" not in err
