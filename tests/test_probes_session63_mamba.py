"""IBM Granite 4.0 (GraniteMoeHybridForCausalLM, models.granite4) equals transformers (float32): the all-attention
shape (granite-4.0-micro: rope, the shared MLP, no experts) and the Mamba-2 hybrid with experts (granite-4.0-h-*:
the Mamba-2 layers' conv and SSM states in the per-sequence state cache, engine.state_cache): greedy tokens and
logprobs of concurrent prompts of different lengths, prompts cut into chunks mixed with decodes, preemption by
recompute under a tiny KV budget; the state slots are given back."""

from __future__ import annotations

import re

import pytest
import torch

from infer import LLM
from infer.models.tiny import ensure_builtin

from helpers import (builtin_model_tests, check_emulated_decode_graphs, check_greedy_and_logprobs_equal_transformers,
                     check_one_step_and_split_prompts, check_preemption_restarts_from_zero_state,
                     check_prompt_logprobs_equal_transformers, check_state_slots_all_free,
                     check_warmup_counts_the_states, greedy_each, greedy_tokens, hf_model, random_prompts)

HYBRID, DENSE = "tiny-granite4", "tiny-granite4-dense"


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(HYBRID)))


def _mamba_layers_hold_states(model) -> None:
    layers = model.linear_layers()
    assert len(layers) == 3 and all(layer.rec_state.dtype == torch.float32 for layer in layers)
    assert layers[0].rec_state.shape[1:] == (8, 16, 16) and layers[0].conv_state.shape[1:] == (128 + 2 * 2 * 16, 3)


def test_dense_granite4_equals_transformers():
    """granite-4.0-micro's shape (attention layers with rope, the shared MLP, no experts, Granite's scalars): prompts
    of 5, 13 and 30 tokens batched, transformers' tokens and logprobs; no state cache."""
    def check(model):
        assert not hasattr(model, "allocate_states") and model.nope_cos_sin is None
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(DENSE), hf_model(str(ensure_builtin(DENSE))), DENSE,
                                                 check)


def test_hybrid_granite4_equals_transformers(hf):
    """Mamba-2 layers (2 groups, chunks of 16: the 30-token prompt spans two), an attention layer without rope, the
    experts beside the shared MLP: transformers' tokens and logprobs, decodes of some beside the others' prefills."""
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(HYBRID), hf, HYBRID, _mamba_layers_hold_states)


