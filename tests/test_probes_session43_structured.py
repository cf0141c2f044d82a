"""Structured outputs probes (session 43): JSON schema keywords xgrammar (0.2.9) compiles but leaves unenforced
beside another keyword, so a reply that finished with "stop" broke the schema: an integer's multipleOf beside a
range ({"type": "integer", "multipleOf": 5, "minimum": 0} took 481), and any constraining keyword beside enum or
const (xgrammar writes the values alone: {"type": "integer", "enum": [1, 5, 10], "maximum": 5} took 10). Such a
schema is refused naming the keyword, as the other keywords xgrammar does not enforce are."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from infer import LLM, SamplingParams, StructuredOutputsParams as S  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4) as llm:
        yield llm


def _xgrammar_accepts(llm, schema, text: str) -> bool:
    """Whether xgrammar's own grammar of `schema` (no check of ours) takes `text` to its end."""
    matcher = xgr.GrammarMatcher(llm.engine.grammars.compiler().compile_json_schema(json.dumps(schema)))
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(llm.engine.tokenizer.eos_token_id)


def _takes(llm, schema, text: str) -> bool:
    """Whether the engine's grammar of `schema` takes `text` to its end."""
    matcher = llm.engine.grammars.matcher(S(json=schema))
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(llm.engine.tokenizer.eos_token_id)


def _generate(llm, schema):
    return llm.generate("hi", SamplingParams(max_new_tokens=24, structured_outputs=S(json=schema)))[0].outputs[0]


@pytest.mark.parametrize("schema, where, bound, breaking", [
    ({"type": "integer", "multipleOf": 5, "minimum": 0}, "#", "minimum", "481"),
    ({"type": "integer", "multipleOf": 5, "exclusiveMaximum": 100}, "#", "exclusiveMaximum", "12"),
    ({"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 10000}, "#", "minimum", "7"),  # 5001 multiples
    ({"type": "object", "properties": {"n": {"type": ["integer", "null"], "multipleOf": 10, "maximum": 90}}},
     "#/properties/n", "maximum", '{"n": 7}'),
])
def test_an_integer_multiple_of_beside_a_range_is_refused_naming_both(llm, schema, where, bound, breaking):
    assert _xgrammar_accepts(llm, schema, breaking)  # what xgrammar's grammar let through
    with pytest.raises(RequestError, match=f"uses multipleOf at {where}/multipleOf beside {bound}, which xgrammar "
                                           "does not enforce together"):
        _generate(llm, schema)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer", "multipleOf": 1000, "minimum": 0, "maximum": 100000}, ["0", "1000", "100000"],
     ["7", "1500", "101000"]),
    ({"type": ["integer", "null"], "multipleOf": 4000, "exclusiveMinimum": -1, "exclusiveMaximum": 20000},
     ["null", "0", "16000"], ["4", "20000", "-4000"]),
])
def test_an_integer_multiple_of_within_a_two_sided_range_is_enforced(llm, schema, good, bad):
    """A range wider than xgrammar enforces multipleOf in, but of few multiples: they are compiled as their enum."""
    assert _xgrammar_accepts(llm, schema, bad[0])
    for text in good + bad:
        assert _takes(llm, schema, text) == (text in good), text
    outs = llm.generate(["hi"] * 4, [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s,
                                                    structured_outputs=S(json=schema)) for s in range(4)])
    for out in outs:
        value, ends = json.loads(out.text), [int(t) for t in good if t != "null"]
        assert out.finish_reason == "stop" and (value is None or (value % schema["multipleOf"] == 0
                                                                  and min(ends) <= value <= max(ends))), value


@pytest.mark.parametrize("schema", [
    {"type": "integer", "multipleOf": 5},  # alone: xgrammar enforces it
    {"type": "integer", "multipleOf": 1, "minimum": 0},  # every integer: nothing lost
    {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 9},  # pydantic's ge, le, multiple_of
    {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 9999},  # a range xgrammar enforces it in
    {"type": "integer", "minimum": 0, "maximum": 9},
])
def test_multiple_of_or_a_range_alone_still_runs(llm, schema):
    assert _generate(llm, schema).finish_reason in ("stop", "length")


@pytest.mark.parametrize("schema, keyword, over, breaking", [
    ({"type": "integer", "enum": [1, 5, 10], "maximum": 5}, "maximum", "enum", "10"),
    ({"type": "string", "enum": ["a", "bbb"], "maxLength": 2}, "maxLength", "enum", '"bbb"'),
    ({"type": "integer", "enum": [1, "a"]}, "type", "enum", '"a"'),
    ({"type": "string", "const": "abc", "minLength": 5}, "minLength", "const", '"abc"'),
    ({"const": "a", "enum": ["b"]}, "enum", "const", '"a"'),
    ({"type": "string", "enum": ["x1", "yy"], "pattern": "^[a-z]+$"}, "pattern", "enum", '"x1"'),
])
def test_a_keyword_beside_enum_or_const_that_a_value_breaks_is_refused(llm, schema, keyword, over, breaking):
    assert _xgrammar_accepts(llm, schema, breaking)
    with pytest.raises(RequestError, match=f"uses {keyword} at #/{keyword} beside {over}, which xgrammar ignores"):
        _generate(llm, schema)


