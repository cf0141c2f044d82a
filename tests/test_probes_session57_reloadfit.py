"""Probes of the fifty-seventh session (reloadfit): reload_weights of a checkpoint whose weights take more memory
than the loaded ones is refused from the files' headers, before anything is freed, when they do not fit what the
loaded weights free and the memory plan leaves of the budget (--memory-limit on a CPU): an OutOfMemoryError naming
both sizes, the engine serving on with the loaded weights. A load that ran out of memory after the free left the
engine without weights."""

from __future__ import annotations

import shutil

import pytest

from infer import LLM, SamplingParams
from infer.errors import OutOfMemoryError
from infer.memory.sizes import gib, weights_bytes
from infer.models.tiny import ensure_builtin

PROMPTS = [[5, 9, 13, 21, 40], [7, 3, 2, 8, 11, 40, 77]]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """tiny-llama as GPTQ int4 (groups of 32) and int8 (groups of 16, act-order): the int8 one's weights are larger
    once loaded (its qweight twice the int4 one's, its scales and g_idx more)."""
    from test_probes_session56_review_moeq import rtn_gptq
    root = tmp_path_factory.mktemp("reloadfit")
    shutil.copytree(ensure_builtin("tiny-llama"), root / "float")
    rtn_gptq(root / "float", root / "int4", group_size=32)
    rtn_gptq(root / "float", root / "int8", group_size=16, act_order=True, bits=8)
    return root


def _llm(folder, memory_limit):
    return LLM(str(folder), block_size=4, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32,
               memory_limit=memory_limit)


def _others(engine) -> int:
    """What the engine's plan holds besides its weights: activations, adapter slots, reserve and KV cache."""
    plan = engine.memory_plan
    return (plan.activation_peak_bytes + plan.lora_bytes + plan.reserve_bytes
            + plan.kv_blocks * plan.kv_block_bytes)


def _write(root, new: str, folder) -> None:
    for f in ("model.safetensors", "config.json"):
        shutil.copy(root / new / f, folder / f)


def _tight(layouts, tmp_path):
    """An engine on a copy of the int4 checkpoint under a --memory-limit that leaves half the int8 one's extra
    bytes beyond the int4 weights and the rest of the plan: (llm, folder, int4 weights' bytes, int8 weights' bytes)."""
    folder = tmp_path / "model"
    shutil.copytree(layouts / "int4", folder)
    with _llm(layouts / "int8", 64 << 20) as llm:
        big = weights_bytes(llm.llm_engine.runner.model)
    with _llm(folder, 64 << 20) as llm:
        small, others = weights_bytes(llm.llm_engine.runner.model), _others(llm.llm_engine)
    assert big > small
    limit = others + small + (big - small) // 2
    llm = _llm(folder, limit)
    assert _others(llm.llm_engine) == others  # (the plan's KV cache, activations and reserve as under 64 MiB)
    return llm, folder, small, big


def test_a_larger_checkpoint_that_does_not_fit_is_refused_before_anything_is_freed(layouts, tmp_path):
    """int4 loaded, int8 written over the folder, a budget that holds only half the int8 weights' extra bytes:
    reload_weights() is refused naming both sizes and --memory-limit; the engine's tokens are those it gave before.
    With the int4 checkpoint written back, the same-size reload is taken."""
    llm, folder, small, big = _tight(layouts, tmp_path)
    with llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)]
        _write(layouts, "int8", folder)
        with pytest.raises(OutOfMemoryError, match="reload_weights\\(\\) does not fit") as e:
            llm.collective_rpc("reload_weights")
        assert f"new checkpoint's weights take {gib(big)} ({big:,} bytes)" in e.value.message
        assert f"the loaded ones {gib(small)} ({small:,} bytes)" in e.value.message
        assert "--memory-limit" in e.value.hint and "serves on with the loaded weights" in e.value.hint
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)] == want
        _write(layouts, "int4", folder)
        llm.collective_rpc("reload_weights")
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)] == want


def test_a_smaller_checkpoint_is_taken_under_the_same_budget(layouts, tmp_path):
    """int8 loaded under a budget that just holds it, int4 written over the folder: reload_weights() takes it and
    the tokens are a fresh int4 engine's."""
    with _llm(layouts / "int4", 64 << 20) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)]
    folder = tmp_path / "model"
    shutil.copytree(layouts / "int8", folder)
    with _llm(folder, 64 << 20) as llm:
        big, others = weights_bytes(llm.llm_engine.runner.model), _others(llm.llm_engine)
    with _llm(folder, others + big) as llm:
        _write(layouts, "int4", folder)
        llm.collective_rpc("reload_weights")
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)] == want


def test_the_server_answers_a_refused_reload_with_400_and_serves_on(layouts, tmp_path):
    """POST /collective_rpc {"method": "reload_weights"} of a checkpoint that does not fit: a 400 naming both sizes
    (the client wrote the checkpoint: not a server fault), and completions as before."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    llm, folder, small, big = _tight(layouts, tmp_path)
    engine = llm.llm_engine
    engine.config.enable_sleep_mode = True  # (POST /collective_rpc needs it; nothing else here does)
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as url:
        want = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        _write(layouts, "int8", folder)
        r = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=60)
        assert r.status_code == 400, r.text
        assert f"weights take {gib(big)} ({big:,} bytes)" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
