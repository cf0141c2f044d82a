"""Session 63 (p63parse): the reasoning parsers vLLM has that infer lacked (olmo3, ernie45, glm45, apertus,
cohere_command, granite), whole and streamed on the chat and Responses endpoints, their tags special tokens where the
real model's tokenizer has them so; and request refusals vLLM makes that infer did not."""

from __future__ import annotations

import pytest

from infer.serve.reasoning import (ReasoningRequest, keeps_special_tokens, parts, reasoning_request, split,
                                   tags_are_skipped)

from helpers import check_stream_adds_up, forced_chat_body, joined_deltas, streamed_chat_choices

ERNIE = "abc\n</think>\n\n<response>\nxyz\n</response>\n"  # ERNIE 4.5 Thinking's reply after its prompt's <think>
COHERE = "<|START_THINKING|>abc<|END_THINKING|><|START_RESPONSE|>xyz<|END_RESPONSE|>"
APERTUS = "<|inner_prefix|>abc<|inner_suffix|>xyz"
GRANITE = "Here is my thought process:\nabc\nHere's my response:\nxyz"
SPECIAL = ["<|inner_prefix|>", "<|inner_suffix|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>",
           "<|END_RESPONSE|>"]  # Apertus's and Command A's tags: special tokens of their tokenizers

# (parser, reply, (reasoning, content)) as vLLM's parser splits the whole reply
WHOLE = [
    ("olmo3", "<think>abc</think>xyz", ("abc", "xyz")),
    ("olmo3", "abc</think>xyz", ("abc", "xyz")),  # the template may open the block: reasoning from the start
    ("olmo3", "</think>xyz", (None, "xyz")),  # an empty reasoning is null (vLLM's olmo3: `or None`)
    ("olmo3", "<think>abc</think>", ("abc", None)),
    ("ernie45", ERNIE, ("abc\n", "\nxyz\n")),  # the text inside <response>, what follows </response> dropped
    ("ernie45", "abc\n</think>\nxyz", ("abc\n", "\nxyz")),  # an answer without the wrapper stays as written
    ("ernie45", "abc\n</think>\n\n<response>\nxy", ("abc\n", "\nxy")),  # cut short in the answer
    ("ernie45", "<think>abc</think>xyz", ("abc", "xyz")),
    ("glm45", "<think>abc</think>xyz", ("abc", "xyz")),
    ("glm45", "abc</think>xyz", (None, "abc</think>xyz")),  # no <think>: all content (vLLM's glm45)
    ("glm45", "<think>abc", ("abc", None)),  # cut short in the block
    ("apertus", APERTUS, ("abc", "xyz")),
    ("apertus", "xyz", (None, "xyz")),  # no block (a plain answer, a tool call): content, as vLLM's apertus
    ("apertus", "<think>abc</think>xyz", (None, "<think>abc</think>xyz")),  # <think> is not Apertus's tag
    ("cohere_command", COHERE, ("abc", "xyz")),
    ("cohere_command", "<|START_RESPONSE|>xyz<|END_RESPONSE|>", (None, "xyz")),  # reasoning off: the answer only
    ("cohere_command", "<|START_THINKING|>abc<|END_THINKING|>\n<|START_RESPONSE|>xy", ("abc", "xy")),
    ("cohere_command", "xyz", (None, "xyz")),
    ("granite", GRANITE, ("\nabc\n", "\nxyz")),
    ("granite", "Here's my thought process: a Here is my response: b", (" a ", " b")),
    ("granite", "Here is my thought process: a", (" a", None)),  # cut short: reasoning (vLLM's stream)
    ("granite", "xyz Here is my response: b", (None, "xyz Here is my response: b")),  # no thought: all content
]


@pytest.mark.parametrize("parser,text,want", WHOLE)
def test_each_new_parser_splits_a_whole_reply_as_vllms(parser, text, want):
    assert split(ReasoningRequest(parser), text) == want


@pytest.mark.parametrize("parser,text,_", WHOLE)
def test_each_new_parser_streams_parts_that_only_grow_and_end_as_the_whole(parser, text, _):
    """Every prefix of the reply (a tag, a marker or a wrapper cut anywhere, as a stream's tokens split it)."""
    check_stream_adds_up(ReasoningRequest(parser), text)


