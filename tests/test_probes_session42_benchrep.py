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
