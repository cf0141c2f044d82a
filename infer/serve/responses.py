"""OpenAI's Responses API, `POST /v1/responses`, as vLLM serves it: a Responses body is turned into the chat body
/v1/chat/completions would get for it (`to_chat`), parsed, checked and run exactly as that chat request (the same
template, tools, reasoning split, structured outputs, LoRA, limits and metrics), and its reply is written back as a
Responses object, whole or as OpenAI's typed stream events.

- `input`: a string (one user message) or a list of items: messages ({"role", "content": str | [{"type":
  "input_text" | "output_text", "text"}]}, with or without "type": "message"; "developer" is a system message),
  "function_call" items (an assistant turn's tool_calls), "function_call_output" items (tool messages) and
  "reasoning" items (the next assistant turn's reasoning). `instructions`: a system message first.
- `max_output_tokens` is chat's max_tokens, `text.format` its response_format, `reasoning.effort` its
  reasoning_effort; function tools come in the Responses shape ({"type": "function", "name", "parameters"}), and
  tool_choice {"type": "function", "name"}. vLLM's extra sampling fields are taken as chat takes them.
- the reply: a "reasoning" output item (with --reasoning-parser), a "message" item, then one "function_call" item per
  call; status "incomplete" (incomplete_details.reason "max_output_tokens") when the reply was cut at its length.
- infer keeps no responses (as vLLM without its response store): `store` is taken, nothing is stored and the
  reply says `store: false`;
  previous_response_id, conversation, background and GET /v1/responses/{id} are refused with why, and so are
  built-in tools (web_search...) and input other than text.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine.inputs import tool_arguments
from ..errors import RequestError
from . import protocol as p
from .body import SafeJSONResponse, request_body
from .embeddings import generation_refusal
from .reasoning import parts as reasoning_parts
from .tools import reads_whole_reply, visible
from .toolstream import CallStream, partial_calls

log = logging.getLogger("infer.serve")

# the Responses fields that become a chat field of another name, for the errors the chat parsing gives
_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "response_format": "text", "reasoning_effort": "reasoning"}
# an engine refusal at submit names the prompt it was given: the client sent `input`
_SUBMIT_NAMES = {**_PARAM_NAMES, "prompt": "input"}
# vLLM's extra sampling and template fields, taken as /v1/chat/completions takes them
_PASSED = {"temperature", "top_p", "seed", "user", "metadata", "stream", "model", "parallel_tool_calls", "top_k",
           "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids",
           "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids", "include_stop_str_in_output",
           "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "bad_words",
           "cache_salt", "priority", "request_id", "chat_template", "chat_template_kwargs", "structured_outputs",
           "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
           "guided_whitespace_pattern", "include_reasoning", "return_token_ids", "max_length", "length_penalty",
           "documents", "vllm_xargs", "kv_transfer_params", "mm_processor_kwargs"}
# Responses fields that change nothing in a reply here (echoed where OpenAI echoes them)
_TAKEN = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning", "store",
          "include", "truncation", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
          "top_logprobs", "previous_response_id", "background", "conversation", "prompt", "max_tool_calls"}
# chat fields a client may send here by mistake: a 400 naming the Responses field (else silently another reply)
_CHAT_ONLY = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
              "response_format": "text.format", "reasoning_effort": "reasoning.effort", "logprobs": "top_logprobs"}
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's (echoed; nothing changes here)
LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the reply's logprobs
NOT_STORED = ("infer keeps no responses (as vLLM without its response store): send the whole conversation in "
              "`input` instead")


def _bad(message: str, param: str | None, code: str | None = None) -> p.ApiError:
    return p.ApiError(400, message, param=param, code=code)


def renamed(e: p.ApiError, names: dict[str, str] = _PARAM_NAMES) -> p.ApiError:
    """A chat parsing error in the words of the Responses field the client sent."""
    if e.code == "unknown_parameter":  # a chat field sent here: named as sent
        return e
    param = names.get(e.param, e.param)
    message = e.message
    for chat, ours in (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                       ("response_format", "text.format"), ("reasoning_effort", "reasoning.effort")):
        message = message.replace(chat, ours)
    return p.ApiError(e.status, message, param=param, code=e.code, type=e.type, headers=e.headers)


def _text_parts(content: Any, where: str, param: str = "input") -> list[dict] | str:
    """A message's content (`where`: "input[i].content", or a function_call_output's "input[i].output"): a string, or
    its text parts as chat's {"type": "text"} parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of input_text parts, got {type(content).__name__}", param)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{k}] is {kind}: infer serves text models, only input_text is taken", param)
        else:
            raise _bad(f"{where}[{k}] must be {{\"type\": \"input_text\", \"text\": ...}}", param)
    return out


