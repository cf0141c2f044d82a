"""Session 56 review of `infer quantize` of mixtures of experts: what GPTQModel 7.6 cannot quantize is refused before
calibration (not a raw GPTQModel error after loading the model), and a Mixtral's report and summary name its modules as
its checkpoint does."""

from __future__ import annotations

import re

import pytest

from infer.errors import UnsupportedModelError

from helpers import save_random_model

QWEN2_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0,
                 tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, shared_expert_intermediate_size=64)
QWEN3_MOE = {k: v for k, v in QWEN2_MOE.items() if k != "shared_expert_intermediate_size"}


def refused(tmp_path, model_type, arch, config, match):
    """quantize_model of the random model refuses it before GPTQModel is reached."""
    from infer.quant import quantize as q
    save_random_model(tmp_path / "src", model_type, arch, config, 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(q, "require_gptqmodel", lambda: pytest.fail("calibration reached"))
        with pytest.raises(UnsupportedModelError, match=match):
            q.quantize_model(tmp_path / "src", tmp_path / "q", q.QuantizeOptions(group_size=32))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("model_type, arch, config, layers", [
    ("qwen3_moe", "Qwen3MoeForCausalLM", {**QWEN3_MOE, "decoder_sparse_step": 2}, "layer 0 "),
    ("qwen3_moe", "Qwen3MoeForCausalLM", {**QWEN3_MOE, "mlp_only_layers": [1]}, "layer 1 "),
    ("qwen2_moe", "Qwen2MoeForCausalLM", {**QWEN2_MOE, "mlp_only_layers": [0, 1]}, "layers 0, 1 "),
])
def test_a_moe_with_dense_layers_is_refused_before_calibration(tmp_path, model_type, arch, config, layers):
    """GPTQModel's Qwen MoE definitions give every layer the experts: a dense layer (mlp_only_layers,
    decoder_sparse_step) failed after loading with "layer module item `mlp.experts.0.gate_proj` not found"."""
    refused(tmp_path, model_type, arch, config, layers + r".*dense.*every layer has the experts")


def test_no_experts_leaves_every_layer_dense():
    """num_experts 0, under either name (transformers 5 writes Qwen3-MoE's as num_local_experts)."""
    from infer.quant.quantize import _check_moe_layers
    for field in ("num_experts", "num_local_experts"):
        with pytest.raises(UnsupportedModelError, match=rf"layers 0, 1 .*{field} 0 in config\.json"):
            _check_moe_layers("m", {"model_type": "qwen3_moe", "num_hidden_layers": 2, field: 0})
    _check_moe_layers("m", {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_local_experts": 8})


def test_every_layer_sparse_passes_the_check():
    from infer.quant.quantize import _check_moe_layers
    _check_moe_layers(None, {"model_type": "qwen3_moe", "num_hidden_layers": 4, "decoder_sparse_step": 1,
                             "mlp_only_layers": []})
    _check_moe_layers(None, {"model_type": "qwen2_moe", "num_hidden_layers": 4, "shared_expert_intermediate_size": 8})
    _check_moe_layers(None, {"model_type": "llama", "num_hidden_layers": 4, "decoder_sparse_step": 2})


def test_a_qwen2_moe_without_a_shared_expert_is_refused_before_calibration(tmp_path):
    """shared_expert_intermediate_size 0 (transformers builds a 0-wide shared expert): GPTQModel failed after loading
    and calibration ("cannot reshape tensor of 0 elements into shape [-1, 0]")."""
    refused(tmp_path, "qwen2_moe", "Qwen2MoeForCausalLM", {**QWEN2_MOE, "shared_expert_intermediate_size": 0},
            r"no shared expert \(shared_expert_intermediate_size 0")


def test_a_mixtrals_report_and_notes_name_its_modules_as_its_checkpoint_does(tmp_path):
    """The checkpoint names a Mixtral's experts block_sparse_moe.experts.N.w1/w3/w2: quantization_report.csv and the
    round-to-nearest note named GPTQModel's mlp.experts.N.gate_proj/up_proj/down_proj, modules the checkpoint lacks.
    One calibration window of 16 tokens: some experts get none (the note names them). `infer quantize` in a process
    of its own (GPTQModel patches transformers' MoE modules, which later tests in this process would see)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd
    from safetensors import safe_open
    pytest.importorskip("gptqmodel")
    out = tmp_path / "q"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "400"}
    res = subprocess.run([sys.executable, "-m", "infer.cli", "quantize", "tiny-mixtral", "-o", str(out),
                          "--group-size", "32", "--num-samples", "1", "--seq-len", "16"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    report = pd.read_csv(out / "quantization_report.csv")
    assert report["module"].str.contains(r"block_sparse_moe\.experts\.\d+\.w[123]$").sum() == 2 * 8 * 3
    assert all(f"model.layers.{r.layer}.{r.module}.qweight" in names for r in report.itertuples())
    gptqmodel_log = pd.read_csv(out / "quant_log.csv")  # GPTQModel's own report, kept beside infer's
    assert sorted(gptqmodel_log["module"]) == sorted(report["module"])
    text = " ".join((res.stdout + res.stderr).split())
    note = text[text.index("calibration routed"):]
    assert re.search(r"layer \d block_sparse_moe\.experts\.\d\.w[123]", note), note
    assert not re.search(r"layer \d mlp\.experts", text), text


def test_a_qwen_moes_unused_intermediate_size_is_not_checked():
    """Every layer of a Qwen MoE that GPTQModel quantizes has the experts: no projection is intermediate_size wide
    (the dense layers' width), so a --group-size that does not divide it (or a width that does not pack) is no reason
    to refuse; the experts' widths still are."""
    from infer.errors import ConfigError
    from infer.quant.quantize import _check_widths
    qwen3 = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 100, "moe_intermediate_size": 32}
    _check_widths(qwen3, 32, 4)
    _check_widths({**qwen3, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 64}, 32, 4)
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(48\)"):
        _check_widths({**qwen3, "moe_intermediate_size": 48}, 32, 4)
    with pytest.raises(ConfigError, match=r"intermediate_size \(100\)"):  # Mixtral's experts are that wide
        _check_widths({**qwen3, "model_type": "mixtral"}, 32, 4)
