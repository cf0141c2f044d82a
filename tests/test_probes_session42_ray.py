"""Session 42 probes of the data-parallel paths under failure (Ray replicas killed, driver stopped)."""

from types import SimpleNamespace

from infer.parallel.serve_engine import RayAsyncEngine, _Replica


def _stats(**kw) -> dict:
    return {"num_running": 1, "num_waiting": 0, "kv_blocks_total": 10, "kv_blocks_used": 2, "num_preemptions": 0,
            "lora_swaps": 0, "num_steps": 0, "cuda_graph_replays": 0, "piecewise_graph_steps": 0,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, **kw}


def test_a_dead_replicas_counts_stay_in_the_servers_counters():
    """/metrics' infer:num_preemptions_total and prefix_cache_*_total are counters: a replica that dies must not
    take its share out of them (Prometheus reads a counter that goes down as a reset), while the gauges (running,
    KV blocks) count only the live replicas."""
    replicas = [_Replica(0, None, {}, stats=_stats(num_preemptions=3, prefix_cache_queries=40, prefix_cache_hits=8,
                                                   num_steps=100)),
                _Replica(1, None, {}, stats=_stats(num_preemptions=2, prefix_cache_queries=10, prefix_cache_hits=1,
                                                   num_steps=50))]
    engine = SimpleNamespace(replicas=replicas)
    before = RayAsyncEngine._aggregate(engine)
    replicas[0].alive = False
    after = RayAsyncEngine._aggregate(engine)
    for key in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_steps"):
        assert after[key] == before[key], key
    assert (after["num_running"], after["kv_blocks_total"], after["num_replicas_alive"]) == (1, 10, 1)
