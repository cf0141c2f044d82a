"""Session 52 probes of adapters at run time (slots swapped between adapters of other ranks and targets, in-place
reloads and unloads under running and waiting requests, the server's load/unload routes under concurrent requests,
the prefix cache across adapters), with peft as the oracle."""

from __future__ import annotations

import threading

import pytest

from lora_helpers import PeftOracle, three_adapters

httpx = pytest.importorskip("httpx")  # the serve extra
pytest.importorskip("fastapi")

PROMPT = [5, 17, 99, 230, 41, 7, 8, 9]
N = 6


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return three_adapters(tmp_path_factory.mktemp("s52-lorart"), seed=52)


@pytest.fixture(scope="module")
def oracle(paths):
    hf, adapters = paths
    return PeftOracle(hf, adapters)


def test_the_choices_of_one_request_never_straddle_an_in_place_reload(paths, oracle, monkeypatch):
    """A request of two prompts (or n > 1) is added choice by choice; an in-place reload the engine thread ran
    between two of them gave the first choice the old weights and the second the new ones: one response, two
    adapters. Every choice of a request is accepted before the reload, or every one after it."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine

    _, adapters = paths
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8))
    aengine = AsyncEngine(engine)
    engine.add_lora("x", str(adapters["a"]))
    new = engine.lora_manager.load("x", str(adapters["b"]))
    real_add, reloaded = aengine.add, threading.Event()

    def add(request_id, prompt, params, lora, queue):
        real_add(request_id, prompt, params, lora, queue)
        if request_id.endswith("-0") and lora == "x" and not reloaded.is_set():
            # the reload reaches the engine thread now, between this request's first and second choice
            def reload(engine):
                engine.add_lora("x", str(adapters["b"]), loaded=new, replace=True)
                reloaded.set()
            with aengine._cond:
                aengine._controls.append((reload, None, None))
                aengine._cond.notify()
            reloaded.wait(timeout=3)  # (it cannot run before this request's choices are all accepted)
    monkeypatch.setattr(aengine, "add", add)
    try:
        with serve_in_thread(Server(aengine, "tiny-llama", runtime_lora=True)) as url:
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "x", "prompt": [PROMPT, PROMPT], "max_tokens": N, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            tokens = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
            assert reloaded.wait(timeout=60)
            assert tokens == [oracle.greedy("a", PROMPT, N)] * 2
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "x", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.json()["choices"][0]["token_ids"] == oracle.greedy("b", PROMPT, N)
    finally:
        engine.close()


def test_an_in_place_reload_of_an_adapter_nobody_uses_does_not_read_its_old_folder_again(paths, oracle, tmp_path):
    """--max-cpu-loras 1: x's CPU copy was dropped. Reloading x in place while no request used it read x's old folder
    again on the engine thread (holding up every step; a second disk load counted), only to free it at once: as an
    unload of an adapter nobody uses, its old weights are dropped without being read."""
    import shutil

    from infer import LLM, SamplingParams

    _, adapters = paths
    old = shutil.copytree(adapters["a"], tmp_path / "x")
    with LLM("tiny-llama", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, max_model_len=64) as llm:
        llm.add_lora("x", str(old))
        llm.add_lora("y", str(adapters["c"]))  # x's CPU copy is dropped
        manager = llm.engine.lora_manager
        reads = manager.disk_loads
        llm.add_lora("x", str(adapters["b"]), replace=True)
        assert manager.disk_loads == reads + 1  # the new folder only (was + 2: the old one read again)
        assert manager.retired() == [] and sorted(llm.list_loras()) == ["x", "y"]
        params = SamplingParams(max_new_tokens=N, ignore_eos=True)
        assert llm.generate([PROMPT], params, lora="x")[0].token_ids == oracle.greedy("b", PROMPT, N)


def test_the_samples_of_one_async_llm_request_never_straddle_an_in_place_reload(paths, monkeypatch):
    """AsyncLLM.generate with n > 1 adds its samples one by one: an in-place reload the engine thread ran between two
    of them gave the samples of one request two adapters' weights (and two prefix-cache keys)."""
    import asyncio

    from infer import SamplingParams
    from infer.serve.async_llm import AsyncLLM

    _, adapters = paths
    llm = AsyncLLM("tiny-llama", enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64)
    engine = llm.engine
    new = engine.lora_manager.load("x", str(adapters["b"]))
    keys = {}
    real_request = engine.add_request

    def add_request(request_id, prompt, params, lora=None, **kw):
        keys[request_id] = engine.lora_manager.cache_key(lora)  # which registration of the name it runs with
        return real_request(request_id, prompt, params, lora, **kw)
    monkeypatch.setattr(engine, "add_request", add_request)
    real_add, reloaded = llm._loop.add, threading.Event()

    def add(request_id, prompt, params, lora, queue):
        real_add(request_id, prompt, params, lora, queue)
        if request_id == "0_r":
            def reload(engine):
                engine.add_lora("x", str(adapters["b"]), loaded=new, replace=True)
                reloaded.set()
            with llm._loop._cond:
                llm._loop._controls.append((reload, None, None))
                llm._loop._cond.notify()
            reloaded.wait(timeout=3)  # (it cannot run before the request's samples are all accepted)
    monkeypatch.setattr(llm._loop, "add", add)

    async def main():
        await llm.add_lora("x", str(adapters["a"]))
        params = SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True)
        return [out async for out in llm.generate({"prompt_token_ids": PROMPT}, params, "r", lora="x")]
    try:
        outs = asyncio.run(main())
        assert outs and outs[-1].finished
        assert reloaded.wait(timeout=60)
        assert keys["0_r"] == keys["1_r"] == ("x", 1)
    finally:
        llm.shutdown()


