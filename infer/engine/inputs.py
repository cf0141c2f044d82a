"""One input request (a JSONL line, an API call) -> validated prompt token ids, SamplingParams and adapter name.

Prompts are tokenized exactly as transformers does: `tokenizer(prompt)` for text, and
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` for chat messages (the tokenizer's template is
--chat-template's where one was given: engine.setup.load_tokenizer; a call's own comes as `chat_template` among the
template's arguments).
"""

from __future__ import annotations

import difflib
import json
import shlex
from dataclasses import dataclass
from typing import Any

from ..checks import _loops_over_content, check_text, reads_content_parts  # noqa: F401 (re-exported)
from ..errors import RequestError, UnknownModelError
from .pooling import EMBEDDINGS_URL, POOLING_URL, PoolingParams, embedding_fields, embedding_inputs, \
    embedding_request_id, pooling_task_params
from .prompt_size import PromptTooLongError, check_prompt_size
from .sampling_params import SamplingParams
from .structured import from_openai

_PARAM_TYPES: dict[str, tuple] = {
    "max_new_tokens": (int,), "max_length": (int,), "temperature": (int, float), "top_p": (int, float),
    "top_k": (int,), "repetition_penalty": (int, float), "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "stop": (str, list), "stop_token_ids": (list,), "seed": (int,),
    "ignore_eos": (bool,), "prefix_token_ids": (list,), "logprobs": (int, bool),
    "min_p": (int, float), "min_tokens": (int,), "logit_bias": (dict,), "allowed_token_ids": (list,),
    "include_stop_str_in_output": (bool,), "skip_special_tokens": (bool,), "spaces_between_special_tokens": (bool,),
    "detokenize": (bool,), "truncate_prompt_tokens": (int,),
    "prompt_logprobs": (int,), "structured_outputs": (dict,), "bad_words": (list,), "cache_salt": (str,),
    "priority": (int,),  # vLLM's request priority (the engine refuses another value than 0 unless it schedules by it)
}
_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_OTHER_KEYS = {"id", "lora"}
# OpenAI request bodies (batch lines) name some parameters differently
_OPENAI_ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
# OpenAI request fields whose only supported value is their default: name -> (is it the default?, what to say)
UNSUPPORTED_OPENAI = {
    "n": (lambda v: v is None or v == 1, "only n=1 is supported"),
    "best_of": (lambda v: v is None or v == 1, "only best_of=1 is supported"),
    "echo": (lambda v: v is None or v is False, "echo is not supported"),
    "suffix": (lambda v: v is None or v == "", "suffix is not supported"),
    "tools": (lambda v: not v, "tool calls are not supported"),
    "functions": (lambda v: not v, "function calls are not supported"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calls are not supported"),
    "function_call": (lambda v: v in (None, "none", "auto"), "function calls are not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    # vLLM's extensions that change the reply: silently dropped, the client would get another reply than it asked
    "use_beam_search": (lambda v: v is None or v is False, "beam search is not run for batch lines (`infer serve` "
                                                           "takes use_beam_search per request, as vLLM's server; "
                                                           "from Python: LLM.beam_search)"),
    # (these two were dropped without a word; SamplingParams refuses the first at other values than this)
    "logits_processors": (lambda v: not v, "logits_processors are not supported"),
    "prompt_embeds": (lambda v: v is None, "prompt_embeds are not supported: send the prompt as text or token ids"),
    # vLLM's cap on a reasoning model's think block (it ends the block after that many tokens): not done here
    "thinking_token_budget": (lambda v: v is None, "thinking_token_budget is not supported: the think block is not "
                                                   "capped (cap the whole reply with max_tokens)"),
}

# vLLM's chat fields that reach the chat template (chat_template_options), and the value that leaves it as it is: a
# request with a prompt instead of messages has no template, and is refused another value rather than ignoring it
CHAT_TEMPLATE_FIELDS = {"add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": None,
                        "documents": None}
# vLLM's reasoning_effort values; it reaches the template, with enable_thinking (unless chat_template_kwargs sets it)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# apply_chat_template's own arguments: in chat_template_kwargs they would change how the text is tokenized (or say
# what a field of the request says), not what the template renders
_TEMPLATE_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                  "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                  "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


# what a chat to a model without a template is told
NO_TEMPLATE_HINT = ("give it one with --chat-template FILE (infer run / serve / bench; LLM(model, "
                    "chat_template=...)), or send `prompt` instead of `messages`")
REQUEST_TEMPLATE_FIELD = "chat_template"  # vLLM's per-request template (the server's --trust-request-chat-template)


def _field_error(field: str, message: str, hint: str | None = None) -> RequestError:
    e = RequestError(message, hint)
    e.field = field  # the request field it is about (the server's error `param`)
    return e


def chat_template_options(body: dict, where: str = "") -> dict:
    """apply_chat_template's keyword arguments for vLLM's chat fields of `body`: add_generation_prompt (default
    true), continue_final_message, documents and chat_template_kwargs (variables the template reads, such as
    Qwen3's enable_thinking). `where` prefixes the field names in errors ("body." for a batch line)."""
    for key in ("add_generation_prompt", "continue_final_message"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _field_error(key, f"{where}{key} must be a boolean, got {type(body[key]).__name__}")
    add, cont = body.get("add_generation_prompt"), body.get("continue_final_message") is True
    if cont and add is not False:  # as vLLM (add_generation_prompt defaults to true there too)
        raise _field_error("continue_final_message", f"{where}continue_final_message=true needs "
                           f"add_generation_prompt=false ({'it is true' if add else 'it defaults to true'})",
                           f"send {where}add_generation_prompt: false with it: the final message is continued, no "
                           "new assistant turn is opened")
    options = {"add_generation_prompt": add is not False, "continue_final_message": cont}
    docs = body.get("documents")
    if docs is not None:
        if not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs):
            raise _field_error("documents", f"{where}documents must be a list of objects",
                               'e.g. [{"title": "...", "text": "..."}]')
        options["documents"] = docs
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _field_error("chat_template_kwargs", f"{where}chat_template_kwargs must be an object, got "
                               f"{type(kwargs).__name__}", 'e.g. {"enable_thinking": false}')
        reserved = sorted(set(kwargs) & _TEMPLATE_ARGS)
        if reserved:
            fields = [k for k in reserved if k in CHAT_TEMPLATE_FIELDS or k == "tools"]  # the request's own
            raise _field_error("chat_template_kwargs", f"{where}chat_template_kwargs cannot set {', '.join(reserved)}",
                               f"send {' and '.join(where + k for k in fields)} as a field of the request itself"
                               if fields else "they are arguments of the tokenization, not variables of the template")
        options.update(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:  # as vLLM: a variable of the template, and thinking on unless it is "none"
        if effort not in REASONING_EFFORTS:
            raise _field_error("reasoning_effort", f"{where}reasoning_effort must be one of "
                               f"{', '.join(REASONING_EFFORTS)}, got {json.dumps(effort)}")
        options["reasoning_effort"] = effort
        if "enable_thinking" not in (kwargs or {}):
            options["enable_thinking"] = effort != "none"
    return options


def check_no_chat_template_fields(body: dict, where: str = "") -> None:
    """A prompt that is not chat messages has no template: its vLLM chat fields are refused, not ignored."""
    for key, default in CHAT_TEMPLATE_FIELDS.items():
        if body.get(key) not in (None, default, {}, []):
            raise _field_error(key, f"{where}{key} applies to chat messages only",
                               "send messages (a chat completion), or remove it")


# OpenAI's sampling fields a request may leave out, and what it then gets (vLLM's rule): the model's
# generation_config.json value, else OpenAI's default (temperature 1; the others' defaults switch them off)
OPENAI_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OPENAI_TEMPERATURE = 1.0


# generation_config.json's max_new_tokens, among the defaults: not a default but a cap on every OpenAI request's reply
# (vLLM's get_max_tokens: the least of the request's max_tokens, this and the context's room)
MAX_TOKENS_CAP = "\0max_tokens_cap"
# the engine's max_logprobs (EngineConfig.max_logprobs), among the server's defaults: the most logprobs and
# top_logprobs a request may ask for (-1: any number, and -1 for the whole vocabulary); 20 when not there
MAX_LOGPROBS = "\0max_logprobs"


def openai_sampling_defaults(model_path) -> dict:
    """The sampling an OpenAI request (the server, a batch line of `infer run`) gets for the fields it leaves out,
    and under MAX_TOKENS_CAP the cap generation_config.json's max_new_tokens puts on every reply (cap_max_tokens).
    A value in generation_config.json that SamplingParams refuses is left out, with a warning; so is the whole file
    when it cannot be read (a truncated copy: the model's sampling would silently be infer's)."""
    import logging
    import math
    from pathlib import Path
    out: dict = {"temperature": OPENAI_TEMPERATURE}
    gen = Path(model_path) / "generation_config.json"
    try:
        data = json.loads(gen.read_text()) if gen.is_file() else {}
    except (OSError, ValueError) as e:
        data = e
    if not isinstance(data, dict):
        logging.getLogger("infer").warning(
            "ignoring %s: %s; its sampling defaults are not used (fix the file, or copy it again with the model)",
            gen, f"it cannot be read ({data})" if isinstance(data, Exception) else "it is not a JSON object")
        data = {}
    for key in OPENAI_SAMPLING_KEYS:
        value = data.get(key)
        if value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        try:
            SamplingParams(**{key: int(value) if key == "top_k" and ok else value})
        except (RequestError, ValueError, TypeError):
            ok = False
        if ok:
            out[key] = int(value) if key == "top_k" else value
        else:
            logging.getLogger("infer").warning("ignoring %s=%r in %s: not a valid sampling value", key, value, gen)
    cap = data.get("max_new_tokens")
    if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1:
        out[MAX_TOKENS_CAP] = cap
    elif cap is not None:
        logging.getLogger("infer").warning("ignoring max_new_tokens=%r in %s: not a whole number of at least 1",
                                           cap, gen)
    return out


def cap_max_tokens(params: SamplingParams, cap: int | None) -> None:
    """Cap a reply at generation_config.json's max_new_tokens, as vLLM caps every OpenAI request (max_tokens
    larger, or none given, gets the cap); a min_tokens past it cannot be met and is refused."""
    if cap is None:
        return
    if params.max_new_tokens is None or params.max_new_tokens > cap:
        params.max_new_tokens = cap
    if params.min_tokens > cap:
        raise _field_error("min_tokens", f"min_tokens ({params.min_tokens}) is more than {cap}, the max_new_tokens "
                           "of the model's generation_config.json, which caps every request's reply (as in vLLM)",
                           f"lower min_tokens to {cap} or less")


def check_add_special_tokens(value: Any, chat: bool, where: str = "add_special_tokens") -> None:
    """vLLM's add_special_tokens: a prompt's text gets them (true), a chat's template adds its own (false); infer
    tokenizes each that way only, so the other value is refused rather than dropped."""
    default = not chat
    if value is not None and value is not default:
        what, how = ("chat messages", "chat messages with the template alone") if chat else \
            ("a text prompt", "a text prompt with its special tokens")
        raise RequestError(f"{where}={json.dumps(value)} is not supported for {what}",
                           f"leave it out: infer tokenizes {how}")


@dataclass
class ParsedRequest:
    id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # (a PoolingParams for an embeddings line)
    lora: str | None = None
    # an OpenAI batch line's: what its response is built from (chat, model, return_token_ids, request_id); None for
    # a line of infer's own format
    openai: dict | None = None


def encode_prompt(tokenizer, prompt: Any = None, messages: Any = None, max_tokens: int | None = None,
                  template: dict | None = None) -> list[int]:
    """The prompt's token ids; with `max_tokens` (the context), a text certainly longer is refused untokenized.
    `template`: apply_chat_template's keyword arguments for `messages` (chat_template_options; default: a
    generation prompt; its `chat_template`, when set, is the template itself, used instead of the tokenizer's)."""
    if messages is not None:
        template = {"add_generation_prompt": True, **(template or {})}
        if template.get("chat_template") is None:
            template.pop("chat_template", None)
        parts = reads_content_parts(tokenizer, template.get("chat_template"), template.get("tools") is not None)
        messages = chat_messages(messages, parts)
        check_text(messages, "messages")
        check_text(template, "the chat template's arguments")
        if template.get("chat_template") is None and getattr(tokenizer, "chat_template", None) is None:
            raise RequestError("this model's tokenizer has no chat template", NO_TEMPLATE_HINT)
        # measured as rendered, not by the contents: a template may leave some out (Qwen3 and DeepSeek-R1 drop the
        # <think> reasoning of earlier assistant turns), and a chat whose prompt fits is not refused for them
        _check_rendered_size(tokenizer, messages, template, max_tokens)
        try:
            enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **template)
        except Exception as e:
            raise template_error(e, template.get("chat_template") is not None) from e
        if not enc["input_ids"]:  # else "the prompt is empty (give a non-empty prompt)" for non-empty messages
            raise RequestError(f"the chat template renders these {len(messages)} message(s) as no text at all",
                               "check the template: it writes nothing for them (does it know their roles?)")
        return list(enc["input_ids"])
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
    check_text(prompt, "prompt")
    check_prompt_size(tokenizer, len(prompt.encode("utf-8")), max_tokens)
    try:
        return list(tokenizer(prompt)["input_ids"])
    except Exception as e:  # a tokenizer error is about this prompt, never about the run
        raise RequestError(f"the tokenizer cannot encode this prompt: {type(e).__name__}: {e}") from e


def _check_rendered_size(tokenizer, messages: list[dict], template: dict, max_tokens: int | None) -> None:
    """Refuse, untokenized, a chat whose rendered text is certainly longer than the context. Where the messages and
    the template's arguments (`documents`, `tools`...) could make it too long, the chat is rendered as text first (no
    tokenizer pass over megabytes of documents) and that text is measured: not the contents, some of which a
    template may leave out (the reasoning of earlier turns)."""
    if not max_tokens:
        return
    args = {k: v for k, v in template.items() if k != "chat_template"}
    size = len(json.dumps([messages, args], ensure_ascii=False, default=str).encode("utf-8"))
    try:
        check_prompt_size(tokenizer, size, max_tokens)
        return  # even all of it rendered would fit
    except PromptTooLongError:
        pass
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
    except Exception as e:
        raise template_error(e, template.get("chat_template") is not None) from e
    check_prompt_size(tokenizer, len(text.encode("utf-8")), max_tokens)


def template_error(e: Exception, own: bool = False) -> RequestError:
    """What apply_chat_template's exception `e` tells the caller: the template's own refusal of these messages
    (raise_exception, a role it does not take...), or a template that is not valid Jinja at all, which no message
    could fix (the model's, or with `own` the request's `chat_template`)."""
    import jinja2
    if not isinstance(e, jinja2.TemplateSyntaxError):
        return RequestError(f"the chat template cannot render these messages: {e}")
    line = f" (line {e.lineno})" if e.lineno else ""
    if own:
        return _field_error(REQUEST_TEMPLATE_FIELD, f"the request's chat_template is not valid Jinja{line}: "
                                                    f"{e.message}", "fix the template's syntax")
    return RequestError(f"this model's chat template is not valid Jinja{line}: {e.message}",
                        "give a working one with --chat-template FILE (infer run / serve / bench; LLM(model, "
                        "chat_template=...))")


def chat_messages(messages: Any, parts: bool = False) -> list[dict]:
    """The messages as a chat template reads them: a string role each, and every content a string. OpenAI's list of
    text parts is joined by newlines (as vLLM does); a template would otherwise render the list's Python repr into
    the prompt. With `parts` (the template loops over content: `reads_content_parts`) every content is a list of
    text parts, a string's too (as vLLM's "openai" content format). Other parts (images, audio) are refused rather
    than dropped; null content is empty (an assistant's tool call), another null field absent; an assistant's
    `reasoning` is its `reasoning_content` too (as vLLM), and either its `thinking` (gpt-oss's template's field)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise RequestError("messages must be a list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m["role"], str):
            raise RequestError(f"messages[{i}].role must be a string, got {type(m['role']).__name__}")
        # a field sent as null is not given (OpenAI's SDK sends back tool_calls, refusal... as null): vLLM leaves it out
        # of what the template reads, and a template that tests `'tool_calls' in message` (Llama 3.x) failed on it
        out.append({**{k: v for k, v in m.items() if v is not None}, "content": _content_text(m.get("content"), i,
                                                                                            parts)})
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise RequestError(f"messages[{i}].tool_calls must be a list of tool call objects, got "
                               f"{type(calls).__name__}", 'e.g. [{"id": "call_1", "type": "function", "function": '
                                                          '{"name": "f", "arguments": "{}"}}]')
        if calls == [] and m["role"] == "assistant":  # no call: the template's plain assistant turn (as vLLM)
            del out[-1]["tool_calls"]
        elif calls is not None:
            out[-1]["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        if m["role"] == "assistant" and isinstance(m.get("reasoning"), str):
            # the reply's `reasoning` (--reasoning-parser's field) sent back, as vLLM takes it: chat templates read
            # reasoning_content (Qwen3's renders it in the turns after the last user message, tool loops' turns)
            out[-1]["reasoning_content"] = m["reasoning"]
        if m["role"] == "assistant" and isinstance(out[-1].get("reasoning_content"), str) and m.get("thinking") is None:
            # gpt-oss's template reads `thinking` (the analysis it renders before a tool call of the turn in progress),
            # as vLLM's harmony rendering takes `reasoning` (or reasoning_content)
            out[-1]["thinking"] = out[-1]["reasoning_content"]
    return out


def tool_arguments(text: str, where: str) -> Any:
    """A tool call's `arguments` sent back in a request's history (`where` names the field): the value its JSON text
    encodes, a key written twice its last value (json.loads, as vLLM reads it); RequestError when the text is not
    JSON, which vLLM refuses too (its json.loads raises) rather than give the template a string to quote."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise _field_error("messages", f"{where} is not JSON: {text[:60]!r}",
                           'send the call\'s arguments as the JSON text the model wrote, e.g. "{\\"city\\": '
                           '\\"Paris\\"}" ("" or null: none)') from None


def _tool_call(call: Any, where: str) -> Any:
    """An OpenAI tool call as chat templates read it: `function.arguments` sent as a JSON string (OpenAI's form)
    becomes the object it encodes, as vLLM does (a template that writes `arguments | tojson` would otherwise quote
    the string again); none (null or "", a call without arguments) is {}, as vLLM has it; text that is not JSON is
    refused (`tool_arguments`; `where`: the call's field). The caller's message is left as it was."""
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and fn.get("arguments", "") in (None, ""):
        return {**call, "function": {**fn, "arguments": {}}}
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    args = tool_arguments(fn["arguments"], f"{where}.function.arguments")
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


# OpenAI's text-bearing content parts and the key of their text (an assistant's refusal is its text; the Responses
# API's input_text and output_text, which vLLM's chat takes as text too)
TEXT_PARTS = {"text": "text", "refusal": "refusal", "input_text": "text", "output_text": "text"}


def _content_text(content: Any, i: int, parts: bool = False) -> str | list[dict]:
    """A message's content as a template reads it: a string, its text parts joined by newlines (as vLLM does for
    templates that render content as a string), or with `parts` (a template that loops over the parts) a list of
    them as given, every part a text part; there a string is one text part and null none, as vLLM's "openai"
    content format gives them (a template that only loops over the parts would drop a string's text)."""
    if content is None or isinstance(content, str):
        if parts:
            return [] if content is None else [{"type": "text", "text": content}]
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        untyped = [k for k, p in enumerate(content) if not isinstance(p.get("type"), str)]
        if untyped:
            raise RequestError(f"messages[{i}].content[{untyped[0]}] has no string 'type'",
                               'give every part its type, e.g. {"type": "text", "text": "..."}')
        kinds = sorted({p["type"] for p in content if p["type"] not in TEXT_PARTS})
        if kinds:
            raise RequestError(f"messages[{i}].content has {', '.join(kinds)} parts; only text parts are supported",
                               "send text only: this is a text model")
        bad = [p["type"] for p in content if not isinstance(p.get(TEXT_PARTS[p["type"]]), str)]
        if bad:  # named by the key its kind holds its text in: a refusal part's is 'refusal', not 'text'
            raise RequestError(f"messages[{i}].content: every {bad[0]} part needs a string "
                               f"'{TEXT_PARTS[bad[0]]}'")
        if parts:
            return [dict(p) if p["type"] == "text" else {"type": "text", "text": p[TEXT_PARTS[p["type"]]]}
                    for p in content]
        return "\n".join(p[TEXT_PARTS[p["type"]]] for p in content)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got "
                       f"{type(content).__name__}")


