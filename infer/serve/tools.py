"""Tool calls on the chat endpoint, as vLLM answers them without a model-specific parser: `tools` reach the chat
template (transformers' `apply_chat_template(tools=...)`), and a `tool_choice` that names a function, or is
"required", constrains the reply with a JSON schema (structured outputs), so that it is always a call that parses:
- a named function: the reply is that function's arguments (its `parameters` schema);
- "required": the reply is a JSON list of one or more {"name", "parameters"} objects, each one of the tools (one
  only with parallel_tool_calls: false).
The message then carries OpenAI's `tool_calls` (content null) and finish_reason "tool_calls". "none" renders the
tools and lets the model write text. "auto" (the default when tools are given) lets the model choose, and reads its
calls out of the text with the parser of its family's syntax, named at the server's start as vLLM names it
(`--enable-auto-tool-choice --tool-call-parser P`): hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes 2 Pro and later, Qwen2.5, QwQ), or llama3_json, a reply that is `{"name": ..., "parameters": {...}}` objects
separated by "; ", after an optional `<|python_tag|>` (Llama 3.1-3.3 JSON tool calling), pythonic, a reply that is a
Python list of calls with literal keyword arguments, `[get_weather(city="Paris"), add(a=1, b=2)]`, possibly between
`<|python_start|>` and `<|python_end|>` (Llama 3.2, Llama 4, ToolACE), or mistral, text then `[TOOL_CALLS]` and a JSON
list of {"name", "arguments"} objects (Mistral 7B v0.3, Mistral Nemo), or `[TOOL_CALLS]name[ARGS]{...}` per call
(newer Mistral tokenizers; `name{...}` too), or qwen3_coder, `<tool_call><function=NAME><parameter=KEY>VALUE
</parameter>...</function></tool_call>` (Qwen3-Coder), or seed_oss, the same function and parameter tags inside
`<seed:tool_call>...</seed:tool_call>` (ByteDance Seed-OSS), both of whose values are typed by the function's JSON
schema as vLLM types them, or openai, gpt-oss's harmony messages, a call being a commentary message addressed
`to=functions.NAME` whose text is the JSON arguments (ended by <|call|>), the content the final channel's text
(and a commentary preamble's), or granite, `<|tool_call|>[{"name": ..., "arguments": {...}}]` (Granite 3.x; the tag
may be written "<tool_call>"), or glm45, `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...
</tool_call>` (GLM-4.5/4.6/4.7), its values typed by the schema, or olmo3, `<function_calls>` then a Python call a
line, `name(key=value)`, then `</function_calls>` (Olmo 3), or ernie45, hermes' blocks as ERNIE 4.5 writes them
(only ended blocks are calls; the content's last newlines dropped), or phi4_mini_json, `functools[{"name": ...,
"arguments": {...}}]` (Phi-4-mini), or deepseek_v3, deepseek_v31 and kimi_k2, a section of calls after
`<｜tool▁calls▁begin｜>` (`<|tool_calls_section_begin|>`), each between its begin and end tokens: DeepSeek-V3's and
R1's `function<｜tool▁sep｜>NAME` then its JSON arguments in a ```json block, V3.1's `NAME<｜tool▁sep｜>{...}`,
Kimi-K2's `functions.NAME:IDX<|tool_call_argument_begin|>{...}`, whose id is the call's, or internlm,
`<|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>` (InternLM2/2.5, one call), or xlam, a JSON
list of {"name", "arguments"} objects, the whole reply or in a ```json block, a <tool_call> or after </think> (xLAM),
or hunyuan_a13b, such a list in `<tool_calls>...</tool_calls>` outside a think block (Hunyuan-A13B), or minimax_m2,
`<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke></minimax:tool_call>`
(MiniMax-M2), its values typed by the parameter's schema type as vLLM types them.
Without a parser "auto" is refused with what to send instead, rather than
answered with text the client would take for "no call".
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError
from .reasoning import harmony_channel, harmony_read


def _error(name: str, message: str, hint: str | None = None) -> RequestError:
    e = RequestError(message, hint)
    e.field = name  # the request field it is about (the server's error `param`)
    return e


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # as sent: what the chat template renders
    mode: str  # "none", "named", "required" or "auto"
    name: str | None = None  # the named function; with "auto", the parser (a key of PARSERS)
    schema: dict | None = None  # the reply's JSON schema (named, required)
    # parallel_tool_calls: false: "auto" keeps only the first call the model writes (vLLM's
    # maybe_filter_parallel_tool_calls, OpenAI's "at most one"); "required" has it in its schema (maxItems 1)
    parallel: bool = True
    # the server's --tool-call-parser, whatever the mode: a forced call's id takes the form its family's chat template
    # takes back (mistral: 9 letters and digits), as "auto"'s calls do
    parser: str | None = None
    # the calls of the conversation's assistant messages: kimi_k2's forced calls are numbered on from them
    # (`functions.NAME:IDX`, the ids its template takes back, as vLLM numbers them)
    history: int = 0


NAMED_HINT = 'e.g. "tool_choice": {"type": "function", "function": {"name": "get_weather"}}'


def _functions(tools: Any) -> dict[str, dict]:
    """{name: parameters schema} of `tools`, checked."""
    if not isinstance(tools, list) or not tools:
        raise _error("tools", "tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _error("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                  f"\"parameters\": {{...}}}}}}")
        name, params = fn.get("name"), fn.get("parameters")
        if params is None:  # absent or null: a function without parameters (OpenAI's SDK and vLLM accept both)
            params = {"type": "object", "properties": {}}
        if not isinstance(name, str) or not name:
            raise _error("tools", f"tools[{i}].function.name must be a non-empty string")
        if name in out:
            raise _error("tools", f"tools[{i}]: a second function named {name!r}", "give each function its own name")
        if not isinstance(params, dict):
            raise _error("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        # a call's arguments are a JSON object (OpenAI's); a schema that says no type ({} among them: "any
        # parameters") would let a constrained reply be a number or `true`, which no client can call with; a root
        # `$ref` (pydantic's schema of a recursive model) has its type where it points, and xgrammar writes a $ref
        # alone: a type beside it would be ignored, and is refused (structured outputs' check)
        out[name] = params if "type" in params or "$ref" in params else {**params, "type": "object"}
    return out


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA_START = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
MISTRAL_START, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _lift_defs(functions: dict[str, dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(functions, {"$defs": ...}) for "required", whose schema nests each parameters schema under
    items.properties.parameters: a `$ref` such as "#/$defs/Unit" (what pydantic writes for an enum or a nested model,
    openai.pydantic_function_tool's tools among them) points at the root of the whole schema, so each function's
    $defs (or draft-4 definitions) move there, as vLLM does. The tools the template renders are left as sent."""
    out, defs = {}, {}
    for name, params in functions.items():
        params = dict(params)
        for key in ("$defs", "definitions"):
            if not isinstance(params.get(key), dict):
                continue
            for def_name, value in params.pop(key).items():
                if defs.setdefault(key, {}).setdefault(def_name, value) != value:
                    raise _error("tools", f"two functions define {key}/{def_name} differently: tool_choice "
                                 "\"required\" puts their definitions in one schema",
                                 "give the definitions distinct names")
        key = f"tool_{name}_parameters"
        moved = _rebase_refs(params, f"#/$defs/{key}")
        if moved is not params:  # a $ref into the parameters themselves ("#": a tree of nodes) would point at the
            # root of the whole schema, a list of calls: the parameters move to $defs, where their refs now point
            if defs.setdefault("$defs", {}).setdefault(key, moved) is not moved:
                raise _error("tools", f"a definition is named {key}, which tool_choice \"required\" needs for "
                             f"{name}'s parameters", "rename the definition")
            params = {"$ref": f"#/$defs/{key}"}
        out[name] = params
    return out, defs


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with each $ref into its own root ("#", "#/properties/...", not the $defs that move to the root) put
    under `base`; the same object when it has none."""
    if isinstance(schema, list):
        items = [_rebase_refs(v, base) for v in schema]
        return items if any(a is not b for a, b in zip(items, schema)) else schema
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or (v.startswith("#/") and not v.startswith(
                ("#/$defs/", "#/definitions/")))):
            out[k] = base + v[1:]
        elif k in ("enum", "const", "default", "examples"):
            out[k] = v
        else:
            out[k] = _rebase_refs(v, base)
    return out if any(out[k] is not schema[k] for k in schema) else schema


def _rendered(tools: list[dict]) -> list[dict]:
    """The (checked) tools as the chat template gets them: as sent, but a function sent without `parameters` (OpenAI's
    function that takes none) has them null, as vLLM gives its tools to the template (its FunctionDefinition's
    model_dump), so that a template that reads them (Hermes' `tool.parameters|tojson`) renders rather than fails."""
    return [tool if "parameters" in tool["function"] else {**tool, "function": {**tool["function"], "parameters": None}}
            for tool in tools]


def parse_tools(body: dict, parser: str | None = None) -> ToolRequest | None:
    """The chat body's tools and tool_choice (and parallel_tool_calls); None when it has no tools (tool_choice may
    then only be absent, "none" or "auto"). `parser`: the server's --tool-call-parser (None: "auto" is refused)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _error("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if tools is not None and not isinstance(tools, list):  # {}, 0, false: a malformed field, not "no tools"
        _functions(tools)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _error("tool_choice", "tool_choice names a call but the request has no tools",
                         "send the functions in tools")
        return None
    functions = _functions(tools)
    if choice == "none":
        return ToolRequest(_rendered(tools), "none", parser=parser)
    if (choice is None or choice == "auto") and parser is not None:
        return ToolRequest(_rendered(tools), "auto", name=parser, parallel=parallel is not False, parser=parser)
    if choice is None or choice == "auto":
        raise _error("tool_choice", f"tool_choice {choice or 'auto'!r} (the default with tools) needs a parser of the "
                     "model's own tool-call syntax: this server was started without one",
                     f'start it with --enable-auto-tool-choice --tool-call-parser {" | ".join(PARSERS)}, or send '
                     '"tool_choice": "required" or a named function (the reply is then constrained to a call), or '
                     '"none" (the model writes text)')
    if choice == "required":
        _check_object_arguments(functions, functions)
        functions, defs = _lift_defs(functions)
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}, **defs}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolRequest(_rendered(tools), "required", schema=schema, parser=parser, history=_history(body))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise _error("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got "
                                    f"{json.dumps(choice)[:80]}", NAMED_HINT)
    if name not in functions:
        raise _error("tool_choice", f"tool_choice names {name!r}, which is not among the tools",
                     f"tools has: {', '.join(functions)}")
    _check_object_arguments({name: functions[name]}, functions)
    return ToolRequest(_rendered(tools), "named", name=name, schema=functions[name], parser=parser,
                       history=_history(body))


_JSON_TYPES = {"array", "string", "integer", "number", "boolean", "null"}


def _check_object_arguments(forced: dict[str, dict], functions: dict[str, dict]) -> None:
    """A forced call's (named, "required") parameters schema must describe an object: the reply is constrained to
    it, and a call's arguments are a JSON object (OpenAI's: a client calls the function with them). A schema typed
    "array" or "integer" made arguments such as `[343460083]` that no client can call with."""
    for name, params in forced.items():
        kinds = params.get("type") if isinstance(params.get("type"), list) else [params.get("type")]
        # (a type JSON schema does not have, "foo", is the structured output's compile error)
        if "$ref" not in params and "object" not in kinds and set(map(str, kinds)) <= _JSON_TYPES:
            raise _error("tools", f"tools[{list(functions).index(name)}].function.parameters has type "
                         f"{json.dumps(params.get('type'))}: a forced call's arguments are constrained to it, and "
                         "a call's arguments are a JSON object",
                         'describe the arguments as an object, e.g. {"type": "object", "properties": {"items": '
                         '{"type": "array"}}}')


def _call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


_ALPHANUMERIC = string.ascii_letters + string.digits


def _mistral_call(name: str, arguments: str) -> dict:
    """A call read by the mistral parser: its id is 9 letters and digits, as vLLM's MistralToolCall makes it, since
    Mistral's chat templates (and mistral_common) refuse any other id when the client sends the call back with the
    tool's reply ("Tool call IDs should be alphanumeric strings with length 9!")."""
    return _call(name, arguments, "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9)))


def call_id(req: ToolRequest, name: str, k: int) -> str:
    """The id of the reply's `k`th call when its text writes none, in the form the --tool-call-parser's family takes
    back: mistral's 9 letters and digits, kimi_k2's `functions.NAME:IDX` (numbered on from the conversation's
    calls), else vLLM's `chatcmpl-tool-...`."""
    if req.parser == "mistral":
        return _mistral_call(name, "")["id"]
    if req.parser == "kimi_k2":
        return f"functions.{name}:{req.history + k}"
    return _call(name, "")["id"]


def _history(body: dict) -> int:
    """How many calls the conversation's assistant messages hold (vLLM's count for kimi_k2's ids)."""
    messages = body.get("messages")
    return sum(len(m["tool_calls"]) for m in messages if isinstance(m, dict) and m.get("role") == "assistant"
               and isinstance(m.get("tool_calls"), list)) if isinstance(messages, list) else 0


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    """A JSON number as json.loads reads it, but one too large for a float (1e400, which json.loads reads as inf):
    refused, as NaN and Infinity are (json.dumps would write the call's arguments with Infinity, no JSON)."""
    value = float(number)
    if math.isinf(value):
        raise ValueError(f"{number} is too large a number")
    return value


def _arguments(args: Any) -> str:
    """A parsed call's arguments as OpenAI's JSON text: written as JSON, but arguments the model gave as JSON text
    ("{\\"a\\": 1}") stay that text; text that is not JSON ("Paris", "") is written as a JSON string, as vLLM writes
    every value, so that a client's json.loads(arguments) reads whatever the call holds."""
    if isinstance(args, str):
        try:  # (Python's NaN and Infinity are no JSON: a client's JSON.parse refuses them)
            json.loads(args, parse_constant=_not_json)
            return args
        except (ValueError, RecursionError):
            pass
    return json.dumps(args, ensure_ascii=False)


def hermes_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content before the first call, the calls) of a reply in the hermes syntax; None when it has no call, or
    when a call is not JSON with a name and arguments (as vLLM's parser: the reply then stays text)."""
    if HERMES_START not in text:
        return None
    calls = []
    for whole, last in _HERMES.findall(text):
        try:
            call = json.loads(whole or last, parse_constant=_not_json, parse_float=_finite)
        except ValueError:
            return None
        # no "arguments" (a call written with Llama's "parameters" among them): text, as vLLM's, not a call whose
        # arguments were silently dropped
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            return None
        args = call["arguments"]
        calls.append(_call(call["name"], _arguments(args)))
    content = text[:text.index(HERMES_START)]  # as vLLM's, blanks included: a stream has sent them already
    return (content or None), calls


def llama3_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(None, the calls) of a reply in Llama 3's JSON syntax, as vLLM's llama3_json parser reads it: the reply starts
    with <|python_tag|> or "{", then JSON objects with a name and parameters (or arguments), separated by ";";
    None when it is not that (the reply then stays text)."""
    if not (text.startswith(LLAMA_START) or text.startswith("{")):
        return None
    body, at, calls = text[len(LLAMA_START):] if text.startswith(LLAMA_START) else text, 0, []
    decoder = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)
    while True:
        at = len(body) - len(body[at:].lstrip())
        if at >= len(body):
            break
        try:
            call, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        args = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if not isinstance(call.get("name") if isinstance(call, dict) else None, str) or args is None:
            return None
        calls.append(_call(call["name"], _arguments(args)))
        rest = body[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        at = len(body) - len(rest) + (1 if rest else 0)
    return (None, calls) if calls else None


# pythonic: the shape vLLM's parser asks of a reply before it reads it as Python (its TOOL_CALL_REGEX, checked here
# step by step, which cannot backtrack for long on a call cut short): "[", then calls `name(` (a name that starts with
# an ASCII letter) that are empty, `name()`, followed by ", " or blanks and the next call, or "]"; the first keyword
# argument, `key=` (key alike), lets anything follow up to a later ")" and "]" with only blanks between them
_PY_CALL = re.compile(r"[a-zA-Z]\w*\(")
_PY_KEY = re.compile(r"[a-zA-Z]\w*=")
_PY_END = re.compile(r"\)\s*\]")
_BLANKS = re.compile(r"\s*")


def _pythonic_shape(text: str) -> bool:
    """Whether `text` has the shape of a pythonic list of calls (see above); the Python parser checks the rest."""
    if not text.startswith("["):
        return False
    at, commas = 1, True  # "name()," only before the first call followed by blanks alone
    while True:
        call = _PY_CALL.match(text, at)
        if call is None:
            return False
        key = _PY_KEY.match(text, call.end())
        if key is not None:
            return _PY_END.search(text, key.end()) is not None
        if not text.startswith(")", call.end()):
            return False
        at = call.end() + 1
        if commas and text.startswith(",", at):
            at = _BLANKS.match(text, at + 1).end()
            continue
        at = _BLANKS.match(text, at).end()
        if text.startswith("]", at):
            return True
        commas = False


_PY_OPENING = re.compile(r"\[(?:[a-zA-Z]\w*)?")


def _may_be_pythonic(text: str) -> bool:
    """Whether `text`, which starts with "[", may still grow into the shape _pythonic_shape reads: its first call's
    `name(` has not been contradicted yet (a reply "[1] ..." or "[Paris] ..." never becomes a list of calls)."""
    at = _PY_OPENING.match(text).end()
    return at == len(text) or (at > 1 and text[at] == "(")


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr, json_names: bool = False) -> Any:
    """A Python literal argument as its JSON value: constants, signed numbers (`days=-2`, a unary minus in Python's
    AST, which vLLM's pythonic and olmo3 parsers leave the whole reply text for: a call to move back 2 days is a
    call), lists, and dicts whose keys are constants (and, with `json_names`, Olmo 3's JSON true, false and null
    written bare)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(
            node.operand, ast.Constant) and type(node.operand.value) in (int, float):  # -1, -0.5 (vLLM's: text)
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if json_names and isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(x, json_names) for x in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal(v, json_names) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


def pythonic_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(None, the calls) of a reply that is a Python list of calls, as vLLM's pythonic parser reads it (and its
    llama4_pythonic one, which first drops a leading <|python_start|> and every <|python_end|>): keyword arguments
    only (positional ones are left out), each a literal (a string, number, True/False/None, or a list or dict of
    them), written as JSON; None when the reply is not that (the reply then stays text)."""
    if text.startswith(PYTHON_START):
        text = text[len(PYTHON_START):].replace(PYTHON_END, "")
    calls = _python_calls(text)
    return None if calls is None else (None, calls)


def _python_calls(text: str, json_names: bool = False) -> list[dict] | None:
    """The calls of `text`, a Python list of calls with literal keyword arguments (see pythonic_calls; `json_names`:
    _literal's); None when it is not that."""
    if not _pythonic_shape(text):
        return None
    try:
        tree = ast.parse(text)
        value = getattr(tree.body[0], "value", None)
        if not isinstance(value, ast.List) or not all(isinstance(e, ast.Call) for e in value.elts):
            return None
        calls = []
        for e in value.elts:
            if not isinstance(e.func, ast.Name):
                return None
            args = {kw.arg: _literal(kw.value, json_names) for kw in e.keywords}
            calls.append(_call(e.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))  # (1e999: inf)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return calls


_MISTRAL_NAME = re.compile(r"[a-zA-Z0-9_-]+")


def _mistral_named(raw: str) -> tuple[str, str] | None:
    """(name, arguments) of one call in the newer syntax, `name[ARGS]{...}` (`name[CALL_ID]id[ARGS]{...}`, or
    `name{...}`): None when the arguments are not one whole JSON object."""
    if MISTRAL_ARGS in raw:
        name, args = raw.split(MISTRAL_ARGS, 1)
        name = name.split(MISTRAL_CALL_ID, 1)[0]
    elif "{" in raw:
        name, args = raw[:raw.index("{")], raw[raw.index("{"):]
    else:
        return None
    name, args = name.strip(), args.strip()
    if _MISTRAL_NAME.fullmatch(name) is None:
        return None
    try:
        value = json.loads(args, parse_constant=_not_json, parse_float=_finite)
    except ValueError:
        return None
    return (name, json.dumps(value, ensure_ascii=False)) if isinstance(value, dict) else None


def _bracketed(body: str) -> str | None:
    """vLLM's fallback match re.search(r"\\[{.*}\\]", body, re.DOTALL): from the first "[{" to the last "}]" after
    it, found in linear time (the regex takes time quadratic in a reply of many "[{" without a "}]": seconds of the
    server's event loop for a degenerate reply of 20,000)."""
    start = body.find("[{")
    end = body.rfind("}]")
    return body[start:end + 2] if start >= 0 and end >= start + 2 else None


def _named_calls(items: Any) -> bool:
    """Whether `items` (a reply's JSON) is a list of calls as Mistral's and Granite's replies write them: not empty,
    each an object with a string "name" and "arguments"."""
    return isinstance(items, list) and bool(items) and all(
        isinstance(x, dict) and isinstance(x.get("name"), str) and "arguments" in x for x in items)


def mistral_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content before [TOOL_CALLS], the calls) of a reply in Mistral's syntax, as vLLM's mistral parser reads it:
    after one [TOOL_CALLS], a JSON list of {"name", "arguments"} objects (or, as its fallback, the first `[{...}]` in
    that text), each call's arguments written as JSON; or, in the newer syntax, `name[ARGS]{...}` after each
    [TOOL_CALLS]. None when it has no [TOOL_CALLS] or a call does not read (the reply then stays text)."""
    if MISTRAL_START not in text:
        return None
    content, *raws = text.split(MISTRAL_START)
    content = content if content else None
    if raws[0].lstrip().startswith("["):  # the JSON list: one [TOOL_CALLS] only
        if len(raws) != 1:
            return None
        body = raws[0].strip()
        try:
            items = json.loads(body, parse_constant=_not_json, parse_float=_finite)
        except ValueError:
            found = _bracketed(body)
            try:
                items = json.loads(found, parse_constant=_not_json, parse_float=_finite) if found else None
            except ValueError:
                return None
        if not _named_calls(items):
            return None
        return content, [_mistral_call(x["name"], json.dumps(x["arguments"], ensure_ascii=False)) for x in items]
    calls = []
    for raw in raws:
        if not raw.strip():
            continue
        named = _mistral_named(raw)
        if named is None:
            return None
        calls.append(_mistral_call(*named))
    return (content, calls) if calls else None


# qwen3_coder and seed_oss: vLLM's XML-ish syntax, `<function=NAME>` then `<parameter=KEY>VALUE</parameter>` per
# argument, then `</function>`, inside the family's call tags (a reply without them is searched whole, as vLLM's
# back-off); a tag left open at the reply's end closes there
XML_FUNCTION = "<function="
QWEN_START, SEED_START = HERMES_START, "<seed:tool_call>"
SEED_THINK_START, SEED_THINK_END = "<seed:think>", "</seed:think>"
# a closing tag ends its part where the syntax may go on after it (the next parameter, the function's end, the next
# call, the reply's end): a value of code that holds "</parameter>" (or a function's "</function>", a call's
# "</tool_call>") is read whole, where vLLM's first-match regexes cut it there and drop the rest; a tag followed by
# anything else (a parameter left unclosed, text after the calls) is read as vLLM reads it
_CALL_ENDS = r"</tool_call>|</seed:tool_call>|<tool_call>|<seed:tool_call>|<function=|$"


def _closed(open_tag: str, close_tag: str, after: str) -> str:
    """An `open_tag`...`close_tag` part whose close is followed (after blanks) by one of `after`, and which does not
    run across another `open_tag` (which also keeps the search linear: each part's is bounded by the next's start)."""
    return rf"{open_tag}((?:(?!{open_tag}).)*?){close_tag}(?=\s*(?:{after}))"


_XML_FUNCTIONS = re.compile(_closed("<function=", "</function>", _CALL_ENDS)
                            + r"|<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_PARAMETER_CLOSED = _closed("<parameter=", "</parameter>", r"<parameter=|</function>|$")
# Qwen3-Coder's parameter also ends where the next one or the function's end starts; Seed-OSS's at its end tag only
_XML_PARAMETERS = {"qwen3_coder": re.compile(_PARAMETER_CLOSED + r"|<parameter=(.*?)(?:</parameter>|(?=<parameter=)|"
                                             r"(?=</function>)|$)", re.DOTALL),
                   "seed_oss": re.compile(_PARAMETER_CLOSED + r"|<parameter=(.*?)</parameter>|<parameter=(.*?)$",
                                          re.DOTALL)}
_XML_CALLS = {"qwen3_coder": re.compile(_closed("<tool_call>", "</tool_call>", r"<tool_call>|$")
                                        + r"|<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL),
              "seed_oss": re.compile(_closed("<seed:tool_call>", "</seed:tool_call>", r"<seed:tool_call>|$")
                                     + r"|<seed:tool_call>(.*?)</seed:tool_call>|<seed:tool_call>(.*?)$",
                                     re.DOTALL)}
_XML_STARTS = {"qwen3_coder": QWEN_START, "seed_oss": SEED_START}
_INT_TYPES = ("int", "uint", "long", "short", "unsigned")


def _json_value(value: Any) -> bool:
    """Whether `value` (what ast.literal_eval read) is one JSON holds: no set, bytes, complex, NaN or infinity (a
    tuple is written as a list, as vLLM's json.dumps writes it)."""
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError, RecursionError):
        return False


