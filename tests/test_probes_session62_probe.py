"""Hostile inputs to what session 61 built (multimodal checkpoints served as their text model, the new dense
families, the qwen3_coder / seed_oss / openai tool parsers, classification and scoring, the benchmarks' new flags):
each a crash, a 500 or a wrong result found by a probe, now a clear error or the right answer."""

from __future__ import annotations

import json

import pytest

from infer import LLM
from infer.errors import UnsupportedModelError
from infer.serve.tools import parse_tools, split

from helpers import tiny_llama_with_json
from test_probes_session61_tools import TOOLS


@pytest.mark.parametrize("eos", ["2", True, [2, "x"], 2.0])
def test_a_multimodal_top_level_eos_token_id_of_another_type_is_refused(tmp_path, eos):
    """A multimodal config.json's top-level eos_token_id that is no token id ("2", true, a list holding text) was set
    on the text config, whose typed field raised huggingface_hub's validation error: a traceback out of `infer run`.
    It is now refused naming config.json's field, as a text model's config.json of that value is."""
    folder = tiny_llama_with_json(tmp_path / "mm", "config.json", "tiny-gemma3-mm", eos_token_id=eos)
    with pytest.raises(UnsupportedModelError, match="config.json's eos_token_id .* is not a value "
                                                    "Gemma3ForConditionalGeneration's text model takes"):
        LLM(str(folder), block_size=4)


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is no JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("parser, reply, want", [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=options>\n{\"wind\": NaN}\n</parameter>\n"
                    "<parameter=hours>\n[Infinity, 1]\n</parameter>\n</function>\n</tool_call>",
     [{"options": "{\"wind\": NaN}", "hours": "[Infinity, 1]"}]),
    ("seed_oss", "<seed:tool_call>\n<function=get_weather>\n<parameter=options>{\"wind\": -Infinity}</parameter>\n"
                 "</function>\n</seed:tool_call>", [{"options": "{\"wind\": -Infinity}"}]),
    ("hermes", "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"temp\": NaN}}</tool_call>", None),
    ("llama3_json", "{\"name\": \"get_weather\", \"parameters\": {\"temp\": Infinity}}", None),
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"temp\": NaN}}]", None),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{\"temp\": NaN}", None),
    ("pythonic", "[get_weather(temp=1e999)]", None),
])
def test_a_call_holding_nan_or_infinity_never_sends_them_as_arguments(parser, reply, want):
    """Python's JSON reads NaN and Infinity (and a Python literal 1e999 is infinity), which json.dumps wrote back into
    a call's `arguments` ('{"wind": NaN}'): no JSON, which a client's JSON.parse refuses. A typed parser's object or
    array value holding them stays its text (as a value that does not read does); the other parsers' reply stays
    text, as a call that is not JSON does (the openai parser's already did)."""
    content, calls = split(parse_tools({"tools": TOOLS}, parser), reply)
    if want is None:
        assert (content, calls) == (reply, None)
    else:
        assert [_strict_json(c["function"]["arguments"]) for c in calls] == want
