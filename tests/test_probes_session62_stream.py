"""Session 62 (p62stream): tool calls streamed as vLLM streams them, the call's id, type and name first, then its
arguments in pieces, for every --tool-call-parser (chat, and the Responses API's function_call_arguments deltas),
the pieces joined being exactly the whole reply's call; and the hunyuan_a13b reasoning parser, whole and streamed."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.cli.serve import _reasoning_parser  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.reasoning import ReasoningRequest  # noqa: E402
from infer.serve.reasoning import split as reasoning_split  # noqa: E402
from infer.serve.tools import parse_tools, split  # noqa: E402
from infer.serve.toolstream import CallStream, json_prefix, partial_calls  # noqa: E402

from helpers import (check_stream_adds_up, forced_chat_body, joined_deltas, joined_tool_calls,  # noqa: E402
                     streamed_chat_choices, tiny_chat_engine, tiny_llama_with_added_tokens)

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                           "o": {"type": "object"}, "zone": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": PARAMS}} for n in ("get_weather", "get_time")]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]

# arguments with unicode (an escape, a surrogate pair, raw), nested JSON, braces and escaped quotes in strings,
# numbers that JSON writes again otherwise (2.50, 1e2), true/false/null
ARGS = ('{"city": "Pa\\"ri{s}] \\u00e9\\ud83d\\ude00 \u00fc\u4e2d", "days":3, "o": {"a": [1, 2.50, true, null, '
        '{"b": "}\\\\"}], "e": 1e2, "f": false}}')
WEATHER = '{"name": "get_weather", "arguments": ' + ARGS + '}'
HARMONY = "<|start|>assistant to=functions.{}<|channel|>commentary json<|message|>{}"
XML = "<function=get_weather>\n<parameter=city>\nPa{{r}}is \u00e9\n</parameter>\n<parameter=days>\n3\n</parameter>\n" \
      "<parameter=o>\n{\"a\": [1, {\"b\": \"}\"}]}\n</parameter>\n</function>"
REPLIES = {
    "hermes": ["Sure. <tool_call>\n" + WEATHER + "\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
               "\"arguments\": {\"zone\": \"\u00e9t\u00e9\"}}\n</tool_call>",
               '<tool_call>{"arguments": {"zone": "x"}, "name": "get_time"}</tool_call>',  # held until whole
               '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"x\\"}"}</tool_call>'],
    "llama3_json": ['<|python_tag|>{"name": "get_weather", "parameters": ' + ARGS + '}; {"name": "get_time", '
                    '"parameters": {"zone": "-0.0"}}'],
    "mistral": ["Sure.[TOOL_CALLS][" + WEATHER + ', {"name": "get_time", "arguments": {"zone": "UTC"}}]',
                "[TOOL_CALLS]get_weather[ARGS]" + ARGS + '[TOOL_CALLS]get_time[ARGS]{"zone": [ ]}'],
    "pythonic": ['[get_weather(city="Pa)r]i,s", days=3, o={"a": [1, None]}), get_time(zone="\u00e9")]',
                 '<|python_start|>[get_time(zone="x")]<|python_end|>'],
    "qwen3_coder": ["I will check.\n<tool_call>\n" + XML + "\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"],
    "seed_oss": ["Checking.<seed:tool_call>\n" + XML.replace("\n</parameter>", "</parameter>").replace(
        ">\n", ">") + "\n</seed:tool_call>"],
    "openai": ["<|channel|>analysis<|message|>Need it.<|end|>" + HARMONY.format("get_weather", ARGS) + "<|call|>"
               + HARMONY.format("get_time", '{"zone": "UTC"}')],
}
# replies that turn out not to be calls (or not yet, at any length): no call may go out
NOT_CALLS = {
    "hermes": ['<tool_call>{"name": "get_time"}</tool_call>', '<tool_call>{"name": "get_time", "parameters": '
               '{"zone": "x"}}</tool_call>', "I use <tool_c tags."],
    "llama3_json": ['{"answer": {"zone": "x"}}', '{"name": "get_time", "arguments": {"zone": "x"}', "Plain."],
    "mistral": ["Sure.[TOOL_CALLS] I cannot.", "[TOOL_CALLS]get_time {no json"],
    "pythonic": ["[1] First, [get_time] is no call", "[Paris](x)"],
    "qwen3_coder": ["<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</function>"],
    "seed_oss": ["<seed:think>I could <function=get_time>...</seed:think>Just text."],
    "openai": ["<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."],
}


def _request(parser: str):
    return parse_tools({"tools": TOOLS}, parser)


def _streamed(parser: str, reply: str, cuts) -> tuple[list[dict], list[dict] | None]:
    """(the delta.tool_calls pieces sent while `reply` streams, cut at each of `cuts`, then finished; the whole
    reply's calls). Each call known at a cut must be the whole reply's, its arguments a start of the whole's."""
    req = _request(parser)
    stream, pieces = CallStream(req), []
    whole = split(req, reply)[1] or []
    for k in cuts:
        now = partial_calls(req, reply[:k])
        assert len(now) <= len(whole), (reply[:k], now)
        for (name, args), call in zip(now, whole):
            assert name == call["function"]["name"] and call["function"]["arguments"].startswith(args), (
                reply[:k], args, call["function"]["arguments"])
        pieces += stream.deltas(now)
    return pieces + stream.deltas(whole, finished=True), whole


@pytest.mark.parametrize("parser,reply", [(p, r) for p, replies in REPLIES.items() for r in replies])
def test_streamed_pieces_join_to_the_whole_call_at_every_cut(parser, reply):
    """The reply streamed a character at a time: each call's first piece has its id, type and name, the others
    only arguments; joined, they are the whole reply's calls (names and arguments, in order)."""
    pieces, whole = _streamed(parser, reply, range(len(reply)))
    calls = joined_tool_calls([{"delta": {"tool_calls": [p]}} for p in pieces])
    assert [c["function"] for c in calls] == [c["function"] for c in whole] and whole
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces
               if "id" not in p)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "openai"])