def _kind(schema: Any, root: Any, seen: int = 0) -> str | None:
    """The type name a parameter's schema gives its value, lower case: its "type"; of a nullable type (["integer",
    "null"]), the other one; of an anyOf / oneOf whose options (null aside) have one type, that type; of a $ref into
    the function's $defs (or definitions), the type there (pydantic writes Optional[int] as an anyOf with null, a
    nested model or an enum as a $ref). vLLM reads "type" alone (a nullable string "007" read as the number 7, a
    nested model's JSON left text). None: several types, which the value's own literal decides; "string" without
    any type, as vLLM's."""
    if not isinstance(schema, dict) or seen > 16:  # (a $ref cycle)
        return "string"
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        kinds = {str(k).strip().lower() for k in kinds} - {"null"}
        return kinds.pop() if len(kinds) == 1 else None if kinds else "string"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")) and isinstance(root, dict):
        where, _, name = ref[2:].partition("/")
        defs = root.get(where)
        return _kind(defs.get(name) if isinstance(defs, dict) else None, root, seen + 1)
    options = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(options, list):
        kinds = {_kind(o, root, seen + 1) for o in options
                 if not (isinstance(o, dict) and o.get("type") == "null")}
        return kinds.pop() if len(kinds) == 1 else None if kinds else "string"
    return "string"


