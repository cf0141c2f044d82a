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
    matcher = xgr.GrammarMatcher(backend._compile_json(backend.compiler(), json.dumps(schema), True))
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