def _messages(body: dict) -> list[dict]:
    """`instructions` and `input` as chat messages."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if given is None:
        raise _bad("missing required field 'input' (a string, or a list of message items)", "input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        got = "an empty list" if isinstance(given, list) else f"a {type(given).__name__}"
        raise _bad(f"input must be a string or a non-empty list of items, got {got}", "input")
    thought = None  # a reasoning item's text: the next assistant turn's
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object (a message or a function_call / function_call_output item)",
                       "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            m = {"role": "system" if role == "developer" else role,
                 "content": _text_parts(item.get("content"), f"{where}.content")}
            if role == "assistant" and thought is not None:
                m["reasoning"], thought = thought, None
            thought = _thought_turn(messages, thought)
            messages.append(m)
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
                raise _bad(f"{where}: a function_call item needs string call_id, name and arguments", "input")
            if arguments:
                try:  # (as chat's history: JSON text, else refused as vLLM's json.loads refuses it)
                    tool_arguments(arguments, f"{where}.arguments")
                except RequestError as e:
                    raise _bad(str(e), "input") from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thought is None:  # the same turn's calls
                last.setdefault("tool_calls", []).append(call)
            else:
                m = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thought is not None:
                    m["reasoning"], thought = thought, None
                messages.append(m)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(f"{where}: a function_call_output item needs a string call_id", "input")
            # a list of parts stays one: the chat reads it as a message's content (its parts joined by newlines for a
            # template that renders a string, kept for one that loops over them), as vLLM's tool message has it
            output = _text_parts(output, f"{where}.output")
            thought = _thought_turn(messages, thought)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            texts = [c.get("text") for c in (item.get("content") or []) if isinstance(c, dict)]
            thought = "".join(t for t in texts if isinstance(t, str))
        elif kind == "item_reference":
            raise _bad(f"{where} is an item_reference: {NOT_STORED}", "input")
        else:
            raise _bad(f"{where} has type {kind!r}: infer takes message, function_call, function_call_output and "
                       "reasoning items", "input")
    if not messages:  # reasoning items alone: no turn to answer (the chat check would name `messages`)
        raise _bad("input holds no message: reasoning items go with the conversation they belong to (send the user's "
                   "message too)", "input")
    _thought_turn(messages, thought)
    return messages


def _thought_turn(messages: list[dict], thought: str | None) -> None:
    """A reasoning item that no assistant message or function call follows (one before a user message, or last)
    is an assistant turn of its own, as vLLM reads every reasoning item (it was dropped from the prompt). None."""
    if thought is not None:
        messages.append({"role": "assistant", "content": "", "reasoning": thought})


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools must be a list of {\"type\": \"function\", \"name\": ..., \"parameters\": {...}}",
                       "tools")
        out = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise _bad(f"tools[{i}] has type {kind!r}: built-in tools (web_search, file_search, "
                           "code_interpreter, mcp...) are not supported; infer serves function tools only", "tools")
            if "function" in tool and "name" not in tool:
                raise _bad(f"tools[{i}] is in the chat completions shape; the Responses API's is {{\"type\": "
                           "\"function\", \"name\": ..., \"parameters\": {...}}", "tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        chat["tools"] = out
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": "
                       f"...}}; got {json.dumps(choice)[:80]} (built-in tools are not supported)", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice


def _text_format(body: dict, chat: dict) -> None:
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise _bad("text must be an object, e.g. {\"format\": {\"type\": \"json_object\"}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema must be a JSON schema object", "text")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise _bad(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")


def to_chat(body: Any, max_logprobs: int = 20) -> dict:
    """The chat body /v1/chat/completions would run for this Responses body (ApiError 400 for what is not taken)."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    if body.get("previous_response_id") is not None:
        raise _bad(f"previous_response_id is not supported: {NOT_STORED}", "previous_response_id",
                   "previous_response_not_found")
    if body.get("conversation") is not None:
        raise _bad(f"conversation is not supported: {NOT_STORED}", "conversation")
    if body.get("prompt") is not None:
        raise _bad("prompt (a stored prompt template) is not supported: send the text in instructions and input",
                   "prompt")
    if body.get("background") not in (None, False):
        raise _bad("background is not supported: infer keeps no responses to poll; send the request with stream "
                   "true, or wait for its reply", "background")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise _bad("store must be true or false", "store")
    for name in ("prompt_cache_key", "safety_identifier"):  # echoed in the reply: their type as OpenAI's
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"{name} must be a string", name)
    if body.get("service_tier") is not None and body["service_tier"] not in SERVICE_TIERS:
        got = json.dumps(body["service_tier"])[:40]
        raise _bad(f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {got}", "service_tier")
    mtc = body.get("max_tool_calls")
    if mtc is not None and (not isinstance(mtc, int) or isinstance(mtc, bool) or mtc < 1):
        raise _bad(f"max_tool_calls must be a positive integer, got {json.dumps(mtc)[:40]}", "max_tool_calls")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise _bad(f"truncation must be \"disabled\" (or \"auto\", not supported), got "
                   f"{json.dumps(body['truncation'])[:40]}", "truncation")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation 'auto' is not supported: a conversation longer than the context is refused (use "
                   "truncate_prompt_tokens to keep its end)", "truncation")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise _bad("include must be a list of strings, e.g. [\"message.output_text.logprobs\"]", "include")
    for name, ours in _CHAT_ONLY.items():
        if name in body and body[name] is not None:
            raise _bad(f"{name} is a chat completions field; the Responses API's is {ours}", name,
                       "unknown_parameter")
    if body.get("n") not in (None, 1):
        raise _bad("n is not a Responses API field: a response has one reply (send one request per reply)", "n",
                   "unknown_parameter")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items())):
        raise _bad("metadata must be an object of at most 16 string values (keys up to 64 characters, values up "
                   "to 512), as OpenAI's", "metadata")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user must be a string", "user")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise _bad("reasoning must be an object, e.g. {\"effort\": \"low\"}", "reasoning")
    chat = {k: v for k, v in body.items() if k in _PASSED}
    chat["messages"] = _messages(body)
    last = body["input"][-1] if isinstance(body["input"], list) else {}
    if last.get("type", "message") == "message" and last.get("role") == "assistant" and \
            last.get("status") in ("in_progress", "incomplete"):
        # an incomplete assistant message last (a reply cut at max_output_tokens, sent back): the reply continues
        # it, as vLLM continues a partial final message
        chat.update(continue_final_message=True, add_generation_prompt=False)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if reasoning and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if LOGPROBS in (include or []):  # as vLLM: the reply's logprobs only when included, top_logprobs alternatives
        chat.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    elif body.get("top_logprobs") is not None:
        top = body["top_logprobs"]
        most = max_logprobs  # the engine's (-1: any number, and -1 for the whole vocabulary)
        if not isinstance(top, int) or isinstance(top, bool) or not (0 <= top <= most if most != -1 else top >= -1):
            allowed = f"in 0..{most}" if most != -1 else "of at least 0, or -1 (the whole vocabulary)"
            raise _bad(f"top_logprobs must be an integer {allowed}, got {json.dumps(top)[:40]}" + (
                f" (the server's max_logprobs is {most}: start it with a larger --max-logprobs N; -1: the whole "
                "vocabulary)" if most != -1 and isinstance(top, int) and top > most else ""), "top_logprobs")
    _tools(body, chat)
    _text_format(body, chat)
    ignored = sorted(k for k in body if k not in _PASSED | _TAKEN)
    if ignored:  # as vLLM's log line
        log.warning("the following fields were present in the request but ignored: %s", ", ".join(ignored))
    return chat