def _typed(value: str, schema: Any, family: str, root: Any = None) -> Any:
    """A parameter's text as the value its JSON schema types it (vLLM's _convert_param_value, the type read by
    `_kind`): "null" is null; string types (and a parameter the schema does not name, or names without a type) stay
    text; integer and number types read as numbers (an integral number as an int), boolean as true unless "false"
    (vLLM: anything else is false); objects (qwen3_coder: and arrays) as JSON, and anything else as a Python literal.
    A value that does not read so stays text, as in vLLM, and so does one JSON cannot hold (NaN, a set). `root`: the
    function's parameters schema, where a $ref points."""
    if value.lower() == "null":
        return None
    kind = _kind(schema, root) or ""
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(_INT_TYPES):
        try:
            return int(value)
        except ValueError:  # "5.0": an integer all the same (a JSON schema's integer takes 5.0)
            try:
                return int(float(value)) if float(value).is_integer() else value
            except (ValueError, OverflowError):
                return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
            return int(number) if number.is_integer() else number if _json_value(number) else value
        except (ValueError, OverflowError):
            return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    as_json = ("object", "array", "arr") if family == "qwen3_coder" else ("object",)
    return _read_value(value, kind in as_json or kind.startswith("dict")
                       or (family == "qwen3_coder" and kind.startswith("list")))


