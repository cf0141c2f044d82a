"""LLMEngine.stats() (what `/health`, the bench timeline and the progress figures read) against counts worked out
by hand from the scheduler's rules: who waits and who runs at each step, the KV blocks they hold, the step count,
and the prefix cache's hit rate (cached prompt tokens / prompt tokens looked up)."""

from __future__ import annotations

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams

from helpers import random_prompts


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=128, block_size=16, max_num_seqs=2,
                                  enable_prefix_caching=True))


def _run(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_stats_follow_the_schedule(engine):
    engine.block_manager.reset_prefix_cache()
    steps0 = engine.stats()["num_steps"]
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for i, p in enumerate(random_prompts(vocab, (20, 20, 20), seed=3)):
        engine.add_request(f"s{i}", p, params)
    s = engine.stats()
    assert (s["num_waiting"], s["num_running"], s["kv_blocks_used"], s["num_steps"] - steps0) == (3, 0, 0, 0)
    engine.step()  # s0 and s1 start (max_num_seqs=2): 20 prompt tokens + 1 sampled = 2 blocks of 16 each
    s = engine.stats()
    assert (s["num_waiting"], s["num_running"], s["kv_blocks_used"], s["num_steps"] - steps0) == (1, 2, 4, 1)
    assert s["kv_blocks_total"] == engine.block_manager.num_blocks
    assert s["kv_usage"] == pytest.approx(4 / s["kv_blocks_total"])
    done = _run(engine)
    # s0, s1: steps 1-3 (prefill + 2 decodes), s2 waits for a free seat: steps 4-6
    s = engine.stats()
    assert sorted(done) == ["s0", "s1", "s2"] and all(len(o.token_ids) == 3 for o in done.values())
    assert (s["num_waiting"], s["num_running"], s["kv_blocks_used"], s["num_steps"] - steps0) == (0, 0, 0, 6)
    assert s["num_preemptions"] == 0 and s["lora_swaps"] == 0 and s["cuda_graph_replays"] == 0


def test_prefix_cache_hit_rate_counts_cached_prompt_tokens(engine):
    engine.block_manager.reset_prefix_cache()
    assert engine.stats()["prefix_cache_hit_rate"] == 0.0
    prompt = random_prompts(engine.model_config.vocab_size, (40,), seed=5)[0]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.add_request("p1", prompt, params)
    first = _run(engine)["p1"]
    assert engine.stats()["prefix_cache_hit_rate"] == 0.0 and first.num_cached_tokens == 0
    engine.add_request("p2", prompt, params)
    second = _run(engine)["p2"]
    # 40 tokens: the two full blocks (32 tokens) are found, the last 8 are computed; 32 of 80 looked up
    assert second.num_cached_tokens == 32
    assert engine.stats()["prefix_cache_hit_rate"] == pytest.approx(32 / 80)
    assert second.token_ids == first.token_ids  # the cached K/V give the same greedy reply
    changed = [(t + 1) % engine.model_config.vocab_size for t in prompt[20:]]
    engine.add_request("p3", prompt[:20] + changed, params)  # only the first block matches
    third = _run(engine)["p3"]
    assert third.num_cached_tokens == 16
    assert engine.stats()["prefix_cache_hit_rate"] == pytest.approx((32 + 16) / 120)
    assert engine.stats()["kv_blocks_used"] == 0
