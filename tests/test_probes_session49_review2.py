"""Data parallelism's replica restarts, the forty-ninth session's second review: races of the serving engine's
driver thread with aborts and adapter changes while a fresh replica loads."""

from __future__ import annotations

from infer.engine.sampling_params import SamplingParams
from infer.parallel.pool import MAX_RESTARTS
from infer.parallel.serve_engine import RayAsyncEngine, _Replica

from fakeray import FakeRay, Handle

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


class _Pending:
    def __init__(self, request_id: str):
        self.request_id, self.prompt_token_ids, self.params, self.lora, self.lost = request_id, [5, 6], PARAMS, None, 0


def _engine(replicas: list) -> RayAsyncEngine:
    import threading
    from collections import deque
    engine = RayAsyncEngine.__new__(RayAsyncEngine)
    engine.ray, engine.replicas, engine._starting, engine._calls = FakeRay(eager=True), replicas, {}, {}
    engine._sinks, engine._owner, engine._adds = {}, {}, deque()
    engine._retry, engine._isolated, engine._cond = deque(), set(), threading.Condition()
    return engine


def test_an_add_aborted_while_the_driver_holds_it_is_not_run():
    """abort() of a request the driver had just taken from _adds found it neither there nor on a replica: the
    request was then sent to a replica (or, every replica stopped, put back to wait for a fresh one) and run to its
    last token with no one to read it."""
    live = _Replica(0, None, {}, alive=True)
    engine = _engine([live])
    RayAsyncEngine._route(engine, [_Pending("gone")], ["gone"])
    assert not live.inflight and not live.new, "the aborted request was sent to a replica"
    starting = _Replica(0, None, {}, alive=False, starting=True)
    engine = _engine([starting])
    RayAsyncEngine._route(engine, [_Pending("gone")], ["gone"])
    assert not engine._adds, "the aborted request waits for the fresh replica"
    kept = _Pending("kept")
    engine._sinks["kept"] = object()
    RayAsyncEngine._route(engine, [kept], [])
    assert list(engine._adds) == [kept] and MAX_RESTARTS


class _Fresh:
    """A replica's adapter calls, recorded; `on_warm`: what the server does while it compiles its kernels."""

    def __init__(self, on_warm=lambda: None, has=("a",)):
        self.calls, self.on_warm, self.has = [], on_warm, list(has)

    def info(self):
        self.calls.append(("info",))
        return {"error": None, "host": "h", "adapters": list(self.has)}

    def add_lora(self, name, path, replace=False):
        self.calls.append(("add_lora", name, path, replace))

    def remove_lora(self, name):
        self.calls.append(("remove_lora", name))
        return 0

    def warm_kernels(self):
        self.calls.append(("warm_kernels",))
        self.on_warm()

    def serve_step(self, new, aborts, holds=()):
        self.calls.append(("serve_step",))
        return [], [], {}


def test_a_fresh_replica_gets_the_adapters_changed_while_it_compiled():
    """The adapters a fresh replica was given were read when its model had loaded: one added, replaced or removed
    while it compiled its kernels (a minute or more) went to the live replicas only, and the fresh one served
    without it (a request naming it failed there) or with the old weights."""
    from types import SimpleNamespace

    from infer.parallel.serve_engine import _Adapters
    adapters = _Adapters(["a", "b"], {"a": "/a", "b": "/b"})

    def change():  # what add_lora / remove_lora do meanwhile (on the live replicas, then the view's names)
        adapters.add("c", "/c")
        adapters.add("a", "/a2")
        adapters.discard("b")

    fresh = _Fresh(change)
    r = _Replica(0, None, {}, alive=False)
    engine = _engine([r])
    engine._restart, engine.max_restarts = lambda index: Handle(fresh, engine.ray), MAX_RESTARTS
    engine.engine = SimpleNamespace(lora_manager=adapters)
    engine._replace(r)
    while engine._starting:
        ref = next(iter(engine._starting))
        engine._started(ref, *engine._starting.pop(ref))
    assert fresh.calls[:3] == [("info",), ("add_lora", "b", "/b", False), ("warm_kernels",)], fresh.calls
    assert sorted(fresh.calls[3:-1]) == [("add_lora", "a", "/a2", True), ("add_lora", "c", "/c", False),
                                         ("remove_lora", "b")], fresh.calls
    assert fresh.calls[-1] == ("serve_step",) and r.alive and not r.starting


def test_add_lora_gives_the_adapter_to_a_replica_that_began_to_serve_meanwhile():
    """add_lora loaded the adapter on the replicas live when it began; one that finished its restart before the
    name was offered had checked the adapters without it: it served requests naming it without the adapter."""
    import asyncio
    from types import SimpleNamespace

    from infer.parallel.serve_engine import _Adapters
    late = _Replica(1, None, {}, alive=False)
    ray = FakeRay(eager=True)

    class Live(_Fresh):
        def add_lora(self, name, path, replace=False):
            super().add_lora(name, path, replace)
            late.alive = True  # the fresh replica's last step (_started, the driver thread) meanwhile

    first, fresh = Live(), _Fresh()
    live = _Replica(0, Handle(first, ray), {}, alive=True)
    late.handle = Handle(fresh, ray)
    engine = _engine([live, late])
    engine.ray, engine._lora_changes = ray, None
    adapters = _Adapters(["a"], {"a": "/a"})
    engine.engine = SimpleNamespace(lora_slots=lambda: adapters, lora_manager=adapters)
    asyncio.run(engine.add_lora("c", "/c"))
    assert adapters.has("c") and ("add_lora", "c", "/c", False) in first.calls
    assert ("add_lora", "c", "/c", False) in fresh.calls, "the replica that began to serve meanwhile lacks it"


def test_a_request_that_ends_while_it_runs_alone_is_no_longer_named_so():
    """A request run again alone (on MAX_LOST replicas that stopped along with others) that stopped its replica
    once more failed, but its id stayed in the set of those running alone: a later request of the same id (a
    client's X-Request-Id) kept its replica from taking new requests while it ran. One aborted while waiting to
    run alone stayed there too."""
    from types import SimpleNamespace

    from infer.parallel.pool import MAX_LOST
    ray = FakeRay(eager=True)
    poison = _Pending("same")
    poison.lost = MAX_LOST
    r0 = _Replica(0, Handle(_Fresh(), ray), {}, alive=True)
    r1 = _Replica(1, Handle(_Fresh(), ray), {}, alive=True)
    engine = _engine([r0, r1])
    engine.ray, engine._restart = ray, lambda index: Handle(_Fresh(), ray)
    engine._carried, engine.max_restarts = {}, 0
    got = []
    sink = (SimpleNamespace(call_soon_threadsafe=lambda put, out: put(out)), SimpleNamespace(put_nowait=got.append))
    engine._sinks["same"] = sink
    engine._isolated.add("same")
    r0.inflight["same"] = poison
    RayAsyncEngine._lost(engine, r0, RuntimeError("the replica died"))
    assert [o.request_id for o in got] == ["same"] and got[0].finish_reason == "error", "the request failed"
    assert not engine._isolated, "its id is still named as running alone"
    again = _Pending("same")
    engine._sinks["same"] = sink
    RayAsyncEngine._route(engine, [again], [])
    assert r1.inflight == {"same": again} and not RayAsyncEngine._runs_retry(engine, r1)
    waiting = _Pending("w")
    engine._retry.append(waiting)
    engine._isolated.add("w")
    RayAsyncEngine._route(engine, [], [])  # (aborted: no sink)
    assert not engine._isolated and not engine._retry
