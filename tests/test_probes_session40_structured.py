"""Structured outputs probes (session 40): xgrammar (0.2.9) ignores a string's minLength and maxLength beside a
pattern, and its pattern, minLength and maxLength beside a format it knows (only a warning on stderr), so
{"type": "string", "pattern": "[a-z]+", "maxLength": 3} (pydantic's constr(pattern=..., max_length=3)) was answered
with "abcdefgh", finish_reason stop: such a schema is refused naming the keyword, as the other keywords xgrammar
does not enforce are."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from infer import LLM, SamplingParams, StructuredOutputsParams as S  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.engine.structured import GrammarBackend  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4) as llm:
        yield llm


def _accepts(llm, schema, text: str) -> bool:
    """Whether xgrammar's own grammar of `schema` (no check of ours) takes `text` to its end."""
    backend: GrammarBackend = llm.engine.grammars
    matcher = xgr.GrammarMatcher(backend.compiler().compile_json_schema(json.dumps(schema)))
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(llm.engine.tokenizer.eos_token_id)


@pytest.mark.parametrize("schema, keyword, beside, where, breaking", [
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength", "pattern", "#", '"abcdefgh"'),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]+$", "minLength": 5}}},
     "minLength", "pattern", "#/properties/s", '{"s": "ab"}'),
    ({"type": "string", "format": "date", "pattern": "^19"}, "pattern", "format", "#", '"2024-01-01"'),
    ({"type": ["string", "null"], "format": "uuid", "maxLength": 4}, "maxLength", "format", "#",
     '"12345678-1234-1234-1234-123456789012"'),
    ({"type": "array", "items": {"type": "string", "format": "email", "minLength": 30}}, "minLength", "format",
     "#/items", '["a@b.co"]'),
])
def test_a_keyword_xgrammar_ignores_beside_another_is_refused_naming_both(llm, schema, keyword, beside, where,
                                                                          breaking):
    assert _accepts(llm, schema, breaking)  # what xgrammar's grammar let through: a reply the schema rejects
    with pytest.raises(RequestError, match=f"uses {keyword} at {where}/{keyword} beside {beside}, which xgrammar "
                                           "does not enforce together"):
        llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=S(json=schema)))


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^[a-z]+$", "minLength": 0},  # no bound
    {"type": "string", "format": "password", "minLength": 2, "maxLength": 6},  # a format xgrammar leaves alone
    {"type": "integer", "pattern": "x", "maxLength": 3},  # string keywords on an integer: nothing to enforce
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "format": "date"},
    {"type": "object", "properties": {"pattern": {"type": "string"}, "maxLength": {"type": "integer"}}},  # names
])
def test_schemas_whose_string_keywords_xgrammar_enforces_still_run(llm, schema):
    out = llm.generate("hi", SamplingParams(max_new_tokens=30, structured_outputs=S(json=schema)))[0]
    assert out.finish_reason in ("stop", "length")


def _matches(llm, schema, text: str) -> bool:
    """Whether the engine's grammar of `schema` takes `text` to its end."""
    matcher = llm.engine.grammars.matcher(S(json=schema))
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(llm.engine.tokenizer.eos_token_id)


DATES = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                          "t": {"type": "string", "format": "date-time"},
                                          "ip": {"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "null"}]},
                                          "e": {"enum": [{"format": "date"}]}},
         "required": ["d", "t", "ip", "e"], "additionalProperties": False}


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "format": "date"}, ['"2024-02-29"', '"2023-04-30"', '"0001-12-31"', '"2000-02-29"'],
     ['"2023-02-31"', '"2023-04-31"', '"2023-02-29"', '"1900-02-29"', '"0000-01-01"']),
    ({"type": "string", "format": "date-time"}, ['"2024-02-29T23:59:60.5+05:30"', '"1999-12-31T00:00:00Z"'],
     ['"2023-11-31T10:00:00Z"', '"2023-02-29T10:00:00Z"', '"2024-01-01T07:57:4989Z"']),
    ({"type": "string", "format": "ipv4"}, ['"10.0.0.1"', '"255.255.255.0"', '"0.0.0.0"'],
     ['"07.22.91.30"', '"1.001.181.44"', '"256.1.1.1"']),
    (DATES, ['{"d": "2024-02-29", "t": "2024-01-01T00:00:00Z", "ip": null, "e": {"format":"date"}}'],
     ['{"d": "2024-02-30", "t": "2024-01-01T00:00:00Z", "ip": null, "e": {"format":"date"}}',
      '{"d": "2024-02-28", "t": "2024-01-01T00:00:00Z", "ip": "1.2.3.04", "e": {"format":"date"}}']),
])
def test_a_date_or_ipv4_is_one_the_format_takes(llm, schema, good, bad):
    """xgrammar's date took day 31 in every month and year 0000 (jsonschema, Python and pydantic refuse them), and
    its ipv4 leading zeros; an enum's data that looks like a schema is left as it is."""
    for text in good:
        assert _matches(llm, schema, text), text
    for text in bad:
        assert not _matches(llm, schema, text), text


