"""Probes of the forty-ninth session's soak of the CLI, the server and the Python API by a newcomer and a hostile
user: each message names what the user sent and what to send instead."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("part, key", [({"type": "refusal", "text": "no"}, "refusal"),
                                       ({"type": "input_text", "refusal": "no"}, "text"),
                                       ({"type": "text", "text": 5}, "text")])
def test_a_text_part_without_its_key_names_the_key_its_kind_needs(part, key):
    """A refusal part ({"type": "refusal", "refusal": ...}) sent with "text" instead was told "every text part needs
    a string 'text'", which it had: the message now names the part's kind and the key that kind holds its text in."""
    from infer.engine.inputs import chat_messages
    from infer.errors import RequestError
    with pytest.raises(RequestError) as e:
        chat_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert e.value.message == f"messages[0].content: every {part['type']} part needs a string '{key}'", e.value.message


@pytest.mark.parametrize("bad", [7, [7], ["a", 7], b"a"])
def test_async_llm_abort_checks_every_id_before_stopping_any(bad):
    """AsyncLLM.abort(7) was a bare TypeError ("'int' object is not iterable"), abort([7]) stopped nothing without a
    word, abort(["a", 7]) stopped "a" and dropped 7, and abort(b"a") aborted the ids 97: now RequestIdTypeError
    before anything is stopped, as LLMEngine.abort_request answers."""
    import asyncio

    from infer.errors import RequestIdTypeError
    from infer.serve.async_llm import AsyncLLM
    aborted = []
    llm = AsyncLLM.__new__(AsyncLLM)  # no engine: abort only reaches the engine thread's loop and the streams
    llm._loop = type("Loop", (), {"abort": lambda self, rid: aborted.append(rid)})()
    llm._streams = {}
    with pytest.raises(RequestIdTypeError, match="request_id must be a string"):
        asyncio.run(llm.abort(bad))
    assert aborted == []
    asyncio.run(llm.abort(("a", "b")))
    assert aborted == ["a", "b"]


@pytest.mark.parametrize("length", [20, 16])
def test_a_beam_search_prompt_as_long_as_the_context_is_told_to_shorten_the_prompt(length):
    """LLM.beam_search of a prompt that fills the context was told to "lower max_tokens to 0 or less", which no
    BeamSearchParams takes (max_tokens is at least 1): now the prompt is named too long, with the most it may be."""
    from infer.engine.beam import BeamSearch, BeamSearchParams
    from infer.errors import RequestError
    with pytest.raises(RequestError) as e:
        BeamSearch([[5] * 3, [5] * length], BeamSearchParams(beam_width=2, max_tokens=4), {0}, max_model_len=16)
    assert e.value.message == (f"prompt 1 has {length} tokens, which leaves no room under the context (16 tokens) "
                               "for even one new token"), e.value.message
    assert e.value.hint == "shorten the prompt to at most 15 tokens" and "max_tokens to 0" not in str(e.value)
    with pytest.raises(RequestError) as e:  # a prompt that leaves room: lower max_tokens, as before
        BeamSearch([[5] * 14], BeamSearchParams(beam_width=2, max_tokens=4), {0}, max_model_len=16)
    assert e.value.hint == "lower max_tokens to 2 or less"


@pytest.mark.parametrize("path", [None, 5, "", ["./adapters/support"]])
def test_an_adapter_path_that_is_no_path_is_a_lora_error(path):
    """LLM.add_lora("x", None) (a path read from an unset setting) was a bare TypeError from pathlib ("expected str,
    bytes or os.PathLike object, not NoneType"), and "" read the current folder: now a LoRAError naming the
    adapter and what it got."""
    from infer.errors import LoRAError
    from infer.lora.adapter import adapter_path
    with pytest.raises(LoRAError) as e:
        adapter_path("support", path)
    assert e.value.message == f"LoRA adapter 'support': its path must be a folder's path (a string), got {path!r}"


def test_an_adapter_path_given_as_bytes_or_a_path_is_read(tmp_path):
    from infer.lora.adapter import adapter_path
    assert adapter_path("support", str(tmp_path).encode()) == tmp_path
    assert adapter_path("support", tmp_path) == tmp_path


def test_a_request_id_of_none_is_not_told_to_pass_str_none():
    """LLMEngine.add_request(None, ...) and abort_request(None) (an id from an unset variable) were told to "pass
    str(None)", which names the request "None" (and a second such request collides with it)."""
    from infer.engine.llm_engine import _check_request_id
    from infer.errors import RequestIdTypeError
    with pytest.raises(RequestIdTypeError) as e:
        _check_request_id(None)
    assert e.value.message == "request_id must be a string, got None" and "str(None)" not in e.value.hint
    assert e.value.hint == "give every request its own id, e.g. str(uuid.uuid4())"
    with pytest.raises(RequestIdTypeError) as e:  # another type: its str() is still the advice
        _check_request_id(7)
    assert e.value.hint == "pass str(7): outputs carry the id as it was given"


def test_a_chat_template_that_renders_nothing_is_named_not_an_empty_prompt():
    """A chat template that writes nothing for the messages (one that knows only the roles "human" and "bot") made a
    chat of non-empty messages "the prompt is empty (give a non-empty prompt)": the template is now named."""
    from infer.engine.inputs import encode_prompt
    from infer.engine.setup import load_tokenizer
    from infer.errors import RequestError
    from infer.models.resolve import resolve_model
    tok = load_tokenizer(resolve_model("tiny-llama"))
    template = {"chat_template": "{% for m in messages %}{% if m.role == 'human' %}{{ m.content }}{% endif %}"
                                 "{% endfor %}"}
    with pytest.raises(RequestError) as e:
        encode_prompt(tok, messages=[{"role": "user", "content": "hi"}], template=template)
    assert e.value.message == "the chat template renders these 1 message(s) as no text at all", e.value.message
    assert encode_prompt(tok, messages=[{"role": "human", "content": "hi"}], template=template)  # it renders these