def _read_value(value: str, as_json: bool = True) -> Any:
    """`value` read as JSON (when `as_json`), else as a Python literal JSON can hold, else that text (vLLM's
    qwen3_coder and glm45 read a parameter's text so)."""
    if as_json:
        try:  # (NaN and Infinity, which Python's JSON reads, are no JSON: a client's JSON.parse refuses them)
            return json.loads(value, parse_constant=_not_json, parse_float=_finite)
        except (ValueError, RecursionError):
            pass
    try:
        read = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value
    return read if _json_value(read) else value


def _xml_call(raw: str, functions: dict[str, Any], family: str) -> dict:
    """One `NAME>...` (after <function=) as a call: its parameters typed by the named function's schema (an unknown
    function's, as vLLM's, stay text). ValueError when the name has no ">", is empty, or holds a blank or "<" (a
    tag that never ended: `<function=f\n<parameter=...`, which vLLM would call a function of that name)."""
    name, sep, params = raw.partition(">")
    if not sep or not name or "<" in name or any(c.isspace() for c in name):
        raise ValueError("a function without its name")
    schema = functions.get(name)
    properties = schema.get("properties", schema) if isinstance(schema, dict) else {}
    properties = properties if isinstance(properties, dict) else {}
    args = {}
    for match in _XML_PARAMETERS[family].findall(params):
        text = next((group for group in match if group), "")
        key, sep, value = text.partition(">")
        if not sep:
            raise ValueError("a parameter without its name")
        value = value[1:] if value.startswith("\n") else value  # the newline after the tag, and before the end's
        value = value[:-1] if value.endswith("\n") else value
        args[key] = _typed(value, properties.get(key), family, schema)
    return _call(name, json.dumps(args, ensure_ascii=False))


def _xml_calls(family: str, text: str, functions: dict[str, Any] | None) -> tuple[str | None, list[dict]] | None:
    """(content before the first call, the calls) of a reply in qwen3_coder's or seed_oss's syntax, as vLLM's parsers
    read it; None (the reply stays text) when it has no <function=, or a function or parameter without its name.
    seed_oss reads only what follows the reply's </seed:think> (when it has both think tags)."""
    body, before = text, ""
    if family == "seed_oss" and SEED_THINK_START in text and SEED_THINK_END in text:
        at = text.index(SEED_THINK_END) + len(SEED_THINK_END)
        before, body = text[:at], text[at:]
    if XML_FUNCTION not in body:
        return None
    blocks = [next((g for g in match if g), "") for match in _XML_CALLS[family].findall(body)] or [body]
    raws = [next((g for g in match if g), "") for block in blocks for match in _XML_FUNCTIONS.findall(block)]
    if not raws:
        return None
    try:
        calls = [_xml_call(raw, functions or {}, family) for raw in raws]
    except ValueError:
        return None
    at = body.find(_XML_STARTS[family])
    content = before + body[:at if at >= 0 else body.find(XML_FUNCTION)]
    return (content or None), calls


def qwen3_coder_calls(text: str, functions: dict[str, Any] | None = None) -> tuple[str | None, list[dict]] | None:
    """Qwen3-Coder's calls (see _xml_calls); `functions`: {name: parameters schema} that types the values."""
    return _xml_calls("qwen3_coder", text, functions)


def seed_oss_calls(text: str, functions: dict[str, Any] | None = None) -> tuple[str | None, list[dict]] | None:
    """Seed-OSS's calls (see _xml_calls); `functions`: {name: parameters schema} that types the values."""
    return _xml_calls("seed_oss", text, functions)


_HARMONY_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


def harmony_calls(text: str, finished: bool = True, memo: dict | None = None) -> tuple[str | None, list[dict]]:
    """(content, the calls) of a gpt-oss reply in harmony's format, as vLLM's openai parser reads it: a message
    addressed `to=functions.NAME` (in its header, before or after its channel) is a call whose text is the arguments
    (JSON, written again as vLLM does; text that is not JSON as a JSON string), the final channel's text the content,
    with a commentary preamble (a commentary message to no one: what the model tells the user before its calls, which
    vLLM's parser answers as the content when there is no final text), each such message's text joined in order (so
    that a stream's content only grows: vLLM's whole reply keeps the final text alone), None without any; the
    analysis is neither. The reply's last message ends where the reply does (its <|call|>
    is the stop token, left out of the text): it is a call when its text is whole JSON; one cut short (max_tokens)
    is not made, and its text is content, as a cut call of the other parsers stays text. Text outside any message
    (a reply without harmony's markers) is content. Not `finished` (a stream): the content so far (a call's text
    not yet), and the calls whose messages ended. `memo`: harmony_read's (a stream's, kept across its reads): what
    the closed messages make is kept in it (their calls' ids too)."""
    messages, closed, kept = harmony_read(text, finished, memo)
    n, content, calls = kept.get("calls", (0, None, ()))
    calls = list(calls)
    for k in range(n, len(messages)):
        header, body, ended = messages[k]
        recipient = _HARMONY_RECIPIENT.search(header)
        if recipient is None:
            if not header or harmony_channel(header) in ("final", "commentary"):
                content = (content or "") + body
        elif ended or finished:  # (a call still written is not read at each token of a stream)
            try:
                args = json.dumps(json.loads(body, parse_constant=_not_json, parse_float=_finite), ensure_ascii=False)
            except (ValueError, RecursionError):
                args = _arguments(body) if ended else None
            if ended or (k == len(messages) - 1 and args is not None):
                calls.append(_call(recipient.group(1), args))
            else:  # the reply's last message, cut short in its arguments
                content = (content or "") + body
        if k == n and k < closed and (recipient is None or ended or not finished):  # (what no later text changes)
            n = k + 1
            kept["calls"] = (n, content, tuple(calls))
    return content, calls


