"""Probes of automatic prefix caching (session 53): outputs with the cache on equal those with it off, and the
figures that say how often it hit are the hits that really happened."""

from __future__ import annotations

import pytest


def test_a_url_runs_prefix_cache_hit_rate_is_its_own_not_the_servers_since_it_started():
    """`infer bench --url` read the server's prefix_cache_hit_rate at the end of each level: the rate of every
    request the server had run since it started (the levels before, a warm-up), as the server's counters go on
    over POST /reset_prefix_cache; an in-process level's rate is its own (the engine's counters are reset)."""
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.bench.datasets import BenchRequest
    from infer.bench.http_driver import reset_prefix_cache, run_http
    from infer.bench.report import run_entry
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine

    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=64))
    prompt = list(range(5, 45))  # 40 tokens: a repeat finds 36 of them cached
    reqs = [BenchRequest(None, prompt, 4, ignore_eos=True) for _ in range(3)]
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as base:
        first = run_http(base, "tiny", reqs, concurrency=1, progress=False)
        assert reset_prefix_cache(base)
        second = run_http(base, "tiny", reqs[:1], concurrency=1, progress=False)  # cold: nothing cached
    assert run_entry(first)["prefix_cache_hit_rate"] == pytest.approx(72 / 120)
    assert run_entry(second)["prefix_cache_hit_rate"] == 0.0
    assert second.engine_stats["run_prefix_cache_queries"] == 40
    assert second.engine_stats["run_prefix_cache_hits"] == 0
