"""Session 42 probes of the data-parallel paths under failure (Ray replicas killed, driver stopped)."""

from types import SimpleNamespace

from infer.parallel.serve_engine import RayAsyncEngine, _Replica

from fakeray import FakeRay, Handle


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


class _Checks:
    """A replica's `validate`: every first line of a call is refused."""

    def validate(self, wires):
        return {wires[0][0]: "top_p must be in (0, 1], got 2.0"}


class _Ray(FakeRay):
    """Notes the handle of each call (`seen`)."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def before(self, ref):
        self.seen.append(ref.handle)


def _handle(dead: bool) -> Handle:
    handle = Handle(_Checks())
    handle.alive = not dead
    return handle


def _item(rid: str, line_no: int):
    request = SimpleNamespace(prompt_token_ids=[1, 2], params=None, lora=None)
    return SimpleNamespace(id=rid, line_no=line_no, request=request, error=None)


def test_a_replica_that_dies_while_lines_are_checked_leaves_the_checks_to_another():
    """`infer run --data-parallel 2` checks every line on replica 0 before generating: a replica 0 that dies then
    (OOM-killed, its node lost) was a Python traceback; the other replica checks the lines and the run goes on."""
    from infer.cli.run_parallel import _check_lines
    from infer.parallel.runtime import ReplicaError
    seen = []
    dead, live = _handle(True), _handle(False)
    lines = [_item("a", 1), _item("b", 2)]
    _check_lines(_Ray(seen), [dead, live], lines, strict=False)
    assert seen == [dead, live]
    assert lines[0].request is None and lines[0].error == "line 1: top_p must be in (0, 1], got 2.0"
    assert lines[1].request is not None
    try:
        _check_lines(_Ray([]), [_handle(True), _handle(True)], [_item("c", 1)], strict=False)
    except ReplicaError as e:
        assert "every engine replica has stopped" in e.message
    else:
        raise AssertionError("no error when every replica died")
