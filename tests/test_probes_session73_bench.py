"""`infer bench --baseline hf --baseline-model FLOAT`: transformers runs another model than MODEL on the same
requests, e.g. the float checkpoint a GPTQ MODEL was quantized from (transformers reads no GPTQ mixture of experts,
and "does int4 pay against the float model?" is the question a deployment asks). The label, the table's note and
report.md say which model the baseline ran; a baseline model of another tokenizer is refused before ours runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from quant_helpers import needs_gptqmodel
from test_probes_session56_review_moeq import rtn_gptq


@needs_gptqmodel
def test_a_gptq_mixture_of_experts_against_the_float_model_it_came_from(tmp_path):
    rtn_gptq(ensure_builtin("tiny-qwen3-moe"), tmp_path / "q")
    out = tmp_path / "bench"
    res = CliRunner().invoke(app, ["bench", str(tmp_path / "q"), "-c", "2", "--num-prompts", "4", "--input-len", "8",
                                   "--output-len", "6", "--baseline", "hf", "--baseline-model", "tiny-qwen3-moe",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "baseline = hf (tiny-qwen3-moe): transformers generate on that model (--baseline-model), not on ours" in said
    [run] = json.loads((out / "results.json").read_text())
    assert run["baseline"]["label"] == "hf (tiny-qwen3-moe)" and run["baseline"]["completed"] == 4
    assert run["completed"] == 4 and run["ratio"]["output_throughput"] > 0
    report = (out / "report.md").read_text()
    assert '"baseline_model": "tiny-qwen3-moe"' in report and "on tiny-qwen3-moe (--baseline-model)" in report


@pytest.mark.parametrize("args, words", [
    (["--baseline-model", "tiny-llama"], "--baseline-model names the model the transformers baseline runs, and "
                                         "--baseline hf is not given"),
    (["--baseline", "hf", "--baseline-model", "llama-100m"], "--baseline-model llama-100m has another tokenizer "
                                                             "than tiny-llama (1,354 tokens against 512"),
])
def test_a_baseline_model_it_cannot_compare_is_refused_before_ours_runs(tmp_path, monkeypatch, args, words):
    from infer.bench import plan as plan_module
    monkeypatch.setattr(plan_module, "run_plan", lambda *a, **k: pytest.fail("the benchmark ran"))
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "-c", "1", "--num-prompts", "1", *args,
                                   "--out", str(tmp_path / "b")])
    assert res.exit_code == 2, res.output
    assert words in " ".join(res.output.split()) and "Traceback" not in res.output
