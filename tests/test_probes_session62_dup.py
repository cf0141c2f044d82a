"""Session 62 (p62dup): the JSON list parsers' shared loop (toolstream._json_calls: llama3_json's calls joined by
";", mistral's JSON list joined by ",") streams each call of the list as its text comes, not only the first."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.serve.tools import split  # noqa: E402
from infer.serve.toolstream import partial_calls  # noqa: E402

from test_probes_session62_stream import REPLIES, _request  # noqa: E402


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_the_second_call_of_a_json_list_streams_before_the_reply_ends(parser):
    """Three characters before the reply ends, both calls are known: the second's name, its arguments a start of the
    whole reply's."""
    reply = REPLIES[parser][0]
    req = _request(parser)
    whole = split(req, reply)[1]
    now = partial_calls(req, reply[:-3])
    assert [name for name, _ in now] == [c["function"]["name"] for c in whole] == ["get_weather", "get_time"]
    assert whole[1]["function"]["arguments"].startswith(now[1][1]), (now, whole)
