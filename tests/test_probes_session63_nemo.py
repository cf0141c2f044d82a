"""NVIDIA Nemotron-H (NemotronHForCausalLM, models.nemotron_h) equals transformers (float32): norm-then-mixer blocks
of Granite 4.0's Mamba-2 mixer (its conv and SSM states in the per-sequence state cache), attention without rope (the
only layers with KV) and the relu² MLP without gate, read from the checkpoint's backbone.* names: greedy tokens and
logprobs of concurrent prompts, chunked prefill, preemption; configs it cannot run refused by name (its experts,
"E": test_probes_session64_nemo3)."""

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


def test_chunked_prefill_carries_the_mamba_state_across_steps(hf):
    """Steps of 8 tokens: prompts of 30 and 41 tokens run in chunks whose conv and SSM states carry over, mixed with
    the others' decodes; a prompt of one token too; every state slot given back."""
    prompts = random_prompts(512, (30, 41, 1, 9), seed=5)
    with LLM(NAME, block_size=4, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        check_state_slots_all_free(llm)


def test_chunked_prefill_prompt_logprobs_equal_transformers(hf):
    """Prompts of 30 and 23 tokens in steps of 8 beside each other: every prompt token's logprob is transformers'."""
    from infer import SamplingParams
    prompts = random_prompts(512, (30, 23), seed=8)
    with LLM(NAME, block_size=4, max_num_batched_tokens=8, max_num_seqs=2) as llm:
        out = llm.generate(prompts, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    check_prompt_logprobs_equal_transformers(hf, prompts, out)


def test_a_long_prompt_spans_several_scan_chunks(hf):
    """A prompt of 70 tokens in one step (five scan chunks of 16) and one of 45 cut into steps of 20."""
    check_one_step_and_split_prompts(NAME, hf, random_prompts(512, (70, 45), seed=7), 20)


def test_preemption_restarts_the_mamba_state_from_zero(hf):
    """A KV budget of 16 blocks of 4 for 4 prompts: some are preempted and recomputed from zero state."""
    check_preemption_restarts_from_zero_state(NAME, hf)


test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests({NAME: "NemotronHForCausalLM"}, nope=(NAME,))


def test_warmup_counts_the_mamba_states_and_the_attention_kv_alone():
    """`infer warmup --estimate` counts the 2 Mamba-2 layers' state slots (8 sequences and a padding slot: a conv
    state [192, 3] and a float32 SSM state [8, 16, 16]) and the KV of the one attention layer of 5 (MLP layers have
    none): 2 KV heads of 16, K and V, float32."""
    plan = check_warmup_counts_the_states(NAME, 2 * 2 * 16 * 4)
    assert plan["state_bytes"] == 2 * 9 * (192 * 3 * 4 + 8 * 16 * 16 * 4)


def test_mixed_adapters_on_the_attention_and_the_mlp_equal_peft(tmp_path):
    """Two adapters (every attention projection and the MLP's up_proj and down_proj; q and v alone) and the base model
    in one batch and each alone: peft's tokens."""
    from lora_helpers import check_mixed_adapters_equal_peft, hf_float, save_adapter
    base = ensure_builtin(NAME)
    hf = hf_float(base)
    paths = {name: save_adapter(hf, tmp_path / name, i + 1, 0.5, lora_dropout=0.0, **kw) for i, (name, kw) in
             enumerate({"all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "up_proj", "down_proj"]),
                        "qv": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"])}.items())}
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 13, 22), seed=2), ["all", None, "qv"])


@pytest.mark.parametrize("change, match", [
    ({"layers_block_type": ["linear_attention", "mlp", "linear_attention", "mlp", "mlp"]},
     r"nemotron_h with no attention layer"),
    ({"n_groups": 3}, r"mamba_num_heads 8 in n_groups 3 is not supported"),
    ({"mlp_hidden_act": "silu"}, r"mlp_hidden_act 'silu' is not supported for nemotron_h")])
def test_config_refusals(change, match):
    """A Nemotron-H config.json without attention, of Mamba-2 heads its groups do not divide or another MLP
    activation: refused naming the field (Nemotron 3's experts: test_probes_session64_nemo3)."""
    from transformers import AutoConfig

    from infer.errors import UnsupportedModelError
    from infer.models.registry import check_supported
    cfg = AutoConfig.from_pretrained(str(ensure_builtin(NAME)))
    for key, value in change.items():
        object.__setattr__(cfg, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        check_supported(cfg)


def test_bfloat16_equals_transformers_in_bfloat16(hf):
    """--dtype bfloat16 (the norms weighting in float32, rounded once, as NemotronHRMSNorm; the SSM state float32):
    transformers' greedy tokens in bfloat16, batched, a one-token prompt included."""
    import copy
    hf = copy.deepcopy(hf).to(torch.bfloat16)  # (the module's hf: float32)
    prompts = random_prompts(512, (5, 13, 30, 1), seed=3)
    with LLM(NAME, block_size=4, dtype="bfloat16", max_num_seqs=2) as llm:
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        check_state_slots_all_free(llm)