def test_data_parallel_choices_of_one_request_never_straddle_an_in_place_reload(paths, monkeypatch):
    """With --data-parallel the driver thread took a request's first choice and a reload (queued before it) in one
    turn, routed the choice, ran the reload on the replicas, and the second choice reached its replica after it: one
    response on two adapters' weights. The driver routes every choice of a request accepted before it runs a
    control."""
    from test_probes_session46_dpbeam import _dp

    from infer.serve.app import serve_in_thread

    _, adapters = paths
    replicas, handles, aengine, server = _dp({"b": adapters["a"]}, start=False)
    keys = {}
    for replica in replicas:
        def add_request(request_id, prompt, params, lora=None, _engine=replica.engine,
                        _real=replica.engine.add_request, **kw):
            keys[request_id] = _engine.lora_manager.cache_key(lora)  # which registration of the name it runs with
            return _real(request_id, prompt, params, lora, **kw)
        monkeypatch.setattr(replica.engine, "add_request", add_request)
    real_add, reloaded = aengine.add, threading.Event()

    def add(request_id, prompt, params, lora, queue):
        real_add(request_id, prompt, params, lora, queue)
        if request_id.endswith("-0") and lora == "b" and not reloaded.is_set():
            def reload(engine):  # (what add_lora(load_inplace) has the driver thread run)
                engine._on_replicas_after_sent(lambda r: r.handle.add_lora.remote("b", str(adapters["c"]), True),
                                               list(engine.replicas))
                reloaded.set()
            with aengine._cond:
                aengine._controls.append((reload, None, None))
                aengine._cond.notify()
            reloaded.wait(timeout=3)  # (it cannot run before this request's choices are all accepted)
    monkeypatch.setattr(aengine, "add", add)
    with serve_in_thread(server) as url:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "b", "prompt": [PROMPT, PROMPT], "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert reloaded.wait(timeout=60)
    choices = sorted(rid for rid in keys if rid.startswith("cmpl-"))
    assert len(choices) == 2 and [keys[rid] for rid in choices] == [("b", 1)] * 2, keys
