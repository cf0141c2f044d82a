"""Session 42 probes of `infer bench`'s numbers and reports, as a `vllm bench serve` user reads them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app


@pytest.mark.parametrize("argv, words", [
    (["bench", "tiny-llama", "--burstiness", "0.5"], "Poisson"),
    (["bench", "tiny-llama", "--metric-percentiles", "50,99"], "p90 and p99"),
    (["bench", "tiny-llama", "--percentile-metrics", "ttft,itl"], "ttft, tpot, itl and e2el"),
    (["bench", "tiny-llama", "--save-detailed"], "per-request"),
])
def test_vllm_bench_serve_options_infer_lacks_say_what_infer_does(argv, words):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    option = next(a for a in argv if a.startswith("--"))
    assert f"{option} is vLLM's option" in result.output
    assert words in result.output
    assert "Possible options" not in result.output


def test_the_default_out_folder_is_checked_before_anything_runs(tmp_path, monkeypatch):
    """Without --out the report goes to ./bench-results/<timestamp>: a `bench-results` file in the current folder
    was only found after every level had been measured (the model loaded and ran, then "cannot write")."""
    import infer.bench.plan as plan_mod
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench-results").write_text("not a folder")
    monkeypatch.setattr(plan_mod, "run_plan", lambda *a, **k: pytest.fail("the benchmark ran"))
    result = CliRunner().invoke(app, ["bench", "tiny-llama", "-c", "1", "--num-prompts", "1"])
    assert result.exit_code == 2, result.output
    assert "bench-results" in result.output and "is a file, not a folder" in result.output


def test_the_default_out_folder_of_a_run_started_in_the_same_second_is_another(tmp_path, monkeypatch):
    from infer.cli import bench as bench_cli
    monkeypatch.setattr(bench_cli.time, "strftime", lambda fmt, *a: "20260101-000000")
    (tmp_path / "20260101-000000").mkdir()
    (tmp_path / "20260101-000000" / "results.json").write_text("[]")
    out = bench_cli.default_out(tmp_path)
    assert out == tmp_path / "20260101-000000-2"
    out.mkdir()
    assert bench_cli.default_out(tmp_path) == tmp_path / "20260101-000000-3"
