"""Session 52's review of its newer code: a closed stdout with stderr in the same pipe, non-JSON argument texts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_warmup_json_and_stderr_into_one_pipe_its_reader_closed_exits_2(tmp_path):
    """`infer warmup M --json 2>&1 | head -c 0`: the line about the closed stdout cannot be written either (stderr is
    the same closed pipe); that second BrokenPipeError escaped to click, a silent exit 1 ("does not fit")."""
    from infer.models.tiny import ensure_builtin
    model = ensure_builtin("tiny-llama")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-m", "infer.cli", "warmup", str(model), "--json", "--estimate"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    p.stdout.close()  # the reader of both is gone before the command writes its line
    assert p.wait(timeout=300) == 2


def test_hermes_arguments_text_nan_is_written_as_a_json_string():
    """Arguments given as the text "NaN" (or "Infinity") passed as JSON because Python's json.loads reads them; they
    went out as `NaN`, which no strict JSON reader (JavaScript's JSON.parse, OpenAI's SDKs in other languages) takes."""
    import json

    from infer.serve.tools import hermes_calls
    for text in ("NaN", "-Infinity"):
        _, calls = hermes_calls('<tool_call>\n{"name": "f", "arguments": "%s"}\n</tool_call>' % text)
        arguments = calls[0]["function"]["arguments"]
        assert arguments == json.dumps(text)
    _, calls = hermes_calls('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"a": 1}'


def test_human_int_negative_fraction_gets_the_range_message_not_a_hint_to_write_it_otherwise():
    """"-1.5K" (since the sign is read) was told "write -1.5k for -1,500", a value the range then refuses too."""
    import pytest
    import typer

    from infer.cli.options import human_int
    parse = human_int(2)
    with pytest.raises(typer.BadParameter) as e:
        parse("-1.5K")
    assert "not in the range 2<=x" in str(e.value) and "write" not in str(e.value)
    with pytest.raises(typer.BadParameter) as e:
        parse("1.5K")
    assert "write 1.5k for 1,500" in str(e.value)
    assert parse("1.5k") == 1500


def test_a_reset_prefix_cache_racing_shutdown_raises_closed_error_not_the_servers_shutting_down():
    """As generate since cc44d23: an AsyncLLM control (reset_prefix_cache, add_lora, remove_lora) that passed its
    check before shutdown() ran on another thread raised the engine loop's ShuttingDownError, "the server is shutting
    down (retry against another replica)", where the README promises ClosedError for every call after shutdown."""
    import asyncio

    import pytest

    from infer.errors import ClosedError
    from infer.serve.async_llm import AsyncLLM

    llm = AsyncLLM("tiny-llama", max_num_seqs=2, max_model_len=64)
    reset = llm._loop.reset_prefix_cache

    def racing():  # shutdown() lands between the call's check and its control reaching the engine loop
        llm.shutdown()
        return reset()
    llm._loop.reset_prefix_cache = racing
    try:
        with pytest.raises(ClosedError, match="shut down"):
            asyncio.run(llm.reset_prefix_cache())
    finally:
        llm.shutdown()


def test_a_bench_report_file_the_write_could_not_open_is_kept_as_it_was(tmp_path, monkeypatch):
    """A write that failed before it touched the file (an earlier run's throughput.png left read-only: open() is
    refused) removed that earlier file too, though this run had not written a byte of it."""
    import errno

    import pytest

    from infer.bench import report
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.errors import OutputError

    def refused(results, path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(report, "plot_throughput", refused)
    (tmp_path / "throughput.png").write_bytes(b"earlier run")
    recs = [RequestRecord(0, 4, send_time=0.0, chunk_times=[0.1, 0.2], output_tokens=2, text="ab", success=True)]
    run = RunResult("infer", 1, recs, duration_s=0.2, num_requests=1, timeline=[])
    with pytest.raises(OutputError) as e:
        report.write_report(tmp_path, [run], show=False)
    assert "throughput.png" in str(e.value)
    assert (tmp_path / "throughput.png").read_bytes() == b"earlier run"
