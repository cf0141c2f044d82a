"""Probes of the engine's scheduler and prefix cache (session 54): num_cached_tokens' meaning, the prompt logprobs'
memory, reset_prefix_cache while requests run, and the prefix cache under preemption, aborts and adapters."""

from __future__ import annotations

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams as Params
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts


def _engine(caching: bool = True, **kw) -> LLMEngine:
    kw = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=caching) | kw
    return LLMEngine(EngineConfig("tiny-llama", **kw))


def _run(engine: LLMEngine, requests, each_step=None) -> dict:
    """requests: [(id, prompt, params)], added together; the finished outputs by id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if each_step is not None:
            each_step(engine)
    return done


def test_num_cached_tokens_counts_prompt_tokens_only_with_prefix_token_ids():
    """A request with forced prefix_token_ids whose prompt and prefix were cached by an earlier one: its
    num_cached_tokens (usage.prompt_tokens_details.cached_tokens) is at most its prompt's length, as vLLM's (the
    prompt tokens whose K/V came from the cache); the prefix's blocks counted too, 28 cached tokens of a 10-token
    prompt were reported. Its tokens are those of the cache off (and of transformers)."""
    prompt, prefix = random_prompts(500, (10, 20), seed=11)
    params = Params(max_new_tokens=3, ignore_eos=True, prefix_token_ids=prefix)
    engine = _engine()
    first = _run(engine, [("a", prompt, params)])["a"]
    again = _run(engine, [("b", prompt, params)])["b"]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(prompt)  # every prompt token's K/V came from the cache
    assert engine.block_manager.prefix_hits == 28  # (the hit counters count the blocks found, prefix ones too)
    want = hf_greedy(ensure_builtin("tiny-llama"), prompt + prefix, 3)
    assert again.outputs[0].token_ids[len(prefix):] == want
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def _hf_prompt_logprobs(prompt: list[int]):
    import torch

    from helpers import hf_model
    with torch.no_grad():
        logits = hf_model(str(ensure_builtin("tiny-llama")))(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1)


def test_whole_vocabulary_prompt_logprobs_are_computed_in_chunks_the_plan_holds(monkeypatch):
    """prompt_logprobs=-1 (the whole vocabulary, under max_logprobs -1) of a 40-token prompt: the device never holds
    more prompt positions' logits at once than memory.sizes.prompt_logprob_rows allows (their bytes within the plan's
    sampler rows of max_num_seqs sequences, as vLLM bounds its logits buffer), and each chunk's results go to the
    host before the next: the [prompt, 2 x vocab] float64 results were built whole on the device (and concatenated,
    twice), past any plan. The values are transformers' (each position's logprob, rank and the whole ordered
    vocabulary) and those of one position at a time."""
    import torch

    from infer.memory.sizes import prompt_logprob_row_bytes, prompt_logprob_rows, sampler_row_bytes
    prompt = random_prompts(500, (40,), seed=21)[0]
    params = Params(max_new_tokens=1, ignore_eos=True, prompt_logprobs=-1)
    got = {}
    for seqs in (8, 1):
        engine = _engine(max_num_seqs=seqs, max_logprobs=-1)
        vocab = engine.model_config.vocab_size
        rows, compute = [], engine.runner.model.compute_logits
        monkeypatch.setattr(engine.runner.model, "compute_logits", lambda h: rows.append(h.shape[0]) or compute(h))
        got[seqs] = _run(engine, [("a", prompt, params)])["a"].prompt_logprobs
        most = prompt_logprob_rows(vocab, vocab, seqs)
        assert max(rows[:-1]) == most  # (the last call: the sampled row)
        held = most * prompt_logprob_row_bytes(vocab, vocab)
        assert held <= max(seqs, 2) * sampler_row_bytes(engine.model_config)  # (one position at least)
    assert prompt_logprob_rows(vocab, vocab, 8) == 5 < 8  # the whole vocabulary's positions weigh more than a row
    assert prompt_logprob_rows(vocab, 20, 8) == 8  # a few top logprobs: max_num_seqs positions, as before
    want = _hf_prompt_logprobs(prompt)
    for records in got.values():
        assert records[0] is None and len(records) == len(prompt)
        for t, rec in enumerate(records[1:]):
            row = want[t]
            assert rec["token_id"] == prompt[t + 1]
            assert rec["logprob"] == pytest.approx(row[prompt[t + 1]].item(), abs=1e-4)
            tops = rec["top_logprobs"]
            assert len(tops) == vocab
            assert [x["logprob"] for x in tops] == pytest.approx(row.sort(descending=True).values.tolist(), abs=1e-4)
            assert tops[0]["token_id"] == int(row.argmax())
    for a, b in zip(got[8][1:], got[1][1:]):  # chunks of 5 positions and of one: the same values
        assert a["rank"] == b["rank"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
        assert [x["logprob"] for x in a["top_logprobs"]] == pytest.approx(
            [x["logprob"] for x in b["top_logprobs"]], abs=1e-5)
    assert torch.isfinite(torch.tensor([r["logprob"] for r in got[8][1:]])).all()


def test_the_measured_worst_case_holds_a_chunk_of_whole_vocabulary_prompt_logprobs(monkeypatch):
    """`infer warmup`'s measured plan (engine.profile.profile_run): its worst-case prefill asks for the prompt
    logprobs of a chunk of positions at the most top logprobs a request may ask for (max_logprobs; -1: the whole
    vocabulary), in every measured run (a step asks for a position once), so that the measured peak holds them.
    It asked for none: a request of prompt_logprobs -1 ran past what warmup had measured."""
    from infer.cli.warmup_plan import measured_plan
    from infer.engine.model_runner import ModelRunner
    from infer.memory.sizes import prompt_logprob_rows
    asked = []
    real = ModelRunner._prompt_logprobs

    def spy(self, hidden, prompt):
        asked.append((max(s.params.prompt_logprobs for s, _ in prompt[2]), prompt[0].shape[0]))
        return real(self, hidden, prompt)
    monkeypatch.setattr(ModelRunner, "_prompt_logprobs", spy)
    for cap, k in ((-1, 512), (20, 20)):
        asked.clear()
        measured_plan(EngineConfig("tiny-llama", max_num_seqs=2, max_model_len=128, max_logprobs=cap), 128, 2)
        assert len(asked) == 3  # the first run of the prefill and both measured ones
        assert set(asked) == {(k, prompt_logprob_rows(512, k, 2))}


def _run_adding(engine: LLMEngine, requests, later: dict, hook=None) -> dict:
    """_run, with the requests of later[s] added before step s (counting from 0) and hook(engine, steps done)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done, step = {}, 0
    while engine.has_unfinished_requests() or later:
        for rid, prompt, params in later.pop(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        if hook is not None:
            hook(engine, step)
    return done


@pytest.mark.parametrize("overlap", [False, True])
def test_reset_prefix_cache_during_a_running_prefill_forgets_its_blocks_with_overlapped_steps(overlap):
    """reset_prefix_cache while a request's prefill runs in chunks (16 tokens a step): the blocks it computed before
    the reset are no longer shared (a request of the same prompt added after it finds nothing), and no request
    reads wrong K/V (the tokens of the cache off and of transformers). With overlapped steps (the GPU's default)
    the step on the device when the reset came registered its blocks again as it completed (register_computed
    re-registered what its schedule had registered), so the next request found 44 cached tokens the reset had
    forgotten."""
    prompt = random_prompts(500, (48,), seed=5)[0]
    params = Params(max_new_tokens=6, ignore_eos=True)
    later = lambda: {2: [("b", prompt, params), ("c", prompt + [7, 8, 9], params)], 4: [("d", prompt, params)]}
    kw = dict(max_num_batched_tokens=16, overlap=overlap)
    on = _run_adding(_engine(**kw), [("a", prompt, params)], later(),
                     hook=lambda e, s: s == 1 and e.reset_prefix_cache())
    off = _run_adding(_engine(False, **kw), [("a", prompt, params)], later())
    assert on["b"].num_cached_tokens == 0  # a's first blocks, computed before the reset, are forgotten
    assert (on["c"].num_cached_tokens, on["d"].num_cached_tokens) == (48, 44)  # b's, computed after it: shared
    want = hf_greedy(ensure_builtin("tiny-llama"), prompt, 6)
    for rid in "abcd":
        assert on[rid].outputs[0].token_ids == off[rid].outputs[0].token_ids
    assert on["a"].outputs[0].token_ids == on["b"].outputs[0].token_ids == want


@pytest.mark.parametrize("with_prefill", [True, False])
def test_a_decodes_block_is_shared_in_its_step_when_the_step_holds_a_prefill_chunk(with_prefill):
    """A decodes; in the step where its token completes its third block (positions 8..11: two prompt tokens and its
    first two tokens), B is admitted with A's prompt and those two tokens and one more. Beside X's prefill chunk
    (a query of several tokens: the step never takes the fused decode kernel, whose reads race its writes) B shares
    that block at once, as vLLM shares every block it schedules, computing 1 token where it computed 5; without a
    prefill chunk in the step the block waits for the step to complete (B computes its block itself). B's tokens
    are those of the cache off and of transformers either way."""
    a_prompt, x_prompt, tail = random_prompts(500, (10, 127, 1), seed=31)
    kw = dict(max_num_batched_tokens=64)
    long = Params(max_new_tokens=8, ignore_eos=True)
    first = [("a", a_prompt, long)] + ([("x", x_prompt, Params(max_new_tokens=2, ignore_eos=True))]
                                        if with_prefill else [])
    outs, b_prompts = {}, set()
    for caching in (True, False):
        engine = _engine(caching, **kw)
        for rid, prompt, params in first:
            engine.add_request(rid, prompt, params)
        engine.step()
        engine.step()  # a holds its first two tokens; x (127 tokens) has 10 left
        a = engine.requests["a"]
        assert a.num_computed_tokens == 11 and len(a.output_token_ids) == 2
        b_prompt = a_prompt + a.output_token_ids + tail
        b_prompts.add(tuple(b_prompt))
        outs[caching] = _run(engine, [("b", b_prompt, Params(max_new_tokens=4, ignore_eos=True))])["b"]
    assert len(b_prompts) == 1
    assert outs[True].num_cached_tokens == (12 if with_prefill else 8)
    assert outs[True].outputs[0].token_ids == outs[False].outputs[0].token_ids \
        == hf_greedy(ensure_builtin("tiny-llama"), b_prompt, 4)
