"""Whether two branches of a JSON schema's oneOf surely match no common value.

xgrammar (and so vLLM) writes oneOf as anyOf: a value that matches two branches can be produced, and oneOf rejects
it. `overlapping(branches, root)` names the first two branches no check here proves disjoint, so that such a schema
is refused rather than answered with JSON it rejects. The proof is conservative: different types, different
const/enum values, numeric ranges that do not meet, or an object property both require whose schemas are disjoint
(a discriminated union, as pydantic writes), or one requires that the other forbids (additionalProperties false,
or absent: xgrammar's strict mode writes an object with only its schema's properties, so the values it produces for
one branch cannot have a name only the other declares).
"""

from __future__ import annotations

import itertools

_KINDS = {bool: "boolean", type(None): "null", str: "string", list: "array", dict: "object"}
_DEPTH = 32  # $refs and nested branches followed at most this deep (a recursive schema: not proven)
CHECKS = 10_000  # schema pairs one oneOf's proof may compare (its branches' and their nested ones); past it: not proven


def overlapping(branches: list, root) -> tuple[int, int] | str | None:
    """(i, j) of the first two branches that may both match a value; "large" when the proof ran past CHECKS
    comparisons first; None when every pair is disjoint. Many branches told apart by their const/enum values (or
    those of a property every branch requires) are proven at once, not pair by pair."""
    if _apart_by_values(branches, root):
        return None
    budget = [CHECKS]
    for i, j in itertools.combinations(range(len(branches)), 2):
        if not disjoint(branches[i], branches[j], root, 0, budget):
            return (i, j) if budget[0] >= 0 else "large"
    return None


def disjoint(a, b, root, depth: int = 0, budget: list | None = None) -> bool:
    """Whether no JSON value matches both schemas `a` and `b` (False: not proven). `budget`: [comparisons left]."""
    if budget is not None:
        budget[0] -= 1
    if depth > _DEPTH or (budget is not None and budget[0] < 0):
        return False
    a, b = _resolve(a, root, depth), _resolve(b, root, depth)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    for one, other in ((a, b), (b, a)):
        for key in ("anyOf", "oneOf"):  # a union is disjoint from a schema when each of its branches is
            subs = one.get(key)
            if isinstance(subs, list) and subs and all(disjoint(s, other, root, depth + 1, budget) for s in subs):
                return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None:
        return not {_key(v) for v in values_a} & {_key(v) for v in values_b}
    for values, other in ((values_a, b), (values_b, a)):
        kinds = _types(other)
        if values is not None and kinds is not None and not any(_kind(v) in kinds for v in values):
            return True
    kinds_a, kinds_b = _types(a), _types(b)
    if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
        return True
    return _ranges_apart(a, b) or _objects_apart(a, b, root, depth, budget)


def _apart_by_values(branches: list, root) -> bool:
    """Whether the branches are told apart by their const/enum values (no value in two of them), or all require one
    property whose const/enum values tell them apart so (a discriminated union)."""
    resolved = [_resolve(b, root, 0) for b in branches]
    if not resolved or not all(isinstance(b, dict) for b in resolved):
        return False

    def distinct(value_sets) -> bool:
        seen: set = set()
        for values in value_sets:
            if values is None:
                return False
            keys = {_key(v) for v in values}
            if keys & seen:
                return False
            seen |= keys
        return True

    if distinct(_values(b) for b in resolved):
        return True
    first = resolved[0].get("required")
    for name in first if isinstance(first, list) else []:
        props = [b.get("properties") for b in resolved]
        if isinstance(name, str) and all(isinstance(b.get("required"), list) and name in b["required"]
                                         and isinstance(p, dict) and isinstance(_resolve(p.get(name), root, 0), dict)
                                         for b, p in zip(resolved, props)):
            if distinct(_values(_resolve(p[name], root, 0)) for p in props):
                return True
    return False


