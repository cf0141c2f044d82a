"""Adapters added and removed while the engine runs (`LLM.add_lora` / `remove_lora`, `--enable-lora`), with peft as
the oracle: added adapters give peft's greedy tokens in a mixed batch (more adapters than slots); a removed adapter
is refused to new requests at once while the requests that hold it (running or still waiting) finish with peft's
tokens, and its memory is freed after them; a name added again serves the new folder's weights, not the old slot's;
every mistake is a LoRAError that leaves the engine serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.errors import LoRAError, LoRANameError, RequestError
from infer.models.tiny import ensure_builtin

from lora_helpers import THREE, PeftOracle, hf_float, save_adapter, save_three

N = 8
PARAMS = SamplingParams(max_new_tokens=N, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def hf():
    return hf_float(Path(ensure_builtin("tiny-llama")))


@pytest.fixture(scope="module")
def paths(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-lora")
    out = save_three(hf, root, 10)
    # made before the oracle wraps `hf` in peft (saving one unloads every adapter of the model)
    return {**out, "r16": save_adapter(hf, root / "r16", seed=3, r=16, lora_alpha=16, target_modules=["q_proj"])}


@pytest.fixture(scope="module")
def oracle(hf, paths):
    return PeftOracle(hf, {name: paths[name] for name in THREE})


def make_llm(**kw) -> LLM:
    return LLM("tiny-llama", enable_lora=True, **{"max_loras": 2, **kw}, max_lora_rank=8, max_model_len=256)


def test_adapters_added_while_running_give_peft_tokens_through_fewer_slots(paths, oracle):
    with make_llm() as llm:
        assert llm.list_loras() == []
        base = llm.generate(PROMPTS[:1], PARAMS)[0].token_ids  # the engine ran before any adapter existed
        for name in ("a", "b", "c"):
            llm.add_lora(name, str(paths[name]))
        assert llm.list_loras() == ["a", "b", "c"]
        rows = [("a", PROMPTS[0]), ("b", PROMPTS[1]), ("c", PROMPTS[2]), (None, PROMPTS[3])]
        outs = llm.generate([p for _, p in rows], PARAMS, lora=[n for n, _ in rows])
        assert [o.token_ids for o in outs] == [oracle.greedy(n, p, N) for n, p in rows]
        assert base == oracle.greedy(None, PROMPTS[0], N)
        assert llm.engine.stats()["lora_swaps"] >= 3  # three adapters went through two slots


def test_removed_adapter_finishes_the_requests_that_hold_it_then_frees_its_slot(paths, oracle):
    """max_num_seqs=1: the second request with the adapter is still waiting when the adapter is removed."""
    with make_llm(max_num_seqs=1) as llm:
        llm.add_lora("a", str(paths["a"]))
        llm.add_lora("b", str(paths["b"]))
        stream = llm.stream(PROMPTS[:2], PARAMS, lora=["a", "a"])
        next(stream)  # the first request runs, the second waits
        manager = llm.engine.lora_manager
        assert manager.pins("a") == 1
        assert llm.remove_lora("a") == 2
        assert llm.list_loras() == ["b"]
        with pytest.raises(RequestError, match="unknown LoRA adapter 'a'"):
            llm.generate(PROMPTS[2:3], PARAMS, lora="a")
        outs = {}
        for i, _, out in stream:
            if out.finished:
                outs[i] = out.token_ids
        assert outs == {0: oracle.greedy("a", PROMPTS[0], N), 1: oracle.greedy("a", PROMPTS[1], N)}
        llm.generate(PROMPTS[3:], PARAMS, lora="b")  # a step after the last user: the adapter is gone
        assert "a" not in manager.resident() and not manager.retired() and not manager.has("a")
        assert "a" not in manager.cpu_resident()
        with pytest.raises(LoRAError, match="unknown LoRA adapter 'a'"):
            llm.remove_lora("a")


def test_removed_adapter_nobody_uses_is_freed_at_once_and_its_name_serves_new_weights(paths, oracle):
    """The name comes back with another folder's weights: a stale device slot or CPU copy would give a's tokens."""
    with make_llm() as llm:
        llm.add_lora("x", str(paths["a"]))
        assert llm.generate(PROMPTS[:1], PARAMS, lora="x")[0].token_ids == oracle.greedy("a", PROMPTS[0], N)
        assert llm.remove_lora("x") == 0
        assert not llm.engine.lora_manager.retired()
        llm.add_lora("x", str(paths["b"]))
        assert llm.generate(PROMPTS[:1], PARAMS, lora="x")[0].token_ids == oracle.greedy("b", PROMPTS[0], N)


def test_a_name_added_again_never_finds_the_prefix_cache_blocks_of_its_old_weights(paths, oracle):
    """A prompt of more than two full KV blocks: its blocks go into the prefix cache keyed on the adapter. The same
    name added again with other weights must compute its own K/V, not reuse the old adapter's."""
    prompt = [(7 * i + 3) % 200 + 5 for i in range(40)]
    with make_llm() as llm:
        bm = llm.engine.block_manager
        assert bm.enable_prefix_caching and len(prompt) > 2 * bm.block_size
        llm.add_lora("x", str(paths["a"]))
        assert llm.generate([prompt], PARAMS, lora="x")[0].token_ids == oracle.greedy("a", prompt, N)
        hits = bm.prefix_hits
        assert llm.generate([prompt], PARAMS, lora="x")[0].token_ids == oracle.greedy("a", prompt, N)
        assert bm.prefix_hits > hits  # the same registration does reuse its blocks
        llm.remove_lora("x")
        llm.add_lora("x", str(paths["b"]))
        hits = bm.prefix_hits
        assert llm.generate([prompt], PARAMS, lora="x")[0].token_ids == oracle.greedy("b", prompt, N)
        assert bm.prefix_hits == hits