# granite: Granite 3.x's `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, the tag written as the text
# "<tool_call>" by some releases (vLLM's granite parser reads both, the list after them and blanks)
GRANITE_STARTS = ("<|tool_call|>", HERMES_START)


def granite_list(text: str) -> int | None:
    """Where a Granite reply's list of calls starts (its "["), after blanks and its tags; None: it has none."""
    at = _BLANKS.match(text).end()
    for tag in GRANITE_STARTS:
        if text.startswith(tag, at):
            at = _BLANKS.match(text, at + len(tag)).end()
    return at if text.startswith("[", at) else None


def _granite_may_call(text: str) -> bool:
    """Whether a streamed Granite reply may still be its list of calls: blanks, a start of a tag, or the list's
    "[" with blanks and its first call's "{" (a reply "[1] First" is text from its "1")."""
    at = _BLANKS.match(text).end()
    for tag in GRANITE_STARTS:
        if text.startswith(tag, at):
            at = _BLANKS.match(text, at + len(tag)).end()
        elif tag.startswith(text[at:at + len(tag) + 1]):  # (a text longer than the tag is none of its starts)
            return True
    rest = _BLANKS.match(text, at + 1).end()
    return at == len(text) or text.startswith("[", at) and (rest == len(text) or text[rest] == "{")


def granite_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(None, the calls) of a Granite reply that is (after blanks and its tag) a JSON list of {"name", "arguments"}
    objects, each call's arguments written as JSON (vLLM's granite parser); None when it is not that (the reply then
    stays text: an empty list, a call without its name or arguments, text after the list)."""
    at = granite_list(text)
    if at is None:
        return None
    try:
        items = json.loads(text[at:], parse_constant=_not_json, parse_float=_finite)
    except ValueError:
        return None
    if not _named_calls(items):
        return None
    return None, [_call(x["name"], json.dumps(x["arguments"], ensure_ascii=False)) for x in items]


def tagged_blocks(text: str, read, state: dict | None = None) -> tuple[list, bool]:
    """(what `read` makes of each <tool_call>...</tool_call> block of `text` that has ended (its text between the
    tags), the blocks it skips (None) left out; whether a block did not read (ValueError), where the reading
    stopped). A block left open at the reply's end is none. `state`: where the read of a shorter text that `text`
    goes on stopped (a stream's): read on from there, each ended block read once."""
    state = {} if state is None else state
    out = state.setdefault("blocks", [])
    if state.get("bad"):
        return list(out), True
    k, start = state.get("at", (0, -1))
    while True:
        if start < 0:
            start = text.find(HERMES_START, k)
            if start < 0:
                k = max(k, len(text) - len(HERMES_START) + 1)
                break
            k = start + len(HERMES_START)
        end = text.find(HERMES_END, k)
        if end < 0:
            k = max(k, len(text) - len(HERMES_END) + 1)
            break
        try:
            block = read(text[start + len(HERMES_START):end])
        except (ValueError, RecursionError):
            state["bad"] = True
            return list(out), True
        if block is not None:
            out.append(block)
        k, start = end + len(HERMES_END), -1
    state["at"] = (k, start)
    return list(out), False


def _ernie_block(body: str) -> tuple[str, str] | None:
    """(name, arguments) of an ERNIE block: a JSON object with its name (arguments {} when it has none, as vLLM's);
    a block that is no object (`<tool_call>hello</tool_call>`) is skipped, as vLLM's regex skips it."""
    body = body.strip()
    if not body.startswith("{"):
        return None
    call = json.loads(body, parse_constant=_not_json, parse_float=_finite)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError("a call without its name")
    return call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)


def _blocks_calls(text: str, read) -> tuple[str | None, list[dict]] | None:
    """(content before the first <tool_call>, the calls of the blocks that ended) of a reply of tagged blocks read
    by `read` (tagged_blocks); None (text) without any call, or when a block does not read."""
    if HERMES_START not in text:
        return None
    blocks, bad = tagged_blocks(text, read)
    if bad or not blocks:
        return None
    return text[:text.index(HERMES_START)] or None, [_call(name, args) for name, args in blocks]


def ernie45_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content before the first call, less its last newlines; the calls) of an ERNIE 4.5 reply, as vLLM's ernie45
    parser reads it: each ended `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block a call (one left
    open at the reply's end is dropped); None (text) without any, or when a block's JSON does not read."""
    parsed = _blocks_calls(text, _ernie_block)
    return None if parsed is None else ((parsed[0] or "").rstrip("\n") or None, parsed[1])


# glm45: GLM-4.5/4.6's `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>` (GLM-4.7
# writes no newline after the name), a value written as text when the parameter is a string, else as JSON
GLM_KEY = "<arg_key>"
_GLM_ARGS = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_STRING_KINDS = ("string", "str", "text", "varchar", "char", "enum")


def _glm_typed(value: str, schema: Any, known: bool, root: Any) -> Any:
    """A GLM parameter's text as its value: text as written when its schema types it a string (`_kind`; its blanks
    kept, as vLLM's glm45 keeps them: a file's last newline), else its text less blanks read as JSON, else as a
    Python literal, else that text (vLLM's glm45; a parameter the function does not name is read so too)."""
    if known and _kind(schema, root) in _STRING_KINDS:
        return value
    return _read_value(value.strip())


def _glm_block(body: str, functions: dict[str, Any]) -> tuple[str, str]:
    """(name, arguments) of a GLM block; ValueError when its name is missing or holds a blank or "<"."""
    at = min((k for k in (body.find("\n"), body.find(GLM_KEY)) if k >= 0), default=len(body))
    name = body[:at].strip()
    if not name or "<" in name or any(c.isspace() for c in name):
        raise ValueError("a call without its name")
    schema = functions.get(name)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    args = {key.strip(): _glm_typed(value, properties.get(key.strip()), key.strip() in properties, schema)
            for key, value in _GLM_ARGS.findall(body, at)}
    return name, json.dumps(args, ensure_ascii=False)


def glm45_calls(text: str, functions: dict[str, Any] | None = None) -> tuple[str | None, list[dict]] | None:
    """(content before the first call, None when blank; the calls) of a GLM-4.5/4.6/4.7 reply, as vLLM's glm45
    parser reads it: each ended <tool_call> block a call, its values typed by `functions` ({name: parameters
    schema}); None (text) without any, or when a block has no name."""
    parsed = _blocks_calls(text, lambda body: _glm_block(body, functions or {}))
    # (GLM writes "\n" before each <tool_call>: blank content is none, as vLLM's glm45 makes it)
    return None if parsed is None else ((parsed[0] or "").strip() and parsed[0] or None, parsed[1])


# olmo3: Olmo 3's calls, one a line, `<function_calls>get_weather(city="Paris")\nadd(a=1, b=true)</function_calls>`
OLMO_START, OLMO_END = "<function_calls>", "</function_calls>"


def olmo3_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content before <function_calls>, None when blank; the calls) of an Olmo 3 reply: the lines up to the
    </function_calls> that follows, each a Python call with literal keyword arguments (JSON's true, false and null
    too), as vLLM's olmo3 parser reads them (what follows the end tag is dropped); None when it is not that (text).
    Olmo 3's template writes a message's content, then its <function_calls>: the tags are found anywhere, as vLLM's
    whole reply finds them (it drops the content before them; its stream reads them only at the reply's start)."""
    at = text.find(OLMO_START)
    end = text.find(OLMO_END, at + len(OLMO_START)) if at >= 0 else -1
    if end < 0:
        return None
    lines = [line.strip() for line in text[at + len(OLMO_START):end].splitlines() if line.strip()]
    calls = _python_calls("[" + ", ".join(lines) + "]", json_names=True)
    return None if calls is None else (text[:at] if text[:at].strip() else None, calls)


# phi4_mini_json: Phi-4-mini's `functools[{"name": ..., "arguments": {...}}, ...]` ("parameters" for "arguments" too)
PHI4_START = "functools["


def phi4_mini_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content before "functools[", the calls) of a Phi-4-mini reply: the JSON list after the tag, each call's
    arguments (or parameters) written as JSON, what follows the list dropped, as vLLM's phi4_mini_json reads it
    (whose regex ends the list at its first "]": a call with a list among its arguments vanished there, and it
    dropped the content before the tag, which a stream has sent); None (text) when it is not that."""
    at = text.find(PHI4_START)
    if at < 0:
        return None
    try:
        items, _ = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite).raw_decode(
            text, at + len(PHI4_START) - 1)
    except ValueError:
        return None
    if not isinstance(items, list) or not items or not all(
            isinstance(x, dict) and isinstance(x.get("name"), str) and ("arguments" in x or "parameters" in x)
            for x in items):
        return None
    return text[:at] or None, [_call(x["name"], json.dumps(x["arguments"] if "arguments" in x else x["parameters"],
                                                          ensure_ascii=False)) for x in items]


# deepseek_v3, deepseek_v31, kimi_k2: a section of calls, each between a begin and an end token, `head` its text up to
# its JSON arguments: DeepSeek-V3's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`,
# V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`, Kimi-K2's
# `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>` (vLLM's parsers' regexes)
DS_CALLS_BEGIN, DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
KIMI_SECTIONS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")  # (vLLM's stream takes both)
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"


