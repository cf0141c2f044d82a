"""Review of Granite 4.0 (models.granite4, kernels.mamba2): random models of the shapes of the real checkpoints'
configs (granite-4.0-h-tiny / -h-small: one Mamba-2 group, conv bias, no projection bias, experts, no rope, tied
embeddings; granite-4.0-h-micro: a hybrid without experts; the other bias settings, rope in a hybrid, a
time_step_limit, Mamba-2 layers alone), saved by transformers' save_pretrained, equal transformers; n > 1, beam
search and sleep / wake with the Mamba-2 states."""

from __future__ import annotations

import pytest
import torch

from helpers import (family_builder, family_small_config, greedy_and_logprobs_test, norms_and_biases_shifted)


def _perturb(name, p):
    """Norms and biases moved, and the Mamba-2 layers' D, dt_bias and A_log too (their init is constant)."""
    norms_and_biases_shifted(name, p)
    if name.rsplit(".", 1)[-1] in ("D", "dt_bias", "A_log"):
        p.add_(torch.randn_like(p) * 0.3)


# granite-4.0-h-*: Mamba-2 heads of 16 (8), 16 state dims, conv kernel 4, chunks of 16, Granite's scalars
_H = dict(shared_intermediate_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
          embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0,
          position_embedding_type="nope", tie_word_embeddings=True,
          layer_types=["mamba", "mamba", "attention", "mamba"],
          mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
          mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False)
build = family_builder(family_small_config(4), {"granite4": ("granitemoehybrid", "GraniteMoeHybridForCausalLM", _H)},
                       _perturb)

CONFIGS = {
    "h-tiny": ("granite4", {}),
    "h-micro": ("granite4", dict(num_local_experts=0)),
    "biases-rope": ("granite4", dict(mamba_conv_bias=False, mamba_proj_bias=True, mamba_n_groups=2,
                                     position_embedding_type="rope")),
}


def _check(model, hf, family, config):
    layers = model.linear_layers()
    assert len(layers) == sum(t == "mamba" for t in {**_H, **config}["layer_types"])
    assert all(layer.rec_state.dtype == torch.float32 for layer in layers)


test_real_config_shapes_equal_transformers = greedy_and_logprobs_test(CONFIGS, build, _check)


def test_time_step_limit_clamps_the_prefill_as_transformers(tmp_path):
    """A time_step_limit (transformers clamps dt in its chunked scan, not in its one-token step, as mamba_ssm's
    selective_state_update): transformers' greedy tokens, and every prompt token's logprob its full forward's, prompts
    cut in steps of 8 mixed with decodes."""
    from infer import LLM, SamplingParams

    from helpers import check_prompt_logprobs_equal_transformers, greedy_each, random_prompts
    hf = build(tmp_path, "granite4", time_step_limit=[0.05, 0.5], mamba_n_groups=4)
    prompts = random_prompts(512, (30, 19, 1), seed=6)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=8, max_num_seqs=3) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, prompt_logprobs=0))
    assert [o.token_ids for o in outs] == greedy_each(hf, prompts, 6)
    check_prompt_logprobs_equal_transformers(hf, prompts, outs)


def test_mamba_layers_alone_are_refused(tmp_path):
    """A config whose every layer is Mamba-2 (transformers' default layer_types): refused naming it, before any
    work (it failed dividing by the KV bytes of no attention layer)."""
    from infer import LLM
    from infer.errors import UnsupportedModelError
    build(tmp_path, "granite4", layer_types=["mamba"] * 4, num_local_experts=0)
    with pytest.raises(UnsupportedModelError, match=r"granitemoehybrid with no attention layer \(every layer_types "
                                                    r"entry \"mamba\"\) is not supported"):
        LLM(str(tmp_path))
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json"])
    assert res.exit_code == 2 and "with no attention layer" in res.output and "hint: serve a Granite 4.0" in res.output


HYBRID = "tiny-granite4"


@pytest.fixture(scope="module")
def hf():
    from infer.models.tiny import ensure_builtin

    from helpers import hf_model
    return hf_model(str(ensure_builtin(HYBRID)))


def test_steps_that_end_exactly_on_scan_chunk_boundaries(hf):
    """Steps of 16 tokens, the SSD scan's chunk (no padding in any step's scan): prompts of 48 and 16 tokens, one
    after the other (each step a whole chunk from the state the last left) and then beside a one-token prompt;
    transformers' prompt logprobs and greedy tokens."""
    from infer import LLM, SamplingParams

    from helpers import (check_prompt_logprobs_equal_transformers, check_state_slots_all_free, greedy_each,
                         random_prompts)
    prompts = random_prompts(512, (48, 16, 1), seed=9)
    for seqs in (1, 3):
        with LLM(HYBRID, block_size=4, max_num_batched_tokens=16, max_num_seqs=seqs) as llm:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True, prompt_logprobs=0))
            check_state_slots_all_free(llm)
        assert [o.token_ids for o in outs] == greedy_each(hf, prompts, 5), seqs
        check_prompt_logprobs_equal_transformers(hf, prompts, outs)


