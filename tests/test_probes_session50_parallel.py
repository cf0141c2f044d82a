"""Data parallelism, the fiftieth session's probes: the restart limit as an option (--max-replica-restarts, the
pool's and the server engine's max_restarts), a deadline for Ray to place a replica (--replica-placement-timeout),
a fresh replica that waits for its predecessor's process to be gone before it loads the model. Replicas are stand-ins
or real engines in this process behind tests/fakeray.py."""

from __future__ import annotations

import pytest

from infer.engine.sampling_params import SamplingParams
from infer.parallel.pool import ReplicaPool, Work
from infer.parallel.runtime import ReplicaError

from fakeray import FakeRay, Handle

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


class _DiesAtStep(FakeRay):
    """Every replica dies at its first step call."""

    def before(self, ref):
        if ref.method in ("step", "serve_step"):
            ref.handle.alive = False


class _Stub:
    def info(self) -> dict:
        return {"error": None, "host": "h", "pid": 0}


@pytest.mark.parametrize("limit", [0, 1])
def test_the_pool_replaces_a_replica_max_restarts_times(limit):
    """The restart limit was the module constant MAX_RESTARTS (2): now the pool's max_restarts (the CLI's
    --max-replica-restarts), 0 turning restarts off."""
    made, notes = [], []

    def restart(index: int) -> Handle:
        made.append(index)
        return Handle(_Stub())

    pool = ReplicaPool(_DiesAtStep(), [Handle(_Stub())], capacity=2, notify=notes.append, restart=restart,
                       max_restarts=limit)
    with pytest.raises(ReplicaError):
        pool.run([Work("r0", 1, [5, 6], PARAMS, None)], lambda *a: None, lambda *a: None)
    assert made == [0] * limit and pool.restarted == limit
    if limit:
        assert any(f"restart {limit} of {limit}" in n for n in notes), notes


def test_the_server_engine_replaces_a_replica_max_restarts_times():
    from infer.parallel.serve_engine import RayAsyncEngine, _Replica
    for limit in (0, 1):
        r = _Replica(0, Handle(_Stub()), {}, alive=False)
        engine = RayAsyncEngine.__new__(RayAsyncEngine)
        engine.ray, engine.replicas, engine._starting = FakeRay(), [r], {}
        engine._restart, engine.max_restarts = lambda index: Handle(_Stub()), limit
        engine._replace(r)
        assert r.starting == bool(limit) and r.restarts == limit


# ------------------------------------------------------------------ a replica Ray never places

def _config():
    from infer.engine.config import EngineConfig
    return EngineConfig("tiny-llama", max_model_len=128, max_num_seqs=3, memory_limit=2 ** 29)


@pytest.fixture(scope="module")
def engines():
    from infer.parallel.replica import Replica
    return [Replica(_config()) for _ in range(2)]


class _KillFirst(FakeRay):
    """The actor of the handle marked `first` dies at its first step call that brings requests."""

    def before(self, ref):
        if ref.method in ("step", "serve_step") and vars(ref.handle).get("first") and ref.args and ref.args[0]:
            ref.handle.alive = False


def _never_placed(made: list):
    def restart(index: int) -> Handle:
        made.append(index)
        return Handle(_Stub(), pending=True)  # no node has room: Ray keeps it pending
    return restart


def _work(n: int = 6) -> list[Work]:
    return [Work(f"r{i}", i + 1, [5 + i, 17, 99, 230 + i], PARAMS, None) for i in range(n)]


