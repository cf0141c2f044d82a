"""Probes of prefix sharing within one step (session 53): a block is put in the prefix cache when the step that
completes its K/V is scheduled (vLLM's allocate_slots caches the blocks of the tokens it schedules), so identical
prefixes admitted in the same step (the n samples of a request, a batch sharing a system prompt) are computed once:
the later requests compute only their tails, reading K/V that the same forward writes first."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.engine.block_manager import BlockManager
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams as Params
from infer.engine.scheduler import Scheduler
from infer.engine.sequence import Sequence
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts


def _engine(caching: bool = True, **kw) -> LLMEngine:
    kw = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=caching) | kw
    return LLMEngine(EngineConfig("tiny-llama", **kw))


def _run(engine: LLMEngine, prompts, params, first_step=None) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 1 and first_step is not None:
            first_step(engine)
    return done


def _tokens_and_logprobs(out):
    c = out.outputs[0]
    return c.token_ids, [r["logprob"] for r in c.logprobs]


def _same(out, other) -> bool:
    """The same tokens, and logprobs to 1e-4 (a prefill of other lengths sums in another order)."""
    (tokens, logprobs), (want, want_lp) = _tokens_and_logprobs(out), _tokens_and_logprobs(other)
    return tokens == want and logprobs == pytest.approx(want_lp, abs=1e-4)


def test_identical_prompts_admitted_in_one_step_compute_the_prefix_once():
    """8 identical 40-token prompts admitted together: the first computes them, the 7 others only their last block
    (36 tokens cached each, as vLLM counts them), with the tokens and logprobs of the cache off and of transformers."""
    prompt = random_prompts(500, (40,), seed=3)[0]
    params = Params(max_new_tokens=6, ignore_eos=True, logprobs=0)
    steps = {}
    on = _run(_engine(), [prompt] * 8, params, lambda e: steps.setdefault("on", e.last_step_tokens))
    off = _run(_engine(False), [prompt] * 8, params, lambda e: steps.setdefault("off", e.last_step_tokens))
    assert steps == {"on": 40 + 7 * 4, "off": 8 * 40}
    want = hf_greedy(ensure_builtin("tiny-llama"), prompt, 6)
    for i in map(str, range(8)):
        assert _tokens_and_logprobs(on[i])[0] == want
        assert _same(on[i], off[i])
    assert [on[str(i)].num_cached_tokens for i in range(8)] == [0] + [36] * 7


def test_prefix_cache_counters_count_the_same_step_hits():
    """The engine's prefix-cache queries and hits (/metrics' prefix_cache_hits) count the blocks a request found
    registered by one admitted before it in the same step."""
    engine = _engine()
    prompt = random_prompts(500, (40,), seed=4)[0]
    _run(engine, [prompt] * 4, Params(max_new_tokens=2, ignore_eos=True))
    bm = engine.block_manager
    assert (bm.prefix_queries, bm.prefix_hits) == (4 * 40, 3 * 36)


def test_n_samples_of_a_request_compute_their_prompt_once():
    """LLM.generate with n=4 (greedy and seeded): the samples' common prompt is computed by the first only."""
    path = ensure_builtin("tiny-llama")
    prompt = random_prompts(500, (33,), seed=5)[0]
    results = {}
    for caching in (True, False):
        llm = LLM(str(path), block_size=4, num_kv_blocks=128, max_model_len=64, enable_prefix_caching=caching)
        outs = []
        for kw in ({}, {"temperature": 1.0, "seed": 7}):
            llm.engine.block_manager.reset_prefix_cache()  # (cold: the second finds nothing of the first)
            outs.append(llm.generate([prompt], SamplingParams(n=4, max_new_tokens=5, ignore_eos=True, logprobs=0,
                                                              **kw))[0])
            if caching:  # 3 samples find the 8 blocks the first computes in the same step
                assert llm.engine.block_manager.prefix_hits == 3 * 32
        results[caching] = [[(c.token_ids, [r["logprob"] for r in c.logprobs]) for c in o.outputs] for o in outs]
    for on, off in zip(results[True], results[False]):
        for (tokens, logprobs), (want, want_lp) in zip(on, off):
            assert tokens == want and logprobs == pytest.approx(want_lp, abs=1e-4)
    assert all(c[0] == hf_greedy(path, prompt, 5) for c in results[True][0])


def test_a_request_admitted_beside_a_running_chunk_shares_the_blocks_the_chunk_completes():
    """Chunked prefill (a budget of 24 tokens): the second request, admitted the step the first computes its prompt's
    last 16 tokens, finds the 6 blocks computed before and the 3 full ones this step completes (36 tokens), and
    computes only its last 4 tokens; the tokens equal the cache off."""
    prompt = random_prompts(500, (40,), seed=6)[0]
    params = Params(max_new_tokens=5, ignore_eos=True, logprobs=0)
    outs = {}
    for caching in (True, False):
        engine = _engine(caching, max_num_batched_tokens=24)
        outs[caching] = _run(engine, [prompt], params, lambda e: e.add_request("1", prompt, params))
    assert outs[True]["1"].num_cached_tokens == 36
    for i in "01":
        assert _same(outs[True][i], outs[False][i])


def _scheduler(num_blocks=32, budget=64) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, 4)
    return Scheduler(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=budget), bm), bm


