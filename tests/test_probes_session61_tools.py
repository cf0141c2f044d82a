"""Session 61 (p61tools): the tool-call parsers of the families that could not call tools with tool_choice "auto",
as vLLM's: `--tool-call-parser qwen3_coder` (Qwen3-Coder, vLLM's qwen3_xml too), `seed_oss` (ByteDance Seed-OSS)
and `openai` (gpt-oss's harmony messages, refused before), whole and streamed, on replies of the shapes the models
write; malformed replies stay text (never a 500); gpt-oss's chat template gets an assistant's reasoning sent back in
the field it reads (`thinking`)."""

from __future__ import annotations

import functools
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.cli.serve import _tool_parser  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.inputs import chat_messages  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.errors import ConfigError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.tools import (ToolRequest, harmony_calls, parse_tools, qwen3_coder_calls, seed_oss_calls,  # noqa: E402
                               split, visible)

from helpers import (forced_chat_body, joined_deltas, joined_tool_calls, streamed_chat_choices,  # noqa: E402
                     tiny_chat_engine, tiny_llama_with_added_tokens)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
    "temp": {"type": "number"}, "options": {"type": "object"}, "hours": {"type": "array"}, "code": {"type": "string"}},
    "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}}}}]
FUNCTIONS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]

# Qwen3-Coder writes each tag on its own line (its chat template renders earlier calls so)
QWEN = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=celsius>\nTrue\n</parameter>\n<parameter=temp>\n21.0\n"
        "</parameter>\n<parameter=options>\n{\"units\": \"metric\", \"wind\": true}\n</parameter>\n"
        "<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=code>\n007\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>")
QWEN_ARGS = [{"city": "Paris", "days": 3, "celsius": True, "temp": 21, "options": {"units": "metric", "wind": True},
              "hours": [9, 12], "code": "007"}, {"zone": "Europe/Paris"}]
# Seed-OSS thinks first (its reasoning parser's tags), then calls
SEED = ("<seed:think>The user wants the weather.</seed:think>Checking.<seed:tool_call>\n<function=get_weather>\n"
        "<parameter=city>Paris</parameter>\n<parameter=hours>[9, 12]</parameter>\n<parameter=temp>-2.5</parameter>\n"
        "<parameter=days>null</parameter>\n</function>\n</seed:tool_call>")
SEED_ARGS = [{"city": "Paris", "hours": [9, 12], "temp": -2.5, "days": None}]
# gpt-oss after its template's prompt (which ends <|start|>assistant): analysis, then a call on commentary, ended by
# <|call|> (its stop token: a generated reply's text leaves it out)
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\",\"days\":3}")
HARMONY_TWO = (HARMONY_CALL + "<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json"
               "<|message|>{\"zone\": \"Europe/Paris\"}")
HARMONY_ANSWER = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>commentary<|message|>"
                  "Let me answer.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.")


def auto(parser: str, **kw) -> ToolRequest:
    return parse_tools({"tools": TOOLS, **kw}, parser)


def args_of(calls: list[dict]) -> list:
    return [json.loads(c["function"]["arguments"]) for c in calls]


# ------------------------------------------------------------------------------------------- the parsers
def test_qwen3_coder_reads_calls_typed_by_the_tools_schema():
    """vLLM's qwen3_coder: the content before <tool_call>, each function's parameters typed by its schema (an
    integer, a boolean, an integral number as an int, an object and an array as JSON, a string kept as written)."""
    content, calls = split(auto("qwen3_coder"), QWEN)
    assert content == "I will check.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert args_of(calls) == QWEN_ARGS
    assert '"temp": 21,' in calls[0]["function"]["arguments"]  # 21.0: an int, as vLLM writes an integral number
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["id"] != calls[1]["id"]