def test_an_adapter_whose_folder_was_deleted_can_still_be_removed(paths, oracle, tmp_path):
    """max_cpu_loras=1: the CPU copy of 'x' is dropped once 'y' is added, so removing 'x' cannot read it again.
    A request that holds its slot still finishes with its weights; the removal frees it afterwards."""
    import shutil

    folder = shutil.copytree(paths["a"], tmp_path / "x")
    with make_llm(max_loras=1, max_cpu_loras=1, max_num_seqs=1) as llm:
        llm.add_lora("x", str(folder))
        stream = llm.stream(PROMPTS[:2], PARAMS, lora=["x", None])
        next(stream)  # 'x' is in a device slot, pinned by the running request
        llm.add_lora("y", str(paths["b"]))
        assert "x" not in llm.engine.lora_manager.cpu_resident()
        shutil.rmtree(folder)
        assert llm.remove_lora("x") == 1
        assert llm.list_loras() == ["y"]
        outs = {i: out.token_ids for i, _, out in stream if out.finished}
        assert outs == {0: oracle.greedy("a", PROMPTS[0], N), 1: oracle.greedy(None, PROMPTS[1], N)}
        assert llm.generate(PROMPTS[2:3], PARAMS, lora="y")[0].token_ids == oracle.greedy("b", PROMPTS[2], N)
        assert not llm.engine.lora_manager.retired()


