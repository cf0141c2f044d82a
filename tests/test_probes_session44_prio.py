"""Probes of vLLM's priority scheduling (--scheduling-policy priority), session 44."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4, max_model_len=64, scheduling_policy="priority") as llm:
        yield llm


def test_a_priority_out_of_range_in_generates_list_names_its_prompt(llm):
    """generate(prompts, priority=[...]) refused a value out of range without saying which prompt's it was, where
    every other per-prompt refusal (the engine's, the encoding's) starts with "prompt i:"."""
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for bad in (2**70, -2**70):
        with pytest.raises(RequestError, match=r"^prompt 1: priority must be in"):
            llm.generate(["a", "b", "c"], params, priority=[0, bad, 1])
    assert not llm.llm_engine.requests
    assert [len(o.token_ids) for o in llm.generate(["a", "b"], params, priority=[0, 2**63 - 1])] == [2, 2]
