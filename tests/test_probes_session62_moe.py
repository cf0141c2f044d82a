"""Session 62: GLM-4.5 and GLM-4.6 (Glm4MoeForCausalLM, model_type glm4_moe), end to end on tiny random models built
from its config (float32) against transformers: the sigmoid router whose e_score_correction_bias steers the choice
(not the weights), group-limited top k (n_group, topk_group), norm_topk_prob, routed_scaling_factor, shared experts,
the first_k_dense_replace dense layers, half of each head rotated (NeoX pairs), q/k/v biases, q/k norms per head;
chunked prefill, prefix caching, the GPU code path (interpreted), peft adapters (attention, dense MLP, shared
experts, stacked experts) mixed in a batch, GPTQ, warmup --estimate, run, bench, the built-in tiny-glm4-moe, the
multi-token-prediction layer of the hub's checkpoints skipped; what infer cannot run of it refused."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import UnsupportedModelError
from infer.models.tiny import ensure_builtin

from helpers import (check_chunked_prefill_and_prefix_caching, check_equal_transformers, greedy_each,
                     measured_warmup, random_prompts, save_random_model)
from lora_helpers import (base_and_adapters, check_mixed_adapters_equal_peft, check_mixed_adapters_gpu_path_equal_peft,
                          hf_float)
from quant_helpers import check_gpu_path_interpreted

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
# GLM-4.5-Air's shape, shrunk: 46 layers there (the first dense), 128 experts of 1408 (top 8) beside one shared
# expert; here 3 layers (the first dense), 8 experts of 32 in 4 groups of 2 (2 groups kept, top-2), one shared
# expert, the routing weights renormalised and scaled by 2.5; 96 query heads of 128 over 8 KV heads there (4 of 16
# over 2 here), q/k/v biases, half of each head rotated
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
             n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
             attention_bias=True, use_qk_norm=True, max_position_embeddings=256, eos_token_id=2, pad_token_id=0)


def shifted(name, p):
    """A save_random_model perturb: norms and biases drawn off their init (a bug in them would go unseen)."""
    if "norm" in name:
        p.add_(torch.randn_like(p) * 0.3)
    elif name.endswith("bias"):
        p.normal_(0.0, 0.5)


def build(folder, seed: int = 0, **config):
    """A random GLM-4.5 folder (float32) with the tiny-llama tokenizer, each router's e_score_correction_bias (a
    buffer, zeros at init) drawn from N(0, 0.3); returns transformers' model (eager)."""
    hf = save_random_model(folder, "glm4_moe", "Glm4MoeForCausalLM", {**SMALL, **config}, seed, shifted)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    hf.save_pretrained(folder)
    return hf


CONFIGS = {
    "groups-shared-bias-qknorm": dict(),
    # every layer sparse, one group (no group limit), the weights neither renormalised nor scaled, no shared expert,
    # no biases, no q/k norms, a whole-head rotary
    "one-group-plain": dict(first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False,
                            routed_scaling_factor=1.0, n_shared_experts=0, attention_bias=False, use_qk_norm=False,
                            partial_rotary_factor=1.0, num_key_value_heads=4),
    # two dense layers first, 2 groups of 4 (1 kept: top-3 of its 4), two shared experts
    "one-group-of-two-kept-top3": dict(num_hidden_layers=4, first_k_dense_replace=2, n_group=2, topk_group=1,
                                       num_experts_per_tok=3, n_shared_experts=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; the
    dense layers and the sparse ones where first_k_dense_replace says, the routers float32."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path, **CONFIGS[name])
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        model = llm.engine.runner.model
        k = hf.config.first_k_dense_replace
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == \
            [i >= k for i in range(hf.config.num_hidden_layers)]
        sparse = model.layers[-1].mlp
        assert sparse.gate.weight.dtype == torch.float32 and torch.equal(
            sparse.gate.e_score_correction_bias, hf.model.layers[-1].mlp.gate.e_score_correction_bias)
        assert sparse.shared_width == hf.config.n_shared_experts * 32
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)


def test_the_router_equals_transformers_where_groups_and_the_bias_decide(tmp_path):
    """SparseMoeBlock.route of 64 tokens against transformers' Glm4MoeTopkRouter of the same weights: the same experts
    (as sets) and weights, with a bias large enough that it, and the groups' limit, change the choice from the
    plain top k of the scores."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path)
    router = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8)[torch.randperm(8, generator=torch.Generator()
                                                                                     .manual_seed(1))])
    block = SparseMoeBlock(hf.config, "model.layers.1.mlp", lambda names: None, torch.float32)
    block.gate.weight.data.copy_(router.weight)
    block.gate.e_score_correction_bias.data.copy_(router.e_score_correction_bias)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, want_w, want_ids = router(x)
    weights, ids = block.route(x)
    assert weights.dtype == torch.float32
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))
    plain = torch.sigmoid(x @ router.weight.T).topk(2, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(plain, order.values)  # (the bias and the groups decided some tokens' experts)
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))  # (renormalised, then scaled)


def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path):
    hf = build(tmp_path, seed=1)
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


@interpreted
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch):
    """Every op through its Triton kernel (interpreted on CPU): the partial rotary with the q/k norms, the fused MoE
    with the router's float32 weights, the shared expert; decodes through emulated CUDA graphs, the other steps
    through emulated piecewise graphs: transformers' tokens."""
    hf = build(tmp_path)
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    assert check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0
