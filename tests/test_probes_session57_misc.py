"""Probes of the fifty-seventh session (misc): vLLM's sleep modes (sleep(level, mode="abort"|"wait"|"keep")) in the
engine, LLM, AsyncLLM, collective_rpc and `POST /sleep?mode=`; reload_weights of a checkpoint whose GPTQ layout
differs; the memory plan's advice when no sequence fits the KV blocks."""

from __future__ import annotations

import asyncio
import threading

import pytest

from infer import LLM, SamplingParams
from infer.errors import RequestError, SleepModeError
from infer.models.tiny import ensure_builtin

from helpers import run_in_sleep_mode_async_llm, served_in_sleep_mode, tiny_llama_str as path  # noqa: F401 (path)

PROMPTS = [[5, 9, 13, 21], [7, 3, 2, 8, 11, 40]]
LONG = SamplingParams(max_tokens=20, ignore_eos=True)


def _llm(path, **kw):
    return LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True, **kw)


def _drive(engine, sleep=None) -> dict:
    """Two requests stepped to their end; `sleep(engine)` called after three steps. Their last outputs by id."""
    engine.add_request("a", PROMPTS[0], LONG)
    engine.add_request("b", PROMPTS[1], LONG)
    outs = []
    for _ in range(3):
        outs += engine.step()
    if sleep is not None:
        outs += sleep(engine)
    for _ in range(200):  # (bounded)
        if not engine.has_unfinished_requests():
            break
        outs += engine.step()
    return {o.request_id: (o.finish_reason, list(o.token_ids)) for o in outs if o.finished}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("level", [1, 2])
def test_keep_pauses_the_requests_and_they_go_on_after_wake_up(path, overlap, level):
    """sleep(mode="keep") (vLLM's): the requests running are paused (their KV blocks freed, the memory freed), steps
    meanwhile run nothing and end nothing, new requests are refused; after wake_up (level 2: and reload_weights,
    vLLM's RLHF order) they go on, greedy tokens equal to a run never put to sleep."""
    def sleep(engine):
        engine.sleep(level, mode="keep")
        assert engine.is_sleeping() and engine.has_unfinished_requests()
        outs = []
        for _ in range(5):  # a step while asleep hands out what it must and runs nothing
            outs += engine.step()
        assert engine.is_paused() and not [o for o in outs if o.finished]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert len(engine.scheduler.waiting) == 2 and not engine.scheduler.running
        assert engine.stats()["num_preemptions"] == 0  # (a pause: no preemption counted)
        with pytest.raises(SleepModeError, match="asleep"):
            engine.add_request("c", PROMPTS[0], LONG)
        if level == 2:
            engine.wake_up(["weights"])
            engine.reload_weights()  # (the paused requests hold no K/V: they go on with the weights loaded)
        engine.wake_up()
        assert not engine.is_paused()
        return outs

    with _llm(path, overlap=overlap) as llm:
        want = _drive(llm.llm_engine)
        assert want["a"][0] == want["b"][0] == "length"
        assert _drive(llm.llm_engine, sleep) == want


@pytest.mark.parametrize("overlap", [False, True])
def test_wait_lets_the_requests_finish_before_the_memory_is_freed(path, overlap):
    """sleep(mode="wait"): the requests run to their end first (their outputs handed out by the next step, tokens as
    ever, finish_reason "length"), then the memory is freed."""
    def sleep(engine):
        engine.sleep(1, mode="wait")
        assert engine.is_sleeping() and not engine.scheduler.has_unfinished()
        outs = engine.step()
        assert not engine.has_unfinished_requests()
        engine.wake_up()
        return outs

    with _llm(path, overlap=overlap) as llm:
        want = _drive(llm.llm_engine)
        assert _drive(llm.llm_engine, sleep) == want


def test_a_bad_mode_is_refused_before_anything_is_done(path):
    """A mode other than abort / wait / keep is refused naming the three; nothing is aborted or freed. vLLM's default
    (abort) is unchanged, and collective_rpc("sleep") takes the mode too."""
    with _llm(path) as llm:
        engine = llm.llm_engine
        engine.add_request("a", PROMPTS[0], LONG)
        engine.step()
        for mode in ("pause", None, 1, "KEEP"):
            with pytest.raises(RequestError, match="sleep mode must be one of 'abort', 'wait', 'keep'") as e:
                llm.sleep(1, mode)
            assert "mode=\"keep\"" in e.value.hint
        assert not llm.is_sleeping() and engine.scheduler.running
        llm.collective_rpc("sleep", kwargs={"level": 1, "mode": "keep"})
        assert llm.is_sleeping() and engine.scheduler.has_unfinished()
        llm.collective_rpc("wake_up")
        llm.sleep(1)  # abort
        outs = engine.step()
        assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("a", "abort")]


