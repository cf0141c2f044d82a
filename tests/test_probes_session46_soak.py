"""Session 46 soak probes: feature combinations run over time (fp8 KV cache, adapters, priority, n, beams, aborts,
resume, data parallel); each defect found is reproduced small here."""

from __future__ import annotations

import pytest

from infer.cli.resume import check_resume, write_fingerprint
from infer.errors import ConfigError


def test_resume_without_the_fp8_kv_cache_names_auto_not_none(tmp_path):
    """A run begun with --kv-cache-dtype fp8 and resumed without the option was refused with
    "kv_cache_dtype 'fp8_e4m3' -> None": the default (auto) is left out of OUT.resume.json, so the message showed
    None, which is no value of the option. It names auto, the value to pass or drop."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    out.write_text("")
    write_fingerprint(out, inp, {"model": "tiny-llama", "kv_cache_dtype": "fp8_e4m3"})
    with pytest.raises(ConfigError) as err:
        check_resume(out, inp, {"model": "tiny-llama"})
    assert "kv_cache_dtype 'fp8_e4m3' -> 'auto'" in err.value.message
    check_resume(out, inp, {"model": "tiny-llama", "kv_cache_dtype": "fp8_e4m3"})  # the same options: taken
    write_fingerprint(out, inp, {"model": "tiny-llama"})  # an auto run resumed with auto (the key left out both times)
    check_resume(out, inp, {"model": "tiny-llama"})


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from lora_helpers import three_adapters
    return three_adapters(tmp_path_factory.mktemp("soak46-lora"), 46, "ab")[1]


def _served_beams(adapters, change=None):
    """A served beam search (use_beam_search, n=2) with adapter b, the engine loop pumped here step by step; after
    its first step `change(engine)` runs on the engine (as the engine thread runs an unload or a reload between two
    iterations). Returns (each choice's finish_reason and token ids, the engine)."""
    import asyncio
    from collections import deque

    from infer.engine.beam import BeamSearchParams
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.engine.sampling_params import SamplingParams
    from infer.serve.async_engine import AsyncEngine
    from infer.serve.beams import ServedBeamSearch
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, enable_lora=True, max_loras=1, max_lora_rank=8,
                                    loras={"b": str(adapters["b"])}, block_size=4))
    aengine = AsyncEngine(engine)  # (its thread is not started: `pump` is its loop)

    def pump():
        with aengine._cond:
            adds, aengine._adds = list(aengine._adds), deque()
            aborts, aengine._aborts = list(aengine._aborts), deque()
            controls, aengine._controls = list(aengine._controls), deque()
        aengine._iteration(adds, aborts, controls)

    async def scenario():
        width = 2
        step = SamplingParams(max_new_tokens=5, logprobs=2 * width)
        beam_params = BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=True)
        search = ServedBeamSearch(aengine, engine.tokenizer, set(engine.eos_token_ids), engine.max_model_len,
                                  [[5, 17, 99, 230, 6, 7]] * width, width, beam_params, step, "b", "cmpl-x")
        search.start()
        outs, steps = [], 0
        while len(outs) < width and steps < 50:
            pump()
            steps += 1
            for _ in range(20):  # the search's task takes the step's outputs and sends the next step
                await asyncio.sleep(0)
            if steps == 1 and change is not None:
                change(engine)
            while not search.queue.empty():
                outs.append(search.queue.get_nowait())
        pump()  # (the hold's release)
        return [(o.finish_reason, o.error, o.token_ids) for o in outs]

    return asyncio.run(scenario()), engine