def test_sampled_dates_and_addresses_validate():
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "array", "items": {"anyOf": [{"type": "string", "format": "date"},
                                                   {"type": "string", "format": "ipv4"}]}, "minItems": 4,
              "maxItems": 4}
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4) as llm:
        outs = llm.generate(["hello"] * 6, [SamplingParams(max_new_tokens=80, temperature=1.0, seed=s,
                                                           structured_outputs=S(json=schema,
                                                                                disable_any_whitespace=True))
                                            for s in range(6)])
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done
    for out in done:
        jsonschema.validate(json.loads(out.text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("schema, breaking, message", [
    ({"type": "string", "pattern": "(?=a)b"}, '"b"', r"a pattern with a lookahead \(\(\?=...\) or \(\?!...\)\) at "
                                                      "#/pattern, which xgrammar ignores"),
    ({"type": "object", "patternProperties": {"^(?!x)[a-z]$": {"type": "integer"}}, "additionalProperties": False},
     '{"x": 1}', r"lookahead .* at #/patternProperties/\^\(\?!x\)\[a-z\]\$, which xgrammar ignores"),
    ({"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}, "required": ["a"]},
     '{"a": [true]}', r'a \$ref that is not a JSON pointer into the schema at #/properties/a/\$ref '
                      r'\("http://example.com/a.json"\), which xgrammar does not resolve'),
    ({"$ref": "#thing", "$defs": {"t": {"$anchor": "thing", "type": "integer"}}}, '"s"', r'at #/\$ref \("#thing"\)'),
])
def test_a_lookahead_or_a_ref_xgrammar_lets_anything_through_is_refused(llm, schema, breaking, message):
    """xgrammar dropped a pattern's lookahead and put any JSON in place of a $ref it could not resolve (warnings on
    stderr only): the reply could break the schema."""
    assert _accepts(llm, schema, breaking)
    with pytest.raises(RequestError, match=message):
        llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=S(json=schema)))


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": r"^a\(?=b[(?=]c$"},  # escaped, and in a character class: no lookahead
    {"type": "string", "pattern": "^[(?!=]+$"},
    {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
    {"type": "object", "properties": {"$ref": {"type": "string"}, "pattern": {"enum": ["(?=a)"]}}},
])
def test_patterns_without_a_lookahead_and_local_refs_still_run(llm, schema):
    out = llm.generate("hi", SamplingParams(max_new_tokens=30, structured_outputs=S(json=schema)))[0]
    assert out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("grammar, good, bad", [
    ('start: "yes" | "no"', ["yes", "no"], ["maybe"]),
    ("?start: pair ~ 2..3\npair: 'k' \"=\" DIGIT+ [\";\"]  // a comment\nDIGIT: \"0\"..\"9\"",
     ["k=1k=22;", "k=1;k=2;k=3"], ["k=1", "k=a;k=1"]),
    ('start: item+ -> items\nitem.2: "x"\n    | "#y"', ["x#yx"], ["z"]),
])
def test_a_lark_grammar_is_converted_as_vllm_does(llm, grammar, good, bad):
    """vLLM takes a grammar without ::= as Lark's and converts it to EBNF for xgrammar; infer sent it to xgrammar as
    it was: 'EBNF lexer error at line 1, column 6: Unexpected character: ':''."""
    def matches(text):
        matcher = llm.engine.grammars.matcher(S(grammar=grammar))
        ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(llm.engine.tokenizer.eos_token_id)

    assert all(matches(t) for t in good) and not any(matches(t) for t in bad)
    out = llm.generate("hi", SamplingParams(max_new_tokens=20, temperature=1.0, seed=0,
                                            structured_outputs=S(grammar=grammar)))[0]
    assert out.finish_reason == "stop" and matches(out.text)


@pytest.mark.parametrize("grammar, message", [
    ("start: /[a-z]+/", r"read as Lark \(it has no ::=\): line 1: the regular expression /\[a-z\]\+/ is not "
                        "supported"),
    ('%import common.WS\n%ignore WS\nstart: "a"', "line 1: %import is not supported"),
    ('start: "a"i', 'the case-insensitive string "a"i is not supported'),
    ("start: value", "it refers to rules it does not define: value"),
    ('start: "a"\n"b"', "line 2 is neither a rule"),
])
def test_what_the_lark_conversion_cannot_write_is_named(llm, grammar, message):
    with pytest.raises(RequestError, match=message):
        llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=S(grammar=grammar)))


