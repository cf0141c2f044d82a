"""The data-parallel driver loop (infer.parallel.pool) without a Ray runtime: replicas are real engines in this
process behind a stand-in for the few Ray calls the pool makes (tests/fakeray.py), so a replica death lands at an
exact moment.
Every request is handed back exactly once, with one engine's tokens, whichever replica ran it."""

from __future__ import annotations

import pytest

from infer.engine.config import EngineConfig
from infer.engine.sampling_params import SamplingParams
from infer.parallel.pool import ReplicaPool, Work
from infer.parallel.replica import Replica
from infer.parallel.runtime import ReplicaError

from fakeray import FakeRay, Handle


@pytest.fixture(scope="module")
def replicas():
    cfg = EngineConfig("tiny-llama", max_model_len=128, max_num_seqs=3, memory_limit=2 ** 29)
    return [Replica(cfg) for _ in range(2)]


def _work() -> list[Work]:
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    return [Work(f"r{i}", i + 1, [5 + i, 17, 99, 230 + i], params, None) for i in range(10)]


@pytest.fixture
def work():
    """Each test's own: a run counts on its Work items the replicas lost under them (`lost`), which another test's
    run would start from (under --dist worksteal a module's tests may run in another order)."""
    return _work()


@pytest.fixture(scope="module")
def want(replicas):
    """What one engine generates for every request."""
    engine = replicas[0].engine
    for w in _work():
        engine.add_request(w.id, w.prompt_token_ids, w.params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


def _pool(replicas, notes):
    return ReplicaPool(FakeRay(), [Handle(r) for r in replicas], capacity=4, notify=notes.append)


def test_spread_over_both_replicas(replicas, work, want):
    got, notes = {}, []
    pool = _pool(replicas, notes)
    pool.run(work, lambda w, out, i: got.setdefault(w.id, []).append(out.token_ids),
             lambda w, reason: pytest.fail(reason))
    assert got == {k: [v] for k, v in want.items()} and not notes
    assert [r.done for r in pool.replicas] != [10, 0] and sum(r.done for r in pool.replicas) == 10


def test_dead_replica_requests_run_again_once(replicas, work, want):
    got, notes = {}, []
    pool = _pool(replicas, notes)

    def on_output(w, out, i):
        got.setdefault(w.id, []).append(out.token_ids)
        if len(got) == 2:
            FakeRay().kill(pool.replicas[0].handle)  # dies with requests in flight
    pool.run(work, on_output, lambda w, reason: pytest.fail(reason))
    assert got == {k: [v] for k, v in want.items()}, "every id once, with one engine's tokens"
    assert len(notes) == 1 and "replica 0 stopped" in notes[0] and "run again on the 1 other" in notes[0]
    engine = replicas[0].engine  # the "dead" replica's engine still holds what it was running: clear it
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def test_every_replica_dead_is_an_error(replicas, work):
    fresh = [Replica(replicas[0].engine.config) for _ in range(2)]
    got, notes = [], []
    pool = _pool(fresh, notes)

    def on_output(w, out, i):
        got.append(w.id)
        for r in pool.replicas:
            FakeRay().kill(r.handle)
    with pytest.raises(ReplicaError, match="every engine replica has stopped"):
        pool.run(work, on_output, lambda w, reason: pytest.fail(reason))
    assert len(got) == len(set(got)) >= 1 and len(notes) == 2


def test_rejected_request_is_handed_back_once(replicas):
    bad = Work("long", 7, list(range(5, 200)), SamplingParams(max_new_tokens=4), None)  # past max_model_len 128
    rejected = []
    pool = _pool(replicas, [])
    pool.run([bad], lambda *a: pytest.fail("should not run"), lambda w, reason: rejected.append((w.id, reason)))
    assert rejected and rejected[0][0] == "long" and "128" in rejected[0][1] and len(rejected) == 1
