"""Session 46 probes: served beam searches (use_beam_search, AsyncLLM.beam_search) under data parallelism: adapter
holds on the replicas, and their /metrics."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fakeray import FakeRay, Handle
from helpers import metric_families, samples_by_engine
from infer.engine.sampling_params import SamplingParams


class _Ray(FakeRay):
    """Calls run at once, in the order they are made, as a Ray actor runs one caller's calls; a handle's `dies_at`
    (None: never) is the how-manieth serve_step call with new requests that finds the actor dead."""

    def __init__(self):
        super().__init__(eager=True)

    def before(self, ref):
        h = ref.handle
        if ref.method == "serve_step" and ref.args[0] and h.dies_at is not None:  # a call with requests
            h.dies_at -= 1
            h.alive = h.alive and h.dies_at > 0


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from lora_helpers import three_adapters
    return three_adapters(tmp_path_factory.mktemp("dpbeam46-lora"), 46, "ab")[1]


def _dp(adapters=None, start=True):
    """Two in-process tiny-llama replicas (adapter b loaded when `adapters`) behind the fake ray, their
    RayAsyncEngine (started) and a Server over it."""
    from infer.engine.config import EngineConfig
    from infer.parallel.replica import Replica
    from infer.parallel.serve_engine import RayAsyncEngine, ReplicaView
    from infer.serve.app import Server
    lora = {} if adapters is None else dict(enable_lora=True, max_loras=1, max_lora_rank=8,
                                            loras={"b": str(adapters["b"])})
    cfg = EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=4, block_size=4, **lora)
    replicas = [Replica(cfg) for _ in range(2)]
    engine = replicas[0].engine
    ray = _Ray()
    handles = [Handle(r, ray, dies_at=None) for r in replicas]
    view = ReplicaView(engine.config, engine.model_path, engine.tokenizer, replicas[0].info())
    aengine = RayAsyncEngine(ray, handles, [r.info() for r in replicas], view)
    if start:  # (else the app's lifespan starts it)
        aengine.start()
    return replicas, handles, aengine, Server(aengine, "tiny-llama")


def _search(aengine, lora, width=2, max_tokens=5, base_id="cmpl-x"):
    from infer.engine.beam import BeamSearchParams
    from infer.serve.beams import ServedBeamSearch
    tok = aengine.engine.tokenizer
    return ServedBeamSearch(aengine, tok, set(aengine.engine.eos_token_ids), aengine.engine.max_model_len,
                            [[5, 17, 99, 230, 6, 7]] * width, width,
                            BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True),
                            SamplingParams(max_new_tokens=max_tokens, logprobs=2 * width), lora, base_id)


async def _settle(replicas):
    for _ in range(500):  # the driver sends the releases with its next step calls
        if not any(r.engine._lora_holds or r.engine.requests for r in replicas):
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("change", ["none", "unload", "reload", "unload, then a replica dies"])
def test_data_parallel_beam_search_keeps_its_adapter_through_an_unload_or_reload(adapters, change):
    """With --data-parallel, a served beam search's adapter hold stayed in the driver (its engine had no holds): an
    unload right after the search began failed its next step with a 500 "unknown LoRA adapter", and an in-place
    reload gave its later steps the new weights. Every live replica now holds the adapter for the search (sent
    before the unload or reload) and runs its steps with that hold; the holds are released after it."""
    replicas, handles, aengine, _ = _dp(adapters)
    if "dies" in change:  # replica 1 dies on its second call that brings it steps: they run again on replica 0
        handles[1].dies_at = 2

    async def main():
        search = _search(aengine, "b")
        search.start()  # its first step is on its way; the change comes before its next ones
        if change.startswith("unload"):
            await aengine.remove_lora("b")
        elif change == "reload":
            await aengine.add_lora("b", str(adapters["a"]), replace=True)
        outs = [await asyncio.wait_for(search.queue.get(), 60) for _ in range(2)]
        await _settle(replicas)
        return [(o.finish_reason, o.error, o.token_ids) for o in outs]

    try:
        got = asyncio.run(main())
    finally:
        aengine.shutdown(timeout=5)
    want = _reference(adapters)
    assert got == want
    for r, handle in zip(replicas, handles):
        if handle.dies_at is not None:
            assert [x.alive for x in aengine.replicas] == [True, False]  # (its holds went with it)
            continue
        manager = r.engine.lora_manager
        assert r.engine._lora_holds == [] and getattr(r, "_holds", {}) == {} and manager.retired() == []
        assert manager.names() == ([] if change.startswith("unload") else ["b"])
        assert r.engine.stats()["kv_blocks_used"] == 0
    assert getattr(aengine.engine, "_lora_holds", []) == []


_REFERENCE = {}


def _reference(adapters):
    """The search's choices with adapter b untouched (one engine, no data parallel)."""
    if "ref" not in _REFERENCE:
        from infer.engine.config import EngineConfig
        from infer.engine.llm_engine import LLMEngine
        from infer.serve.async_engine import AsyncEngine
        engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=4, block_size=4,
                                        enable_lora=True, max_loras=1, max_lora_rank=8,
                                        loras={"b": str(adapters["b"])}))
        aengine = AsyncEngine(engine)
        aengine.start()

        async def main():
            search = _search(aengine, "b")
            search.start()
            return [await asyncio.wait_for(search.queue.get(), 60) for _ in range(2)]
        try:
            outs = asyncio.run(main())
        finally:
            aengine.shutdown(timeout=5)
        _REFERENCE["ref"] = [(o.finish_reason, o.error, o.token_ids) for o in outs]
    return _REFERENCE["ref"]


