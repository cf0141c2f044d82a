"""Session 68: AllenAI's FlexOlmo (FlexOlmoForCausalLM, model_type flex_olmo: FlexOlmo-7x7B-1T), end to end on tiny
random models (float32) against transformers: OLMo 2's layer (no norm before the attention and the MLP, one after
each, before the residual adds it; RMSNorms weighting in float32; q and k normed over their whole projections; the
rotary in float32) with OLMoE's experts on every layer (a float32 softmax router, its top k renormalised where
norm_topk_prob says; mlp.experts.N.gate_proj, up_proj, down_proj); chunked prefill and prefix caching; the GPU code
path interpreted; peft adapters mixed in one batch; GPTQ checkpoints; the built-in tiny-flex-olmo; what infer cannot
run refused naming the field."""

from __future__ import annotations

import pytest
import torch

from infer import LLM

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_greedy_and_logprobs_equal_transformers, check_stray_sliding_window, estimate_refusal,
                     norms_shifted_biases_drawn, save_random_model)
from quant_helpers import needs_gptqmodel

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
ARCH = "FlexOlmoForCausalLM"
BUILTIN = "tiny-flex-olmo"
# FlexOlmo-7x7B-1T's shape, shrunk: 32 layers there, 32 heads of 128, 7 experts of 11008 (top 5, not renormalised);
# here 2 layers, 4 heads of 16 (2 KV heads), 7 experts of 32 (top 3)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts=7, num_experts_per_tok=3, max_position_embeddings=256,
             eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def build(folder, seed: int = 0, **config):
    """A random FlexOlmo folder (float32) with the tiny-llama tokenizer, norms shifted and biases drawn; returns
    transformers' model (eager)."""
    return save_random_model(folder, "flex_olmo", ARCH, {**SMALL, **config}, seed, norms_shifted_biases_drawn)


CONFIGS = {
    "top3": dict(),
    # renormalised top 2, q/k/v/o biases, a tied head, as many KV heads as heads
    "renormalised-biases-tied": dict(num_experts_per_tok=2, norm_topk_prob=True, attention_bias=True,
                                     tie_word_embeddings=True, num_key_value_heads=4),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; every
    layer sparse, its norms after the attention and the MLP only (float32-weighted), q and k normed whole."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path, **CONFIGS[name])

    def check_model(model):
        for layer in model.layers:
            assert isinstance(layer.mlp, SparseMoeBlock) and not hasattr(layer, "input_layernorm")
            assert layer.post_feedforward_layernorm.float_weight and layer.self_attn.qk_norm_whole
            assert layer.mlp.top_k == hf.config.num_experts_per_tok
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, name, check_model)


def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path):
    check_chunked_prefill_and_prefix_caching(tmp_path, build(tmp_path, seed=1, norm_topk_prob=True))


def test_a_stray_sliding_window_caps_the_context(tmp_path):
    """FlexOlmo's attention is full whatever config.json says (transformers' FlexOlmoModel masks no window), while its
    generate() cache keeps the last sliding_window keys of a config.json with one: the context is capped at the
    window, no layer slides (models.limits.WINDOW_IGNORED)."""
    check_stray_sliding_window(tmp_path, build(tmp_path, sliding_window=16), "flex_olmo")


def test_builtin_tiny_model_runs_and_warmup_sizes_it():
    check_builtin_runs_and_warmup_sizes_it(BUILTIN, ARCH, False)


@interpreted
def test_the_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch):
    """The GPU code path (the fused MoE, the RMSNorm kernels weighting in float32 without a residual, q and k normed
    whole; Triton interpreted, emulated CUDA graphs and piecewise graphs): transformers' tokens."""
    from quant_helpers import check_gpu_path_equals_transformers
    check_gpu_path_equals_transformers(tmp_path, monkeypatch, build(tmp_path, seed=2))


