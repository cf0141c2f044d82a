"""Session 66: two more mixtures of experts, end to end on tiny random models built from their configs (float32)
against transformers. rednote's dots.llm1 (Dots1ForCausalLM, model_type dots1): Qwen3's attention (q and k normed per
head, sliding windows on the layers layer_types names) with DeepSeek-V3's router (sigmoid scores whose
e_score_correction_bias steers the choice, group-limited top k, norm_topk_prob, routed_scaling_factor), shared
experts and first_k_dense_replace dense layers. MiniMax-M2 (MiniMaxM2ForCausalLM, model_type minimax_m2): Mixtral's
layer of experts on every layer (block_sparse_moe.experts.N.w1, w3, w2) whose sigmoid router's bias
(block_sparse_moe.e_score_correction_bias) steers the choice, the top k renormalised; q and k normed over their
whole projections; a partial rotary (rotary_dim). Greedy tokens and logprobs, chunked prefill, prefix caching, peft
adapters mixed in one batch, GPTQ checkpoints, the built-in tiny-dots1 and tiny-minimax-m2, and what infer cannot run
of them refused naming the field."""

from __future__ import annotations

import pytest
import torch

from infer import LLM

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_greedy_and_logprobs_equal_transformers, check_stray_sliding_window, correction_bias_drawn,
                     estimate_refusal, norms_shifted_biases_drawn, save_random_model)
from quant_helpers import needs_gptqmodel

# dots.llm1's shape, shrunk: 62 layers there (the first dense), 128 experts of 1408 (top 6, renormalised, scaled by
# 2.5) beside 2 shared experts, 32 heads of 128; here 2 layers (the first dense), 8 experts of 32 in 4 groups of 2 (2
# kept, top 2), one shared expert, 4 heads of 16 over 2 KV heads
DOTS = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            max_position_embeddings=256, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
# MiniMax-M2's shape, shrunk: 62 layers of 256 experts of 1536 (top 8), 48 heads of 128 over 8 KV heads, rotary_dim 64
# (half of each head); here 2 layers of 8 experts of 32 (top 2), 4 heads of 32 over 2, rotary_dim 16
MINIMAX = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2, rotary_dim=16,
               max_position_embeddings=256, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
FAMILIES = {"dots1": ("Dots1ForCausalLM", DOTS), "minimax_m2": ("MiniMaxM2ForCausalLM", MINIMAX)}


def build(folder, family: str = "dots1", seed: int = 0, **config):
    """A random `family` folder (float32) with the tiny-llama tokenizer, norms shifted and biases drawn, each router's
    e_score_correction_bias (a buffer, zeros at init) drawn from N(0, 0.3); returns transformers' model (eager)."""
    arch, small = FAMILIES[family]
    hf = save_random_model(folder, family, arch, {**small, **config}, seed, norms_shifted_biases_drawn)
    return correction_bias_drawn(hf, folder, seed, 0.3, buffers=True)


CONFIGS = {"dots1": dict(), "minimax_m2": dict()}  # family -> config (test_greedy_tokens_and_logprobs_...)
# the other variants (test_chunked_prefill_and_prefix_caching_...): dots.llm1's every layer sparse, one group, neither
# renormalised nor scaled, two shared experts, layer 1 sliding over a window of 8 (max_window_layers 1:
# transformers' layer_types), prompts past it; MiniMax-M2's whole head rotated, top 3, as many KV heads as heads
VARIANTS = {"dots1": dict(first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False,
                          routed_scaling_factor=1.0, n_shared_experts=2, sliding_window=8, max_window_layers=1),
            "minimax_m2": dict(rotary_dim=32, num_experts_per_tok=3, num_key_value_heads=4)}