def test_run_stops_waiting_for_a_fresh_replica_ray_never_places():
    """The only replica stopped and its fresh one was never placed (no node had the GPU it asked for): `infer run`
    waited for it for ever. Now it counts as failed after placement_timeout, with what to do."""
    made, notes = [], []
    pool = ReplicaPool(_KillFirst(), [Handle(_Stub(), first=True)], capacity=2, notify=notes.append,
                       restart=_never_placed(made), max_restarts=1, placement_timeout=0.05)
    pool.resources = "1 GPU and 1 CPU"
    with pytest.raises(ReplicaError):
        pool.run(_work(2), lambda *a: None, lambda *a: None)
    assert made == [0] and not pool._starting
    note = next(n for n in notes if "not placed" in n)
    assert "the fresh replica 0 was not placed by Ray within 0.05 s" in note and "1 GPU and 1 CPU" in note, note
    assert "it stays stopped" in note and "--replica-placement-timeout" in note and "--ray-address" in note, note


def test_run_completes_on_the_other_replica_while_a_fresh_one_is_never_placed(engines):
    made, notes, done = [], [], []
    handles = [Handle(engines[0], first=True), Handle(engines[1])]
    pool = ReplicaPool(_KillFirst(), handles, capacity=3, notify=notes.append, restart=_never_placed(made),
                       placement_timeout=0.0)
    pool.run(_work(), lambda w, out, i: done.append((w.id, i)), lambda w, reason: pytest.fail(reason))
    assert sorted(d[0] for d in done) == [f"r{i}" for i in range(6)] and {d[1] for d in done} == {1}
    assert len(made) <= 2 and not pool._starting and not pool.replicas[0].alive


def test_start_replicas_fails_when_ray_does_not_place_every_replica(monkeypatch):
    """At the start too: one replica with no room on the cluster kept `infer run` and `infer serve` waiting."""
    import torch

    from infer.models.resolve import resolve_model
    from infer.parallel.runtime import start_replicas

    class Ray(FakeRay):
        def remote(self, cls):
            actor, made = super().remote(cls), []

            class Pending:
                def options(self, **_):
                    return self

                def remote(self, *args):
                    made.append(actor.remote(*args))
                    made[-1].pending = len(made) > 1  # the second one is never placed
                    return made[-1]
            return Pending()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    ray = Ray()
    with pytest.raises(ReplicaError) as e:
        start_replicas(ray, _config(), resolve_model("tiny-llama"), 2, threads=1, placement_timeout=0.05)
    assert "engine replica(s) 1 of 2 were not placed by Ray within 0.05 s" in e.value.message, e.value.message
    assert "1 CPU(s) free" in e.value.message and "--replica-placement-timeout" in e.value.hint


def test_serve_keeps_serving_when_a_fresh_replica_is_never_placed(engines):
    """`infer serve`: the fresh replica stayed 'restarting' for ever. Now it counts as failed after the deadline;
    /health's replicas say why, and the other replica serves."""
    import time

    from infer.parallel.serve_engine import RayAsyncEngine, ReplicaView
    from test_probes_session43_poison import _serve

    made = []
    view = ReplicaView(engines[0].engine.config, engines[0].engine.model_path, engines[0].engine.tokenizer,
                       engines[0].info())
    handles = [Handle(engines[0], first=True), Handle(engines[1])]
    aengine = RayAsyncEngine(_KillFirst(), handles, [r.info() for r in engines], view,
                             restart=_never_placed(made), max_restarts=1, placement_timeout=0.05)
    aengine.start()
    try:
        outs = _serve(aengine, _work())
        deadline = time.monotonic() + 30
        while (not made or aengine.stats["replicas_restarting"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = aengine.stats
        assert made == [0] and stats["replicas_restarting"] == 0 and stats["num_replicas_alive"] == 1
        first = stats["replicas"][0]
        assert not first["alive"] and "not placed by Ray within 0.05 s" in first["error"], first
        assert stats["replicas"][1]["error"] is None
        for o in outs.values():
            assert o.finish_reason == "length" or "stopped while this request ran" in o.error
        later = _serve(aengine, [Work("after", 1, [5, 6, 7], PARAMS, None)])
        assert later["after"].finish_reason == "length"
    finally:
        aengine.shutdown(timeout=5)
