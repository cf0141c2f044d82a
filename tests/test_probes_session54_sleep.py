"""Probes of the fifty-fourth session: vLLM's sleep mode (LLM(..., enable_sleep_mode=True), sleep(level=1|2),
wake_up(tags), is_sleeping(), collective_rpc("reload_weights")), in the Python API, AsyncLLM and `infer serve`
(POST /sleep, POST /wake_up, GET /is_sleeping, POST /collective_rpc). It was refused ("infer has no sleep mode")."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import RequestError, SleepModeError

from helpers import (random_prompts, run_in_sleep_mode_async_llm, served_in_sleep_mode,  # noqa: F401 (path: a fixture)
                     tiny_llama_str as path)
from lora_helpers import THREE, hf_float, save_adapter

PROMPTS = [[5, 9, 13, 21], [7, 3, 2, 8, 11, 40]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _tokens(llm, prompts=PROMPTS, params=GREEDY, **kw) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, **kw)]


def _freed(llm) -> bool:
    """Whether the model's weights and the KV cache hold no memory (their storages resized to 0 bytes)."""
    runner = llm.llm_engine.runner
    weight = runner.model.embed_tokens.weight
    return runner.kv_cache.untyped_storage().nbytes() == 0 and weight.untyped_storage().nbytes() == 0


def test_level_1_frees_the_memory_and_wakes_to_the_same_tokens(path):
    """LLM(enable_sleep_mode=True).sleep(level=1) frees the weights (a copy in host memory) and the KV cache;
    while asleep generate is refused with SleepModeError (not garbage, not a crash); wake_up() brings both back and
    greedy tokens equal those before; is_sleeping() says which."""
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True) as llm:
        want = _tokens(llm)
        assert llm.is_sleeping() is False
        llm.sleep(level=1)
        assert llm.is_sleeping() is True and _freed(llm)
        with pytest.raises(SleepModeError, match="asleep") as e:
            llm.generate(PROMPTS, GREEDY)
        assert "wake_up()" in e.value.hint
        llm.sleep(level=1)  # asleep already: nothing (vLLM warns)
        llm.wake_up()
        assert llm.is_sleeping() is False and not _freed(llm)
        assert _tokens(llm) == want
        llm.wake_up()  # awake already: nothing


def test_level_2_needs_the_weights_reloaded_as_vllms_rlhf_loop_does(path):
    """sleep(level=2) keeps no copy: after wake_up(["weights"]) the weights are garbage, so generate is refused until
    collective_rpc("reload_weights") reads them again (vLLM's RLHF order: weights, reload, then the KV cache); then
    the tokens equal those before. Waking both without reloading is refused naming reload_weights."""
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True) as llm:
        want = _tokens(llm)
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()  # the KV cache still asleep
        with pytest.raises(SleepModeError, match="kv_cache"):
            llm.generate(PROMPTS, GREEDY)
        assert llm.collective_rpc("reload_weights") == [None]
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        assert _tokens(llm) == want
        llm.sleep(level=2)
        llm.wake_up()
        with pytest.raises(SleepModeError, match="discarded \\(by sleep\\(level=2\\)") as e:
            llm.generate(PROMPTS, GREEDY)
        assert "reload_weights" in e.value.hint
        llm.llm_engine.reload_weights()
        assert _tokens(llm) == want


def test_reload_weights_frees_the_old_ones_first_and_a_failed_load_leaves_none(path, monkeypatch):
    """reload_weights frees the old weights' memory before it loads the new ones (one model's worth at a time, not
    two); a load that fails leaves the engine refusing requests (SleepModeError) until a reload succeeds."""
    import infer.models.loader as loader
    from infer.errors import ModelLoadError
    real = loader.load_model
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True) as llm:
        want = _tokens(llm)
        weight = llm.llm_engine.runner.model.embed_tokens.weight
        seen = []

        def failing(*args, **kwargs):
            seen.append(weight.untyped_storage().nbytes())
            raise ModelLoadError("the checkpoint is being written")
        monkeypatch.setattr(loader, "load_model", failing)
        with pytest.raises(ModelLoadError):
            llm.collective_rpc("reload_weights")
        assert seen == [0]  # freed before the load
        with pytest.raises(SleepModeError, match="reload_weights\\(\\) that failed"):
            llm.generate(PROMPTS, GREEDY)
        monkeypatch.setattr(loader, "load_model", real)
        llm.collective_rpc("reload_weights")
        assert _tokens(llm) == want


