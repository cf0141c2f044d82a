"""Session 63 (p63tstream): a forced tool call (tool_choice "required" or a named function) streams as vLLM's
does, its id, type and name first, then its arguments in pieces as the constrained reply writes them (it went out
whole at the reply's end), for chat (several choices, parallel_tool_calls false) and the Responses API; the pieces
join to the whole reply's arguments, as the OpenAI SDK's stream helper joins them. And the streamed calls of every
parser read in time linear in the reply."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.tools import parse_tools, split  # noqa: E402
from infer.serve.toolstream import CallStream, partial_calls  # noqa: E402

from helpers import joined_deltas, joined_tool_calls, tiny_chat_engine  # noqa: E402
from test_probes_session62_rstream import _chat_chunks, _responses_events  # noqa: E402
from test_probes_session62_stream import ARGS, MESSAGES, REPLIES, TOOLS  # noqa: E402

NAMED = {"type": "function", "function": {"name": "get_weather"}}
# constrained replies as the grammar lets them be written: blanks where JSON allows them, the arguments' own layout
FORCED = {"named": [" " + ARGS + "\n", '{"city":"x" , "o":{ }}', "{}"],
          "required": ['[ {"name": "get_weather", "parameters": ' + ARGS + '}, {"name": "get_time", "parameters":'
                       ' {"zone":"x"}}]', '[{"name":"get_time","parameters":{}}]']}


def _forced(mode: str, parallel: bool = True):
    return parse_tools({"tools": TOOLS, "tool_choice": NAMED if mode == "named" else "required",
                        "parallel_tool_calls": parallel}, "hermes")


def _streamed(req, reply: str, step) -> tuple[list[dict], list[dict]]:
    """(the delta.tool_calls pieces of `reply` streamed `step` characters at a time (or cut at each of a list of
    ends) with the stream's memo, then finished; the whole reply's calls). Each read is a fresh read's, each call's
    arguments a start of the whole's."""
    stream, pieces, whole = CallStream(req), [], split(req, reply)[1] or []
    for k in range(0, len(reply), step) if isinstance(step, int) else step:
        now = partial_calls(req, reply[:k], stream.memo)
        assert now == partial_calls(req, reply[:k]) and len(now) <= len(whole), (reply[:k], now)
        for (name, args), call in zip(now, whole):
            assert name == call["function"]["name"] and call["function"]["arguments"].startswith(args), reply[:k]
        pieces += stream.deltas(now)
    return pieces + stream.deltas(whole, finished=True), whole


def _joined(pieces: list[dict]) -> list[dict]:
    return joined_tool_calls([{"delta": {"tool_calls": [p]}} for p in pieces])


@pytest.mark.parametrize("mode,reply", [(m, r) for m, replies in FORCED.items() for r in replies])
@pytest.mark.parametrize("step", [1, 4])
def test_a_forced_call_streams_its_name_then_pieces_that_join_to_the_whole_call(mode, reply, step):
    pieces, whole = _streamed(_forced(mode), reply, step)
    assert whole and [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]
    firsts = [p for p in pieces if "id" in p]
    assert [p["function"]["name"] for p in firsts] == [c["function"]["name"] for c in whole]
    if len(reply) > 40:  # the arguments as they come, not whole at the end
        assert len([p for p in pieces if p["index"] == 0]) > len(reply) // (4 * step)


def test_a_forced_call_goes_out_as_soon_as_it_shows_itself():
    """named: the function's name with the reply's first character; "required": a call's name once its
    "parameters" key has come (the name whole), its parameters as json.dumps writes them (the whole's)."""
    assert partial_calls(_forced("named"), '{"ci') == [("get_weather", '{"ci')]
    assert partial_calls(_forced("named"), "") == []
    req = _forced("required")
    assert partial_calls(req, '[{"name": "get_ti') == []
    assert partial_calls(req, '[{"name": "get_time", "parameters": {"zone" :"U') == [("get_time", '{"zone": "U')]
    assert len(partial_calls(req, FORCED["required"][0][:-1])) == 2


def test_a_named_call_escapes_a_raw_control_character_as_the_whole_reply_does():
    """The grammar may let a string hold a raw tab (serve/tools.py's _read escapes it in the whole reply, in place):
    it goes out escaped, and a tab between values (a blank) goes out as it is."""
    req = _forced("named")
    tab = '{\t"city": "a\tb", "zone": "c"}'
    assert partial_calls(req, tab) == [("get_weather", '{\t"city": "a\\tb", "zone": "c"}')] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in split(req, tab)[1]]
    escaped = '{"city": "a\\"b\\\\", "zone": "c'  # (escapes: no string's end, no control character)
    assert partial_calls(req, escaped) == [("get_weather", escaped)]


