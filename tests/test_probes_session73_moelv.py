"""`infer lora-validate --quantized` on a GPTQ mixture of experts stopped with "cannot build the float oracle: no
weight for model.layers.0.mlp.experts.down_proj": its oracle was transformers' model built from the config with the
engine's dequantized weights copied in by name, and transformers 5 stacks the experts (gate_up_proj, down_proj) where
infer holds w13 and w2, names routers its own way (block_sparse_moe.router, gate.wg) and keeps the score-correction
biases as buffers that a copy of parameters never filled. Its oracle is now transformers' own load of the
checkpoint's weights dequantized as infer dequantizes them (lora_check.dequantized_moe_oracle)."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from infer.cli import demo as demo_module
from infer.models.tiny import ensure_builtin

from quant_helpers import check_lora_validate_quantized
from test_probes_session56_review_moeq import rtn_gptq


@pytest.mark.parametrize("name, mlp", [("tiny-mixtral", ["w1", "w3", "w2"]), ("tiny-phimoe", []),
                                       ("tiny-glm4-moe", ["gate_proj", "up_proj", "down_proj"])])
def test_lora_validate_quantized_on_a_gptq_mixture_of_experts_agrees_with_peft(tmp_path, name, mlp):
    """Mixtral's experts (w1, w3, w2), GLM-4.5's (a dense first layer, shared experts, the router's score-correction
    bias): an adapter of the attention and, through peft's conversion, the experts is checked against peft on the
    dequantized int4 base and agrees; Phi-3.5-MoE's (its router, a biased head; peft converts none of its names) with
    an adapter of the attention."""
    rtn_gptq(ensure_builtin(name), tmp_path / "q")
    demo_module.make_random_adapter(ensure_builtin(name), tmp_path / "a", 8, ["q_proj", "v_proj", *mlp], seed=1)
    check_lora_validate_quantized(tmp_path / "q", tmp_path / "a")
    if mlp:  # (peft's conversion: the experts' stacked parameters)
        held = {k for k in safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt").keys()}
        assert any("experts" in k for k in held), held
