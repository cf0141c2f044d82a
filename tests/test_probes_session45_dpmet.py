"""Session 45 probes: per-engine /metrics under data parallelism, and O(1) aborts of waiting fcfs requests."""

from __future__ import annotations

import random
from collections import deque

import pytest

from helpers import metric_families, samples_by_engine
from infer.engine.sampling_params import SamplingParams


class _CountingDeque(deque):
    """A deque that counts the elements its Python-visible scans could visit (`in`, remove, iteration)."""

    visits = 0

    def __contains__(self, x):
        _CountingDeque.visits += len(self)
        return super().__contains__(x)

    def remove(self, x):
        _CountingDeque.visits += len(self)
        return super().remove(x)

    def __iter__(self):
        _CountingDeque.visits += len(self)
        return super().__iter__()


def test_fcfs_abort_of_waiting_requests_does_not_scan_the_queue(monkeypatch):
    """fcfs: aborting a waiting request removed it from a deque by scanning it (`in`, then remove): aborting n waiting
    requests one by one took O(n^2). Now it is marked and skipped when it reaches the front: O(1) amortized, with the
    queue order, len() (stats' num_waiting), `in`, the front and preemption's appendleft exact."""
    import infer.engine.scheduler as scheduler_module
    from infer.engine.config import EngineConfig
    from infer.engine.scheduler import Scheduler
    from infer.engine.sequence import Sequence
    monkeypatch.setattr(scheduler_module, "deque", _CountingDeque)
    sched = Scheduler(EngineConfig("tiny-llama"), block_manager=None)
    params = SamplingParams()
    seqs = [Sequence(str(i), [1, 2, 3], params) for i in range(4096)]
    for seq in seqs:
        sched.add(seq)
    rng = random.Random(0)
    gone = rng.sample(seqs, 3000)
    _CountingDeque.visits = 0
    for seq in gone:
        sched.finish(seq, "abort")
    assert _CountingDeque.visits < 3000 * 8, f"{_CountingDeque.visits / 3000:.0f} queue elements visited per abort"
    gone_ids = {id(s) for s in gone}
    want = [s for s in seqs if id(s) not in gone_ids]
    assert len(sched.waiting) == len(want) and all(s not in sched.waiting for s in gone)
    assert all(s in sched.waiting for s in want) and list(sched.waiting) == want and sched.waiting[0] is want[0]
    first = sched.waiting.popleft()
    sched.waiting.appendleft(first)  # (a preempted request goes back at the front)
    sched.finish(want[1], "abort")  # the second, then the first: the next front is the third
    sched.finish(want[0], "abort")
    assert sched.waiting[0] is want[2] and len(sched.waiting) == len(want) - 2
    assert [sched.waiting.popleft() for _ in range(len(want) - 2)] == want[2:]
    assert not sched.waiting and not sched.has_unfinished()
    try:
        sched.waiting.popleft()
    except IndexError:
        pass
    else:
        raise AssertionError("popleft from an empty queue did not raise")


# -------------------------------------------------------------------------------------------------- data parallel


def _dp_server():
    """Two in-process tiny-llama replicas behind the fake ray (tests/fakeray.py), their RayAsyncEngine and a Server
    over it."""
    from fakeray import FakeRay, Handle
    from infer.engine.config import EngineConfig
    from infer.parallel.replica import Replica
    from infer.parallel.serve_engine import RayAsyncEngine, ReplicaView
    from infer.serve.app import Server
    cfg = EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=4, memory_limit=2 ** 29)
    replicas = [Replica(cfg) for _ in range(2)]
    engine = replicas[0].engine
    view = ReplicaView(engine.config, engine.model_path, engine.tokenizer, replicas[0].info())
    aengine = RayAsyncEngine(FakeRay(), [Handle(r) for r in replicas], [r.info() for r in replicas], view)
    server = Server(aengine, "tiny-llama")
    return replicas, aengine, server


