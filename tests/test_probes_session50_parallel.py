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


# ------------------------------------------------------------------ a fresh replica waits for its predecessor's process

@pytest.fixture
def predecessor():
    """A process standing in for a stopped replica's actor process that ends late (as a killed actor's process may
    still hold its GPU memory): its `where`, and the process."""
    import socket
    import subprocess
    import sys

    import psutil
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    where = {"host": socket.gethostname(), "pid": child.pid, "started": psutil.Process(child.pid).create_time()}
    yield where, child
    child.kill()
    child.wait()


class _Handles(list):
    """start_replicas' ReplicaHandles as the pool reads them: the handles and each replica's `where`."""

    def __init__(self, handles, wheres):
        super().__init__(handles)
        self.wheres, self.resources = wheres, "1 GPU and 1 CPU"


def test_a_fresh_replica_loads_once_its_predecessors_process_has_ended(predecessor, monkeypatch):
    """On a GPU, the fresh replica could load the model while the process of the one it replaces still held its
    GPU memory (OOM at load). Now the driver hands it the predecessor's `where` and its `load` waits for that
    process to end first (bounded)."""
    import threading

    from infer.engine import llm_engine
    from infer.parallel.replica import Replica
    where, child = predecessor
    real, seen, ended = llm_engine.LLMEngine, [], []

    def engine(config):  # what the fresh replica's load sees: has the predecessor's process been ended?
        seen.append(bool(ended))
        return real(config)
    monkeypatch.setattr(llm_engine, "LLMEngine", engine)

    def end_late():
        ended.append(True)
        child.kill()
        child.wait()
    made, done = [], []

    def restart(index: int) -> Handle:
        made.append(index)
        threading.Timer(0.3, end_late).start()
        return Handle(Replica(_config(), None, False))
    pool = ReplicaPool(_KillFirst(), _Handles([Handle(_Stub(), first=True)], [where]), capacity=3,
                       notify=lambda m: None, restart=restart)
    pool.run(_work(2), lambda w, out, i: done.append(w.id), lambda w, reason: pytest.fail(reason))
    assert made == [0] and sorted(done) == ["r0", "r1"]
    assert seen == [True], "the fresh replica loaded while its predecessor's process ran"


def test_the_wait_for_a_predecessor_is_bounded_and_only_for_this_hosts_process(predecessor):
    import socket

    from infer.parallel.replica import wait_gone
    where, child = predecessor
    assert wait_gone(where, timeout=0.2) is False and child.poll() is None  # (gave up: the fresh one loads)
    assert wait_gone({**where, "host": socket.gethostname() + "-other"}, timeout=30) is True
    assert wait_gone({**where, "started": where["started"] - 100}, timeout=30) is True  # a pid used again
    assert wait_gone(None) is True and wait_gone({}) is True
    child.kill()
    child.wait()
    assert wait_gone(where, timeout=30) is True


def test_the_server_hands_a_fresh_replica_its_predecessors_process():
    from types import SimpleNamespace

    from infer.parallel.serve_engine import RayAsyncEngine, _Replica

    class Fresh(_Stub):
        def __init__(self):
            self.after = "not loaded"

        def where(self):
            return {"host": "h", "pid": 2}

        def load(self, after=None):
            self.after = after
            return self.info()

        def warm_kernels(self):
            pass

        def serve_step(self, new, aborts, holds=()):
            return [], [], {}

    fresh, old = Fresh(), {"host": "h", "pid": 1, "started": 5.0}
    r = _Replica(0, None, {}, alive=False, where=old)
    engine = RayAsyncEngine.__new__(RayAsyncEngine)
    engine.ray, engine.replicas, engine._starting, engine._calls = FakeRay(eager=True), [r], {}, {}
    engine._restart, engine.max_restarts = lambda index: Handle(fresh, engine.ray), 1
    engine.engine = SimpleNamespace(lora_manager=None)
    engine._replace(r)
    while engine._starting:
        ref = next(iter(engine._starting))
        engine._started(ref, *engine._starting.pop(ref))
    assert fresh.after == old and r.alive and r.where == {"host": "h", "pid": 2}


# ------------------------------------------------------------------ restarts racing the server's adapter changes

def test_add_lora_gives_the_adapter_to_a_fresh_replica_in_place_of_one_that_stopped_while_asked():
    """A replica that stopped while add_lora asked it (its call failed: it is left out) and whose fresh replica
    began to serve before the name was offered (its own check did not see the adapter) was skipped: the slot had
    been asked, so the fresh actor served requests naming the adapter without it."""
    import asyncio
    from types import SimpleNamespace

    from infer.parallel.serve_engine import RayAsyncEngine, _Adapters, _Replica
    from test_probes_session49_review2 import _engine, _Fresh

    ray = FakeRay(eager=True)
    stopping, fresh = _Fresh(), _Fresh()
    first = _Replica(0, Handle(stopping, ray), {}, alive=True)

    class Other(_Fresh):
        def add_lora(self, name, path, replace=False):
            super().add_lora(name, path, replace)
            # meanwhile (the driver thread): replica 0 stopped, and its fresh replica began to serve
            first.handle, first.alive = Handle(fresh, ray), True

    def died(ref):
        if ref.handle.replica is stopping and ref.method == "add_lora":
            ref.handle.alive = False
    ray.before = died
    other = _Replica(1, Handle(Other(), ray), {}, alive=True)
    engine = _engine([first, other])
    engine.ray, engine._lora_changes = ray, None
    adapters = _Adapters(["a"], {"a": "/a"})
    engine.engine = SimpleNamespace(lora_slots=lambda: adapters, lora_manager=adapters)
    asyncio.run(RayAsyncEngine.add_lora(engine, "c", "/c"))
    assert adapters.has("c")
    assert ("add_lora", "c", "/c", False) in fresh.calls, "the fresh replica in the stopped one's place lacks it"


def test_an_in_place_reload_skips_a_replica_that_stopped_before_the_driver_sent_it():
    """add_lora(load_inplace) read the live replicas, then the driver thread sent the reload to each one's actor:
    one that had stopped meanwhile had a fresh actor in its place, still loading, and the reload reached that one
    first (no engine yet: the change failed, and the name was no longer served on any replica)."""
    import asyncio
    from types import SimpleNamespace

    from infer.parallel.replica import Replica
    from infer.parallel.serve_engine import RayAsyncEngine, _Adapters, _Replica
    from test_probes_session49_review2 import _engine, _Fresh

    ray = FakeRay(eager=True)
    fresh = Replica(_config(), None, False)  # (loads in its `load` call, not sent yet)
    first = _Replica(0, Handle(_Fresh(), ray), {}, alive=True)
    other = _Replica(1, Handle(_Fresh(), ray), {}, alive=True)
    engine = _engine([first, other])
    engine.ray, engine._lora_changes, engine._carried = ray, None, {}
    adapters = _Adapters(["a"], {"a": "/a"})
    engine.engine = SimpleNamespace(lora_slots=lambda: adapters, lora_manager=adapters)

    async def on_driver_thread(fn):  # meanwhile replica 0 stopped and a fresh actor is starting in its place
        first.alive, first.starting, first.handle = False, True, Handle(fresh, ray)
        return fn(engine)
    engine._call = on_driver_thread
    asyncio.run(RayAsyncEngine.add_lora(engine, "a", "/a2", replace=True))
    assert adapters.path_of("a") == "/a2" and ("add_lora", "a", "/a2", True) in other.handle.replica.calls
