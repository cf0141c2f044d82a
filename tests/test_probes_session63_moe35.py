"""Session 63: three more mixture-of-experts families through models.moe, end to end on tiny random models (float32)
against transformers. GraniteMoeShared (GraniteMoeSharedForCausalLM): Granite MoE with a dense shared MLP
(layers.N.shared_mlp.input_linear / output_linear) added to the experts' output; chunked prefill, prefix caching,
the GPU code path (interpreted), peft adapters (attention, stacked experts) mixed in a batch, the built-in
tiny-granitemoeshared, warmup --estimate, `infer quantize` (adapters of the shared MLP: session 71). Qwen3.5 MoE
(Qwen3_5MoeForCausalLM, and Qwen3_5MoeForConditionalGeneration served as its text model): Qwen3.5's hybrid layers
with experts renormalised always and a gated shared expert on every layer; batched and chunked against
transformers, the GPU code path (interpreted, decode graphs), peft adapters of the attention, the shared expert and
the stacked experts mixed in a batch, `infer quantize` through GPTQModel's qwen3_5_moe_text definition, the built-in
tiny-qwen3_5-moe and tiny-qwen3_5-moe-mm. ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM): the sparse layers of
moe_layer_start_index / end_index / interval, the float32 router whose moe_statics bias steers the choice (weights
over their sum clamped to moe_norm_min), shared experts; chunked prefill, the GPU code path (interpreted), a GPTQ
checkpoint (CPU and int4 kernels), peft adapters, the built-in tiny-ernie4_5-moe; use_bias and `infer quantize`
(GPTQModel 7.6's definition fails on transformers 5) refused."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import (builtin_model_tests, check_builtin_runs_and_warmup_sizes_it,
                     check_chunked_prefill_and_prefix_caching, check_equal_transformers,
                     check_greedy_and_logprobs_equal_transformers, correction_bias_drawn,
                     norms_shifted_biases_drawn, random_prompts, save_random_model)
from lora_helpers import check_all8_qv4_equal_peft, check_granite_adapters_equal_peft, hf_float
from quant_helpers import (check_gpu_path_equals_transformers, check_gptq_moe_equals_dequantized, gptqmodel_greedy,
                           infer_quantize, needs_gptqmodel, rtn_gptq_pair)

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


# ======================================================================================== GraniteMoeShared
# Granite MoE's tiny shape (session 62's) with a shared MLP of 48 beside the 8 experts of 32 (top 2)
GRANITE = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48,
               max_position_embeddings=256, embedding_multiplier=12.0, residual_multiplier=0.22,
               attention_multiplier=0.0625, logits_scaling=4.0, eos_token_id=2, pad_token_id=0)


def build_granite(folder, seed: int = 0, **config):
    """A random GraniteMoeShared folder (float32, the hub's names) with the tiny-llama tokenizer; returns
    transformers' model (eager)."""
    return save_random_model(folder, "granitemoeshared", "GraniteMoeSharedForCausalLM", {**GRANITE, **config}, seed,
                             norms_shifted_biases_drawn)


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
    def check(model):
        mlp = model.layers[0].mlp.shared_experts
        assert (mlp is None) if not shared else mlp.gate_up_proj.names == ["model.layers.0.shared_mlp.input_linear"] * 2
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, name, check)


@pytest.mark.parametrize("builder", ["granitemoeshared", "ernie4_5_moe"])
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, builder):
    check_chunked_prefill_and_prefix_caching(tmp_path, BUILDERS[builder](tmp_path, seed=1))


@interpreted
@pytest.mark.parametrize("builder", ["granitemoeshared", "ernie4_5_moe"])
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, builder):
    """Every op through its Triton kernel (interpreted on CPU), the fused MoE with the family's router and the shared
    MLP: transformers' tokens."""
    check_gpu_path_equals_transformers(tmp_path, monkeypatch, BUILDERS[builder](tmp_path))


