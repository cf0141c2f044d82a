"""Qwen3.5's text model (Qwen3_5ForCausalLM: Gated DeltaNet layers and gated attention, models.qwen3_5) with its
per-sequence state cache (engine.state_cache) equals transformers (float32), and Qwen3.5's multimodal checkpoints
(Qwen3_5ForConditionalGeneration) served as that text model: greedy tokens and logprobs of several
concurrent prompts of different lengths, prompts cut into chunks, preemption by recompute under a tiny KV budget; the
state slots are taken and given back; prefix caching is off for it without state snapshots."""

from __future__ import annotations

import logging

import pytest
import torch

from infer import LLM
from infer.models.tiny import ensure_builtin

from helpers import (builtin_model_tests, check_batched_chunks_equal_transformers, check_emulated_decode_graphs,
                     check_greedy_and_logprobs_equal_transformers, check_one_step_and_split_prompts,
                     check_preemption_restarts_from_zero_state, check_state_slots_all_free,
                     check_warmup_counts_the_states, estimated_plan, greedy_each, greedy_tokens, hf_model,
                     random_prompts)
from quant_helpers import needs_gptqmodel

NAME = "tiny-qwen3_5"


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(NAME)))


def _linear_layers_hold_states(model) -> None:
    layers = model.linear_layers()
    assert len(layers) == 3 and all(layer.rec_state.dtype == torch.float32 for layer in layers)


def test_greedy_tokens_and_logprobs_equal_transformers(hf):
    """Prompts of 5, 13 and 30 tokens, 10 tokens generated, batched (decodes of some beside the others' prefills):
    transformers' tokens, each logprob within 1e-4."""
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(NAME), hf, NAME, _linear_layers_hold_states)


def test_chunked_prefill_carries_the_state_across_steps(hf):
    """Steps of 8 tokens: every prompt of 30 and 41 tokens runs in chunks whose states carry over, mixed with the
    others' decodes; a prompt of one token too (its first step a decode-shaped step from zero state)."""
    prompts = random_prompts(512, (30, 41, 1, 9), seed=5)
    with LLM(str(ensure_builtin(NAME)), block_size=4, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        check_state_slots_all_free(llm)


def test_a_long_prompt_spans_several_chunks_of_the_delta_rule(hf):
    """A prompt of 150 tokens in one step (three chunks of 64 of the chunked delta rule, the state decayed across
    them) and one of 70 cut into steps of 40 (a chunk boundary inside a step's piece): transformers' tokens."""
    check_one_step_and_split_prompts(NAME, hf, random_prompts(512, (150, 70), seed=7), 40)


def test_preemption_restarts_from_zero_state(hf):
    """A KV budget of 16 blocks of 4 for 4 prompts: some are preempted and recomputed from position 0 (their slot
    given back and a new one taken, zero state), and still give transformers' tokens."""
    check_preemption_restarts_from_zero_state(NAME, hf)


def test_prefix_caching_is_off_with_a_note(hf, caplog):
    """enable_prefix_caching asked without state snapshots (--state-snapshots 0): the engine runs without it (a
    cached prefix's KV lacks the linear layers' state at its end) and says so; a prompt sharing another's prefix
    still gives transformers' tokens. (With snapshots: tests/test_probes_session64_hybcache.py.)"""
    prompts = random_prompts(512, (24,), seed=6)
    prompts.append(prompts[0][:16] + [7, 8, 9])
    with caplog.at_level(logging.INFO, logger="infer"):
        llm = LLM(str(ensure_builtin(NAME)), block_size=4, enable_prefix_caching=True, state_snapshots=0)
    with llm:
        assert "prefix caching is off for qwen3_5_text" in caplog.text
        assert not llm.engine.block_manager.enable_prefix_caching
        want = greedy_each(hf, prompts, 6)
        assert greedy_tokens(llm, prompts[:1], 6) == want[:1]
        assert greedy_tokens(llm, prompts[1:], 6) == want[1:]
        assert llm.engine.stats()["prefix_cache_hits"] == 0


test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests({NAME: "Qwen3_5ForCausalLM", "tiny-qwen3_5-mm": "Qwen3_5ForConditionalGeneration",
                         "tiny-qwen3-next": "Qwen3NextForCausalLM"})


def test_warmup_counts_the_state_cache():
    """`infer warmup --estimate` counts the state slots of max_num_seqs sequences (the bytes the engine allocates)
    and the KV of the attention layer only (1 of 4 layers): its KV blocks are fewer by the states' bytes."""
    plan = check_warmup_counts_the_states(NAME, 2 * 64 * 4)
    assert plan["state_bytes"] > 0
    more = estimated_plan(NAME, "--max-length", "256", "--max-num-seqs", "64", "--memory-limit", "256MiB")
    assert more["state_bytes"] == plan["state_bytes"] * 65 // 9
    assert more["kv_blocks"] < plan["kv_blocks"]


@pytest.mark.parametrize("triton", [False, True])
def test_emulated_decode_graphs_index_the_state_slots(hf, monkeypatch, triton):
    """Decode steps through (emulated) CUDA graphs: the rows' state slots are a static buffer the step copies in,
    padding rows read zero state and write the padding slot; 5 sequences of different output lengths replay every
    bucket and give transformers' tokens. `triton`: every op through its Triton kernel (interpreted), the GPU's code
    path. No piecewise graphs for this model (prefills run eagerly)."""
    def no_pieces(llm):
        assert llm.engine.runner.pieces is None
    check_emulated_decode_graphs(NAME, hf, monkeypatch, triton, no_pieces)


def test_mixed_adapters_on_attention_and_mlp_equal_peft(tmp_path):
    """Two adapters (every attention and MLP projection, the gated q_proj included; q, v and up alone) and the base
    model in one batch and each alone: peft's tokens."""
    from lora_helpers import ALL, check_mixed_adapters_equal_peft, hf_float, save_adapters
    base = ensure_builtin(NAME)
    hf = hf_float(base)
    qvu = dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"])
    paths = save_adapters(hf, tmp_path, {"all": dict(r=8, lora_alpha=16, target_modules=ALL), "qvu": qvu})
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 13, 22), seed=2), ["all", None, "qvu"])


