"""Session 67, Llama 4 follow-ups: checkpoints of the hub's Llama-4-Scout-17B-16E-Instruct and
Llama-4-Maverick-17B-128E-Instruct shapes (Llama4ForConditionalGeneration, the hub's config.json fields: rope_scaling
llama3 or none, no_rope_layers [] derived, attn_temperature_tuning left out) read and planned on an 80 GB GPU; an
integer attn_temperature_tuning (transformers 4.51's 4) refused naming the fix; a GPTQ checkpoint's int4 experts (the
router's score scaling their input) through the Triton kernels (interpreted) giving the CPU path's tokens, top 1 and
top 2; an adapter of the router refused naming Llama 4."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer.cli.main import app

from test_probes_session67_llama4 import _gptq_checkpoint, build

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


# ------------------------------------------------------------------------------------------------------------ GPTQ
@interpreted
@pytest.mark.parametrize("top_k", [1, 2])
def test_int4_experts_through_the_triton_kernels_equal_the_cpu_path(tmp_path, monkeypatch, top_k):
    """A GPTQ Llama 4 in GPTQModel's layout (each expert's projections apart, 4-bit; 2 layers, the second's 4
    experts routed top `top_k`, their inputs scaled by the router's sigmoid) through every op's Triton kernel
    (interpreted), the experts int4 in the fused MoE kernel's layout: the CPU path's tokens."""
    from helpers import random_prompts
    from infer import LLM, SamplingParams, kernels
    from quant_helpers import int4_kernel_path
    build(tmp_path / "f", seed=5, num_hidden_layers=2, intermediate_size_mlp=64, num_experts_per_tok=top_k,
          no_rope_layers=[1, 0])
    out = _gptq_checkpoint(tmp_path / "f", tmp_path / "q")
    prompts, params = random_prompts(512, (5, 9), seed=4), SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(str(out), block_size=4) as llm:
        assert llm.engine.runner.model.layers[1].feed_forward.int4 is None  # (the CPU's: dequantized at load)
        cpu = [o.token_ids for o in llm.generate(prompts, params)]
    int4_kernel_path(monkeypatch)
    calls, real = [], kernels.fused_moe_int4
    monkeypatch.setattr(kernels, "fused_moe_int4", lambda *a, **k: calls.append(1) or real(*a, **k))
    with LLM(str(out), block_size=4, max_model_len=32) as llm:
        block = llm.engine.runner.model.layers[1].feed_forward
        assert block.int4 is not None and block.top_k == top_k and block.llama4
        assert [o.token_ids for o in llm.generate(prompts, params)] == cpu
    assert calls  # (the experts ran int4, in the fused MoE kernel)
    assert len({t for tokens in cpu for t in tokens}) > 3


# ------------------------------------------------------------------------------------------------------ adapters
def test_an_adapter_of_the_router_is_refused_naming_llama4(tmp_path):
    """peft adapts Llama 4's router (feed_forward.router, a Linear) where target_modules names it; infer's routers
    take no adapter: refused naming Llama 4's router and what to train instead, before anything loads."""
    from infer import LLM
    from infer.errors import LoRAError
    from lora_helpers import save_adapter
    hf = build(tmp_path / "base", seed=3)
    router = save_adapter(hf, tmp_path / "r", 1, r=4, lora_alpha=8, target_modules=["q_proj", "router"],
                          lora_dropout=0.0)
    with pytest.raises(LoRAError, match=r"targets \['router'\] \(feed_forward\.router\): infer does not adapt "
                       r"Llama 4's experts or router"):
        LLM(str(tmp_path / "base"), loras={"x": str(router)}, max_lora_rank=8)