def test_granitemoeshared_peft_adapters_equal_peft_alone_and_mixed(tmp_path):
    """Adapters of the attention and the stacked experts (target_parameters block_sparse_moe.experts.*), each alone
    and mixed with the base in one batch: peft's tokens (weights at 0.5's scale, as Granite MoE's test)."""
    check_granite_adapters_equal_peft(tmp_path, build_granite)


@needs_gptqmodel
def test_granitemoeshared_infer_quantize_equals_gptqmodels_load(tmp_path):
    """`infer quantize` through GPTQModel given infer's definition (quant.quantize._granite_view: GPTQModel 7.6 has
    none, and its fallback left the experts float): the attention, the shared MLP and each expert's gate_proj,
    up_proj and down_proj quantized; infer's tokens equal GPTQModel's own load given that definition; the shared
    MLP's fused input_linear read as its gate_up."""
    from infer.quant.quantize import _granite_view
    build_granite(tmp_path / "f")
    infer_quantize(tmp_path / "f", tmp_path / "q")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(tmp_path / "q"), block_size=4, dtype="float32") as llm:
        assert llm.engine.runner.model.layers[0].mlp.shared_experts.gate_up_proj.qweight is not None
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.gate_proj.qweight" in f.keys()
    with _granite_view(tmp_path / "q"):
        assert got == gptqmodel_greedy(tmp_path / "q", prompts, 8)
    assert len({t for tokens in got for t in tokens}) > 6


def test_granitemoeshared_builtin_tiny_model_runs_and_warmup_sizes_it():
    check_builtin_runs_and_warmup_sizes_it("tiny-granitemoeshared", "GraniteMoeSharedForCausalLM", False,
                                           lengths=(6, 90))




# ============================================================================================= Qwen3.5 MoE
QWEN = "tiny-qwen3_5-moe"


@pytest.fixture(scope="module")
def qwen_hf():
    from helpers import hf_model
    return hf_model(str(ensure_builtin(QWEN)))


def test_qwen3_5_moe_equals_transformers_batched_and_chunked(qwen_hf):
    """Qwen3.5 MoE's text model (Qwen3.5's Gated DeltaNet and gated attention layers, in_proj_qkv and in_proj_z
    apart; experts renormalised always and a gated shared expert on every layer): transformers' tokens and
    logprobs of prompts of 5, 13 and 30 batched, and its tokens in steps of 8 (prompts in chunks, mixed with
    decodes), every state slot freed after."""
    from helpers import check_greedy_and_logprobs_equal_transformers, check_state_slots_all_free, greedy_each
    from infer.models.moe import SparseMoeBlock
    path = ensure_builtin(QWEN)

    def check_model(model):
        assert not model.layers[0].linear_attn.fused
        assert all(isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.renormalize and layer.mlp.shared_width == 48
                   for layer in model.layers)
    check_greedy_and_logprobs_equal_transformers(path, qwen_hf, QWEN, check_model)
    prompts = random_prompts(512, (30, 17, 1), seed=5)
    with LLM(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=3) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
        assert got == greedy_each(qwen_hf, prompts, 6)
        check_state_slots_all_free(llm)


test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests({QWEN: "Qwen3_5MoeForCausalLM", "tiny-qwen3_5-moe-mm": "Qwen3_5MoeForConditionalGeneration"})


# the attention (the gated q_proj too), the shared expert (target_modules gate_proj, up_proj, down_proj: peft adapts
# shared_expert's nn.Linear layers) and the stacked experts (target_parameters); some of them
QWEN_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
QWEN_ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=[*ATTENTION, "gate_proj", "up_proj", "down_proj"],
                              target_parameters=QWEN_EXPERTS),
                 "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"],
                             target_parameters=QWEN_EXPERTS)}