def test_a_removed_adapter_that_must_come_back_from_a_deleted_folder_fails_only_its_request(paths, oracle, tmp_path):
    """One slot, one CPU copy: the third request needs 'x' swapped back in after 'y' took its slot, and its folder is
    gone. That request fails with a message naming the folder; the others finish with peft's tokens."""
    import shutil

    folder = shutil.copytree(paths["a"], tmp_path / "x")
    with LLM("tiny-llama", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, max_model_len=256,
             max_num_seqs=1) as llm:
        llm.add_lora("x", str(folder))
        llm.add_lora("y", str(paths["b"]))
        stream = llm.stream(PROMPTS[:3], PARAMS, lora=["x", "y", "x"])
        next(stream)  # 'x' runs in the only slot
        llm.add_lora("w", str(paths["c"]))  # the CPU copy of 'x' is dropped
        shutil.rmtree(folder)
        assert llm.remove_lora("x") == 2
        outs = {i: out for i, _, out in stream if out.finished}
        assert outs[0].token_ids == oracle.greedy("a", PROMPTS[0], N)
        assert outs[1].token_ids == oracle.greedy("b", PROMPTS[1], N)
        assert outs[2].finish_reason == "error" and "can no longer be read" in outs[2].error
        llm.generate(PROMPTS[3:], PARAMS, lora="y")  # a step after the last user: the adapter is gone
        assert not llm.engine.lora_manager.retired() and llm.list_loras() == ["y", "w"]


def test_every_mistake_is_a_lora_error_and_the_engine_keeps_serving(paths, oracle, tmp_path):
    with LLM("tiny-llama", max_model_len=256) as plain:
        with pytest.raises(LoRAError, match="--enable-lora"):
            plain.add_lora("a", str(paths["a"]))
        with pytest.raises(LoRAError, match="--enable-lora"):
            plain.remove_lora("a")
        assert plain.list_loras() == []
    with make_llm(max_num_seqs=1) as llm:
        llm.add_lora("a", str(paths["a"]))
        with pytest.raises(LoRANameError, match="already loaded"):  # the name is the problem: a server says lora_name
            llm.add_lora("a", str(paths["b"]))
        with pytest.raises(LoRAError, match="nowhere"):
            llm.add_lora("n", str(tmp_path / "nowhere"))
        with pytest.raises(LoRAError, match="rank 16"):
            llm.add_lora("big", str(paths["r16"]))
        with pytest.raises(LoRANameError, match="invalid LoRA adapter name"):
            llm.add_lora("", str(paths["b"]))
        with pytest.raises(LoRAError, match="unknown LoRA adapter 'zz'"):
            llm.remove_lora("zz")
        stream = llm.stream(PROMPTS[:1], PARAMS, lora="a")
        next(stream)
        llm.remove_lora("a")
        llm.add_lora("a", str(paths["c"]))  # the name is free at once (vLLM's); its running request keeps a's weights
        assert llm.list_loras() == ["a"]
        assert [out.token_ids for _, _, out in stream if out.finished] == [oracle.greedy("a", PROMPTS[0], N)]
        out = llm.generate(PROMPTS[:1], PARAMS, lora="a")[0]
        assert out.token_ids == oracle.greedy("c", PROMPTS[0], N)


def test_enable_lora_reserves_the_slots_in_the_memory_plan():
    with LLM("tiny-llama", max_model_len=256) as plain, make_llm() as slots:
        assert plain.engine.memory_plan.lora_bytes == 0
        assert slots.engine.memory_plan.lora_bytes == slots.engine.lora_manager.device_bytes() > 0


def test_a_waiting_request_whose_adapter_left_the_registry_fails_instead_of_waiting_for_ever(paths):
    """The engine never unregisters an adapter a request still names, but if one goes (a bug, a caller of the
    manager), that request must end with an error naming the adapter, not wait for a slot for ever."""
    with make_llm(max_num_seqs=1) as llm:
        llm.add_lora("a", str(paths["a"]))
        engine = llm.engine
        engine.add_request("r1", PROMPTS[0], PARAMS)
        engine.add_request("r2", PROMPTS[1], PARAMS, "a")  # waits: one sequence at a time
        engine.step()
        engine.lora_manager.unregister("a")  # allowed: nothing pins it
        done = {}
        for _ in range(100):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
        assert done["r1"].finish_reason == "length"
        assert done["r2"].finish_reason == "error" and "unknown LoRA adapter 'a'" in done["r2"].error