REFUSED = {  # config -> words of the refusal
    "top-k-past-the-experts": (dict(num_experts_per_tok=8), "config.json has num_experts_per_tok 8 with num_experts 7"),
    "act": (dict(hidden_act="gelu"), "gelu"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_infer_cannot_run_is_refused_up_front_naming_the_field(tmp_path, name):
    config, words = REFUSED[name]
    text = estimate_refusal(tmp_path, "flex_olmo", ARCH, **{**SMALL, **config})
    assert words in text, text


# ------------------------------------------------------------------------------------------------------- GPTQ
@needs_gptqmodel
def test_infer_quantize_equals_gptqmodels_load_through_its_olmoe_definition(tmp_path):
    """GPTQModel 7.6 has no FlexOlmo definition (it took one for OLMo 2 and failed after loading: "layer module item
    `mlp.down_proj` not found"): `infer quantize` of tiny-flex-olmo runs GPTQModel's OLMoE definition given
    FlexOlmo's norms (quantize._flex_olmo_view), which quantizes the attention and each expert (the router float;
    every token's 3 experts calibrated); infer gives GPTQModel's load's greedy tokens (under that definition too: its
    own load leaves the experts unread, which the notes say); warmup --estimate counts its weights as loaded."""
    import pandas as pd
    from safetensors.torch import load_file

    from helpers import estimated_plan, greedy_tokens, random_prompts
    from infer.memory.sizes import weights_bytes
    from infer.quant.quantize import _flex_olmo_view
    from quant_helpers import gptqmodel_greedy, infer_quantize
    out = infer_quantize("tiny-flex-olmo", tmp_path / "q")
    state = load_file(out / "model.safetensors")
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts.6.down_proj", "mlp.experts.2.up_proj"):
        assert f"model.layers.1.{name}.qweight" in state, name
    assert state["model.layers.1.mlp.gate.weight"].is_floating_point()
    report = pd.read_csv(out / "quantization_report.csv")
    gates = report[report["module"].str.endswith("gate_proj") & (report["layer"] == 0)]
    assert gates["samples"].sum() == 3 * 256  # (8 samples of 32 tokens, each routed to 3 experts)
    prompts = random_prompts(512, (6, 15), seed=11)
    plan = estimated_plan(str(out), "--dtype", "float32")
    with LLM(str(out), block_size=4, dtype="float32") as llm:
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)
        got = greedy_tokens(llm, prompts, 6)
    with _flex_olmo_view(out):
        assert got == gptqmodel_greedy(out, prompts, 6, every_float=True)
    with LLM("tiny-flex-olmo", block_size=4) as llm:
        assert got != greedy_tokens(llm, prompts, 6)  # (the int4 weights change the tokens)


# ------------------------------------------------------------------------------------------------------- LoRA
# the attention and the experts: through target_modules gate_proj, up_proj, down_proj, which peft (on transformers 5)
# turns into the experts' parameters (FlexOlmo: qwen2_moe's conversion; gate and up one gate_up_proj of rank 2r), or
# peft's target_parameters of the names that conversion gives (peft mixes adapters of one set of parameters only)
ADAPTERS = {"all8": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                        target_parameters=["gate_up_proj", "down_proj"])}


@pytest.fixture(scope="module")
def flex_lora(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of ADAPTERS (peft's) on a FlexOlmo."""
    from lora_helpers import base_and_adapters
    return base_and_adapters(tmp_path_factory.mktemp("flex_olmo_lora"), ADAPTERS, build)


def test_peft_adapters_equal_peft_alone_and_mixed(flex_lora):
    """Adapters of the attention (its q and k norms over the adapted projections) and the stacked experts, each alone
    and mixed with the base in one batch: peft's tokens."""
    from helpers import random_prompts
    from lora_helpers import check_mixed_adapters_equal_peft
    check_mixed_adapters_equal_peft(*flex_lora, random_prompts(512, (5, 9, 7), seed=6), ["all8", None, "qv4"], n=4)


def test_an_adapter_of_the_router_is_refused_naming_it(flex_lora, tmp_path):
    """Weights on the router (mlp.gate): refused naming the module, by `infer lora validate`'s checks and at load."""
    from transformers import AutoConfig

    from infer.errors import LoRAError
    from infer.lora.adapter import adapter_problems
    from lora_helpers import adapter_with_module
    base, _, paths = flex_lora
    module = "layers.1.mlp.gate"
    folder = adapter_with_module(paths["qv4"], tmp_path / "a", module, 4, 64, 7)
    problems = adapter_problems("x", folder, AutoConfig.from_pretrained(base))
    assert any("not its router (gate)" in p.message and module in p.message for p in problems), problems
    with pytest.raises(LoRAError, match="gate"):
        LLM(str(base), loras={"x": str(folder)})


def test_an_adapter_config_naming_the_experts_gate_proj_up_proj_down_proj_is_accepted(flex_lora, tmp_path):
    """An adapter_config.json naming FlexOlmo's experts by transformers 4's target_modules gate_proj, up_proj and
    down_proj (peft turns them into the stacked parameters: its qwen2_moe conversion) passes infer's checks and gives
    the tokens of the same adapter saved with target_parameters."""
    from lora_helpers import check_expert_target_modules_adapter
    base, _, paths = flex_lora
    check_expert_target_modules_adapter(base, paths["qv4"], tmp_path / "v4", ["gate_proj", "up_proj", "down_proj"])


def test_an_adapter_without_target_modules_is_refused_as_peft_refuses_it(flex_lora, tmp_path):
    """An adapter of the attention whose adapter_config.json lost target_modules: peft has no default for FlexOlmo
    and refuses it (its MoE conversion: "No `target_modules` passed but also no `target_parameters`"), and so does
    infer, naming the family."""
    import json
    import shutil

    from peft import PeftModel

    from infer.errors import LoRAError
    from lora_helpers import hf_float, save_adapter
    base, hf, _ = flex_lora
    adapter = save_adapter(hf, tmp_path / "qv", 5, r=4, lora_alpha=4, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj"])
    path = shutil.copytree(adapter, tmp_path / "a")
    cfg = json.loads((path / "adapter_config.json").read_text())
    del cfg["target_modules"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="No `target_modules` passed"):
        PeftModel.from_pretrained(hf_float(base), str(path))
    with pytest.raises(LoRAError, match="peft has no default for a flex_olmo base"):
        LLM(str(base), loras={"a": str(path)})


def test_infer_run_and_bench_on_the_builtin_model(tmp_path):
    from helpers import check_run_and_bench_builtin
    check_run_and_bench_builtin(tmp_path, BUILTIN)