@pytest.fixture(scope="module")
def qwen_lora(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of QWEN_ADAPTERS (peft's) on tiny-qwen3_5-moe."""
    from lora_helpers import save_adapters
    base = ensure_builtin(QWEN)
    hf = hf_float(base)
    return base, hf, save_adapters(hf, tmp_path_factory.mktemp("qwen35moe_lora"), QWEN_ADAPTERS)


def test_qwen3_5_moe_peft_adapters_equal_peft_alone_and_mixed(qwen_lora):
    check_all8_qv4_equal_peft(*qwen_lora)


@interpreted
def test_qwen3_5_moe_gpu_code_path_interpreted_equals_transformers(qwen_hf, monkeypatch):
    """Every op through its Triton kernel (interpreted on CPU): the gated delta rule's and the fused MoE's with the
    renormalised top 2 and the gated shared expert; decodes through emulated CUDA graphs (no piecewise graphs for a
    hybrid model): transformers' tokens, every state slot freed after."""
    from helpers import check_state_slots_all_free, greedy_each
    from infer import kernels
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    prompts, lens = random_prompts(512, (5, 13, 3), seed=11), [4, 6, 9]
    with LLM(QWEN, max_num_seqs=4, block_size=4, max_model_len=64, cuda_graph_max_tokens=4) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        got = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                          for n in lens])]
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
        check_state_slots_all_free(llm)
    assert got == [greedy_each(qwen_hf, [p], n)[0] for p, n in zip(prompts, lens)]


@needs_gptqmodel
def test_qwen3_5_moe_infer_quantize_equals_transformers_of_the_dequantized_weights(tmp_path):
    """`infer quantize` (GPTQModel's qwen3_5_moe_text definition): infer loads its checkpoint and gives
    transformers' greedy tokens on the dequantized weights; warmup --estimate counts its weights as loaded."""
    from helpers import estimated_plan, greedy_each
    from infer.memory.sizes import weights_bytes
    from quant_helpers import check_greedy_equal_but_near_ties, dequantized_float_model
    out = infer_quantize(QWEN, tmp_path / "q")
    plan = estimated_plan(str(out), "--max-length", "256")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    want = greedy_each(dequantized_float_model(ensure_builtin(QWEN), out), prompts, 8)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:
        model = llm.engine.runner.model
        assert plan["weights_bytes"] == weights_bytes(model)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]
        check_greedy_equal_but_near_ties(llm, prompts, got, want)  # (a near-tie: decided by infer's margin)
    assert len({t for tokens in got for t in tokens}) > 6


# ============================================================================================ ERNIE 4.5 MoE
# ERNIE-4.5-21B-A3B's shape, shrunk: 28 layers there (the first dense), 64 experts of 1536 (top 6) and 2 shared
# experts; here 4 layers, experts on layers 1 and 3 (moe_layer_start_index 1, interval 2), 8 experts of 32 (top 2),
# 2 shared experts (one MLP of 64), the router's moe_statics bias steering the choice
ERNIE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
             moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=2,
             max_position_embeddings=256, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def build_ernie(folder, seed: int = 0, **config):
    """A random ERNIE 4.5 MoE folder (float32) with the tiny-llama tokenizer, each router's moe_statics bias (zeros
    at init) drawn from N(0, 0.05) (the softmax's probabilities are about 1 / 8: enough to change some choices);
    returns transformers' model (eager)."""
    hf = save_random_model(folder, "ernie4_5_moe", "Ernie4_5_MoeForCausalLM", {**ERNIE, **config}, seed,
                           norms_shifted_biases_drawn)
    return correction_bias_drawn(hf, folder, seed, 0.05, buffers=False)


ERNIE_CONFIGS = {
    "interval2-shared2": dict(),
    # every layer sparse, no shared experts, one expert a token, multi-head attention
    "all-sparse-top1-mha": dict(moe_layer_start_index=0, moe_layer_interval=1, moe_num_shared_experts=0, moe_k=1,
                                num_key_value_heads=4),
    # experts on layers 1 and 2 only (moe_layer_end_index 2)
    "end-index-2": dict(moe_layer_interval=1, moe_layer_end_index=2),
}