def test_a_beam_search_its_client_left_counts_its_steps_aborts_on_their_replicas(monkeypatch):
    """With data parallel, a beam search whose client went away was counted as one abort per choice, all on
    engine "0" (the choices' ids have no replica). Its steps are the engine requests, as in vLLM (whose beam search
    runs each beam step as an ordinary request): the steps in flight are counted as aborts on the replica each ran
    on, and the choices not at all."""
    from infer.serve import protocol as p
    replicas, _, aengine, server = _dp()
    gate = threading.Event()  # closed: the replicas take their steps in and run none of them
    for r in replicas:
        real = r.engine.has_unfinished_requests
        monkeypatch.setattr(r.engine, "has_unfinished_requests", lambda real=real: gate.is_set() and real())

    async def main():
        # two prompts: each search's first step is one request, and the driver sends them to the two replicas
        req = p.parse_completion({"prompt": [[5, 17, 99], [6, 17, 99, 230]], "n": 2, "use_beam_search": True,
                                  "max_tokens": 4, "ignore_eos": True}, server.tokenizer)
        queue, ids = server.submit(req, None, "cmpl-x")

        async def client():
            async for _ in server.outputs(queue, ids, None, 0.0):
                pass
        task = asyncio.create_task(client())
        for _ in range(1000):
            if all(len(r.engine.requests) == 1 for r in replicas):
                break
            await asyncio.sleep(0.01)
        assert [len(r.engine.requests) for r in replicas] == [1, 1]
        task.cancel()  # the client goes away
        try:
            await task
        except asyncio.CancelledError:
            pass
        gate.set()
        for _ in range(1000):  # the driver sends the aborts, which free the steps
            if not any(r.engine.requests for r in replicas):
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        gate.set()
        aengine.shutdown(timeout=5)
    samples = metric_families(server.metrics.render().decode())
    assert samples_by_engine(samples, "infer:request_success_total", finished_reason="abort") == {"0": 1.0, "1": 1.0}
    assert [len(r.engine.requests) for r in replicas] == [0, 0]


def test_served_beam_search_metrics_count_every_step_as_vllms():
    """A served beam search's /metrics counted its choices as the requests: generation_tokens_total only the tokens
    of the beams returned, no time to first token, one success per choice, and every count on engine "0" under
    data parallel. vLLM's beam search runs each beam step as an ordinary engine request, which its /metrics count:
    each step's prompt and token, its time to first token, its finish, on the engine that ran it; so does infer."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.serve.app import create_app
    replicas, _, aengine, server = _dp(start=False)
    steps = []  # (step request id, prompt length)
    real_add = aengine.add

    def add(rid, prompt, params, lora, queue):
        steps.append((rid, len(prompt)))
        return real_add(rid, prompt, params, lora, queue)
    aengine.add = add
    with TestClient(create_app(server)) as client:
        r = client.post("/v1/completions", json={"prompt": [5, 17, 99], "n": 2, "use_beam_search": True,
                                                 "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert [len(c["text"]) > 0 for c in r.json()["choices"]] == [True, True]
        samples = metric_families(client.get("/metrics").text)
    # one step of the prompt, then one of each of the two beams for each later token
    assert len(steps) == 1 + 2 * 3, steps
    done = samples_by_engine(samples, "infer:request_success_total", finished_reason="length")
    assert sum(done.values()) == len(steps) and set(done) == {"0", "1"} and all(done.values()), done
    assert samples_by_engine(samples, "infer:generation_tokens_total") == done  # one token each
    assert samples_by_engine(samples, "infer:time_to_first_token_seconds_count") == done
    assert samples_by_engine(samples, "infer:e2e_request_latency_seconds_count") == done
    assert sum(samples_by_engine(samples, "infer:prompt_tokens_total").values()) == sum(n for _, n in steps)
