"""Session 52 (errors): what a user gets wrong on the command line gets a message that names the bad value and what
to do, the exit code README's table gives, and keeps what was already written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


def _no_load(monkeypatch):
    from infer.engine import llm_engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)


@pytest.mark.parametrize("argv", [
    ["run", "tiny-llama", "IN", "--max-model-len", "-1"],
    ["run", "tiny-llama", "IN", "--max-num-batched-tokens", "-8"],
    ["run", "tiny-llama", "IN", "--max-num-batched-tokens", "-2k"],
    ["warmup", "tiny-llama", "--max-length", "-4096"],
])
def test_a_negative_token_count_is_named_out_of_range_not_not_a_whole_number(tmp_path, monkeypatch, argv):
    """`--max-model-len -1` said "'-1' is not a whole number": it is one, only below the range."""
    _no_load(monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    r = runner.invoke(app, [str(src) if a == "IN" else a for a in argv])
    assert r.exit_code == 2, r.output
    assert "not a whole number" not in r.output
    assert "is not in the range" in r.output and "-" in r.output


def test_a_bench_report_file_the_disk_could_not_finish_is_removed_and_named(tmp_path, monkeypatch):
    """A full disk while a plot was written left a 0-byte throughput.png (and, earlier, a truncated results.json)
    among the report's files, and the error named only the folder."""
    import errno

    from infer.bench import report
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.errors import OutputError

    def full(results, path):
        path.write_bytes(b"\x89PNG")  # what got out before the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")  # matplotlib's, without a file name
    monkeypatch.setattr(report, "plot_throughput", full)
    recs = [RequestRecord(0, 4, send_time=0.0, chunk_times=[0.1, 0.2], output_tokens=2, text="ab", success=True)]
    run = RunResult("infer", 1, recs, duration_s=0.2, num_requests=1, timeline=[])
    with pytest.raises(OutputError) as e:
        report.write_report(tmp_path, [run], show=False)
    assert "throughput.png" in str(e.value) and "No space left" in str(e.value)
    assert not (tmp_path / "throughput.png").exists()
    assert json.loads((tmp_path / "results.json").read_text())[0]["completed"] == 1  # what was written stays


@pytest.mark.parametrize("argv, value", [
    (["run", "tiny-llama", "IN", "--max-num-seqs", "0"], "(got 0)"),
    (["run", "tiny-llama", "IN", "--max-loras", "0"], "(got 0)"),
    (["run", "tiny-llama", "IN", "--max-num-seqs", "abc"], "(got abc)"),
    (["run", "tiny-llama", "IN", "--max-num-seqs", ""], "(got '')"),
    (["warmup", "tiny-llama", "--concurrency", "0"], "(got 0)"),
    (["lora-validate", "tiny-llama", "x", "--steps", "999"], "(got 999)"),
    (["quantize", "tiny-llama", "-o", "OUT", "--bits", "four"], "(got four)"),
])
def test_an_option_typer_refuses_names_the_value_given(tmp_path, monkeypatch, argv, value):
    """typer's own range and type checks said "Input should be greater than or equal to 1" without the value."""
    _no_load(monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    subs = {"IN": str(src), "OUT": str(tmp_path / "q")}
    r = runner.invoke(app, [subs.get(a, a) for a in argv])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert value in r.output, r.output


def test_bench_out_on_a_read_only_mount_says_read_only_not_permission_denied(tmp_path, monkeypatch):
    """os.access's no became a made-up "Permission denied" (which chmod cannot fix) for a read-only file system."""
    import errno
    import os
    import tempfile

    from infer.cli import bench
    from infer.errors import ConfigError

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # what access(2) answers on a read-only mount
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ConfigError) as e:
        bench.check_out(tmp_path / "report")
    assert os.strerror(errno.EROFS) in str(e.value) and "Permission denied" not in str(e.value)


def test_warmup_json_into_a_pipe_its_reader_closed_exits_2_with_a_message(tmp_path):
    """click made a closed stdout a silent exit 1, which for warmup means "does not fit" (README: exit 2, a line)."""
    import os
    import subprocess
    import sys

    from infer.models.tiny import ensure_builtin
    model = ensure_builtin("tiny-llama")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-m", "infer.cli", "warmup", str(model), "--json", "--estimate"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    p.stdout.close()  # the reader is gone before the command writes its line (`| head -c 0`)
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 2, err
    assert "stdout was closed by its reader" in err and "Traceback" not in err