@pytest.mark.parametrize("parser,text,held", [
    ("glm45", "<thi", ("", "")), ("olmo3", "abc</thi", ("abc", "")), ("ernie45", "a</think>\n\n<resp", ("a", "")),
    ("apertus", "<|inner_prefix|>ab<|inner_su", ("ab", "")), ("cohere_command", "<|START_THINKING|>a<|END", ("a", "")),
    ("cohere_command", "<|START_THINKING|>a<|END_THINKING|><|START_RESP", ("a", "")),
    ("cohere_command", "<|START_RESPONSE|>xyz<|END_RES", ("", "xyz")),
    ("granite", "Here's my thou", ("", "")), ("granite", "Here is my thought process: a Here's my res", (" a ", "")),
])
def test_a_stream_holds_back_a_partial_tag(parser, text, held):
    assert parts(ReasoningRequest(parser), text, finished=False) == held


def test_the_new_parsers_keep_their_tags_when_the_tokenizer_makes_them_special():
    from infer.engine.setup import load_tokenizer
    from infer.models.tiny import ensure_builtin
    tok = load_tokenizer(str(ensure_builtin("tiny-llama")))
    assert not any(keeps_special_tokens(p, tok) for p in ("apertus", "cohere_command", "ernie45", "granite"))
    tok.add_special_tokens({"additional_special_tokens": [*SPECIAL, "<response>", "</response>"]})
    assert all(keeps_special_tokens(p, tok) for p in ("apertus", "cohere_command", "ernie45"))
    assert tags_are_skipped(tok, "ernie45") and not tags_are_skipped(tok, "olmo3")  # (<response> only: a wrapper)
    assert not keeps_special_tokens("granite", tok) and keeps_special_tokens("openai_gptoss", tok)


def test_a_prompt_that_closes_the_glm45_block_leaves_the_reply_content():
    """GLM-4.5's template with thinking off ends the prompt with <think></think>: the reply is all content."""
    from infer.engine.setup import load_tokenizer
    from infer.models.tiny import ensure_builtin
    tok = load_tokenizer(str(ensure_builtin("tiny-llama")))
    closed, opened = tok.encode("<|user|>hi<|assistant|><think></think>"), tok.encode("<|user|>hi<|assistant|>")
    assert reasoning_request("glm45", {}, closed, tok).ended and not reasoning_request("glm45", {}, opened, tok).ended
    assert split(reasoning_request("glm45", {}, closed, tok), "<think>a</think>b") == (None, "<think>a</think>b")
    cohere = reasoning_request("cohere_command", {}, tok.encode("<|START_THINKING|><|END_THINKING|>"), tok)
    assert split(cohere, "<|START_RESPONSE|>xyz<|END_RESPONSE|>") == (None, "xyz")  # the wrapper still left out


def test_the_cli_takes_the_new_parsers():
    from infer.cli.serve import _reasoning_parser
    for name in ("olmo3", "ernie45", "glm45", "apertus", "cohere_command", "granite"):
        assert _reasoning_parser(name) == name


# ------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from helpers import tiny_llama_with_added_tokens
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    model = tiny_llama_with_added_tokens(tmp_path_factory.mktemp("p63parse") / "tiny-special", SPECIAL, special=True)
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=4))
    yield engine
    engine.close()


@pytest.mark.parametrize("parser,reply,want", [
    ("olmo3", "abc</think>xyz", ("abc", "xyz")), ("ernie45", ERNIE, ("abc\n", "\nxyz\n")),
    ("glm45", "<think>abc</think>xyz", ("abc", "xyz")), ("glm45", "xyz", (None, "xyz")),
    ("apertus", APERTUS, ("abc", "xyz")), ("apertus", "xyz", (None, "xyz")),
    ("cohere_command", COHERE, ("abc", "xyz")),
    ("cohere_command", "<|START_RESPONSE|>xyz<|END_RESPONSE|>", (None, "xyz")),  # no block: the answer unwrapped
    ("granite", GRANITE, ("\nabc\n", "\nxyz")),
])
def test_a_server_splits_the_new_parsers_replies_on_chat_and_responses_whole_and_streamed(engine, parser, reply,
                                                                                           want):
    httpx = pytest.importorskip("httpx")
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    from test_probes_session62_rstream import _responses_events
    body = forced_chat_body([{"role": "user", "content": "think, then answer"}], reply, 120)
    responses = {"input": "think, then answer", "guided_regex": body["guided_regex"], "max_output_tokens": 120,
                 "temperature": 0}
    reasoning, content = want
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", reasoning_parser=parser)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == want
        deltas = streamed_chat_choices(base, body)
        assert (joined_deltas(deltas, "reasoning"), joined_deltas(deltas, "content")) == (reasoning or "", content)
        out = httpx.post(f"{base}/v1/responses", json=responses, timeout=120).json()["output"]
        assert [o["type"] for o in out] == ["reasoning"] * bool(reasoning) + ["message"]
        assert ("".join(c["text"] for o in out if o["type"] == "reasoning" for c in o["content"]),
                "".join(c["text"] for o in out if o["type"] == "message" for c in o["content"])) == (reasoning or "",
                                                                                                    content)
        events = _responses_events(base, responses)
        assert ("".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"),
                "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")) == (reasoning or "",
                                                                                                     content)


