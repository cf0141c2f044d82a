"""Probes of `infer serve` through the official OpenAI Python SDK, session 52: a Responses reply said `store: true`
though infer stores nothing (vLLM without its store sets the request's store to false, and its reply says so); a
chat reply's return_token_ids prompt ids were only in its choices, where vLLM's chat response (and its stream's first
chunk) holds them at the top, where a client reads response.prompt_token_ids; a chat request's `echo` (vLLM's: the
last message's text before the reply's, when it has the reply's role) was a 400."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_probes_session43_sdk import client, engine  # noqa: E402, F401 (fixtures)


@pytest.mark.parametrize("store", [None, True, False])
def test_a_response_says_it_was_not_stored(client, store):
    extra = {} if store is None else {"store": store}
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, **extra)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=2, stream=True, **extra))
    assert events[0].response.store is False and events[-1].response.store is False


@pytest.mark.parametrize("n", [1, 2])
def test_a_chat_replys_prompt_token_ids_are_at_its_top_as_vllms(client, engine, n):
    messages = [{"role": "user", "content": "hi"}]
    want = list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
    kw = dict(model="tiny", messages=messages, max_tokens=2, n=n, extra_body={"return_token_ids": True})
    r = client.chat.completions.create(**kw)
    assert r.model_extra["prompt_token_ids"] == want
    assert all(len(c.model_extra["token_ids"]) == 2 for c in r.choices)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    tops = [(c.choices[0].index, c.model_extra.get("prompt_token_ids")) for c in chunks]
    assert [(i, ids) for i, ids in tops if ids is not None] == [(i, want) for i in range(n)]
    assert tops[:n] == [(i, want) for i in range(n)]  # each choice's first chunk, its role's
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert "prompt_token_ids" not in plain.model_extra
    done = client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"return_token_ids": True})
    assert "prompt_token_ids" not in done.model_extra and done.choices[0].model_extra["prompt_token_ids"]


PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def _streamed(client, n, **kw) -> list[str]:
    chunks = list(client.chat.completions.create(stream=True, n=n, **kw))
    assert all(len(c.choices) == 1 for c in chunks)
    return ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2])
def test_a_chat_echo_puts_the_last_messages_text_before_the_reply_as_vllm(client, n):
    kw = dict(model="tiny", messages=PREFILL, max_tokens=3, temperature=0, n=n)
    plain = client.chat.completions.create(**kw, extra_body=CONTINUE)
    echoed = client.chat.completions.create(**kw, extra_body={**CONTINUE, "echo": True})
    assert [c.message.content for c in echoed.choices] == ["Sure, " + c.message.content for c in plain.choices]
    assert echoed.usage == plain.usage  # the echo is no token of the reply
    assert _streamed(client, **kw, extra_body={**CONTINUE, "echo": True}) == [c.message.content
                                                                              for c in echoed.choices]
    # the assistant's turn with a generation prompt too (the reply's role), its text parts joined by newlines
    parts = [PREFILL[0], {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]
    r = client.chat.completions.create(model="tiny", messages=parts, max_tokens=2, extra_body={"echo": True})
    assert r.choices[0].message.content.startswith("a\nb")


def test_a_chat_echo_of_a_user_turn_echoes_nothing_as_vllm(client):
    kw = dict(model="tiny", messages=PREFILL[:1], max_tokens=3, temperature=0)
    plain = client.chat.completions.create(**kw)
    echoed = client.chat.completions.create(**kw, extra_body={"echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content
    assert _streamed(client, 1, **kw, extra_body={"echo": True}) == [plain.choices[0].message.content]