@pytest.mark.parametrize("name", ERNIE_CONFIGS)
def test_ernie_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens and logprobs; the sparse layers
    where moe_layer_start_index, end_index and interval say, the routers float32 with the checkpoint's bias."""
    from safetensors.torch import load_file
    from infer.models.moe import SparseMoeBlock
    hf = build_ernie(tmp_path, **ERNIE_CONFIGS[name])
    stored = load_file(tmp_path / "model.safetensors")
    bias = next(k for k in stored if k.endswith("e_score_correction_bias"))
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        model = llm.engine.runner.model
        sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
        assert sparse == [type(layer.mlp).__name__ == "Ernie4_5_MoeSparseMoeBlock" for layer in hf.model.layers]
        block = model.layers[sparse.index(True)].mlp
        assert block.gate.weight.dtype == torch.float32
        assert torch.equal(block.gate.e_score_correction_bias, stored[bias].reshape(-1))
        assert block.gate.e_score_correction_bias.abs().sum() > 0
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)


def test_ernie_the_router_equals_transformers_where_the_bias_decides(tmp_path):
    """SparseMoeBlock.route of 64 tokens against transformers' Ernie4_5_MoeTopKRouter of the same weights: the same
    experts and weights, with a bias large enough that it changes the choice from the plain top k."""
    from infer.models.moe import SparseMoeBlock
    hf = build_ernie(tmp_path)
    router = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        router.moe_statics.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 8).view(1, 8))
    block = SparseMoeBlock(hf.config, "model.layers.1.mlp", lambda names: None, torch.float32)
    block.gate.weight.data.copy_(router.weight)
    block.gate.e_score_correction_bias.data.copy_(router.moe_statics.e_score_correction_bias.reshape(-1))
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, want_w, want_ids = router(x)
    weights, ids = block.route(x)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)
    plain = torch.softmax(x @ router.weight.T, dim=-1).topk(2, dim=-1).indices
    assert not torch.equal(plain, ids)  # (the bias decided some tokens' experts)


def test_ernie_builtin_tiny_model_runs_and_warmup_sizes_it():
    """tiny-ernie4_5-moe: transformers' tokens; warmup --estimate counts its float32 routers and biases as loaded."""
    check_builtin_runs_and_warmup_sizes_it("tiny-ernie4_5-moe", "Ernie4_5_MoeForCausalLM", False, lengths=(6, 90))


@pytest.fixture(scope="module")
def gptq_ernie(tmp_path_factory):
    """(float folder, a GPTQ checkpoint of it in GPTQModel's layout: every attention, dense MLP, shared expert and
    expert projection 4-bit by round to nearest, group 32, each expert's projections apart; the routers float)."""
    return rtn_gptq_pair(tmp_path_factory.mktemp("ernie_gptq"), build_ernie)


def test_ernie_a_gptq_checkpoint_equals_transformers_of_its_dequantized_weights(gptq_ernie):
    """infer's CPU path (each GPTQ expert dequantized at load) gives transformers' greedy tokens of the same weights
    dequantized in float32; the hub's moe_statics bias read beside the GPTQ experts; warmup --estimate counts the
    weights as loaded."""
    check_gptq_moe_equals_dequantized(*gptq_ernie)


@interpreted
def test_ernie_int4_experts_through_the_kernels_equal_the_cpu_path(gptq_ernie, monkeypatch):
    """The GPTQ checkpoint on the GPU code path (the experts stacked int4, the int4 fused MoE with ERNIE's routing
    weights, interpreted): the CPU path's tokens."""
    from quant_helpers import check_kernel_path_equals_cpu
    check_kernel_path_equals_cpu(gptq_ernie[1], monkeypatch)


ERNIE_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_ernie_peft_adapters_equal_peft_alone_and_mixed(tmp_path):
    """Adapters of the attention and the stacked experts (target_parameters), each alone and mixed with the base in
    one batch: peft's tokens."""
    from lora_helpers import base_and_adapters
    adapters = {"all8": dict(r=8, lora_alpha=16, target_modules=ATTENTION, target_parameters=ERNIE_EXPERTS),
                "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"],
                            target_parameters=ERNIE_EXPERTS)}
    check_all8_qv4_equal_peft(*base_and_adapters(tmp_path, adapters, build_ernie))


