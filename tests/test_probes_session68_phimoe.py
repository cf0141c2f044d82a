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

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
ARCH = "PhimoeForCausalLM"
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
