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
