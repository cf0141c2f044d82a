"""Session 68: Microsoft's Phi-3.5-MoE (PhimoeForCausalLM, model_type phimoe: Phi-3.5-MoE-instruct), end to end on
tiny random models (float32) against transformers: LayerNorms with biases (StarCoder2's loop), q/k/v/o biases
(attention_bias), a head bias (lm_head_bias), longrope whose short_mscale scales cos and sin, and on every layer
Mixtral's layer of experts (block_sparse_moe.experts.N.w1, w3, w2) routed by the sparsemixer (two experts a token,
each the softmax's value over the logits within 2 * router_jitter_noise of its top, in eval mode); chunked prefill and
prefix caching; the GPU code path interpreted; peft adapters mixed in one batch; GPTQ checkpoints; the built-in
tiny-phimoe; the memory plan of Phi-3.5-MoE's shapes; what infer cannot run refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_greedy_and_logprobs_equal_transformers, estimate_refusal, greedy_each, hub_shaped_folder,
                     norms_shifted_biases_drawn, random_prompts, save_random_model)
from quant_helpers import needs_gptqmodel

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
ARCH = "PhimoeForCausalLM"
BUILTIN = "tiny-phimoe"
# Phi-3.5-MoE's longrope, shrunk: factors for heads of 16 (8 frequencies), its original context 4096 there, 64 here
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.3 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)], "short_mscale": 1.2, "long_mscale": 1.2,
            "original_max_position_embeddings": 64}
# Phi-3.5-MoE's shape, shrunk: 32 layers there, 32 heads of 128 (8 KV heads), 16 experts of 6400 (top 2); here 2
# layers, 4 heads of 16 (2 KV heads), 8 experts of 32, the router's jitter 0.3 (Phi-3.5-MoE's 0.01: here its masks
# drop some logits of tiny random routers)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
             eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, attention_bias=True, lm_head_bias=True,
             router_jitter_noise=0.3, rope_parameters=LONGROPE)


def build(folder, seed: int = 0, **config):
    """A random Phi-3.5-MoE folder (float32) with the tiny-llama tokenizer, norms shifted and biases drawn (the
    LayerNorms' too); returns transformers' model (eager)."""
    return save_random_model(folder, "phimoe", ARCH, {**SMALL, **config}, seed, norms_shifted_biases_drawn)


CONFIGS = {
    "longrope-biases": dict(),
    # the default rope, no biases but the norms', Phi-3.5-MoE's jitter, a sliding window of 8 (prompts pass it)
    "default-rope-window": dict(attention_bias=False, lm_head_bias=False, router_jitter_noise=0.01, sliding_window=8,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; every
    layer sparse under block_sparse_moe, its norms LayerNorms with biases, the head's bias where lm_head_bias says."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path, **CONFIGS[name])

    def check_model(model):
        for layer in model.layers:
            assert isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.phimoe
            assert layer.mlp.prefix.endswith(".block_sparse_moe") and layer.input_layernorm.bias is not None
        assert (model.head_bias is not None) == hf.config.lm_head_bias
        assert model.layers[0].self_attn.window == (hf.config.sliding_window or 0)
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, name, check_model)


def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path):
    """Phi-3.5-MoE's mscales unequal (long_mscale past the original context of 64: the context capped there),
    no q/k/v/o biases: in chunks of 12 and with prefix caching, transformers' tokens."""
    from infer.models.rope import rope_max_positions
    hf = build(tmp_path, seed=1, attention_bias=False, rope_parameters={**LONGROPE, "long_mscale": 1.5})
    assert rope_max_positions(hf.config) == 64
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


def test_the_sparsemixer_equals_transformers_in_eval_mode(tmp_path):
    """SparseMoeBlock.route of 256 tokens against transformers' PhimoeTopKRouter (eval mode) of the same weights, in
    float32 and bfloat16: the same two experts in the same order and the same weights (the model's dtype); the masks
    decide (the weights differ from the plain softmax's top 2, and from the jitter's masks of 0)."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path)
    router = hf.model.layers[0].mlp.router.eval()
    for dtype in (torch.float32, torch.bfloat16):
        block = SparseMoeBlock(hf.config, "model.layers.0.block_sparse_moe", lambda names: None, dtype)
        block.gate.weight.data.copy_(router.weight)
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
        with torch.no_grad():
            _, want_w, want_ids = router.to(dtype)(x)
        weights, ids = block.route(x)
        assert weights.dtype == dtype and torch.equal(ids, want_ids) and torch.equal(weights, want_w)
        plain = torch.softmax(x.float() @ router.weight.float().T, dim=-1).topk(2, dim=-1).values.to(dtype)
        assert not torch.equal(weights, plain)
        block.jitter = 0.0
        assert not torch.equal(block.route(x)[0], want_w)


def test_transformers_5s_own_names_load_too(tmp_path):
    """A state dict saved as transformers 5 holds it (mlp.router, the stacked mlp.experts.gate_up_proj [E, 2I, H] and
    down_proj [E, H, I], not the hub's block_sparse_moe.gate and experts.N.w1, w3, w2): transformers' tokens."""
    from safetensors.torch import save_file

    from helpers import greedy_tokens
    hf = build(tmp_path, seed=4)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.router.weight" in state and state["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(512, (7, 12), seed=5)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 6) == greedy_each(hf, prompts, 6)


def test_builtin_tiny_model_runs_and_warmup_sizes_it():
    check_builtin_runs_and_warmup_sizes_it(BUILTIN, ARCH, False)




# ------------------------------------------------------------------------------------------------------- memory
# Phi-3.5-MoE-instruct's config.json: its longrope factors (64 a head of 128) stand in by ones (their values change no
# shape), its mscales equal (1.243163121016122)
HUB = dict(vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_hidden_layers=32, num_attention_heads=32,
           num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2, max_position_embeddings=131072,
           sliding_window=131072, attention_bias=True, lm_head_bias=True, tie_word_embeddings=False,
           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 64,
                            "long_factor": [1.0] * 64, "short_mscale": 1.243163121016122,
                            "long_mscale": 1.243163121016122, "original_max_position_embeddings": 4096})


def test_warmup_plans_phi35_moes_shapes(tmp_path, monkeypatch):
    """`infer warmup --estimate` of a checkpoint of Phi-3.5-MoE-instruct's shapes (no values): its 41.9 billion
    parameters' bfloat16 bytes (the CPU's prepacked copies of the dense layers on top, under 15% more), a KV cache of
    32 x 2 x 8 x 128 x 2 bytes a token, its context not capped at the original 4096 (the mscales equal), 8,192 tokens
    planned for on a host of 256 GiB given 120 GB."""
    params = hub_shaped_folder(tmp_path, "phimoe", ARCH, HUB)
    assert 41.8e9 < params < 42.0e9, params
    monkeypatch.setattr("infer.memory.plan.device_total", lambda device: 256 << 30)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--dtype", "bfloat16",
                                   "--max-length", "8192", "--device", "cpu", "--memory-limit", "120GB"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    assert plan["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert 2 * params <= plan["weights_bytes"] < 2 * params * 1.15, (plan["weights_bytes"], params)
    assert plan["max_concurrency_at_max_length"] >= 1, plan


def test_phi35_moe_in_int4_fits_one_80_gb_gpu_with_a_long_context(tmp_path):
    """A 4-bit GPTQ checkpoint of Phi-3.5-MoE's shapes (groups of 128, GPTQModel's layout: each expert's w1, w3, w2
    apart; no values): the weights a GPU holds (the experts int4, about 0.53 bytes a parameter) with the KV cache of
    131,072 tokens (its whole context) fit one 80 GB GPU with a tenth to spare."""
    from infer.memory.checkpoint import checkpoint_load_bytes
    from infer.memory.sizes import kv_bytes_per_token
    from infer.models.loader import load_config
    params = hub_shaped_folder(tmp_path, "phimoe", ARCH, HUB, gptq_group=128)
    cfg = load_config(tmp_path)
    weights = checkpoint_load_bytes(tmp_path, cfg, torch.bfloat16, torch.device("cuda"))
    assert 0.5 * params < weights < 0.56 * params, (weights, params)
    assert weights + 131072 * kv_bytes_per_token(cfg, torch.bfloat16) < 0.9 * 80e9


# ------------------------------------------------------------------------------------------------------ refusals
REFUSED = {  # config -> words of the refusal
    "top-1": (dict(num_experts_per_tok=1), "phimoe with num_experts_per_tok 1 is not supported: Phi-3.5-MoE's "
                                           "sparsemixer router (transformers') routes every token to 2 experts"),
    "top-4": (dict(num_experts_per_tok=4), "phimoe with num_experts_per_tok 4 is not supported"),
    "jitter-negative": (dict(router_jitter_noise=-0.1), "phimoe with router_jitter_noise -0.1 is not supported"),
    "jitter-inf": (dict(router_jitter_noise=float("inf")), "phimoe with router_jitter_noise inf is not supported"),
    "mscale-inf": (dict(rope_parameters={**LONGROPE, "long_mscale": float("inf")}),
                   "phimoe's longrope rope_parameters need long_mscale (a number scaling cos and sin), got inf"),
    "act": (dict(hidden_act="gelu"), "gelu"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_infer_cannot_run_is_refused_up_front_naming_the_field(tmp_path, name):
    config, words = REFUSED[name]
    text = estimate_refusal(tmp_path, "phimoe", ARCH, **{**SMALL, **config})
    assert words in text, text


# ------------------------------------------------------------------------------------------------------- LoRA
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# the attention and the stacked experts (peft's target_parameters: peft has no conversion of Phi-3.5-MoE's target
# modules w1, w3, w2 of transformers 4, which name no module of transformers 5's PhimoeExperts)
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=ATTENTION, target_parameters=EXPERTS),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"], target_parameters=EXPERTS)}


@pytest.fixture(scope="module")
def phimoe_lora(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of ADAPTERS (peft's) on a Phi-3.5-MoE."""
    from lora_helpers import base_and_adapters
    return base_and_adapters(tmp_path_factory.mktemp("phimoe_lora"), ADAPTERS, build)


