"""IBM's Bamba (BambaForCausalLM, models.bamba) equals transformers (float32): Granite 4.0's Mamba-2 mixers (their
conv and SSM states in the per-sequence state cache) and attention layers rotating half of each head, in Llama's
layer of two norms (input_layernorm, pre_ff_layernorm) with a SwiGLU feed_forward, the final final_layernorm: greedy
tokens and logprobs of concurrent prompts, chunked prefill, prefix caching through state snapshots, the GPU code path
interpreted; peft adapters; the memory estimate on the hub's shapes; configs infer cannot honour refused by field."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import (check_batched_chunks_equal_transformers, check_greedy_and_logprobs_equal_transformers,
                     check_state_slots_all_free, greedy_each, greedy_tokens, hf_model, norms_and_biases_shifted,
                     prompt_steps, random_prompts, save_random_model)

NAME = "tiny-bamba"


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(NAME)))


def _layers_as_the_config(model) -> None:
    """Mamba-2, Mamba-2, attention, Mamba-2: three mixers with a conv state [128 + 2 * 2 * 16, 3] and a float32 SSM
    state [8, 16, 16], one attention layer rotating 8 of its 16 dims; the feed_forward on every layer."""
    assert [layer.linear for layer in model.layers] == [True, True, False, True]
    mixers = model.linear_layers()
    assert len(mixers) == 3 and all(m.rec_state.dtype == torch.float32 for m in mixers)
    assert mixers[0].rec_state.shape[1:] == (8, 16, 16) and mixers[0].conv_state.shape[1:] == (192, 3)
    assert model.layers[2].self_attn.rot_dim == 8
    assert all(layer.feed_forward.gate_up_proj.out_sizes == [128, 128] for layer in model.layers)


def test_bamba_equals_transformers(hf):
    """Prompts of 5, 13 and 30 tokens batched (the 30-token one spans two scan chunks of 16): transformers' greedy
    tokens and logprobs."""
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(NAME), hf, NAME, _layers_as_the_config)
