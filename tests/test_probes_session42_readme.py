"""Probes of README's examples, as a newcomer runs them (session 42, area readme)."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.errors import RequestError

P = SamplingParams(max_new_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", max_model_len=64) as llm:
        yield llm


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_list_of_dicts_that_are_no_prompt_names_the_dict_not_chat_messages(llm, call):
    """README: a dict that is no prompt ({"text": ...}) is a RequestError saying what it is. In a list (a dataset's
    rows, llm.generate([{"text": ...}])) it was read as one chat and answered 'messages must be a list of
    {"role": ..., "content": ...} objects', about messages the caller never gave."""
    with pytest.raises(RequestError, match=r"prompt 0 is a dict of 'text', which is no prompt"):
        out = getattr(llm, call)([{"text": "hi"}, {"text": "yo"}], P)
        list(out)


def test_chats_and_prompt_dicts_in_lists_still_run(llm):
    assert len(llm.generate([{"prompt": "hi"}, {"prompt_token_ids": [5, 6]}], P)) == 2
    assert len(llm.generate([{"role": "user", "content": "hi"}], P)) == 1  # one chat
    with pytest.raises(RequestError, match="messages must be a list"):  # a chat message without its role
        llm.generate([{"content": "hi"}], P)


@pytest.mark.parametrize("call", ["generate", "chat"])
def test_priority_zero_as_one_int_is_vllms_default(llm, call):
    """README: `priority` None or 0 for every prompt is taken. priority=0 (one int, as add_request takes it and as
    vLLM reads a falsy priority) was refused with a hint to 'give 0 for every prompt'."""
    prompt = [{"role": "user", "content": "hi"}] if call == "chat" else ["hi"]
    assert len(getattr(llm, call)(prompt, P, priority=0)) == 1
    assert len(getattr(llm, call)(prompt, P, priority=[0])) == 1
    for bad in (1, [1], True, 0.0):
        with pytest.raises(RequestError, match="first come, first served|integer per prompt"):
            getattr(llm, call)(prompt, P, priority=bad)
