"""Structured outputs probes (session 38): a JSON schema string with minLength or maxLength let the reply hold raw
control characters (xgrammar's set for such a string is [^"\\\r\n]), so a response_format json_schema reply that
finished with "stop" was JSON that json.loads (and a client's SDK) refuses; keywords xgrammar compiles but does not
enforce (allOf of several schemas, uniqueItems, contains, not, if/then/else) were answered with JSON the schema
rejects, and are refused naming the keyword; tool_choice "required" pointed a parameters schema's "$ref": "#" at the
list of calls."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from infer import LLM, SamplingParams, StructuredOutputsParams as S  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.engine.structured import GrammarBackend  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402

BOUNDED = {"type": "string", "minLength": 2, "maxLength": 4}


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4) as llm:
        yield llm


def test_a_bounded_string_reply_is_json_that_parses(llm):
    """tiny-llama, seed 1: '"Iͱd\\x02"' (token 193 is the byte 0x02), finish_reason stop, which json.loads refused."""
    outs = llm.generate(["hello"] * 6, [SamplingParams(max_new_tokens=40, temperature=1.0, seed=s,
                                                       structured_outputs=S(json=BOUNDED)) for s in range(6)])
    for out in outs:
        assert out.finish_reason == "stop"
        value = json.loads(out.text)
        assert isinstance(value, str) and 2 <= len(value) <= 4


@pytest.mark.parametrize("schema, good, bad", [
    (BOUNDED, '"ab"', '"a\x02b"'),
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"],
      "additionalProperties": False}, '{"s": "ab"}', '{"s": "a\tb"}'),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, '{"ab": 1}', '{"a\x01": 1}'),
    ({"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}, '["a"]', '["\x1f"]'),
])
def test_the_matcher_refuses_a_raw_control_character_in_a_bounded_string(llm, schema, good, bad):
    backend: GrammarBackend = llm.engine.grammars
    tok = llm.engine.tokenizer

    def accepts(text: str) -> bool:
        m = backend.matcher(S(json=schema))
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False))

    assert accepts(good)
    assert not accepts(bad)


def test_a_bad_bounded_schema_is_still_named_and_others_are_unchanged(llm):
    with pytest.raises(Exception, match="minLength|min_length|greater"):
        llm.engine.grammars.compile(S(json={"type": "string", "minLength": 5, "maxLength": 1}))
    out = llm.generate("hi", SamplingParams(max_new_tokens=20, structured_outputs=S(json={"type": "integer"})))
    assert out[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("schema, keyword, where", [
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", "#/allOf"),  # xgrammar allowed any JSON: "s", {}
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#/uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"type": "string"}}}}, "contains",
     "#/properties/a/contains"),
    ({"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]}, "not", "#/anyOf/1/not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "then", "#/then"),
])
def test_a_keyword_xgrammar_does_not_enforce_is_refused_naming_it(llm, schema, keyword, where):
    """allOf [integer, minimum 3] compiled and the reply could be {} or "s" (xgrammar only warned); uniqueItems,
    contains, not and if/then were ignored: a 200 whose JSON the schema rejects. vLLM refuses uniqueItems and
    contains ("features not supported by xgrammar")."""
    with pytest.raises(RequestError, match=f"uses {keyword} at {where}, which xgrammar does not enforce"):
        llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=S(json=schema)))


@pytest.mark.parametrize("schema", [
    {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer"}}},  # pydantic v1's one-schema allOf
    {"type": "object", "properties": {"not": {"type": "integer"}, "contains": {"type": "string"}}},  # names only
    {"enum": [{"not": 1}]},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 2},
])
def test_schemas_xgrammar_enforces_still_run(llm, schema):
    out = llm.generate("hi", SamplingParams(max_new_tokens=30, structured_outputs=S(json=schema)))[0]
    assert out.finish_reason in ("stop", "length")


def test_the_server_refuses_it_as_a_400_naming_response_format():
    pytest.importorskip("fastapi")
    import httpx
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=4, block_size=4))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": True}}}}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        ok = httpx.post(f"{base}/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}},
                        timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "uniqueItems" in r.json()["error"]["message"]
    assert ok.status_code == 200


TREE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"},
                                                                              "maxItems": 2}},
        "required": ["v"], "additionalProperties": False}


def test_required_keeps_a_recursive_parameters_ref_on_the_parameters(llm):
    """tool_choice "required" nests each function's parameters under items.properties.parameters: their "$ref": "#"
    (a tree of nodes) pointed at the root of the whole schema, the list of calls, so a node's kids had to be lists
    of calls ([[{"name": "tree", ...}]]) and {"v": 1, "kids": [{"v": 2}]} was refused."""
    jsonschema = pytest.importorskip("jsonschema")
    from infer.serve.tools import parse_tools
    tools = [{"type": "function", "function": {"name": "tree", "parameters": TREE}},
             {"type": "function", "function": {"name": "flat", "parameters": {"type": "object"}}}]
    schema = parse_tools({"tools": tools, "tool_choice": "required"}).schema
    calls = [{"name": "tree", "parameters": {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}}, {"name": "flat",
                                                                                             "parameters": {}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "tree", "parameters": {"v": 1, "kids": [[{"name": "tree", "parameters": {
            "v": 2}}]]}}], schema)
    assert tools[0]["function"]["parameters"] == TREE  # what the template renders is left as sent
    m = llm.engine.grammars.matcher(S(json=schema, disable_any_whitespace=True))
    text = json.dumps(calls, separators=(", ", ": "))
    assert all(m.accept_token(t) for t in llm.engine.tokenizer.encode(text, add_special_tokens=False))