@pytest.mark.parametrize("change", ["unload", "reload"])
def test_served_beam_search_keeps_its_adapter_through_an_unload_or_reload(adapters, change):
    """A served beam search (use_beam_search; AsyncLLM.beam_search too) adds a new engine request per beam and step,
    so between two steps no request held its adapter: an unload then freed it at once and the next step was refused,
    a 500 "beam search failed: RequestError: unknown LoRA adapter" for a request accepted before the unload (which
    the README says finishes with it), and an in-place reload (load_inplace) gave the later steps the new weights.
    The search now holds the adapter (LLMEngine.hold_lora) from its first step to its end."""
    want, plain = _served_beams(adapters)
    assert [r for r, _, _ in want] == ["length", "length"]

    def unload(engine):
        assert engine.remove_lora("b") == 1  # the unload's 200 says one request still finishes with it

    def reload(engine):
        engine.add_lora("b", str(adapters["a"]), replace=True)

    got, engine = _served_beams(adapters, unload if change == "unload" else reload)
    assert got == want  # the same beams: the adapter the search began with, on every step
    # and its K/V: each step finds the beams' prefixes in the cache, under the key of the weights it holds
    assert engine.stats()["prefix_cache_hits"] == plain.stats()["prefix_cache_hits"] > 0
    manager = engine.lora_manager
    assert manager.retired() == [] and engine._lora_holds == []  # freed after the search
    assert manager.names() == ([] if change == "unload" else ["b"])
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("change", ["remove", "replace"])
def test_llm_beam_search_keeps_its_adapter_through_remove_or_replace(adapters, change):
    """LLM.beam_search runs each step as a generate call of its own: an LLM.remove_lora from another thread between
    two steps raised "prompt 0: unknown LoRA adapter 'b'" out of a search begun before it (README: requests already
    holding an adapter finish with it), and add_lora(replace=True) gave the later steps the new weights."""
    from infer import LLM, BeamSearchParams
    llm = LLM("tiny-llama", max_model_len=64, enable_lora=True, max_loras=1, max_lora_rank=8,
              loras={"b": str(adapters["b"])})
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    want = [s.output_token_ids for s in llm.beam_search([[5, 17, 99, 230]], params, lora="b")[0].sequences]
    real, calls = llm.generate, []

    def generate(*args, **kwargs):  # the change comes between the first step and the second (as from a thread)
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            if change == "remove":
                assert llm.remove_lora("b") == 1  # the search still uses it
            else:
                llm.add_lora("b", str(adapters["a"]), replace=True)
        return out

    llm.generate = generate
    got = [s.output_token_ids for s in llm.beam_search([[5, 17, 99, 230]], params, lora="b")[0].sequences]
    assert len(calls) > 1 and got == want
    engine = llm.engine
    assert engine.lora_manager.retired() == [] and engine._lora_holds == []  # freed after the search
    assert engine.lora_manager.names() == ([] if change == "remove" else ["b"])
    assert engine.stats()["kv_blocks_used"] == 0
    llm.close()


def test_a_held_adapter_removed_after_the_cpu_cache_dropped_it_is_read_again_for_the_search(adapters):
    """remove_lora counts a beam search's hold as a user: with one slot and one CPU copy, a request on adapter a
    between two steps of a search on b evicts b from both, so the removal must keep b's weights (read again from its
    folder) for the search's later steps, which swap it back in; taken as unused, its weights were dropped and the
    next step failed."""
    from infer import LLM, BeamSearchParams
    llm = LLM("tiny-llama", max_model_len=64, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              loras={"a": str(adapters["a"]), "b": str(adapters["b"])})
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    want = [s.output_token_ids for s in llm.beam_search([[5, 17, 99, 230]], params, lora="b")[0].sequences]
    real, calls = llm.generate, []

    def generate(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:  # between the first step and the second: b leaves the slot and the CPU cache, then goes
            real([[7, 8, 9]], None, "a")
            assert llm.remove_lora("b") == 1  # the search holds it
        return out

    llm.generate = generate
    got = [s.output_token_ids for s in llm.beam_search([[5, 17, 99, 230]], params, lora="b")[0].sequences]
    assert len(calls) > 1 and got == want
    assert llm.engine.lora_manager.names() == ["a"] and llm.engine._lora_holds == []
    llm.close()


def test_llm_beam_search_names_a_failed_step_instead_of_an_index_error():
    """A step of LLM.beam_search that the engine failed (its output carries the error and no token) raised a bare
    IndexError from the search; it raises RequestError naming the prompt, the step and the step's error."""
    from infer import LLM, BeamSearchParams
    from infer.engine.outputs import RequestOutput
    from infer.errors import RequestError
    llm = LLM("tiny-llama", max_model_len=64)
    real, calls = llm.generate, []

    def generate(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # as the engine ends a request its step failed
            out[0] = RequestOutput.failed(out[0].request_id, None, "engine step failed: boom")
        return out

    llm.generate = generate
    with pytest.raises(RequestError) as err:
        llm.beam_search([[5, 17, 99, 230]], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    assert "prompt 0 failed at step 2" in err.value.message and "boom" in err.value.message
    llm.close()
