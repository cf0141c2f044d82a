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
