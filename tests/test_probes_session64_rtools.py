"""Session 64 (p64rtools): a hostile review of the granite, glm45, olmo3, ernie45 and phi4_mini_json tool-call parsers
against vLLM's and the models' chat templates: each bug found, whole and streamed (the same calls and content at every
cut)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.serve.tools import split  # noqa: E402

from test_probes_session63_tstream import _joined, _streamed  # noqa: E402
from test_probes_session64_tools import _content_streamed, _req  # noqa: E402


def _check(parser: str, reply: str, content: str | None, calls: list[tuple[str, dict]]) -> None:
    """`reply` read whole gives `content` and `calls`; streamed a character at a time, the same calls and content."""
    req = _req(parser)
    got_content, got = split(req, reply)
    assert (got_content or None) == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got or []] == calls
    pieces, whole = _streamed(req, reply, 1)
    assert [c["function"] for c in _joined(pieces)] == [c["function"] for c in whole]
    assert (_content_streamed(req, reply) or None) == content


@pytest.mark.parametrize("reply,content", [
    ("I'll look it up.\n<function_calls>get_time(zone=\"UTC\")\nget_weather(city='P', days=2)</function_calls>",
     "I'll look it up.\n"),
    (" \n<function_calls>get_time(zone=\"UTC\")\nget_weather(city='P', days=2)</function_calls>", None)])
def test_olmo3_content_before_its_calls_is_content_and_the_calls_are_calls(reply, content):
    """Olmo 3's template writes a message's content, then its <function_calls>...</function_calls>: a reply with text
    before its calls was all text (the calls lost); vLLM's whole reply finds the calls there too. Blank content is
    none (held while streamed)."""
    _check("olmo3", reply, content, [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "P", "days": 2})])


def test_olmo3_end_tag_before_its_start_tag_is_not_its_end():
    """The calls end at the </function_calls> after their start tag, streamed (each read the same as a fresh one's)
    as whole; what follows the end tag is dropped (vLLM's)."""
    _check("olmo3", "See </function_calls> here.<function_calls>get_time()</function_calls> Done.",
           "See </function_calls> here.", [("get_time", {})])


def test_glm45_string_value_keeps_its_blanks():
    """GLM writes a string parameter's text as it is between <arg_value> and </arg_value>: a file's content keeps its
    last newline and its indentation (vLLM's glm45 keeps them); the other values are read less their blanks."""
    reply = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>  def f():\n    pass\n</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value> 3\n</arg_value>\n</tool_call>")
    _check("glm45", reply, None, [("get_weather", {"city": "  def f():\n    pass\n", "days": 3})])


@pytest.mark.parametrize("reply,content", [
    ("\n<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>", None),
    ("Sure.\n<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>", "Sure.\n")])
def test_glm45_blank_content_before_its_calls_is_none(reply, content):
    """GLM's template writes "\\n" before each <tool_call> (after </think> with a reasoning parser): the message's
    content was "\\n" beside its calls; vLLM's glm45 makes blank content none. Streamed, the blank is held."""
    _check("glm45", reply, content, [("get_time", {"zone": "UTC"})])


def test_olmo3_call_with_a_negative_number_is_a_call():
    """`days=-2` is a unary minus in Python's AST, not a constant: Olmo 3's whole call was text (as vLLM's olmo3
    parser leaves it); its signed numbers read as numbers (a bool is no number: `-True` stays text)."""
    reply = "<function_calls>get_weather(city=\"P\", days=-2, o={\"t\": [+1.5, -0.25]})</function_calls>"
    _check("olmo3", reply, None, [("get_weather", {"city": "P", "days": -2, "o": {"t": [1.5, -0.25]}})])
    assert split(_req("olmo3"), reply.replace("-2", "-True")) == (reply.replace("-2", "-True"), None)