def test_chunked_prefill_carries_the_mamba_state_across_steps(hf):
    """Steps of 8 tokens: prompts of 30 and 41 tokens run in chunks whose conv and SSM states carry over, mixed with
    the others' decodes; a prompt of one token too (its first step a decode from zero state)."""
    prompts = random_prompts(512, (30, 41, 1, 9), seed=5)
    with LLM(str(ensure_builtin(HYBRID)), block_size=4, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        check_state_slots_all_free(llm)


def test_chunked_prefill_prompt_logprobs_equal_transformers(hf):
    """Prompts of 30 and 23 tokens in steps of 8 beside each other: every prompt token's logprob is transformers'
    (within 1e-4): the tokens at the start of each step read the conv and SSM states the step before left (the tiny
    model's states decay within a few tokens, so greedy tokens alone would not tell)."""
    from infer import SamplingParams
    prompts = random_prompts(512, (30, 23), seed=8)
    with LLM(HYBRID, block_size=4, max_num_batched_tokens=8, max_num_seqs=2) as llm:
        out = llm.generate(prompts, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
        check_state_slots_all_free(llm)
    check_prompt_logprobs_equal_transformers(hf, prompts, out)


def test_a_long_prompt_spans_several_scan_chunks(hf):
    """A prompt of 70 tokens in one step (five chunks of 16 of the SSD scan) and one of 45 cut into steps of 20 (a
    scan chunk boundary inside a step's piece): transformers' tokens."""
    check_one_step_and_split_prompts(HYBRID, hf, random_prompts(512, (70, 45), seed=7), 20)


def test_preemption_restarts_the_mamba_state_from_zero(hf):
    """A KV budget of 16 blocks of 4 for 4 prompts: some are preempted and recomputed from position 0 (zero state),
    and still give transformers' tokens."""
    check_preemption_restarts_from_zero_state(HYBRID, hf)


test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests({HYBRID: "GraniteMoeHybridForCausalLM", DENSE: "GraniteMoeHybridForCausalLM"},
                        nope=(HYBRID,))


def test_warmup_counts_the_mamba_states():
    """`infer warmup --estimate` counts the Mamba-2 layers' state slots of max_num_seqs sequences and a padding slot
    (the bytes the engine allocates: 3 layers of a conv state [192, 3] and a float32 SSM state [8, 16, 16]) and the KV
    of the attention layer alone (1 of 4 layers)."""
    plan = check_warmup_counts_the_states(HYBRID, 2 * 32 * 4)
    assert plan["state_bytes"] == 3 * 9 * (192 * 3 * 4 + 8 * 16 * 16 * 4)


def test_prefix_caching_is_off_and_speculative_decoding_refused(caplog):
    """enable_prefix_caching asked of the hybrid without state snapshots (--state-snapshots 0): the engine runs
    without it (the Mamba-2 states of a cached prefix cannot be restored) and says so; the dense shape keeps it. A
    draft model is refused naming the option."""
    import logging

    from infer.errors import ConfigError
    with caplog.at_level(logging.INFO, logger="infer"):
        with LLM(HYBRID, block_size=4, enable_prefix_caching=True, state_snapshots=0) as llm:
            assert not llm.engine.block_manager.enable_prefix_caching
    assert "prefix caching is off for granitemoehybrid" in caplog.text
    with LLM(DENSE, block_size=4, enable_prefix_caching=True) as llm:
        assert llm.engine.block_manager.enable_prefix_caching
    with pytest.raises(ConfigError, match="--speculative-config cannot run granitemoehybrid"):
        LLM(HYBRID, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("triton", [False, True])
def test_emulated_decode_graphs_index_the_mamba_state_slots(hf, monkeypatch, triton):
    """Decode steps through (emulated) CUDA graphs: the rows' state slots a static buffer, padding rows reading zero
    state and writing the padding slot; 5 sequences of different output lengths replay every bucket and give
    transformers' tokens. `triton`: every op that has a Triton kernel through it (interpreted)."""
    check_emulated_decode_graphs(HYBRID, hf, monkeypatch, triton)



def test_mixed_adapters_on_the_attention_equal_peft(tmp_path):
    """Two adapters (every attention projection; q and v alone) and the base model in one batch and each alone:
    peft's tokens."""
    from lora_helpers import check_attention_adapters_equal_peft, hf_float
    base = ensure_builtin(HYBRID)
    check_attention_adapters_equal_peft(base, hf_float(base), tmp_path)


@pytest.mark.parametrize("targets", [["v_proj", "+conv1d"], ["in_proj", "+router"]])
def test_adapters_of_the_conv_or_the_router_are_refused(tmp_path, targets):
    """An adapter that names the Mamba-2 mixers' conv1d or the experts' router is refused at registration, naming it
    and what to adapt (a "+" target is added to adapter_config.json after peft made the adapter: peft refuses the
    conv at a rank its groups do not divide). The mixers' in_proj and out_proj are adapted
    (test_probes_session69_mamba_lora), the shared MLP's input_linear and output_linear too
    (test_probes_session71_granite_lora)."""
    import json

    from lora_helpers import hf_float, save_adapters

    from infer.errors import LoRAError
    made = [t for t in targets if not t.startswith("+")]
    paths = save_adapters(hf_float(ensure_builtin(HYBRID)), tmp_path, {"a": dict(r=4, lora_alpha=8,
                                                                                  target_modules=made)})
    config = json.loads((paths["a"] / "adapter_config.json").read_text())
    (paths["a"] / "adapter_config.json").write_text(json.dumps({**config, "target_modules": [t.lstrip("+")
                                                                                             for t in targets]}))
    listed = re.escape(repr([t.lstrip("+") for t in targets if t.startswith("+")]))
    with pytest.raises(LoRAError, match=rf"targets {listed}: infer's adapters of granitemoehybrid .* adapt the "
                                        r"attention's, the Mamba-2 mixers' \(in_proj, out_proj\) and the shared "
                                        r"MLP's \(input_linear, output_linear\) projections and the stacked experts, "
                                        r"not the mixers' conv1d, the router or a whole block.*retrain with "
                                        r"target_modules among q_proj, k_proj, v_proj, o_proj, in_proj, out_proj, "
                                        r"input_linear, output_linear"):
        LLM(HYBRID, loras={"a": str(paths["a"])}, max_lora_rank=8)


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]},
     r"granitemoehybrid layer_types \['sliding_attention'\] are not supported"),
    ({"layer_types": ["linear_attention", "full_attention"]},
     r"layer_types \['linear_attention', 'full_attention'\] are not supported for 4 layers"),
    ({"position_embedding_type": "alibi"}, r"position_embedding_type \"alibi\" is not supported"),
    ({"mamba_n_groups": 3}, r"mamba_n_heads 8 in mamba_n_groups 3 is not supported")])
def test_config_refusals(change, match):
    """A Granite 4.0 config.json of other layer types, a position embedding other than rope or none, or Mamba-2
    heads its groups do not divide: refused naming the field."""
    from transformers import AutoConfig

    from infer.errors import UnsupportedModelError
    from infer.models.registry import check_supported
    cfg = AutoConfig.from_pretrained(str(ensure_builtin(HYBRID)))
    for key, value in change.items():
        object.__setattr__(cfg, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        check_supported(cfg)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_equals_transformers_in_the_same_dtype(hf, dtype):
    """--dtype bfloat16 / float16 (the conv state in the model's dtype, the SSM state float32; dt, the step's
    products and the scan's output rounded where transformers rounds them): transformers' greedy tokens in that
    dtype, batched, a one-token prompt included."""
    import copy
    hf = copy.deepcopy(hf).to(getattr(torch, dtype))  # (the module's hf: float32)
    prompts = random_prompts(512, (5, 13, 30, 1), seed=3)
    with LLM(HYBRID, block_size=4, dtype=dtype, max_num_seqs=2) as llm:
        assert llm.engine.runner.model.linear_layers()[0].conv_state.dtype == getattr(torch, dtype)
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        check_state_slots_all_free(llm)
