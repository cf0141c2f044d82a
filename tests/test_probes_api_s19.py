"""Probes of the engine's step API lifecycle (session 19): a request id is free again once its request was aborted
(as vLLM's LLMEngine frees it), in the engine and through the server's AsyncEngine; a closed LLMEngine says so
instead of failing with an AttributeError from inside its step; and a stream the GC collects in the middle of another
call's step frees its requests after that step, not inside it."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from infer.errors import ClosedError
from infer.serve.async_engine import AsyncEngine

P = SamplingParams(max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=64))


def _run(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def _idle(engine) -> bool:
    return not engine.requests and engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_an_aborted_requests_id_may_be_used_again_at_once(engine):
    """add("a"), abort("a"), add("a") was refused as 'already running' until a step had handed out the abort."""
    want = [o.token_ids for o in _run_one(engine, "ref", [8, 9, 10]) if o.finished]
    engine.add_request("a", [5, 6, 7], P)
    engine.step()
    engine.abort_request("a")
    engine.add_request("a", [8, 9, 10], P)  # the aborted request's id, before any step
    outs = _run(engine)
    finished = [o for o in outs if o.finished]
    # one end for the id: the new request's (the old one's abort output would read as the new one ending)
    assert [(o.request_id, o.finish_reason) for o in finished] == [("a", "length")]
    assert [o.token_ids for o in finished] == want
    assert [t for o in outs for t in o.new_token_ids] == want[0]  # no token of the old request under its id
    assert _idle(engine)
    engine.add_request("b", [5, 6, 7], P)
    with pytest.raises(ValueError, match="request id 'b' is already running"):  # a running id is still refused
        engine.add_request("b", [5, 6, 7], P)
    _run(engine)
    assert _idle(engine)


def _run_one(engine, rid, prompt) -> list:
    engine.add_request(rid, prompt, P)
    return _run(engine)


def test_the_server_engine_runs_a_request_that_reuses_an_aborted_id(engine):
    """AsyncEngine accepted the new request (the old one's sink was gone), then the engine refused it as 'already
    running': the client got finish_reason 'error' for a request it had every right to make. (The engine thread's
    iterations are run here one by one, so the abort and the new request reach the engine in the same one.)"""
    want = [o.token_ids for o in _run_one(engine, "ref", [8, 9, 10]) if o.finished][0]
    ae = AsyncEngine(engine)  # not started: this test runs its iterations

    def iteration():
        with ae._cond:
            adds, ae._adds = list(ae._adds), deque()
            aborts, ae._aborts = list(ae._aborts), deque()
        ae._iteration(adds, aborts)

    async def main():
        first, second = asyncio.Queue(), asyncio.Queue()
        ae.add("x", [5, 6, 7], SamplingParams(max_new_tokens=40, ignore_eos=True), None, first)
        iteration()
        ae.abort("x")
        ae.add("x", [8, 9, 10], P, None, second)
        while ae._adds or engine.has_unfinished_requests():
            iteration()
        await asyncio.sleep(0)  # the deliveries (call_soon_threadsafe) run
        return [first.get_nowait() for _ in range(first.qsize())], [second.get_nowait() for _ in range(second.qsize())]

    old, outs = asyncio.run(main())
    assert len(old) == 1 and not old[0].finished  # the aborted request's client had left: nothing more for it
    assert [(o.finish_reason, o.error) for o in outs if o.finished] == [("length", None)]
    assert outs[-1].token_ids == want and [t for o in outs for t in o.new_token_ids] == want
    assert _idle(engine) and ae.num_in_flight() == 0


def test_a_closed_engine_says_so():
    """After LLMEngine.close(), add_request queued the request and step() failed with "'NoneType' object has no
    attribute 'run'" (having already given the request KV blocks); warm_kernels() likewise."""
    e = LLMEngine(EngineConfig("tiny-llama", max_model_len=64))
    e.add_request("a", [5, 6, 7], P)
    e.step()
    e.close()
    e.close()  # twice is fine
    assert not e.has_unfinished_requests()
    for call in (lambda: e.add_request("b", [5, 6], P), e.step, e.warm_kernels):
        with pytest.raises(ClosedError, match=r"this engine was closed \(LLMEngine.close\(\)\)") as info:
            call()
        assert isinstance(info.value, RuntimeError) and "new engine" in str(info.value)
    e.abort_request("a")  # nothing to abort: no error
    assert not e.requests and not e.scheduler.has_unfinished()


def test_a_stream_the_gc_collects_during_another_calls_step_frees_its_requests_after_the_step(monkeypatch):
    """A paused stream in a reference cycle is collected whenever the cyclic GC runs: inside another call's engine
    step too, in the same thread (the LLM's lock is reentrant). Its requests were aborted in the middle of that step,
    after the batch was scheduled, and the step failed ('IndexError: list index out of range'): the other call's
    request ended with finish_reason 'error'."""
    import gc

    from infer import LLM
    from infer.engine.scheduler import Scheduler
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM("tiny-llama", max_model_len=64, max_num_seqs=4) as llm:
        want = [o.token_ids for o in llm.generate([[11, 12]], params)]

        class Holder:
            pass
        gc.disable()  # the collection below is the only one, where an allocation could have triggered it
        try:
            holder = Holder()
            holder.me, holder.stream = holder, llm.stream([[5, 6, 7], [8, 9, 10]], params)
            next(holder.stream)
            del holder  # garbage only the cyclic collector finds
            real = Scheduler.schedule

            def schedule(self):
                batch = real(self)
                gc.collect()
                return batch
            monkeypatch.setattr(Scheduler, "schedule", schedule)
            out = llm.generate([[11, 12]], params)
        finally:
            gc.enable()
        assert [(o.finish_reason, o.error) for o in out] == [("length", None)]
        assert [o.token_ids for o in out] == want
        assert not llm._mail and not llm.engine.requests and llm.engine.block_manager.num_used_blocks == 0