def test_seed_oss_reads_calls_after_its_think_block():
    """vLLM's seed_oss: the calls inside <seed:tool_call>, after the think block (the content before them keeps it,
    as vLLM's; with --reasoning-parser seed_oss the tool parser sees the content only), `null` is null."""
    content, calls = seed_oss_calls(SEED, FUNCTIONS)
    assert content == "<seed:think>The user wants the weather.</seed:think>Checking."
    assert args_of(calls) == SEED_ARGS
    # a call mentioned while thinking is not made
    assert seed_oss_calls("<seed:think><function=get_time></function></seed:think>Hi", FUNCTIONS) is None


@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss"])
@pytest.mark.parametrize("value,kind,want", [
    ("12x", "integer", "12x"), ("nan", "number", "nan"), ("inf", "number", "inf"), ("1e400", "number", "1e400"),
    ("yes", "boolean", False), ("{1, 2}", "array", "{1, 2}"), ("[" * 3000, "array", "[" * 3000),
    ("(1, 2)", "object", [1, 2]), ("Null", "string", None), ("3", "integer", 3), ("2.50", "number", 2.5)])
def test_a_value_that_does_not_read_as_its_type_stays_text(parser, value, kind, want):
    """A value that is not its schema's type stays the text written (vLLM's "degenerating to string"), a boolean
    other than true is false (vLLM's), a Python literal is read (a tuple as a list, as vLLM's json.dumps writes it);
    one JSON cannot hold (NaN, infinity, a set) or nested deeper than Python reads stays text rather than making
    arguments no client parses (or a 500)."""
    tag, end = ("<tool_call>", "</tool_call>") if parser == "qwen3_coder" else ("<seed:tool_call>",
                                                                              "</seed:tool_call>")
    text = f"{tag}<function=f>\n<parameter=x>\n{value}\n</parameter>\n</function>{end}"
    _, calls = split(ToolRequest([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": kind}}}}}], "auto", name=parser), text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": want}


@pytest.mark.parametrize("parser,want", [("qwen3_coder", [True, None]), ("seed_oss", "[true, null]")])
def test_qwen3_coder_reads_an_array_as_json_and_seed_oss_as_a_python_literal(parser, want):
    """vLLM's qwen3_coder reads an array parameter as JSON; its seed_oss reads only an object so (an array as a
    Python literal, where `true` is no literal: the text)."""
    tag, end = ("<tool_call>", "</tool_call>") if parser == "qwen3_coder" else ("<seed:tool_call>",
                                                                              "</seed:tool_call>")
    _, calls = split(auto(parser), f"{tag}<function=get_weather><parameter=hours>[true, null]</parameter>"
                                   f"</function>{end}")
    assert args_of(calls) == [{"hours": want}]


@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss"])
@pytest.mark.parametrize("text", [
    "<TAG><function=get_weather",  # the name never ends
    "<TAG>\n<function=get_weather>\n<parameter=city\n</function></END>",  # a parameter's name never ends
    "<TAG>\n{\"name\": \"get_weather\"}\n</END>",  # hermes' JSON inside the tags: no <function=
    "The tag <TAG> is how I call tools.",
    "<function=>\n</function>",  # no name
    "<TAG>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</function>\n</END>",  # its ">" left out
])
def test_a_malformed_call_stays_text(parser, text):
    tag = "tool_call" if parser == "qwen3_coder" else "seed:tool_call"
    text = text.replace("<TAG>", f"<{tag}>").replace("</END>", f"</{tag}>")
    assert split(auto(parser), text) == (text, None)


def test_unclosed_tags_and_an_unknown_function_are_read_as_vllm_reads_them():
    """vLLM's parsers close a tag left open at the reply's end (a call cut by max_tokens after its name is a call),
    and a function not among the tools is a call whose values stay text (vLLM warns and makes it)."""
    _, calls = qwen3_coder_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", FUNCTIONS)
    assert (calls[0]["function"]["name"], args_of(calls)) == ("get_weather", [{"city": "Par"}])
    # Qwen3-Coder's parameter also ends where the next starts
    _, calls = qwen3_coder_calls("<function=get_weather><parameter=city>Rome<parameter=days>2</function>", FUNCTIONS)
    assert args_of(calls) == [{"city": "Rome", "days": 2}]
    _, calls = seed_oss_calls("<seed:tool_call><function=fly><parameter=days>2</parameter></function>", FUNCTIONS)
    assert (calls[0]["function"]["name"], args_of(calls)) == ("fly", [{"days": "2"}])


@pytest.mark.parametrize("parser,reply", [("qwen3_coder", QWEN), ("seed_oss", SEED), ("openai", HARMONY_ANSWER),
                                          ("openai", HARMONY_TWO), ("qwen3_coder", "a <b> <tool_c"),
                                          ("seed_oss", "x <function=get_time")])
def test_a_streamed_reply_only_grows_and_ends_as_the_whole(parser, reply):
    """`visible` (what a stream sends as content so far), for every prefix of the reply: it only grows, shows no
    call's tag, and is a prefix of the whole reply's content."""
    req, seen = auto(parser), ""
    whole = split(req, reply)[0] or ""
    for n in range(len(reply) + 1):
        now = visible(req, reply[:n])
        assert now.startswith(seen) and whole.startswith(now), (reply[:n], now, seen)
        assert "<function=" not in now and "tool_call>" not in now and "<|" not in now, now
        seen = now


def test_harmony_calls_as_vllms_openai_parser_reads_them():
    """gpt-oss's calls are commentary messages to=functions.NAME (the recipient before or after the channel), their
    text JSON (written again as vLLM's json.dumps(json.loads(...)) does); the content is the final channel's text
    and commentary preambles' (none: none), the analysis is neither."""
    content, calls = harmony_calls(HARMONY_TWO)
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "Europe/Paris"}')]
    assert harmony_calls(HARMONY_ANSWER) == ("Let me answer.It is sunny.", [])
    # the reply's first header written after the prompt's <|start|>assistant, recipient first
    _, calls = harmony_calls(" to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>")
    assert calls[0]["function"]["name"] == "get_time"
    assert split(auto("openai", parallel_tool_calls=False), HARMONY_TWO)[1][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("reply,want", [
    (HARMONY_CALL[:-3], '{"city":"Paris","days"'),  # cut short by max_tokens: no call, its text is content
    ("<|channel|>commentary to=functions.f<|message|>" + "[" * 3000, "[" * 3000),  # deeper than json reads
    ("no harmony markers at all", "no harmony markers at all"),
])
def test_a_harmony_call_that_does_not_read_stays_text(reply, want):
    assert split(auto("openai"), reply) == (want, None)


def test_an_ended_harmony_call_whose_text_is_not_json_is_a_call_of_that_text():
    """vLLM keeps a call whose message ended (<|call|>) with the text as its arguments; infer writes text that is
    not JSON as a JSON string, as its other parsers, so a client's json.loads reads it."""
    _, calls = harmony_calls("<|channel|>commentary to=functions.f json<|message|>{oops<|call|>")
    assert json.loads(calls[0]["function"]["arguments"]) == "{oops"


def test_tool_choice_none_required_and_named_with_the_new_parsers():
    for parser, reply in (("qwen3_coder", QWEN), ("seed_oss", SEED), ("openai", HARMONY_TWO)):
        # parallel_tool_calls false: the first call only (vLLM's maybe_filter_parallel_tool_calls)
        assert args_of(split(auto(parser, parallel_tool_calls=False), reply)[1]) == args_of(split(auto(parser),
                                                                                                  reply)[1])[:1]
        assert split(auto(parser, tool_choice="none"), QWEN) == (QWEN, None)  # "none": the text as written
        named = auto(parser, tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert named.mode == "named" and named.schema == FUNCTIONS["get_time"]
        assert split(named, '{"zone": "UTC"}')[1][0]["function"]["name"] == "get_time"
        required = auto(parser, tool_choice="required")
        assert split(required, '[{"name": "get_time", "parameters": {}}]')[1][0]["function"]["name"] == "get_time"


def test_the_cli_takes_the_new_parsers_and_vllms_qwen3_xml_name():
    assert [_tool_parser(True, p) for p in ("qwen3_coder", "qwen3_xml", "seed_oss", "openai")] == [
        "qwen3_coder", "qwen3_coder", "seed_oss", "openai"]
    with pytest.raises(ConfigError) as e:
        _tool_parser(True, "jamba")
    assert "qwen3_coder" in str(e.value.hint) and "openai" in str(e.value.hint)


# ------------------------------------------------------------------------------------------- gpt-oss's template
# the shape of the hub's gpt-oss template (openai/gpt-oss-20b, transformers' convert_gpt_oss_weights_to_hf.py): an
# assistant turn with tool calls renders its `thinking` as an analysis message (while no final answer follows), the
# first call to=functions.NAME with its arguments | tojson, then the tool's reply from functions.NAME
GPT_OSS_TEMPLATE = (
    "{%- set last_tool_call = namespace(name=none) %}{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and 'tool_calls' in message -%}"
    "{%- set future_final_message = namespace(found=false) %}"
    "{%- for future_message in messages[loop.index:] %}"
    "{%- if future_message.role == 'assistant' and 'tool_calls' not in future_message %}"
    "{%- set future_final_message.found = true %}{%- endif %}{%- endfor %}"
    "{%- set tool_call = message.tool_calls[0] %}{%- if tool_call.function %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content and message.thinking %}"
    "{{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls!') }}"
    "{%- elif message.content and not future_final_message.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.thinking and not future_final_message.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json<|message|>' }}"
    "{{- tool_call.arguments|tojson }}{{- '<|call|>' }}{%- set last_tool_call.name = tool_call.name %}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start|>functions.' + last_tool_call.name + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{- message.content|tojson + '<|end|>' }}"
    "{%- else -%}{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


def test_an_assistants_reasoning_reaches_gpt_oss_template_as_thinking():
    """The hub's gpt-oss template reads `thinking`; infer passed the reasoning sent back as reasoning_content only,
    so the analysis of a tool call's turn in progress was dropped from the next prompt."""
    out = chat_messages([{"role": "assistant", "content": None, "reasoning": "r", "tool_calls": []},
                         {"role": "assistant", "content": "x", "reasoning_content": "old"},
                         {"role": "assistant", "content": "y", "reasoning": "new", "thinking": "own"}])
    assert [m.get("thinking") for m in out] == ["r", "old", "own"]


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory):
    path = tiny_llama_with_added_tokens(tmp_path_factory.mktemp("tools61") / "harmony", MARKERS, special=True)
    return LLMEngine(EngineConfig(path, block_size=4, max_num_seqs=4))


_body = functools.partial(forced_chat_body, MESSAGES, tools=TOOLS)  # _body(reply, max_tokens, **extra)


def test_gpt_oss_calls_served_whole_and_streamed_then_sent_back(harmony_engine):
    """--tool-call-parser openai --reasoning-parser openai_gptoss: the analysis is the reasoning, each harmony call
    a tool call (finish_reason tool_calls, content null); streamed, the reasoning deltas, then the calls (their
    pieces joined) and the finish alone. The calls and the tool's result sent back render through gpt-oss's
    template with the reasoning as the turn's analysis."""
    tokenizer = harmony_engine.tokenizer
    with serve_in_thread(Server(AsyncEngine(harmony_engine), "gpt-oss", tool_parser="openai",
                                reasoning_parser="openai_gptoss", trust_request_chat_template=True)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(HARMONY_TWO, 200), timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        message = c["message"]
        assert c["finish_reason"] == "tool_calls" and message["content"] is None
        assert message["reasoning"] == "Need the weather."
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in message["tool_calls"]] == [
            ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "Europe/Paris"})]
        deltas = streamed_chat_choices(base, _body(HARMONY_TWO, 200))
        assert joined_deltas(deltas, "reasoning") == "Need the weather." and joined_deltas(deltas, "content") == ""
        calls = joined_tool_calls(deltas)  # (each call's arguments in pieces: session 62)
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls] == [
            (t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]]
        assert deltas[-1]["finish_reason"] == "tool_calls" and deltas[-1]["delta"] == {}
        # an answer: the preamble and the final channel are the content, whole and streamed
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(HARMONY_ANSWER, 200), timeout=120)
        c = r.json()["choices"][0]
        answer = "Let me answer.It is sunny."
        assert (c["finish_reason"], c["message"]["content"], "tool_calls" in c["message"]) == ("stop", answer, False)
        assert joined_deltas(streamed_chat_choices(base, _body(HARMONY_ANSWER, 200)), "content") == answer
        # no final channel, no call: content null (vLLM's), not ""
        r = httpx.post(f"{base}/v1/chat/completions", json=_body("<|channel|>analysis<|message|>Hmm.<|end|>", 50),
                       timeout=120)
        assert (r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["message"]["reasoning"]) == (
            None, "Hmm.")
        # a call cut short by max_tokens: no call, no 500
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(HARMONY_CALL, 18), timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert "tool_calls" not in r.json()["choices"][0]["message"]
        # the next request: the assistant's message as received, then the tool's result
        call = message["tool_calls"][0]
        history = [*MESSAGES, {"role": "assistant", "content": None, "reasoning": message["reasoning"],
                               "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        r = httpx.post(f"{base}/tokenize", json={"messages": history, "tools": TOOLS,
                                                 "chat_template": GPT_OSS_TEMPLATE}, timeout=60)
        assert r.status_code == 200, r.text
        prompt = tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 3}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant')