def test_peft_adapters_equal_peft_alone_and_mixed(phimoe_lora):
    """Adapters of the attention (its biases kept) and the stacked experts, each alone and mixed with the base in one
    batch: peft's tokens."""
    from lora_helpers import check_all8_qv4_equal_peft
    check_all8_qv4_equal_peft(*phimoe_lora)


@pytest.mark.parametrize("module, width, words", [
    ("layers.1.mlp.router", (4, 64, 8), "not its router (gate)"),
    ("layers.1.block_sparse_moe.gate", (4, 64, 8), "not its router (gate)")])
def test_an_adapter_of_the_router_is_refused_naming_it(phimoe_lora, tmp_path, module, width, words):
    """Weights on the router (transformers 5's mlp.router, a Linear peft adapts where target_modules names it; the
    hub's block_sparse_moe.gate): refused naming the module, by `infer lora validate`'s checks and at load."""
    from transformers import AutoConfig

    from infer.errors import LoRAError
    from infer.lora.adapter import adapter_problems
    from lora_helpers import adapter_with_module
    base, _, paths = phimoe_lora
    folder = adapter_with_module(paths["qv4"], tmp_path / "a", module, *width)
    problems = adapter_problems("x", folder, AutoConfig.from_pretrained(base))
    assert any(words in p.message and module in p.message for p in problems), problems
    with pytest.raises(LoRAError, match=module.rpartition(".")[2]):
        LLM(str(base), loras={"x": str(folder)})


