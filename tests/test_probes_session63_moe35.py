"""Session 63: three more mixture-of-experts families through models.moe, end to end on tiny random models (float32)
against transformers. GraniteMoeShared (GraniteMoeSharedForCausalLM): Granite MoE with a dense shared MLP
(layers.N.shared_mlp.input_linear / output_linear) added to the experts' output; chunked prefill, prefix caching,
the GPU code path (interpreted), peft adapters (attention, stacked experts) mixed in a batch, the built-in
tiny-granitemoeshared, warmup --estimate; what infer cannot run of it refused."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_equal_transformers, random_prompts, save_random_model)
from lora_helpers import check_all8_qv4_equal_peft, hf_float, save_adapter
from quant_helpers import check_gpu_path_equals_transformers, gptqmodel_greedy, infer_quantize, needs_gptqmodel

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def shifted(name, p):
    """A save_random_model perturb: norms and biases drawn off their init (a bug in them would go unseen)."""
    if "norm" in name:
        p.add_(torch.randn_like(p) * 0.3)
    elif name.endswith("bias"):
        p.normal_(0.0, 0.5)


def generate_equal_transformers(folder, hf, name, **engine):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched (blocks of 4): transformers' tokens, the logprobs
    within 1e-4. Returns the loaded model's first layer."""
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(folder), block_size=4, **engine) as llm:
        layer = llm.engine.runner.model.layers[0]
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)
    return layer


# ======================================================================================== GraniteMoeShared
# Granite MoE's tiny shape (session 62's) with a shared MLP of 48 beside the 8 experts of 32 (top 2)
GRANITE = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48,
               max_position_embeddings=256, embedding_multiplier=12.0, residual_multiplier=0.22,
               attention_multiplier=0.0625, logits_scaling=4.0, eos_token_id=2, pad_token_id=0)
GRANITE_EXPERTS = ["block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"]


def build_granite(folder, seed: int = 0, **config):
    """A random GraniteMoeShared folder (float32, the hub's names) with the tiny-llama tokenizer; returns
    transformers' model (eager)."""
    return save_random_model(folder, "granitemoeshared", "GraniteMoeSharedForCausalLM", {**GRANITE, **config}, seed,
                             shifted)


GRANITE_CONFIGS = {"gqa-top2-shared48": dict(), "mha-top1-biases-shared96": dict(
    num_key_value_heads=4, num_experts_per_tok=1, attention_bias=True, shared_intermediate_size=96),
    "no-shared-mlp": dict(shared_intermediate_size=0)}


@pytest.mark.parametrize("name", GRANITE_CONFIGS)
def test_granitemoeshared_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """The checkpoint in the hub's names (block_sparse_moe.input_linear, shared_mlp.input_linear ...): transformers'
    tokens and logprobs; the shared MLP of shared_intermediate_size (none where it is 0)."""
    from safetensors.torch import load_file
    hf = build_granite(tmp_path, **GRANITE_CONFIGS[name])
    shared = hf.config.shared_intermediate_size
    stored = set(load_file(tmp_path / "model.safetensors"))
    assert ("model.layers.0.shared_mlp.input_linear.weight" in stored) == bool(shared)
    layer = generate_equal_transformers(tmp_path, hf, name)
    mlp = layer.mlp.shared_experts
    assert (mlp is None) if not shared else mlp.gate_up_proj.names == ["model.layers.0.shared_mlp.input_linear"] * 2


@pytest.mark.parametrize("builder", ["granitemoeshared"])
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, builder):
    check_chunked_prefill_and_prefix_caching(tmp_path, BUILDERS[builder](tmp_path, seed=1))


@interpreted
@pytest.mark.parametrize("builder", ["granitemoeshared"])
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, builder):
    """Every op through its Triton kernel (interpreted on CPU), the fused MoE with the family's router and the shared
    MLP: transformers' tokens."""
    check_gpu_path_equals_transformers(tmp_path, monkeypatch, BUILDERS[builder](tmp_path))


def test_granitemoeshared_peft_adapters_equal_peft_alone_and_mixed(tmp_path):
    """Adapters of the attention and the stacked experts (target_parameters block_sparse_moe.experts.*), each alone
    and mixed with the base in one batch: peft's tokens (weights at 0.5's scale, as Granite MoE's test)."""
    build_granite(tmp_path / "base")
    hf = hf_float(tmp_path / "base")
    adapters = {"all8": dict(r=8, lora_alpha=16, target_modules=ATTENTION, target_parameters=GRANITE_EXPERTS),
                "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                            target_parameters=GRANITE_EXPERTS)}
    paths = {name: save_adapter(hf, tmp_path / name, seed=i + 1, scale=0.5, lora_dropout=0.0, **kw)
             for i, (name, kw) in enumerate(adapters.items())}
    check_all8_qv4_equal_peft(tmp_path / "base", hf, paths)


def test_granitemoeshared_an_adapter_of_the_shared_mlp_is_refused_naming_it(tmp_path):
    """peft adapts shared_mlp.input_linear (an nn.Linear of gate|up) through target_modules; infer does not adapt
    the shared MLP: the load refuses the adapter naming the module."""
    build_granite(tmp_path / "base")
    path = save_adapter(hf_float(tmp_path / "base"), tmp_path / "ad", seed=1, r=4, lora_alpha=4,
                        target_modules=["q_proj", "input_linear"], lora_dropout=0.0)
    with pytest.raises(Exception) as err:
        LLM(str(tmp_path / "base"), loras={"a": str(path)})
    assert "targets ['input_linear']: infer does not adapt GraniteMoeShared's shared MLP" in str(err.value), \
        str(err.value)


@needs_gptqmodel
def test_granitemoeshared_infer_quantize_equals_gptqmodels_load(tmp_path):
    """`infer quantize` through GPTQModel (the attention and the shared MLP quantized, the stacked experts left
    float): infer's tokens equal GPTQModel's own load; the shared MLP's fused input_linear read as its gate_up."""
    build_granite(tmp_path / "f")
    infer_quantize(tmp_path / "f", tmp_path / "q")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(tmp_path / "q"), block_size=4, dtype="float32") as llm:
        assert llm.engine.runner.model.layers[0].mlp.shared_experts.gate_up_proj.qweight is not None
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]
    assert got == gptqmodel_greedy(tmp_path / "q", prompts, 8)
    assert len({t for tokens in got for t in tokens}) > 6


def test_granitemoeshared_builtin_tiny_model_runs_and_warmup_sizes_it():
    check_builtin_runs_and_warmup_sizes_it("tiny-granitemoeshared", "GraniteMoeSharedForCausalLM", False,
                                           lengths=(6, 90))


BUILDERS = {"granitemoeshared": build_granite}
