"""`infer demo` end to end on CPU in a fresh model cache: every step runs, the terminal holds only the demo's own
lines, the verdict line parses, every artifact exists and parses; plus the demo's checks and its reuse of an
earlier run's checkpoint and adapters."""

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
from typer.testing import CliRunner

from infer.cli import demo as demo_module
from infer.cli.main import app

from quant_helpers import needs_gptqmodel

NOISE = ("GPT-QModel", "INFO", "WARNING", "Warning", "torchao", "Loading weights", "it/s", "Traceback")


@needs_gptqmodel
def test_demo_in_a_fresh_cache(tmp_path):
    out, cache = tmp_path / "demo", tmp_path / "cache"
    env = {**os.environ, "INFER_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "infer.cli", "demo", "--out", str(out), "--quick"],
                          capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stderr
    for step in ("infer quantize", "infer.cli.demo tiny-llama", "infer lora-validate", "infer warmup", "infer run",
                 "infer bench"):
        assert f"$ {step}" in log or f"$ python -m {step}" in log, step
    assert f"each step's full output: {out / 'demo.log'}" in log and (out / "demo.log").stat().st_size > 0
    assert not [line for line in log.splitlines() if any(n in line for n in NOISE)], log
    assert (cache / "models").is_dir()  # the built-in model was built into the fresh cache
    verdict = demo_module.VERDICT.search(log)
    assert verdict, log
    ratio, tps = float(verdict["ratio"]), int(verdict["tps"])
    runs = json.loads((out / "bench" / "results.json").read_text())
    assert int(verdict["c"]) == runs[0]["concurrency"] == 8
    assert math.isfinite(ratio) and ratio > 0 and tps > 0
    assert ratio == pytest.approx(runs[0]["ratio"]["output_throughput"], abs=0.006)
    assert runs[0]["completed"] == 8 and runs[0]["baseline"]["completed"] == 8
    gptq = out / "tiny-llama-gptq"
    assert json.loads((gptq / "config.json").read_text())["quantization_config"]["bits"] == 4
    assert len(pd.read_csv(gptq / "quantization_report.csv")) == 14
    for name in ("support", "legal"):
        assert json.loads((out / "adapters" / name / "adapter_config.json").read_text())["peft_type"] == "LORA"
    recs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all(r["error"] is None and r["token_ids"] for r in recs)
    assert (out / "bench" / "report.md").is_file() and list((out / "bench").glob("*.png"))
    assert not (tmp_path / "logs").exists()  # GPTQModel's log folder does not land in the working directory


@pytest.mark.parametrize("args, message", [
    (["--out", "{file}"], "is a file, not a folder"),
    (["--model", "bogus", "--out", "{dir}"], "--model 'bogus' is not a built-in model"),
])
def test_demo_refuses_bad_arguments_before_any_work(tmp_path, args, message):
    (tmp_path / "f").write_text("x")
    args = [a.format(file=tmp_path / "f", dir=tmp_path / "d") for a in args]
    res = CliRunner().invoke(app, ["demo", *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: --") and message in res.output and "hint: " in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "d").exists()


class _Steps:
    """The demo's step runner, recording (title, args) instead of running anything."""

    def __init__(self):
        self.ran = []

    def run(self, title, args, summary, module="infer.cli"):
        self.ran.append((title, args))


def _earlier_adapters(out):
    """The adapter folders an earlier tiny-llama demo left in `out`."""
    for name in demo_module.ADAPTERS:
        (out / "adapters" / name).mkdir(parents=True)
        (out / "adapters" / name / "adapter_config.json").write_text("{}")


def test_rerun_reuses_checkpoint_and_adapters(tmp_path, capsys):
    out = tmp_path / "demo"
    (out / "tiny-llama-gptq").mkdir(parents=True)
    (out / "tiny-llama-gptq" / "config.json").write_text("{}")
    (out / "tiny-llama-gptq" / "model.safetensors").write_bytes(b"")
    _earlier_adapters(out)
    steps = _Steps()
    demo_module._model_steps(steps, out, "tiny-llama", demo_module.SIZES[True])
    err = capsys.readouterr().err
    assert [t for t, _ in steps.ran] == ["lora-validate"]
    assert f"quantize: reusing {out / 'tiny-llama-gptq'} from an earlier run" in err
    assert "adapters: reusing support (rank 8, q/v) and legal" in err


def test_another_model_into_the_same_folder_makes_adapters_of_its_own(tmp_path):
    """A second demo with --model tiny-qwen3 into the same --out reused tiny-llama's adapters, and lora-validate
    failed them (made for another base)."""
    out = tmp_path / "demo"
    _earlier_adapters(out)
    steps = _Steps()
    _, loras = demo_module._model_steps(steps, out, "tiny-qwen3", demo_module.SIZES[True])
    assert [t for t, _ in steps.ran] == ["quantize", "adapters", "lora-validate"]
    made = dict(steps.ran)["adapters"]
    assert made[:2] == ["tiny-qwen3", str(out / "tiny-qwen3-adapters")]
    assert all(str(out / "tiny-qwen3-adapters") in lo for lo in loras)