# ------------------------------------------------------------------------------------------- qwen3_coder, seed_oss
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_chat_engine(tmp_path_factory, "tools61")


@pytest.mark.parametrize("parser,reply,content,want", [
    ("qwen3_coder", QWEN, "I will check.\n", QWEN_ARGS),
    ("seed_oss", SEED.split("</seed:think>")[1], "Checking.", SEED_ARGS)])
def test_xml_calls_served_whole_and_streamed(engine, parser, reply, content, want):
    """The calls whole and streamed as the other parsers serve them (the content before them streams, then the calls'
    pieces, then the finish alone); a malformed reply is the content, finish_reason stop."""
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser=parser)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(reply, 400), timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == content
        assert args_of(c["message"]["tool_calls"]) == want
        deltas = streamed_chat_choices(base, _body(reply, 400))
        assert joined_deltas(deltas, "content") == content
        assert args_of(joined_tool_calls(deltas)) == want and deltas[-1]["finish_reason"] == "tool_calls"
        bad = reply.replace("<function=get_weather>", "<function=get_weather")
        c = httpx.post(f"{base}/v1/chat/completions", json=_body(bad, 400), timeout=120).json()["choices"][0]
        assert (c["message"]["content"], c["finish_reason"]) == (bad, "stop")
        deltas = streamed_chat_choices(base, _body(bad, 400))
        assert joined_deltas(deltas, "content") == bad and deltas[-1]["finish_reason"] == "stop"
        assert not any(d["delta"].get("tool_calls") for d in deltas)


def test_responses_api_reads_harmony_calls_as_function_call_items(harmony_engine):
    """/v1/responses with --tool-call-parser openai: the calls are function_call items, whole and streamed, and the
    stream sends no text of theirs as output_text (the commentary channel is not the answer)."""
    from test_responses_api import _events
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    body = dict(input="Weather in Paris?", tools=tools, guided_regex=forced_chat_body([], HARMONY_TWO, 0)[
        "guided_regex"], max_output_tokens=200, temperature=0)
    with serve_in_thread(Server(AsyncEngine(harmony_engine), "gpt-oss", tool_parser="openai",
                                reasoning_parser="openai_gptoss")) as base:
        r = httpx.post(f"{base}/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        items = r.json()["output"]
        assert [(o["type"], o.get("name")) for o in items] == [("reasoning", None), ("function_call", "get_weather"),
                                                              ("function_call", "get_time")]
        events = _events(base, **body)
    assert "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta") == ""
    assert [(o["type"], o.get("name")) for o in events[-1][1]["response"]["output"]] == [
        (o["type"], o.get("name")) for o in items]