# ------------------------------------------------------------------------------------------------------- GPTQ
@pytest.fixture(scope="module")
def rtn_pair(tmp_path_factory):
    """(a float Phi-3.5-MoE folder, a GPTQ checkpoint of it in GPTQModel's layout: the attention and each expert's w1,
    w3 and w2 4-bit by round to nearest, apart under block_sparse_moe; the router, norms and head float)."""
    from quant_helpers import rtn_gptq_pair
    return rtn_gptq_pair(tmp_path_factory.mktemp("phimoe_rtn"), lambda folder: build(folder, seed=3))


def test_a_gptq_checkpoint_equals_transformers_on_its_dequantized_weights(rtn_pair):
    """infer's CPU path (the experts dequantized at load) gives transformers' greedy tokens of the same weights
    dequantized, varied; warmup --estimate counts its weights as loaded."""
    from quant_helpers import check_gptq_moe_equals_dequantized
    check_gptq_moe_equals_dequantized(*rtn_pair, lambda layer: layer.self_attn.qkv_proj)


@interpreted
def test_the_gpu_code_path_interpreted_equals_transformers(rtn_pair, monkeypatch):
    """The GPU code path of the GPTQ checkpoint (the experts int4 through the fused MoE kernel with the sparsemixer's
    weights, the attention's int4 kernels with their biases, the LayerNorm kernels with biases, the head's bias;
    Triton interpreted, emulated CUDA graphs and piecewise graphs): transformers' tokens of the dequantized weights."""
    from quant_helpers import check_gpu_path_equals_transformers, dequantized_float_model
    hf = dequantized_float_model(*rtn_pair)
    hf.generation_config.eos_token_id = None
    check_gpu_path_equals_transformers(rtn_pair[1], monkeypatch, hf)