def test_data_parallel_metrics_have_a_series_per_engine_as_vllms():
    """vLLM labels every engine series of a data-parallel server with its engine's index (engine="0", "1", ...);
    infer summed the replicas into engine="0", so a dashboard built for vLLM could not tell a stuck or hot replica
    from the others. Each replica now has its own series: the gauges and counters of its stats, the request counters
    and histograms of the requests it ran, and its steps' tokens; /health and the replica_* gauges stay as they were."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.parallel.serve import ReplicaCollector
    from infer.serve.app import create_app
    replicas, aengine, server = _dp_server()
    server.metrics.registry.register(ReplicaCollector(aengine))
    prompts = [[5, 17, 99], [6, 17, 99, 230], [7, 8], [9, 10, 11, 12, 13]]
    with TestClient(create_app(server)) as client:
        before = metric_families(client.get("/metrics").text)
        # both engines' series are there from the start, as vLLM's
        zero = {"0": 0.0, "1": 0.0}
        assert samples_by_engine(before, "infer:request_success_total", finished_reason="length") == zero
        assert samples_by_engine(before, "infer:num_requests_running") == {"0": 0.0, "1": 0.0}
        r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3, "ignore_eos": True,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        samples = metric_families(client.get("/metrics").text)
        health = client.get("/health").json()
    # the driver sends each new request to the replica with the fewest in flight: two each
    done = samples_by_engine(samples, "infer:request_success_total", finished_reason="length")
    assert done == {"0": 2.0, "1": 2.0}, done
    prompt_tokens = samples_by_engine(samples, "infer:prompt_tokens_total")
    assert set(prompt_tokens) == {"0", "1"} and sum(prompt_tokens.values()) == sum(map(len, prompts))
    assert all(v > 0 for v in prompt_tokens.values()), prompt_tokens
    assert samples_by_engine(samples, "infer:generation_tokens_total") == {"0": 6.0, "1": 6.0}
    assert samples_by_engine(samples, "infer:e2e_request_latency_seconds_count") == {"0": 2.0, "1": 2.0}
    assert samples_by_engine(samples, "infer:request_prompt_tokens_sum") == prompt_tokens
    steps = samples_by_engine(samples, "infer:iteration_tokens_total_sum")
    # each engine's steps computed its prompts and fed back all but the last token of each request
    assert steps == {k: v + 2 * 2 for k, v in prompt_tokens.items()}, steps
    blocks = samples_by_engine(samples, "infer:kv_cache_blocks_total")
    assert blocks == {str(i): float(r.engine.block_manager.num_blocks) for i, r in enumerate(replicas)}, blocks
    assert samples_by_engine(samples, "infer:num_requests_running") == {"0": 0.0, "1": 0.0}
    for name in ("infer:num_preemptions_total", "infer:prefix_cache_queries_total", "infer:kv_cache_usage_perc"):
        assert set(samples_by_engine(samples, name)) == {"0", "1"}, name
    assert samples[("infer:replica_up", (("replica", "1"),))] == 1.0
    assert "engines" not in health["engine"] and len(health["engine"]["replicas"]) == 2


def test_a_dead_replicas_engine_series_keep_its_counters_and_zero_its_gauges():
    """A replica that died keeps its counters in its own series (Prometheus reads a counter going down as a reset)
    and shows nothing running or held."""
    from types import SimpleNamespace

    from infer.parallel.serve_engine import RayAsyncEngine, _Replica
    from infer.serve.metrics import ServerMetrics

    def stats(**kw):
        return {"num_running": 2, "num_waiting": 1, "kv_blocks_total": 10, "kv_blocks_used": 4, "kv_usage": 0.4,
                "num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0, **kw}
    replicas = [_Replica(0, None, {}, stats=stats(num_preemptions=1)),
                _Replica(1, None, {}, stats=stats(num_preemptions=5, prefix_cache_hits=7))]
    replicas[1].alive = False
    total = RayAsyncEngine._aggregate(SimpleNamespace(replicas=replicas))
    samples = metric_families(ServerMetrics(lambda: total, 64, "m", engines=2).render().decode())
    assert samples_by_engine(samples, "infer:num_preemptions_total") == {"0": 1.0, "1": 5.0}
    assert samples_by_engine(samples, "infer:prefix_cache_hits_total") == {"0": 0.0, "1": 7.0}
    assert samples_by_engine(samples, "infer:num_requests_running") == {"0": 2.0, "1": 0.0}
    assert samples_by_engine(samples, "infer:kv_cache_usage_perc") == {"0": 0.4, "1": 0.0}
    assert samples_by_engine(samples, "infer:kv_cache_blocks_total") == {"0": 10.0, "1": 0.0}


def test_a_request_its_client_left_is_counted_as_an_abort_on_the_engine_that_ran_it():
    """The server counts an abort for each request whose client went away: with data-parallel replicas, on the
    replica that ran it (engine="i"), not all on engine "0"."""
    import asyncio

    replicas, aengine, server = _dp_server()
    aengine.start()

    async def main():
        queue, params = asyncio.Queue(), SamplingParams(max_new_tokens=40, ignore_eos=True)
        aengine.add("x0", [5, 6], params, None, queue)
        aengine.add("x1", [5, 6, 7], params, None, queue)
        outputs = server.outputs(queue, ["x0", "x1"], None, 0.0)
        seen = 0
        async for _ in outputs:
            seen += 1
            if seen == 4:  # both have started on their replicas; then the client goes away
                break
        await outputs.aclose()
        for _ in range(1000):  # the driver sends the aborts to the replicas, which free the requests
            if not any(r.engine.requests for r in replicas):
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown(timeout=5)
    samples = metric_families(server.metrics.render().decode())
    assert samples_by_engine(samples, "infer:request_success_total", finished_reason="abort") == {"0": 1.0, "1": 1.0}
    assert [len(r.engine.requests) for r in replicas] == [0, 0]
