"""Tool calls on the chat endpoint, as vLLM answers them without a model-specific parser: `tools` reach the chat
template (transformers' `apply_chat_template(tools=...)`), and a `tool_choice` that names a function, or is
"required", constrains the reply with a JSON schema (structured outputs), so that it is always a call that parses:
- a named function: the reply is that function's arguments (its `parameters` schema);
- "required": the reply is a JSON list of one or more {"name", "parameters"} objects, each one of the tools (one
  only with parallel_tool_calls: false).
The message then carries OpenAI's `tool_calls` (content null) and finish_reason "tool_calls". "none" renders the
tools and lets the model write text. "auto" (the default when tools are given) would need a parser of each model
family's own tool-call syntax, which infer does not have: it is refused with what to send instead, rather than
answered with text the client would take for "no call".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError


def _error(name: str, message: str, hint: str | None = None) -> RequestError:
    e = RequestError(message, hint)
    e.field = name  # the request field it is about (the server's error `param`)
    return e


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # as sent: what the chat template renders
    mode: str  # "none", "named" or "required"
    name: str | None = None  # the named function
    schema: dict | None = None  # the reply's JSON schema (named, required)


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
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not name:
            raise _error("tools", f"tools[{i}].function.name must be a non-empty string")
        if name in out:
            raise _error("tools", f"tools[{i}]: a second function named {name!r}", "give each function its own name")
        if not isinstance(params, dict):
            raise _error("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = params
    return out


def parse_tools(body: dict) -> ToolRequest | None:
    """The chat body's tools and tool_choice (and parallel_tool_calls); None when it has no tools (tool_choice may
    then only be absent, "none" or "auto")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _error("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _error("tool_choice", "tool_choice names a call but the request has no tools",
                         "send the functions in tools")
        return None
    functions = _functions(tools)
    if choice == "none":
        return ToolRequest(list(tools), "none")
    if choice is None or choice == "auto":
        raise _error("tool_choice", f"tool_choice {choice or 'auto'!r} (the default with tools) needs a parser of the "
                     "model's own tool-call syntax, which infer does not have",
                     'send "tool_choice": "required" or a named function (the reply is then constrained to a call), '
                     'or "none" (the model writes text)')
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolRequest(list(tools), "required", schema=schema)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise _error("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got "
                                    f"{json.dumps(choice)[:80]}", NAMED_HINT)
    if name not in functions:
        raise _error("tool_choice", f"tool_choice names {name!r}, which is not among the tools",
                     f"tools has: {', '.join(functions)}")
    return ToolRequest(list(tools), "named", name=name, schema=functions[name])


def _call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_calls(req: ToolRequest | None, text: str) -> list[dict] | None:
    """The reply `text` as OpenAI's tool_calls; None when it asks for none, or when the reply did not complete
    (cut by max_tokens or a stop string: not JSON), which then stays text."""
    if req is None or req.mode == "none":
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if req.mode == "named":
        return [_call(req.name, text)]
    if not isinstance(value, list):
        return None
    return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]
