"""POST /v1/responses, OpenAI's Responses API as vLLM serves it: a Responses body runs as the chat completion it
stands for (the same prompt, sampling, tools, reasoning split, structured output and LoRA), and the reply is a
Responses object, whole or as OpenAI's typed SSE events (read by the official openai SDK too); what infer does not
take (stored responses, background, built-in tools, non-text input) is a 400 or 404 that says so."""

from __future__ import annotations

import functools
import json
import re
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.body import BodyLimits  # noqa: E402
from infer.serve.responses import to_chat  # noqa: E402

from helpers import StepGate, tiny_llama_with_template, wait_until  # noqa: E402

# a template that renders the tools, an assistant's calls and a tool message's call id (to check what reaches it)
TEMPLATE = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
            "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments }} {{ c.id }}"
            "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather now", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                                "parameters": WEATHER}}]
MAX_LEN = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_llama_with_template(tmp_path_factory.mktemp("responses") / "tiny-resp", TEMPLATE))


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    from lora_helpers import hf_float, save_adapter
    return str(save_adapter(hf_float(model), tmp_path_factory.mktemp("lora") / "pirate", seed=5, r=4,
                            lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


@pytest.fixture(scope="module")
def engine(model, adapter):
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=4, max_model_len=MAX_LEN, max_lora_rank=8,
                                    loras={"pirate": adapter}))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-resp", tool_parser="hermes")) as base:
        yield base


def _resp(base, **body):
    return httpx.post(f"{base}/v1/responses", json={"max_output_tokens": 8, "temperature": 0, **body}, timeout=120)


def _chat(base, messages, **body):
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()


def _events(base, **body) -> list[tuple[str, dict]]:
    """(event: line, data) of each streamed event."""
    out, name = [], None
    with httpx.stream("POST", f"{base}/v1/responses", json={"max_output_tokens": 8, "temperature": 0, **body,
                                                            "stream": True}, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
                name = None
    return out


def _text(resp: dict) -> str:
    return "".join(c["text"] for item in resp["output"] if item["type"] == "message" for c in item["content"])


# ------------------------------------------------------------------------------------------- the request
def test_input_and_instructions_run_as_the_chat_completion_of_the_same_messages(served):
    r = _resp(served, input="hello there", instructions="be brief", ignore_eos=True)
    assert r.status_code == 200, r.text
    chat = _chat(served, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
                 ignore_eos=True)
    body = r.json()
    assert _text(body) == chat["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert body["usage"]["output_tokens"] == 8 and body["usage"]["total_tokens"] == chat["usage"]["total_tokens"]
    # a list of message items: input_text parts, "type": "message" or not, developer as a system message
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}]
    r2 = _resp(served, input=items, ignore_eos=True)
    assert r2.status_code == 200, r2.text
    assert _text(r2.json()) == _text(body) and r2.json()["usage"]["input_tokens"] == body["usage"]["input_tokens"]