@pytest.mark.parametrize("family", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, family):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; the
    layers sparse where the family says, dots.llm1's routers float32, MiniMax-M2's q and k normed over their whole
    projections and rotated over rotary_dim dims."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path, family, **CONFIGS[family])

    def check_model(model):
        k = getattr(hf.config, "first_k_dense_replace", 0)
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == \
            [i >= k for i in range(hf.config.num_hidden_layers)]
        sparse = model.layers[-1].mlp
        if family == "dots1":
            assert sparse.glm and sparse.gate.weight.dtype == torch.float32
            assert sparse.shared_width == hf.config.n_shared_experts * 32
        else:
            attn = model.layers[0].self_attn
            assert sparse.prefix.endswith(".block_sparse_moe") and attn.qk_norm_whole
            assert attn.rot_dim == hf.config.rotary_dim
            assert torch.equal(sparse.gate.e_score_correction_bias, hf.model.layers[-1].mlp.e_score_correction_bias)
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, family, check_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_router_equals_transformers_where_the_bias_decides(tmp_path, family):
    """SparseMoeBlock.route of 64 tokens against transformers' router of the same weights (Dots1TopkRouter,
    MiniMaxM2TopKRouter): the same experts (as sets) and float32 weights, with a bias large enough that it changes
    the choice from the plain top k of the scores; MiniMax-M2's weights renormalised to 1."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path, family)
    block_hf = hf.model.layers[1].mlp
    bias = torch.linspace(-1, 1, 8)[torch.randperm(8, generator=torch.Generator().manual_seed(1))]
    prefix = "model.layers.1." + ("mlp" if family == "dots1" else "block_sparse_moe")
    block = SparseMoeBlock(hf.config, prefix, lambda names: None, torch.float32)
    block.gate.weight.data.copy_(block_hf.gate.weight)
    block.gate.e_score_correction_bias.data.copy_(bias)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        if family == "dots1":
            block_hf.gate.e_score_correction_bias.copy_(bias)
            _, want_w, want_ids = block_hf.gate(x)
        else:
            _, want_w, want_ids = block_hf.gate(x, bias)
    weights, ids = block.route(x)
    assert weights.dtype == torch.float32
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))
    plain = torch.sigmoid(x @ block_hf.gate.weight.T).topk(2, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(plain, order.values)
    if family == "minimax_m2":
        torch.testing.assert_close(weights.sum(-1), torch.ones(64))


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, family):
    """The family's other variant (VARIANTS) in chunks of 12 tokens and with prefix caching: transformers' tokens;
    dots.llm1's sliding layers those its layer_types names."""
    hf = build(tmp_path, family, seed=1, **VARIANTS[family])
    if family == "dots1":
        from infer.models.limits import layer_window
        assert [layer_window(hf.config, i) for i in range(2)] == [0, 8] and \
            hf.config.layer_types == ["full_attention", "sliding_attention"]
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


def test_a_stray_sliding_window_caps_minimax_m2s_context(tmp_path):
    """MiniMax-M2's attention is full whatever config.json says (transformers' MiniMaxM2Model masks no window), while
    its generate() cache keeps the last sliding_window keys of a config.json with one: the context is capped at the
    window, no layer slides (models.limits.WINDOW_IGNORED)."""
    check_stray_sliding_window(tmp_path, build(tmp_path, "minimax_m2", sliding_window=16), "minimax_m2")


@pytest.mark.parametrize("name, arch", [("tiny-dots1", "Dots1ForCausalLM"),
                                        ("tiny-minimax-m2", "MiniMaxM2ForCausalLM")])
def test_builtin_tiny_model_runs_and_warmup_sizes_it(name, arch):
    check_builtin_runs_and_warmup_sizes_it(name, arch, False)


@pytest.mark.parametrize("name", ["tiny-dots1", "tiny-minimax-m2"])
def test_the_bfloat16_plan_counts_the_routers_as_the_engine_holds_them(name):
    """`infer warmup --estimate --dtype bfloat16` counts the weights the bfloat16 engine holds: dots.llm1's routers
    (weight and e_score_correction_bias) float32 as transformers keeps them, MiniMax-M2's in bfloat16 (its router and
    the block's bias in the model's dtype); a token's KV bytes: 2 layers of K and V of 2 KV heads of head_dim (16;
    MiniMax-M2's 32, set apart from hidden_size / heads) in 2 bytes."""
    from helpers import estimated_plan
    from infer.memory.sizes import weights_bytes
    plan = estimated_plan(name, "--dtype", "bfloat16", "--max-length", "64")
    assert plan["kv_bytes_per_token"] == 2 * 2 * 2 * (16 if name == "tiny-dots1" else 32) * 2
    with LLM(name, dtype="bfloat16", max_model_len=64) as llm:
        model = llm.engine.runner.model
        gate = model.layers[-1].mlp.gate
        want = torch.float32 if name == "tiny-dots1" else torch.bfloat16
        assert gate.weight.dtype == gate.e_score_correction_bias.dtype == want
        assert plan["weights_bytes"] == weights_bytes(model)