def test_the_server_takes_a_lark_guided_grammar():
    pytest.importorskip("fastapi")
    import httpx
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=4, block_size=4))
    body = {"prompt": "hi", "max_tokens": 8, "temperature": 0, "guided_grammar": 'start: "yes" | "no"'}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        ok = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        bad = httpx.post(f"{base}/v1/completions", json={**body, "guided_grammar": "start: /x/"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no"), ok.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_grammar", bad.text
    assert "regular expression /x/" in bad.json()["error"]["message"]


@pytest.mark.parametrize("schema, breaking, message", [
    ({"type": "number", "multipleOf": 0.5}, "0.3", "uses multipleOf at #/multipleOf, which xgrammar enforces only"),
    ({"multipleOf": 2}, '"s"', "uses multipleOf at #/multipleOf"),
    ({"type": "object", "required": ["z"]}, "{}", 'requires "z" at #/required, which is not in that schema'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "uses dependentRequired at #/dependentRequired"),
    ({"type": "integer", "anyOf": [{"type": "integer", "minimum": 5}, {"type": "string"}]}, '"s"',
     "uses type at #/type beside anyOf, which xgrammar ignores there"),
    ({"$ref": "#/$defs/a", "maximum": 3, "$defs": {"a": {"type": "integer"}}}, "9",
     r"uses maximum at #/maximum beside \$ref"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, '"s"',
     "beside anyOf"),
])
def test_a_keyword_xgrammar_drops_is_refused(llm, schema, breaking, message):
    """xgrammar ignored multipleOf on a number, required names without a property schema, dependentRequired and
    whatever constrains beside $ref, anyOf, oneOf or allOf: replies the schema rejects finished with stop."""
    assert _accepts(llm, schema, breaking)
    with pytest.raises(RequestError, match=message):
        llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=S(json=schema)))


def test_a_pydantic_models_schema_still_runs_and_its_replies_validate(llm):
    pydantic = pytest.importorskip("pydantic")
    jsonschema = pytest.importorskip("jsonschema")
    import datetime
    from typing import Literal, Optional, Union

    class Addr(pydantic.BaseModel):
        street: str = pydantic.Field(description="the street", max_length=8)
        zip: Optional[str] = None

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int = pydantic.Field(ge=0, le=9, multiple_of=3)

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]

    class Model(pydantic.BaseModel):
        code: str = pydantic.Field(pattern=r"^[A-Z]{3}$")
        addr: Addr = pydantic.Field(description="home")
        other: Optional[Addr] = None
        pet: Union[Cat, Dog] = pydantic.Field(discriminator="kind")
        day: datetime.date
        when: datetime.datetime

    schema = Model.model_json_schema()
    outs = llm.generate(["hi"] * 3, [SamplingParams(max_new_tokens=200, temperature=1.0, seed=s,
                                                    structured_outputs=S(json=schema, disable_any_whitespace=True))
                                     for s in range(3)])
    assert any(out.finish_reason == "stop" for out in outs)
    for out in outs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema, format_checker=jsonschema.FormatChecker())
            Model.model_validate_json(out.text)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "pattern": "^b(x[0-9]+)?$"}, ['"b"', '"bx5"', '"bx55"'], ['"b5"', '"b55"']),
    ({"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}, ['"12"', '"1.25"'], ['"1x2"']),
    ({"type": "string", "pattern": "^v(-[a-z]+)??$"}, ['"v"', '"v-ab"'], ['"vab"']),
    ({"type": "object", "patternProperties": {"^k(_[0-9]+)?$": {"type": "integer"}}, "additionalProperties": False},
     ['{"k": 1}', '{"k_5": 1}'], ['{"k5": 1}']),
    ({"type": "string", "pattern": r"^a\)?[)?]$"}, ['"a)?"', '"a?"'], ['"a)??"']),  # not groups: as they were
])
def test_an_optional_group_in_a_pattern_holds(llm, schema, good, bad):
    """xgrammar's automaton of a schema pattern skipped an optional group wrongly when it ends in a repetition:
    "^b(x[0-9]+)?$" took "b5" (a date-time's fraction, (\\.[0-9]+)?, took "07:57:4989Z")."""
    for text in good:
        assert _matches(llm, schema, text), text
    for text in bad:
        assert not _matches(llm, schema, text), text


@pytest.mark.parametrize("schema", [
    {"type": "object", "oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    {"type": "number", "anyOf": [{"type": "integer", "minimum": 3}, {"type": "number", "maximum": -1}]},
    {"type": ["string", "null"], "anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
])
def test_a_type_beside_anyof_that_every_branch_keeps_runs(llm, schema):
    """A `type` beside oneOf/anyOf that each branch's own type is within (OpenAPI writes {"type": "object",
    "oneOf": [objects]}) loses nothing when xgrammar writes the branches alone: not refused, and replies validate."""
    jsonschema = pytest.importorskip("jsonschema")
    outs = llm.generate(["hi", "a b", "x"], SamplingParams(max_new_tokens=24, temperature=1.0, seed=3,
                                                            structured_outputs=S(json=schema)))
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), schema)
