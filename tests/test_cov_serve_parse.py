"""OpenAI request bodies the server tests leave out, parsed against hand-written expectations: a completion whose
prompt is a batch of token-id lists, chat content given as text parts, and the range and type checks of
top_logprobs, logprobs and stream_options."""

from __future__ import annotations

import pytest

from infer.engine.setup import load_tokenizer
from infer.models.tiny import ensure_builtin
from infer.serve.protocol import ApiError, parse_chat, parse_completion


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_builtin("tiny-llama"))


def test_a_batch_of_token_id_lists_is_one_prompt_each(tok):
    req = parse_completion({"prompt": [[5, 6, 7], [8], [9, 10]], "max_tokens": 3}, tok)
    assert req.prompts == [[5, 6, 7], [8], [9, 10]]
    assert req.params.max_new_tokens == 3
    assert parse_completion({"prompt": [5, 6, 7]}, tok).prompts == [[5, 6, 7]]  # one prompt of token ids
    texts = parse_completion({"prompt": ["Hello there", "A cat"]}, tok).prompts
    assert texts == [tok("Hello there")["input_ids"], tok("A cat")["input_ids"]]


@pytest.mark.parametrize("prompt", [[[5, 6], []], [[5, 6], "x"], [[5, True]], [], [[5], [6.0]]])
def test_a_malformed_prompt_batch_is_a_400(tok, prompt):
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": prompt}, tok)
    assert e.value.status == 400 and e.value.param == "prompt"


def test_chat_text_parts_are_joined_in_order(tok):
    """By newlines, as vLLM joins them for a template that prints content as a string."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there,"}, {"type": "text", "text": " cat"}]
    joined = parse_chat({"messages": [{"role": "user", "content": "Hello\n there,\n cat"}]}, tok).prompts
    by_parts = parse_chat({"messages": [{"role": "user", "content": parts}]}, tok).prompts
    assert by_parts == joined
    want = tok.apply_chat_template([{"role": "user", "content": "Hello\n there,\n cat"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    assert by_parts == [list(want)]


@pytest.mark.parametrize("content", [[{"type": "image_url", "image_url": {"url": "http://x"}}],
                                     [{"type": "text", "text": 5}], [{"type": "text"}], 7])
def test_chat_content_that_is_not_text_is_a_400(tok, content):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": content}]}, tok)
    assert e.value.status == 400 and e.value.param == "messages"


def test_top_logprobs_range(tok):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    assert parse_chat({**body, "top_logprobs": 20}, tok).params.logprobs == 20
    assert parse_chat({**body, "top_logprobs": 0}, tok).params.logprobs == 0
    for bad in (21, -1):
        with pytest.raises(ApiError) as e:
            parse_chat({**body, "top_logprobs": bad}, tok)
        assert e.value.status == 400 and e.value.param == "top_logprobs"


def test_logprobs_types_per_endpoint(tok):
    with pytest.raises(ApiError) as e:  # completions take a count, not a boolean
        parse_completion({"prompt": "hi", "logprobs": True}, tok)
    assert e.value.param == "logprobs"
    assert parse_completion({"prompt": "hi", "logprobs": 5}, tok).params.logprobs == 5
    with pytest.raises(ApiError) as e:  # chat takes a boolean (the count is top_logprobs)
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, tok)
    assert e.value.param == "logprobs"


def test_stream_options_include_usage(tok):
    req = parse_completion({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}, tok)
    assert req.include_usage
    with pytest.raises(ApiError) as e:  # as vLLM: the options of a stream that is not one are a mistake
        parse_completion({"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}}, tok)
    assert e.value.status == 400 and e.value.param == "stream_options"
    req = parse_completion({"prompt": "hi", "stream": False, "stream_options": None}, tok)
    assert not req.include_usage  # usage rides in the response itself when not streaming
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, tok)
    assert e.value.status == 400 and e.value.param == "stream_options"