# ---------------------------------------------------------------------------------------------- the reply
def _ids(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class Reply:
    """What a Responses object holds but its output: the request's echoed fields, its id and its usage."""

    def __init__(self, body: dict, req: p.GenerationRequest, rid: str, model: str, tokenizer):
        self.body, self.req, self.rid, self.model, self.tokenizer = body, req, rid, model, tokenizer
        self.created = time.time()
        self.ids = {"msg": _ids("msg"), "rs": _ids("rs")}
        self.usage = None

    def envelope(self, status: str, output: list[dict]) -> dict:
        b, params = self.body, self.req.params
        out = {"id": self.rid, "object": "response", "created_at": int(self.created), "status": status,
               "background": False, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
               "max_tool_calls": b.get("max_tool_calls"), "metadata": b.get("metadata") or {}, "model": self.model,
               "output": output, "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
               "previous_response_id": None, "prompt_cache_key": b.get("prompt_cache_key"),
               "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"),
                             "summary": (b.get("reasoning") or {}).get("summary")},
               "safety_identifier": b.get("safety_identifier"), "service_tier": b.get("service_tier") or "auto",
               # false whatever the request said: nothing is stored (vLLM without its store sets the request's
               # store to false, so its reply says so; a client reading true would retrieve a 404)
               "store": False, "temperature": params.temperature,
               "text": b.get("text") or {"format": {"type": "text"}},
               "tool_choice": b.get("tool_choice") or "auto",
               "tools": b.get("tools") or [], "top_logprobs": b.get("top_logprobs") or 0, "top_p": params.top_p,
               "truncation": b.get("truncation") or "disabled", "usage": self.usage, "user": b.get("user")}
        return out

    def count(self, prompt_n: int, output_n: int, cached: int, reasoning: str | None) -> None:
        thought = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        # cache_write_tokens (which the SDK's InputTokensDetails requires): not counted here, 0
        self.usage = {"input_tokens": prompt_n, "input_tokens_details": {"cached_tokens": cached,
                                                                         "cache_write_tokens": 0},
                      "output_tokens": output_n, "output_tokens_details": {"reasoning_tokens": min(thought, output_n)},
                      "total_tokens": prompt_n + output_n}

    def reasoning_item(self, text: str, status: str = "completed") -> dict:
        return {"type": "reasoning", "id": self.ids["rs"], "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": status}

    def logprobs(self, records: list[dict] | None) -> list[dict]:
        """The reply's token records as output_text's logprobs (chat's logprobs content: token, logprob, bytes,
        top_logprobs)."""
        return p.chat_logprobs(records, self.tokenizer, bool(self.req.tokens_as_ids))["content"] if records else []

    def message_item(self, text: str, status: str = "completed", records: list[dict] | None = None) -> dict:
        content = [] if status == "in_progress" else [_output_text(text, self.logprobs(records))]
        return {"type": "message", "id": self.ids["msg"], "status": status, "role": "assistant", "content": content}

    def output(self, reasoning: str | None, content: str | None, calls: list[dict] | None, status: str,
               records: list[dict] | None = None) -> list:
        out = []
        if reasoning:  # (none: a reply that wrote no reasoning, as a stream sends no reasoning item for it)
            out.append(self.reasoning_item(reasoning, _thought_status(status, content, calls)))
        if content or not calls:
            out.append(self.message_item(content or "", status, records))
        out += [_call_item(c) for c in calls or []]
        return out


