"""Session 44 soak probes: races and leaks an `infer serve` soak (concurrent clients, adapters loaded and unloaded
while traffic runs, disconnects, SIGTERM under load) found, each reproduced small and deterministic."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.engine.sampling_params import SamplingParams  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from lora_helpers import THREE, hf_float, save_adapter  # noqa: E402


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from pathlib import Path
    hf = hf_float(Path(ensure_builtin("tiny-llama")))
    return save_adapter(hf, tmp_path_factory.mktemp("soak-lora") / "b", seed=3, **THREE["b"])


def test_request_accepted_while_its_adapter_is_being_unloaded_runs_with_it(adapter):
    """A request whose adapter was checked (accepted) after the engine thread took an unload of that adapter, but
    before the unload ran, was admitted after it: "unknown LoRA adapter", a 500 (stream: an engine_error event)
    for a request the README says finishes with the adapter. Now it is admitted before the removal runs."""
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, enable_lora=True, max_loras=1, max_lora_rank=8,
                                    loras={"b": str(adapter)}))
    aengine = AsyncEngine(engine)

    async def scenario():
        removal = asyncio.ensure_future(aengine.remove_lora("b"))
        await asyncio.sleep(0)  # the control is queued
        with aengine._cond:  # the engine thread takes it (its iteration begins)...
            controls, aengine._controls = list(aengine._controls), deque()
        queue: asyncio.Queue = asyncio.Queue()
        aengine.add("r", [5, 17, 99], SamplingParams(max_tokens=3, ignore_eos=True), "b", queue)  # ...b still served
        aengine._iteration([], [], controls)  # ...and runs the removal
        aengine.start()
        out = await asyncio.wait_for(queue.get(), 60)
        while not out.finished:
            out = await asyncio.wait_for(queue.get(), 60)
        return out, await asyncio.wait_for(removal, 60)

    try:
        out, running = asyncio.run(scenario())
    finally:
        aengine.shutdown(timeout=5)
    assert (out.finish_reason, out.error) == ("length", None) and len(out.token_ids) == 3
    assert running == 1  # the unload's 200 said one request still finishes with it
    assert engine.lora_manager.retired() == [] and "b" not in engine.lora_manager.names()  # freed after it


def test_adapter_unloaded_between_model_check_and_submit_is_a_404(adapter, monkeypatch):
    """An unload that ran on the engine thread after the route found the request's adapter (lora_for) and before the
    request was queued made the engine's check refuse it: a 400 "unknown LoRA adapter" blaming `prompt`, where a
    request naming an unloaded adapter gets vLLM's 404 model_not_found on `model`."""
    import httpx

    from infer.serve.app import Server, serve_in_thread

    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, enable_lora=True, max_loras=1, max_lora_rank=8,
                                    loras={"b": str(adapter)}))
    found = Server.lora_for

    def lora_for_then_unloaded(self, model):
        name = found(self, model)
        if name == "b":
            engine.remove_lora("b")  # no request uses it: freed at once, as the engine thread would do it
        return name

    monkeypatch.setattr(Server, "lora_for", lora_for_then_unloaded)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama", runtime_lora=True)) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2}, timeout=60)
        health = httpx.get(f"{url}/health").json()["engine"]
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert health["num_in_flight"] == 0 and health["kv_blocks_used"] == 0
