"""Session 52 probes of the lifecycle of engines and servers: what a long-lived process sees when it starts and
stops them."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.serve.app import Server, create_app
from infer.serve.async_engine import AsyncEngine
from infer.serve.lifecycle import uvicorn_server


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_forced_quit_runs_the_apps_shutdown_and_logs_no_cancelled_lifespan_traceback():
    """A third Ctrl-C (uvicorn's force_exit) skipped the app's lifespan shutdown: the lifespan task was cancelled as
    the event loop closed and starlette logged "ERROR: Traceback ... CancelledError" on the terminal."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=64))
    server = Server(AsyncEngine(engine), "tiny-llama")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn_server(server, create_app(server), 5.0, log_level="warning")
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    records = _Records()
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while not uv.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert uv.started
        for name in ("uvicorn.error", "uvicorn"):  # (uvicorn's loggers do not propagate to the root)
            logging.getLogger(name).addHandler(records)
        uv.force_exit = True  # what a third Ctrl-C sets, then the exit itself
        uv.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        for name in ("uvicorn.error", "uvicorn"):
            logging.getLogger(name).removeHandler(records)
        uv.should_exit = True
        thread.join(timeout=30)
        server.aengine.shutdown(0)
        engine.close()
        sock.close()
    errors = [r.getMessage() for r in records.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    assert uv.lifespan.shutdown_event.is_set(), "the app's shutdown did not run"


def _slow_inputs(llm, entered: threading.Event, release: threading.Event):
    """AsyncLLM._inputs (run on a worker thread) that waits for `release` once the prompt is tokenized."""
    inputs = llm._inputs

    def slow(*args):
        got = inputs(*args)
        entered.set()
        release.wait(60)
        return got
    return slow


@pytest.mark.parametrize("call", ["generate", "beam_search"])
def test_a_generate_racing_shutdown_raises_closed_error_not_the_servers_shutting_down(call):
    """shutdown() on another thread while a generate's prompt was tokenized: the generate raised the server's
    ShuttingDownError, "the server is shutting down (retry against another replica)", where the README promises
    ClosedError for every call after shutdown."""
    import asyncio

    from infer import BeamSearchParams, SamplingParams
    from infer.errors import ClosedError
    from infer.serve.async_llm import AsyncLLM

    llm = AsyncLLM("tiny-llama", max_num_seqs=2, max_model_len=64)
    entered, release = threading.Event(), threading.Event()
    llm._inputs = _slow_inputs(llm, entered, release)

    async def main():
        async def generate():
            outs = llm.generate("hi", SamplingParams(max_new_tokens=2), request_id="r") if call == "generate" else \
                llm.beam_search("hi", "r", BeamSearchParams(beam_width=2, max_tokens=2))
            async for _ in outs:
                pass
        task = asyncio.create_task(generate())
        assert await asyncio.to_thread(entered.wait, 60)  # the call passed its checks and tokenizes the prompt
        await asyncio.to_thread(llm.shutdown)
        release.set()
        with pytest.raises(ClosedError, match="shut down"):
            await asyncio.wait_for(task, 60)

    try:
        asyncio.run(main())
    finally:
        release.set()
        llm.shutdown()


def test_asyncllm_shutdown_ends_requests_in_flight_naming_the_asyncllm_not_a_server():
    """AsyncLLM.shutdown() with requests in flight ended each with finish_reason "abort" and the error "the server
    shut down before the request finished": an AsyncLLM program has no server."""
    import asyncio

    from infer import SamplingParams
    from infer.serve.async_llm import AsyncLLM

    llm = AsyncLLM("tiny-llama", max_num_seqs=2, max_model_len=256)

    async def main():
        first, started = asyncio.Event(), set()

        async def generate(i):
            last = None
            async for out in llm.generate(f"hi {i}", SamplingParams(max_new_tokens=200, ignore_eos=True),
                                          request_id=f"r{i}"):
                last = out
                started.add(i)
                if len(started) == 2:  # both in flight (a prompt is tokenized on a worker thread: the second one
                    first.set()  # could reach the engine after the shutdown, a ClosedError, not an abort)
            return last
        tasks = [asyncio.create_task(generate(i)) for i in range(2)]
        await asyncio.wait_for(first.wait(), 60)
        await asyncio.to_thread(llm.shutdown)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    try:
        outs = asyncio.run(main())
    finally:
        llm.shutdown()
    ended = [(o.finish_reason, o.error) for o in outs]
    assert all(reason == "abort" and "AsyncLLM" in error and "server" not in error for reason, error in ended), ended
    assert not llm.engine.requests


def test_asyncllm_list_loras_after_shutdown_raises_closed_error_as_llms_does():
    """After shutdown() `list_loras()` answered [] (the adapters registered before were gone without a word), where
    the README says every call raises ClosedError and LLM.list_loras does."""
    from infer.errors import ClosedError
    from infer.serve.async_llm import AsyncLLM

    llm = AsyncLLM("tiny-llama", max_num_seqs=2, max_model_len=64, enable_lora=True)
    assert llm.list_loras() == []
    llm.shutdown()
    with pytest.raises(ClosedError, match="shut down"):
        llm.list_loras()
