"""Probes of the thirty-fourth session: a chat whose template renders request fields besides the contents
(`documents`, `tools`) is measured before it is tokenized, so megabytes of documents are refused at once instead of
tokenized (which held a server's parse threads for seconds and could take a run's memory)."""

from __future__ import annotations

import pytest

from infer.engine.inputs import encode_prompt
from infer.engine.prompt_size import PromptTooLongError
from infer.models.tiny import ensure_builtin

RAG = ("{% for d in documents %}<doc>{{ d['text'] }}</doc>{% endfor %}{% for m in messages %}"
       "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
NO_DOCS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))


def _untokenizable(tok, monkeypatch):
    """The tokenizer refuses to tokenize: a refusal must come from the rendered text's size alone."""
    real = tok.apply_chat_template

    def render_only(*args, **kw):
        assert not kw.get("tokenize", True), "the chat was tokenized"
        return real(*args, **kw)
    monkeypatch.setattr(tok, "apply_chat_template", render_only)


def test_documents_the_template_renders_count_toward_the_prompt_size(tok, monkeypatch):
    _untokenizable(tok, monkeypatch)
    docs = [{"title": "t", "text": "hello " * 200_000}]
    with pytest.raises(PromptTooLongError, match="bytes long"):
        encode_prompt(tok, messages=[{"role": "user", "content": "hi"}], max_tokens=2048,
                      template={"chat_template": RAG, "documents": docs})


def test_tools_in_a_message_field_count_too(tok, monkeypatch):
    _untokenizable(tok, monkeypatch)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {{ m['name'] }}{% endfor %}"
    with pytest.raises(PromptTooLongError):
        encode_prompt(tok, messages=[{"role": "user", "content": "hi", "name": "x" * 1_000_000}], max_tokens=512,
                      template={"chat_template": template})


def test_large_arguments_a_template_ignores_do_not_refuse_the_chat(tok):
    docs = [{"title": "t", "text": "hello " * 200_000}]
    got = encode_prompt(tok, messages=[{"role": "user", "content": "hi"}], max_tokens=2048,
                        template={"chat_template": NO_DOCS, "documents": docs})
    assert got == encode_prompt(tok, messages=[{"role": "user", "content": "hi"}], max_tokens=2048,
                                template={"chat_template": NO_DOCS})


def test_a_chat_that_fits_renders_once_and_is_the_template_s_tokens(tok, monkeypatch):
    calls = []
    real = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **kw: calls.append(kw.get("tokenize")) or real(*a, **kw))
    docs = [{"title": "t", "text": "a short document"}]
    got = encode_prompt(tok, messages=[{"role": "user", "content": "hi"}], max_tokens=2048,
                        template={"chat_template": RAG, "documents": docs})
    assert calls == [True]  # small arguments: no text render first
    want = real([{"role": "user", "content": "hi"}], chat_template=RAG, documents=docs, add_generation_prompt=True,
                tokenize=True, return_dict=True)["input_ids"]
    assert got == list(want)


# ------------------------------------------------------------------ OpenAI batch lines read as the server reads them
from infer.engine.inputs import parse_request  # noqa: E402
from infer.errors import RequestError  # noqa: E402

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("line,error", [
    ({"custom_id": "a", "url": "/v1/chat/completions", "body": {"prompt": "y"}}, "body.messages is missing"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"messages": CHAT}}, "takes a prompt"),
    ({"custom_id": "a", "prompt": "top level", "max_new_tokens": 1, "body": {"prompt": "b"}},
     r"unknown field\(s\) \['max_new_tokens', 'prompt'\] in an OpenAI batch line"),
    ({"custom_id": "a", "id": "b", "body": {"prompt": "b"}}, r"unknown field\(s\) \['id'\]"),
    ({"custom_id": "a", "method": "GET", "body": {"prompt": "b"}}, "method 'GET' is not supported"),
    ({"custom_id": "a", "body": {"prompt": "b", "max_tokens": "2"}}, "field 'max_tokens' must be"),
    ({"custom_id": "a", "body": {"prompt": "b", "max_completion_tokens": 1.5}}, "field 'max_completion_tokens'"),
])
def test_batch_lines_the_server_would_refuse_are_refused(tok, line, error):
    with pytest.raises(RequestError, match=error):
        parse_request(line, tok, "0")


def test_batch_lines_the_server_takes_still_parse(tok):
    chat = parse_request({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"messages": CHAT, "max_tokens": 3}}, tok, "0")
    plain = parse_request({"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}},
                          tok, "0")
    bare = parse_request({"custom_id": "c", "body": {"messages": CHAT}}, tok, "0")  # no url: either kind
    assert chat.params.max_new_tokens == 3 and plain.params.max_new_tokens == 2
    assert chat.prompt_token_ids == bare.prompt_token_ids != plain.prompt_token_ids


@pytest.mark.parametrize("key,value,n_hint", [("n", 2, True), ("best_of", 3, True), ("echo", True, False),
                                              ("tools", [{"type": "function"}], False)])
def test_an_unsupported_batch_field_s_hint_is_about_that_field(tok, key, value, n_hint):
    with pytest.raises(RequestError) as e:
        parse_request({"custom_id": "a", "body": {"prompt": "b", key: value}}, tok, "0")
    assert e.value.message.startswith(f"body.{key}: ")
    assert ("for n > 1" in e.value.hint) == n_hint, e.value.hint
