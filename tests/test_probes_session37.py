"""Session 37: vLLM's add_request(arrival_time=...), and the times of requests a failed engine step ended."""

from __future__ import annotations

import asyncio
import time

import pytest

from infer import LLM, SamplingParams
from infer.errors import RequestError

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", max_model_len=64, max_num_seqs=4) as llm:
        yield llm


def test_add_request_counts_the_queue_from_the_arrival_it_is_given(llm):
    engine = llm.engine
    arrived = time.monotonic() - 5.0  # held five seconds by the caller (a server's queue) before it was added
    engine.add_request("held", [5, 6, 7], PARAMS, arrival_time=arrived)
    engine.add_request("now", [5, 6, 8], PARAMS)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    held, now = outs["held"].metrics, outs["now"].metrics
    assert held.arrival_time == arrived and held.time_in_queue >= 5.0
    assert now.arrival_time > arrived + 4.0 and now.time_in_queue < 5.0


@pytest.mark.parametrize("bad", ["epoch", "future", "nan", "text", "bool"])
def test_an_arrival_time_not_read_from_the_monotonic_clock_is_refused(llm, bad):
    """vLLM's engine reads time.time(): its epoch seconds here would make every queue time negative."""
    bad = {"epoch": time.time(), "future": time.monotonic() + 60, "nan": float("nan"), "text": "now",
           "bool": True}[bad]
    with pytest.raises(RequestError, match=r"time\.monotonic\(\)"):
        llm.engine.add_request("bad", [5, 6], PARAMS, arrival_time=bad)
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished_requests()


def _failing_step(engine, monkeypatch, after: int):
    """The engine's model runs fail from its `after`-th launch on (a kernel fault, say)."""
    launch, calls = engine.runner.launch, [0]

    def fails(*args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("simulated kernel failure")
        return launch(*args, **kwargs)
    monkeypatch.setattr(engine.runner, "launch", fails)


def test_the_requests_a_failed_step_ends_keep_their_tokens_and_times(monkeypatch):
    with LLM("tiny-llama", max_model_len=64, max_num_seqs=4, overlap=False) as llm:
        arrived = time.monotonic()
        _failing_step(llm.engine, monkeypatch, after=2)
        outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    for out in outs:
        assert out.finish_reason == "error" and "simulated kernel failure" in out.error
        assert out.prompt_token_ids and out.token_ids  # the tokens it had before the failure
        m = out.metrics
        assert arrived <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time \
            <= m.finished_time
        assert m.last_token_time == out.token_times[-1] and len(out.token_times) == len(out.token_ids)


def test_the_server_loop_fails_a_request_with_its_tokens_and_times(monkeypatch):
    """The server's loop (AsyncEngine): a request's arrival is when the server accepted it (here it waits in the
    loop's queue until the loop starts), and a request a failed step ended keeps its prompt, tokens and times."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=4, overlap=False))
    _failing_step(engine, monkeypatch, after=2)
    aengine = AsyncEngine(engine)  # not started: an add waits in its queue

    async def main():
        queue = asyncio.Queue()
        aengine.add("r", [5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True), None, queue)
        accepted = time.monotonic()
        await asyncio.sleep(0.05)
        started = time.monotonic()
        aengine.start()
        outs = [await queue.get()]
        while not outs[-1].finished:
            outs.append(await queue.get())
        return accepted, started, outs

    try:
        accepted, started, outs = asyncio.run(main())
    finally:
        aengine.shutdown(5.0)
        engine.close()
    last = outs[-1]
    assert last.finish_reason == "error" and "simulated kernel failure" in last.error
    assert last.prompt_token_ids == [5, 6, 7] and last.token_ids == outs[-2].token_ids and last.token_ids
    assert last.arrival_time <= accepted < started <= last.metrics.first_scheduled_time <= last.metrics.finished_time
    assert last.first_token_time is not None and last.new_token_ids == [] and last.delta_text == ""