def test_another_threads_generate_is_paused_and_finishes_after_wake_up(path, monkeypatch):
    """LLM.sleep(mode="keep") while another thread's generate runs: that generate waits (it does not spin on the
    lock the waking thread needs, nor end) and returns, after wake_up, the tokens of a run never put to sleep."""
    with _llm(path) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, LONG)]
        engine, real, steps = llm.llm_engine, llm.llm_engine.step, []

        def step():
            steps.append(1)
            if len(steps) == 3:  # (generate's own thread, holding the LLM's lock: the sleep lands between steps)
                llm.sleep(1, mode="keep")
            return real()

        monkeypatch.setattr(engine, "step", step)
        got = []
        worker = threading.Thread(target=lambda: got.append(llm.generate(PROMPTS, LONG)))
        worker.start()
        for _ in range(6000):  # (bounded: ~60 s)
            if llm.is_sleeping():
                break
            threading.Event().wait(0.01)
        assert llm.is_sleeping() and worker.is_alive()
        llm.wake_up()
        worker.join(60)
        assert not worker.is_alive()
        assert [list(o.outputs[0].token_ids) for o in got[0]] == want


def test_async_llm_wait_and_keep(path):
    """AsyncLLM.sleep(level, mode): "keep" pauses a running generate, which finishes after wake_up() with the
    tokens of an uninterrupted one; "wait" returns once the running generate finished (finish_reason "length"),
    refusing new generates while it waits."""
    async def run(llm, rid, on_first=None):
        outs = []
        async for out in llm.generate(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True), rid):
            outs.append(out)
            if len(outs) == 1 and on_first is not None:
                await on_first()
        return outs[-1].outputs[0]

    async def main(llm):
        want = await run(llm, "a")

        engine, real, idle = llm.engine, llm.engine.step, []

        def step():
            if engine.is_paused():  # (a step that would run nothing: the loop waits instead of spinning on it)
                idle.append(1)
            return real()

        async def keep():
            await llm.sleep(1, mode="keep")
            assert await llm.is_sleeping()
            engine.step = step
            await asyncio.sleep(0.05)  # (the engine loop's chance to step, were the generate not paused)
            assert not idle
            del engine.step
            await llm.wake_up()

        got = await run(llm, "b", keep)
        assert list(got.token_ids) == list(want.token_ids) and got.finish_reason == "length"

        sleeping = []

        async def wait():
            task = asyncio.ensure_future(llm.sleep(1, mode="wait"))
            for _ in range(1000):
                if llm._loop._draining:
                    break
                await asyncio.sleep(0)
            with pytest.raises(SleepModeError, match="going to sleep"):
                await run(llm, "d")
            sleeping.append(task)

        got = await run(llm, "c", wait)
        await sleeping[0]
        assert list(got.token_ids) == list(want.token_ids) and got.finish_reason == "length"
        assert await llm.is_sleeping()
        with pytest.raises(RequestError, match="sleep mode must be one of"):
            await llm.sleep(1, mode="later")
        await llm.wake_up()
        assert list((await run(llm, "e")).token_ids) == list(want.token_ids)

    run_in_sleep_mode_async_llm(path, main)


def test_the_server_takes_vllms_mode_parameter(path):
    """POST /sleep?level=1&mode=keep (vLLM's route): a completion in flight is paused and answered after POST
    /wake_up with the text of an uninterrupted one; mode=wait answers once the requests in flight finished; another
    mode is a 400 naming the parameter."""
    httpx = pytest.importorskip("httpx")
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with served_in_sleep_mode(path) as (url, engine):
        want = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        r = httpx.post(f"{url}/sleep?level=1&mode=later", timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
        assert "abort, wait or keep" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": False}
        for mode in ("keep", "wait"):
            got = []
            client = threading.Thread(target=lambda: got.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                           timeout=120)))
            client.start()
            for _ in range(6000):  # (bounded) until the completion runs
                if engine.scheduler.running:
                    break
                threading.Event().wait(0.005)
            assert httpx.post(f"{url}/sleep?level=1&mode={mode}", timeout=120).status_code == 200
            assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": True}
            if mode == "wait":  # answered before /sleep was
                client.join(60)
                assert got and got[0].status_code == 200
            assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
            client.join(60)
            assert got[0].status_code == 200, got[0].text
            assert got[0].json()["choices"][0]["text"] == want
            assert got[0].json()["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- 2. reload_weights of another layout
@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """tiny-llama's float checkpoint and two GPTQ ones of it (round to nearest): int4 with groups of 32 in plain
    order, and int8 with groups of 16 in act-order (g_idx a permutation)."""
    import shutil

    from test_probes_session56_review_moeq import rtn_gptq
    root = tmp_path_factory.mktemp("layouts")
    shutil.copytree(ensure_builtin("tiny-llama"), root / "float")
    rtn_gptq(root / "float", root / "g32", group_size=32)
    rtn_gptq(root / "float", root / "g16act8", group_size=16, act_order=True, bits=8)
    return root


def _reloaded(root, old: str, new: str):
    """An engine on a copy of checkpoint `old`, `new` written over the folder: the LLM, the folder."""
    import shutil
    folder = root / f"{old}-{new}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(root / old, folder)
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32)
    for f in ("model.safetensors", "config.json"):
        shutil.copy(root / new / f, folder / f)
    return llm


