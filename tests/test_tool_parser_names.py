"""Tool-call parsing details of the forty-fourth session: vLLM's Mistral fallback match without its quadratic
regex, and vLLM's llama4 parser names."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings, strategies as st


@example("[{a}] [{b}]")
@example("x[{[{}]y}]")
@example("[{]")
@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="[]{}ab\n", max_size=40))
def test_the_mistral_fallback_finds_what_vllms_regex_finds(body):
    """The fallback `[{...}]` of a Mistral reply whose JSON does not read: the same match as vLLM's regex
    (re.search(r"\\[{.*}\\]", body, re.DOTALL)), found with find/rfind (the regex was quadratic in a degenerate
    reply of many "[{": seconds of the server's event loop)."""
    import re

    from infer.serve.tools import _bracketed
    found = re.search(r"\[{.*}\]", body, re.DOTALL)
    assert _bracketed(body) == (found.group(0) if found else None)


@pytest.mark.parametrize("name, reads", [("llama4_json", "llama3_json"), ("llama4_pythonic", "pythonic")])
def test_vllms_llama4_parser_names_are_taken(name, reads):
    """vLLM's --tool-call-parser llama4_json (its llama3_json parser) and llama4_pythonic (the pythonic list inside
    <|python_start|>...<|python_end|>, which pythonic reads) were refused as not available."""
    from infer.cli.serve import _tool_parser
    from infer.errors import ConfigError
    from infer.serve.tools import PARSERS, ToolRequest, split
    assert _tool_parser(True, name) == reads
    with pytest.raises(ConfigError, match="llama4_pythonic as pythonic"):
        _tool_parser(True, "llama5")
    req = ToolRequest([{"type": "function", "function": {"name": "f"}}], "auto", name=reads, parser=reads)
    text = ('{"name": "f", "parameters": {"x": 1}}' if reads == "llama3_json"
            else "<|python_start|>[f(x=1)]<|python_end|>")
    content, calls = split(req, text)
    assert reads in PARSERS and [c["function"]["name"] for c in calls] == ["f"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