# --------------------------------------------------------------------------------------------------- refusals
REFUSED = {  # family, config -> words of the refusal
    "dots1-groups-not-dividing": ("dots1", dict(n_group=3), "n_group 3 with n_routed_experts 8"),
    "dots1-top-k-past-the-groups": ("dots1", dict(num_experts_per_tok=5), "num_experts_per_tok 5, more than the 4 "
                                                                          "experts of its topk_group 2 groups of 2"),
    "dots1-no-shared-experts-field": ("dots1", dict(n_shared_experts=None), "config.json has no n_shared_experts "
                                                                            "(null)"),
    "minimax-top-k-past-the-experts": ("minimax_m2", dict(num_experts_per_tok=9),
                                       "num_experts_per_tok 9 with num_local_experts 8"),
    "minimax-no-qk-norm": ("minimax_m2", dict(use_qk_norm=False),
                           "minimax_m2 with use_qk_norm false (q and k not normed) is not supported"),
    "minimax-per-head-norm": ("minimax_m2", dict(qk_norm_type="per_head"), "minimax_m2 with qk_norm_type "
                                                                          "\"per_head\" (q and k normed otherwise"),
    "minimax-shared-expert": ("minimax_m2", dict(shared_intermediate_size=64),
                              "minimax_m2 with shared_intermediate_size 64 (a shared expert beside the experts)"),
    "minimax-lightning-layers": ("minimax_m2", dict(attn_type_list=[0, 1]),
                                 "minimax_m2 with attn_type_list naming layers [0] of linear attention"),
    "minimax-rotary-past-the-head": ("minimax_m2", dict(rotary_dim=64), "a default rope over 64 of 32 head "
                                                                        "dimensions (partial_rotary_factor 2.0)"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_infer_cannot_run_is_refused_up_front(tmp_path, name):
    """`infer warmup --estimate` of a config whose router, remote-code fields or rotary infer cannot run as
    transformers does: refused naming the field."""
    family, config, words = REFUSED[name]
    arch, small = FAMILIES[family]
    text = estimate_refusal(tmp_path, family, arch, **{**small, **config})
    assert words in text, text
    if name == "dots1-groups-not-dividing":
        assert "dots.llm1's router (GLM-4.5's)" in text, text


def test_minimax_text_01_is_refused_naming_minimax_m2(tmp_path):
    """MiniMax-Text-01's config (model_type minimax: lightning attention layers) is refused naming what it is and
    MiniMax-M2, which infer runs."""
    text = estimate_refusal(tmp_path, "minimax", "MiniMaxForCausalLM", **{k: v for k, v in MINIMAX.items()
                                                                           if k != "rotary_dim"})
    assert "(model_type 'minimax') is MiniMax-Text-01" in text and "which infer does not run" in text, text
    assert "MiniMaxM2ForCausalLM, model_type minimax_m2" in text, text


# ------------------------------------------------------------------------------------------------------- LoRA
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# the attention and the stacked experts (target_parameters; MiniMax-M2's by Mixtral's target_modules w1, w3, w2, which
# peft on transformers 5 turns into those parameters, gate_up at twice the rank, within --max-lora-rank 8: peft mixes
# only adapters of the same parameters)
ADAPTERS = {
    "dots1": {"all8": dict(r=8, lora_alpha=16, target_modules=ATTENTION, target_parameters=EXPERTS),
              "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"],
                          target_parameters=EXPERTS)},
    "minimax_m2": {"all8": dict(r=4, lora_alpha=8, target_modules=[*ATTENTION, "w1", "w3", "w2"]),
                   "qv4": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "w1", "w3", "w2"])},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_lora(request, tmp_path_factory):
    """(family, base folder, transformers' model, {name: adapter}) of the family's ADAPTERS (peft's)."""
    from lora_helpers import base_and_adapters
    family = request.param
    return (family, *base_and_adapters(tmp_path_factory.mktemp(family), ADAPTERS[family],
                                       lambda folder: build(folder, family)))


