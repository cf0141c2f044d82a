"""Structured outputs (vLLM's guided decoding): a reply constrained to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar.

xgrammar (vLLM's default backend) compiles a constraint against the tokenizer's vocabulary (cached per constraint,
so a schema sent again is not compiled again) and keeps one matcher per request. At each step the sampler masks
every token the request's matcher does not allow next (a bitmask of the vocabulary per row, filled on the host and
copied with the step), and each token the request samples advances its matcher. The end of the grammar allows only
the model's EOS tokens, so a complete reply ends with finish_reason "stop". As in vLLM, max_tokens or a stop string
can still cut a reply short of the grammar's end.

What a matcher allows next depends on the last token sampled, so while steps overlap (a GPU engine) a step that
samples for such a request queues its forward pass first and fills that row's mask only once the step before has
completed, before its sampling is queued (`SamplingInputs.late`, LLMEngine.step).
"""

from __future__ import annotations

import ast
import collections
import copy
import functools
import json
import re
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field, fields

import torch

from ..errors import RequestError, json_problem
from ..kernels import apply_bitmask
from .schema_overlap import overlapping

MAX_SPEC_CHARS = 200_000  # a schema, regex or grammar (compiling one runs on the server's threads)
MAX_CHOICES = 4096
CACHE_BYTES = 512 << 20  # compiled constraints kept (xgrammar's cache; vLLM's default size): a server that meets many
# different schemas does not grow without bound
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: \(.*?\) is false: )?")
# a string character in xgrammar's grammar of a string with a length bound (raw control characters pass), and the
# one JSON allows (as xgrammar's other strings take it) less the UTF-16 surrogates: xgrammar's matcher decodes the
# bytes ED A0-BF xx (not UTF-8) as one of them, so a reply of maxLength 4 held " re" and those 3 bytes, which the
# reply's text holds as 3 U+FFFD (6 characters)
_RAW_CONTROL, _JSON_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n\ud800-\udfff]'
# what a grammar no text can match (or complete) usually is: xgrammar compiles it, its matcher allows nothing
DEAD_HINT = "e.g. a rule that never ends (root ::= a, a ::= a \"x\") or a set of no characters: fix it"


def _unpickled(cls, fields: dict):
    """A StructuredOutputsParams as it was pickled (its fields set as they are: the JSON schema's text is not
    parsed again, which a deeply nested one would need the recursion pickle lacked for)."""
    spec = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(spec, name, value)
    object.__setattr__(spec, "_text", fields["json"])
    return spec


