"""Session 43 probes: the scheduler under KV pressure (few blocks, preemption by recompute, chunked prefill).

Outputs must not depend on batch composition or preemption, and the counters must say what vLLM's say."""

from __future__ import annotations

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams

PROMPTS = [[10 + i] * 6 for i in range(4)]  # no shared first block: nothing for the prefix cache to find


def _run(engine: LLMEngine, prompts, params: SamplingParams) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tight():
    """Ten blocks of 4 tokens for four requests of 6 + 14 tokens (5 blocks each): they preempt one another."""
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, num_kv_blocks=10, max_model_len=40))
    yield engine
    engine.close()


def test_preempted_recompute_is_not_a_prefix_cache_hit(tight):
    """vLLM counts a preempted request's re-admission apart (PrefixCacheStats.preempted_*) and sets a request's
    num_cached_tokens at its first scheduling only; here the recompute, which finds the request's own prompt and
    reply blocks in the cache, was counted as queries and hits (a hit rate of ~40% for prompts that share nothing)
    and became its num_cached_tokens (more than its prompt's tokens)."""
    tight.reset_prefix_cache()
    q0, h0, p0 = (tight.stats()[k] for k in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"))
    outs = _run(tight, PROMPTS, SamplingParams(max_new_tokens=14, ignore_eos=True))
    s = tight.stats()
    assert s["num_preemptions"] > p0  # the point of the setup
    assert s["prefix_cache_queries"] - q0 == sum(len(p) for p in PROMPTS)
    assert s["prefix_cache_hits"] - h0 == 0
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]
    assert s["kv_blocks_used"] == 0 and tight.get_num_unfinished_requests() == 0


def test_no_prefix_cache_queries_without_a_lookup():
    """vLLM's get_computed_blocks records no query with prefix caching off, nor for a request that skips the cache
    (prompt_logprobs); here every admission was a query, so /metrics' infer:prefix_cache_queries_total grew on an
    engine started with --no-prefix-caching."""
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_model_len=40, enable_prefix_caching=False))
    try:
        _run(engine, PROMPTS[:2], SamplingParams(max_new_tokens=2))
        assert (engine.stats()["prefix_cache_queries"], engine.stats()["prefix_cache_hits"]) == (0, 0)
    finally:
        engine.close()


def test_prompt_logprobs_request_is_no_prefix_cache_query(tight):
    tight.reset_prefix_cache()
    q0 = tight.stats()["prefix_cache_queries"]
    _run(tight, PROMPTS[:1], SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    assert tight.stats()["prefix_cache_queries"] == q0
    _run(tight, PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert tight.stats()["prefix_cache_queries"] == q0 + len(PROMPTS[0])


@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_num_kv_blocks_error_names_the_keyword(value):
    """num_kv_blocks (vLLM's num_gpu_blocks_override) is API only: its error named a flag no command takes,
    '--num-kv-blocks must be at least 1' (infer run says no such option)."""
    from infer.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        EngineConfig("tiny-llama", num_kv_blocks=value)
    assert "num_kv_blocks must be" in str(e.value) and "--num-kv-blocks" not in str(e.value)


@pytest.mark.parametrize("keyword, value, hint", [
    ("num_gpu_blocks_override", 8, "num_kv_blocks=N"), ("preemption_mode", "swap", "recomputing"),
    ("kv_cache_memory_bytes", 2 ** 20, "num_kv_blocks"),
    ("max_num_partial_prefills", 2, "max_num_batched_tokens")])
def test_vllm_scheduler_keywords_say_what_to_do(keyword, value, hint):
    """vLLM's scheduler and KV-cache keywords of LLM(): the command line names what to do for each
    (cli/vllm_flags); LLM() listed its 30 options instead (num_gpu_blocks_override: a guess)."""
    from infer import LLM
    from infer.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        LLM("tiny-llama", **{keyword: value})
    assert "vLLM's keyword" in str(e.value) and hint in str(e.value)
