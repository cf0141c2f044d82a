"""Session 43, review of session 42's code."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app


def test_two_bench_runs_started_in_the_same_second_get_their_own_default_folders(tmp_path, monkeypatch):
    """The default --out (bench-results/<timestamp>) got a -2 suffix only when the other run's folder already
    existed, and a run's folder was made only when its report was written, at its end: two runs a script started at
    once both chose the same folder and the later report replaced the earlier one. The folder is made when chosen."""
    from infer.cli import bench as bench_cli
    monkeypatch.setattr(bench_cli.time, "strftime", lambda fmt, *a: "20260101-000000")
    first, second = bench_cli.default_out(tmp_path), bench_cli.default_out(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()


def test_a_bench_run_that_ends_before_its_report_leaves_no_empty_default_folder(tmp_path, monkeypatch):
    """The default folder, now made when chosen, is removed again when the run ends before writing a report."""
    import infer.bench.plan as plan_mod
    from infer.errors import ConfigError
    monkeypatch.chdir(tmp_path)

    def fail(*a, **k):
        raise ConfigError("the model cannot load")
    monkeypatch.setattr(plan_mod, "run_plan", fail)
    result = CliRunner().invoke(app, ["bench", "tiny-llama", "-c", "1", "--num-prompts", "1"])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "bench-results").exists()  # nothing left behind


def test_the_request_id_headers_hint_says_infer_makes_no_id_up():
    """vLLM's --enable-request-id-headers puts an X-Request-Id (a random uuid when the request has none) on every
    answer; the hint said infer always sends one back, so dropping the option, as told, left a client that sends
    none without the header it relied on."""
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--enable-request-id-headers"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "makes up none for a request that sends none" in text, result.output