def test_adapters_of_the_linear_attention_layers_are_refused(tmp_path):
    """An adapter of the Gated DeltaNet's projections is refused at registration, naming them and what to adapt."""
    from lora_helpers import hf_float, save_adapters

    from infer.errors import LoRAError
    paths = save_adapters(hf_float(ensure_builtin(NAME)), tmp_path, {"lin": dict(r=4, lora_alpha=8, target_modules=[
        "in_proj_qkv", "out_proj", "down_proj"])})
    with pytest.raises(LoRAError, match=r"targets \['in_proj_qkv', 'out_proj'\], the projections of qwen3_5_text's "
                                        r"linear-attention \(Gated DeltaNet\) layers.*retrain with target_modules"):
        LLM(NAME, loras={"lin": str(paths["lin"])}, max_lora_rank=8)


def test_speculative_decoding_is_refused():
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match="--speculative-config cannot run qwen3_5_text: its linear-attention"):
        LLM(NAME, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})


@needs_gptqmodel
def test_infer_quantize_and_the_gptq_checkpoint_equal_transformers_dequantized(tmp_path):
    """`infer quantize` (GPTQModel's qwen3_5_text definition) writes the linear attention's in_proj_qkv, in_proj_z and
    out_proj and the attention's and MLP's projections int4, in_proj_b and in_proj_a float; infer loads it (the int4
    layers merged, in_proj_ba float) and gives transformers' greedy tokens on the dequantized weights; `infer warmup
    --estimate` counts its weights as loaded."""
    from safetensors import safe_open

    from infer.memory.sizes import weights_bytes
    from quant_helpers import dequantized_float_model, infer_quantize
    out = infer_quantize(NAME, tmp_path / "q")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    prefix = "model.layers.0.linear_attn."
    assert {prefix + p + ".qweight" for p in ("in_proj_qkv", "in_proj_z", "out_proj")} <= names
    assert {prefix + "in_proj_b.weight", prefix + "in_proj_a.weight", "model.layers.3.self_attn.q_proj.qweight"} \
        <= names
    plan = estimated_plan(str(out), "--max-length", "256")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:
        model = llm.engine.runner.model
        assert model.layers[0].linear_attn.in_proj_qkvz.qweight is not None
        assert model.layers[0].linear_attn.in_proj_ba.weight.is_floating_point()
        assert plan["weights_bytes"] == weights_bytes(model)
        got = greedy_tokens(llm, prompts, 8)
    assert got == greedy_each(dequantized_float_model(ensure_builtin(NAME), out), prompts, 8)


def test_qwen3_next_equals_transformers_batched_and_chunked():
    """Qwen3-Next (Qwen3.5's layers with in_proj_qkvz and in_proj_ba stored fused by key head, two value heads a key
    head; Qwen2-MoE's experts and gated shared expert): transformers' tokens and logprobs of prompts of 5, 13 and 30
    batched, and its tokens in steps of 8 (prompts in chunks, mixed with decodes)."""
    path = ensure_builtin("tiny-qwen3-next")
    hf = hf_model(str(path))

    def check_model(model):
        layer = model.layers[0].linear_attn
        assert layer.fused and layer.hv == 2 * layer.hk and model.layers[0].mlp.shared_expert is not None
    check_greedy_and_logprobs_equal_transformers(path, hf, "tiny-qwen3-next", check_model)
    check_batched_chunks_equal_transformers(path, hf)


def test_beam_search_equals_transformers_beams(hf):
    """A beam search (LLM.beam_search: a request per beam and step, each recomputed from position 0 with prefix
    caching off) gives transformers' two beams; every state slot comes back."""
    from infer.engine.beam import BeamSearchParams
    prompt = random_prompts(512, (9,), seed=12)[0]
    with LLM(NAME, block_size=4, max_num_seqs=4) as llm:
        out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=4,
                                                                                 ignore_eos=True))
        check_state_slots_all_free(llm)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2, max_new_tokens=4,
                           do_sample=False, length_penalty=1.0, early_stopping=True, pad_token_id=0)
    assert [s.tokens for s in out[0].sequences] == want.tolist()
