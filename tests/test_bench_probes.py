"""`infer bench` probes: the HF baseline keeps other libraries' output off the terminal (unless --debug), a baseline
that ran the base model while infer ran adapters is labelled as such, and a bad dataset is refused before any model
loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from infer.cli.main import app

from quant_helpers import make_gptqmodel_checkpoint, needs_gptqmodel

runner = CliRunner()
TINY = ["-c", "2", "--num-prompts", "2", "--input-len", "4", "--output-len", "3"]
NOISE = "LIBRARY-BANNER"


# ---------------------------------------------------------------------------------------------- library output
@pytest.fixture
def noisy_baseline(monkeypatch):
    """transformers / GPTQModel stand-ins: the baseline's loading and each generate batch print to stdout and
    stderr, as GPTQModel's banner and transformers' warnings do."""
    import infer.bench.hf_baseline as hb
    load, batch = hb.load_hf, hb._run_batch

    def noisy_load(*a, **kw):
        print(f"{NOISE} load (stdout)")
        print(f"{NOISE} load (stderr)", file=sys.stderr)
        return load(*a, **kw)

    def noisy_batch(*a, **kw):
        print(f"{NOISE} generate (stdout)")
        print(f"{NOISE} generate (stderr)", file=sys.stderr)
        return batch(*a, **kw)
    monkeypatch.setattr(hb, "load_hf", noisy_load)
    monkeypatch.setattr(hb, "_run_batch", noisy_batch)


def test_hf_baseline_output_is_hidden_unless_debug(tmp_path, noisy_baseline):
    res = runner.invoke(app, ["bench", "tiny-llama", "--baseline", "hf", "--out", str(tmp_path / "q"), *TINY, "-q"])
    assert res.exit_code == 0, res.output
    assert NOISE not in res.output
    assert json.loads((tmp_path / "q" / "results.json").read_text())[0]["baseline"]["completed"] == 2
    res = runner.invoke(app, ["--debug", "bench", "tiny-llama", "--baseline", "hf", "--out", str(tmp_path / "d"),
                              *TINY, "-q"])
    assert res.exit_code == 0, res.output
    assert f"{NOISE} load (stdout)" in res.output and f"{NOISE} generate (stderr)" in res.output


@needs_gptqmodel
def test_gptq_baseline_prints_no_library_lines(tmp_path):
    """The probe itself: GPTQModel's banner and INFO lines (stdout) and transformers' FutureWarning (stderr) came
    out of `infer bench GPTQ_MODEL --baseline hf -q`, whose only line is where the report went."""
    from infer.models.tiny import ensure_builtin
    qdir = make_gptqmodel_checkpoint(ensure_builtin("tiny-llama"), tmp_path / "q", bits=4, group_size=32,
                                     num_samples=4, seq_len=32)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "infer.cli", "bench", str(qdir), "--baseline", "hf", "--out",
                           str(out), *TINY, "-q"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "default"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"infer bench: report written to {out}"]
    [r] = json.loads((out / "results.json").read_text())
    assert r["baseline"]["completed"] == 2


# ---------------------------------------------------------------------------------------------- adapters
@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from lora_helpers import hf_float, save_adapter

    from infer.models.tiny import ensure_builtin
    hf = hf_float(ensure_builtin("tiny-llama"))
    return save_adapter(hf, tmp_path_factory.mktemp("adapter") / "a0", 0, r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj"])


def test_baseline_without_adapters_is_labelled(tmp_path, adapter):
    """infer ran the adapter, transformers the base model: the table, results.json, results.csv and report.md say
    so, and a note is printed once."""
    out = tmp_path / "out"
    res = runner.invoke(app, ["bench", "tiny-llama", "--lora", f"a0={adapter}", "--baseline", "hf", "--out",
                              str(out), *TINY])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert text.count("note: --baseline hf runs tiny-llama without adapters, labelled 'hf (base, no adapters)'; "
                      "the requests measured use a0, so the x columns compare") == 1
    assert "infer bench: throughput, baseline hf (base, no adapters)" in text
    assert "baseline = hf (base, no adapters): transformers generate on the base model" in text
    [r] = json.loads((out / "results.json").read_text())
    assert r["label"] == "infer" and r["baseline"]["label"] == "hf (base, no adapters)"
    assert r["baseline"]["backend"] == "hf" and "ratio" in r
    assert sorted(pd.read_csv(out / "results.csv")["label"]) == ["hf (base, no adapters)", "infer"]
    md = (out / "report.md").read_text()
    assert "Baseline = hf (base, no adapters): transformers generate on the base model, without the adapters" in md


def test_baseline_of_a_workload_without_adapters_is_plain_hf(tmp_path):
    """No adapter in the workload: the baseline runs the same model, labelled by its backend alone, no note."""
    ds = tmp_path / "p.jsonl"
    ds.write_text('{"prompt": "hello there", "max_new_tokens": 3}\n')
    out = tmp_path / "out"
    res = runner.invoke(app, ["bench", "tiny-llama", "--baseline", "hf", "--dataset", f"jsonl:{ds}", "--out", str(out),
                              "-c", "1", "-q"])
    assert res.exit_code == 0, res.output
    assert "note:" not in res.output
    [r] = json.loads((out / "results.json").read_text())
    assert r["baseline"]["label"] == "hf" and "base, no adapters" not in (out / "report.md").read_text()


# ---------------------------------------------------------------------------------------------- dataset first
@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the engine (the model) or the HF baseline is loaded."""
    import infer.bench.hf_baseline as hb
    import infer.engine.llm_engine as le
    loaded = []

    def refuse(*a, **kw):
        loaded.append(a)
        raise AssertionError("a model was loaded before the dataset was checked")
    monkeypatch.setattr(le, "LLMEngine", refuse)
    monkeypatch.setattr(hb, "load_hf", refuse)
    return loaded