def _output_text(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].rsplit("-", 1)[-1], "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"], "status": status}


def _thought_status(status: str, content: str | None, calls) -> str:
    """A reply's reasoning item's status: incomplete when the reply was cut inside it (nothing after it), as
    OpenAI's and vLLM's."""
    return "incomplete" if status == "incomplete" and not content and not calls else "completed"


def _status(out) -> str:
    return "incomplete" if p.finish_reason(out) == "length" else "completed"


def _parts(req: p.GenerationRequest, text: str) -> tuple[str | None, str | None, list[dict] | None]:
    """(reasoning, content, calls) of a finished reply, as the chat message has them."""
    thought, text, calls = p.reply_parts(req, text)
    return (thought if req.reasoning is not None and req.reasoning.include else None), text, calls


async def _whole(server, req, reply: Reply, queue, ids, request, arrival):
    from .app import _ClientGone, _error  # noqa: PLC0415 (the chat route's helpers; app.py imports this module)
    final = None
    try:
        async with aclosing(server.outputs(queue, ids, request, arrival)) as outs:
            async for _, out in outs:
                if out.finished:
                    if out.finish_reason in ("error", "abort"):
                        raise _error(out)
                    final = out
    except _ClientGone:
        return SafeJSONResponse({}, status_code=499)  # nobody reads it
    thought, content, calls = _parts(req, final.text)
    status = "completed" if calls else _status(final)
    reply.count(len(final.prompt_token_ids), final.num_generated, final.num_cached_tokens, thought)
    return SafeJSONResponse(reply.envelope(status, reply.output(thought, content, calls, status, final.logprobs)))