def test_peft_adapters_equal_peft_alone_and_mixed(family_lora):
    """Adapters of the attention and the stacked experts, each alone and mixed with the base in one batch: peft's
    tokens."""
    from lora_helpers import check_all8_qv4_equal_peft
    family, base, hf, paths = family_lora
    check_all8_qv4_equal_peft(base, hf, paths)


def test_the_mlps_adapters_are_served_as_peft_adapts_them_and_a_router_is_refused(family_lora, tmp_path):
    """dots.llm1: target_modules gate_proj, up_proj, down_proj adapt its dense layer's MLP and its shared experts
    (peft >= 0.22 keeps them on those Linear layers) and its experts (turned into their parameters): served mixed
    with the base, peft's tokens. MiniMax-M2: weights on its router (block_sparse_moe.gate), which infer does not
    adapt: refused naming the module, by `infer lora-validate`'s checks and at load."""
    from transformers import AutoConfig

    from infer.errors import LoRAError
    from infer.lora.adapter import adapter_problems
    from lora_helpers import adapter_with_module, check_mlp_names_adapter_equals_peft
    family, base, hf, paths = family_lora
    if family == "dots1":
        check_mlp_names_adapter_equals_peft(base, hf, tmp_path, "q_proj", {
            "model.layers.0.mlp.up_proj", "model.layers.1.mlp.shared_experts.down_proj",
            "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"})
        return
    module = "layers.1.block_sparse_moe.gate"
    folder = adapter_with_module(paths["qv4"], tmp_path / module, module, 4, 64, 8)
    problems = adapter_problems("x", folder, AutoConfig.from_pretrained(base))
    assert any("not its router (gate)" in p.message and module in p.message for p in problems), problems
    with pytest.raises(LoRAError, match="gate"):
        LLM(str(base), loras={"x": str(folder)})


# ------------------------------------------------------------------------------------------------------- GPTQ
@needs_gptqmodel
def test_infer_quantize_of_dots1_equals_transformers_on_its_dequantized_weights(tmp_path):
    """`infer quantize` of tiny-dots1 through GPTQModel's dots1 definition quantizes the attention, the dense MLP, the
    shared experts and every expert (the routers float); infer runs it with transformers' greedy tokens of the same
    weights dequantized, and warmup --estimate counts its weights as loaded."""
    from safetensors.torch import load_file

    from infer.models.tiny import ensure_builtin
    from quant_helpers import check_gptq_moe_equals_dequantized, infer_quantize
    out = infer_quantize("tiny-dots1", tmp_path / "q")
    tensors = load_file(out / "model.safetensors")
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.shared_experts.up_proj", "mlp.experts.7.down_proj"):
        assert f"model.layers.1.{name}.qweight" in tensors, name
    assert "model.layers.0.mlp.gate_proj.qweight" in tensors
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    check_gptq_moe_equals_dequantized(ensure_builtin("tiny-dots1"), out)


def test_a_gptq_minimax_m2_checkpoint_equals_transformers_on_its_dequantized_weights(tmp_path):
    """A GPTQ MiniMax-M2 checkpoint in GPTQModel's layout (each expert's w1, w3 and w2 apart under block_sparse_moe,
    the attention quantized, the router and its bias float): infer's CPU path gives transformers' greedy tokens of the
    same weights dequantized, varied; warmup --estimate counts its weights as loaded."""
    from quant_helpers import check_gptq_moe_equals_dequantized, rtn_gptq_pair
    check_gptq_moe_equals_dequantized(*rtn_gptq_pair(tmp_path, lambda folder: build(folder, "minimax_m2")),
                                      lambda layer: layer.self_attn.qkv_proj)


@pytest.mark.parametrize("family_lora", ["minimax_m2"], indirect=True)
def test_an_adapter_config_naming_mixtrals_w1_w3_w2_is_accepted_on_minimax_m2(family_lora, tmp_path):
    """An adapter_config.json naming MiniMax-M2's experts by Mixtral's target_modules w1, w3 and w2 (as written before
    peft turned them into the stacked parameters; peft's conversion reads MiniMax-M2 as Mixtral) passes infer's
    checks and gives the tokens of the same adapter saved with target_parameters."""
    from lora_helpers import check_expert_target_modules_adapter
    _, base, _, paths = family_lora
    check_expert_target_modules_adapter(base, paths["qv4"], tmp_path / "v4", ["w1", "w3", "w2"])