@pytest.mark.parametrize("overlap", [False, True])
def test_sleep_aborts_the_running_requests(path, overlap):
    """As vLLM's sleep (mode "abort"): requests running or waiting end with finish_reason "abort" (handed out by the
    next step, so their callers are not left waiting); the prefix cache is forgotten; add_request is refused. With
    the overlapped step, the step still on the device is completed first (its memory is what sleep frees)."""
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True, overlap=overlap) as llm:
        engine = llm.llm_engine
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
        engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True))
        engine.step()
        engine.step()
        assert (engine._inflight is not None) == overlap
        engine.sleep(1)
        assert engine._inflight is None and engine._unsettled is None
        outs = []
        for _ in range(4):  # (bounded: a request left running would keep it true for ever)
            outs += engine.step()
        assert not engine.has_unfinished_requests()
        assert sorted((o.request_id, o.finish_reason) for o in outs if o.finished) == [("a", "abort"), ("b", "abort")]
        assert not engine.block_manager.hash_to_block
        with pytest.raises(SleepModeError):
            engine.add_request("c", PROMPTS[0], GREEDY)
        engine.wake_up()
        engine.add_request("c", PROMPTS[0], GREEDY)


def test_sleep_mode_is_checked(path):
    """sleep() of an engine started without enable_sleep_mode is refused naming the option; a level other than 1 or
    2 and a tag other than weights / kv_cache are refused; enable_sleep_mode is an option of its own (EngineArgs)."""
    from infer import EngineArgs
    with LLM(path, block_size=4, max_model_len=64) as llm:
        with pytest.raises(SleepModeError, match="without sleep mode") as e:
            llm.sleep()
        assert "enable_sleep_mode=True" in e.value.hint
        assert not llm.is_sleeping()
    assert EngineArgs(model=path, enable_sleep_mode=True).create_engine_config().enable_sleep_mode is True
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True) as llm:
        for level in (0, 3, True, "1"):
            with pytest.raises(RequestError, match="sleep level must be 1"):
                llm.sleep(level)
        llm.sleep()
        with pytest.raises(RequestError, match="unknown wake_up tag 'kv'"):
            llm.wake_up(["kv"])
        assert llm.is_sleeping()
        llm.wake_up(["weights", "kv_cache"])
        assert not llm.is_sleeping()
        llm.sleep()
        llm.wake_up([])  # (vLLM's server reads no tags as every tag)
        assert not llm.is_sleeping()


def test_collective_rpc_calls_the_one_worker(path):
    """vLLM's LLM.collective_rpc: a method name of the worker, or a function called with the worker first
    (worker.model_runner.model is the model), their results in a list of one; an unknown name is refused."""
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True) as llm:
        got = llm.collective_rpc(lambda worker, k: (type(worker.model_runner.model).__name__, k), args=(3,))
        assert got == [("LlamaForCausalLM", 3)]
        assert llm.collective_rpc("is_sleeping") == [False]
        llm.collective_rpc("sleep", kwargs={"level": 1})
        assert llm.is_sleeping()
        llm.collective_rpc("wake_up")
        with pytest.raises(RequestError, match="no method 'nope'"):
            llm.collective_rpc("nope")


def test_adapters_survive_both_levels(path, tmp_path):
    """A LoRA adapter's slots are copied to host memory at both levels (reload_weights reads the base model's
    checkpoint only): after sleep and wake_up (level 2: and reload_weights) an adapter's tokens equal those before.
    Adding or removing an adapter while asleep is refused (a removal clears its slot, freed memory)."""
    hf = hf_float(path)
    adapter = str(save_adapter(hf, tmp_path / "a", seed=3, **THREE["a"]))
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True, loras={"a": adapter},
             max_lora_rank=8) as llm:
        want = _tokens(llm, lora=["a", None])
        assert want != _tokens(llm)  # the adapter changes them
        llm.sleep(1)
        llm.wake_up()
        assert _tokens(llm, lora=["a", None]) == want
        llm.sleep(2)
        for change in (lambda: llm.add_lora("b", adapter), lambda: llm.remove_lora("a")):
            with pytest.raises(SleepModeError, match="asleep"):  # (they write the freed slots)
                change()
        llm.wake_up()
        llm.collective_rpc("reload_weights")
        assert _tokens(llm, lora=["a", None]) == want


