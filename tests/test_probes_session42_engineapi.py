"""Session 42 probes of the low-level LLMEngine API as vLLM's users drive it."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.errors import ClosedError

P = SamplingParams(max_new_tokens=3, ignore_eos=True)


def test_llm_llm_engine_is_vllms_way_to_the_engine():
    """vLLM code reaches the engine under an LLM as `llm.llm_engine` (llm.llm_engine.get_tokenizer(), an
    add_request/step loop on it); infer named it only `llm.engine`, so that code was an AttributeError."""
    llm = LLM("tiny-llama", max_model_len=64, block_size=4)
    engine = llm.llm_engine
    assert engine is llm.engine and engine.get_tokenizer() is llm.get_tokenizer()
    engine.add_request("own", [5, 6, 7], P)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["own"]
    assert done[0].token_ids == llm.generate([[5, 6, 7]], P)[0].token_ids
    llm.close()
    with pytest.raises(ClosedError):
        llm.llm_engine
