"""Session 41 probes of adapters at run time (LLMEngine.add_lora / remove_lora, what POST /v1/load_lora_adapter and
/v1/unload_lora_adapter call), with peft as the oracle: a name unloaded while its requests still run can be loaded
again at once (as in vLLM), each request keeping its own weights and prefix-cache key; an adapter name cannot take
the private key under which replaced weights finish their requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.errors import LoRANameError

from lora_helpers import PeftOracle, finish_all, three_adapters

PROMPT = list(range(5, 45))  # two full blocks of 16: the prefix cache holds them
N = 6


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return three_adapters(tmp_path_factory.mktemp("s41-lora"), seed=40)


@pytest.fixture(scope="module")
def oracle(paths):
    hf, adapters = paths
    return PeftOracle(hf, adapters)


def test_a_name_unloaded_while_its_requests_run_can_be_loaded_again_at_once(paths, oracle):
    """vLLM frees the name at once; infer answered 400 'being removed' until the old requests ended (which a client
    cannot see), though load_inplace on that same unloaded name worked."""
    _, adapters = paths
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8))
    try:
        params = SamplingParams(max_new_tokens=N, ignore_eos=True)
        engine.add_lora("a", str(adapters["a"]))
        engine.add_request("old", PROMPT, params, lora="a")
        engine.step()  # its prompt's K/V are computed (and cached) with a's weights
        assert engine.remove_lora("a") == 1
        engine.add_lora("a", str(adapters["c"]))  # was: LoRANameError 'being removed'
        assert engine.list_loras() == ["a"]
        engine.add_request("new", PROMPT, params, lora="a")
        engine.add_request("base", PROMPT, params)
        done = finish_all(engine)
        assert done["old"] == oracle.greedy("a", PROMPT, N)
        assert done["new"] == oracle.greedy("c", PROMPT, N)  # no block of a's K/V, in a slot swap either
        assert done["base"] == oracle.greedy(None, PROMPT, N)
        assert engine.lora_manager.retired() == [] and engine.lora_manager.names() == ["a"]  # old weights freed
        assert engine.stats()["lora_swaps"] == 2  # a, then c, through the one slot
    finally:
        engine.close()


def test_an_adapter_name_with_a_nul_cannot_take_the_key_of_replaced_weights(paths, oracle):
    """Replaced weights finish their requests under NAME + NUL + registration; a JSON lora_name can hold a NUL, and an
    adapter loaded under such a name was overwritten (and later freed) by the replace, unlisted from /v1/models."""
    _, adapters = paths
    with LLM("tiny-llama", enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256) as llm:
        llm.add_lora("x", str(adapters["a"]))
        key = f"x\x00{llm.engine.lora_manager.cache_key('x')[1]}"
        with pytest.raises(LoRANameError, match="NUL"):
            llm.add_lora(key, str(adapters["c"]))
        assert llm.list_loras() == ["x"]


def test_an_adapters_models_card_has_its_folder_as_root_as_in_vllm(paths):
    """vLLM's /v1/models card of an adapter: root = the folder it was loaded from (infer gave its name again), so a
    client can see which folder a name serves, after a load_inplace too."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine

    _, adapters = paths
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8,
                                    loras={"a": str(adapters["a"])}))
    try:
        with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama", runtime_lora=True)) as url:
            def roots():
                return {m["id"]: m["root"] for m in httpx.get(f"{url}/v1/models").json()["data"]}

            assert Path(roots()["a"]).samefile(adapters["a"])
            r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])})
            assert r.status_code == 200
            assert Path(roots()["b"]).samefile(adapters["b"])
            r = httpx.post(f"{url}/v1/load_lora_adapter",
                           json={"lora_name": "b", "lora_path": str(adapters["c"]), "load_inplace": True})
            assert r.status_code == 200
            assert Path(roots()["b"]).samefile(adapters["c"])
    finally:
        engine.close()


def test_two_loads_of_one_name_at_once_tell_the_second_client_about_load_inplace(paths):
    """Both pass the check made before the folder is read; the second was refused by the engine's own check, whose
    hint is for Python (`add_lora(name, path, replace=True)`), on an HTTP route."""
    import asyncio

    from infer.serve.async_engine import AsyncEngine

    _, adapters = paths
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8))
    aengine = AsyncEngine(engine)

    async def both():
        aengine.start()
        try:
            return await asyncio.gather(aengine.add_lora("k", str(adapters["a"])),
                                        aengine.add_lora("k", str(adapters["b"])), return_exceptions=True)
        finally:
            await asyncio.to_thread(aengine.shutdown, 10)

    try:
        results = asyncio.run(both())  # either may be read first
        assert results.count(None) == 1
        error = next(r for r in results if r is not None)
        assert isinstance(error, LoRANameError)
        assert "load_inplace: true" in str(error) and "add_lora(" not in str(error)
    finally:
        engine.close()