def _sse(event: dict) -> str:
    from .app import _dumps  # noqa: PLC0415
    return f"event: {event['type']}\ndata: {_dumps(event)}\n\n"


async def _stream(server, req, reply: Reply, queue, ids, arrival):
    """OpenAI's typed events; an error once the stream started is an `error` event, as OpenAI ends such a stream."""
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return _sse({"type": kind, **fields, "sequence_number": seq - 1})

    try:
        async with aclosing(_events(server, req, reply, queue, ids, arrival, event)) as events:
            async for chunk in events:
                yield chunk
    except p.ApiError as e:
        yield event("error", code=e.code or e.type, message=e.message, param=e.param)
    except Exception as e:  # noqa: BLE001 (a bug of the server: the client is told, not left with a cut stream)
        log.exception("unhandled error in the stream %s", reply.rid)
        yield event("error", code="server_error", message=f"{type(e).__name__}: {e}", param=None)


async def _events(server, req, reply: Reply, queue, ids, arrival, event):
    from .app import _error  # noqa: PLC0415
    yield event("response.created", response=reply.envelope("in_progress", []))
    yield event("response.in_progress", response=reply.envelope("in_progress", []))
    index = 0  # the next output item's
    open_item = None  # "rs" or "msg": the item whose text is streaming
    thought_sent = text_sent = ""
    lp_sent = 0  # the reply's token records sent in deltas
    thought_done = req.reasoning is None or not req.reasoning.include

    def start(kind: str):
        item = reply.reasoning_item("", "in_progress") if kind == "rs" else reply.message_item("", "in_progress")
        if kind == "rs":
            item["content"] = []
        part = {"type": "reasoning_text", "text": ""} if kind == "rs" else _output_text("")
        return [event("response.output_item.added", output_index=index, item=item),
                event("response.content_part.added", item_id=reply.ids[kind], output_index=index, content_index=0,
                      part=part)]

    def finish(kind: str, text: str, records=None, cut: bool = False):
        done = "response.reasoning_text.done" if kind == "rs" else "response.output_text.done"
        extra = {} if kind == "rs" else {"logprobs": reply.logprobs(records)}
        part = {"type": "reasoning_text", "text": text} if kind == "rs" else _output_text(text, extra["logprobs"])
        item = reply.reasoning_item(text, "incomplete" if cut else "completed") if kind == "rs" else \
            reply.message_item(text, status, records)
        closed.append(item)
        return [event(done, item_id=reply.ids[kind], output_index=index, content_index=0, text=text, **extra),
                event("response.content_part.done", item_id=reply.ids[kind], output_index=index, content_index=0,
                      part=part),
                event("response.output_item.done", output_index=index, item=item)]

    def stray(out, text: str, pieces: list[dict]):
        """The end of a reply whose calls went out streamed but are not (all) read whole (its text broke after them,
        serve/toolstream.py's known limit): what went out stands, each call done as it went out (those the whole
        reply does not read "incomplete"), then the reply's text after what went out in a message of its own (a
        fresh item at the next index, not the closed one again at a call's), the response's output these items."""
        nonlocal index
        for piece in pieces:  # (the rest of a call the whole reply reads)
            call_id, name, _ = stream.sent[piece["index"]]
            item = _call_item({"id": call_id, "function": {"name": name, "arguments": ""}})
            yield event("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=index + piece["index"], delta=piece["function"]["arguments"])
        for k, (call_id, name, args) in enumerate(stream.sent):
            item = _call_item({"id": call_id, "function": {"name": name, "arguments": args}},
                              "completed" if k < len(calls or []) else "incomplete")
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index + k,
                        name=name, arguments=args)
            yield event("response.output_item.done", output_index=index + k, item=item)
            closed.append(item)
        index += len(stream.sent)
        rest, records = text[len(text_sent):] if text.startswith(text_sent) else "", (out.logprobs or [])[lp_sent:]
        if rest:
            reply.ids["msg"] = _ids("msg")
            yield from start("msg")
            yield event("response.output_text.delta", item_id=reply.ids["msg"], output_index=index, content_index=0,
                        delta=rest, logprobs=reply.logprobs(records))
            yield from finish("msg", rest, records)
        reply.count(len(out.prompt_token_ids), out.num_generated, out.num_cached_tokens, final[0])
        yield event("response.completed" if status == "completed" else "response.incomplete",
                    response=reply.envelope(status, closed))

    status = "completed"
    closed = []  # the items done, in order
    stream = CallStream(req.tools)  # the calls' items as they went out
    memo = {}  # the reply's reads kept from token to token (harmony's: serve/reasoning.py's harmony_read)
    async with aclosing(server.outputs(queue, ids, None, arrival)) as outs:
        async for _, out in outs:
            if out.finished and out.finish_reason in ("error", "abort"):
                raise _error(out)
            if out.finished:  # as the whole response reads it (the same calls, ids included)
                final = _parts(req, out.text)
                thought, text, calls = final[0] or "", final[1] or "", final[2]
                status = "completed" if calls else _status(out)
                pieces = stream.deltas(calls or [], finished=True)
                for call, call_id in zip(calls or [], stream.ids()):
                    call["id"] = call_id  # (the items streamed)
                if len(stream.sent) > len(calls or []):
                    for e in stray(out, text, pieces):
                        yield e
                    return
            else:
                text, thought, pieces = out.text, "", []
                if req.reasoning is not None:
                    thought, text = reasoning_parts(req.reasoning, out.text, False, memo)
                if req.tools is not None and req.tools.mode == "auto":
                    # the calls as they come, after the message (harmony's content may go on after a call: whole)
                    if not reads_whole_reply(req.tools):
                        pieces = stream.deltas(partial_calls(req.tools, text, stream.memo))
                    text = visible(req.tools, out.text if reads_whole_reply(req.tools) else text, memo)
                elif req.tools is not None and req.tools.mode != "none":  # a forced call: no message, the call
                    pieces, text = stream.deltas(partial_calls(req.tools, text, stream.memo)), ""  # as it comes
            if not thought_done and thought and len(thought) > len(thought_sent):
                if open_item is None:
                    open_item = "rs"
                    for e in start("rs"):
                        yield e
                yield event("response.reasoning_text.delta", item_id=reply.ids["rs"], output_index=index,
                            content_index=0, delta=thought[len(thought_sent):])
                thought_sent = thought
            if open_item == "rs" and (text or pieces or out.finished):  # the answer starts: the reasoning is whole
                cut = out.finished and _thought_status(status, text, calls) == "incomplete"
                for e in finish("rs", thought_sent, cut=cut):
                    yield e
                open_item, index, thought_done = None, index + 1, True
            if text and len(text) > len(text_sent):
                if open_item is None:
                    open_item = "msg"
                    for e in start("msg"):
                        yield e
                records = (out.logprobs or [])[lp_sent:]  # the tokens since the last delta (its text may lag)
                lp_sent += len(records)
                yield event("response.output_text.delta", item_id=reply.ids["msg"], output_index=index,
                            content_index=0, delta=text[len(text_sent):], logprobs=reply.logprobs(records))
                text_sent = text
            if out.finished and open_item is None and not calls and not stream.sent:  # an empty reply: its
                open_item = "msg"  # message all the same
                for e in start("msg"):
                    yield e
            if open_item == "msg" and (pieces or out.finished):  # the calls start: the message is whole
                for e in finish("msg", text_sent, out.logprobs if out.finished else (out.logprobs or [])[:lp_sent]):
                    yield e
                open_item, index = None, index + 1
            for piece in pieces:  # each call an item, its arguments in pieces
                call_id, name, _ = stream.sent[piece["index"]]
                item = _call_item({"id": call_id, "function": {"name": name, "arguments": ""}}, "in_progress")
                at = index + piece["index"]
                if "id" in piece:
                    yield event("response.output_item.added", output_index=at, item=item)
                if piece["function"]["arguments"]:
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                delta=piece["function"]["arguments"])
            if not out.finished:
                continue
            for k, call in enumerate(calls or []):
                item = _call_item(call)
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index + k,
                            name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index + k, item=item)
            reply.count(len(out.prompt_token_ids), out.num_generated, out.num_cached_tokens, final[0])
            whole = reply.envelope(status, reply.output(*final, status, out.logprobs))
            yield event("response.completed" if status == "completed" else "response.incomplete", response=whole)


