"""A request that crashes the process it runs in (a "poison" request) under data parallelism: `infer run --dp` and
`infer serve --dp` re-ran a dead replica's unfinished requests on the others, so such a request took every replica
down in turn and the whole run (or server) with it. Now a request that was in flight on pool.MAX_LOST replicas
that stopped ends as an error while other replicas live; the others still complete, each once.

Replicas are real engines in this process behind a stand-in for the few Ray calls the driver makes (tests/fakeray.py,
as in tests/test_ray_pool.py); the stand-in kills a replica whenever the poison request is on it."""

from __future__ import annotations

import asyncio

import pytest

from infer.engine.config import EngineConfig
from infer.engine.sampling_params import SamplingParams
from infer.parallel.pool import MAX_LOST, ReplicaPool, Work
from infer.parallel.replica import ENGINE_FAILURE, Replica
from infer.parallel.runtime import ReplicaError

from fakeray import FakeRay, Handle

POISON = "poison"


class _Ray(FakeRay):
    """A replica handed the poison request dies (and stays dead)."""

    def before(self, ref):
        h = ref.handle
        h.ran.update(w[0] for w in (ref.args[0] if ref.args else []))
        if POISON in h.ran:
            h.alive = False


def _handle(replica: Replica) -> Handle:
    return Handle(replica, ran=set())  # ran: the requests handed to it


def _replicas(n: int) -> list[Replica]:
    cfg = EngineConfig("tiny-llama", max_model_len=128, max_num_seqs=3, memory_limit=2 ** 29)
    return [Replica(cfg) for _ in range(n)]


PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _work() -> list[Work]:
    work = [Work(f"r{i}", i + 1, [5 + i, 17, 99, 230 + i], PARAMS, None) for i in range(6)]
    work.insert(1, Work(POISON, 99, [7, 8, 9], PARAMS, None))
    return work


def test_run_a_poison_request_ends_as_an_error_and_the_others_complete():
    notes, done, failed = [], [], []
    handles = [_handle(r) for r in _replicas(3)]
    # (each step call runs until a request finishes: with the default budget of 0.5 s a slow machine's call ended
    # first, which changed where the requests went, and a request on both stopped replicas with the poison one was
    # failed with it: the outcome depended on the machine's speed)
    pool = ReplicaPool(_Ray(), handles, capacity=3, notify=notes.append, budget_s=600)
    pool.run(_work(), lambda w, out, i: done.append(w.id), lambda w, reason: failed.append((w.id, reason)))
    assert sorted(done) == [f"r{i}" for i in range(6)], "every other request completes, once"
    assert [f[0] for f in failed] == [POISON], failed
    assert failed[0][1].startswith(ENGINE_FAILURE) and f"in flight on {MAX_LOST} engine replicas" in failed[0][1]
    assert sum(not h.alive for h in handles) == MAX_LOST, "the third replica lives on"
    assert any("written as errors" in n for n in notes), notes


def test_run_with_no_replica_left_fails_nothing_so_resume_reruns_it():
    """With two replicas both stopped there is no one left: the run stops (ReplicaError) and the requests in flight
    are not written as errors (an error record is done for --resume, which would never run them again)."""
    failed = []
    pool = ReplicaPool(_Ray(), [_handle(r) for r in _replicas(2)], capacity=3, notify=lambda m: None)
    with pytest.raises(ReplicaError, match="every engine replica has stopped"):
        pool.run(_work(), lambda *a: None, lambda w, reason: failed.append(w.id))
    assert failed == []



def _serve(aengine, work: list[Work]) -> dict:
    """Every request of `work` through the serving engine at once; {request_id: its final output}."""
    async def one(rid: str, prompt: list[int]):
        queue = asyncio.Queue()
        aengine.add(rid, prompt, PARAMS, None, queue)
        while True:
            out = await asyncio.wait_for(queue.get(), 60)
            if out.finished:
                return out

    async def main():
        return await asyncio.gather(*[one(w.id, w.prompt_token_ids) for w in work])
    return {o.request_id: o for o in asyncio.run(main())}

def test_serve_a_poison_request_fails_alone_and_the_server_keeps_replicas():
    from infer.parallel.serve_engine import RayAsyncEngine, ReplicaView

    replicas = _replicas(3)
    handles = [_handle(r) for r in replicas]
    engine = replicas[0].engine
    view = ReplicaView(engine.config, engine.model_path, engine.tokenizer, replicas[0].info())
    aengine = RayAsyncEngine(_Ray(), handles, [r.info() for r in replicas], view)
    aengine.start()

    try:
        outs = _serve(aengine, _work())
    finally:
        aengine.shutdown(timeout=5)
    assert outs[POISON].finish_reason == "error" and f"on {MAX_LOST} engine replicas" in outs[POISON].error
    for i in range(6):  # one that had streamed on a replica when it stopped ends with that error (not re-run)
        o = outs[f"r{i}"]
        assert o.finish_reason == "length" or "stopped while this request ran" in o.error, (o.request_id, o.error)
    assert sum(r.alive for r in aengine.replicas) == 3 - MAX_LOST