def _resolve(schema, root, depth: int):
    """The schema a local "$ref": "#/..." (alone beside annotations) points to, followed; else `schema`."""
    for _ in range(_DEPTH - depth):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return schema
        target = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return schema
        schema = target
    return schema


def _values(schema: dict) -> list | None:
    """The values a schema's const or enum allows, or None."""
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def _kind(value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "integer" if isinstance(value, int) or value.is_integer() else "number"
    return _KINDS.get(type(value), "?")


def _key(value):
    """A hashable key equal for JSON-equal values: 1 and 1.0 are one number, true is not 1."""
    if isinstance(value, bool) or value is None:
        return "b", value
    if isinstance(value, (int, float)):
        return "n", value
    if isinstance(value, list):
        return "l", tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return "d", frozenset((k, _key(v)) for k, v in value.items())
    return "s", value


def _types(schema: dict) -> set | None:
    """The JSON types a schema's `type` allows (a number's include integer), or None where it names none."""
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else None
    if kinds is None or not all(isinstance(k, str) for k in kinds):
        return None
    return kinds | ({"integer"} if "number" in kinds else set())


def _bounds(schema: dict) -> tuple[float, bool, float, bool]:
    """(low, low is exclusive, high, high is exclusive) of a schema's numeric bounds."""
    low, low_open, high, high_open = float("-inf"), False, float("inf"), False
    for key, is_low, is_open in (("minimum", True, False), ("exclusiveMinimum", True, True),
                                 ("maximum", False, False), ("exclusiveMaximum", False, True)):
        value = schema.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if is_low and (value > low or value == low and is_open):
            low, low_open = value, is_open
        elif not is_low and (value < high or value == high and is_open):
            high, high_open = value, is_open
    return low, low_open, high, high_open


def _ranges_apart(a: dict, b: dict) -> bool:
    """Whether two schemas that allow numbers only have ranges that do not meet."""
    if not all((kinds := _types(s)) is not None and kinds <= {"integer", "number"} for s in (a, b)):
        return False
    (low_a, open_low_a, high_a, open_high_a), (low_b, open_low_b, high_b, open_high_b) = _bounds(a), _bounds(b)
    return (high_a < low_b or high_a == low_b and (open_high_a or open_low_b)
            or high_b < low_a or high_b == low_a and (open_high_b or open_low_a))


def _objects_apart(a: dict, b: dict, root, depth: int, budget: list | None) -> bool:
    """Whether two schemas that allow objects only surely match no common object: a property both require with
    disjoint schemas, or one that one requires and the other forbids."""
    if not all(_types(s) in ({"object"}, None) and (_types(s) or "properties" in s) for s in (a, b)):
        return False
    for one, other in ((a, b), (b, a)):
        required = one.get("required") if isinstance(one.get("required"), list) else []
        props = one.get("properties") if isinstance(one.get("properties"), dict) else {}
        other_props = other.get("properties") if isinstance(other.get("properties"), dict) else {}
        for name in required:
            if not isinstance(name, str):
                continue
            if name in props and name in other_props \
                    and disjoint(props[name], other_props[name], root, depth + 1, budget):
                return True
            if name not in other_props and _closed(other, False):
                return True
    return _escapes(a, b) and _escapes(b, a)


def _closed(schema: dict, produced: bool) -> bool:
    """Whether an object matching `schema` has only its properties: the schema says so, or (`produced`) xgrammar
    writes it so (its strict mode: additionalProperties and unevaluatedProperties absent are false)."""
    return all(schema.get(key, False if produced else True) is False
               for key in ("additionalProperties", "unevaluatedProperties")) and not schema.get("patternProperties")


def _escapes(one: dict, other: dict) -> bool:
    """Whether no object xgrammar produces for `one` matches `other`: `one`'s objects have only its properties,
    and `other` requires a name that is not one of them."""
    props = one.get("properties") if isinstance(one.get("properties"), dict) else {}
    required = other.get("required") if isinstance(other.get("required"), list) else []
    return _closed(one, True) and any(isinstance(name, str) and name not in props for name in required)