def _type_name(types: tuple) -> str:
    return " or ".join({int: "integer", float: "number", str: "string", list: "list", bool: "boolean",
                        dict: "object"}[t]
                       for t in types)


# the OpenAI request fields vLLM types as integers (lists of them), which pydantic reads in lax mode: a whole number
# written as a float (5.0, as JavaScript's and some SDKs' JSON writes it) is that integer, 5.5 is refused
OPENAI_INTS = ("max_tokens", "max_completion_tokens", "n", "best_of", "top_k", "seed", "logprobs", "top_logprobs",
               "min_tokens", "truncate_prompt_tokens", "prompt_logprobs", "priority",
               "max_output_tokens")  # (/v1/responses' max_tokens)
OPENAI_INT_LISTS = ("stop_token_ids", "allowed_token_ids")


def whole_numbers(body: Any) -> Any:
    """An OpenAI request body with each integer field given as a whole float (max_tokens 5.0) as that integer, as
    vLLM reads it (answered 400 "must be an integer, got float" here); anything else as it is."""
    if not isinstance(body, dict):
        return body

    def whole(value):
        return int(value) if isinstance(value, float) and value.is_integer() else value

    out = dict(body)
    for key in OPENAI_INTS:
        if key in out:
            out[key] = whole(out[key])
    for key in OPENAI_INT_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [whole(v) for v in out[key]]
    return out