def test_async_llm_sleeps_as_vllms(path):
    """vLLM's AsyncLLM.sleep / wake_up / is_sleeping / collective_rpc are coroutines; a generate while asleep is
    refused, and the tokens after waking equal those before."""
    async def tokens(llm, rid):
        outs = [o async for o in llm.generate(PROMPTS[0], GREEDY, rid)]
        return list(outs[-1].outputs[0].token_ids)

    async def main(llm):
        want = await tokens(llm, "a")
        await llm.sleep(2)
        assert await llm.is_sleeping() is True
        with pytest.raises(SleepModeError):
            await tokens(llm, "b")
        await llm.wake_up(["weights"])
        assert await llm.collective_rpc("reload_weights") == [None]
        await llm.wake_up(["kv_cache"])
        assert await llm.is_sleeping() is False
        assert await tokens(llm, "c") == want

    run_in_sleep_mode_async_llm(path, main)


def test_the_server_has_vllms_sleep_routes(path):
    """`infer serve --enable-sleep-mode`: POST /sleep?level=N, POST /wake_up?tags=..., GET /is_sleeping and POST
    /collective_rpc, as vLLM's; a completion while asleep is a 503 engine_sleeping; a bad level a 400."""
    httpx = pytest.importorskip("httpx")
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with served_in_sleep_mode(path) as (url, _):
        want = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": False}
        assert httpx.post(f"{url}/sleep?level=3", timeout=60).status_code == 400
        r = httpx.post(f"{url}/sleep?level=2", timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
        assert httpx.post(f"{url}/wake_up?tags=weights", timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": True}  # (the KV cache)
        r = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=60)
        assert r.status_code == 200 and r.json() == {"results": [None]}
        assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": False}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_the_gpu_path_wakes_with_its_graphs_captured_again(tmp_path, monkeypatch):
    """The engine's GPU code path on CPU (an int4 AWQ model through the Triton kernels, interpreted; emulated CUDA
    graphs; the overlapped step; an adapter): sleep drops the graphs (they hold the old addresses), wake_up
    captures them again, and the tokens after either level equal those before, through the graphs."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (test_sleep_frees_gpu_memory)")
    from quant_helpers import int4_kernel_path
    from test_lora_engine import SPECS
    from test_probes_session53_awq import float_model, write_awq
    base = float_model(tmp_path)
    write_awq(base, tmp_path / "awq")
    adapter = str(save_adapter(hf_float(base), tmp_path / "qv4", seed=2, **SPECS["qv4"]))
    prompts = random_prompts(512, (5, 3), seed=4)
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path / "awq"), overlap=True, block_size=4, max_model_len=32, max_num_seqs=4,
             cuda_graph_max_tokens=4, loras={"qv4": adapter}, max_lora_rank=8, enable_sleep_mode=True) as llm:
        runner = llm.llm_engine.runner
        assert runner.model.layers[0].self_attn.qkv_proj.weight is None  # really the packed int4 path
        runner.capture_graphs(8, emulate=True)
        want = _tokens(llm, prompts, SamplingParams(max_tokens=4, ignore_eos=True), lora=["qv4", None])
        for level in (1, 2):
            llm.sleep(level)
            assert runner.graphs is None
            llm.wake_up()
            if level == 2:
                assert runner.graphs is None  # (not over garbage weights)
                llm.collective_rpc("reload_weights")
            assert runner.graphs is not None and runner.graphs.emulate
            got = _tokens(llm, prompts, SamplingParams(max_tokens=4, ignore_eos=True), lora=["qv4", None])
            assert got == want
            assert sum(runner.graphs.replays.values()) > 0


@pytest.mark.gpu
def test_sleep_frees_gpu_memory(path):
    """On a GPU, sleep gives the weights' and the KV cache's memory back (torch.cuda.memory_allocated), and the
    tokens after wake_up (level 2: after reload_weights) equal those before."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    with LLM(path, block_size=16, max_model_len=256, enable_sleep_mode=True, gpu_memory_utilization=0.2) as llm:
        runner = llm.llm_engine.runner
        kv = runner.kv_cache.untyped_storage().nbytes()
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        want = _tokens(llm)
        for level in (1, 2):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            llm.sleep(level)
            assert before - torch.cuda.memory_allocated() >= kv + weights * 0.9
            llm.wake_up()
            if level == 2:
                llm.collective_rpc("reload_weights")
            assert _tokens(llm) == want