def test_ernie_an_adapter_of_transformers_4s_expert_names_equals_peft(tmp_path):
    """target_modules gate_proj, up_proj, down_proj (transformers 4's names of the experts' projections), which peft
    (>= 0.22) on transformers 5 turns into the stacked experts' parameters (gate_up_proj at twice the rank) and keeps
    on the dense layer's MLP and the shared experts: peft's tokens, mixed with the base."""
    from lora_helpers import base_and_adapters, check_mixed_adapters_equal_peft
    base, hf, paths = base_and_adapters(tmp_path, {"v4": dict(r=4, lora_alpha=16, target_modules=[
        "q_proj", "gate_proj", "up_proj", "down_proj"])}, build_ernie)
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (5, 20), seed=6), ["v4", None])


def test_ernie_a_transformers_4_adapter_of_the_dense_mlp_and_the_experts_equals_peft(tmp_path):
    """An adapter as transformers 4's peft saved it (each expert's gate_proj, up_proj, down_proj, modules of their
    own, beside the dense layer's and the shared experts' MLP weights, all under target_modules gate_proj, up_proj,
    down_proj): peft (>= 0.22) on transformers 5 converts the experts' and keeps the others; infer serves all of
    them, mixed with the base: peft's tokens."""
    import json

    from safetensors.torch import load_file, save_file

    from lora_helpers import check_mixed_adapters_equal_peft, hf_float, save_adapter
    from test_probes_session57_moelora import _v4_adapter
    build_ernie(tmp_path / "base")
    hf = hf_float(tmp_path / "base")
    path = _v4_adapter(hf, tmp_path / "v4", ("gate_proj", "up_proj", "down_proj"), seed=3)
    mlp = save_adapter(hf, tmp_path / "mlp", seed=5, r=4, lora_alpha=8, lora_dropout=0.0,
                       target_modules=["mlp.down_proj", "shared_experts.up_proj"])
    tensors = {**load_file(path / "adapter_model.safetensors"), **load_file(mlp / "adapter_model.safetensors")}
    assert any(".layers.0.mlp.down_proj." in k for k in tensors) and any(".shared_experts.up_proj." in k
                                                                          for k in tensors)
    save_file(tensors, path / "adapter_model.safetensors")
    config = json.loads((path / "adapter_config.json").read_text())
    assert {"gate_proj", "up_proj", "down_proj"} <= set(config["target_modules"]), config
    check_mixed_adapters_equal_peft(tmp_path / "base", hf, {"v4": path}, random_prompts(512, (5, 20), seed=6),
                                    ["v4", None])


def test_ernie_an_up_proj_without_gate_proj_is_refused_as_peft_refuses_it(tmp_path):
    """target_modules up_proj without gate_proj: peft (>= 0.22) turns it into the experts' gate_up_proj, which holds
    both, and refuses to load it; so do infer and lora-validate, naming both."""
    import json

    from peft import PeftModel
    from transformers import AutoConfig

    from infer.errors import LoRAError
    from infer.lora.adapter import adapter_problems
    from lora_helpers import hf_float, save_adapter
    build_ernie(tmp_path / "base")
    hf = hf_float(tmp_path / "base")
    path = save_adapter(hf, tmp_path / "a", seed=2, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"])
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "up_proj"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="up_proj without also targeting gate_proj"):
        PeftModel.from_pretrained(hf, str(path))
    said = "targets up_proj without gate_proj: peft cannot load it on transformers 5, whose ernie4_5_moe experts"
    assert any(said in p.message for p in adapter_problems("a", path, AutoConfig.from_pretrained(tmp_path / "base")))
    with pytest.raises(LoRAError, match=said):
        LLM(str(tmp_path / "base"), loras={"a": str(path)})


BUILDERS = {"granitemoeshared": build_granite, "ernie4_5_moe": build_ernie}