def test_json_arguments_go_out_as_they_come(parser):
    """The JSON parsers send a call's arguments in many pieces, each one no later than its text allows: a string's
    characters as they come (not the whole call at its end)."""
    reply = REPLIES[parser][0]
    pieces, _ = _streamed(parser, reply, range(len(reply)))
    assert len([p for p in pieces if p["index"] == 0]) > 20
    at = reply.index("ri{s}") + 3  # the text so far ends inside the city's string: its characters went out
    assert partial_calls(_request(parser), reply[:at])[0] == ("get_weather", '{"city": "Pa\\"ri{')


@pytest.mark.parametrize("parser,reply", [(p, r) for p, replies in NOT_CALLS.items() for r in replies])
def test_a_reply_that_is_no_call_sends_no_call_at_any_length(parser, reply):
    pieces, whole = _streamed(parser, reply, range(len(reply) + 1))
    assert pieces == [] and whole == []


def test_json_prefix_is_a_start_of_json_dumps_at_every_cut():
    """json_prefix: what json.dumps of the value writes, as far as the text so far decides it (an escape, a surrogate
    pair, a number or a word held until whole), and where the value ends."""
    raw = ARGS + " trailing"
    want = json.dumps(json.loads(ARGS), ensure_ascii=False)
    sent = ""
    for k in range(len(raw) + 1):
        now, end = json_prefix(raw[:k])
        assert want.startswith(now) and now.startswith(sent), (raw[:k], now)
        assert (end is not None) == (k >= len(ARGS)) and end in (None, len(ARGS))
        sent = now
    assert sent == want
    assert json_prefix('{"a": 12')[0] == '{"a": ' and json_prefix('{"a": "\\u00')[0] == '{"a": "'
    assert json_prefix('{"a": NaN}', nan=False) == ('{"a": ', None)


# ------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_chat_engine(tmp_path_factory, "stream62")


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json", "pythonic", "qwen3_coder"])
def test_served_stream_sends_each_call_then_its_arguments_in_pieces(engine, parser):
    """Through the server, token by token (the reply forced): the content before the calls, then each call's first
    chunk (id, type, name) and its arguments' pieces, the finish alone; joined, the whole reply's message."""
    reply = REPLIES[parser][0]
    body = forced_chat_body(MESSAGES, reply, 600, tools=TOOLS)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser=parser)) as base:
        c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 2
        deltas = streamed_chat_choices(base, body)
    assert joined_deltas(deltas, "content") == (c["message"]["content"] or "")
    assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in c["message"]["tool_calls"]]
    chunks = [d for d in deltas if d["delta"].get("tool_calls")]
    # not the calls whole at the end: pythonic's a call at a time, qwen3_coder's a parameter at a time
    assert len(chunks) >= {"pythonic": 2, "qwen3_coder": 5}.get(parser, 10)
    assert all(len(d["delta"]["tool_calls"]) == 1 and d["finish_reason"] is None for d in chunks)
    assert deltas[-1]["finish_reason"] == "tool_calls" and deltas[-1]["delta"] == {}