def test_an_incomplete_assistant_message_last_is_continued(served):
    first = _resp(served, input="tell", max_output_tokens=3, ignore_eos=True).json()
    assert first["status"] == "incomplete"
    more = _resp(served, input=[{"role": "user", "content": "tell"}, *first["output"]], ignore_eos=True).json()
    chat = _chat(served, [{"role": "user", "content": "tell"}, {"role": "assistant", "content": _text(first)}],
                 continue_final_message=True, add_generation_prompt=False, ignore_eos=True)
    assert _text(more) == chat["choices"][0]["message"]["content"]
    assert more["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    # a completed one is a turn of its own: the reply is the next assistant turn
    done = [{"role": "user", "content": "tell"}, {**first["output"][0], "status": "completed"}]
    chat = _chat(served, [{"role": "user", "content": "tell"}, {"role": "assistant", "content": _text(first)}],
                 ignore_eos=True)
    assert _resp(served, input=done, ignore_eos=True).json()["usage"]["input_tokens"] == chat["usage"][
        "prompt_tokens"]


def test_the_response_object_has_openais_fields(served):
    r = _resp(served, input="hi", max_output_tokens=4, ignore_eos=True, top_p=0.5, seed=3, user="u1",
              metadata={"k": "v"}, store=True, instructions="sys")
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["id"].startswith("resp_") and b["object"] == "response" and isinstance(b["created_at"], int)
    assert b["status"] == "incomplete" and b["incomplete_details"] == {"reason": "max_output_tokens"}
    assert b["model"] == "tiny-resp" and b["error"] is None
    (msg,) = b["output"]
    assert msg["type"] == "message" and msg["id"].startswith("msg_") and msg["role"] == "assistant"
    assert msg["status"] == "incomplete" and msg["content"][0]["type"] == "output_text"
    assert msg["content"][0]["annotations"] == []
    assert (b["temperature"], b["top_p"], b["max_output_tokens"], b["instructions"]) == (0, 0.5, 4, "sys")
    assert (b["metadata"], b["user"], b["store"], b["tools"], b["tool_choice"]) == ({"k": "v"}, "u1", False, [], "auto")
    assert b["parallel_tool_calls"] is True and b["text"] == {"format": {"type": "text"}}
    u = b["usage"]
    assert u["input_tokens_details"]["cached_tokens"] >= 0 and u["output_tokens_details"] == {"reasoning_tokens": 0}
    # a reply that stops before its limit is completed
    done = _resp(served, input="hi", guided_regex="ok", max_output_tokens=20).json()
    assert done["status"] == "completed" and done["incomplete_details"] is None and _text(done) == "ok"
    assert done["output"][0]["status"] == "completed"


def test_the_response_id_follows_x_request_id_as_chat_does(served):
    r = httpx.post(f"{served}/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                   headers={"X-Request-Id": "abc123"}, timeout=60)
    assert r.json()["id"] == "resp_abc123" and r.headers["x-request-id"] == "abc123"


def test_a_stream_sends_openais_typed_events_in_order(served):
    whole = _resp(served, input="hello", ignore_eos=True).json()
    events = _events(served, input="hello", ignore_eos=True)
    assert all(name == data["type"] for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    kinds = [d["type"] for _, d in events]
    deltas = [d for d in (e for _, e in events) if d["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    item_id = events[2][1]["item"]["id"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert text == _text(whole) == events[-4][1]["text"]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["usage"] == {**whole["usage"], "input_tokens_details":
                                                                 final["usage"]["input_tokens_details"]}
    assert final["output"][0]["id"] == item_id and _text(final) == text
    assert _events(served, input="hi", guided_regex="ok", max_output_tokens=20)[-1][0] == "response.completed"


def _cold(base):
    """Forget the cached prefixes: a prompt prefilled over cached blocks gets logprobs that differ from a whole
    prefill's in the last float bits (and under --dist worksteal another test of the module may have cached it)."""
    assert httpx.post(f"{base}/reset_prefix_cache", timeout=60).status_code == 200


def test_logprobs_come_as_chats_when_included(served):
    include = ["message.output_text.logprobs"]
    _cold(served)
    r = _resp(served, input="hi", include=include, top_logprobs=2, ignore_eos=True).json()
    _cold(served)
    chat = _chat(served, [{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, ignore_eos=True)
    lp = r["output"][0]["content"][0]["logprobs"]
    assert lp == chat["choices"][0]["logprobs"]["content"] and len(lp) == 8 and len(lp[0]["top_logprobs"]) == 2
    assert _resp(served, input="hi", top_logprobs=2).json()["output"][0]["content"][0]["logprobs"] == []  # as vLLM
    _cold(served)
    events = _events(served, input="hi", include=include, top_logprobs=2, ignore_eos=True)
    streamed = [x for _, d in events if d["type"] == "response.output_text.delta" for x in d["logprobs"]]
    done = [d for _, d in events if d["type"] == "response.output_text.done"][0]
    assert done["logprobs"] == lp and [x["token"] for x in streamed] == [x["token"] for x in lp]
    assert events[-1][1]["response"]["output"][0]["content"][0]["logprobs"] == lp


def test_the_openai_sdk_reads_it_whole_and_streamed(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none")
    resp = client.responses.create(model="tiny-resp", input="hi", max_output_tokens=20, temperature=0,
                                   extra_body={"guided_regex": "fine, thanks"})
    assert resp.output_text == "fine, thanks" and resp.status == "completed" and resp.usage.output_tokens > 0
    kinds, text = [], ""
    for ev in client.responses.create(model="tiny-resp", input="hi", max_output_tokens=20, temperature=0,
                                      stream=True, extra_body={"guided_regex": "fine, thanks"}):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            assert ev.response.output_text == "fine, thanks"
    assert text == "fine, thanks" and kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_text_format_is_chats_response_format(served):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    r = _resp(served, input="json", max_output_tokens=40, text={"format": fmt})
    assert r.status_code == 200, r.text
    chat = _chat(served, [{"role": "user", "content": "json"}], max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert _text(r.json()) == chat["choices"][0]["message"]["content"] and _text(r.json()).startswith("{")
    assert r.json()["text"]["format"] == fmt
    r = _resp(served, input="json", max_output_tokens=30, text={"format": {"type": "json_object"}})
    chat = _chat(served, [{"role": "user", "content": "json"}], max_tokens=30, response_format={"type": "json_object"})
    assert r.status_code == 200 and _text(r.json()) == chat["choices"][0]["message"]["content"]
    assert _text(r.json()).lstrip().startswith("{")
    bad = _resp(served, input="json", text={"format": {"type": "json_schema", "name": "x"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text"


def test_a_lora_adapter_is_chosen_by_model_as_in_chat(served):
    a = _resp(served, input="hello", model="pirate", ignore_eos=True).json()
    chat = _chat(served, [{"role": "user", "content": "hello"}], model="pirate", ignore_eos=True)
    base = _resp(served, input="hello", ignore_eos=True).json()
    assert a["model"] == "pirate" and _text(a) == chat["choices"][0]["message"]["content"] != _text(base)
    r = _resp(served, input="hello", model="nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ------------------------------------------------------------------------------------------- tools
FORCED = re.escape('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_auto_tool_calls_are_function_call_items(served):
    r = _resp(served, input="weather?", tools=TOOLS, guided_regex=FORCED, max_output_tokens=80)
    assert r.status_code == 200, r.text
    b = r.json()
    assert [o["type"] for o in b["output"]] == ["message", "function_call"] and b["status"] == "completed"
    call = b["output"][1]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"] and call["id"].startswith("fc_") and call["status"] == "completed"
    assert _text(b) == "Sure." and b["tools"] == TOOLS and b["tool_choice"] == "auto"
    events = _events(served, input="weather?", tools=TOOLS, guided_regex=FORCED, max_output_tokens=80)
    kinds = [d["type"] for _, d in events]
    at = kinds.index("response.output_item.added", kinds.index("response.output_item.done"))  # after the message's
    pieces = kinds[at + 1:-3]  # the call's arguments in pieces (session 62), then its end
    assert pieces and set(pieces) == {"response.function_call_arguments.delta"}
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(d["delta"] for _, d in events[at + 1:-3]) == events[-3][1]["arguments"] == call["arguments"]
    assert "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta") == "Sure."
    final = events[-1][1]["response"]
    assert final["output"][1]["call_id"] == events[-2][1]["item"]["call_id"]
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Paris"}


def test_a_named_tool_choice_forces_the_call(served):
    r = _resp(served, input="weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=40)
    assert r.status_code == 200, r.text
    (call,) = r.json()["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"])["city"] in ("Paris", "Rome")


def test_function_call_items_reach_the_template_as_the_chat_messages(served):
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = _resp(served, input=items, tools=TOOLS, tool_choice="none", ignore_eos=True)
    assert r.status_code == 200, r.text
    chat = _chat(served, messages, tools=CHAT_TOOLS, tool_choice="none", ignore_eos=True)
    tok = httpx.post(f"{served}/tokenize", json={"messages": messages, "tools": CHAT_TOOLS}).json()
    assert r.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] == tok["count"]
    assert _text(r.json()) == chat["choices"][0]["message"]["content"]
    assert to_chat({"input": items, "tools": TOOLS})["messages"] == messages


def test_the_sdk_sends_a_replys_output_items_back_with_the_call_outputs(served):
    """The SDK's tool loop: the reply's items, then a function_call_output, as the next request's input."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none")
    first = client.responses.create(model="tiny-resp", input=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                    max_output_tokens=80, temperature=0, extra_body={"guided_regex": FORCED})
    (call,) = [o for o in first.output if o.type == "function_call"]
    sent = [{"role": "user", "content": "weather?"}, *[o.model_dump(exclude_none=True) for o in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(model="tiny-resp", input=sent, tools=TOOLS, max_output_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True, "tool_choice": "none"})
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Sure.", "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                          "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    chat = _chat(served, messages, tools=CHAT_TOOLS, tool_choice="none", ignore_eos=True, max_tokens=4)
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert second.output_text == chat["choices"][0]["message"]["content"]


def test_an_engine_failure_is_a_500_or_an_error_event(served, monkeypatch):
    from infer.engine.model_runner import ModelRunner

    def run(self, batch):
        raise RuntimeError("simulated kernel failure")
    monkeypatch.setattr(ModelRunner, "run", run)
    r = _resp(served, input="hi")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    events = _events(served, input="hi")
    assert events[-1][0] == "error" and events[-1][1]["code"] == "engine_error"
    assert "simulated kernel failure" in events[-1][1]["message"]
    monkeypatch.undo()
    assert _resp(served, input="hi", max_output_tokens=2).status_code == 200


# ------------------------------------------------------------------------------------------- reasoning
def test_reasoning_is_an_output_item_before_the_message(model):
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=2, max_model_len=MAX_LEN))
    try:
        with serve_in_thread(Server(AsyncEngine(engine), "tiny-resp", reasoning_parser="deepseek_r1")) as base:
            body = {"input": "think", "max_output_tokens": 80, "guided_regex": re.escape("<think>abc</think>xyz")}
            b = _resp(base, **body).json()
            assert [o["type"] for o in b["output"]] == ["reasoning", "message"]
            assert b["output"][0]["content"] == [{"type": "reasoning_text", "text": "abc"}]
            assert b["output"][0]["id"].startswith("rs_") and _text(b) == "xyz"
            assert 0 < b["usage"]["output_tokens_details"]["reasoning_tokens"] < b["usage"]["output_tokens"]
            events = _events(base, **body)
            kinds = [d["type"] for _, d in events]
            assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
            assert "".join(d["delta"] for _, d in events if d["type"] == "response.reasoning_text.delta") == "abc"
            assert "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta") == "xyz"
            added = [d["item"] for _, d in events if d["type"] == "response.output_item.added"]
            final = events[-1][1]["response"]["output"]
            assert [o["id"] for o in final] == [a["id"] for a in added]
            assert [{**o, "id": None} for o in final] == [{**o, "id": None} for o in b["output"]]
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("body,param,words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools", "built-in tools"),
    ({"tools": CHAT_TOOLS}, "tools", "chat completions shape"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}, "tool_choice", "built-in"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_text"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "keeps no responses"),
    ({"input": None}, "input", "missing required field 'input'"),
    ({"input": []}, "input", "non-empty"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages", "input"),
    ({"max_tokens": 5}, "max_tokens", "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": -1}, "max_output_tokens", "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text", "json_schema"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"n": 2}, "n", "one reply"),
    ({"input": "word " * 600}, "input", "maximum context length"),
    ({"metadata": "x"}, "metadata", "string values"),
    ({"metadata": {"k": 1}}, "metadata", "string values"),
    ({"user": 5}, "user", "string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": None}]}, "input", "input[0].output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "call_id, name and arguments"),
    ({"input": [{"type": "computer_call"}]}, "input", "'computer_call'"),
    ({"reasoning": {"effort": "bogus"}}, "reasoning", "reasoning.effort must be one of"),
    ({"top_logprobs": 30}, "top_logprobs", "0..20"),
    ({"top_logprobs": 30, "include": ["message.output_text.logprobs"]}, "top_logprobs", "0..20"),
    ({"include": "message.output_text.logprobs"}, "include", "list of strings"),
    ({"truncation": "auto"}, "truncation", "truncation"),
])
def test_what_is_not_taken_is_a_400_naming_it(served, body, param, words):
    r = httpx.post(f"{served}/v1/responses", json={"input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"


def test_stored_responses_are_404s_that_say_why(served):
    for method, path in (("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                         ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items")):
        r = httpx.request(method, f"{served}{path}")
        assert r.status_code == 404 and "keeps no responses" in r.json()["error"]["message"], (path, r.text)
    r = _resp(served, input="hi", store=True, max_output_tokens=2)  # taken, nothing stored
    assert r.status_code == 200 and httpx.get(f"{served}/v1/responses/{r.json()['id']}").status_code == 404


# ------------------------------------------------------------------------------------------- server behaviours
def test_api_key_limits_and_metrics_hold_for_it(model):
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=2, max_model_len=MAX_LEN))
    try:
        server = Server(AsyncEngine(engine), "tiny-resp", api_key="k", limits=BodyLimits(max_body_size=4096))
        with serve_in_thread(server) as base:
            assert httpx.post(f"{base}/v1/responses", json={"input": "hi"}).status_code == 401
            assert httpx.get(f"{base}/v1/responses/x").status_code == 401
            auth = {"Authorization": "Bearer k"}
            r = httpx.post(f"{base}/v1/responses", json={"input": "x" * 5000}, headers=auth)
            assert r.status_code == 413
            r = httpx.post(f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 2}, headers=auth)
            assert r.status_code == 200
            text = httpx.get(f"{base}/metrics", headers=auth).text
            assert re.search(r'path="/v1/responses",status="200"', text) or '"/v1/responses"' in text
            assert re.search(r'infer:request_success_total\{[^}]*finished_reason="length"[^}]*\} [1-9]', text)
    finally:
        engine.close()


_Gate = functools.partial(StepGate, closed=True)  # (helpers.py): held until opened


_until = wait_until  # (helpers.py)


def test_a_full_queue_is_a_503_and_a_client_gone_aborts(model):
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=1, max_model_len=MAX_LEN))
    try:
        server = Server(AsyncEngine(engine, max_queue=1), "tiny-resp")
        with serve_in_thread(server) as base, _Gate(engine) as gate:
            results = []
            body = {"input": "wait", "max_output_tokens": 2}
            threads = [threading.Thread(target=lambda: results.append(httpx.post(f"{base}/v1/responses", json=body,
                                                                                 timeout=60))) for _ in range(2)]
            for t in threads:
                t.start()
            assert _until(lambda: server.aengine.num_in_flight() == 2)
            r = httpx.post(f"{base}/v1/responses", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
            gate.open.set()
            for t in threads:
                t.join(60)
            assert [x.status_code for x in results] == [200, 200]
            # a stream left after its first delta: the request is aborted (its KV blocks freed)
            gate.open.clear()
            stream = {"input": "story", "max_output_tokens": 200, "ignore_eos": True, "stream": True}

            def opener():
                time.sleep(0.1)
                gate.open.set()
            threading.Thread(target=opener).start()
            with httpx.stream("POST", f"{base}/v1/responses", json=stream, timeout=60) as s:
                for line in s.iter_lines():
                    if "response.output_text.delta" in line:
                        break
            assert _until(lambda: server.stats()["num_in_flight"] == 0 and server.stats()["num_running"] == 0)
            assert server.stats()["kv_blocks_used"] == 0
            text = httpx.get(f"{base}/metrics").text
            assert re.search(r'infer:request_finished_total\{[^}]*finished_reason="abort"[^}]*\} 1\.0', text)
    finally:
        engine.close()