def test_beam_search_and_n_samples_equal_transformers(hf):
    """A beam search of width 2 (a request per beam and step, each from zero state) gives transformers' beams; n=3
    greedy samples of two prompts each give transformers' tokens; every state slot back."""
    from infer import LLM, SamplingParams
    from infer.engine.beam import BeamSearchParams

    from helpers import check_state_slots_all_free, greedy_each, random_prompts
    prompts = random_prompts(512, (9, 21), seed=12)
    with LLM(HYBRID, block_size=4, max_num_seqs=4) as llm:
        beams = llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=2, max_tokens=4,
                                                                                     ignore_eos=True))
        outs = llm.generate(prompts, SamplingParams(n=3, max_new_tokens=6, ignore_eos=True, temperature=0.0))
        check_state_slots_all_free(llm)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompts[0]]), num_beams=2, num_return_sequences=2, max_new_tokens=4,
                           do_sample=False, length_penalty=1.0, early_stopping=True, pad_token_id=0)
    assert [s.tokens for s in beams[0].sequences] == want.tolist()
    assert [[s.token_ids for s in o.outputs] for o in outs] == [[w] * 3 for w in greedy_each(hf, prompts, 6)]


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_sleep_and_wake_with_the_mamba_states(hf, mode):
    """sleep(level=1) frees the Mamba-2 states with the KV cache (zeros on waking); mode "keep" mid-run: the four
    requests (a one-token prompt among them) are recomputed from position 0 after wake_up: transformers' tokens."""
    from infer import LLM

    from helpers import (add_greedy_requests, check_requests_finish_as_transformers, check_state_slots_all_free,
                         random_prompts, state_tensors)
    prompts = random_prompts(512, (1, 13, 30, 9), seed=3)
    with LLM(HYBRID, block_size=4, max_num_seqs=4, enable_sleep_mode=True) as llm:
        eng = llm.engine
        add_greedy_requests(eng, prompts, 8, steps=3)
        if mode == "abort":
            for i in range(len(prompts)):
                eng.abort_request(str(i))
        assert any(bool(t.any()) for t in state_tensors(llm))
        eng.sleep(level=1, mode=mode)
        check_state_slots_all_free(llm)
        eng.wake_up()
        assert all(not t.any() for t in state_tensors(llm))
        if mode == "abort":
            add_greedy_requests(eng, prompts, 8)
        check_requests_finish_as_transformers(llm, hf, prompts, 8)


def test_pooling_runner_and_slots_left_nan(hf):
    """--runner pooling (last-token, normalized), prompts in steps of 8: transformers' final hidden state; then every
    slot filled with NaN (what a request gone non-finite leaves) and one-token prompts generated: transformers'
    tokens (a zero state chosen, not NaN times zero)."""
    from infer import LLM

    from helpers import check_pooling_embeds_as_transformers, greedy_each, greedy_tokens, random_prompts, state_tensors
    prompts = random_prompts(512, (5, 30, 1, 19), seed=13)
    check_pooling_embeds_as_transformers(HYBRID, hf, prompts)
    with LLM(HYBRID, block_size=4, max_num_seqs=4) as llm:
        for t in state_tensors(llm):
            t.fill_(float("nan"))
        assert greedy_tokens(llm, [[7], [9], prompts[0]], 4) == greedy_each(hf, [[7], [9], prompts[0]], 4)


def test_many_sequences_preempted_in_chunks_mixed_with_decodes(hf):
    """Ten prompts (one of one token) through 6 slots, steps of 12 tokens and a KV budget of 24 blocks of 4: chunked
    prefills beside decodes, preemptions recomputed from zero state, slots reused: transformers' tokens, every slot
    back."""
    from infer import LLM

    from helpers import check_state_slots_all_free, greedy_each, greedy_tokens, random_prompts
    prompts = random_prompts(512, (23, 7, 1, 31, 16, 12, 29, 5, 18, 33), seed=21)
    with LLM(HYBRID, block_size=4, num_kv_blocks=24, max_model_len=48, max_num_seqs=6,
             max_num_batched_tokens=12) as llm:
        assert greedy_tokens(llm, prompts, 10) == greedy_each(hf, prompts, 10)
        assert llm.engine.scheduler.num_preemptions > 0
        check_state_slots_all_free(llm)


def test_measured_warmup_runs_and_the_formula_counts_the_ssd_scan(tmp_path):
    """`infer warmup` (measured) of Granite 4.0's hybrid: its worst-case sequences hold state slots (the profile run
    failed without them), and a step of 1,024 tokens in chunks of 256 (the real checkpoints' mamba_chunk_size; 32
    Mamba-2 heads) peaks at the SSD scan's [H, T, L] float32 temporaries, which the formula counts: the measured peak
    is under the estimate by less than 1.3x."""
    from helpers import measured_warmup
    build(tmp_path, "granite4", mamba_n_heads=32, mamba_d_head=4, mamba_chunk_size=256, max_position_embeddings=4096)
    measured = measured_warmup([str(tmp_path), "--max-length", "1024", "--concurrency", "1",
                                "--max-num-batched-tokens", "1024"])
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert peak <= formula <= 1.3 * peak, (formula, peak)