@dataclass(frozen=True)
class Sectioned:
    sections: tuple[str, ...]  # where the calls start (the content is the text before the first)
    begin: str
    end: str
    head: re.Pattern  # a call's text up to its arguments, its name (and Kimi's id) in the groups "name", "id"
    fence: bool = False  # the arguments are followed by "```" (DeepSeek-V3's code block)


SECTIONED = {
    "deepseek_v3": Sectioned((DS_CALLS_BEGIN,), DS_CALL_BEGIN, DS_CALL_END,
                             re.compile(r"[^\n]*?<｜tool▁sep｜>(?P<name>[^\n]*)\n[ \t]*```json[ \t]*\n"), fence=True),
    "deepseek_v31": Sectioned((DS_CALLS_BEGIN,), DS_CALL_BEGIN, DS_CALL_END,
                              re.compile(r"(?P<name>[^\n]*?)<｜tool▁sep｜>")),
    "kimi_k2": Sectioned(KIMI_SECTIONS, KIMI_CALL_BEGIN, KIMI_CALL_END,
                         re.compile(r"\s*(?P<id>[^<]+:\d+)\s*<\|tool_call_argument_begin\|>")),
}


def sectioned_head(spec: Sectioned, match: re.Match) -> tuple[str, str | None]:
    """(name, the call's id written in the text: Kimi's `functions.NAME:IDX`, None for the others) of a call's head;
    ValueError when the name is empty or holds a blank or "<"."""
    call_id = match.group("id").strip() if "id" in spec.head.groupindex else None
    name = call_id.split(":")[0].split(".")[-1] if call_id is not None else match.group("name").strip()
    if not name or "<" in name or any(c.isspace() for c in name):
        raise ValueError("a call without its name")
    return name, call_id


def sectioned_block(spec: Sectioned, body: str) -> tuple[str, str, str | None]:
    """(name, arguments, id) of one ended call (its text between the begin and end tokens): its arguments a JSON
    object (written again as json.dumps writes it), none at all read as {}; ValueError when they are anything else
    (the reply then stays text, as a call that is no JSON does)."""
    match = spec.head.match(body)
    if match is None:
        raise ValueError("a call without its head")
    name, call_id = sectioned_head(spec, match)
    args = body[match.end():].rstrip()
    if spec.fence:
        if not args.endswith("```"):
            raise ValueError("arguments without the end of their code block")
        args = args[:-3]
    if not args.strip():  # a function without parameters called with no arguments at all: OpenAI's "{}", as a
        return name, "{}", call_id  # client's json.loads takes it (vLLM passed "", and the client's read failed)
    value = json.loads(args, parse_constant=_not_json, parse_float=_finite)
    if not isinstance(value, dict):
        raise ValueError("arguments that are no JSON object")
    return name, json.dumps(value, ensure_ascii=False), call_id


def section_start(spec: Sectioned, text: str) -> int:
    """Where the first of the spec's section tokens is in `text` (-1: none is)."""
    return min((k for k in (text.find(s) for s in spec.sections) if k >= 0), default=-1)


def _sectioned_calls(family: str, text: str) -> tuple[str | None, list[dict]] | None:
    """(content before the section's token, None when empty; the calls) of a reply in `family`'s syntax, as vLLM's
    parser reads it: each call that ended after the section's token (one left open at the reply's end is none),
    Kimi's with the id it writes. None (text) without a call, or when a call does not read (vLLM passes arguments
    that are no JSON on as they are; a begin token inside a call drops it)."""
    spec = SECTIONED[family]
    at = section_start(spec, text)
    if at < 0:
        return None
    calls, k = [], at
    while True:
        start = text.find(spec.begin, k)
        end = text.find(spec.end, start + len(spec.begin)) if start >= 0 else -1
        if end < 0:
            break
        body = text[start + len(spec.begin):end]
        if spec.begin in body:
            return None
        try:
            name, args, call_id = sectioned_block(spec, body)
        except ValueError:
            return None
        calls.append(_call(name, args, call_id))
        k = end + len(spec.end)
    return (text[:at] or None, calls) if calls else None


def deepseek_v3_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """DeepSeek-V3's and R1's calls (see _sectioned_calls)."""
    return _sectioned_calls("deepseek_v3", text)


def deepseek_v31_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """DeepSeek-V3.1's calls (see _sectioned_calls)."""
    return _sectioned_calls("deepseek_v31", text)


def kimi_k2_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """Kimi-K2's calls, each with the id it writes (`functions.NAME:IDX`, as vLLM passes it on; see
    _sectioned_calls)."""
    return _sectioned_calls("kimi_k2", text)


# internlm: InternLM2/2.5's one call, `<|action_start|><|plugin|>\n{"name": ..., "parameters": {...}}<|action_end|>`
INTERNLM_START, INTERNLM_END = "<|action_start|><|plugin|>", "<|action_end|>"


