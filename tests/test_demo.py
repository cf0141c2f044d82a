"""`infer demo` end to end on CPU: every step runs and every artifact exists and parses."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from quant_helpers import needs_gptqmodel


@needs_gptqmodel
def test_demo_runs_the_whole_chain(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "infer.cli", "demo", "--out", str(out)], capture_output=True,
                          text=True, env=dict(os.environ), timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stderr
    for step in ("infer quantize", "infer lora-validate", "infer warmup", "infer run", "infer bench"):
        assert f"$ {step}" in log
    gptq = out / "tiny-llama-gptq"
    cfg = json.loads((gptq / "config.json").read_text())
    assert cfg["quantization_config"]["bits"] == 4
    assert (gptq / "model.safetensors").is_file()
    assert len(pd.read_csv(gptq / "quantization_report.csv")) == 14
    for name in ("support", "legal"):
        assert json.loads((out / "adapters" / name / "adapter_config.json").read_text())["peft_type"] == "LORA"
    recs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all(r["error"] is None and r["token_ids"] for r in recs)
    runs = json.loads((out / "bench" / "results.json").read_text())
    assert runs and runs[0]["completed"] > 0 and runs[0]["output_throughput"] > 0
    assert (out / "bench" / "results.csv").is_file() and (out / "bench" / "report.md").is_file()
    assert list((out / "bench").glob("*.png"))
    assert not (tmp_path / "logs").exists()  # GPTQModel's log folder does not land in the working directory
