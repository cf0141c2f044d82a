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


# ------------------------------------------------------------------ non-finite logits end their request only
import math  # noqa: E402

import torch  # noqa: E402

from infer.engine.sampler import NOT_FINITE, Sampler  # noqa: E402


@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("temperature,logprobs", [(0.0, None), (1.0, None), (0.0, 2), (0.8, 1)])
def test_the_sampler_marks_rows_whose_logits_are_not_finite(poison, temperature, logprobs):
    from infer import SamplingParams
    from infer.engine.sequence import Sequence
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = poison
    logits[2, :] = -math.inf  # a row every mask emptied is not this error (bad_words and grammars handle it)
    logits[2, 4] = -math.inf
    params = SamplingParams(temperature=temperature, logprobs=logprobs, seed=1, max_new_tokens=4)
    seqs = [Sequence(f"r{i}", [1, 2], params) for i in range(3)]
    out = Sampler(0).sample(logits, seqs)
    tokens, _ = out.decode(out.packed.cpu())
    assert tokens[1] == NOT_FINITE and tokens[0] != NOT_FINITE and tokens[2] != NOT_FINITE
    assert 0 <= int(out.tokens[1]) < 50  # the next step's input id stays in the vocabulary


def test_a_request_whose_logits_are_not_finite_ends_with_an_error_and_the_others_complete(monkeypatch):
    from infer import LLM, SamplingParams
    real = Sampler.sample

    def poisoned(self, logits, seqs, inputs=None):
        logits = logits.clone()
        for i, s in enumerate(seqs):
            if s.request_id == llm_ids[1] and s.num_generated >= 2:  # the second prompt, from its third token
                logits[i, 5] = math.nan
        return real(self, logits, seqs, inputs)
    monkeypatch.setattr(Sampler, "sample", poisoned)
    llm_ids = ["llm-1", "llm-2", "llm-3"]  # LLM.generate's ids, in the prompts' order
    with LLM("tiny-llama") as llm:
        outs = llm.generate(["one prompt", "two prompt", "three prompt"],
                            SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0))
    assert [o.request_id for o in outs] == llm_ids
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "logits for this request were not finite (NaN or inf) at output token 3" in outs[1].error
    assert len(outs[1].outputs[0].token_ids) == 2 and NOT_FINITE not in outs[1].outputs[0].token_ids
    assert all(len(outs[i].outputs[0].token_ids) == 6 for i in (0, 2))
