"""Session 52 probes: the scheduler and KV cache under pressure (tight caches, preemption, overlapped steps).

Every request's greedy tokens must be those it gets alone, the counters must say what happened, and the block
manager must hold nothing once every request is over."""

from __future__ import annotations

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams


def _drain(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return outs


def _both_ways(num_kv_blocks: int = 10, max_model_len: int = 40):
    """(overlap, a tiny-llama engine of `num_kv_blocks` blocks of 4) without overlapped steps, then with; each
    closed when the loop moves on or leaves."""
    for overlap in (False, True):
        engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, num_kv_blocks=num_kv_blocks,
                                        max_model_len=max_model_len, overlap=overlap))
        try:
            yield overlap, engine
        finally:
            engine.close()


def test_overlapped_step_past_max_tokens_takes_no_block_and_preempts_no_one():
    """With overlapped steps (a GPU's default) the scheduler ran a request once more after the step that samples its
    last token (max_tokens reached, whatever that token is): a's ninth token's KV, which no one reads, needed a third
    block of the ten that a (2) and b (8) filled, and b was preempted and recomputed for it. vLLM's async scheduling
    skips such a request; the synchronous engine never ran that step."""
    results = {}
    for overlap, engine in _both_ways():
        engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_new_tokens=5, ignore_eos=True))
        engine.add_request("b", list(range(10, 34)), SamplingParams(max_new_tokens=8, ignore_eos=True))
        outs = _drain(engine)
        s = engine.stats()
        results[overlap] = outs
        assert s["num_preemptions"] == 0, overlap
        assert s["kv_blocks_used"] == 0 and all(b.ref_count == 0 for b in engine.block_manager.blocks)
        assert len(outs["a"]) == 5 and len(outs["b"]) == 8
    assert results[True] == results[False]


def test_overlapped_request_at_its_last_token_frees_its_blocks_for_the_next_schedule():
    """With overlapped steps a request whose launched step samples its last token held its blocks through the next
    schedule (its completion comes after it): b, younger, needed a ninth block of the ten that a's two and b's eight
    filled and was preempted (recomputing 33 tokens), where the synchronous engine had freed a's blocks already."""
    results = {}
    for overlap, engine in _both_ways():
        engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_new_tokens=5, ignore_eos=True))
        engine.add_request("b", list(range(10, 38)), SamplingParams(max_new_tokens=8, ignore_eos=True))
        results[overlap] = _drain(engine)
        assert engine.stats()["num_preemptions"] == 0, overlap
        assert engine.stats()["kv_blocks_used"] == 0
    assert results[True] == results[False]


def test_overlapped_request_freed_at_its_last_token_still_leaves_its_prompt_in_the_prefix_cache():
    """The blocks freed before the completion that ends a request are registered first: a one-token request's
    prompt, computed by the step that samples its only token, is found by the next request of that prompt."""
    for overlap, engine in _both_ways():
        prompt = list(range(20, 29))
        engine.add_request("x", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        engine.add_request("y", [3, 4], SamplingParams(max_new_tokens=4, ignore_eos=True))  # keeps steps going
        _drain(engine)
        engine.add_request("z", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        cached = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    cached = o.num_cached_tokens
        assert cached == 8, overlap
        s = engine.stats()
        assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (9 + 2 + 9, 8)
        assert s["kv_blocks_used"] == 0 and all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_overlapped_request_at_its_last_token_is_never_the_one_preempted():
    """a and c each need a third block in the step after b (the youngest) sampled its last token; b's block, freed
    at that schedule, goes to a, and c is preempted (as in the synchronous engine). b, whose blocks were already
    freed, was preempted first for nothing (two preemptions counted, b's own among them)."""
    results = {}
    for overlap, engine in _both_ways(num_kv_blocks=5, max_model_len=20):
        engine.add_request("a", [5, 6, 7, 8, 9, 10, 11], SamplingParams(max_new_tokens=5, ignore_eos=True))
        engine.add_request("c", [15, 16, 17, 18, 19, 20, 21], SamplingParams(max_new_tokens=5, ignore_eos=True))
        engine.add_request("b", [30, 31], SamplingParams(max_new_tokens=2, ignore_eos=True))
        results[overlap] = _drain(engine)
        assert engine.stats()["num_preemptions"] == 1, overlap
        assert engine.stats()["kv_blocks_used"] == 0
    assert results[True] == results[False]
