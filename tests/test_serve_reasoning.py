"""--reasoning-parser deepseek_r1 | qwen3, read as vLLM's reasoning parsers read a reply (basic_parsers.py's
BaseThinkingReasoningParser.extract_reasoning, deepseek_r1_reasoning_parser.py, qwen3_reasoning_parser.py): the text
in <think>...</think> is the message's `reasoning`, what follows is `content`; a reply without the opening tag is
reasoning from its start (the template opened the block), one without the closing tag all reasoning, and qwen3
with enable_thinking false all content. A stream holds back a partial tag; its deltas add up to the whole message;
the tool-call parser reads the content only; /v1/completions and a server without the option are unchanged."""

from __future__ import annotations

import functools
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.errors import ConfigError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.reasoning import ReasoningRequest, parts, prompt_ends_reasoning, split  # noqa: E402

from helpers import (TOOLS_TEMPLATE, check_stream_adds_up, forced_chat_body, joined_deltas,  # noqa: E402
                     joined_tool_calls, streamed_chat_choices, tiny_llama_with_template)

R1, QWEN3 = ReasoningRequest("deepseek_r1"), ReasoningRequest("qwen3")


# ------------------------------------------------------------------------------------------- a whole reply
@pytest.mark.parametrize("req", [R1, QWEN3])
@pytest.mark.parametrize("text,want", [
    ("<think>abc</think>xyz", ("abc", "xyz")),
    ("abc</think>xyz", ("abc", "xyz")),  # the template opened the block: the reply has no <think>
    ("<think>\nabc\n</think>\n\nxyz", ("\nabc\n", "\n\nxyz")),  # nothing stripped but the tags
    ("abc</think>", ("abc", None)),  # stops right after the block: content null
    ("<think>abc", ("abc", None)),  # cut short in the block: all reasoning
    ("abc", ("abc", None)),
    ("</think>xyz", ("", "xyz")),
    ("a</think>b</think>c", ("a", "b</think>c")),  # the first closing tag ends the block
])
def test_a_whole_reply_splits_as_vllm_splits_it(req, text, want):
    assert split(req, text) == want


def test_qwen3_with_thinking_off_is_all_content():
    off = ReasoningRequest("qwen3", ended=True)
    assert split(off, "abc") == (None, "abc")
    assert split(off, "<think>abc</think>xyz") == (None, "<think>abc</think>xyz")
    assert parts(off, "<thi", finished=False) == ("", "<thi")


def test_which_requests_end_their_reasoning_before_the_reply(model):
    from infer.engine.setup import load_tokenizer
    from infer.serve.reasoning import reasoning_request
    tok = load_tokenizer(model)
    ids = tok.encode("hello")
    assert reasoning_request(None, {}, ids, tok) is None  # no --reasoning-parser: nothing split
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert reasoning_request("qwen3", off, ids, tok).ended  # vLLM's qwen3 reads enable_thinking
    assert not reasoning_request("deepseek_r1", off, ids, tok).ended  # deepseek_r1 does not
    assert not reasoning_request("qwen3", {"chat_template_kwargs": {"enable_thinking": True}}, ids, tok).ended
    # a prompt whose last think tag closes the block (Qwen3's template with thinking off)
    closed = tok.encode("user: hi\nassistant: <think>\n\n</think>\n\n")
    opened = tok.encode("user: hi\nassistant: <think>\n")
    assert prompt_ends_reasoning(closed, tok) and not prompt_ends_reasoning(opened, tok)
    assert reasoning_request("deepseek_r1", {}, closed, tok).ended
    assert not reasoning_request("deepseek_r1", {}, opened, tok).ended
    # a reply constrained to JSON or a choice from its first token is all answer; a regex may write the block
    assert reasoning_request("deepseek_r1", {}, ids, tok, {"json": {"type": "object"}}).ended
    assert reasoning_request("deepseek_r1", {}, ids, tok, {"choice": ["a", "b"]}).ended
    assert not reasoning_request("deepseek_r1", {}, ids, tok, {"regex": "a+"}).ended


# ------------------------------------------------------------------------------------------- a streamed reply
@pytest.mark.parametrize("req", [R1, QWEN3])
@pytest.mark.parametrize("text", ["<think>abc</think>xyz", "abc</think>xyz", "<think>a</th</think>b<think>",
                                  "abc", "<thin", "</think>", "ab</thi", "<think>x</think>"])
def test_a_stream_adds_up_to_the_whole_reply(req, text):
    """At every length, each part only grows, and the last one is the whole reply's."""
    check_stream_adds_up(req, text)


def test_a_stream_holds_back_a_partial_tag():
    assert parts(R1, "<thi", finished=False) == ("", "")  # may become the opening tag
    assert parts(R1, "<thi", finished=True) == ("<thi", "")  # it did not
    assert parts(R1, "<think>ab</thi", finished=False) == ("ab", "")  # may become the closing tag
    assert parts(R1, "ab</", finished=False) == ("ab", "")
    assert parts(R1, "ab<", finished=False) == ("ab", "")
    assert parts(R1, "ab</x", finished=False) == ("ab</x", "")  # cannot
    assert parts(R1, "ab</think>x<", finished=False) == ("ab", "x<")  # after the block nothing is held
    assert parts(R1, "ab</think", finished=True) == ("ab</think", "")