# ------------------------------------------------------------------------------------------- refusals
HISTORY = [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _history(arguments: str) -> list[dict]:
    call = {**HISTORY[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": arguments}}
    return [HISTORY[0], {**HISTORY[1], "tool_calls": [call]}, HISTORY[2]]


def test_a_history_call_whose_arguments_repeat_a_key_reaches_the_template_with_the_last_value():
    """vLLM's json.loads of the history's arguments: a key written twice holds its last value."""
    from infer.engine.inputs import chat_messages
    assert chat_messages(_history('{"city": "Rome", "city": "Paris"}'))[1]["tool_calls"][0]["function"][
        "arguments"] == {"city": "Paris"}


@pytest.mark.parametrize("arguments", ["Paris", "{\"city\": ", "{'city': 'Paris'}"])
def test_a_history_call_whose_arguments_are_not_json_is_refused_naming_it(arguments):
    """vLLM's json.loads raises on them (a 400); infer gave the template the string, which it quoted again."""
    from infer.engine.inputs import chat_messages
    from infer.errors import RequestError
    with pytest.raises(RequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not JSON") as e:
        chat_messages(_history(arguments))
    assert e.value.field == "messages" and "JSON text" in e.value.hint
    for none in ("", None):  # no arguments: {} (as vLLM)
        assert chat_messages(_history(none))[1]["tool_calls"][0]["function"]["arguments"] == {}


@pytest.mark.parametrize("parser,reply", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "city": "Paris"}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "city": "Paris"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "city": "Paris"}}]'),
    ("pythonic", '[get_weather(city="Rome", city="Paris")]'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=city>\n"
                    "Paris\n</parameter>\n</function>\n</tool_call>"),
])
def test_a_model_call_whose_arguments_repeat_a_key_keeps_the_last_value_as_vllm(parser, reply):
    """vLLM's parsers read the call with json.loads (a dict, ast keywords, XML parameters into a dict): the last
    value of a repeated key, written once in the call's arguments."""
    import json

    from infer.serve.tools import parse_tools, split
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    _, calls = split(parse_tools({"tools": tools}, parser), reply)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert calls[0]["function"]["arguments"].count("city") == 1


def test_the_server_refuses_history_arguments_that_are_not_json_on_chat_and_responses(engine):
    httpx = pytest.importorskip("httpx")
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": _history("Paris"), "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "messages[1].tool_calls[0].function.arguments is not JSON: 'Paris'" in r.json()["error"]["message"]
        items = [{"role": "user", "content": "weather?"},
                 {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "Paris"},
                 {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
        r = httpx.post(f"{base}/v1/responses", json={"input": items, "max_output_tokens": 2}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "input[1].arguments is not JSON" in r.json()["error"]["message"]
        ok = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "messages": _history('{"city": "Rome", "city": "Paris"}'), "max_tokens": 2})
        assert ok.status_code == 200, ok.text  # (a repeated key is no error, as in vLLM)


@pytest.mark.parametrize("task", ["classify", "token_classify"])
def test_pooling_dimensions_are_refused_for_a_classifiers_task(task):
    """vLLM's PoolingParams: dimensions (as normalize) is embed's and token_embed's field; a classify task's
    dimensions was refused with the matryoshka message (or, on a matryoshka model, not at all)."""
    from infer.engine.pooling import PoolingParams, pooling_task_params
    from infer.errors import RequestError
    params = PoolingParams(dimensions=4, task="embed").checked()
    with pytest.raises(RequestError, match=f"dimensions is an embedding's field: task {task}") as e:
        pooling_task_params({"task": task, "dimensions": 4}, params, classifies=True, prefix="")
    assert "leave dimensions out" in e.value.hint
    for embed in ("embed", "token_embed"):
        assert pooling_task_params({"task": embed, "dimensions": 4}, params, classifies=False).dimensions == 4


def test_infer_run_splits_a_new_parsers_batch_line(engine, tmp_path):
    """`infer run --output-format openai --reasoning-parser cohere_command`: its special tokens kept in the line's
    text, split as the server splits them."""
    from helpers import infer_run_records
    body = forced_chat_body([{"role": "user", "content": "think, then answer"}], COHERE, 120)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    recs, out = infer_run_records(tmp_path, [line], "--output-format", "openai", "--reasoning-parser",
                                  "cohere_command", key="custom_id", model=str(engine.config.model))
    message = recs["a"]["response"]["body"]["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("abc", "xyz"), out
