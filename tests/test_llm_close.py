"""LLM.close() and `with LLM(...)` give the engine's memory back (KV cache, graphs, weights) and leave a clear error
for later calls; a closed engine's model no longer holds its KV views."""

from __future__ import annotations

import gc
import weakref

import pytest

from infer import LLM, SamplingParams


def test_close_frees_the_kv_cache_and_refuses_later_calls():
    llm = LLM("tiny-llama", max_num_seqs=2, max_model_len=64)
    out = llm.generate(["hello"], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    runner = llm.engine.runner
    kv = weakref.ref(runner.kv_cache)
    model = runner.model
    llm.close()
    gc.collect()
    assert kv() is None, "the KV cache is still referenced after close()"
    assert all(getattr(m, "k_cache", None) is None for m in model.modules())
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["again"])
    llm.close()  # twice is fine


def test_context_manager_closes():
    with LLM("tiny-llama", max_num_seqs=2, max_model_len=64) as llm:
        engine = llm.engine
        llm.generate(["x"], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert llm.engine is None and engine.runner is None