@pytest.fixture(scope="module")
def gptq_phimoe(tmp_path_factory):
    """`infer quantize tiny-phimoe` (GPTQModel 7.6's phimoe definition): its output folder."""
    from quant_helpers import infer_quantize
    return infer_quantize("tiny-phimoe", tmp_path_factory.mktemp("gq") / "q")


@needs_gptqmodel
def test_infer_quantize_writes_phi35_moes_names_and_equals_gptqmodels_load(gptq_phimoe, tmp_path):
    """`infer quantize` of tiny-phimoe through GPTQModel quantizes the attention and each expert's projections, the
    router float; GPTQModel saves them under transformers 5's names (mlp.experts.N.gate_proj, up_proj, down_proj;
    mlp.router), which infer writes as Phi-3.5-MoE's own checkpoints name them (block_sparse_moe.experts.N.w1, w3, w2;
    block_sparse_moe.gate), the same tensors. GPTQModel.load reads only its own names: the checkpoint renamed back
    loads there with infer's greedy tokens; warmup --estimate counts its weights as loaded."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from helpers import estimated_plan, greedy_tokens
    from infer.memory.sizes import weights_bytes
    from quant_helpers import gptqmodel_greedy
    state = load_file(gptq_phimoe / "model.safetensors")
    for name in ("self_attn.q_proj", "self_attn.o_proj", "block_sparse_moe.experts.7.w2",
                 "block_sparse_moe.experts.3.w3"):
        assert f"model.layers.1.{name}.qweight" in state, name
    assert state["model.layers.1.block_sparse_moe.gate.weight"].is_floating_point()
    assert not [k for k in state if ".mlp." in k]
    back = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    shutil.copytree(gptq_phimoe, tmp_path / "g")
    save_file({re.sub(r"\.block_sparse_moe\.experts\.(\d+)\.(w\d)\.", lambda m: f".mlp.experts.{m[1]}.{back[m[2]]}.",
                      k).replace(".block_sparse_moe.gate.", ".mlp.router."): v for k, v in state.items()},
              str(tmp_path / "g" / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(512, (6, 15), seed=11)
    plan = estimated_plan(str(gptq_phimoe), "--dtype", "float32")
    with LLM(str(gptq_phimoe), block_size=4, dtype="float32") as llm:
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)
        got = greedy_tokens(llm, prompts, 6)
    assert got == gptqmodel_greedy(tmp_path / "g", prompts, 6, every_float=True)
    with LLM("tiny-phimoe", block_size=4) as llm:
        assert got != greedy_tokens(llm, prompts, 6)  # (the int4 weights change the tokens)


def test_an_adapter_without_target_modules_is_refused_as_peft_refuses_it(phimoe_lora, tmp_path):
    """An adapter of the attention whose adapter_config.json lost target_modules: peft has no default for the family
    and refuses it, and so does infer, naming the family."""
    from lora_helpers import check_no_target_modules_refused_as_peft, save_adapter
    base, hf, _ = phimoe_lora
    adapter = save_adapter(hf, tmp_path / "qv", 5, r=4, lora_alpha=4, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj"])
    check_no_target_modules_refused_as_peft(base, adapter, tmp_path / "a", "phimoe")


def test_infer_run_and_bench_on_the_builtin_model(tmp_path):
    from helpers import check_run_and_bench_builtin
    check_run_and_bench_builtin(tmp_path, BUILTIN)