@pytest.mark.parametrize("kind, content, message", [
    ("jsonl", '{"prompt": "fine"}\n{"prompt": oops}\n', "line 2 is not valid JSON"),
    ("jsonl", '{"prompt": "fine"}\n{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}\n',
     "line 2: messages[0].content has image_url parts; only text parts are supported"),
    ("sharegpt", '{"conversations": [', "is not valid JSON"),
    ("sharegpt", '[{"conversations": [{"from": "human", "value": "hi"}]}]', "has no usable conversations"),
])
def test_bad_dataset_is_refused_before_the_model_loads(tmp_path, no_model, kind, content, message):
    ds = tmp_path / "bad.json"
    ds.write_text(content)
    res = runner.invoke(app, ["bench", "tiny-llama", "--dataset", f"{kind}:{ds}", "--baseline", "hf", "-q",
                              "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()) and "Traceback" not in res.output
    assert not no_model


def test_random_prompts_too_long_are_refused_before_the_model_loads(tmp_path, no_model):
    res = runner.invoke(app, ["bench", "tiny-llama", "--input-len", "200", "--output-len", "100",
                              "--max-model-len", "256", "-q", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "do not fit the engine's max length of 256" in " ".join(res.output.split()) and not no_model


@pytest.mark.parametrize("kind", ["jsonl", "sharegpt"])
def test_dataset_with_a_byte_order_mark_runs(tmp_path, kind):
    long = "To cook rice, rinse it under cold water until the water runs clear"
    content = ('{"prompt": "hello there", "max_new_tokens": 3}\n' if kind == "jsonl" else
               json.dumps([{"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long}]}]))
    ds = tmp_path / "bom.json"
    ds.write_bytes(b"\xef\xbb\xbf" + content.encode("utf-8"))
    out = tmp_path / "out"
    res = runner.invoke(app, ["bench", "tiny-llama", "--dataset", f"{kind}:{ds}", "-c", "1", "-q", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "results.json").read_text())[0]["completed"] == 1
