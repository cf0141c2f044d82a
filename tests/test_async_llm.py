"""infer.AsyncLLM, vLLM's asyncio engine API: concurrent `generate` calls of one event loop batch on one engine
thread and give transformers' greedy tokens (peft's with an adapter added while running); a caller that stops
reading aborts its request and frees its KV blocks; bad requests raise before anything runs; shutdown ends what is in
flight and refuses new work."""

from __future__ import annotations

import asyncio

import pytest

from infer import AsyncLLM, SamplingParams
from infer.errors import ClosedError, InferError, RequestError, RequestIdTypeError
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts
from lora_helpers import THREE, hf_float, save_adapter

P = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


@pytest.fixture(scope="module")
def llm(path):
    engine = AsyncLLM(path, max_model_len=64, block_size=4, enable_lora=True, max_lora_rank=8)
    yield engine
    engine.shutdown()


async def _collect(llm, prompt, rid, params=P, **kw) -> list:
    return [out async for out in llm.generate(prompt, params, rid, **kw)]


async def _settled(llm) -> None:
    """Wait (a bounded number of polls) for the engine thread to take what was aborted."""
    for _ in range(500):
        if not llm.engine.requests and llm.engine.block_manager.num_used_blocks == 0:
            return
        await asyncio.sleep(0.01)


def test_concurrent_generates_batch_and_match_transformers(llm, path):
    prompts = random_prompts(512, (5, 9, 3), seed=4)

    async def main():
        return await asyncio.gather(*(_collect(llm, p, f"r{i}") for i, p in enumerate(prompts)))
    runs = asyncio.run(main())
    for prompt, outs in zip(prompts, runs):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].token_ids == hf_greedy(path, prompt, 6)
        assert "".join(o.delta_text for o in outs) == outs[-1].text
    text = llm.tokenizer.decode(prompts[0])
    by_text = asyncio.run(_collect(llm, {"prompt": text, "cache_salt": "s"}, "t"))
    by_ids = asyncio.run(_collect(llm, llm.tokenizer(text)["input_ids"], "i"))
    assert by_text[-1].token_ids == by_ids[-1].token_ids and by_text[-1].prompt_token_ids == by_ids[-1].prompt_token_ids


def test_a_salted_prompt_shares_no_cached_prefix(llm):
    prompt = list(range(20, 33))

    async def main():
        await _collect(llm, prompt, "warm")
        plain = await _collect(llm, {"prompt_token_ids": prompt}, "again")
        salted = await _collect(llm, {"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, "salted")
        return plain[-1].num_cached_tokens, salted[-1].num_cached_tokens
    assert asyncio.run(main()) == (12, 0)


def test_reset_prefix_cache_forgets_the_cached_prompt(llm):
    prompt = list(range(40, 53))

    async def main():
        await _collect(llm, prompt, "cold")
        warm = await _collect(llm, prompt, "warm")
        assert await llm.reset_prefix_cache() is True
        reset = await _collect(llm, prompt, "reset")
        return warm[-1].num_cached_tokens, reset[-1].num_cached_tokens
    assert asyncio.run(main()) == (12, 0)


def test_leaving_the_loop_aborts_the_request_and_frees_its_blocks(llm, monkeypatch):
    aborted = []
    real = llm._loop.abort
    monkeypatch.setattr(llm._loop, "abort", lambda rid: aborted.append(rid) or real(rid))

    async def main():
        got = []
        async for out in llm.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=40, ignore_eos=True), "early"):
            got.append(out)
            if len(got) == 2:
                break
        await _settled(llm)
        return got
    got = asyncio.run(main())
    assert len(got) == 2 and not got[-1].finished
    assert not llm.engine.requests and llm.engine.block_manager.num_used_blocks == 0

    async def cancelled():
        first = asyncio.Event()

        async def consume():  # (cancelled right after its first output: 60 tokens are not done by then)
            async for _ in llm.generate([5, 6, 7], SamplingParams(max_new_tokens=60, ignore_eos=True), "cancel"):
                first.set()
        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _settled(llm)
        await llm.abort(["never-added"])  # an unknown id is nothing to stop
    asyncio.run(cancelled())
    assert not llm.engine.requests and llm.engine.block_manager.num_used_blocks == 0
    assert aborted == ["early", "cancel", "never-added"]  # each left early, none after it finished


@pytest.mark.parametrize("prompt, params, rid, error, match", [
    ([], P, "e", RequestError, "the prompt is empty"),
    ([5, 6], P, 7, RequestIdTypeError, "request_id must be a string"),
    ([5, 6], SamplingParams(max_new_tokens=2, priority=1), "p", RequestError, "first come, first served"),
    ({"text": "x"}, P, "d", RequestError, "prompt"),
])
def test_a_bad_request_raises_before_anything_runs(llm, prompt, params, rid, error, match):
    with pytest.raises(error, match=match):
        asyncio.run(_collect(llm, prompt, rid, params))
    assert not llm.engine.requests


def test_an_id_in_flight_is_refused_and_lora_names_an_adapter(llm):
    async def main():
        first = llm.generate([5, 6, 7], SamplingParams(max_new_tokens=30, ignore_eos=True), "dup")
        await first.__anext__()
        with pytest.raises(InferError, match="already in use"):
            await _collect(llm, [5, 6], "dup")
        await first.aclose()
        with pytest.raises(RequestError, match="lora=NAME"):
            await _collect(llm, [5, 6], "lr", lora_request=object())
        with pytest.raises(RequestError, match="first come, first served"):  # the keyword reaches the engine
            await _collect(llm, [5, 6], "pk", priority=1)
        with pytest.raises(RequestError, match="priority must be an integer"):
            await _collect(llm, [5, 6], "pb", priority=True)
        await _settled(llm)
    asyncio.run(main())


def test_an_adapter_added_while_running_gives_peft_tokens(llm, path, tmp_path):
    import torch
    from peft import PeftModel
    adapter = save_adapter(hf_float(path), tmp_path / "a", seed=3, **{**THREE["a"], "r": 4})
    prompt = [5, 9, 11, 4]

    async def main():
        await llm.add_lora("a", str(adapter))
        assert llm.list_loras() == ["a"]
        outs = await _collect(llm, prompt, "with-a", lora="a")
        base = await _collect(llm, prompt, "base")
        assert await llm.remove_lora("a") == 0 and llm.list_loras() == []
        with pytest.raises(RequestError, match="a"):
            await _collect(llm, prompt, "gone", lora="a")
        return outs[-1].token_ids, base[-1].token_ids
    with_a, base = asyncio.run(main())
    peft = PeftModel.from_pretrained(hf_float(path), str(adapter)).eval()
    with torch.no_grad():
        want = peft.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert with_a == want[0, len(prompt):].tolist() and base == hf_greedy(path, prompt, 6) != with_a


def test_shutdown_ends_what_runs_and_refuses_new_work(path):
    engine = AsyncLLM(path, max_model_len=64, block_size=4)

    async def main():
        gen = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True), "long")
        await gen.__anext__()
        assert engine.is_running
        await asyncio.to_thread(engine.shutdown)
        rest = [out async for out in gen]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        with pytest.raises(ClosedError, match="shut down"):
            await _collect(engine, [5, 6], "after")
        with pytest.raises(ClosedError):
            await engine.check_health()
    asyncio.run(main())
    assert not engine.is_running
