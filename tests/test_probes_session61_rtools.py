"""Session 61 (p61rtools): review of the qwen3_coder, seed_oss and openai (gpt-oss harmony) tool-call parsers.
- A value of code that holds a closing tag ("</parameter>", "</function>", "</tool_call>") is read whole (vLLM's
  first-match regexes cut it there, dropping the rest of the value); replies vLLM reads are read as it reads them.
- A value is typed through a nullable type, an anyOf/oneOf with null and a $ref into the function's $defs (what
  pydantic writes for Optional[int], a nested model, an enum): vLLM reads "type" alone, so a nullable string "007"
  became the number 7 and a nested model's JSON stayed text; an integer written "5.0" is 5.
- gpt-oss's commentary preamble (a commentary message to no one) is content, as vLLM's openai parser answers it.
Each reply is also streamed one character at a time: the content only grows, and ends as the whole reply's."""

from __future__ import annotations

import json

import pytest

from infer.serve.tools import harmony_calls, parse_tools, split, visible


def tools_of(**functions: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": params}}
            for name, params in functions.items()]


CODE = {"type": "object", "properties": {"path": {"type": "string"}, "code": {"type": "string"}}}
TOOLS = tools_of(write=CODE, run=CODE)


def parsed(parser: str, reply: str, tools: list[dict] = TOOLS, **body):
    """(content, [(name, arguments)]) of `reply` read whole by `parser`, after checking that its stream (the reply
    one character more at a time) only grows its content and ends at the whole reply's content."""
    req = parse_tools({"tools": tools, **body}, parser)
    content, calls = split(req, reply)
    seen = ""
    for n in range(len(reply) + 1):
        now = visible(req, reply[:n])
        assert now.startswith(seen) and content.startswith(now), (reply[:n], now, seen)
        seen = now
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or []]


def wrapped(parser: str, *functions: str) -> str:
    tag = "tool_call" if parser == "qwen3_coder" else "seed:tool_call"
    return "".join(f"<{tag}>\n{f}\n</{tag}>\n" for f in functions)


def function(name: str, **params: str) -> str:
    return (f"<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
            + "</function>")


# code the model writes about these very tags (a parser's test, an XML file): unicode and blank lines too
PY = "def f():\n    return '</parameter>' + \"</function>\"\n\n\n# ünï 😀 </tool_call> </seed:tool_call>\n"


@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss"])
def test_a_value_holding_closing_tags_is_read_whole(parser):
    """Two calls after content, the first's code holding every closing tag: both read whole; text after the calls
    is no content (as vLLM's: the content is what precedes the first call)."""
    reply = ("Writing it.\n" + wrapped(parser, function("write", path="a.py", code=PY),
                                       function("run", path="a.py")) + "Done.")
    assert parsed(parser, reply) == ("Writing it.\n", [("write", {"path": "a.py", "code": PY}),
                                                       ("run", {"path": "a.py"})])
    # parallel_tool_calls false: the first call, whole
    assert parsed(parser, reply, parallel_tool_calls=False)[1] == [("write", {"path": "a.py", "code": PY})]
    # without the call tags (vLLM's back-off reads the bare functions)
    assert parsed(parser, function("write", code=PY) + "\n" + function("run", code="x"))[1] == [
        ("write", {"code": PY}), ("run", {"code": "x"})]


@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss"])
def test_tags_followed_by_other_text_are_read_as_vllm_reads_them(parser):
    """A closing tag followed by text that cannot follow it closes its part when no later one can (a parameter's end
    then stray text; a reply cut short in a value), as vLLM's."""
    reply = wrapped(parser, "<function=write>\n<parameter=path>\na.py\n</parameter> oops\n"
                            "<parameter=code>\nx = 1\n</parameter>\n</function>")
    assert parsed(parser, reply)[1] == [("write", {"path": "a.py", "code": "x = 1"})]
    # a reply cut short (max_tokens) in a value holding "</parameter>": no later end says where the value ends
    cut = wrapped(parser, function("write", code=PY))[:-40]
    assert parsed(parser, cut)[1] == [("write", {"code": PY.split("</parameter>")[0]})]


PYDANTIC = {"type": "object", "$defs": {
    "Unit": {"enum": ["c", "f"], "type": "string"},
    "Place": {"type": "object", "properties": {"city": {"type": "string"}}}},
    "properties": {
    "zip": {"anyOf": [{"type": "string"}, {"type": "null"}]},  # Optional[str]
    "code": {"type": ["string", "null"]},
    "days": {"anyOf": [{"type": "integer"}, {"type": "null"}]},  # Optional[int]
    "hours": {"oneOf": [{"type": "array"}, {"type": "null"}]},
    "place": {"$ref": "#/$defs/Place"},  # a nested model
    "near": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
    "unit": {"$ref": "#/$defs/Unit"},
    "count": {"type": "integer"},
    "either": {"type": ["integer", "string"]}}}


@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss"])
def test_values_are_typed_through_nullable_anyof_and_ref(parser):
    reply = wrapped(parser, function("find", zip="07001", code="True", days="3", hours="[9, 12]",
                                     place='{"city": "Paris"}', near='{"city": "Lyon"}', unit="c", count="5.0",
                                     either="7"))
    assert parsed(parser, reply, tools_of(find=PYDANTIC))[1] == [("find", {
        "zip": "07001", "code": "True", "days": 3, "hours": [9, 12], "place": {"city": "Paris"},
        "near": {"city": "Lyon"}, "unit": "c", "count": 5, "either": 7})]
    # null is null whatever the type (vLLM's), and text that is not the type stays text
    reply = wrapped(parser, function("find", zip="null", days="three", count="5.5", place="null"))
    assert parsed(parser, reply, tools_of(find=PYDANTIC))[1] == [("find", {
        "zip": None, "days": "three", "count": "5.5", "place": None})]


def test_a_ref_cycle_or_a_ref_elsewhere_leaves_the_value_text():
    params = {"type": "object", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
              "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "https://example.com/s.json"}}}
    reply = wrapped("qwen3_coder", function("f", a="[1]", b="2"))
    assert parsed("qwen3_coder", reply, tools_of(f=params))[1] == [("f", {"a": "[1]", "b": "2"})]


HEAD = "<|channel|>analysis<|message|>Need the file.<|end|><|start|>assistant"


@pytest.mark.parametrize("reply,content,calls", [
    # a preamble, then a call (its header with <|constrain|>json): the preamble is content, as vLLM's
    (HEAD + "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.run <|constrain|>json<|message|>{\"path\": \"ü.py\"}", "Let me look.",
     [("run", {"path": "ü.py"})]),
    # a preamble then the final answer (ended by <|return|>): both, in order (a stream cannot take the first back)
    (HEAD + "<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant<|channel|>final<|message|>Done."
     "<|return|>", "Checking. Done.", []),
    # only analysis: no content, no call
    (HEAD[:-len("<|end|><|start|>assistant")], "", []),
    # a call, then the final text after its result
    ("<|channel|>commentary to=functions.run<|message|>{}<|call|><|start|>assistant<|channel|>final<|message|>Ok",
     "Ok", [("run", {})]),
])
def test_harmony_preamble_is_content(reply, content, calls):
    assert parsed("openai", reply) == (content, calls)
    assert harmony_calls(reply)[0] == (content or None)
