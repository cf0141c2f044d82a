"""AsyncEngine (the server's engine thread) on its own, without HTTP: what a shutdown does to a request still
running, an abort that comes before the engine thread took the request, and a request the engine refuses when it
is admitted. Each request must end exactly once for its client, and the engine must be left with no request and
no KV block."""

from __future__ import annotations

import asyncio
import time

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from infer.errors import InferError
from infer.serve.async_engine import AsyncEngine, ShuttingDownError

PROMPT = list(range(5, 40))  # 35 tokens: 3 blocks of 16


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=256, block_size=16))


def _idle(engine) -> bool:
    return not engine.has_unfinished_requests() and not engine.requests and engine.block_manager.num_used_blocks == 0


def _slow_steps(engine, monkeypatch, seconds: float) -> None:
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()
    monkeypatch.setattr(engine, "step", step)


async def _until_finished(queue: asyncio.Queue, timeout: float = 60.0) -> list:
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(await asyncio.wait_for(queue.get(), timeout))
    return outs


def test_shutdown_aborts_a_running_request_in_the_engine_too(engine, monkeypatch):
    _slow_steps(engine, monkeypatch, 0.02)  # 200 tokens take 4 s: the shutdown comes long before the end
    ae = AsyncEngine(engine)
    ae.start()

    async def main():
        queue = asyncio.Queue()
        ae.add("r1", PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True), None, queue)
        first = await asyncio.wait_for(queue.get(), 60)
        # 3 blocks at the first token; a 4th from token 14 on (0.26 s later), if this thread woke up late
        assert not first.finished and engine.block_manager.num_used_blocks >= 3
        await asyncio.get_running_loop().run_in_executor(None, ae.shutdown, 0.0)
        return first, await _until_finished(queue)

    first, rest = asyncio.run(main())
    assert [(o.finish_reason, o.error) for o in rest if o.finished] == [
        ("abort", "the server shut down before the request finished")]
    assert not ae._thread.is_alive()
    assert _idle(engine), engine.stats()  # the engine does not keep running the request nobody waits for
    with pytest.raises(ShuttingDownError):
        ae.add("r2", PROMPT, SamplingParams(max_new_tokens=2), None, asyncio.Queue())


def test_abort_before_the_engine_took_the_request_never_runs_it(engine, monkeypatch):
    admitted = []
    real_add = engine.add_request

    def add_request(rid, *args, **kwargs):
        admitted.append(rid)
        return real_add(rid, *args, **kwargs)
    monkeypatch.setattr(engine, "add_request", add_request)
    ae = AsyncEngine(engine)  # not started: adds wait in its queue

    async def main():
        gone, kept = asyncio.Queue(), asyncio.Queue()
        ae.add("gone", PROMPT, SamplingParams(max_new_tokens=50, ignore_eos=True), None, gone)
        ae.add("kept", PROMPT[:20], SamplingParams(max_new_tokens=3, ignore_eos=True), None, kept)
        ae.abort("gone")
        ae.abort("gone")  # a second abort (a client that disconnects twice) changes nothing
        assert ae.num_in_flight() == 1
        ae.start()
        outs = await _until_finished(kept)
        return gone, outs

    try:
        gone, outs = asyncio.run(main())
    finally:
        ae.shutdown(5.0)
    assert admitted == ["kept"]
    assert gone.empty()
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 3
    assert _idle(engine), engine.stats()


def test_a_request_the_engine_refuses_at_admission_fails_alone(engine, monkeypatch):
    real_add = engine.add_request

    def add_request(rid, *args, **kwargs):
        if rid == "bad":
            raise RuntimeError("cannot admit")
        return real_add(rid, *args, **kwargs)
    monkeypatch.setattr(engine, "add_request", add_request)
    ae = AsyncEngine(engine)

    async def main():
        bad, good = asyncio.Queue(), asyncio.Queue()
        ae.add("bad", PROMPT, SamplingParams(max_new_tokens=4), None, bad)
        ae.add("good", PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), None, good)
        with pytest.raises(InferError, match="already in use"):
            ae.add("good", PROMPT, SamplingParams(max_new_tokens=4), None, asyncio.Queue())
        ae.start()
        return await _until_finished(bad), await _until_finished(good)

    try:
        bad, good = asyncio.run(main())
    finally:
        ae.shutdown(5.0)
    assert [(o.finish_reason, o.error) for o in bad] == [("error", "cannot admit")]
    assert good[-1].finish_reason == "length" and len(good[-1].token_ids) == 4 and len(good) == 4
    assert _idle(engine), engine.stats()