@pytest.mark.parametrize("parser,reply", [(p, r) for p, replies in REPLIES.items() for r in replies])
def test_every_parsers_pieces_streamed_unevenly_join_to_the_whole_reply(parser, reply):
    pieces, whole = _streamed(parse_tools({"tools": TOOLS}, parser), reply, 5)
    assert whole and [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]


# ------------------------------------------------------------------------------------------- served
LONG = {"type": "object", "properties": {"city": {"type": "string", "minLength": 30, "maxLength": 40},
                                         "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"], "additionalProperties": False}
LONG_TOOLS = [{"type": "function", "function": {"name": n, "parameters": LONG}} for n in ("get_weather", "get_time")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_chat_engine(tmp_path_factory, "tstream63")


@pytest.fixture(scope="module")
def base(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", tool_parser="hermes")) as url:
        yield url


def _chat(base: str, body: dict) -> tuple[list[dict], list[dict]]:
    """(the whole answer's choices, the streamed chunks' choices) of `body`."""
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"]
    return whole, [x for chunk in _chat_chunks(base, body) for x in chunk["choices"]]


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
@pytest.mark.parametrize("extra", [{"n": 2}, {"parallel_tool_calls": False}], ids=["n2", "not-parallel"])
def test_served_forced_call_streams_in_pieces_that_join_to_the_whole_message(base, choice, extra):
    body = {"messages": MESSAGES, "max_tokens": 120, "temperature": 0, "tools": LONG_TOOLS, "tool_choice": choice,
            "parallel_tool_calls": False, **extra}
    whole, deltas = _chat(base, body)
    assert len(whole) == extra.get("n", 1)
    for c in whole:
        mine = [d for d in deltas if d["index"] == c["index"]]
        assert c["finish_reason"] == mine[-1]["finish_reason"] == "tool_calls" and mine[-1]["delta"] == {}
        calls = c["message"]["tool_calls"]
        assert len(calls) == 1 and len(json.loads(calls[0]["function"]["arguments"])["city"]) > 20
        assert [x["function"] for x in joined_tool_calls(mine)] == [x["function"] for x in calls]
        chunks = [d for d in mine if d["delta"].get("tool_calls")]
        assert len(chunks) > 10 and "id" in chunks[0]["delta"]["tool_calls"][0]
        assert chunks[0]["delta"]["tool_calls"][0]["function"]["name"] == calls[0]["function"]["name"]
        assert joined_deltas(mine, "content") == ""


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_forced_call_cut_by_max_tokens_ends_as_the_whole_reply(base, choice):
    """max_tokens cuts the constrained reply: the whole reply is text (no call); the stream has sent the call's
    start (serve/toolstream.py's known limit, as vLLM's), then ends as the whole reply: its text as content, its
    finish_reason "length"."""
    body = {"messages": MESSAGES, "max_tokens": 12 if choice == NAMED else 60, "temperature": 0, "tools": LONG_TOOLS,
            "tool_choice": choice}  # (cut in the first call's city: "required"'s after its "parameters" key)
    (whole,), deltas = _chat(base, body)
    assert whole["finish_reason"] == deltas[-1]["finish_reason"] == "length" and "tool_calls" not in whole["message"]
    assert joined_deltas(deltas, "content") == whole["message"]["content"]
    assert joined_tool_calls(deltas)  # (what went out stands)


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_responses_stream_of_a_forced_call_sends_its_arguments_in_pieces(base, choice):
    body = {"input": "weather?", "tools": [{"type": "function", **t["function"]} for t in LONG_TOOLS],
            "tool_choice": {"type": "function", "name": "get_weather"} if choice == NAMED else choice,
            "parallel_tool_calls": False, "max_output_tokens": 120, "temperature": 0}
    whole = httpx.post(f"{base}/v1/responses", json=body, timeout=120).json()
    events = _responses_events(base, body)
    assert [o["type"] for o in whole["output"]] == ["function_call"]
    call = whole["output"][0]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert len(added) == 1 and added[0]["item"]["name"] == call["name"] and added[0]["item"]["arguments"] == ""
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 10 and "".join(pieces) == call["arguments"]
    final = events[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["function_call"] and final[0]["arguments"] == call["arguments"]
    assert final[0]["id"] == added[0]["item"]["id"]


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_the_sdks_stream_accumulation_of_a_forced_call_is_the_whole_message(base, choice):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0, tools=LONG_TOOLS, tool_choice=choice,
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    done = [(e.index, e.name, e.arguments) for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(deltas) > 10 and whole.message.tool_calls
    assert done == [(k, c.function.name, c.function.arguments) for k, c in enumerate(whole.message.tool_calls)]
    # (the helper joins the first chunk's "" content, as vLLM's stream starts: no text beside the call)
    assert final.finish_reason == whole.finish_reason == "tool_calls" and not final.message.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


# ------------------------------------------------------------------------------------------- linear reading
MANY = {  # several calls, each parsed whole once it has ended (kept), not again at each token
    "pythonic": "[" + ", ".join(f'get_time(zone="zone {k})")' for k in range(6)) + "]",
    "qwen3_coder": "".join(f"<tool_call>\n<function=get_time>\n<parameter=zone>\nz{k}\n</parameter>\n</function>\n"
                           "</tool_call>" for k in range(6)),
    "hermes": "".join(f'<tool_call>{{"name": "get_time", "arguments": {{"zone": "z{k}"}}}}</tool_call>'
                      for k in range(6)),
}
PARSE = {"pythonic": "pythonic_calls", "qwen3_coder": "_xml_call", "hermes": None}


@pytest.mark.parametrize("parser", sorted(MANY))
def test_a_call_that_has_ended_is_parsed_once_not_at_each_token(monkeypatch, parser):
    """Streamed a character at a time, a call whose text has ended is parsed a few times in all (pythonic's list
    and qwen3_coder's parameters were parsed again at each token: time quadratic in the reply; hermes' ended blocks
    are read once, the open one read on from where the last read stopped, in place)."""
    from infer.serve import tools, toolstream
    reply, counted, req = MANY[parser], [], parse_tools({"tools": TOOLS}, parser)
    if PARSE[parser]:
        real = getattr(tools, PARSE[parser])
        monkeypatch.setattr(tools, PARSE[parser], lambda *a, **k: counted.append(1) or real(*a, **k))
    else:  # (a read without the stream's memo: a block's own text, read afresh)
        real = toolstream._json_call
        monkeypatch.setattr(toolstream, "_json_call", lambda kind, raw, at=0, memo=None: counted.append(
            memo is None) or real(kind, raw, at, memo))
    stream, pieces = CallStream(req), []
    for k in range(len(reply)):
        pieces += stream.deltas(partial_calls(req, reply[:k], stream.memo))
    whole = split(req, reply)[1]
    pieces += stream.deltas(whole, finished=True)
    assert len(whole) == 6 and [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]
    assert sum(counted) <= 5 * len(whole) < len(reply) // 4, sum(counted)  # (not one a token)


@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss"])
def test_an_xml_calls_arguments_end_at_its_function_end_tag_streamed_as_whole(parser):
    """The text after a call's </function> is no parameter of it (the whole reply's read), streamed or whole: a
    stray parameter after it is left out at every length (it was read into the streamed call, which then was not
    the whole reply's)."""
    call = "<function=get_time>\n<parameter=zone>\nx\n</parameter>\n</function>\n<parameter=days>\n3\n</parameter>"
    for reply, want in ((call, ['{"zone": "x"}']), (call + call, ['{"zone": "x"}'] * 2)):
        pieces, whole = _streamed(parse_tools({"tools": TOOLS}, parser), reply, 1)
        assert [c["function"]["arguments"] for c in _joined(pieces)] == [c["function"]["arguments"]
                                                                         for c in whole] == want
    assert not any("days" in p["function"]["arguments"] for p in pieces)


@pytest.mark.parametrize("parser", sorted(REPLIES))
def test_a_memo_of_another_text_is_not_read_on(parser):
    """The stream's memo kept for a text that the next one does not go on (not a stream's reply): read afresh."""
    req = parse_tools({"tools": TOOLS}, parser)
    for first, then in ((REPLIES[parser][0], REPLIES[parser][-1]), (REPLIES[parser][-1], REPLIES[parser][0])):
        memo = {}
        for k in range(0, len(first), 7):
            partial_calls(req, first[:k], memo)
        for k in range(0, len(then) + 7, 7):
            assert partial_calls(req, then[:k], memo) == partial_calls(req, then[:k]), then[:k]


def test_the_bench_streams_every_parser_and_checks_the_pieces(capsys):
    from infer.bench.toolstream import main, replies
    rows = main(["--chars", "200", "--step", "3"])
    assert [r["parser"] for r in rows] == list(replies(1)) and all(r["seconds"] >= 0 for r in rows)
    assert "us/char" in capsys.readouterr().out
