"""Structured outputs probes (session 52, fuzzing JSON schemas against the engine's grammars): xgrammar's matcher
(0.2.9) decodes the bytes ED A0-BF 80-BF, which are not UTF-8 (a UTF-16 surrogate's code), as one character of a
JSON string, so a string with maxLength 4 took " re" and those 3 bytes: the reply's text holds them as 3 U+FFFD, a
string of 6 characters the schema rejects."""

from __future__ import annotations

import json
import re

import pytest

xgr = pytest.importorskip("xgrammar")

from infer import StructuredOutputsParams as S  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.engine.structured import GrammarBackend  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402


@pytest.fixture(scope="module")
def grammars():
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    return GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _byte(tokenizer, value: int) -> int:
    """The byte-level BPE token of one byte (GPT-2's map of bytes to characters)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = chr(value) if value in printable else chr(256 + [b for b in range(256) if b not in printable].index(value))
    return tokenizer.convert_tokens_to_ids(char)


def _takes(grammars, schema, ids) -> bool:
    matcher = grammars.matcher(S(json=schema))
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(grammars.tokenizer.eos_token_id)


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 4, "maxLength": 4},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}},
])
def test_a_bounded_string_takes_no_surrogate_bytes(grammars, schema):
    tokenizer = grammars.tokenizer
    quote = _byte(tokenizer, 0x22)
    # what the fuzzer's walk (seed 5) sampled: '"', 'Ġre', then ED A4 9D and '"'
    ids = [quote, *tokenizer.encode(" r" if "properties" in schema else " re", add_special_tokens=False),
           *(_byte(tokenizer, b) for b in (0xED, 0xA4, 0x9D)), quote]
    if "properties" in schema:
        ids = tokenizer.encode('{"s":', add_special_tokens=False) + ids + tokenizer.encode("}",
                                                                                          add_special_tokens=False)
    text = tokenizer.decode(ids)
    value = json.loads(text)
    assert "\ufffd" in json.dumps(value, ensure_ascii=False)  # the reply's text: too long for the schema
    assert not _takes(grammars, schema, ids)
    good = '"ab€d"' if "properties" not in schema else '{"s": "é€"}'
    assert _takes(grammars, schema, tokenizer.encode(good, add_special_tokens=False))  # real UTF-8 still passes


@pytest.mark.parametrize("regex, before, after, good", [
    ("a.b", "a", "b", "aéb"),
    ("[^x]{1,2}", "", "", "é€"),
    ("\\S", "", "", "€"),
    ("x\\W", "x", "", "x€"),
    ("\\D", "", "", "€"),
])
def test_a_regex_takes_no_surrogate_bytes(grammars, regex, before, after, good):
    tokenizer = grammars.tokenizer
    ids = (tokenizer.encode(before, add_special_tokens=False) + [_byte(tokenizer, b) for b in (0xED, 0xA4, 0x9D)]
           + tokenizer.encode(after, add_special_tokens=False))
    assert not re.fullmatch(regex, tokenizer.decode(ids), re.S)  # the reply's text (3 U+FFFD) breaks the regex

    def takes(ids):
        matcher = grammars.matcher(S(regex=regex))
        return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)

    assert not takes(ids)
    assert takes(tokenizer.encode(good, add_special_tokens=False))


@pytest.mark.parametrize("regex, good, bad", [
    ("a[^\\]x]b", ["ayb", "a\nb"], ["a]b", "axb"]),
    ("[.]\\.", [".."], ["a."]),
    ("[^]a]", ["ba]"], ["b"]),  # ECMA's [^] (any character)
    ("\\s\\w\\d", [" a1"], ["a a1"]),
    ("x[^a-]", ["xb", "xz", "x_"], ["xa", "x-"]),  # the last "-" is itself: the surrogates' range went after it,
    ("x[^-]", ["xb"], ["x-"]),  # and "a-\\ud800" took every character from a to U+D800 out of the class
])
def test_a_regex_means_what_it_did(grammars, regex, good, bad):
    tokenizer = grammars.tokenizer
    for text in good + bad:
        matcher = grammars.matcher(S(regex=regex))
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert (all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)) \
            == (text in good), text


def test_a_regex_that_does_not_compile_is_named_at_its_own_position(grammars):
    with pytest.raises(RequestError, match="position 6: Unclosed"):
        grammars.matcher(S(regex="a.([b"))


def _json_takes(grammars, schema, text: str) -> bool:
    tokenizer = grammars.tokenizer
    return _takes(grammars, schema, tokenizer.encode(text, add_special_tokens=False))


_NAMES = {"pattern": "^[a-z]+$"}


@pytest.mark.parametrize("schema, breaking, message", [
    # the walk's schema 239 (seed 8): xgrammar took {"p1": []} though propertyNames rejects "p1"
    ({"type": "object", "properties": {"p1": {"type": "array"}}, "required": ["p1"], "propertyNames": _NAMES},
     '{"p1": []}', 'has the property "p1" at #/properties/p1, whose name its object\'s propertyNames does not surely '
                   'allow'),
    ({"type": "object", "properties": {"ab": {"type": "null"}}, "additionalProperties": {"type": "null"},
      "patternProperties": {"^x": {"type": "null"}}, "propertyNames": _NAMES},
     '{"A1": null}', "uses propertyNames at #/propertyNames beside patternProperties"),
    ({"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}},
                                 "propertyNames": {"maxLength": 0}}},
     '[{"n": 1}]', 'has the property "n" at #/items/properties/n'),
])
def test_property_names_xgrammar_lets_through_are_refused(grammars, schema, breaking, message):
    tokenizer = grammars.tokenizer
    matcher = xgr.GrammarMatcher(grammars.compiler().compile_json_schema(json.dumps(schema)))
    ids = tokenizer.encode(breaking, add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)  # xgrammar's own
    with pytest.raises(RequestError, match=re.escape(message)):
        grammars.matcher(S(json=schema))


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "object", "propertyNames": _NAMES, "properties": {"ab": {"type": "null"}},
      "additionalProperties": {"type": "null"}}, ['{"ab": null}', '{"cd": null}'], ['{"A1": null}']),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"], "type": "string", "description": "x"},
      "properties": {"a": {"type": "integer"}}}, ['{"a": 1}'], ['{"c": 1}']),
    ({"type": "object", "propertyNames": {"const": "k"}, "properties": {"k": {"type": "integer"}}},
     ['{"k": 1}'], ['{"j": 1}']),
])
def test_property_names_xgrammar_enforces_still_run(grammars, schema, good, bad):
    for text in good + bad:
        assert _json_takes(grammars, schema, text) == (text in good), text
