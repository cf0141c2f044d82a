"""Probes of POST /v1/responses (session 44): errors name the Responses field the client sent, ..."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from helpers import tiny_llama_with_template  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_llama_with_template(tmp_path_factory.mktemp("resp2") / "tiny-resp", TEMPLATE))


@pytest.fixture(scope="module")
def served(model):
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=2, max_model_len=256))
    try:
        with serve_in_thread(Server(AsyncEngine(engine), "tiny-resp", tool_parser="hermes")) as base:
            yield base
    finally:
        engine.close()


def _post(base, **body):
    return httpx.post(f"{base}/v1/responses", json={"max_output_tokens": 2, "temperature": 0, **body}, timeout=120)


def test_an_engine_refusal_of_the_prompt_names_input_not_the_prompt_field(served):
    """`prompt` is a Responses field of its own (a stored prompt template): a prompt the engine refuses (longer than
    the request's max_length) is the client's `input`."""
    r = _post(served, input="hello there", max_length=3)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and "max_length" in err["message"]
    r = _post(served, input="hi", prompt={"id": "pmpt_1"})  # the field itself is still named as sent
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_an_input_of_reasoning_items_alone_is_a_400_in_the_responses_words(served):
    r = _post(served, input=[{"type": "reasoning", "id": "rs_1", "summary": [],
                              "content": [{"type": "reasoning_text", "text": "hmm"}]}])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and "messages" not in err["message"] and "no message" in err["message"]


@pytest.mark.parametrize("field,value", [("service_tier", 5), ("service_tier", "fastest"), ("prompt_cache_key", 5),
                                         ("safety_identifier", ["x"]), ("max_tool_calls", "2"), ("truncation", 5)])
def test_an_echoed_field_of_the_wrong_type_is_a_400_naming_it(served, field, value):
    """These fields change nothing here but come back in the response object: a wrong one was echoed as sent (a
    response a typed client cannot read), where vLLM and OpenAI refuse it."""
    r = _post(served, input="hi", **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    ok = _post(served, input="hi", service_tier="flex", prompt_cache_key="k", safety_identifier="u", max_tool_calls=2,
               truncation="disabled")
    assert ok.status_code == 200 and ok.json()["service_tier"] == "flex" and ok.json()["prompt_cache_key"] == "k"


def test_a_continued_message_is_content_not_reasoning_with_a_reasoning_parser(model):
    """An incomplete message sent back (its reasoning done, its text cut) is continued: with --reasoning-parser
    deepseek_r1 the continuation (no closing tag in it, the template leaving the reasoning out) was all reasoning,
    the message's text empty; chat's continue_final_message the same."""
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=2, max_model_len=256))
    try:
        with serve_in_thread(Server(AsyncEngine(engine), "tiny-resp", reasoning_parser="deepseek_r1")) as base:
            sent = [{"role": "user", "content": "q"},  # a reply cut at max_output_tokens, as the SDK sends it back
                    {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                     "content": [{"type": "reasoning_text", "text": "ab"}]},
                    {"type": "message", "id": "msg_1", "role": "assistant", "status": "incomplete",
                     "content": [{"type": "output_text", "text": "hel", "annotations": [], "logprobs": []}]}]
            more = _post(base, input=sent, max_output_tokens=10, guided_regex="lo world").json()
            assert [o["type"] for o in more["output"]] == ["message"] and more["output"][0]["content"][0]["text"] \
                == "lo world"
            chat = httpx.post(f"{base}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "hel"}],
                "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 10, "temperature": 0,
                "guided_regex": "lo world"}, timeout=60).json()
            assert chat["choices"][0]["message"]["content"] == "lo world"
            assert chat["choices"][0]["message"]["reasoning"] is None
            # a message that opens a think block it does not close is still continued as reasoning
            open_ = httpx.post(f"{base}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>a"}],
                "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 10, "temperature": 0,
                "guided_regex": "b</think>c"}, timeout=60).json()
            assert open_["choices"][0]["message"]["reasoning"] == "b" and open_["choices"][0]["message"]["content"] \
                == "c"
    finally:
        engine.close()


def test_the_response_and_every_event_validate_as_the_openai_sdks_types(served):
    """The SDK reads without validating, so a field its types require but the server leaves out is an
    AttributeError when read (usage.input_tokens_details.cache_write_tokens) and a failure for a validating client."""
    openai_types = pytest.importorskip("openai.types.responses")
    pydantic = pytest.importorskip("pydantic")
    if "cache_write_tokens" not in openai_types.response_usage.InputTokensDetails.model_fields:
        pytest.skip("this openai SDK has no cache_write_tokens")
    body = {"input": "hi", "max_output_tokens": 3, "ignore_eos": True, "include": ["message.output_text.logprobs"],
            "top_logprobs": 1}
    whole = _post(served, **body).json()
    openai_types.Response.model_validate(whole)
    events = pydantic.TypeAdapter(openai_types.ResponseStreamEvent)
    with httpx.stream("POST", f"{served}/v1/responses", json={**body, "stream": True}, timeout=60) as s:
        sent = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert sent[-1]["type"] == "response.incomplete"
    for event in sent:
        events.validate_python(event)
