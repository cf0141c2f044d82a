"""NVIDIA Nemotron-H (NemotronHForCausalLM, models.nemotron_h) equals transformers (float32): norm-then-mixer blocks
of Granite 4.0's Mamba-2 mixer (its conv and SSM states in the per-sequence state cache), attention without rope (the
only layers with KV) and the relu² MLP without gate, read from the checkpoint's backbone.* names: greedy tokens and
logprobs of concurrent prompts, chunked prefill, preemption; experts ("E") and other configs refused by name."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.models.tiny import ensure_builtin

from helpers import (builtin_model_tests, check_greedy_and_logprobs_equal_transformers,
                     check_one_step_and_split_prompts, check_preemption_restarts_from_zero_state,
                     check_prompt_logprobs_equal_transformers, check_state_slots_all_free,
                     check_warmup_counts_the_states, greedy_each, greedy_tokens, hf_model, random_prompts)

NAME = "tiny-nemotron-h"


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(NAME)))


def _layers_as_the_pattern(model) -> None:
    """M-*M-: two Mamba-2 mixers with states, one attention layer without rope (the only KV), two MLPs."""
    kinds = [type(layer.mixer).__name__ for layer in model.layers]
    assert kinds == ["Mamba2Mixer", "UngatedMLP", "Attention", "Mamba2Mixer", "UngatedMLP"]
    layers = model.linear_layers()
    assert len(layers) == 2 and layers[0].rec_state.shape[1:] == (8, 16, 16)
    assert layers[0].conv_state.shape[1:] == (128 + 2 * 2 * 16, 3)
    assert model.nope == [False, False, True, False, False]
    assert [hasattr(layer.mixer, "k_cache") for layer in model.layers].count(True) == 1


def test_nemotron_h_equals_transformers(hf):
    """Prompts of 5, 13 and 30 tokens batched (the 30-token one spans two scan chunks of 16): transformers' greedy
    tokens and logprobs."""
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(NAME), hf, NAME, _layers_as_the_pattern)