def params_from(obj: dict, aliases: dict[str, str] | None = None) -> SamplingParams:
    kwargs = {}
    for key, value in obj.items():
        if aliases and key == "max_tokens" and obj.get("max_completion_tokens") is not None:
            continue  # max_completion_tokens supersedes max_tokens wherever each comes (OpenAI, vLLM, the server)
        given, key = key, (aliases or {}).get(key, key)
        if key not in _PARAM_TYPES or value is None:
            continue
        types = _PARAM_TYPES[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise RequestError(f"field {given!r} must be {_type_name(types)}, got {type(value).__name__}")
        kwargs[key] = value
    if isinstance(kwargs.get("logprobs"), bool):  # OpenAI chat: logprobs=true + top_logprobs=k
        kwargs["logprobs"] = int(obj.get("top_logprobs") or 0) if kwargs["logprobs"] else None
    try:
        return SamplingParams(**kwargs)
    except TypeError as e:
        raise RequestError(str(e)) from e


BATCH_URLS = ("/v1/completions", "/v1/chat/completions")
BATCH_KEYS = ("custom_id", "method", "url", "body")  # an OpenAI batch line's fields


@dataclass(frozen=True)
class ModelNames:
    """What a batch line takes from the model it runs on: what its body.model may name (the base model, by any of
    its names, or a registered adapter), and the sampling it gets for the OpenAI fields it leaves out
    (openai_sampling_defaults; empty: SamplingParams' own defaults)."""
    base: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()
    sampling: tuple = ()  # ((field, value), ...)
    max_logprobs: int = 20  # the engine's (EngineConfig.max_logprobs): the most top_logprobs a chat line asks for
    labels: tuple = ()  # a classifier's label names (its lines of infer's format classify); empty: not a classifier
    per_token: bool = False  # a token classifier's (*ForTokenClassification): its lines classify every token

    def lora_for(self, model: Any) -> str | None:
        """vLLM's rule (run-batch and the server's _check_model): no name or an empty one, or a name of the base,
        runs the base; an adapter's name runs that adapter; any other name is an error for that line alone ("The
        model `X` does not exist.", 404): a batch file written for an adapter ran the base without a word when no
        adapter was registered. Without base names (`base` empty: the model's names are not known) no name is
        checked."""
        if model is not None and not isinstance(model, str):  # (before `in`: a list or an object is unhashable)
            raise RequestError(f"body.model must be a string, got {type(model).__name__}")
        if model is not None and model in self.base and model in self.adapters:  # it ran the base, unsaid
            raise RequestError(f"body.model {model!r} names both the base model and the adapter --lora {model}=...",
                               "register the adapter under another name (--lora OTHER=PATH) and name that one")
        if not model or model in self.base:  # no name or an empty one: the base, as the server runs it (and vLLM)
            return None
        if model in self.adapters:
            return model
        if not self.base:
            return None
        known = sorted(self.base, key=lambda n: (len(n), n)) + sorted(self.adapters)  # the base's shortest first
        raise UnknownModelError(f"body.model {model!r} is neither the base model nor a registered adapter: the "
                                f"model `{model}` does not exist in this run",
                                f"name one of: {', '.join(known)}, or leave body.model out for the base model; to run "
                                f"the base model by that name (a batch file written for the hub id, say), give "
                                f"--served-model-name {shlex.quote(model)} (vllm run-batch's); to run an adapter by "
                                f"that name, register it with --lora {shlex.quote(model + '=')}PATH (PATH: its PEFT "
                                "folder)", name=model, known=known)


def _batch_prompt(body: dict) -> dict:
    """OpenAI's completions prompt may be token ids or a list of prompts: a line answers one prompt."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list):
        return {}
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt": None, "prompt_token_ids": prompt}
    if not prompt:
        raise RequestError("body.prompt is an empty list", "give the prompt as a string or a list of token ids")
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _batch_prompt({"prompt": prompt[0]}) or {"prompt": prompt[0]}
    if not all(isinstance(p, (str, list)) for p in prompt):  # [true], [1.5]: not "holds 1 prompts"
        raise RequestError("body.prompt must be a string, a list of token ids (integers) or a list of such prompts",
                           'e.g. "prompt": "Hi" or "prompt": [1, 2, 3]')
    raise RequestError(f"body.prompt holds {len(prompt)} prompts; a batch line answers one",
                       "write one line per prompt, each with its own custom_id")


def _check_batch_logprobs(value: Any, chat: bool) -> None:
    """OpenAI's logprobs is a boolean for a chat (the count is top_logprobs) and the count itself for a completion,
    as the server reads them: a chat's 1 gave one alternative per token (vLLM: none) and a completion's true none
    (vLLM: one)."""
    if value is None:
        return
    if chat and not isinstance(value, bool):
        raise RequestError(f"body.logprobs must be a boolean for a chat, got {json.dumps(value)}",
                           "send \"logprobs\": true with \"top_logprobs\": N for N alternatives per token")
    if not chat and isinstance(value, bool):
        raise RequestError(f"body.logprobs must be an integer for a completion (the alternatives per token), got "
                           f"{json.dumps(value)}", "e.g. \"logprobs\": 2 (0: the sampled token's alone)")


_TEMPLATE_KEY = "\0template"  # a batch line's chat_template_options among its fields (a line's own is refused)
_OPENAI_KEY = "\0openai"  # what a batch line's response is built from (ParsedRequest.openai)
_WORDS_KEY = "\0words"  # a batch line's names for the engine's fields (max_tokens for max_new_tokens...)


def _in_body_words(e: RequestError, words: dict | None) -> RequestError:
    """SamplingParams' error in the words of the batch line's body: "max_new_tokens must be in 1..N, got 0" was
    the answer to "max_tokens": 0, and "structured_outputs cannot be combined with min_tokens" to a response_format
    (the server names the field the client sent)."""
    message, hint = e.message, e.hint
    for engine_name, body_name in (words or {}).items():
        if body_name is None or body_name == engine_name:
            continue
        message = message.replace(engine_name, "body." + body_name)
        if hint is not None:
            hint = hint.replace(engine_name, "body." + body_name)
            if engine_name == "structured_outputs":
                hint = hint.replace("the constraint", "body." + body_name)
    return e if (message, hint) == (e.message, e.hint) else RequestError(message, hint)


def _batch_body(obj: dict) -> dict:
    """An OpenAI batch line's body, its fields and method checked."""
    if "body" not in obj:
        raise RequestError("an OpenAI batch line (it has custom_id) needs a 'body' object with the request",
                           'e.g. {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", '
                           '"body": {"messages": [{"role": "user", "content": "Hi"}]}}')
    body = whole_numbers(obj["body"])
    if not isinstance(body, dict):
        raise RequestError(f"field 'body' must be an object, got {type(body).__name__}",
                           'e.g. "body": {"prompt": "Hi", "max_tokens": 16}')
    unknown = sorted(str(k) for k in obj if k not in BATCH_KEYS)
    if unknown:  # (a request field beside the body would otherwise be dropped without a word)
        raise RequestError(f"unknown field(s) {unknown} in an OpenAI batch line", f"its fields are "
                           f"{', '.join(BATCH_KEYS)}; the request's own fields go inside body")
    if obj.get("method") not in (None, "POST"):
        raise RequestError(f"method {obj['method']!r} is not supported: a batch line is a POST request",
                           'write "method": "POST" or leave it out')
    return body


def _embedding_line(obj: dict, tokenizer, default_id: str, names: ModelNames, max_tokens: int | None):
    """An OpenAI batch line of url /v1/embeddings (vLLM's run-batch, on a pooling runner): its inputs (OpenAI's
    four forms; one record answers them all, as the server's response), its PoolingParams; its response is built
    from `openai` (the model named, the encoding_format, the request_id, every input's token ids)."""
    body = _batch_body(obj)
    if body.get("messages") is not None:  # (vLLM's chat form: the server's POST /v1/embeddings takes it)
        raise RequestError(f"body.messages: an infer run line of url {obj.get('url')} takes input, not the chat "
                           "form", "give the chat's rendered text (POST /tokenize with the messages gives its ids) as "
                           f"body.input, or send the messages to a server's POST {obj.get('url')}")
    params, fmt = embedding_fields(body, "body.")
    pooling = obj.get("url") == POOLING_URL  # (vLLM's /pooling: a task of the model's, its own unless named)
    if pooling:
        params = pooling_task_params(body, params, bool(names.labels), prefix="body.", per_token=names.per_token)
    rid = embedding_request_id(body, "body.")
    keep = params.truncate_prompt_tokens is not None
    prompts = [[int(t) for t in item] if isinstance(item, list) else
               encode_prompt(tokenizer, prompt=item, max_tokens=None if keep else max_tokens)
               for item in embedding_inputs(body.get("input"), "body.input")]
    req_id = batch_custom_id(obj, default_id)
    return ParsedRequest(req_id, prompts[0], params, names.lora_for(body.get("model")),
                         openai={"embedding": True, "pooling": pooling, "chat": False, "model": body.get("model"),
                                 "encoding_format": fmt, "request_id": rid, "inputs": prompts})


CLASSIFY_PROMPTS = ("prompt", "input", "prompt_token_ids", "messages")
_CLASSIFY_FIELDS = ("truncate_prompt_tokens", "use_activation", "priority")
_CLASSIFY_CHAT = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")  # (messages' only)


def _classify_line(obj: dict, tokenizer, default_id: str, max_tokens: int | None,
                   per_token: bool = False) -> ParsedRequest:
    """A line of infer's format on a classifier (a *ForSequenceClassification model, whose lines classify as POST
    /classify does; `per_token`: a *ForTokenClassification model, whose lines classify every token, task
    token_classify): one prompt (prompt or input: a text or token ids; prompt_token_ids; messages, rendered by the
    chat template as vLLM's ClassificationChatRequest) and the pooling fields; a generation field is refused."""
    allowed = [*CLASSIFY_PROMPTS, *sorted(_OTHER_KEYS), *_CLASSIFY_FIELDS, *_CLASSIFY_CHAT]
    unknown = sorted(str(k) for k in obj if k not in allowed)
    what = ("this model is a token classifier (a *ForTokenClassification model): a line classifies every token of "
            "its prompt, generating nothing" if per_token else
            "this model is a classifier (a *ForSequenceClassification model): a line classifies its prompt, "
            "generating nothing")
    if unknown:
        sampling = [k for k in unknown if k in _PARAM_TYPES or k in _OPENAI_ALIASES]
        raise RequestError(f"{'generation' if sampling else 'unknown'} field(s) {unknown}: {what}",
                           f"remove them; a classifier's line takes {', '.join(allowed)}")
    given = [k for k in CLASSIFY_PROMPTS if obj.get(k) is not None]
    if len(given) != 1:
        raise RequestError(f"no prompt: {what}" if not given else
                           f"give only one of {', '.join(CLASSIFY_PROMPTS)} (got {', '.join(given)})",
                           'e.g. {"prompt": "great product"} or {"input": [1, 2, 3]}')
    params = PoolingParams(truncate_prompt_tokens=obj.get("truncate_prompt_tokens"), priority=obj.get("priority", 0),
                           use_activation=obj.get("use_activation"),
                           task="token_classify" if per_token else "classify").checked()
    room = max_tokens if params.truncate_prompt_tokens is None else None
    key, value = given[0], obj[given[0]]
    chat = {k: obj.get(k) for k in _CLASSIFY_CHAT}  # (read as /classify's chat form reads them)
    stray = [k for k, v in chat.items() if v is not None and key != "messages"]
    if stray:
        raise RequestError(f"{', '.join(stray)} applies to chat messages only: this line's prompt is {key}",
                           "send messages, or remove it")
    if key == "messages":  # (vLLM's classify chat form: no generation prompt unless asked)
        asked = chat["add_generation_prompt"]
        template = chat_template_options({**chat, "add_generation_prompt": False if asked is None else asked})
        tokens = encode_prompt(tokenizer, messages=value, max_tokens=room, template=template)
    elif key == "prompt_token_ids" and not (isinstance(value, list) and value):
        raise RequestError("prompt_token_ids must be a non-empty list of integers")
    else:
        inputs = embedding_inputs(value, key, verb="classify")
        if len(inputs) != 1:
            raise RequestError(f"{key} holds {len(inputs)} inputs: a line classifies one prompt",
                               "write one line per text (each its own id)")
        one = inputs[0]
        tokens = [int(t) for t in one] if isinstance(one, list) else encode_prompt(tokenizer, prompt=one,
                                                                                   max_tokens=room)
    req_id = default_id if obj.get("id") is None else request_id(obj["id"], "id")
    lora = obj.get("lora")
    if lora is not None and not isinstance(lora, str):
        raise RequestError(f"field 'lora' must be a string or null, got {type(lora).__name__}")
    return ParsedRequest(req_id, tokens, params, lora)


SCORING_URLS = ("/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")  # (serve.scoring's)


def _batch_line(obj: dict, default_id: str, names: ModelNames) -> tuple[dict, str, Any, dict]:
    """(fields, id, adapter, aliases) of an OpenAI batch line; a body field that would change the reply but is
    not supported (n > 1, tools, ...) is refused rather than dropped."""
    body = _batch_body(obj)
    url = obj.get("url")
    if url in SCORING_URLS:
        raise RequestError(f"url {url!r}: infer run does not answer classify, score or rerank lines (a line is one "
                           "prompt; a score or rerank body is several)",
                           f"send the body to a server started with `infer serve MODEL --runner pooling` (POST {url})"
                           + ('; or write each input as a line of infer\'s own format, {"prompt": ...}, which infer '
                              'run classifies on a classifier' if url == "/classify" else ""))
    if url is not None and url not in BATCH_URLS:
        raise RequestError(f"url {url!r} is not supported: infer run answers {' and '.join(BATCH_URLS)} (and "
                           f"{EMBEDDINGS_URL} with --runner pooling, {POOLING_URL} too)",
                           "remove the line, or run it with a server that has that endpoint")
    # each endpoint's request, as the server (and OpenAI) reads it: chat needs messages, a completion a prompt
    if url == "/v1/chat/completions" and "messages" not in body:
        raise RequestError("body.messages is missing: a /v1/chat/completions line needs the chat's messages",
                           'e.g. "body": {"messages": [{"role": "user", "content": "Hi"}]}; for a plain prompt use '
                           '"url": "/v1/completions"')
    if url == "/v1/completions" and "messages" in body:
        raise RequestError("body.messages is given to /v1/completions, which takes a prompt",
                           'use "url": "/v1/chat/completions" for messages, or give body.prompt')
    beam = body.get("use_beam_search")
    if beam is not None and not isinstance(beam, bool):
        raise RequestError(f"body.use_beam_search must be true or false, got {type(beam).__name__}")
    for key, (ok, why) in UNSUPPORTED_OPENAI.items():
        if beam and key in ("n", "use_beam_search"):  # vLLM's beam search (its n: the beam width): _beam_line
            continue
        if not ok(body.get(key)):
            more = " (for n > 1, write one line per reply, each with its own custom_id and seed)" \
                if key in ("n", "best_of") else ""
            raise RequestError(f"body.{key}: {why}", f"remove it from the line's body{more}")
    if body.get("stream") not in (None, False):  # OpenAI's batch refuses it, vLLM's run-batch answers an error
        raise RequestError("body.stream: a batch line's reply is written whole, never streamed (OpenAI's Batch API "
                           "and vllm run-batch refuse stream: true)", "remove stream (and stream_options) from the "
                           "line's body")
    if body.get("stream_options"):  # as infer serve's and vLLM's check: the options of a stream that is not one
        raise RequestError("body.stream_options: a batch line's reply is written whole, never streamed, so it takes "
                           "no stream options (infer serve and vllm run-batch refuse them without stream: true)",
                           "remove stream_options from the line's body (every reply's body holds its usage)")
    if body.get(REQUEST_TEMPLATE_FIELD) is not None:
        raise RequestError("body.chat_template: a chat template per line is not supported",
                           "remove it from the line's body; `infer run --chat-template FILE` gives the whole run one")
    check_add_special_tokens(body.get("add_special_tokens"), "messages" in body, "body.add_special_tokens")
    if "messages" in body:
        template = chat_template_options(body, "body.")
    else:
        check_no_chat_template_fields(body, "body.")
        template = None
    _check_batch_logprobs(body.get("logprobs"), "messages" in body)
    top = body.get("top_logprobs")
    most = names.max_logprobs  # (-1: any number, and -1 for the whole vocabulary)
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not (0 <= top <= most if most != -1 else top >= -1)):
        raise RequestError("body.top_logprobs must be an integer " + (f"in 0..{most}" if most != -1 else
                           "of at least 0, or -1 (the whole vocabulary)") + f", got {top!r}",
                           f"the run's max_logprobs is {most}: pass a larger --max-logprobs N (-1: the whole "
                           "vocabulary)" if most != -1 and isinstance(top, int) and top > most else None)
    if top and "messages" in body and body.get("logprobs") is not True:  # 0 asks for none (as vLLM's check)
        raise RequestError("body.top_logprobs is given but body.logprobs is not true: no logprobs would be written",
                           "set \"logprobs\": true, or remove top_logprobs")
    fields = {k: v for k, v in body.items() if k in _PARAM_TYPES or k in _OPENAI_ALIASES
              or k in ("prompt", "messages", "top_logprobs")}
    fields["structured_outputs"], source = from_openai(body, "body.")  # response_format, guided_json...: one of them
    length = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    # the body's names for the engine's fields that SamplingParams' errors name
    fields[_WORDS_KEY] = {"max_new_tokens": length, "structured_outputs": source}
    fields.update(_batch_prompt(body))
    fields[_TEMPLATE_KEY] = template
    lora = body.get("lora")
    if lora is None:
        lora = names.lora_for(body.get("model"))
    req_id = batch_custom_id(obj, default_id)
    for key in ("return_token_ids", "return_tokens_as_token_ids"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise RequestError(f"body.{key} must be a boolean, got {type(body[key]).__name__}")
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError(f"body.request_id must be a string, got {type(rid).__name__}")
    if body.get("include_reasoning") is not None and not isinstance(body["include_reasoning"], bool):
        raise RequestError(f"body.include_reasoning must be a boolean, got {type(body['include_reasoning']).__name__}")
    # what --reasoning-parser reads of a chat body (cli/batch_io.py), as the server reads it
    reasoning = {k: body.get(k) for k in ("include_reasoning", "chat_template_kwargs", "reasoning_effort")}
    fields[_OPENAI_KEY] = {"chat": "messages" in body, "model": body.get("model"), "reasoning": reasoning,
                           "return_token_ids": body.get("return_token_ids") is True, "request_id": rid or None,
                           "tokens_as_ids": body.get("return_tokens_as_token_ids") is True,
                           "beam": _beam_line(body, source) if beam else None}
    return fields, req_id, lora, _OPENAI_ALIASES


def _beam_line(body: dict, structured: str | None) -> dict:
    """A batch line's use_beam_search, as the server takes it (serve/protocol.py): {"n": the beam width,
    "length_penalty"}; what a beam search cannot give (a constraint, the prompt's logprobs) is refused."""
    n, penalty = body.get("n"), body.get("length_penalty")
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10:
        raise RequestError(f"body.n (the beam width of use_beam_search) must be an integer in 1..10, got {n!r}"[:200],
                           "each beam's candidates are its top 2 x n tokens, and top logprobs stop at 20")
    if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, (int, float))):
        raise RequestError(f"body.length_penalty must be a number, got {type(penalty).__name__}")
    if structured is not None:
        raise RequestError(f"{structured} cannot be combined with body.use_beam_search (its beams do not follow a "
                           "constraint)")
    if body.get("prompt_logprobs") is not None:
        raise RequestError("body.prompt_logprobs cannot be combined with body.use_beam_search")
    return {"n": n, "length_penalty": 1.0 if penalty is None else float(penalty)}


