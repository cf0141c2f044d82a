"""Fixes from probing chat templates of real models (Qwen3, Llama-3.1, Mistral v0.3, Gemma-2, Phi-3, trimmed here to
the feature each test needs) against transformers' apply_chat_template and vLLM's chat fields: chat_template_kwargs,
add_generation_prompt, continue_final_message and documents reach the template, in the server and in `infer run`'s
OpenAI batch lines, and their misuse is a 400 naming the field."""

from __future__ import annotations

import pytest

from infer.engine.inputs import parse_request
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin
from infer.serve.protocol import ApiError, parse_chat, parse_completion

# Qwen3's generation prompt and its enable_thinking switch, and its reasoning in assistant history
QWEN3 = ("{%- for message in messages %}{%- if message.role == 'assistant' and message.reasoning_content is string %}"
         "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
         "{{- message.content }}"
         "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content }}{%- endif %}"
         "{%- if not (loop.last and message.role == 'assistant') or add_generation_prompt %}{{- '<|im_end|>\\n' }}"
         "{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
         "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
         "{%- endif %}{%- endif %}")
# a RAG template (Command-R's idea): the request's documents in the system turn
RAG = ("{%- if documents %}{{- '<|im_start|>system\\n' }}"
       "{%- for d in documents %}{{- d.title + ': ' + d.text + '\\n' }}"
       "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
       "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
       "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
MSGS = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def tok(monkeypatch):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-qwen3")))
    monkeypatch.setattr(t, "chat_template", QWEN3)
    return t


def _want(tok, messages, **kw) -> list[int]:
    kw.setdefault("add_generation_prompt", True)
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def _chat(tok, **body) -> list[int]:
    return parse_chat({"messages": MSGS, **body}, tok).prompts[0]


def _refused(fn, param: str) -> str:
    with pytest.raises(ApiError) as e:
        fn()
    assert e.value.status == 400 and e.value.param == param, (e.value.status, e.value.param, e.value.message)
    return e.value.message


def test_chat_template_kwargs_reach_the_template(tok):
    """Qwen3's `chat_template_kwargs: {"enable_thinking": false}` (vLLM's way to switch thinking off) was a 400
    "chat_template_kwargs is not supported": no request could turn Qwen3's thinking off."""
    got = _chat(tok, chat_template_kwargs={"enable_thinking": False})
    assert got == _want(tok, MSGS, enable_thinking=False)
    assert tok.decode(got).endswith("<think>\n\n</think>\n\n")
    assert _chat(tok, chat_template_kwargs={}) == _chat(tok) == _want(tok, MSGS)


def test_continue_final_message_continues_the_assistant_turn(tok):
    """vLLM's prefill (`continue_final_message: true, add_generation_prompt: false`) was a 400; it now renders what
    transformers renders: the final assistant message left open, its reasoning kept."""
    messages = [*MSGS, {"role": "assistant", "content": "The answer is", "reasoning_content": "think"}]
    got = parse_chat({"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
                     tok).prompts[0]
    assert got == _want(tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(got).endswith("<think>\nthink\n</think>\n\nThe answer is")
    ended = parse_chat({"messages": messages, "add_generation_prompt": False}, tok).prompts[0]
    assert ended == _want(tok, messages, add_generation_prompt=False)


def test_continue_final_message_with_a_generation_prompt_is_a_400_naming_both(tok):
    """As vLLM: both at once cannot be rendered; add_generation_prompt defaults to true, so it must be sent false."""
    for extra in ({}, {"add_generation_prompt": True}):
        msg = _refused(lambda: _chat(tok, continue_final_message=True, **extra), "continue_final_message")
        assert "add_generation_prompt" in msg and "false" in msg
    assert "must be a boolean" in _refused(lambda: _chat(tok, add_generation_prompt="no"), "add_generation_prompt")


def test_documents_reach_the_template(tok, monkeypatch):
    """vLLM's `documents` (a RAG template's sources) were silently dropped: the reply answered without them."""
    monkeypatch.setattr(tok, "chat_template", RAG)
    docs = [{"title": "Paris", "text": "Capital of France."}]
    got = _chat(tok, documents=docs)
    assert got == _want(tok, MSGS, documents=docs) != _want(tok, MSGS)
    assert "must be a list of objects" in _refused(lambda: _chat(tok, documents=["text"]), "documents")


@pytest.mark.parametrize("kwargs, names", [({"tokenize": False}, "tokenize"),
                                           ({"add_generation_prompt": False}, "add_generation_prompt"),
                                           ({"max_length": 3, "truncation": True}, "max_length, truncation")])
def test_chat_template_kwargs_cannot_change_the_tokenization(tok, kwargs, names):
    """apply_chat_template's own arguments in chat_template_kwargs would have truncated or untokenized the prompt (or
    collided with the request's field): a 400 naming them, not a tokenizer's TypeError."""
    msg = _refused(lambda: _chat(tok, chat_template_kwargs=kwargs), "chat_template_kwargs")
    assert f"cannot set {names}" in msg
    assert "must be an object" in _refused(lambda: _chat(tok, chat_template_kwargs=["x"]), "chat_template_kwargs")


def test_template_fields_on_a_completion_are_refused_not_ignored(tok):
    """A text prompt has no template: chat_template_kwargs there would be silently ignored."""
    msg = _refused(lambda: parse_completion({"prompt": "Hi", "chat_template_kwargs": {"enable_thinking": False}}, tok),
                   "chat_template_kwargs")
    assert "applies to chat messages only" in msg
    assert parse_completion({"prompt": "Hi", "add_generation_prompt": True, "chat_template_kwargs": {}}, tok).prompts


def test_an_openai_batch_line_passes_its_template_fields(tok):
    """`infer run` OpenAI batch lines: the same fields as the server (they were refused as unsupported)."""
    line = {"custom_id": "a", "url": "/v1/chat/completions",
            "body": {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}}}
    assert parse_request(line, tok, "0").prompt_token_ids == _want(tok, MSGS, enable_thinking=False)
    line["body"] = {"messages": MSGS, "continue_final_message": True}
    with pytest.raises(RequestError, match="body.continue_final_message=true needs add_generation_prompt=false"):
        parse_request(line, tok, "0")
    line["url"], line["body"] = "/v1/completions", {"prompt": "Hi", "documents": [{"title": "t", "text": "x"}]}
    with pytest.raises(RequestError, match="body.documents applies to chat messages only"):
        parse_request(line, tok, "0")
    with pytest.raises(RequestError, match="unknown field"):  # infer's own line format has no such fields
        parse_request({"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}}, tok, "0")


@pytest.mark.parametrize("calls", ["get_weather()", [["get_weather"]], {"function": {"name": "f"}}])
def test_tool_calls_that_are_not_a_list_of_objects_are_a_400_naming_them(tok, monkeypatch, calls):
    """A Qwen-style template answered "Object of type Undefined is not JSON serializable" (naming nothing the client
    sent), and a template that never reads tool_calls (Gemma-2's) rendered them away with a 200; vLLM refuses such a
    message as invalid."""
    monkeypatch.setattr(tok, "chat_template", "{%- for m in messages %}{{- m.role + ': ' + m.content }}"
                                              "{%- for c in m.tool_calls or [] %}{{- c.function | tojson }}"
                                              "{%- endfor %}{%- endfor %}")
    messages = [*MSGS, {"role": "assistant", "content": None, "tool_calls": calls}]
    msg = _refused(lambda: parse_chat({"messages": messages}, tok), "messages")
    assert "messages[1].tool_calls must be a list of tool call objects" in msg
    ok = [*MSGS, {"role": "assistant", "content": "Sure", "tool_calls": None}, {"role": "user", "content": "and?"}]
    assert parse_chat({"messages": ok}, tok).prompts[0] == _want(tok, ok)  # null: no tool calls, as in vLLM


def test_llm_chat_takes_vllms_template_options():
    """vLLM's LLM.chat(messages, params, chat_template_kwargs=..., add_generation_prompt=...,
    continue_final_message=...): the same token ids as transformers' apply_chat_template with those options."""
    from infer import LLM, SamplingParams
    from infer.errors import RequestError
    with LLM("tiny-qwen3", block_size=4) as llm:
        tok = llm.tokenizer
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                             "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n"
                             "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                             "{% endif %}{% endif %}")
        msgs = [{"role": "user", "content": "hi"}]
        p = SamplingParams(max_new_tokens=2)
        plain = llm.chat(msgs, p)[0]
        quiet = llm.chat([msgs, msgs], p, chat_template_kwargs={"enable_thinking": False})
        more = llm.chat(msgs + [{"role": "assistant", "content": "Sure, "}], p, add_generation_prompt=False,
                        continue_final_message=True)[0]
        assert plain.prompt_token_ids == tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
        assert quiet[0].prompt_token_ids == quiet[1].prompt_token_ids == tok.apply_chat_template(
            msgs, add_generation_prompt=True, enable_thinking=False)["input_ids"] != plain.prompt_token_ids
        assert more.prompt_token_ids == tok.apply_chat_template(
            msgs + [{"role": "assistant", "content": "Sure, "}], continue_final_message=True)["input_ids"]
        with pytest.raises(RequestError, match="needs add_generation_prompt=false"):
            llm.chat(msgs, p, continue_final_message=True)
        with pytest.raises(RequestError, match="takes a conversation"):
            llm.chat("hi", p)