def _asked(kind: str, value) -> bool:
    """Whether a field asks for its kind: given (json_object: not false). Not `value not in (None, False)`: 0 equals
    False, and json=0 or regex=0 was told that no kind was given instead of what is wrong with it."""
    return value is not None and not (kind == "json_object" and value is False)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One of: json (a JSON schema, as an object or its JSON text), regex, choice (the reply is one of these
    strings), grammar (EBNF, in xgrammar's dialect of GBNF) or json_object=True (any JSON object).
    disable_any_whitespace: JSON without whitespace between its tokens (vLLM's option of the same name)."""

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    _text: str = field(default="", init=False, repr=False, compare=False)  # the schema's JSON text

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if _asked(k, getattr(self, k))]
        if len(given) != 1:
            raise RequestError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
                               + (f" (got {', '.join(given)})" if given else ""),
                               'e.g. {"json": {"type": "object"}}, {"regex": "[0-9]+"} or {"choice": ["yes", "no"]}')
        if not isinstance(self.disable_any_whitespace, bool):
            raise RequestError("structured_outputs.disable_any_whitespace must be true or false")
        kind = given[0]
        value = text = getattr(self, kind)
        if kind == "json":
            text = value
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except (ValueError, RecursionError) as e:
                    raise RequestError(f"structured_outputs.json is not valid JSON: {json_problem(e)}",
                                       "give the JSON schema as an object, or as its JSON text") from None
            else:
                parsed = value
                try:
                    text = json.dumps(value)
                except (TypeError, ValueError) as e:
                    raise RequestError(f"structured_outputs.json cannot be written as JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise RequestError(f"structured_outputs.json must be a JSON schema (an object), got "
                                   f"{type(parsed).__name__}", 'e.g. {"type": "object", "properties": {...}}')
            object.__setattr__(self, "_text", text)
        elif kind == "json_object":
            if value is not True:
                raise RequestError("structured_outputs.json_object must be true")
            text = ""
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise RequestError("structured_outputs.choice must be a non-empty list of non-empty strings")
            if len(value) > MAX_CHOICES:
                raise RequestError(f"structured_outputs.choice has {len(value)} strings, more than {MAX_CHOICES}")
            object.__setattr__(self, "choice", list(value))
            text = "".join(value)
        else:
            if not isinstance(value, str) or not value.strip():
                raise RequestError(f"structured_outputs.{kind} must be a non-empty string")
            text = value
        if isinstance(text, str) and len(text) > MAX_SPEC_CHARS:
            raise RequestError(f"structured_outputs.{kind} has {len(text)} characters, more than {MAX_SPEC_CHARS}")

    def __reduce_ex__(self, protocol):
        """Pickled (to a data-parallel replica) with a JSON schema as its text: a schema nested a few hundred levels
        deep, which a JSONL line may hold, was more than pickle's recursion allows, and the run stopped."""
        if self.kind != "json" or isinstance(self.json, str):
            return super().__reduce_ex__(protocol)
        return _unpickled, (self.__class__, {**{f.name: getattr(self, f.name) for f in fields(self) if f.init},
                                                "json": self._text})

    def __copy__(self):  # copy and deepcopy (SamplingParams.clone) keep the schema as it was given
        return self._copied(lambda value: value)

    def __deepcopy__(self, memo):
        return self._copied(lambda value: copy.deepcopy(value, memo))

    def _copied(self, each):
        new = object.__new__(type(self))
        for name, value in self.__dict__.items():
            object.__setattr__(new, name, each(value))
        return new

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if _asked(k, getattr(self, k)))

    @classmethod
    def of(cls, value, name: str = "structured_outputs") -> StructuredOutputsParams | None:
        """An instance from itself, a dict of its fields (JSON), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise RequestError(f"{name} must be an object, got {type(value).__name__}",
                               'e.g. {"json": {"type": "object"}} or {"choice": ["yes", "no"]}')
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(value) - known)
        if unknown:
            raise RequestError(f"{name} has unknown fields {unknown}", f"its fields are {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in value.items() if v is not None})


_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}
# vLLM's older request fields, one per kind (they still work there)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _field_error(name: str, message: str, hint: str | None = None) -> RequestError:
    e = RequestError(message, hint)
    e.field = name  # the request field it is about (the server's error `param`)
    return e


def from_openai(body: dict, where: str = "") -> tuple[dict | None, str | None]:
    """(structured_outputs fields, the request field they came from) of an OpenAI request body: response_format
    json_object or json_schema (OpenAI), structured_outputs (vLLM) or vLLM's older guided_json, guided_regex,
    guided_choice and guided_grammar; (None, None) when it asks for none. `where` prefixes field names in errors
    ("body." for a batch line)."""
    found: list[tuple[str, dict]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise _field_error("response_format", f"{where}response_format must be an object with a type",
                               'e.g. {"type": "json_object"}')
        kind = fmt["type"]
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise _field_error("response_format", f"{where}response_format.json_schema needs a schema object",
                                   'e.g. {"type": "json_schema", "json_schema": {"name": "answer", "schema": '
                                   '{"type": "object"}}}')
            found.append(("response_format", {"json": spec["schema"]}))
        elif kind != "text":
            raise _field_error("response_format", f"{where}response_format type {kind!r} is not supported",
                               "use text, json_object or json_schema (or structured_outputs for a regex, a choice "
                               "or a grammar)")
    if body.get("structured_outputs") is not None:
        value = body["structured_outputs"]
        if not isinstance(value, dict):
            raise _field_error("structured_outputs", f"{where}structured_outputs must be an object",
                               'e.g. {"regex": "[0-9]+"}')
        found.append(("structured_outputs", value))
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append((key, {kind: body[key]}))
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None:
        raise _field_error("guided_whitespace_pattern", f"{where}guided_whitespace_pattern is not supported",
                           "structured_outputs.disable_any_whitespace: true writes JSON without whitespace")
    backend = body.get("guided_decoding_backend")
    if backend not in (None, "auto", "xgrammar"):
        raise _field_error("guided_decoding_backend", f"{where}guided_decoding_backend {backend!r} is not "
                           "available", "infer uses xgrammar (send \"xgrammar\", or leave it out)")
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(where + k for k, _ in found)
        raise _field_error(found[1][0], f"a request may ask for one structured output, got {names}",
                           "keep one of them")
    name, spec = found[0]
    if name != "structured_outputs":  # its own errors name structured_outputs' fields: first the one this came as
        try:
            StructuredOutputsParams.of(spec)
        except RequestError as e:
            raise _field_error(name, f"{where}{name}: {e.message}", e.hint) from None
    return spec, name


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: JSON's escapes, which xgrammar's parser reads."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


# Lark (vLLM takes a grammar without "::=" as Lark's syntax and converts it to EBNF for xgrammar): its tokens
_LARK_TOKEN = re.compile(r"""(?P<space>\s+)|(?P<comment>//[^\n]*|\#[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?)|(?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
    |(?P<name>[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?[0-9]+)?)|(?P<number>[0-9]+)|(?P<op>\.\.|->|[:|()\[\]*+?~])
    |(?P<directive>%[a-z]+)|(?P<open>["'/].*)|(?P<other>.)""", re.X)
# (open: a string or regex left open runs to the end of the line, a token of its own; as `other`, the scan went on from
# its next character, and each quote of a line of escaped quotes ('"\\"\\"...') rescanned the rest: quadratic, in `re`,
# which holds the GIL: a grammar of 40 kB stalled the whole server 10 s, one of 200 kB (the most a request sends)
# for minutes)
_LARK_HINT = ("write it in xgrammar's EBNF (root ::= ...), or in Lark with rules, terminals, strings, \"a\"..\"z\" "
              "ranges, [optional], ( | ), ?, *, +, ~ n and ~ n..m")


def _is_lark(grammar: str) -> bool:
    """vLLM's test: no line (less its # or // comment) defines a rule with ::=."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))


def _lark_error(message: str) -> RequestError:
    return RequestError(f"structured_outputs.grammar is read as Lark (it has no ::=): {message}", _LARK_HINT)


def _lark_string(token: str) -> str:
    if token.endswith("i"):
        raise _lark_error(f"the case-insensitive string {token} is not supported")
    try:
        return ast.literal_eval(token)
    except (ValueError, SyntaxError):
        raise _lark_error(f"the string {token} is not a valid string literal") from None


def _class_char(char: str) -> str:
    return "\\" + char if char in "\\]-^[" else json.dumps(char, ensure_ascii=False)[1:-1]


def lark_to_ebnf(grammar: str) -> str:
    """A Lark grammar (what vLLM's convert_lark_to_ebnf takes, and [optional], "a".."z" and ~ n..m, which it did
    not translate) as xgrammar's EBNF; RequestError for what it cannot write (regexes, %import, %ignore)."""
    rules: list[tuple[str, list[str]]] = []
    for number, line in enumerate(grammar.split("\n"), 1):
        tokens = [(m.lastgroup, m.group()) for m in _LARK_TOKEN.finditer(line)
                  if m.lastgroup not in ("space", "comment")]
        if not tokens:
            continue
        kind, text = tokens[0]
        if kind == "directive":
            raise _lark_error(f"line {number}: {text} is not supported ({line.strip()!r})")
        if kind == "name" and len(tokens) > 1 and tokens[1] == ("op", ":"):
            rules.append((text.lstrip("?!").split(".")[0], []))
            body = tokens[2:]
        elif (kind, text) == ("op", "|") and rules:
            body = tokens
        else:
            raise _lark_error(f"line {number} is neither a rule (name: ...) nor an alternative (| ...): "
                              f"{line.strip()!r}")
        out = rules[-1][1]
        i = 0
        while i < len(body):
            kind, text = body[i]
            if kind == "string":
                value = _lark_string(text)
                if i + 2 < len(body) and body[i + 1] == ("op", "..") and body[i + 2][0] == "string":
                    end = _lark_string(body[i + 2][1])
                    if len(value) != 1 or len(end) != 1:
                        raise _lark_error(f"line {number}: a range needs one character each side, got {text}.."
                                          f"{body[i + 2][1]}")
                    out.append(f"[{_class_char(value)}-{_class_char(end)}]")
                    i += 3
                    continue
                out.append(json.dumps(value, ensure_ascii=False))
            elif kind == "regex":
                raise _lark_error(f"line {number}: the regular expression {text} is not supported")
            elif kind == "open":
                shown = text if len(text) <= 40 else text[:40] + "..."
                raise _lark_error(f"line {number}: {shown} is never closed (no unescaped {text[0]} after it on its "
                                  "line)")
            elif kind == "name":
                out.append(text.lstrip("?!").split(".")[0])
            elif kind == "op" and text in "()|*+?":
                out.append(text)
            elif (kind, text) == ("op", "["):
                out.append("(")
            elif (kind, text) == ("op", "]"):
                out.append(")?")
            elif (kind, text) == ("op", "~") and i + 1 < len(body) and body[i + 1][0] == "number":
                low = high = body[i + 1][1]
                i += 2
                if i + 1 < len(body) and body[i] == ("op", "..") and body[i + 1][0] == "number":
                    high = body[i + 1][1]
                    i += 2
                out.append(f"{{{low},{high}}}")
                continue
            elif (kind, text) == ("op", "->") and i + 1 < len(body) and body[i + 1][0] == "name":
                i += 2  # an alias names the tree's node: the language is the same
                continue
            else:
                raise _lark_error(f"line {number}: {text!r} is not supported here ({line.strip()!r})")
            i += 1
    if not rules:
        raise _lark_error("it defines no rule (name: ...)")
    names = [name for name, _ in rules]
    start = "start" if "start" in names else names[0]
    if "root" in names and start != "root":
        raise _lark_error("a rule named root that is not the start rule is not supported (root is EBNF's start)")
    defined: dict[str, list[str]] = {}
    for name, body in rules:
        if name in defined:
            raise _lark_error(f"the rule {name} is defined twice")
        defined[name] = body
    used = {t for body in defined.values() for t in body if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t)}
    missing = sorted(used - set(defined))
    if missing:
        raise _lark_error(f"it refers to rules it does not define: {', '.join(missing)}")
    lines = [] if start == "root" else [f"root ::= {start}"]
    for name, body in defined.items():
        lines.append(f"{name} ::= {' '.join(body)}")
    return "\n".join(lines)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise RequestError(f"structured outputs need the xgrammar package, which is not installed ({e})",
                           "pip install xgrammar (or install infer with the [structured] extra)") from None
    return xgrammar


# keywords xgrammar (0.2.9) compiles but does not enforce (it ignores them, or allows any JSON in their place: allOf
# of two or more schemas, with a warning), so a reply could break them; vLLM refuses some of them too
_UNENFORCED = {"uniqueItems": lambda v: v is True, "contains": lambda v: True, "minContains": lambda v: True,
               "maxContains": lambda v: True, "not": lambda v: True, "then": lambda v: True,
               "else": lambda v: True,
               "allOf": lambda v: isinstance(v, list) and len(v) > 1,
               "dependentRequired": bool, "dependentSchemas": bool, "dependencies": bool}
_DATA = ("enum", "const", "default", "examples")  # values, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


# the string formats xgrammar (0.2.9) writes a grammar of: with one, a string's pattern, minLength and maxLength are
# ignored (a warning on stderr), and a pattern ignores minLength and maxLength: {"pattern": "[a-z]+", "maxLength": 3}
# took "abcdefgh"
_FORMATS = frozenset(("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                      "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"))
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")  # an integer's multipleOf is ignored beside
_LENGTHS = {"minLength": lambda v: v != 0, "maxLength": lambda v: True}


def _ignored_beside(schema: dict) -> tuple[str, str] | None:
    """(keyword, the keyword that makes xgrammar ignore it) of a string schema, or None."""
    kind = schema.get("type", "string")
    if "string" not in (kind if isinstance(kind, list) else [kind]):
        return None
    over = "format" if schema.get("format") in _FORMATS else "pattern" if "pattern" in schema else None
    if over is None:
        return None
    if over == "format" and "pattern" in schema:
        return "pattern", over
    return next(((k, over) for k, counts in _LENGTHS.items() if k in schema and counts(schema[k])), None)


# with one of these, xgrammar (0.2.9) writes the grammar of it alone: a keyword that constrains beside it is ignored
# ({"type": "integer", "anyOf": [..., {"type": "string"}]} took "s"; {"$ref": ..., "maximum": 3} took 9)
_ALONE = ("$ref", "anyOf", "oneOf", "allOf")
_ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor",
                          "$dynamicAnchor", "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
                          "discriminator", "nullable", "format", "contentMediaType", "contentEncoding", "example"))


# with enum or const, xgrammar (0.2.9) writes those values alone (const before enum): a keyword beside them that
# constrains is ignored ({"type": "integer", "enum": [1, 5, 10], "maximum": 5} took 10); each checks a value here
_BOUND_HOLDS = {"minimum": lambda v, b: v >= b, "maximum": lambda v, b: v <= b,
                "exclusiveMinimum": lambda v, b: v > b, "exclusiveMaximum": lambda v, b: v < b}
_JSON_TYPES = {"string": str, "array": list, "object": dict}
_VACUOUS = {"minLength": 0, "minItems": 0, "minProperties": 0, "uniqueItems": False}
_OPEN = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_VALUE_KEYWORDS = frozenset(("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                             "multipleOf", "minLength", "maxLength", "pattern", "items", "prefixItems",
                             "minItems", "maxItems", "uniqueItems", "contains", "properties", "required",
                             "additionalProperties", "patternProperties", "propertyNames", "minProperties",
                             "maxProperties", "unevaluatedProperties", "unevaluatedItems"))


def _value_holds(value, keyword: str, bound) -> bool:
    """Whether an enum/const value surely meets `keyword`: its type, a number's bound, a string's length or pattern,
    the enum beside a const; False for the others (items, properties, ...), which are not checked."""
    if bound == _VACUOUS.get(keyword, ()) or keyword in _OPEN and bound in (True, {}):  # says nothing
        return True
    if keyword == "type":
        kinds = set(bound) if isinstance(bound, list) else {bound}
        if isinstance(value, bool) or value is None:
            return ("boolean" if value is not None else "null") in kinds
        if isinstance(value, (int, float)):
            return "number" in kinds or ("integer" in kinds and (isinstance(value, int) or value.is_integer()))
        return any(isinstance(value, _JSON_TYPES[k]) for k in kinds if k in _JSON_TYPES)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if keyword in _BOUND_HOLDS and isinstance(bound, (int, float)):
        return not number or _BOUND_HOLDS[keyword](value, bound)
    if keyword in ("minLength", "maxLength") and isinstance(bound, int):
        return not isinstance(value, str) or (len(value) >= bound if keyword == "minLength" else len(value) <= bound)
    if keyword == "enum" and isinstance(bound, list):
        return value in bound
    if keyword == "multipleOf" and isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > 0:
        return not number or (value % bound == 0 if isinstance(value, int) and isinstance(bound, int)
                              else (value / bound).is_integer())
    if keyword == "pattern" and isinstance(bound, str):
        return not isinstance(value, str) or _pattern_holds(bound, value)
    return False


# the most time the pattern checks of one schema (its enum and const values against a pattern beside them) may take:
# the request's own pattern, run by Python, which backtracks (re's "^(a|aa)+$" on 40 a's and a "!" ran for hours,
# holding the GIL: the whole server stalled); a check that runs out says "not surely held" (the 400 names the keyword)
PATTERN_CHECK_S = 0.5
_PATTERN_DEADLINE: ContextVar[float | None] = ContextVar("infer_pattern_deadline", default=None)


def _pattern_holds(pattern: str, value: str) -> bool:
    """Whether `value` surely matches `pattern` (a search, as JSON Schema's): with the `regex` module, which lets go
    of the GIL and stops at the time left of PATTERN_CHECK_S (the schema's, under _check_enforced); False for a
    pattern it cannot read and once the time is up."""
    import regex  # (a dependency of transformers)
    deadline = _PATTERN_DEADLINE.get()
    left = PATTERN_CHECK_S if deadline is None else deadline - time.monotonic()
    if left <= 0:
        return False
    try:
        return regex.search(pattern, value, timeout=left, concurrent=True) is not None
    except (regex.error, TimeoutError):
        return False


def _beside_values(schema: dict) -> tuple[str, str] | None:
    """(a keyword xgrammar ignores beside the schema's const or enum, which of those), or None: one that some value
    may break."""
    over = "const" if "const" in schema else "enum" if isinstance(schema.get("enum"), list) else None
    if over is None:
        return None
    values = [schema["const"]] if over == "const" else schema["enum"]
    found = next((k for k in schema if k in _VALUE_KEYWORDS and k != over
                  and not all(_value_holds(v, k, schema[k]) for v in values)), None)
    return (found, over) if found else None


MAX_MULTIPLES = 1024  # an integer's multipleOf beside a range of at most this many multiples is written as their enum
XGRAMMAR_RANGE = 10_000  # xgrammar (0.2.9) enforces multipleOf beside a range of at most this many integers


def _range(schema: dict) -> tuple[int, int] | None:
    """(lowest, highest) integer a schema's two whole-number bounds allow, or None without both."""
    bounds = {k: schema[k] for k in _BOUNDS if k in schema}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer()
               for v in bounds.values()):
        return None
    lows = [int(bounds[k]) + (k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if k in bounds]
    highs = [int(bounds[k]) - (k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if k in bounds]
    return (max(lows), min(highs)) if lows and highs else None


def _multiples(schema: dict) -> list[int] | None:
    """The multiples an integer schema's multipleOf (2 or more) allows within its two-sided range (pydantic's ge, le
    and multiple_of), when they are 1..MAX_MULTIPLES; else None."""
    mult, kind = schema.get("multipleOf"), schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if not isinstance(mult, int) or isinstance(mult, bool) or mult < 2 or kinds - {"null"} != {"integer"} \
            or "enum" in schema or "const" in schema:  # (values of their own: _beside_values checked them)
        return None
    span = _range(schema)
    if span is None:
        return None
    first, last = -(-span[0] // mult) * mult, span[1]
    count = (last - first) // mult + 1
    return list(range(first, last + 1, mult)) if 0 < count <= MAX_MULTIPLES else None


def _multiple_ignored(schema: dict) -> bool:
    """Whether xgrammar would ignore an integer schema's multipleOf for its range (one-sided, or wider than
    XGRAMMAR_RANGE integers: {"multipleOf": 5, "minimum": 0} took 481), and it is not written as an enum."""
    if "enum" in schema or "const" in schema:  # xgrammar writes the values alone, each checked by _beside_values
        return False
    span = _range(schema)
    return (span is None or span[1] - span[0] + 1 > XGRAMMAR_RANGE) and not _multiples(schema)


def _lookahead(pattern: str) -> bool:
    """Whether a regex has a lookahead, (?=...) or (?!...): xgrammar ignores one in a schema's pattern (only a
    warning on stderr), so pattern "(?=a)b" took "b"; a regex of its own (structured_outputs.regex) is refused."""
    i, in_class = 0, False
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        if in_class:
            in_class = pattern[i] != "]"
        elif pattern[i] == "[":  # ECMA-262's class, as JSON Schema's: "[]" is empty, a first ] ends it
            in_class = True
        elif pattern.startswith(("(?=", "(?!"), i):
            return True
        i += 1
    return False


def _types(schema) -> set | None:
    """The JSON types a schema's `type` names (None where it names none); a number's include integer."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else None
    return None if kinds is None else kinds | ({"integer"} if "number" in kinds else set())


def _type_holds(schema: dict, over: str) -> bool:
    """Whether a `type` beside anyOf/oneOf/allOf says nothing the branches do not: each branch's own type is within
    it ({"type": "object", "oneOf": [{"type": "object", ...}, ...]}, as OpenAPI writes), so xgrammar writing the
    branches alone loses nothing."""
    outer, branches = _types(schema), schema.get(over)
    if outer is None or over == "$ref" or not isinstance(branches, list) or not branches:
        return False
    return all((inner := _types(b)) is not None and inner <= outer for b in branches)


def _unenforced(schema, path: str, root=None) -> tuple[str, str | None] | None:
    """(the JSON pointer of the first keyword of `schema` xgrammar does not enforce, why: the keyword beside it that
    makes xgrammar ignore it, "lookahead", "ref " and the $ref's JSON, "overlap I J" (two oneOf branches one value
    may match), or None), or None. `root`: the whole schema, which $refs point into (default: `schema`)."""
    root = schema if root is None else root
    if isinstance(schema, list):
        return next((found for i, sub in enumerate(schema) if (found := _unenforced(sub, f"{path}/{i}", root))), None)
    if not isinstance(schema, dict):
        return None
    ignored = _ignored_beside(schema)
    if ignored:
        return f"{path}/{ignored[0]}", ignored[1]
    if isinstance(schema.get("pattern"), str) and _lookahead(schema["pattern"]):
        return f"{path}/pattern", "lookahead"
    names = schema.get("patternProperties")
    found = next((name for name in names if _lookahead(name)), None) if isinstance(names, dict) else None
    if found is not None:
        return f"{path}/patternProperties/{found}", "lookahead"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):  # xgrammar allowed any JSON in its place
        return f"{path}/$ref", "ref " + json.dumps(ref)
    empty = next((k for k in ("anyOf", "oneOf", "type") if schema.get(k) == []), None)
    if empty:  # xgrammar wrote nothing in its place: {"anyOf": []} was answered "" and an item of one "[,]"
        return f"{path}/{empty}", "empty"
    fixed = _beside_values(schema)
    if fixed:
        return f"{path}/{fixed[0]}", fixed[1]
    over = next((k for k in _ALONE if k in schema), None)
    beside = next((k for k in schema if k != over and k not in _ANNOTATIONS
                   and not (k == "type" and _type_holds(schema, over))), None) if over else None
    if beside is not None:
        return f"{path}/{beside}", over
    pair = overlapping(schema["oneOf"], root) if isinstance(schema.get("oneOf"), list) else None
    if pair is not None:  # xgrammar writes oneOf as anyOf: a value that matches both branches could be produced
        return f"{path}/oneOf", "overlap large" if pair == "large" else f"overlap {pair[0]} {pair[1]}"
    mult, kind = schema.get("multipleOf"), schema.get("type")
    kinds = set(kind) - {"null"} if isinstance(kind, list) else {kind}
    if mult is not None and (kinds != {"integer"} or not isinstance(mult, int) or isinstance(mult, bool)):
        return f"{path}/multipleOf", "multiple"
    bound = next((k for k in _BOUNDS if k in schema), None) if mult not in (None, 1) else None
    if bound is not None and _multiple_ignored(schema):
        return f"{path}/multipleOf", "range " + bound
    required, names = schema.get("required"), schema.get("properties")
    missing = [n for n in required if not isinstance(names, dict) or n not in names] \
        if isinstance(required, list) else []
    if missing:
        return f"{path}/required", "required " + json.dumps(missing[0])
    found = _names_unenforced(schema, path)
    if found:
        return found
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in _UNENFORCED and _UNENFORCED[key](value):
            return f"{path}/{key}", None
        subs = value.items() if key in _SCHEMA_MAPS and isinstance(value, dict) else [("", value)]
        for name, sub in subs:
            found = _unenforced(sub, f"{path}/{key}" + (f"/{name}" if name else ""), root) \
                if isinstance(sub, (dict, list)) else None
            if found:
                return found
    return None


def _name_holds(name: str, names: dict) -> bool:
    """Whether a property name surely meets a propertyNames schema (its type, length, pattern, enum, const)."""
    return all(k in _ANNOTATIONS or (k == "const" and v == name) or (k != "const" and _value_holds(name, k, v))
               for k, v in names.items())


def _names_unenforced(schema: dict, path: str) -> tuple[str, str] | None:
    """(where, why) xgrammar (0.2.9) would not hold an object's property names to its propertyNames: beside
    patternProperties (with properties and additionalProperties it ignored propertyNames: {"A1": null} passed
    "^[a-z]+$"), or at a name of `properties` that propertyNames rejects (which xgrammar allowed all the same)."""
    names = schema.get("propertyNames")
    if not isinstance(names, dict) or not set(names) - _ANNOTATIONS:
        return None
    if schema.get("patternProperties"):
        return f"{path}/propertyNames", "patternProperties"
    props = schema.get("properties")
    bad = next((n for n in props if not _name_holds(n, names)), None) if isinstance(props, dict) else None
    return (f"{path}/properties/{bad}", "names " + json.dumps(bad)) if bad is not None else None


@functools.lru_cache(maxsize=256)
def _check_enforced(schema: str) -> None:
    """RequestError naming a keyword of the schema (JSON text) that xgrammar would leave unenforced: the reply would
    not be held to it (allOf [integer, minimum 3] took "s"), so the request is refused, as vLLM refuses uniqueItems
    and contains, rather than answered with JSON the schema rejects."""
    deadline = _PATTERN_DEADLINE.set(time.monotonic() + PATTERN_CHECK_S)  # (every pattern check of the schema)
    try:
        found = _unenforced(json.loads(schema), "#")
    except RecursionError:  # deeper than Python reads: xgrammar's own limits decide
        return
    except TypeError:  # a keyword of the wrong kind ({"type": {...}}, {"format": [...]}): xgrammar's checks name it
        return
    finally:
        _PATTERN_DEADLINE.reset(deadline)
    if found:
        found, beside = found
        keyword = found.rsplit("/", 1)[1]
        beside = beside or ""
        if beside == "multiple":
            raise RequestError(f"structured_outputs.json uses multipleOf at {found}, which xgrammar enforces only "
                               "as a whole number on an integer schema: a reply could break it",
                               "remove multipleOf from the schema (and check it in the reply)")
        if beside == "empty":
            raise RequestError(f"structured_outputs.json has an empty {keyword} at {found}: no JSON value matches it "
                               "(xgrammar would write nothing there, which is not JSON)",
                               f"give {keyword} at least one {'type' if keyword == 'type' else 'schema'}, or drop it")
        if beside.startswith("range "):
            raise RequestError(f"structured_outputs.json uses multipleOf at {found} beside {beside[6:]}, which "
                               "xgrammar does not enforce together (it keeps the range and ignores multipleOf): a "
                               "reply could break it", f"bound the range on both sides, to at most {XGRAMMAR_RANGE} "
                               f"integers or {MAX_MULTIPLES} multiples (which are enforced), or keep one of "
                               "multipleOf and the range")
        if beside == "patternProperties":
            raise RequestError(f"structured_outputs.json uses propertyNames at {found} beside patternProperties, "
                               "which xgrammar does not enforce together (a reply's property names could break "
                               "propertyNames)", "keep one of propertyNames and patternProperties (and check the "
                               "other in the reply)")
        if beside.startswith("names "):
            raise RequestError(f"structured_outputs.json has the property {beside[6:]} at {found}, whose name its "
                               "object's propertyNames does not surely allow: xgrammar lets a reply hold it all "
                               "the same", "drop that property, or make propertyNames allow its name")
        if beside.startswith("required "):
            raise RequestError(f"structured_outputs.json requires {beside[9:]} at {found}, which is not in that "
                               "schema's properties: xgrammar does not enforce such a name",
                               "give each required name a schema under the same properties")
        if beside in ("enum", "const"):
            raise RequestError(f"structured_outputs.json uses {keyword} at {found} beside {beside}, which xgrammar "
                               f"ignores there (it allows every value of {beside}): a reply could break it",
                               f"give {beside} only values that meet {keyword}, and drop {keyword}")
        if beside in _ALONE:
            raise RequestError(f"structured_outputs.json uses {keyword} at {found} beside {beside}, which xgrammar "
                               f"ignores there (it writes {beside} alone): a reply could break it",
                               f"move {keyword} into the schemas of {beside} (or drop it and check it in the reply)")
        if beside == "lookahead":
            raise RequestError(f"structured_outputs.json has a pattern with a lookahead ((?=...) or (?!...)) at "
                               f"{found}, which xgrammar ignores: a reply could break it",
                               "write the pattern without the lookahead (and check it in the reply)")
        if beside == "overlap large":
            raise RequestError(f"structured_outputs.json has a oneOf at {found} too large to prove its schemas "
                               f"exclusive: xgrammar enforces oneOf as anyOf, so a reply could match two of them, "
                               "which oneOf rejects", "use anyOf if a value may match several of them, or tell them "
                               "apart by a const in each (of the value, or of a property they all require)")
        if beside.startswith("overlap "):
            first, second = beside.split()[1:]
            raise RequestError(f"structured_outputs.json has a oneOf at {found} whose schemas {first} and {second} "
                               "one value may both match: xgrammar enforces oneOf as anyOf, so a reply could match "
                               "both, which oneOf rejects", "use anyOf if a value may match several of them, or make "
                               "them exclusive (different types, or a property each requires with a different const)")
        if beside.startswith("ref "):
            raise RequestError(f"structured_outputs.json has a $ref that is not a JSON pointer into the schema at "
                               f"{found} ({beside[4:]}), which xgrammar does not resolve (any JSON would pass)",
                               'put what it points to under $defs and refer to it as "#/$defs/NAME"')
        if beside:
            raise RequestError(f"structured_outputs.json uses {keyword} at {found} beside {beside}, which xgrammar "
                               f"does not enforce together (it keeps {beside} and ignores {keyword}): a reply could "
                               "break it", f"keep one of {keyword} and {beside} in that string's schema (and check "
                               "the other in the reply)")
        raise RequestError(f"structured_outputs.json uses {keyword} at {found}, which xgrammar does not enforce: "
                           "a reply could break it", f"remove {keyword} from the schema (and check it in the reply)")


# formats whose grammar in xgrammar (0.2.9) takes strings the format does not: a date took any day 01-31 in any
# month ("2023-02-31", "2023-04-31") and year 0000, an ipv4 address octets with leading zeros ("07.22.091.30",
# which JSON Schema's test suite, Python's ipaddress and pydantic refuse); each as the pattern that holds the reply
# to it (Feb 29 in leap years only, Python's years 0001-9999)
_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+){0,1}(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9][0-9]|[0-9])"
_FORMAT_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}T{_TIME}$",
                    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$"}


def _optional_groups_fixed(pattern: str) -> str:
    """`pattern` with each optional group, (...)?, written (...){0,1}. xgrammar (0.2.9) builds a schema pattern's
    automaton with a wrong skip for an optional group that ends in a repetition: "^b(x[0-9]+)?$" took "b5" and
    "^[0-9]+(\\.[0-9]+)?$" took "12" as "1" and "2" without the dot; {0,1} is built right (its regex kind is too)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":  # ECMA-262's class, as JSON Schema's: "[]" is empty, a first ] ends it
            in_class = True
        elif char == ")" and pattern.startswith("?", i + 1):
            out.append("){0,1}")
            i += 3 if pattern.startswith("??", i + 1) else 2  # lazy or not: the same strings
            continue
        out.append(char)
        i += 1
    return "".join(out)


_SURROGATES = "\\ud800-\\udfff"


def _surrogates_excluded(pattern: str) -> str:
    """`pattern` with its `.`, \\S, \\W, \\D and each negated class, [^...], not taking a UTF-16 surrogate.
    xgrammar's matcher (0.2.9) decodes the bytes ED A0-BF 80-BF (not UTF-8) as one, so regex "a.b" took "a", those
    3 bytes and "b", whose text is "a" 3 U+FFFD "b", which the regex does not match."""
    out, i, negated = [], 0, None  # negated: inside a class, whether it is [^...]
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            escape = pattern[i + 1:i + 2]
            out.append(f"[^\\{escape.lower()}{_SURROGATES}]" if negated is None and escape in "SWD" and escape
                       else pattern[i:i + 2])
            i += 2
            continue
        if negated is not None:
            if char == "]":
                if negated and out[-1] == "-":  # a class's last "-" is itself ([^a-]): the range goes before it, not
                    out.insert(len(out) - 1, _SURROGATES)  # after ("[^a-\\ud800-...]" ranged from a)
                    out.append("]")
                else:
                    out.append(_SURROGATES + "]" if negated else "]")
                negated = None
            else:
                out.append(char)
        elif char == "[":  # ECMA-262's class, as JSON Schema's: "[]" is empty, a first ] ends it
            negated = pattern.startswith("^", i + 1)
            out.append(pattern[i:i + 1 + negated])
            i += negated
        elif char == ".":
            out.append(f"[^{_SURROGATES}]")
        else:
            out.append(char)
        i += 1
    return "".join(out)


# the keywords of each JSON type: xgrammar (0.2.9) ignores a number's, a string's or an array's in a schema without a
# type ({"minimum": 5} took 3, {"maxLength": 1} "abc", {"maxItems": 1} [1, 2]), so such a schema gets those types
_TYPE_KEYWORDS = {"number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
                  "string": ("minLength", "maxLength", "pattern", "format"),
                  "array": ("minItems", "maxItems", "items", "prefixItems"),
                  "object": ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                             "minProperties", "maxProperties")}
_OPEN_OBJECT = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "propertyNames")
_TYPED_ELSEWHERE = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not")