@pytest.mark.parametrize("old,new", [("g32", "g16act8"), ("g16act8", "g32")])
def test_reload_weights_takes_another_group_size_act_order_and_bits(layouts, monkeypatch, old, new):
    """reload_weights of a checkpoint whose GPTQ layers have another group size, act-order and bits than the loaded
    ones: the layers' method (its config) and their kernel layout's group size and interleave, computed at load and
    held as no tensors, are taken with the tensors, so the tokens and logprobs (the GPU path: packed int4/int8,
    interleaved rows) equal those of a fresh load of the new checkpoint. They kept the old load's: other tokens, or
    NaN."""
    from quant_helpers import int4_kernel_path
    int4_kernel_path(monkeypatch)
    prompts = [[5, 9, 13, 21, 40], [7, 3, 2, 8, 11, 40, 77]]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    with LLM(str(layouts / new), block_size=4, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32) as llm:
        want = [o.outputs[0] for o in llm.generate(prompts, params)]
    with _reloaded(layouts, old, new) as llm:
        llm.collective_rpc("reload_weights")
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [g.finish_reason for g in got] == ["length", "length"]
    assert [list(g.token_ids) for g in got] == [list(w.token_ids) for w in want]
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


@pytest.mark.parametrize("old,new", [("float", "g32"), ("g32", "float")])
def test_reload_weights_refuses_other_layers_quantized_before_freeing_anything(layouts, old, new):
    """A checkpoint that quantizes other layers (GPTQ where float was loaded, or float where GPTQ was) is refused
    naming the layer and what to do, before the loaded weights are freed: the engine runs on as before."""
    from infer.errors import ModelLoadError
    prompts = [[5, 9, 13, 21, 40]]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with _reloaded(layouts, old, new) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        with pytest.raises(ModelLoadError, match="q_proj is (quantized \\(GPTQ\\)|float) in the new checkpoint") as e:
            llm.collective_rpc("reload_weights")
        assert "start a new engine" in e.value.hint
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)] == want


# --------------------------------------------------------------------------- 3. blocks too few for any sequence
def _refusal(path, **kw):
    from infer.errors import InferError
    with pytest.raises(InferError) as e:
        LLM(str(path), **kw)
    return e.value


def _lengths_advised(err) -> list[int]:
    import re
    return [int(n) for n in re.findall(r"--max-model-len(?: to)? (\d+)", f"{err.message} {err.hint}")]


@pytest.mark.parametrize("family,blocks,fewest", [("gemma2", 1, 3), ("gemma2", 2, 3), ("mistral", 1, 2),
                                                  ("tiny-llama", 1, 2)])
def test_blocks_that_hold_no_sequence_say_so_and_the_fewest_that_do(tmp_path, family, blocks, fewest):
    """num_kv_blocks so few that no sequence fits (a sliding window's placeholder takes the only block, fewer blocks
    than KV layer groups, or blocks of 1 token and one block) advised "lower --max-model-len to 0 (or 1) or less":
    the error says the blocks hold no sequence and names the fewest that do, with which the engine starts."""
    from infer.errors import ConfigError
    from test_probes_session55_swblocks import CHUNK, build as build_sw
    from test_probes_session56_hybrid2 import build as build_groups
    if family == "gemma2":
        build_groups(tmp_path, family, seed=2)
    elif family == "mistral":
        build_sw(tmp_path, family, seed=4)
    else:
        tmp_path = ensure_builtin(family)
    kw = dict(block_size=1 if family == "tiny-llama" else 4, max_num_batched_tokens=CHUNK, max_num_seqs=1)
    err = _refusal(tmp_path, num_kv_blocks=blocks, max_model_len=64, **kw)
    assert isinstance(err, ConfigError)
    assert "too few for any sequence, even one of 2 tokens" in err.message
    assert not _lengths_advised(err)  # (no length to lower --max-model-len to: none fits)
    assert f"num_kv_blocks={fewest} is the fewest that hold any sequence" in err.hint
    with LLM(str(tmp_path), num_kv_blocks=fewest, max_model_len=2, **kw) as llm:
        assert llm.generate([[5]], SamplingParams(max_tokens=1))[0].outputs[0].finish_reason == "length"
    with pytest.raises(ConfigError, match="too few for any sequence"):
        LLM(str(tmp_path), num_kv_blocks=fewest - 1, max_model_len=2, **kw)


def test_a_budget_that_holds_no_sequence_names_no_length(path):
    """A memory budget that holds no sequence said "estimated maximum model length is 0": it says no sequence fits
    (not even one of 2 tokens), and advises no length."""
    err = _refusal(path, max_model_len=4096, memory_limit="5MB")
    assert "no sequence fits, not even one of 2 tokens" in err.message
    assert "estimated maximum model length" not in err.message and not _lengths_advised(err)
    assert "raise --memory-limit" in err.hint
