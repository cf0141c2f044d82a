"""Session 45 probes: per-engine /metrics under data parallelism, and O(1) aborts of waiting fcfs requests."""

from __future__ import annotations

import random
from collections import deque

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