def test_the_cli_option_names_vllms_parsers_and_refuses_others():
    from infer.cli.serve import _reasoning_parser
    assert _reasoning_parser("deepseek_r1") == "deepseek_r1" and _reasoning_parser("qwen3") == "qwen3"
    assert _reasoning_parser(None) is None
    with pytest.raises(ConfigError) as e:
        _reasoning_parser("step3")
    assert "--reasoning-parser 'step3'" in str(e.value) and "deepseek_r1 | qwen3" in e.value.hint
    from typer.testing import CliRunner
    from infer.cli.main import app
    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--reasoning-parser" in res.output and "deepseek_r1" in res.output
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--reasoning-parser", "step3"])
    assert res.exit_code != 0 and "deepseek_r1 | qwen3" in res.output


# ------------------------------------------------------------------------------------------- end to end
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "think, then answer"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_llama_with_template(tmp_path_factory.mktemp("reasoning") / "tiny-think", TOOLS_TEMPLATE))


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=4))


_body = functools.partial(forced_chat_body, MESSAGES, max_tokens=160)  # _body(reply, **extra)
_streamed, _joined = streamed_chat_choices, joined_deltas


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_server_splits_the_reasoning_whole_and_streamed(engine, parser):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-think", reasoning_parser=parser)) as base:
        for reply, reasoning, content in [("<think>abc</think>xyz", "abc", "xyz"), ("abc</think>xyz", "abc", "xyz"),
                                          ("abc</think>", "abc", None), ("abc", "abc", None)]:
            r = httpx.post(f"{base}/v1/chat/completions", json=_body(reply), timeout=120)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == (reasoning, content), reply
            assert "reasoning_content" not in message  # current vLLM's name only
            deltas = _streamed(base, _body(reply))
            assert _joined(deltas, "reasoning") == reasoning and _joined(deltas, "content") == (content or "")
            assert deltas[-1]["finish_reason"] == "stop"
            said = [k for d in deltas for k in ("reasoning", "content") if d["delta"].get(k)]
            assert said == sorted(said, key=lambda k: k == "content")  # the reasoning first, then the content
            assert not any("think>" in (d["delta"].get("content") or "") + (d["delta"].get("reasoning") or "")
                           for d in deltas)  # no tag (nor its end) leaks in a delta
        # /v1/completions is not split
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 40, "temperature": 0,
                                                        "guided_regex": re.escape("<think>abc</think>xyz")})
        assert r.json()["choices"][0]["text"] == "<think>abc</think>xyz" and "reasoning" not in r.json()["choices"][0]


def test_qwen3_with_thinking_off_answers_with_content_only(engine):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-think", reasoning_parser="qwen3")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=_body("abc", **off), timeout=120)
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (None, "abc")
        deltas = _streamed(base, _body("abc", **off))
        assert _joined(deltas, "content") == "abc" and not any("reasoning" in d["delta"] for d in deltas)


def test_without_the_option_nothing_is_split(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-think")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=_body("<think>abc</think>xyz"), timeout=120)
        message = r.json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "<think>abc</think>xyz"}


def test_tool_calls_are_read_from_the_content_only(engine):
    """The reasoning may mention a call; the hermes parser reads the one after </think>."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 10}}</tool_call>'
    thought = 'I could write <tool_call>{"name": "add", "arguments": {"a": 0, "b": 0}}</tool_call> here'
    reply = f"<think>{thought}</think>Sure.{call}"
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-think", tool_parser="hermes",
                                reasoning_parser="deepseek_r1")) as base:
        body = _body(reply, tools=TOOLS)
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls"
        assert (c["message"]["reasoning"], c["message"]["content"]) == (thought, "Sure.")
        calls = [(x["function"]["name"], x["function"]["arguments"]) for x in c["message"]["tool_calls"]]
        assert calls == [("add", '{"a": 2, "b": 10}')]
        deltas = _streamed(base, body)
        assert _joined(deltas, "reasoning") == thought and _joined(deltas, "content") == "Sure."
        assert deltas[-1]["finish_reason"] == "tool_calls"
        assert [x["function"] for x in joined_tool_calls(deltas)] == [x["function"] for x in c["message"]["tool_calls"]]
        # a call only in the reasoning is no call
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(f"<think>{thought}</think>no", tools=TOOLS),
                       timeout=120)
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop" and "tool_calls" not in c["message"]
        assert (c["message"]["reasoning"], c["message"]["content"]) == (thought, "no")
        # a reply constrained to a call (tool_choice named) is all answer: the call is read
        named = {"type": "function", "function": {"name": "add"}}
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 60, "temperature": 0,
                                                             "tools": TOOLS, "tool_choice": named}, timeout=120)
        c = r.json()["choices"][0]
        assert c["message"]["reasoning"] is None and c["message"]["tool_calls"][0]["function"]["name"] == "add"


def test_include_reasoning_false_leaves_the_reasoning_out(engine):
    """vLLM's include_reasoning: false still splits the reply (the content has no reasoning in it), but the message's
    reasoning is null and no streamed delta carries any; it must be a boolean; without a parser it changes nothing."""
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-think", reasoning_parser="deepseek_r1")) as base:
        for reply, content in [("<think>abc</think>xyz", "xyz"), ("abc</think>", None)]:
            body = _body(reply, include_reasoning=False)
            message = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == (None, content), reply
            deltas = _streamed(base, body)
            assert _joined(deltas, "content") == (content or "") and not any("reasoning" in d["delta"] for d in deltas)
        shown = httpx.post(f"{base}/v1/chat/completions", json=_body("<think>abc</think>xyz", include_reasoning=True),
                           timeout=120).json()["choices"][0]["message"]
        assert (shown["reasoning"], shown["content"]) == ("abc", "xyz")
        r = httpx.post(f"{base}/v1/chat/completions", json=_body("abc", include_reasoning="no"), timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning", r.text
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-think")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=_body("<think>abc</think>xyz", include_reasoning=False),
                       timeout=120)
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "<think>abc</think>xyz"}