async def create(server, request: Request):
    """POST /v1/responses."""
    arrival = time.monotonic()
    raw = await request_body(server, request)
    if raw is None:
        return Response(status_code=499)  # nobody reads it
    generation_refusal(server, "Responses")
    sent: dict = {}

    def convert(body):
        sent.update(body if isinstance(body, dict) else {})
        return to_chat(body, getattr(server, "sampling_defaults", {}).get(p.MAX_LOGPROBS, 20))

    try:
        req = await server.parser.parse(raw, True, convert)
        del raw
        lora = server.lora_for(req.model)
        p.check_context(req, server.engine.max_model_len)
    except p.ApiError as e:
        raise renamed(e) from e
    if req.tokens_as_ids is None:  # --return-tokens-as-token-ids: the logprobs' tokens as token_id:ID, as vLLM's
        req.tokens_as_ids = server.tokens_as_ids
    model = req.model or server.model_id
    base = request.headers.get("x-request-id") or req.request_id
    reply = Reply(sent, req, "resp_" + (base or uuid.uuid4().hex), model, server.tokenizer)
    try:
        queue, ids = server.submit(req, lora, _ids("resp"))
    except p.ApiError as e:  # the engine's refusal names the prompt: here it is `input` (`prompt` is another field)
        raise renamed(e, _SUBMIT_NAMES) from e
    if req.stream:
        return StreamingResponse(_stream(server, req, reply, queue, ids, arrival), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(server, req, reply, queue, ids, request, arrival)


def add_routes(app, server) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request):
        return await create(server, request)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored(request: Request, response_id: str):
        server.check_auth(request)
        raise p.ApiError(404, f"no response {response_id!r}: {NOT_STORED}", param="response_id",
                         code="response_not_found")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str):
        server.check_auth(request)
        raise p.ApiError(404, f"no response {response_id!r}: {NOT_STORED} (background responses are not "
                              "supported)", param="response_id", code="response_not_found")

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str):
        server.check_auth(request)
        raise p.ApiError(404, f"no response {response_id!r}: {NOT_STORED}", param="response_id",
                         code="response_not_found")
