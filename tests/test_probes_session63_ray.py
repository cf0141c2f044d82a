"""`infer serve --data-parallel`: the driver reads each replica's step calls in the order it sent them. ray.wait
answers any call that is ready (Ray's core worker takes them from a hash set), not the oldest; with two calls of a
replica ready at once a stream's tokens came out swapped (the CI run of test_ray_serve saw 7, 47 streamed where
the engine gave 47, 7), and a request's last output read before an earlier one dropped that earlier one."""

from __future__ import annotations

from fakeray import FakeRay, Handle
from infer.engine.config import EngineConfig
from infer.engine.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 230, 41, 7]


class _NewestReady(FakeRay):
    """An eager fake Ray (each call runs when made, in order, as an actor runs one caller's calls) whose ray.wait
    answers the newest of the ready calls, as Ray may; every other wait times out with none ready (the replica
    still busy), so the driver queues a second call meanwhile."""

    def __init__(self):
        super().__init__(eager=True)
        self.waits = 0

    def wait(self, refs, num_returns=1, timeout=None):
        self.waits += 1
        if self.waits % 2:
            return [], list(refs)
        ready = [r for r in refs if not self.pending(r)][::-1][:num_returns]
        return ready, [r for r in refs if r not in ready]


def test_a_stream_on_a_replica_gets_its_tokens_in_the_engines_order():
    import asyncio

    from infer.engine.llm import LLM
    from infer.parallel.replica import Replica
    from infer.parallel.serve_engine import RayAsyncEngine, ReplicaView
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = LLM("tiny-llama", max_model_len=64).generate([PROMPT], params)[0].token_ids
    replicas = [Replica(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=4, memory_limit=2 ** 29))]
    engine = replicas[0].engine
    view = ReplicaView(engine.config, engine.model_path, engine.tokenizer, replicas[0].info())
    aengine = RayAsyncEngine(_NewestReady(), [Handle(r) for r in replicas], [r.info() for r in replicas], view)
    aengine.start()

    async def stream() -> tuple[list, list]:
        queue: asyncio.Queue = asyncio.Queue()
        aengine.add("s", PROMPT, params, None, queue)
        deltas, whole = [], []
        while not whole:
            out = await asyncio.wait_for(queue.get(), 30)  # (a lost last output would wait for ever)
            deltas += out.new_token_ids
            whole = out.token_ids if out.finished else []
        return deltas, whole
    try:
        deltas, whole = asyncio.run(stream())
    finally:
        aengine.shutdown(timeout=5)
    assert deltas == want and whole == want
