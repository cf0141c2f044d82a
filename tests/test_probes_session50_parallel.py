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