def _implied_types(schema: dict) -> list[str]:
    """The types whose keywords a schema without a type (or values, or branches) has, when one is a number's or a
    string's or it bounds a count of items or properties (xgrammar types those with properties or items itself, and
    ignores the others); else []."""
    if any(k in schema for k in _TYPED_ELSEWHERE):
        return []
    kinds = [kind for kind, words in _TYPE_KEYWORDS.items()
             if any(w in schema and (w != "format" or isinstance(schema[w], str) and schema[w] in _FORMATS)
                    for w in words)]
    bounded = {"minItems", "maxItems", "minProperties", "maxProperties"} & set(schema)
    return kinds if set(kinds) & {"number", "string"} or bounded else []


def _for_xgrammar(schema):
    """`schema` with each string's format in _FORMAT_PATTERNS (and no pattern of its own) as that pattern, its
    patterns' optional groups as xgrammar builds them right (_optional_groups_fixed), a schema without a type given
    the types its keywords imply (_implied_types), an integer's multiples in a range as their enum, and any items
    (properties) for an array (object) whose count of them is bounded and nothing else says what they are."""
    if isinstance(schema, list):
        return [_for_xgrammar(sub) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {_optional_groups_fixed(name): _for_xgrammar(sub) for name, sub in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _for_xgrammar(sub) for name, sub in value.items()}
        elif key == "pattern" and isinstance(value, str):
            out[key] = _optional_groups_fixed(value)
        else:
            out[key] = _for_xgrammar(value)
    implied = _implied_types(out)
    if implied:
        out["type"] = implied[0] if len(implied) == 1 else implied
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "array" in kinds and ("minItems" in out or "maxItems" in out) and not {"items", "prefixItems"} & set(out):
        out["items"] = True  # xgrammar took a count of items with no schema for them as no items at all
    if "object" in kinds and ("minProperties" in out or "maxProperties" in out) \
            and not set(_OPEN_OBJECT) & set(out):
        out["additionalProperties"] = True  # as an array's items: {"maxProperties": 2} took only {}
    values = _multiples(out) if isinstance(out.get("multipleOf"), int) else None
    if values:
        kind = out["type"]
        out = {k: v for k, v in out.items() if k not in _BOUNDS and k not in ("multipleOf", "type")}
        out["enum"] = values + ([None] if isinstance(kind, list) and "null" in kind else [])
        return out
    kind = out.get("type", "string")
    if "string" in (kind if isinstance(kind, list) else [kind]) and isinstance(out.get("format"), str) \
            and out["format"] in _FORMAT_PATTERNS and "pattern" not in out:
        out["pattern"] = _FORMAT_PATTERNS[out.pop("format")]
    return out


# what _for_xgrammar may rewrite: a schema's text without any of these is compiled as it is
_SPOTS = ("pattern", "patternProperties", "multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
          "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "format",
          *_FORMAT_PATTERNS)


@functools.lru_cache(maxsize=256)
def _for_xgrammar_text(schema: str) -> str:
    """The schema (JSON text) as _for_xgrammar writes it, or itself when it has nothing _for_xgrammar rewrites."""
    if not any(f'"{name}"' in schema for name in _SPOTS):
        return schema
    try:
        return json.dumps(_for_xgrammar(json.loads(schema)))
    except (RecursionError, TypeError):  # deeper than Python reads, or malformed: xgrammar's own checks decide
        return schema


@functools.lru_cache(maxsize=256)
def _json_control_fixed(schema: str, any_whitespace: bool) -> str | None:
    """The EBNF of xgrammar's grammar of `schema` with JSON's string characters in place of _RAW_CONTROL, or None
    when it has none. xgrammar writes a string with minLength or maxLength (a property name with them too) with a
    set that lets U+0000-U+001F other than CR and LF (a tab, U+0002) into the reply as they are, and json.loads (a
    client's SDK) refuses such a reply; its other strings take JSON's set."""
    text = str(_xgrammar().Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return text.replace(_RAW_CONTROL, _JSON_CHAR) if _RAW_CONTROL in text else None


def _reason(e: Exception) -> str:
    """xgrammar's error without its C++ source location."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _XGRAMMAR_PREFIX.sub("", lines[0] if lines else type(e).__name__).strip()


class GrammarBackend:
    """The engine's xgrammar compiler, made on the first request that needs it (it reads the whole vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                try:
                    info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                              stop_token_ids=self.stop_token_ids or None)
                except Exception as e:  # noqa: BLE001 - xgrammar's reasons come as several exception types
                    raise RequestError(f"structured outputs cannot read this model's tokenizer: {_reason(e)}",
                                       "send the request without a constraint") from None
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled constraint (cached by xgrammar); RequestError naming the field when it does not compile."""
        compiler, kind = self.compiler(), spec.kind
        if kind == "json":
            _check_enforced(spec._text)
        grammar = (lark_to_ebnf(spec.grammar) if _is_lark(spec.grammar) else spec.grammar) if kind == "grammar" else ""
        try:
            if kind == "json":
                return self._compile_json(compiler, spec._text, not spec.disable_any_whitespace)
            if kind == "json_object":
                if spec.disable_any_whitespace:
                    return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                return compiler.compile_json_schema('{"type": "object"}')
            if kind == "regex":
                try:
                    return compiler.compile_regex(_surrogates_excluded(spec.regex))
                except (RuntimeError, ValueError, TypeError):  # the regex's own reason (a position in it as sent), or
                    return compiler.compile_regex(spec.regex)  # one the rewrite could not keep, run as it was sent
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors are RuntimeErrors; its FFI's may not be
            raise RequestError(f"the structured output's {_WHAT[kind]} does not compile: {_reason(e)}",
                               "fix it, or send the request without it") from None

    @staticmethod
    def _compile_json(compiler, schema: str, any_whitespace: bool):
        """xgrammar's grammar of a JSON schema, less its one way to write raw control characters (_RAW_CONTROL)."""
        schema = _for_xgrammar_text(schema)
        text = _json_control_fixed(schema, any_whitespace)
        if text is None:
            return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        return compiler.compile_grammar(text)

    def matcher(self, spec: StructuredOutputsParams, forced: list[int] = ()):
        """A new request's matcher, past its forced first reply tokens (RequestError if the grammar refuses them)."""
        matcher = _xgrammar().GrammarMatcher(self.compile(spec))
        for i, token in enumerate(forced):
            if not matcher.accept_token(token):
                raise RequestError(f"prefix_token_ids[{i}] ({token}) does not follow structured_outputs."
                                   f"{spec.kind}", "force a prefix the constraint allows, or none")
            if matcher.is_terminated():  # an EOS the constraint accepted: its matcher has no next token to allow,
                # and filling its row would fail the whole step (every request in it) in xgrammar
                raise RequestError(f"prefix_token_ids[{i}] ({token}) ends structured_outputs.{spec.kind} (an EOS "
                                   "token): nothing could be sampled after it", "leave EOS out of the prefix")
        if not allows_any(matcher, self.vocab_size):  # refused here, not as 'token 0 does not follow' a step later
            raise RequestError(f"structured_outputs.{spec.kind} allows no token"
                               + (" after prefix_token_ids" if forced else "") + ": nothing can match it",
                               DEAD_HINT)
        return matcher


BATCH_FILL_ROWS = 4  # from this many rows on, xgrammar's own threads (outside the GIL) may fill them
PROBES = 4  # fills of each way, per thread and vocabulary size, before the faster one is kept
REPROBE = 512  # then the other way once every this many fills, in case the host's load has changed
_fillers = threading.local()  # per thread that steps an engine: one BatchGrammarMatcher, one _FillChoice per vocab


class _FillChoice:
    """Which way fills a step's rows faster on this host: xgrammar's threads (`BatchGrammarMatcher`) or one row
    after another on the calling thread. Measured, not assumed: on a 2-core machine the batch call wins by about
    30% (5.4 against 7.6 us per row, 64 rows of 32,000 tokens), while on a 16-core H100 host its pool lost 7x
    (37 against 5.1 us per row: waking its threads cost more than the rows). Each way's last PROBES times per row
    decide; the bits are the same either way."""

    def __init__(self):
        self.times: dict[bool, collections.deque] = {w: collections.deque(maxlen=PROBES) for w in (True, False)}
        self.fills = 0

    def threads(self) -> bool:
        together, alone = self.times[True], self.times[False]
        if len(together) < PROBES or len(alone) < PROBES:
            return len(together) <= len(alone)
        self.fills += 1
        faster = sorted(together)[PROBES // 2] <= sorted(alone)[PROBES // 2]
        return faster != (self.fills % REPROBE == 0)

    def record(self, threads: bool, seconds: float, rows: int) -> None:
        self.times[threads].append(seconds / rows)


def fill_bitmask(matchers: list, vocab: int, threads: bool | None = None) -> torch.Tensor:
    """[len(matchers), ceil(vocab / 32)] int32 on the host: bit t of row i set when matchers[i] allows token t.
    threads: fill on xgrammar's threads (True) or one row after another (False); None: from BATCH_FILL_ROWS rows
    on, whichever this thread has measured faster (`_FillChoice`)."""
    words = -(-vocab // 32)
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    choice = None
    if threads is None and len(matchers) >= BATCH_FILL_ROWS:
        choices = _fillers.__dict__.setdefault("choices", {})
        choice = choices.get(vocab) or choices.setdefault(vocab, _FillChoice())
        threads = choice.threads()
    t0 = time.perf_counter()
    if threads:
        filler = getattr(_fillers, "batch", None)
        if filler is None:
            filler = _fillers.batch = _xgrammar().BatchGrammarMatcher()
        filler.batch_fill_next_token_bitmask(matchers, bitmask)
    else:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
    if choice is not None:
        choice.record(bool(threads), time.perf_counter() - t0, len(matchers))
    return bitmask


def draft_bitmask(matcher, drafts: list[int], vocab: int) -> tuple[list[int], torch.Tensor]:
    """Speculative decoding: (the longest prefix of `drafts` the matcher accepts, token by token, without ending,
    the bitmask [len(kept) + 1, ceil(vocab / 32)] int32 of its verify rows: row j the tokens the matcher allows after
    kept[:j]). Cut at the first draft it refuses (never verified, as vLLM's validate_tokens) and before one that
    ends it (an EOS: nothing is allowed after it). The matcher is rolled back to where it was."""
    bitmask = torch.full((len(drafts) + 1, -(-vocab // 32)), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    kept = 0
    try:
        for t in drafts:
            if not matcher.accept_token(t):
                break
            if matcher.is_terminated():
                matcher.rollback(1)
                break
            kept += 1
            matcher.fill_next_token_bitmask(bitmask, kept)
    finally:
        if kept:
            matcher.rollback(kept)
    return list(drafts[:kept]), bitmask[:kept + 1]


def allows_any(matcher, vocab: int) -> bool:
    """Whether `matcher` allows some token of the vocabulary next. xgrammar compiles a grammar no text can match
    (or can complete from here): its matcher then allows nothing, and a step samples a token it refuses."""
    row = fill_bitmask([matcher], vocab)
    return bool(apply_bitmask(torch.zeros(1, vocab), None, row).isfinite().any())