@pytest.mark.parametrize("schema", [
    {"type": "string", "enum": ["red", "green"], "title": "Color", "description": "x", "default": "red"},  # pydantic
    {"type": "string", "const": "a"},  # pydantic's Literal["a"]
    {"type": ["string", "null"], "enum": ["a", None]},
    {"type": "number", "enum": [1, 2.5], "maximum": 3},
    {"type": "integer", "const": 3.0},
    {"type": "string", "enum": ["a", "bb"], "maxLength": 2},
    {"type": "string", "enum": ["a", "bb"], "pattern": "^[ab]+$"},
    {"type": "object", "properties": {"k": {"type": "string", "enum": ["x", "y"]}}, "required": ["k"]},
    {"type": "string", "format": "date", "enum": ["2024-01-31"]},  # format: an annotation
    {"type": "string", "enum": ["a"], "minLength": 0},  # says nothing
    {"type": "array", "enum": [[1, 2]], "uniqueItems": False, "items": {}},
])
def test_enum_and_const_whose_values_meet_the_keywords_beside_still_run(llm, schema):
    out = _generate(llm, schema)
    assert out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("schema, good, bad", [
    ({"minimum": 5}, ["7", "5.5"], ["3"]),
    ({"description": "n", "minimum": 1, "maximum": 3}, ["2"], ["9", "0"]),
    ({"maxLength": 1}, ['"a"'], ['"abc"']),
    ({"pattern": "^a+$"}, ['"aa"'], ['"b"']),
    ({"format": "date"}, ['"2024-01-31"'], ['"x"']),
    ({"minimum": 5, "maxLength": 3}, ["7", '"ab"'], ["4", '"abcd"']),
    ({"type": "object", "properties": {"n": {"description": "a count", "maximum": 3}}, "required": ["n"]},
     ['{"n": 2}'], ['{"n": 9}']),
])
def test_a_schema_without_a_type_holds_its_number_and_string_keywords(llm, schema, good, bad):
    """xgrammar ignored a number's or a string's keywords in a schema without a type ({"minimum": 5} took 3): the
    schema now gets the types its keywords are of, so every reply validates."""
    assert _xgrammar_accepts(llm, schema, bad[0])
    for text in good + bad:
        assert _takes(llm, schema, text) == (text in good), text


@pytest.mark.parametrize("schema, message", [
    ({"type": {"a": 1}}, "Type should be a string"),
    ({"type": [{"a": 1}], "minimum": 1}, "type must be a string or an array of strings"),
    ({"type": "string", "format": {"x": 1}}, "does not compile"),
    ({"type": {"a": 1}, "multipleOf": 3, "minimum": 0, "maximum": 9}, "Type should be a string"),
])
def test_a_keyword_of_the_wrong_kind_is_a_request_error_not_a_type_error(llm, schema, message):
    """The checks of what xgrammar enforces hashed `type` and `format`: a dict there raised TypeError (the server's
    500 "internal server error"); xgrammar's own checks now name it."""
    with pytest.raises(RequestError, match=message):
        _generate(llm, schema)
    assert _generate(llm, {"type": "integer"}).finish_reason in ("stop", "length")


@pytest.mark.parametrize("schema", [{"format": ["a"]}, {"type": "object", "properties": {"a": {"format": {}}}}])
def test_a_format_that_is_not_a_string_is_ignored_as_xgrammar_ignores_it(llm, schema):
    assert _generate(llm, schema).finish_reason in ("stop", "length")


@pytest.mark.parametrize("schema, where, breaking", [
    ({"anyOf": []}, "#/anyOf", ""),
    ({"oneOf": []}, "#/oneOf", ""),
    ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}, "#/properties/a/anyOf", '{"a": }'),
    ({"type": "array", "items": {"oneOf": []}}, "#/items/oneOf", "[,]"),
    ({"type": []}, "#/type", "1"),
])
def test_an_empty_any_of_one_of_or_type_is_refused(llm, schema, where, breaking):
    """No JSON value matches an empty anyOf, oneOf or type list; xgrammar wrote nothing in its place, so
    {"anyOf": []} was answered "" with finish_reason stop (json.loads refuses it)."""
    assert _xgrammar_accepts(llm, schema, breaking)
    with pytest.raises(RequestError, match=f"has an empty {where.rsplit('/', 1)[1]} at {where}: no JSON value"):
        _generate(llm, schema)


def test_an_empty_all_of_still_runs(llm):
    assert _generate(llm, {"allOf": []}).finish_reason in ("stop", "length")  # every value matches it


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "array", "maxItems": 2}, ["[]", "[1]", '[1, "a"]'], ["[1, 2, 3]"]),
    ({"type": ["array", "null"], "minItems": 1, "maxItems": 2}, ["[1]", "null"], ["[]", "[1, 2, 3]"]),
    ({"type": "object", "maxProperties": 2}, ["{}", '{"a": 1}'], ['{"a": 1, "b": 2, "c": 3}']),
    ({"maxProperties": 1}, ['{"a": 1}'], ['{"a": 1, "b": 2}']),
])
def test_a_bounded_count_of_items_or_properties_with_no_schema_for_them_takes_any(llm, schema, good, bad):
    """xgrammar read an array's maxItems with no items schema as no items at all ({"type": "array", "maxItems": 2}
    took only []), and an object's maxProperties with no properties as no properties; JSON Schema takes any."""
    for text in good + bad:
        assert _takes(llm, schema, text) == (text in good), text


@pytest.mark.parametrize("schema", [{"type": "array", "minItems": 1}, {"type": "object", "minProperties": 1}])
def test_a_lower_bound_on_items_or_properties_with_no_schema_for_them_compiles(llm, schema):
    """It was refused: 'minItems is greater than the number of prefixItems, but additional items are not allowed'."""
    with pytest.raises(RuntimeError, match="are not allowed|aren't allowed"):
        llm.engine.grammars.compiler().compile_json_schema(json.dumps(schema))
    empty = "[]" if schema["type"] == "array" else "{}"
    assert not _takes(llm, schema, empty) and _takes(llm, schema, "[1]" if empty == "[]" else '{"a": 1}')
