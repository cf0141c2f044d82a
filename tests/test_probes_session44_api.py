"""Session 44 probes of the Python API as a vLLM user porting code would use it: LLM.beam_search, AsyncLLM and
LoRARequest."""

from __future__ import annotations

import asyncio
import time

import pytest

from infer import AsyncLLM, SamplingParams

from helpers import tiny_llama_str as path  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def allm(path):
    engine = AsyncLLM(path, max_model_len=64, block_size=4)
    yield engine
    engine.shutdown()


def _settle(engine) -> None:
    for _ in range(500):
        if not engine.requests and engine.block_manager.num_used_blocks == 0:
            return
        time.sleep(0.01)


def test_abort_from_another_task_ends_the_generate(allm):
    """vLLM's AsyncLLM.abort(request_id) from another task ends that request's `async for` (it hung forever: the
    engine dropped the request's queue without a word to the generate awaiting it). The engine is gated: its second
    step waits until the abort was sent, so the request is still running when it is aborted."""
    engine = allm.engine
    real_step = engine.step

    async def main():
        outs, first, gate = [], asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        steps = []

        def gated_step():  # engine thread: every step after the first waits for the abort to have been sent
            if steps:
                asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(timeout=30)
            steps.append(1)
            return real_step()

        async def consume():
            async for out in allm.generate([5, 9, 13], SamplingParams(max_new_tokens=40, ignore_eos=True), "ab"):
                outs.append(out)
                first.set()

        async def aborter():
            await first.wait()
            await allm.abort("ab")
            gate.set()

        engine.step = gated_step
        try:
            await asyncio.wait_for(asyncio.gather(consume(), aborter()), 20)
        finally:
            engine.step = real_step
            gate.set()
        return outs
    outs = asyncio.run(main())
    assert outs and not outs[-1].finished
    _settle(engine)
    assert not engine.requests and engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def adapters(path, tmp_path_factory):
    from lora_helpers import hf_float, save_three
    return {n: str(p) for n, p in save_three(hf_float(path), tmp_path_factory.mktemp("p44_adapters"), 5, "ab").items()}


@pytest.fixture(scope="module")
def lora_llm(path):
    from infer import LLM
    with LLM(path, block_size=4, max_model_len=64, enable_lora=True, max_lora_rank=8) as engine:
        yield engine


def test_beam_search_takes_vllms_lora_request(lora_llm, adapters):
    """vLLM's LLM.beam_search(prompts, params, lora_request=...) (its third argument): a LoRARequest, or a list with
    one or None per prompt, registered on first use as generate's is. It was a TypeError by keyword and a
    RequestError ("lora must be an adapter name") as the third argument."""
    from infer import BeamSearchParams, LoRARequest
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompt = [5, 9, 13]
    by_keyword = lora_llm.beam_search([prompt], params, lora_request=LoRARequest("a", 1, adapters["a"]))[0]
    assert "a" in lora_llm.list_loras()
    by_name = lora_llm.beam_search([prompt], params, "a")[0]
    by_position = lora_llm.beam_search([prompt], params, LoRARequest("a", 1, adapters["a"]))[0]
    base, with_b = lora_llm.beam_search([prompt, prompt], params, [None, LoRARequest("b", 2, adapters["b"])])
    alone_b = lora_llm.beam_search([prompt], params, "b")[0]
    tokens = [[s.tokens for s in o.sequences] for o in (by_keyword, by_name, by_position, base, with_b, alone_b)]
    assert tokens[0] == tokens[1] == tokens[2] != tokens[3]
    assert tokens[4] == tokens[5] != tokens[3]
    from infer.errors import RequestError
    with pytest.raises(RequestError, match="both lora and lora_request"):
        lora_llm.beam_search([prompt], params, "a", lora_request=LoRARequest("a", 1, adapters["a"]))


def test_a_request_id_in_flight_is_a_valueerror_as_vllms(allm):
    """vLLM's AsyncLLM refuses a request id already running with a ValueError; infer's was a bare InferError (no
    hint), which a ported `except ValueError` let through."""
    async def main():
        first = allm.generate([5, 9, 13], SamplingParams(max_new_tokens=30, ignore_eos=True), "dup")
        await first.__anext__()
        try:
            with pytest.raises(ValueError, match="already in use") as e:
                async for _ in allm.generate([7, 8], SamplingParams(max_new_tokens=2), "dup"):
                    pass
            assert e.value.hint
        finally:
            await first.aclose()
    asyncio.run(main())
    _settle(allm.engine)
    assert not allm.engine.requests


def test_lora_request_is_hashable_and_equal_by_name_as_vllms():
    """vLLM's LoRARequest is equal and hashed by lora_name (sets, dict keys, lru_cache of requests), with the
    properties adapter_id, name and path; infer's dataclass was unhashable (TypeError) and had none of them."""
    from infer import LoRARequest
    a1, a2, b = LoRARequest("a", 1, "/x"), LoRARequest("a", 2, "/y"), LoRARequest("b", 1, "/x")
    assert a1 == a2 and a1 != b and len({a1, a2, b}) == 2 and {a1: 1}[a2] == 1
    assert (a1.adapter_id, a1.name, a1.path) == (1, "a", "/x")
    assert LoRARequest("c", 3, lora_local_path="/z").path == "/z"


def test_beam_search_takes_vllms_concurrency_limit(lora_llm):
    """vLLM's LLM.beam_search(..., concurrency_limit=N) searches N prompts at a time; it was a TypeError here. The
    beams are those of one call over all the prompts."""
    from infer import BeamSearchParams
    from infer.errors import RequestError
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompts = [[5, 9, 13], [7, 8, 9, 10, 11], [3]]
    whole = lora_llm.beam_search(prompts, params)
    limited = lora_llm.beam_search(prompts, params, concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in limited] == [[s.tokens for s in o.sequences] for o in whole]
    assert lora_llm.beam_search([], params, concurrency_limit=1) == []
    with pytest.raises(RequestError, match="concurrency_limit must be a positive integer"):
        lora_llm.beam_search(prompts, params, concurrency_limit=0)
    assert lora_llm.engine.block_manager.num_used_blocks == 0 and not lora_llm.engine.requests


def test_beam_search_keeps_a_prompt_dicts_cache_salt(lora_llm):
    """A prompt dict's cache_salt shares cached prefixes only with requests of that salt (README); beam_search
    dropped it, so a salted search's steps hit the blocks an unsalted request cached. Its first step (one beam, the
    prompt alone) now finds none of them, and the beams are the unsalted ones."""
    from infer import BeamSearchParams
    params = BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True)
    prompt = list(range(40, 61))
    plain = lora_llm.beam_search([prompt], params)[0]
    hits = lora_llm.engine.stats()["prefix_cache_hits"]
    salted = lora_llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "tenant-1"}], params)[0]
    assert lora_llm.engine.stats()["prefix_cache_hits"] == hits
    assert [s.tokens for s in salted.sequences] == [s.tokens for s in plain.sequences]
    again = lora_llm.beam_search([prompt], params)[0]  # (the unsalted one does hit its own blocks)
    assert lora_llm.engine.stats()["prefix_cache_hits"] > hits
    assert again.sequences[0].tokens == plain.sequences[0].tokens