def internlm_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content before the call's tags, None when empty; the call) of an InternLM2 reply, as vLLM's internlm parser
    reads it: one call (its parser reads no second), the JSON object from the first "{" after the tags up to
    <|action_end|> (or the reply's end), its "parameters" (else "arguments", else {}) the arguments. None (text)
    when it is not that."""
    at = text.find(INTERNLM_START)
    if at < 0 or text.find(INTERNLM_START, at + len(INTERNLM_START)) >= 0:
        return None
    action = text[at + len(INTERNLM_START):].split(INTERNLM_END, 1)[0]
    try:
        call = json.loads(action[action.find("{"):] if "{" in action else action, parse_constant=_not_json,
                          parse_float=_finite)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    args = call["parameters"] if "parameters" in call else call.get("arguments", {})
    return text[:at] or None, [_call(call["name"], json.dumps(args, ensure_ascii=False))]


# xlam: Salesforce xLAM's JSON list of {"name", "arguments"} objects: the whole reply, or (in this order) what follows
# its </think>, a ```json code block, a [TOOL_CALLS] line or a <tool_call> block that holds one (vLLM's xlam)
XLAM_BLOCKS = (re.compile(r"```(?:json)?\s*([\s\S]*?)```"), re.compile(r"\[TOOL_CALLS\]([\s\S]*?)(?=\n|$)"),
               re.compile(r"<tool_call>([\s\S]*?)</tool_call>"))
XLAM_THINK_END = "</think>"
XLAM_STARTS = ("```", "[TOOL_CALLS]", HERMES_START, XLAM_THINK_END)  # (where a stream's content stops)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except ValueError:
        return None


def _xlam_found(text: str) -> tuple[str | None, Any]:
    """(content, the calls' JSON) as vLLM's xlam finds them; (None, None) when no JSON is found."""
    think = text.find(XLAM_THINK_END)
    if think >= 0:
        content, rest = text[:think + len(XLAM_THINK_END)], text[think + len(XLAM_THINK_END):].strip()
        value = _json_or_none(rest)
        if value is not None:
            return content, value
        for pattern in XLAM_BLOCKS:
            value = next((v for v in map(_json_or_none, pattern.findall(rest)) if v is not None), None)
            if value is not None:
                return content, value
    for pattern in XLAM_BLOCKS:
        value = next((v for v in map(_json_or_none, pattern.findall(text)) if v is not None), None)
        if value is not None:
            return pattern.sub("", text), value
    value = _json_or_none(text) if text.lstrip().startswith("[") else None
    return (None, value) if value is not None else (None, None)


def xlam_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content, the calls) of an xLAM reply, as vLLM's xlam parser reads it (_xlam_found): each item of the list
    that is an object with a name and arguments a call (the others left out), its arguments written as JSON (an
    object) or kept as the text they are (a string); the content the text around the JSON, its last blanks dropped
    (vLLM's drops its first blanks too, which a stream has sent). None (text) without any call."""
    content, value = _xlam_found(text)
    if not isinstance(value, list):
        return None
    calls = _xlam_items(value)
    return ((content or "").rstrip() or None, calls) if calls else None


def _xlam_items(items: list) -> list[dict]:
    """The calls of a list of xLAM's (and Hunyuan's) call objects: each object with a string name and arguments,
    its arguments written as JSON (an object) or kept as the text they are (a string); the other items left out."""
    return [_call(x["name"], json.dumps(x["arguments"], ensure_ascii=False) if isinstance(x["arguments"], dict)
                  else _arguments(x["arguments"]))
            for x in items if isinstance(x, dict) and isinstance(x.get("name"), str) and "arguments" in x]


# hunyuan_a13b: Hunyuan-A13B's `<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`
HUNYUAN_START, HUNYUAN_END = "<tool_calls>", "</tool_calls>"
_HUNYUAN_BLOCK = re.compile(r"<tool_calls>([\s\S]*?)</tool_calls>")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


def hunyuan_a13b_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content before the calls' tags, None when blank; the calls) of a Hunyuan-A13B reply, as vLLM's hunyuan_a13b
    parser reads it: the first <tool_calls>...</tool_calls> outside a <think> block whose text is JSON, a list
    whose objects with a name and arguments are the calls (the others left out), each call's arguments written as
    JSON (an object) or kept as the text they are (a string). None (text) without any call."""
    thinks = [m.span() for m in _THINK_BLOCK.finditer(text)] if "<think>" in text else []
    for match in _HUNYUAN_BLOCK.finditer(text):
        if any(a < match.start() and match.end() < b for a, b in thinks):
            continue
        value = _json_or_none(match.group(1).strip())
        if value is None:
            continue
        if not isinstance(value, list):
            return None
        calls = _xlam_items(value)
        content = text[:match.start()]
        return (content if content.strip() else None, calls) if calls else None
    return None


# minimax_m2: MiniMax-M2's `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>
# </minimax:tool_call>`, each value typed by the parameter's schema "type" (vLLM's minimax_m2)
MINIMAX_START, MINIMAX_END = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_INVOKE, MINIMAX_INVOKE_END = "<invoke name=", "</invoke>"
MINIMAX_PARAM, MINIMAX_PARAM_END = "<parameter name=", "</parameter>"
_MINIMAX_BLOCKS = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
_MINIMAX_INVOKES = re.compile(r"<invoke name=(.*?)</invoke>", re.DOTALL)
_MINIMAX_PARAMS = re.compile(r"<parameter name=(.*?)</parameter>", re.DOTALL)


def _unquoted(name: str) -> str:
    name = name.strip()
    return name[1:-1] if len(name) > 1 and name[0] == name[-1] and name[0] in "\"'" else name


def minimax_value(value: str, schema: Any) -> Any:
    """A MiniMax-M2 parameter's text (less its blanks) as the value its schema's "type" names, as vLLM's minimax_m2
    types it: "null" is null, a string stays text, an integer or number reads as one (an integral number as an
    int), a boolean is true for "true" or "1", anything else reads as JSON; a value that does not read stays text."""
    value = value.strip()
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    kind = kind.lower() if isinstance(kind, str) else ""
    if value.lower() == "null":
        return None
    if kind in ("string", "str", "text"):
        return value
    try:
        if kind in ("integer", "int"):
            return int(value)
        if kind in ("number", "float"):
            number = _finite(value)
            return value if number != number else int(number) if number.is_integer() else number  # (NaN: text)
    except ValueError:
        return value
    if kind in ("boolean", "bool"):
        return value.lower() in ("true", "1")
    read = _json_or_none(value)
    return value if read is None else read


def minimax_invoke(raw: str, functions: dict[str, Any]) -> tuple[str, str]:
    """(name, arguments) of one invoke's text (after `<invoke name=`, before `</invoke>`): its parameters typed by
    the named function's schema. ValueError when it has no name."""
    name, sep, _ = raw.partition(">")
    name = _unquoted(name)
    if not sep or not name:
        raise ValueError("an invoke without its name")
    schema = functions.get(name)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    args = {}
    for param in _MINIMAX_PARAMS.findall(raw):
        key, sep, value = param.partition(">")
        if sep and key:
            args[_unquoted(key)] = minimax_value(value, properties.get(_unquoted(key)))
    return name, json.dumps(args, ensure_ascii=False)


def minimax_m2_calls(text: str, functions: dict[str, Any] | None = None) -> tuple[str | None, list[dict]] | None:
    """(content before the first <minimax:tool_call>, None when empty; the calls) of a MiniMax-M2 reply, as vLLM's
    minimax_m2 parser reads it: each invoke that ended inside a tool-call block that ended. None (text) without any,
    or when an invoke has no name."""
    if MINIMAX_START not in text:
        return None
    try:
        calls = [_call(*minimax_invoke(raw, functions or {})) for block in _MINIMAX_BLOCKS.findall(text)
                 for raw in _MINIMAX_INVOKES.findall(block)]
    except ValueError:
        return None
    return (text[:text.find(MINIMAX_START)] or None, calls) if calls else None


# --tool-call-parser: the syntaxes "auto" reads
PARSERS = {"hermes": hermes_calls, "llama3_json": llama3_calls, "pythonic": pythonic_calls, "mistral": mistral_calls,
           "qwen3_coder": qwen3_coder_calls, "seed_oss": seed_oss_calls, "openai": harmony_calls,
           "granite": granite_calls, "glm45": glm45_calls, "olmo3": olmo3_calls, "ernie45": ernie45_calls,
           "phi4_mini_json": phi4_mini_calls, "deepseek_v3": deepseek_v3_calls, "deepseek_v31": deepseek_v31_calls,
           "kimi_k2": kimi_k2_calls, "internlm": internlm_calls, "xlam": xlam_calls,
           "hunyuan_a13b": hunyuan_a13b_calls, "minimax_m2": minimax_m2_calls}
# the parsers that type a call's values by the tools' schemas (they get {name: parameters schema} too)
TYPED_PARSERS = ("qwen3_coder", "seed_oss", "glm45", "minimax_m2")
# the parsers that read the whole reply, not the content a --reasoning-parser leaves (harmony's calls are messages)
WHOLE_REPLY_PARSERS = ("openai",)
# vLLM's other names of these syntaxes (its llama4_json parser is its llama3_json one; its llama4_pythonic reads the
# pythonic list inside <|python_start|>...<|python_end|>, as pythonic_calls does)
# granite4: Granite 4.0's `<tool_call>{json}</tool_call>` blocks, hermes' syntax (vLLM's granite4 also reads text
# between and after the blocks as content; the content here is what comes before the first); glm47: GLM-4.7's
# syntax, glm45's without the newline after the name)
PARSER_ALIASES = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic", "qwen3_xml": "qwen3_coder",
                  "granite4": "hermes", "glm47": "glm45"}


def _parsed(req: ToolRequest, text: str) -> tuple[str | None, list[dict]] | None:
    """PARSERS[req.name](text) (the typed parsers get the tools' schemas too), or None (the reply stays text) when
    the reply is too deeply nested for Python's JSON or AST readers (a model that repeats "[" until max_tokens:
    RecursionError), as vLLM's parsers, which catch any error of a reply they cannot read."""
    try:
        if req.name in TYPED_PARSERS:
            return PARSERS[req.name](text, {t["function"]["name"]: t["function"].get("parameters") for t in req.tools})
        return PARSERS[req.name](text)
    except RecursionError:
        return None


def reads_whole_reply(req: ToolRequest | None) -> bool:
    """Whether `req`'s calls are read from the whole reply rather than from the content a --reasoning-parser split
    from it (openai: harmony's calls are messages of their own, beside the analysis and final channels)."""
    return req is not None and req.mode == "auto" and req.name in WHOLE_REPLY_PARSERS


def visible(req: ToolRequest | None, text: str, memo: dict | None = None) -> str:
    """What of a streamed reply can go out as content now: with "auto", the text before a call starts, less an end
    that may be the start of one ("<tool_c", "[TOOL_"), held back as stop strings are (llama3_json and pythonic:
    nothing of a reply that starts as a call may, "{" or "[" (pythonic: while it may be "[name("), or their tag).
    `memo`: a dict the stream keeps for this reply (openai's harmony_calls', the others' where a call's tag was
    looked for): each read looks in the text the last one did not have."""
    if req is None or req.mode != "auto":
        return text
    if req.name == "openai":  # (the whole reply) the final channel's text so far
        return harmony_calls(text, finished=False, memo=memo)[0] or ""
    if req.name == "pythonic" and text.startswith("[") and not _may_be_pythonic(text):
        return text  # "[1] First,", "[Paris]": no call can follow, the reply streams (the parser leaves it text)
    if req.name == "granite":
        return "" if _granite_may_call(text) else text
    if req.name == "xlam":
        return _xlam_visible(text, memo)
    if req.name in ("llama3_json", "pythonic"):
        first, tag = ("{", LLAMA_START) if req.name == "llama3_json" else ("[", PYTHON_START)
        return "" if text.startswith(first) or text.startswith(tag) or tag.startswith(text) else text
    starts = _STARTS.get(req.name, (HERMES_START,))
    at, content = _first_start(text, starts, memo)
    text = content if content is not None else _less_start(text, starts)
    if req.name in _BLANK_NONE and (not text or text.isspace()):  # (no copy of the reply at each token)
        return ""  # (blank content before the calls is none, held until text comes)
    return text.rstrip("\n") if req.name == "ernie45" else text  # (ernie45: its content's last newlines, held)


def _less_start(text: str, starts: tuple[str, ...]) -> str:
    """`text` less an end that may be the start of one of `starts` ("<tool_c"), held back as stop strings are."""
    for k in range(min(max(map(len, starts)) - 1, len(text)), 0, -1):
        if any(start.startswith(text[-k:]) for start in starts):
            return text[:-k]
    return text


def _xlam_visible(text: str, memo: dict | None) -> str:
    """xLAM's content so far: nothing of a reply that starts (after blanks) as its list, else the text before a code
    block, a [TOOL_CALLS] or a <tool_call> (up to a </think>, itself included), its last blanks held (the whole
    reply's content has them dropped)."""
    lead = _BLANKS.match(text).end()
    if lead == len(text) or text.startswith("[", lead):
        return ""
    at, content = _first_start(text, XLAM_STARTS, memo)
    if content is None:
        return _less_start(text, XLAM_STARTS).rstrip()
    return (content + XLAM_THINK_END if text.startswith(XLAM_THINK_END, at) else content).rstrip()


def _first_start(text: str, starts: tuple[str, ...], memo: dict | None) -> tuple[int, str | None]:
    """(where the first of `starts` is in `text`, -1 when none is; the text before it, None when none is), looked for
    in the text the last read (`memo`'s, of a text `text` goes on) did not have, the text before a start found kept:
    no read or copy of the whole reply at each token. (No start is a part of another's: one found stays the first.)"""
    state = memo.get("visible") if memo is not None else None
    if state is None or not (text is state[0] or len(text) >= len(state[0]) and text.startswith(state[0])):
        state = (text, 0, -1, None)
    _, seen, at, content = state
    if at < 0:
        found = [k for k in (text.find(start, max(0, seen - len(start) + 1)) for start in starts) if k >= 0]
        if found:
            at = min(found)
            content = text[:at]
    if memo is not None:
        memo["visible"] = (text, len(text), at, content)
    return at, content


# the parsers whose content before the calls is none when it is blank (GLM writes "\n" before its <tool_call>)
_BLANK_NONE = ("glm45", "olmo3", "hunyuan_a13b")
# where a call may start, for each parser `visible` holds back from (qwen3_coder, seed_oss: vLLM's back-off reads a
# bare <function= too)
_STARTS = {"mistral": (MISTRAL_START,), "phi4_mini_json": (PHI4_START,), "olmo3": (OLMO_START,),
           **{family: spec.sections for family, spec in SECTIONED.items()}, "internlm": (INTERNLM_START,),
           "hunyuan_a13b": (HUNYUAN_START,), "minimax_m2": (MINIMAX_START,),
           "qwen3_coder": (QWEN_START, XML_FUNCTION),
           "seed_oss": (SEED_START, XML_FUNCTION)}


def split(req: ToolRequest | None, text: str) -> tuple[str, list[dict] | None]:
    """(content, tool_calls) of a finished reply: the calls with what came before them (nothing for a constrained
    call), or the whole text and None. With "auto", the calls the parser reads (the content before them: PARSERS),
    only the first with parallel_tool_calls false; openai: the final channel's text and the calls (none: None)."""
    if req is not None and req.mode == "auto":
        parsed = _parsed(req, text)
        if parsed is None:
            return text, None
        return parsed[0] or "", ((parsed[1] if req.parallel else parsed[1][:1]) or None)
    calls = tool_calls(req, text)
    if calls is None:
        return text, None
    return "", calls


_IN_STRING = re.compile(r'[^"\\\x00-\x1f]*')  # (a string's characters up to its end, an escape or a control one)


def control_escaped(text: str, k: int = 0, in_string: bool = False) -> tuple[str, int, bool]:
    """(text[k:] with each raw control character inside a JSON string written as json.dumps escapes it, the rest as
    it is; where that read stopped: the text's end, or a backslash that ends it (its escape not whole yet); whether
    it stopped inside a string). Resumed at `k` with `in_string` (an earlier read of a text this one goes on)."""
    out = []
    while k < len(text):
        if not in_string:
            at = text.find('"', k)
            out.append(text[k:] if at < 0 else text[k:at + 1])
            k, in_string = (len(text), False) if at < 0 else (at + 1, True)
            continue
        at = _IN_STRING.match(text, k).end()
        out.append(text[k:at])
        k = at
        if k >= len(text):
            break
        if text[k] == '"':
            out.append('"')
            k, in_string = k + 1, False
        elif text[k] == "\\":
            if k + 1 >= len(text):
                break
            out.append(text[k:k + 2])
            k += 2
        else:
            out.append(json.dumps(text[k])[1:-1])
            k += 1
    return "".join(out), k, in_string


def _read(text: str) -> tuple[Any, str]:
    """(value, the same value as JSON a strict reader takes) of a constrained reply: xgrammar lets a string with
    minLength or maxLength hold raw control characters (a tab, U+0003), which strict JSON refuses (so did this reader:
    the forced call came back as text); it is read all the same, the reply's text with them escaped in place (its
    layout kept: a named call's streamed pieces, serve/toolstream.py, are that text as it comes)."""
    try:
        return json.loads(text), text
    except ValueError:
        value = json.loads(text, strict=False)
        escaped, k, _ = control_escaped(text)
        return value, escaped + text[k:]


def tool_calls(req: ToolRequest | None, text: str) -> list[dict] | None:
    """A constrained reply `text` (a named tool_choice or "required") as OpenAI's tool_calls; None when the request
    asks for none, or when the reply did not complete (cut by max_tokens or a stop string: not JSON), which then
    stays text. ("auto" is read by split, with the parser's PARSERS.)"""
    if req is None or req.mode in ("none", "auto"):
        return None
    try:
        value, text = _read(text)
        if req.mode == "named":
            return [_call(req.name, text, call_id(req, req.name, 0))]
        if not isinstance(value, list):
            return None
        return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False), call_id(req, item["name"], k))
                for k, item in enumerate(value)]
    except (ValueError, RecursionError):  # cut short, or nested deeper than Python's JSON reads: text
        return None
