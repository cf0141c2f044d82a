"""Ordering and races of the data-parallel drivers (infer.parallel): ray.wait answers any call that is ready (Ray's
core worker takes them from a hash set), not the oldest, so each driver reads a replica's earlier calls first; fake
Rays (tests/fakeray.py) force the interleavings that real Ray makes only now and then."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fakeray import FakeRay, Handle
from infer.engine.sampling_params import SamplingParams
from infer.parallel.pool import ReplicaPool, Work
from infer.parallel.replica import StepResult
from infer.parallel.runtime import ReplicaError


class _Finishes:
    """A stand-in replica whose step finishes every request it is given at once."""

    def step(self, new, budget_s=0.5):
        return StepResult(finished=[SimpleNamespace(request_id=rid) for rid, *_ in new], tokens=len(new))


class _NewestFirst(FakeRay):
    """An eager fake Ray (each call runs when made, as an actor runs one caller's calls) whose ray.wait answers the
    newest ready call, as Ray may, and whose `dies` maps a handle to the step call (1, 2, ...) its actor dies before."""

    def __init__(self):
        super().__init__(eager=True)
        self.dies, self.steps = {}, {}

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if not self.pending(r)][::-1][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def before(self, ref):
        if ref.method == "step":
            n = self.steps[ref.handle] = self.steps.get(ref.handle, 0) + 1
            if self.dies.get(ref.handle) == n:
                ref.handle.alive = False


def test_run_reads_a_replicas_earlier_call_before_a_later_one_that_failed():
    """Replica 1 dies at once: its request goes back to the queue and to replica 0, beside the call replica 0 already
    runs (two calls queued there); replica 0 dies after answering the first. Read first, the failed second call
    dropped the first one's finished outputs (they ran again, or, as here, none was left to run them)."""
    ray = _NewestFirst()
    handles = [Handle(_Finishes(), ray), Handle(_Finishes(), ray)]
    ray.dies = {handles[0]: 2, handles[1]: 1}
    params = SamplingParams(max_new_tokens=4)
    work = [Work(f"w{i}", i + 1, [5, 17, 99], params, None) for i in range(3)]
    got, notes = [], []
    pool = ReplicaPool(ray, handles, capacity=3, notify=notes.append)
    with pytest.raises(ReplicaError, match="every engine replica has stopped"):
        pool.run(work, lambda w, out, i: got.append((w.id, out.request_id, i)), lambda w, reason: pytest.fail(reason))
    assert got == [("w0", "w0", 0), ("w1", "w1", 0)]
    assert len(notes) == 2 and "its 1 unfinished request(s)" in notes[1]


def test_a_failed_in_place_reload_removes_the_adapter_behind_the_requests_routed_with_it():
    """load_inplace that one replica cannot read removes the name from every replica (the others have no old weights
    left): the removal was sent from the event loop's thread, ahead of a request accepted while the name was served
    and routed to a replica with its step calls queued (not sent yet), which the replica then refused as naming an
    unknown adapter. As remove_lora does, the driver thread sends the routed requests first."""
    import asyncio
    from types import SimpleNamespace

    from infer.errors import LoRAError
    from infer.parallel.serve_engine import DEPTH, RayAsyncEngine, _Adapters, _Replica
    from test_probes_session49_review2 import _engine, _Fresh, _Pending

    ray = FakeRay(eager=True)
    first = _Replica(0, Handle(_Fresh(), ray), {}, alive=True)

    class _Steps(_Fresh):
        def serve_step(self, new, aborts, holds=()):
            self.calls.append(("serve_step", *[w[0] for w in new]))
            return [], [], {}

    class _Loads(_Steps):  # replica 0: it takes the new weights; meanwhile a request naming them is routed to it
        def add_lora(self, name, path, replace=False):
            super().add_lora(name, path, replace)
            request = _Pending("uses-a")
            request.lora = name
            first.new.append(request)
            first.inflight[request.request_id] = request
            first.calls = DEPTH  # (its step calls queued: the request waits for the next)

    class _Cannot(_Steps):
        def add_lora(self, name, path, replace=False):
            super().add_lora(name, path, replace)
            return {"message": f"no adapter_config.json in {path}"}

    first.handle = Handle(_Loads(), ray)
    other = _Replica(1, Handle(_Cannot(), ray), {"host": "h1"}, alive=True)
    engine = _engine([first, other])
    engine.ray, engine._lora_changes, engine._carried = ray, None, {}
    adapters = _Adapters(["a"], {"a": "/a"})
    engine.engine = SimpleNamespace(lora_slots=lambda: adapters, lora_manager=adapters)

    async def on_driver_thread(fn):
        return fn(engine)
    engine._call = on_driver_thread
    with pytest.raises(LoRAError, match="replica 1 .*no adapter_config.json.*'a' is no longer served"):
        asyncio.run(RayAsyncEngine.add_lora(engine, "a", "/a2", replace=True))
    assert not adapters.has("a")
    calls = first.handle.replica.calls
    assert ("serve_step", "uses-a") in calls and ("remove_lora", "a") in calls
    assert calls.index(("serve_step", "uses-a")) < calls.index(("remove_lora", "a")), calls


class _Resets:
    def reset_prefix_cache(self):
        return True


def test_reset_prefix_cache_skips_a_replica_that_stopped_while_it_read_them():
    """POST /reset_prefix_cache read each replica's `alive`, then its handle, in the server's thread: the driver
    thread marks a stopped replica dead, then puts a fresh actor in its place; between the two reads the call went
    to the fresh actor, which Ray had not placed yet (the reset waited for it: for ever where no node has room), or
    which had no engine yet (the reset failed)."""
    import asyncio

    from infer.parallel.serve_engine import RayAsyncEngine, _Replica
    from test_probes_session49_review2 import _engine

    ray = FakeRay(eager=True)

    class _Stops:
        """Replica 0: stopped (the driver thread's _lost, then _replace) while the server read it."""

        def __init__(self):
            self.index, self.handle, self._alive = 0, Handle(_Resets(), ray), True
            self.fresh = Handle(_Resets(), ray, pending=True)  # (pending: Ray has not placed it)

        @property
        def alive(self):
            alive, self._alive = self._alive, False
            if alive:
                ray.kill(self.handle)
                self.handle = self.fresh
            return alive

    engine = _engine([_Stops(), _Replica(1, Handle(_Resets(), ray), {}, alive=True)])
    engine.ray = ray
    assert asyncio.run(RayAsyncEngine.reset_prefix_cache(engine)) is True
    assert engine.replicas[0].fresh.calls == 0, "a call went to the fresh actor before it was placed"


def test_no_metrics_counter_of_a_replaced_replica_goes_down():
    """Every counter /metrics shows (each engine's series and the sums) keeps the figures of the replica a fresh one
    replaced: kv_blocks_freed_window (a sliding window's model: infer:kv_cache_window_freed_blocks) was not moved to
    the replica's base, and went back to the fresh replica's count."""
    from prometheus_client.core import CounterMetricFamily

    from infer.parallel.serve_engine import RayAsyncEngine, _Replica
    from infer.serve.metrics import _EngineCollector

    counters = ("num_preemptions", "num_steps", "prefix_cache_queries", "prefix_cache_hits", "lora_swaps",
                "kv_blocks_freed_window")
    old = {**dict.fromkeys(counters, 50), "lora_max": 2, "num_running": 2, "kv_blocks_total": 64}
    r = _Replica(0, None, {}, stats=dict(old))
    engine = RayAsyncEngine.__new__(RayAsyncEngine)
    engine.ray, engine.replicas, engine._starting = FakeRay(), [r], {}
    engine._restart, engine.max_restarts = lambda index: Handle(_Finishes()), 1

    def samples() -> dict:
        collector = _EngineCollector(lambda: RayAsyncEngine._aggregate(engine), ["tiny", "0"])
        return {(m.name, s.labels.get("engine")): s.value for m in collector.collect()
                if isinstance(m, CounterMetricFamily) for s in m.samples if s.name.endswith("_total")}
    before = samples()
    engine._replace(r)
    r.stats, r.alive = {**dict.fromkeys(counters, 1), "lora_max": 2, "num_running": 1, "kv_blocks_total": 64}, True
    after = samples()
    assert ("infer:kv_cache_window_freed_blocks", "0") in before and ("infer:lora_swaps", "0") in before
    assert set(after) == set(before)
    assert {k: v for k, v in after.items() if v < before[k]} == {}, "a counter went down"


def test_an_adapter_given_late_skips_a_replica_that_stopped_while_it_was_read():
    """add_lora gives the adapter to a fresh replica that began to serve while the others loaded it (`late`): it read
    the replica's `alive`, then its handle; a replica that stopped again between the two reads had a fresh actor,
    not placed yet, in its place, and the load waited for Ray to place it (for ever where no node has room)."""
    import asyncio
    from types import SimpleNamespace

    from infer.parallel.serve_engine import RayAsyncEngine, _Adapters, _Replica
    from test_probes_session49_review2 import _engine, _Fresh

    ray = FakeRay(eager=True)

    class _Flaps:
        """Replica 1: restarting when the live replicas were read; then it serves, and stops as it is read again."""

        def __init__(self):
            self.index, self.handle, self.reads = 1, Handle(_Fresh(), ray), 0
            self.fresh = Handle(_Fresh(), ray, pending=True)  # (pending: Ray has not placed it)

        @property
        def alive(self):
            self.reads += 1
            if self.reads == 2:  # (the driver thread, meanwhile: it stopped, a fresh actor is put in its place)
                ray.kill(self.handle)
                self.handle = self.fresh
            return self.reads == 2

    flaps = _Flaps()
    engine = _engine([_Replica(0, Handle(_Fresh(), ray), {}, alive=True), flaps])
    engine.ray, engine._lora_changes = ray, None
    adapters = _Adapters(["a"], {"a": "/a"})
    engine.engine = SimpleNamespace(lora_slots=lambda: adapters, lora_manager=adapters)
    asyncio.run(RayAsyncEngine.add_lora(engine, "c", "/c"))
    assert adapters.has("c") and ("add_lora", "c", "/c", False) in engine.replicas[0].handle.replica.calls
    assert flaps.fresh.calls == 0, "a call went to the fresh actor before it was placed"


def test_an_abort_not_sent_to_a_replica_that_stopped_never_reaches_the_fresh_one():
    """A client's abort waits for the replica's next step call; the replica stopped first, and the abort went to the
    fresh replica in its place, where it aborted a request that reused the id (the client's X-Request-Id): added and
    aborted in one call, the retried request ended at once."""
    from infer.parallel.serve_engine import RayAsyncEngine, _Replica
    from test_probes_session49_review2 import _engine, _Fresh, _Pending

    ray = FakeRay(eager=True)

    class _Records(_Fresh):
        def serve_step(self, new, aborts, holds=()):
            self.calls.append(("serve_step", [w[0] for w in new], list(aborts)))
            return [], [], {}

    r = _Replica(0, Handle(_Records(), ray), {}, alive=True)
    engine = _engine([r])
    engine.ray, engine._carried, engine.max_restarts = ray, {}, 1
    fresh = Handle(_Records(), ray)
    engine._restart = lambda index: fresh
    r.aborts.append("cmpl-x")  # (the client went away; the driver sends it with the replica's next call)
    RayAsyncEngine._lost(engine, r, FakeRay.exceptions.ActorDiedError("the actor died"))
    assert r.starting and r.handle is fresh
    r.starting, r.alive = False, True  # (the fresh replica loaded the model: it serves)
    engine._sinks["cmpl-x"] = object()  # the client sends it again, with the same X-Request-Id
    RayAsyncEngine._route(engine, [_Pending("cmpl-x")], [])
    RayAsyncEngine._send(engine)
    assert fresh.replica.calls[-1] == ("serve_step", ["cmpl-x"], [])