def test_a_call_that_turns_out_malformed_ends_as_the_whole_reply(engine):
    """A call whose text breaks after its arguments went out (the known limit vLLM's stream shares: they cannot be
    taken back) or that max_tokens cuts: the stream still ends as the whole reply does, its text the content (all of
    it joined) and the whole reply's finish_reason, not "tool_calls"."""
    reply = 'Hm.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}} oops</tool_call>'
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser="hermes")) as base:
        for body in (forced_chat_body(MESSAGES, reply, 200, tools=TOOLS),
                     forced_chat_body(MESSAGES, REPLIES["hermes"][0], 40, tools=TOOLS)):
            c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
            assert "tool_calls" not in c["message"] and c["finish_reason"] in ("stop", "length")
            deltas = streamed_chat_choices(base, body)
            assert joined_deltas(deltas, "content") == c["message"]["content"]
            assert deltas[-1]["finish_reason"] == c["finish_reason"]


def test_responses_stream_sends_function_call_arguments_in_pieces(engine):
    """/v1/responses streamed: the message item ends when the first call starts; each call an output item, added
    with its name and empty arguments, then function_call_arguments.delta pieces that join to its arguments."""
    reply = REPLIES["hermes"][0]
    body = {"input": "weather?", "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "guided_regex": re.escape(reply), "max_output_tokens": 600, "temperature": 0}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser="hermes")) as base:
        whole = httpx.post(f"{base}/v1/responses", json=body, timeout=120).json()
        with httpx.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}, timeout=120) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    calls = [o for o in whole["output"] if o["type"] == "function_call"]
    assert [o["type"] for o in whole["output"]] == ["message", "function_call", "function_call"]
    final = events[-1]["response"]["output"]
    for k, call in enumerate(calls, start=1):
        added = [e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == k]
        assert added[0]["item"]["name"] == call["name"] and added[0]["item"]["arguments"] == ""
        pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == k]
        assert len(pieces) > (10 if k == 1 else 3) and "".join(pieces) == call["arguments"]
        assert all(e["item_id"] == added[0]["item"]["id"] for e in events
                   if e["type"].startswith("response.function_call_arguments") and e["output_index"] == k)
        assert final[k]["id"] == added[0]["item"]["id"] and final[k]["arguments"] == call["arguments"]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Sure. "


# ------------------------------------------------------------------------------------------- hunyuan_a13b
def _vllm_hunyuan(text: str):
    """vLLM's HunyuanA13BReasoningParser.extract_reasoning (its regexes), the reference of a whole reply."""
    full = re.compile(r"(?:<think>\n(.*?)\n</think>\n<answer>\n)?(.*?)\n</answer>", re.DOTALL).findall(text)
    if full:
        reasoning, content = full[0]
    else:
        half = re.compile(r"<think>\n(.*?)\n</think>\n<answer>\n(.*)", re.DOTALL).findall(text)
        if not half:
            return None, text
        reasoning, content = half[0]
    return reasoning or None, content or None


HUNYUAN = ["<think>\nThe user asks 2+2.\nIt is 4.\n</think>\n<answer>\nIt is 4.\n</answer>",
           "<think>\n\n</think>\n<answer>\nHi there\n</answer>",  # its no-think form
           "<think>\nA</think> still thinking\n</think>\n<answer>\nB\n</answer> dropped",
           "<think>\nR\n</think>\n<answer>\nA, then EOS", "Plain answer\n</answer>", "Plain answer"]


@pytest.mark.parametrize("text", HUNYUAN)
def test_hunyuan_splits_as_vllm_and_streams_to_the_same(text):
    req = ReasoningRequest("hunyuan_a13b")
    assert reasoning_split(req, text) == _vllm_hunyuan(text)
    check_stream_adds_up(req, text)


def test_hunyuan_cut_in_its_think_block_is_reasoning_and_is_a_cli_parser():
    """A reply cut in its think block is all reasoning (as vLLM streams it), not the tags as content (vLLM's whole
    reply), so that the stream adds up; and --reasoning-parser takes the name."""
    req = ReasoningRequest("hunyuan_a13b")
    assert reasoning_split(req, "<think>\nStill going\n</th") == ("Still going\n</th", None)
    check_stream_adds_up(req, "<think>\nStill going\n</th")
    assert _reasoning_parser("hunyuan_a13b") == "hunyuan_a13b"


