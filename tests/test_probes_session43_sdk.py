"""Probes of `infer serve` through the official OpenAI Python SDK, session 43: stream_options that the SDK's own
types carry (include_obfuscation) were refused with a 400; a chat prompt past the context was a 400 naming `prompt`,
a field the chat request has not; `top_logprobs: 0` without `logprobs` (a default some clients send) was a 400
where vLLM refuses only a positive count."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from helpers import openai_sdk_client, tiny_chat_engine  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_chat_engine(tmp_path_factory, "probes_s43_sdk")


@pytest.fixture(scope="module")
def client(engine):
    yield from openai_sdk_client(engine)


@pytest.mark.parametrize("chat", [True, False])
def test_stream_options_include_obfuscation_of_the_sdk_is_taken(client, chat):
    kw = dict(model="tiny", max_tokens=2, temperature=0, stream=True,
              stream_options={"include_usage": True, "include_obfuscation": False})
    stream = (client.chat.completions.create(messages=MESSAGES, **kw) if chat
              else client.completions.create(prompt="hi", **kw))
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="include_obfuscation must be a boolean"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True,
                                       stream_options={"include_obfuscation": "no"})


def test_a_chat_over_the_context_names_messages_not_a_prompt_it_did_not_send(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 3000}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi " * 3000, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt", e.value.body


def test_top_logprobs_0_without_logprobs_is_taken_as_vllm_takes_it(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, top_logprobs=0)
    assert r.choices[0].logprobs is None and r.usage.completion_tokens == 2
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, top_logprobs=0, logprobs=False)
    assert r.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="logprobs must be set to true") as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, top_logprobs=1)
    assert e.value.param == "top_logprobs"


def test_a_batch_line_with_top_logprobs_0_without_logprobs_is_taken(engine):
    from infer.engine.inputs import parse_request
    from infer.errors import RequestError
    line = {"custom_id": "a", "body": {"messages": MESSAGES, "max_tokens": 2, "top_logprobs": 0}}
    assert parse_request(line, engine.tokenizer, "0").params.logprobs is None
    with pytest.raises(RequestError, match="body.logprobs is not true"):
        parse_request({"custom_id": "a", "body": {**line["body"], "top_logprobs": 1}}, engine.tokenizer, "0")