# what datasets call the prompt (a calibration file's "text", Alpaca's "instruction"/"input"), read by no line
_PROMPT_LOOKALIKES = frozenset({"text", "input", "instruction", "question", "query", "content", "inputs"})


def prompt_lookalike(obj: dict, unknown) -> str | None:
    """What to rename when a line without a prompt holds what other datasets call one ({"text": ...}), or None."""
    if any(k in obj for k in _PROMPT_KEYS):
        return None
    if "conversations" in unknown:  # a ShareGPT record: {"from": "human", "value": ...} turns
        return ("'conversations' is ShareGPT's chat: write it as 'messages', OpenAI's list of {\"role\": \"user\", "
                "\"content\": ...} (from human/gpt/system to role user/assistant/system, value to content)")
    named = sorted(set(unknown) & _PROMPT_LOOKALIKES)
    if not named:
        return None
    return f"the prompt's field is 'prompt' (a chat's 'messages'), e.g. {{\"prompt\": \"...\"}}: rename {named[0]!r}"


def is_request_id(value: Any) -> bool:
    """An id a record can carry as given: a string or an integer (not a list, an object or a boolean)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def request_id(value: Any, field: str) -> str:
    if not is_request_id(value):
        raise RequestError(f"field {field!r} must be a string or an integer, got {type(value).__name__}",
                           'e.g. "id": "q1" (every record carries its request\'s id)')
    if isinstance(value, str) and "\0" in value:  # (a line of several engine requests names them id + NUL + ...)
        raise RequestError(f"field {field!r} holds a NUL character (\\u0000), which infer keeps for the ids of the "
                           "requests a line of several inputs or a beam search makes", "remove it from the id")
    return str(value)


def batch_custom_id(obj: dict, default_id: str) -> str:
    """An OpenAI batch line's custom_id: a string, as OpenAI's Batch API and vllm run-batch require (a number would
    come back as a string in the output line, which a join on the input's custom_id then misses); none or null: the
    line's number."""
    value = obj.get("custom_id")
    if value is None:
        return default_id
    if not isinstance(value, str):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        raise RequestError(f"field 'custom_id' must be a string, got {json.dumps(value)[:60]}",
                           f'quote it: "custom_id": "{value}"' if number else
                           'e.g. "custom_id": "request-1" (each output line carries its line\'s custom_id)')
    return request_id(value, "custom_id")


def parse_request(obj: Any, tokenizer, default_id: str, defaults: dict | None = None,
                  names: ModelNames = ModelNames(), max_tokens: int | None = None) -> ParsedRequest:
    """Validate one request object (our JSONL format, or an OpenAI batch line) and tokenize its prompt; `names`
    says which body.model of a batch line picks which adapter, `max_tokens` is the context (when known)."""
    if not isinstance(obj, dict):
        raise RequestError(f"expected a JSON object, got {type(obj).__name__}")
    names = ModelNames() if names is None else names  # (callers with no model to name: the data-parallel driver)
    if ("body" in obj or "custom_id" in obj) and obj.get("url") in (EMBEDDINGS_URL, POOLING_URL):
        return _embedding_line(obj, tokenizer, default_id, names, max_tokens)
    if names.labels and not ("body" in obj or "custom_id" in obj):
        return _classify_line(obj, tokenizer, default_id, max_tokens, names.per_token)
    if "body" in obj or "custom_id" in obj:  # OpenAI batch line, as `vllm run-batch` reads it
        fields, req_id, lora, aliases = _batch_line(obj, default_id, names)
        defaults = {**(defaults or {}), **dict(names.sampling)}  # what the fields it leaves out get, as vLLM
    else:
        unknown = set(obj) - set(_PARAM_TYPES) - set(_PROMPT_KEYS) - _OTHER_KEYS
        if unknown:
            openai = sorted(unknown & set(_OPENAI_ALIASES))
            hint = f"allowed: {', '.join(sorted([*_PROMPT_KEYS, *_OTHER_KEYS, *_PARAM_TYPES]))}"
            if openai:  # OpenAI's names for a field this format spells otherwise
                hint = (f"this format calls {' and '.join(openai)} 'max_new_tokens' (OpenAI's names are read inside "
                        f"an OpenAI batch line's body); {hint}")
            elif prompt_lookalike(obj, unknown) is not None:  # {"text": ...}
                hint = f"{prompt_lookalike(obj, unknown)}; {hint}"
            elif "model" in unknown:  # vLLM's and OpenAI's way to pick an adapter, in this format's line
                named = json.dumps(obj["model"][:60] if isinstance(obj["model"], str) else "NAME")
                hint = (f"a line picks its adapter with 'lora', e.g. \"lora\": {named} (a --lora NAME; without it "
                        f"the line runs the base model): 'model' is read only in an OpenAI batch line's body; {hint}")
            else:  # a typo ("promt", "temprature"): name the field meant first
                allowed = [*_PROMPT_KEYS, *_OTHER_KEYS, *_PARAM_TYPES]
                meant = [f"{k!r} for {u!r}" for u in sorted(unknown) if isinstance(u, str)
                         for k in difflib.get_close_matches(u, allowed, n=1, cutoff=0.8)]
                if meant:
                    hint = f"did you mean {', '.join(meant)}? {hint}"
            raise RequestError(f"unknown field(s) {sorted(unknown)}", hint)
        req_id = default_id if obj.get("id") is None else request_id(obj["id"], "id")
        fields, lora, aliases = obj, obj.get("lora"), None
    if lora is not None and not isinstance(lora, str):
        raise RequestError(f"field 'lora' must be a string or null, got {type(lora).__name__}")
    # a field given as null is not given (OpenAI clients write None as null): the run's default holds
    defaults = dict(defaults or {})
    cap = defaults.pop(MAX_TOKENS_CAP, None)  # (batch lines only: the model's generation_config.json, as the server)
    merged = {**defaults, **{k: v for k, v in fields.items() if v is not None}}
    try:
        params = params_from(merged, aliases)
        asked = params.max_new_tokens  # what the context must hold: the body's own, not generation_config's cap
    except RequestError as e:
        raise _in_body_words(e, fields.get(_WORDS_KEY)) from None
    given = [k for k in _PROMPT_KEYS if fields.get(k) is not None]
    if len(given) != 1:
        raise RequestError("no prompt: give one of prompt, messages, prompt_token_ids" if not given else
                           f"give only one of prompt, messages, prompt_token_ids (got {', '.join(given)})")
    if given[0] == "prompt_token_ids":
        ids = fields["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("prompt_token_ids must be a list of integers")
        tokens = list(ids)
    else:
        keep = params.truncate_prompt_tokens  # the prompt's end only: its whole length is no reason to refuse it
        tokens = encode_prompt(tokenizer, fields.get("prompt"), fields.get("messages"),
                               max_tokens if keep is None else None, fields.get(_TEMPLATE_KEY))
    length = (fields.get(_WORDS_KEY) or {}).get("max_new_tokens")  # a batch body's own max_tokens, if it gave one
    if fields.get(_OPENAI_KEY) is not None and max_tokens is not None and params.max_new_tokens is not None:
        keep = params.truncate_prompt_tokens
        size = len(tokens) if keep is None else min(len(tokens), max_tokens if keep == -1 else keep)
        if length is not None and size + asked > max_tokens:  # as the server answers it (and vllm
            # run-batch): not a reply the context silently cuts
            raise RequestError(f"this model's maximum context length is {max_tokens} tokens; the prompt has {size} "
                               f"tokens and body.{length} asks for {asked} more",
                               f"lower body.{length} to {max(max_tokens - size, 0)} or less, or raise --max-model-len")
        if size + params.min_tokens > max_tokens:  # no max_tokens: a min_tokens the context cannot hold (the server's)
            raise RequestError(f"body.min_tokens ({params.min_tokens}) is more than the {max_tokens - size} tokens "
                               f"this model's maximum context length of {max_tokens} leaves after the prompt's {size}",
                               "lower body.min_tokens, or raise --max-model-len")
    try:  # after the context's checks, which read the body's own max_tokens (as vLLM's order: the cap is no request)
        cap_max_tokens(params, cap)
    except RequestError as e:
        raise _in_body_words(e, fields.get(_WORDS_KEY)) from None
    return ParsedRequest(req_id, tokens, params, lora, fields.get(_OPENAI_KEY))