def test_only_blocks_the_step_writes_completely_are_registered_when_scheduled():
    """A 40-token prompt whose first chunk is 30 tokens: blocks 0..6 (positions 0..27) are shareable at once; block 7
    holds positions 28..31, of which the step writes two: registered only once a step completes it."""
    sched, bm = _scheduler(budget=30)
    seq = Sequence("a", list(range(100, 140)), Params(max_new_tokens=1))
    sched.add(seq)
    batch = sched.schedule()
    assert batch.num_new_tokens == [30]
    assert sorted(bm.hash_to_block.values()) == seq.block_table[:7]


def test_a_step_of_one_token_registers_nothing_when_scheduled():
    """A sequence's step of a single token (a decode, a chunk of one) may run in the fused decode kernel, where each
    token's program writes its key while the others read: no block of it is shared before that step ran."""
    bm = BlockManager(8, 4)
    seq = Sequence("a", list(range(100, 108)), Params(max_new_tokens=1))
    bm.allocate(seq)
    seq.num_computed_tokens = 7
    bm.register_scheduled(seq, 1)
    assert bm.hash_to_block == {} and bm.scheduled == []
    bm.register_scheduled(seq, 2)  # (a step of several tokens: shared at once)
    assert len(bm.hash_to_block) == 2


def test_a_step_that_fails_leaves_no_block_registered_without_its_kv(monkeypatch):
    """The step that would have computed a shared prefix fails (its forward raised): the blocks registered for it
    leave the prefix cache and the request that took them computes them itself, so that when the first request is
    then aborted the second still gives the cache-off tokens (it read zeroed K/V before)."""
    prompt = random_prompts(500, (40,), seed=8)[0]
    params = Params(max_new_tokens=5, ignore_eos=True, logprobs=0)
    ref = _run(_engine(False), [prompt], params)["0"]
    engine = _engine()
    engine.add_request("0", prompt, params)
    engine.add_request("1", prompt, params)
    run, calls = engine.runner.run, []

    def failing(batch):
        calls.append(batch.num_tokens)
        if len(calls) == 1:
            raise RuntimeError("the forward failed")
        return run(batch)
    monkeypatch.setattr(engine.runner, "run", failing)
    with pytest.raises(RuntimeError):
        engine.step()
    assert calls == [44]
    bm = engine.block_manager
    assert bm.hash_to_block == {}
    assert bm.prefix_hits == 0 and engine.requests["1"].num_cached_tokens == 0  # (no hit happened)
    engine.abort_request("0")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert calls[1] == 40  # the second request computes its whole prompt
    assert _same(done["1"], ref)


@pytest.mark.parametrize("kw", [
    dict(speculative_config={"model": "tiny-qwen2", "num_speculative_tokens": 3}),  # draft-model speculation
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    dict(kv_cache_dtype="fp8"),
    dict(overlap=True),
    dict(max_num_batched_tokens=24, num_kv_blocks=12, max_model_len=48),  # chunks, and 3 preemptions
    dict(scheduling_policy="priority"),
], ids=["draft", "ngram", "fp8", "overlap", "chunked-tiny", "priority"])
def test_same_step_sharing_gives_the_tokens_of_the_cache_off(kw):
    """Identical and overlapping prompts admitted together give the tokens and logprobs of the cache off with draft
    speculation (whose draft KV of a block shared the step it is computed is fed again), prompt lookup, an fp8 cache,
    overlapped steps, small chunks with a cache small enough to preempt, the priority policy; some of them shared."""
    if "speculative_config" in kw and kw["speculative_config"].get("model"):
        kw = dict(kw, speculative_config=dict(kw["speculative_config"], model=str(ensure_builtin("tiny-qwen2"))))
    base = random_prompts(500, (30, 5, 3), seed=9)
    prompts = [base[0]] * 3 + [base[0] + base[1], base[0][:12] + base[2], base[0] + base[1]]
    params = Params(max_new_tokens=6, ignore_eos=True, logprobs=0)
    outs = {}
    for caching in (True, False):
        outs[caching] = _run(_engine(caching, max_num_seqs=6, **kw), prompts, params)
    for i in map(str, range(len(prompts))):
        assert _same(outs[True][i], outs[False][i]), f"request {i}"
    assert sum(o.num_cached_tokens for o in outs[True].values()) > 0


def test_same_step_sharing_through_emulated_piecewise_graphs():
    """A step whose tokens replay the piecewise graphs (emulated on CPU: the same static buffers and padded buckets):
    the pieces store every token's K/V before the eager attention reads, so 3 identical prompts admitted together
    (13 + 1 + 1 tokens computed) give transformers' tokens."""
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), max_num_seqs=3, max_num_batched_tokens=64, cuda_graph_max_tokens=32, block_size=4,
              num_kv_blocks=64, max_model_len=64)
    llm.engine.runner.capture_graphs(64, emulate=True)
    prompt = random_prompts(500, (13,), seed=10)[0]
    outs = llm.generate([prompt] * 3, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.num_cached_tokens for o in outs] == [0, 12, 12]
    assert llm.engine.runner.pieces.replays
    assert all(o.outputs[0].token_ids == hf_greedy(path, prompt, 4) for o in outs)