def test_tiny_hunyuan_served_with_its_reasoning_parser_whole_and_streamed():
    """tiny-hunyuan (its ChatML template: the reply writes its own think block): the reasoning and the answer split
    whole and streamed, the hermes call read from the answer only."""
    engine = LLMEngine(EngineConfig(str(ensure_builtin("tiny-hunyuan")), block_size=4, max_num_seqs=4))
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    reply = "<think>\nNeed the <tool_call> time.\n</think>\n<answer>\nChecking." + call + "\n</answer>"
    body = forced_chat_body(MESSAGES, reply, 300, tools=TOOLS)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-hunyuan", tool_parser="hermes",
                                reasoning_parser="hunyuan_a13b")) as base:
        c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        deltas = streamed_chat_choices(base, body)
    message = c["message"]
    assert (message["reasoning"], message["content"]) == ("Need the <tool_call> time.", "Checking.")
    assert [x["function"] for x in message["tool_calls"]] == [{"name": "get_time", "arguments": '{"zone": "UTC"}'}]
    assert joined_deltas(deltas, "reasoning") == message["reasoning"]
    assert joined_deltas(deltas, "content") == message["content"]
    assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in message["tool_calls"]]


# ------------------------------------------------------------------------------------------- exaone4
def test_exaone4_thinks_only_when_asked(engine):
    """--reasoning-parser exaone4 (vLLM's): EXAONE 4.0's reply is all content unless chat_template_kwargs
    enable_thinking is true, then split by deepseek_r1's rules (its template opens the block: the reply may start
    inside it), whole and streamed alike."""
    reply = "Let me think.</think>It is 4."
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", reasoning_parser="exaone4")) as base:
        for kwargs, want in [(None, (None, reply)), ({"enable_thinking": False}, (None, reply)),
                             ({"enable_thinking": True}, ("Let me think.", "It is 4."))]:
            body = forced_chat_body(MESSAGES, reply, 100, **({"chat_template_kwargs": kwargs} if kwargs else {}))
            message = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == want, kwargs
            deltas = streamed_chat_choices(base, body)
            assert (joined_deltas(deltas, "reasoning"), joined_deltas(deltas, "content")) == (want[0] or "", want[1])
    assert _reasoning_parser("exaone4") == "exaone4"


# ------------------------------------------------------------------------------------------- mistral (Magistral)
def _vllm_mistral(text: str):
    """vLLM's MistralReasoningParser.extract_reasoning, the reference of a whole reply."""
    before, tag, after = text.partition("[THINK]")
    if tag and "[/THINK]" in after:
        reasoning, _, rest = after.partition("[/THINK]")
        return reasoning, (before + rest) or None
    if tag:
        return after, before or None
    return None, text


@pytest.mark.parametrize("text", ["[THINK]Let me see.[/THINK]It is 4.", "[THINK]Cut in its thinking",
                                  "It is 4, no thinking.", "[THINK][/THINK]Answer", "[THINK]x[/THINK]"])
def test_mistral_splits_magistral_think_block_as_vllm(text):
    req = ReasoningRequest("mistral")
    assert reasoning_split(req, text) == _vllm_mistral(text)
    check_stream_adds_up(req, text)
    assert _reasoning_parser("mistral") == "mistral"


def test_magistral_think_tags_that_are_special_tokens_split_whole_and_streamed(tmp_path):
    """Magistral's [THINK] and [/THINK] are special tokens: the reply's text keeps them for the split (a reply
    without them is all content)."""
    path = tiny_llama_with_added_tokens(tmp_path / "magistral", ["[THINK]", "[/THINK]"], special=True)
    engine = LLMEngine(EngineConfig(path, block_size=4, max_num_seqs=4))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", reasoning_parser="mistral")) as base:
        for reply, want in [("[THINK]Hmm, 2+2.[/THINK]It is 4.", ("Hmm, 2+2.", "It is 4.")),
                            ("It is 4.", (None, "It is 4."))]:
            body = forced_chat_body(MESSAGES, reply, 100)
            message = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == want
            deltas = streamed_chat_choices(base, body)
            assert (joined_deltas(deltas, "reasoning"), joined_deltas(deltas, "content")) == (want[0] or "", want[1])
