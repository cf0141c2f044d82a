"""Probes of what operators read while serving (session 52): /metrics, /health and `infer bench --url`'s use of
them, against what a scripted run actually did."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from infer.bench.datasets import BenchRequest  # noqa: E402
from infer.bench.http_driver import run_http, server_stats  # noqa: E402
from infer.bench.report import spec_decode_figures  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def spec_engine():
    return LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                  speculative_config=SPEC))


def _requests(n: int = 2) -> list[BenchRequest]:
    """Prompts that repeat a phrase: tiny-llama's greedy output then repeats itself too, so drafts are made."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    return [BenchRequest("Repeat: " + " ".join([" ".join(words[i:i + 5]) + "."] * 6), None, 16, ignore_eos=True)
            for i in range(n)]


def test_a_url_runs_speculative_figures_are_its_own_not_the_servers_since_it_started(spec_engine):
    """`infer bench --url` read the server's counters once, at the end of each level: a level's acceptance rate
    and length were those of every request the server ran since it started (a warm-up, the levels before)."""
    with serve_in_thread(Server(AsyncEngine(spec_engine), "tiny")) as base:
        run_http(base, "tiny", _requests(), concurrency=2, progress=False)  # a level before
        before = server_stats(base)
        run = run_http(base, "tiny", _requests(3), concurrency=3, progress=False)
        after = server_stats(base)
    stats = run.engine_stats
    assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"] > 0
    for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
              "num_steps"):
        assert stats[f"run_{k}"] == after[k] - before[k], k
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    tokens = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert spec_decode_figures(stats) == pytest.approx({"spec_decode_acceptance_rate": accepted / tokens,
                                                        "spec_decode_mean_acceptance_length": 1 + accepted / drafts})


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=64))


def test_server_stats_go_to_the_server_as_the_runs_requests_do_not_through_a_proxy(engine, monkeypatch):
    """The run's requests and its /reset_prefix_cache ignore HTTP_PROXY (trust_env=False); its /health read went
    through the proxy, so with one set (a dead one here) the level's engine figures were silently empty."""
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as base:
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        run = run_http(base, "tiny", [BenchRequest(None, [5, 6, 7], 3, ignore_eos=True)], concurrency=1,
                       progress=False)
        assert run.records[0].success
        assert run.engine_stats.get("num_steps", 0) > 0
        assert server_stats(base)["num_steps"] == engine.stats()["num_steps"]


def test_a_merged_n_requests_timings_are_the_groups_not_sample_zeros():
    """LLM.generate(n > 1) merges the samples into one RequestOutput: its metrics' last_token_time was sample 0's,
    earlier than its finished_time by the whole time the other samples kept going (decode time read from it was
    short), and its first token / first scheduled times sample 0's, not the group's first (vLLM's group times)."""
    from infer.engine.outputs import RequestOutput

    def sample(first_scheduled, times, finished):
        return RequestOutput("r", [1, 2, 3], [7] * len(times), text="x", finished=True, finish_reason="length",
                             arrival_time=1.0, first_scheduled_time=first_scheduled, first_token_time=times[0],
                             token_times=times, finished_time=finished)
    early = sample(2.0, [3.0, 3.5], 3.6)  # stopped after two tokens
    late = sample(1.5, [2.5, 4.0, 6.0, 8.0], 8.1)
    m = RequestOutput.merged([early, late]).metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time) == (1.0, 1.5, 2.5)
    assert (m.last_token_time, m.finished_time, m.time_in_queue) == (8.0, 8.1, 0.5)
    assert RequestOutput.merged([early]).metrics.last_token_time == 3.5  # one sample: its own


def test_a_data_parallel_servers_prefix_cache_hit_rate_weighs_each_replica_by_its_lookups():
    """/health's prefix_cache_hit_rate with --data-parallel was the mean of the replicas' rates: a replica that looked
    up 8 tokens and found none halved the rate of one that found 900 of 1000. As one engine's: hits over queries."""
    from types import SimpleNamespace

    from infer.parallel.serve_engine import RayAsyncEngine, _Replica

    def stats(queries, hits):
        return {"num_running": 0, "num_waiting": 0, "kv_blocks_total": 10, "kv_blocks_used": 0, "kv_usage": 0.0,
                "num_preemptions": 0, "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0}
    replicas = [_Replica(0, None, {}, stats=stats(1000, 900)), _Replica(1, None, {}, stats=stats(8, 0))]
    total = RayAsyncEngine._aggregate(SimpleNamespace(replicas=replicas))
    assert (total["prefix_cache_queries"], total["prefix_cache_hits"]) == (1008, 900)
    assert total["prefix_cache_hit_rate"] == pytest.approx(900 / 1008)
    idle = RayAsyncEngine._aggregate(SimpleNamespace(replicas=[_Replica(0, None, {}, stats=stats(0, 0))]))
    assert idle["prefix_cache_hit_rate"] == 0.0


def test_the_stats_snapshot_a_client_reads_after_its_last_token_includes_the_step_that_made_it(engine):
    """The engine thread handed a step's outputs to the server, then took the stats snapshot /health and /metrics
    read: a client that got its last token and at once read /metrics could see its request still running and the
    step's counters (steps, preemptions, cache hits, drafts) not yet counted."""
    aengine = AsyncEngine(engine)
    seen = []
    deliver = aengine._deliver

    def spy(out):
        if out.finished:  # what a reader would see the moment the server has this output
            seen.append(dict(aengine.stats))
        deliver(out)
    aengine._deliver = spy
    with serve_in_thread(Server(aengine, "tiny")) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
    assert len(seen) == 1
    assert seen[0]["num_running"] == 0 and seen[0]["kv_blocks_used"] == 0
    assert seen[0]["num_steps"] == engine.stats()["num_steps"]
