"""Session 53 review of the Phi-3 support: defects found beyond its own tests, each pinned here."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from lora_helpers import hf_float, save_adapter
from quant_helpers import make_gptqmodel_checkpoint, needs_gptqmodel


def test_lora_validates_oracle_state_keeps_a_fused_modules_rows_together():
    """lora-validate's oracle for a GPTQ base (peft on the engine's dequantized weights) reads the engine's merged
    layers under HF names: a fused Phi-3 qkv_proj / gate_up_proj is every shard's rows, not the last shard's (each
    shard overwrote the one before, and the oracle's copy failed)."""
    from infer.cli.lora_check import dequantized_state
    path = ensure_builtin("tiny-phi3")
    with LLM("tiny-phi3") as llm:
        state = dequantized_state(llm.engine.runner.model)
    stored = load_file(path / "model.safetensors")
    for key in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        assert torch.equal(state[key], stored[key].float()), key


@needs_gptqmodel
def test_lora_validate_quantized_on_a_gptq_phi3(tmp_path):
    base = ensure_builtin("tiny-phi3")
    qdir = make_gptqmodel_checkpoint(base, tmp_path / "q", bits=4, group_size=32, seq_len=32)
    adapter = save_adapter(hf_float(base), tmp_path / "a", seed=1, lora_dropout=0.0, r=4, lora_alpha=8,
                           target_modules=["qkv_proj", "gate_up_proj"])
    res = CliRunner().invoke(app, ["lora-validate", str(qdir), str(adapter), "--quantized", "--json", "--steps", "2"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["ok"], res.output


def test_a_regex_selecting_phi3s_activation_or_dropout_is_refused_as_peft_refuses_it(tmp_path):
    """peft refuses a target_modules regex that selects a non-Linear module ("Target module SiLUActivation() is not
    supported"): Phi-3's MLP names its activation activation_fn (not Llama's act_fn) and its layers hold
    resid_attn_dropout / resid_mlp_dropout; such an adapter was accepted and served as if plain."""
    from transformers import AutoConfig

    from infer.lora.adapter import adapter_problems
    base = ensure_builtin("tiny-phi3")
    adapter = save_adapter(hf_float(base), tmp_path / "a", seed=1, lora_dropout=0.0, r=4, lora_alpha=8,
                           target_modules=["qkv_proj"])
    for regex, module in ((r".*\.(qkv_proj|activation_fn)", "mlp.activation_fn"),
                          (r".*(qkv_proj|resid_attn_dropout)", "resid_attn_dropout")):
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        cfg["target_modules"] = regex
        (adapter / "adapter_config.json").write_text(json.dumps(cfg))
        problems = [p.message for p in adapter_problems("a", adapter, AutoConfig.from_pretrained(base))]
        assert any(f"selects model.layers.0.{module}, which is not a Linear layer" in m for m in problems), problems
