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
