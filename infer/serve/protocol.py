"""OpenAI request bodies -> engine inputs, and engine outputs -> OpenAI response objects.

Parsing raises ApiError (an HTTP status plus an OpenAI-style error body); it never lets a TypeError through.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from ..engine.inputs import UNSUPPORTED_OPENAI as _UNSUPPORTED, REQUEST_TEMPLATE_FIELD, chat_template_options, \
    check_add_special_tokens, chat_messages, check_no_chat_template_fields, reads_content_parts, encode_prompt, \
    params_from, MAX_LOGPROBS, MAX_TOKENS_CAP, cap_max_tokens
from ..engine.outputs import RequestOutput
from ..engine.prompt_size import PromptTooLongError
from ..engine.sampling_params import MAX_TOKENS
from ..engine.structured import from_openai
from ..errors import RequestError
from .reasoning import ReasoningRequest, keeps_special_tokens, reasoning_request, split as reasoning_split
from .tools import ToolRequest, parse_tools, reads_whole_reply, split as split_tools

# OpenAI names for our SamplingParams fields, and the vLLM-style extras we accept as they are
_ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
_PARAM_KEYS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "seed", "ignore_eos", "logprobs",
               "top_logprobs", "max_length", "min_p", "min_tokens", "logit_bias", "allowed_token_ids",
               "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
               "truncate_prompt_tokens", "prompt_logprobs", "bad_words", "cache_salt", "priority"}
_FIELD = re.compile(r"^(?:field ')?([a-z_]+)'?")
MAX_N = 128  # choices per request (each one is an engine request)
# Every field of a completions or chat body that OpenAI or vLLM defines: what infer reads, what it refuses at other
# values (engine.inputs.UNSUPPORTED_OPENAI), and what changes nothing in a reply (user, metadata...). Any
# other field is ignored, and named in the server's log as vLLM names it, so that a mistyped field is found.
_KNOWN_FIELDS = _PARAM_KEYS | set(_UNSUPPORTED) | {
    "model", "prompt", "messages", "stream", "stream_options", "n", "echo", "user", "metadata", "store",
    "service_tier", "prompt_cache_key", "safety_identifier", "verbosity", "reasoning_effort", "prediction",
    "web_search_options", "parallel_tool_calls", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
    "add_special_tokens", "include_reasoning", "return_token_ids", "return_tokens_as_token_ids", "request_id",
    "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "media_io_kwargs", "length_penalty"}


def ignored_fields(body: Any) -> list[str]:
    """The body's fields that neither OpenAI nor vLLM define (a mistyped `max_token`...): ignored, as vLLM ignores
    them, and worth a line in the log, as vLLM writes one."""
    return sorted(k for k in body if k not in _KNOWN_FIELDS) if isinstance(body, dict) else []


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shutting_down(message: str, retry_after: int | str = 1) -> ApiError:
    """The one 503 a server that is shutting down gives, whether it refuses a new request, a LoRA load or unload,
    or ends a running request: a client or load balancer checks one code and retries another replica."""
    return ApiError(503, message, type="server_unavailable", code="server_shutting_down",
                    headers={"Retry-After": str(retry_after)})


def bad_request(e: RequestError | str, param: str | None = None) -> ApiError:
    message = str(e)
    if param is None:
        param = getattr(e, "field", None)  # the field the error names itself (a server's `param`)
    if param is None:
        m = _FIELD.match(message)
        name = m.group(1) if m else None
        param = {"max_new_tokens": "max_tokens"}.get(name, name) if name in _PARAM_KEYS | {"max_new_tokens",
                                                                                          "prompt", "messages"} \
            else None
    return ApiError(400, message, param=param)


@dataclass
class GenerationRequest:
    prompts: list[list[int]]  # one engine request per prompt (choice index = position)
    params: Any
    model: str | None
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    return_token_ids: bool = False  # vLLM extension: token ids in each choice (and chunk)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk (vLLM)
    n: int = 1  # choices per prompt: prompts[i] is prompt i // n's sample i % n
    echo: bool = False  # completions: the prompt's text (and logprobs) before the reply's
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone (one token is generated and left out)
    prompt_texts: list | None = None  # with echo: each prompt's text as sent (None: token ids, decoded)
    # the body's own prompt_logprobs (echo with logprobs asks the engine too, for as many alternatives as logprobs)
    asked_prompt_logprobs: int | None = None
    structured_field: str | None = None  # the field that asked for a structured output (response_format...)
    length_field: str = "max_tokens"  # the field that set the reply's length (max_completion_tokens supersedes it)
    tools: ToolRequest | None = None  # chat: the tools and the tool_choice (serve/tools.py)
    reasoning: ReasoningRequest | None = None  # chat with --reasoning-parser: the reply's split (serve/reasoning.py)
    request_id: str | None = None  # vLLM's field: the response's id is cmpl-/chatcmpl- and this (else a uuid)
    # the client asked for the reply's length (chat without max_tokens: up to the context, or the generation_config
    # cap, whichever is less, as vLLM's get_max_tokens: the cap is no request the context must hold)
    asked_length: bool = True
    # the reply's length as the client asked for it, before the generation_config cap (None: params'): what the
    # context must hold, as vLLM checks it ("max_tokens 100" was refused as "asks for 50", the cap)
    asked_tokens: int | None = None
    capped: ApiError | None = None  # the cap's refusal (a min_tokens past it), said after the context's checks
    # vLLM's return_tokens_as_token_ids (the field, or the server's --return-tokens-as-token-ids): each logprobs
    # token is "token_id:ID" instead of its text (a token whose text is not valid UTF-8 alone stays identifiable);
    # None: the body left it out (or null), and the server's option decides, as vLLM's (a body's false overrides it)
    tokens_as_ids: bool | None = False
    # vLLM's use_beam_search: the n choices of a prompt are its n best beams (serve/beams.py), not n samples
    beam: Any = None
    # chat's echo (vLLM's): the last message's text, when it has the reply's role, before each choice's content
    echo_text: str | None = None
    # the server's --enable-prompt-tokens-details (vLLM's): usage.prompt_tokens_details.cached_tokens, the prompt
    # tokens the prefix cache held when the request was first admitted
    cached_details: bool = False

    def params_for(self, index: int):
        """Choice `index`'s sampling: with n > 1 and a seed, sample j draws with seed + j (as vLLM's parallel
        sampling), so the n choices differ and each is reproducible."""
        j = index % self.n
        return self.params if j == 0 or self.params.seed is None else self.params.sample(j)

    def counts_prompt(self, index: int) -> bool:
        """Whether choice `index` is its prompt's first: usage counts each prompt once, however many choices."""
        return index % self.n == 0


def _expect(body: dict, key: str, types: tuple, what: str) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
        raise ApiError(400, f"field {key!r} must be {what}, got {type(value).__name__}", param=key)
    return value


# OpenAI's deprecated function-calling fields: the chat endpoint calls the same functions through tools and
# tool_choice (serve/tools.py), which a client written for the old fields can send instead
_LEGACY_FUNCTIONS = {
    "functions": 'functions (OpenAI\'s deprecated field) is not supported: send each function as a tool, "tools": '
                 '[{"type": "function", "function": {"name": ..., "parameters": {...}}}]',
    "function_call": 'function_call (OpenAI\'s deprecated field) is not supported: send "tool_choice" instead ("auto", '
                     '"none", "required" or {"type": "function", "function": {"name": ...}})'}
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


def _common(body: Any, chat: bool, defaults: dict | None = None) -> GenerationRequest:
    """The fields both endpoints share; `defaults` (engine.inputs.openai_sampling_defaults) fill the sampling fields
    the body leaves out or sends as null."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for key, (ok, why) in _UNSUPPORTED.items():
        if key in ("tools", "tool_choice") and chat:  # serve/tools.py (parse_chat)
            continue
        if key not in ("n", "echo", "use_beam_search") and not ok(body.get(key)):  # n: one engine request per
            # choice; echo, use_beam_search: below
            raise ApiError(400, _LEGACY_FUNCTIONS[key] if chat and key in _LEGACY_FUNCTIONS else why, param=key)
    if not chat and body.get(REQUEST_TEMPLATE_FIELD) is not None:
        raise ApiError(400, "chat_template applies to chat messages only (send messages to /v1/chat/completions, "
                            "or remove it)", param=REQUEST_TEMPLATE_FIELD)
    # chat's echo (vLLM's: the last message's text before the reply's) is parse_chat's; this one is completions'
    echo = bool(_expect(body, "echo", (bool,), "a boolean")) and not chat
    n = _expect(body, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in 1..{MAX_N}, got {n}", param="n")
    try:
        check_add_special_tokens(body.get("add_special_tokens"), chat)
    except RequestError as e:
        raise ApiError(400, str(e), param="add_special_tokens") from e
    if not chat:
        try:
            check_no_chat_template_fields(body)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from e
    model = _expect(body, "model", (str,), "a string")
    stream = bool(_expect(body, "stream", (bool,), "a boolean"))
    given = _expect(body, "stream_options", (dict,), "an object")
    options = given or {}
    if options and not stream:  # as vLLM and OpenAI: the options of a stream that is not one are a mistake
        raise ApiError(400, "stream_options can only be given with stream: true", param="stream_options")
    # vLLM's StreamOptions: include_usage defaults to true once stream_options is sent ({"continuous_usage_stats":
    # true} alone gets the usage in every chunk and the last), a null is false; no stream_options, no usage
    include_usage = options.get("include_usage", given is not None)
    continuous = options.get("continuous_usage_stats", False)
    # OpenAI's include_obfuscation (the SDK's type has it): random padding of each chunk against side channels;
    # infer (as vLLM) sends none, so the option changes nothing and is taken either way
    for key, value in (("include_usage", include_usage), ("continuous_usage_stats", continuous),
                       ("include_obfuscation", options.get("include_obfuscation"))):
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"stream_options.{key} must be a boolean", param="stream_options")
    include_usage, continuous = bool(include_usage), bool(continuous)
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"})
    if unknown:
        raise ApiError(400, f"stream_options has unknown fields {unknown}; infer reads include_usage, "
                            "continuous_usage_stats and include_obfuscation", param="stream_options")
    defaults = dict(defaults or {})
    cap = defaults.pop(MAX_TOKENS_CAP, None)  # generation_config.json's max_new_tokens: caps every reply (vLLM)
    most = defaults.pop(MAX_LOGPROBS, 20)  # the engine's max_logprobs (vLLM's 20 by default; -1: no cap)
    allowed = f"0..{most}" if most != -1 else "at least 0, or -1 (the whole vocabulary)"

    def within(n: int) -> bool:
        return 0 <= n <= most if most != -1 else n >= -1

    def refused(name: str, n: int) -> str:
        return f"{name} must be {'in ' if most != -1 else ''}{allowed}, got {n}" + (
            f" (the server's max_logprobs is {most}: start it with a larger --max-logprobs N; -1: the whole "
            "vocabulary)" if most != -1 and n > most else "")
    fields = {**defaults, **{k: v for k, v in body.items() if k in _PARAM_KEYS and v is not None}}
    try:
        structured, source = from_openai(body)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.field) from e
    if structured is not None:
        fields["structured_outputs"] = structured
    if not chat and isinstance(fields.get("logprobs"), bool):
        raise ApiError(400, f"field 'logprobs' must be an integer ({allowed}) for completions",
                       param="logprobs")
    if not chat and isinstance(fields.get("logprobs"), int) and not within(fields["logprobs"]):
        # vLLM's range (its max_logprobs, 20 by default), not OpenAI's legacy 0..5: a vLLM client's logprobs 10 was
        # a 400
        raise ApiError(400, refused("logprobs", fields["logprobs"]), param="logprobs")
    if chat and fields.get("logprobs") is not None and not isinstance(fields["logprobs"], bool):
        raise ApiError(400, "field 'logprobs' must be a boolean for chat (use top_logprobs for the count)",
                       param="logprobs")
    top = _expect(body, "top_logprobs", (int,), "an integer")
    if top is not None and not within(top):
        raise ApiError(400, refused("top_logprobs", top), param="top_logprobs")
    if stream and body.get("prompt_logprobs") is not None:
        if type(body["prompt_logprobs"]) is int and body["prompt_logprobs"] == 0:
            # as vLLM (it refuses only a value above 0, or -1): taken, and not computed, as a stream returns none
            fields.pop("prompt_logprobs", None)
        else:
            raise ApiError(400, "prompt_logprobs is only returned by a response that is not streamed",
                           param="prompt_logprobs")
    # as vLLM: else silently no logprobs; a top_logprobs of 0 (the SDK's or a client's default) asks for none
    if chat and top and fields.get("logprobs") is not True:
        raise ApiError(400, "when using top_logprobs, logprobs must be set to true", param="top_logprobs")
    length = "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    if length == "max_completion_tokens":  # it supersedes max_tokens, whichever comes first (OpenAI, vLLM)
        fields.pop("max_tokens", None)
    prompt_only = echo and fields.get(length) == 0  # OpenAI's legacy echo of the prompt alone (lm-eval scores so)
    if prompt_only:
        least = fields.get("min_tokens")
        if isinstance(least, int) and not isinstance(least, bool) and least > 0:  # not "at most max_tokens (1)"
            raise ApiError(400, f"min_tokens ({least}) must be at most {length} (0)", param="min_tokens")
        fields[length] = 1
    unsized = _no_max_tokens(body)
    if unsized:  # the endpoint's default is what min_tokens is checked against, not SamplingParams' own (256)
        fields["max_tokens"] = MAX_TOKENS if chat else COMPLETIONS_MAX_TOKENS  # chat: the context, None below
    try:
        params = params_from(fields, _ALIASES)
    except RequestError as e:
        if str(e).startswith("max_new_tokens"):  # name the field the client sent, not the engine's
            raise ApiError(400, str(e).replace("max_new_tokens", length), param=length) from e
        if str(e).startswith("structured_outputs"):
            raise ApiError(400, _in_words_of(e, source), param=source) from e
        raise bad_request(str(e).replace("max_new_tokens", length)) from e
    asked_tokens = params.max_new_tokens
    if unsized and chat:
        params.max_new_tokens = None  # as OpenAI: up to the context limit (check_context checks min_tokens)
    try:
        cap_max_tokens(params, cap)
        capped = None
    except RequestError as e:  # said after the context's checks, as vLLM checks the prompt's length first
        capped = ApiError(400, str(e), param="min_tokens")
    asked = params.prompt_logprobs
    if echo and params.logprobs is not None:  # the prompt's logprobs, with as many alternatives as the reply's
        params.prompt_logprobs = max(params.prompt_logprobs or 0, params.logprobs)
    return_ids = bool(_expect(body, "return_token_ids", (bool,), "a boolean"))
    as_ids = _expect(body, "return_tokens_as_token_ids", (bool,), "a boolean")  # None: the server's option
    request_id = _expect(body, "request_id", (str,), "a string") or None  # "" is none given, as in vLLM
    beam = _beam_params(body, params, n or 1, chat, stream, echo, source) \
        if _expect(body, "use_beam_search", (bool,), "a boolean") else None
    return GenerationRequest([], params, model, stream, include_usage and stream, chat, return_ids,
                             include_usage and continuous and stream, n or 1, echo, prompt_only,
                             asked_prompt_logprobs=asked, structured_field=source, length_field=length,
                             request_id=request_id, asked_length=not (unsized and chat), asked_tokens=asked_tokens,
                             capped=capped, tokens_as_ids=as_ids, beam=beam)


def _beam_params(body: dict, params, n: int, chat: bool, stream: bool, echo: bool, structured: str | None):
    """vLLM's to_beam_search_params: n beams (the choices), max_tokens, ignore_eos, temperature (the draw of the
    one sampled candidate a step adds), length_penalty and include_stop_str_in_output; the other sampling fields
    do not apply to a beam search, as in vLLM. Refused as vLLM refuses them: a streamed completion; and what a beam
    search cannot give: a constraint (its beams would not follow it) and the prompt's logprobs."""
    if stream and not chat:
        raise ApiError(400, "Streaming is not currently supported with beam search (as in vLLM; a chat completion "
                            "streams its beams once they are found)", param="stream")
    if structured is not None:
        raise ApiError(400, f"{structured} cannot be combined with use_beam_search (its beams do not follow a "
                            "constraint)", param=structured)
    if params.prompt_logprobs is not None:
        raise ApiError(400, "prompt_logprobs cannot be combined with use_beam_search" if not echo else
                       "echo with logprobs cannot be combined with use_beam_search (the prompt's logprobs are not "
                       "computed)", param="prompt_logprobs" if not echo else "logprobs")
    penalty = _expect(body, "length_penalty", (int, float), "a number")
    from ..engine.beam import BeamSearchParams
    try:
        return BeamSearchParams(beam_width=n, max_tokens=params.max_new_tokens or 1, ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=1.0 if penalty is None else penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output)
    except RequestError as e:
        name = str(e).split(" ", 1)[0]
        message = str(e).replace("beam_width", "n (the beam width)", 1)
        raise ApiError(400, message, param={"beam_width": "n", "max_tokens": None}.get(name, name)) from e


def _truncation(req: GenerationRequest, max_tokens: int | None) -> int | None:
    """The prompt size limit to check before tokenizing: none with truncate_prompt_tokens (only the prompt's end is
    kept: its length is no reason to refuse it), whose -1 (vLLM's: the context length) becomes the context here."""
    if req.params.truncate_prompt_tokens is None:
        return max_tokens
    if req.params.truncate_prompt_tokens == -1 and max_tokens is not None:
        req.params.truncate_prompt_tokens = max_tokens
    return None


def _choices(req: GenerationRequest, prompts: list[list[int]]) -> list[list[int]]:
    """One engine request per choice: each prompt's last truncate_prompt_tokens tokens (vLLM), n times."""
    keep = req.params.truncate_prompt_tokens  # -1 (the context length) is resolved by the engine
    return [q[-keep:] if keep and keep > 0 else q for q in prompts for _ in range(req.n)]


def _encode(tokenizer, prompt: str, max_tokens: int | None = None) -> list[int]:
    try:
        return encode_prompt(tokenizer, prompt=prompt, max_tokens=max_tokens)
    except PromptTooLongError as e:
        raise ApiError(400, str(e), param="prompt", code="context_length_exceeded") from e
    except RequestError as e:
        raise bad_request(e, param="prompt") from e


def prompt_count(prompt: Any) -> int:
    """How many prompts a completion's `prompt` field holds, from its shape alone (a list of strings or of token id
    lists: its length; anything else: one, or a 400 later)."""
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def too_many_choices(prompts: int, n: int, limit: int) -> ApiError:
    """A request of more choices (prompts x n) than the server could ever hold at once (its running slots and
    --max-queue waiting): a 400 (a 503 would make the client retry for ever)."""
    what = f"{prompts} prompts" if n == 1 else f"{prompts * n} choices (prompts x n)"
    return ApiError(400, f"this request has {what}, more than the {limit} requests the server can hold at once "
                         "(its --max-num-seqs running slots and --max-queue waiting); send them in smaller requests",
                    param="n" if n > 1 else "prompt")


def _completion_prompts(prompt: Any, tokenizer, max_tokens: int | None = None) -> list[list[int]]:
    if isinstance(prompt, str):
        return [_encode(tokenizer, prompt, max_tokens)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [_encode(tokenizer, p, max_tokens) for p in prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return [list(p) for p in prompt]
    raise ApiError(400, "prompt must be a non-empty string, a list of strings, a list of token ids, or a list of "
                        "token id lists", param="prompt")


def _in_words_of(e: RequestError, field: str) -> str:
    """A constraint's error in the words of the request field that asked for it: SamplingParams names its own
    structured_outputs, which a client that sent response_format or tool_choice never wrote."""
    message = e.message
    if message.startswith("structured_outputs"):
        message = field + message[len("structured_outputs"):]
    else:
        message = f"{field}: {message}"
    hint = (e.hint or "").replace("the constraint", field)
    return f"{message} ({hint})" if hint else message


def _tool_choice_words(tools) -> str:
    """How an error names the tool_choice the client sent."""
    return f"tool_choice (function {tools.name!r})" if tools.mode == "named" else f"tool_choice {tools.mode!r}"


def _no_max_tokens(body: dict) -> bool:
    """No max_tokens given: absent or null (OpenAI's clients send null for None), so the endpoint's default holds."""
    return body.get("max_tokens") is None and body.get("max_completion_tokens") is None


def parse_completion(body: Any, tokenizer, max_tokens: int | None = None,
                     defaults: dict | None = None) -> GenerationRequest:
    req = _common(body, chat=False, defaults=defaults)
    if body.get("prompt") is None:
        other = " ('messages' is a chat's: POST /v1/chat/completions)" if body.get("messages") is not None else ""
        raise ApiError(400, f"missing required field 'prompt'{other}", param="prompt")
    max_tokens = _truncation(req, max_tokens)
    req.prompts = _choices(req, _completion_prompts(body["prompt"], tokenizer, max_tokens))
    if req.echo:
        sent = body["prompt"]
        texts = [sent] if isinstance(sent, str) else [q if isinstance(q, str) else None for q in sent]
        req.prompt_texts = texts if len(texts) * req.n == len(req.prompts) else None  # token ids: [None]
    return req


def echoed_prompt(req: GenerationRequest, index: int, out: RequestOutput,
                  tokenizer) -> tuple[str, list[dict] | None]:
    """(text, logprob records) an echo choice starts with: the prompt as sent (its tokens decoded when sent as ids or
    truncated) and, with logprobs, its tokens' (the first one's null). A stream sends them in the choice's first
    chunk, before its first text, as vLLM does."""
    text = req.prompt_texts[index // req.n] if req.prompt_texts else None
    if text is None or req.params.truncate_prompt_tokens is not None:
        text = tokenizer.decode(out.prompt_token_ids)
    records = None
    if out.logprobs is not None:
        k = req.params.logprobs
        records = [{"token_id": out.prompt_token_ids[0], "logprob": None}] + [
            {"token_id": r["token_id"], "logprob": r["logprob"], "top_logprobs": r.get("top_logprobs", [])[:k]}
            for r in out.prompt_logprobs[1:]]
    return text, records


def echoed(req: GenerationRequest, index: int, out: RequestOutput, tokenizer) -> tuple[str, list[dict] | None]:
    """(text, logprob records) of an echo choice: the prompt (echoed_prompt), then the reply (nothing with
    max_tokens 0)."""
    text, records = echoed_prompt(req, index, out, tokenizer)
    if records is not None:
        records += [] if req.prompt_only else out.logprobs
    return text + ("" if req.prompt_only else out.text), records


def parse_chat(body: Any, tokenizer, max_tokens: int | None = None, defaults: dict | None = None,
               tool_parser: str | None = None, reasoning_parser: str | None = None,
               trust_template: bool = False) -> GenerationRequest:
    """`tool_parser`: the server's --tool-call-parser, which lets tool_choice "auto" through (serve/tools.py);
    `reasoning_parser`: its --reasoning-parser, which splits the reply's reasoning from its content
    (serve/reasoning.py); `trust_template`: --trust-request-chat-template, which lets a request's own chat_template
    render it."""
    req = _common(body, chat=True, defaults=defaults)
    own = request_template(body, trust_template)
    clean = _messages(body, tokenizer, own)
    if body.get("echo"):
        req.echo_text = _echoed_message(body, clean[-1])
    try:
        template = {**chat_template_options(body), "chat_template": own}
        req.tools = parse_tools(body, tool_parser)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.field) from e
    if req.tools is not None:
        template["tools"] = req.tools.tools  # apply_chat_template renders them (a template that reads `tools`)
    if req.tools is not None and req.tools.schema is not None and req.beam is not None:
        raise ApiError(400, f"{_tool_choice_words(req.tools)} cannot be combined with use_beam_search (its beams do "
                            "not follow a constraint)", param="tool_choice")
    if req.tools is not None and req.tools.schema is not None:  # the reply is a call: a JSON schema constrains it
        if req.params.structured_outputs is not None:
            raise ApiError(400, f"tool_choice {req.tools.mode!r} constrains the reply already; "
                                f"{req.structured_field} cannot be combined with it", param=req.structured_field)
        try:
            # no free whitespace in a call's JSON: a model cannot stall in it, and a program reads the arguments
            req.params = replace(req.params, structured_outputs={"json": req.tools.schema,
                                                                 "disable_any_whitespace": True})
        except RequestError as e:
            raise ApiError(400, _in_words_of(e, _tool_choice_words(req.tools)), param="tool_choice") from e
        req.structured_field = "tools"  # a parameters schema xgrammar cannot compile is the tools' fault
    if req.tools is not None and req.tools.mode == "auto":  # as vLLM's hermes parser: its tags stay in the text
        req.params = replace(req.params, skip_special_tokens=False)
    max_tokens = _truncation(req, max_tokens)
    prompt = _render_chat(tokenizer, clean, template, max_tokens)
    _expect(body, "include_reasoning", (bool,), "a boolean")
    req.reasoning = reasoning_request(reasoning_parser, body, prompt, tokenizer, req.params.structured_outputs)
    if req.reasoning is not None and not req.reasoning.ended and keeps_special_tokens(req.reasoning.parser,
                                                                                    tokenizer):
        req.params = replace(req.params, skip_special_tokens=False)  # the tags (markers) stay in the text to split it
    req.prompts = _choices(req, [prompt])
    return req


def _echoed_message(body: dict, last: dict) -> str:
    """vLLM's chat echo: the last message's text (its text parts joined by newlines) when its role is the reply's
    (the assistant's with add_generation_prompt, the default; else the last message's own), else nothing."""
    role = "assistant" if body.get("add_generation_prompt", True) is not False else last["role"]
    content = last.get("content") if last["role"] == role else None
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if isinstance(part, dict)
                         and isinstance(part.get("text"), str))
    return content if isinstance(content, str) else ""


def request_template(body: dict, trusted: bool) -> str | None:
    """A chat request's own `chat_template` (vLLM's field; None: the model's). It runs on the server, so it is
    refused unless the server trusts its clients with that (--trust-request-chat-template), as vLLM does."""
    value = body.get(REQUEST_TEMPLATE_FIELD)
    if value is None:
        return None
    if not trusted:
        raise ApiError(400, "this server does not accept a chat_template per request (the model's is used; start "
                            "it with --trust-request-chat-template to allow one)", param=REQUEST_TEMPLATE_FIELD)
    if not isinstance(value, str) or not value.strip():
        got = "an empty string" if isinstance(value, str) else f"a {type(value).__name__}"
        raise ApiError(400, f"field 'chat_template' must be the template's text (a Jinja string), got {got}",
                       param=REQUEST_TEMPLATE_FIELD)
    return value


def _messages(body: dict, tokenizer, template: str | None = None) -> list[dict]:
    """The body's messages, checked, and returned as sent: encode_prompt gives them to the template as it gives
    LLM.chat's and infer run's (name, tool_calls... kept), in the content format of the template it renders with
    (a tokenizer's "tool_use" one where tools are rendered)."""
    messages = body.get("messages")
    if messages is None:
        other = " ('prompt' is a completion's: POST /v1/completions)" if body.get("prompt") is not None else ""
        raise ApiError(400, f"missing required field 'messages' (a non-empty list){other}", param="messages")
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else f"a {type(messages).__name__}"
        raise ApiError(400, f"field 'messages' must be a non-empty list of message objects, got {got}",
                       param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
    try:
        chat_messages(messages, reads_content_parts(tokenizer, template))
    except RequestError as e:
        raise bad_request(e, param="messages") from e
    return messages


def _render_chat(tokenizer, messages: list[dict], template: dict, max_tokens: int | None) -> list[int]:
    """The prompt ids the chat template gives `messages`: the one rendering of /v1/chat/completions and /tokenize."""
    try:
        return encode_prompt(tokenizer, messages=messages, max_tokens=max_tokens, template=template)
    except PromptTooLongError as e:
        raise ApiError(400, str(e), param="messages", code="context_length_exceeded") from e
    except RequestError as e:
        raise bad_request(e, param=getattr(e, "field", None) or "messages") from e


def chat_prompt_ids(body: dict, tokenizer, max_tokens: int | None, trust_template: bool) -> list[int]:
    """The prompt ids of a body's `messages` as /v1/chat/completions renders them (the same checks: the chat
    template's fields, the request's own template, add_special_tokens, tools rendered whatever tool_choice), for
    /tokenize's and /v1/embeddings' chat forms."""
    own = request_template(body, trust_template)
    try:
        check_add_special_tokens(body.get("add_special_tokens"), chat=True)
    except RequestError as e:
        raise ApiError(400, str(e), param="add_special_tokens") from e
    clean = _messages(body, tokenizer, own)
    try:
        template = {**chat_template_options(body), "chat_template": own}
        tools = parse_tools({"tools": body.get("tools"), "tool_choice": "none"})
    except RequestError as e:
        raise ApiError(400, str(e), param=e.field) from e
    if tools is not None:
        template["tools"] = tools.tools
    return _render_chat(tokenizer, clean, template, max_tokens)


# ---------------------------------------------------------------------------------- vLLM's /tokenize, /detokenize
def _flag(body: dict, key: str, default: bool) -> bool:
    value = _expect(body, key, (bool,), "a boolean")
    return default if value is None else value


def tokenize(body: Any, tokenizer, max_model_len: int, trust_template: bool = False) -> tuple[str | None, dict]:
    """(model, response) of vLLM's POST /tokenize. With `messages` (the chat form), the very ids
    /v1/chat/completions feeds the engine for them (the same checks and rendering: add_generation_prompt,
    continue_final_message, chat_template_kwargs, documents, tools); else `prompt` as
    `tokenizer(prompt, add_special_tokens=...)` gives it. As vLLM, the context does not limit it: `count` against
    `max_model_len` tells the client whether it fits. `trust_template`: as parse_chat's."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = _expect(body, "model", (str,), "a string")
    strs = _flag(body, "return_token_strs", False)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise ApiError(400, "send either prompt or messages, not both", param="prompt")
        ids = chat_prompt_ids(body, tokenizer, None, trust_template)
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "missing required field 'prompt' (a string), or 'messages' for a chat",
                           param="prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, f"field 'prompt' must be a string, got {type(prompt).__name__}", param="prompt")
        try:
            check_no_chat_template_fields(body)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from e
        special = _flag(body, "add_special_tokens", True)
        try:
            ids = list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
        except Exception as e:  # a tokenizer error is about this prompt
            raise ApiError(400, f"the tokenizer cannot encode this prompt: {type(e).__name__}: {e}",
                           param="prompt") from e
    return model, {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids) if strs else None}


def detokenize(body: Any, tokenizer, max_token_id: int, known_id: int | None = None) -> tuple[str | None, dict]:
    """(model, response) of vLLM's POST /detokenize: `tokenizer.decode(tokens)`, special tokens kept; an id outside
    the vocabulary (0..max_token_id: the model's, which may be padded past the tokenizer's, as vLLM's bound) is a 400
    naming `tokens`. An id the tokenizer does not know (above `known_id`, an embedding row of the padding) decodes
    to nothing, as vLLM decodes what it can."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = _expect(body, "model", (str,), "a string")
    tokens = body.get("tokens")
    if tokens is None:
        raise ApiError(400, "missing required field 'tokens' (a list of token ids)", param="tokens")
    if not isinstance(tokens, list):
        raise ApiError(400, f"field 'tokens' must be a list of token ids, got {type(tokens).__name__}",
                       param="tokens")
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ApiError(400, f"tokens[{i}] must be an integer token id, got {type(t).__name__}", param="tokens")
        if not 0 <= t <= max_token_id:
            raise ApiError(400, f"tokens[{i}] = {t} is outside the vocabulary (0..{max_token_id})", param="tokens")
    if known_id is not None and known_id < max_token_id:
        tokens = [t for t in tokens if t <= known_id]
    try:
        return model, {"prompt": tokenizer.decode(tokens)}
    except Exception as e:
        raise ApiError(400, f"the tokenizer cannot decode these tokens: {type(e).__name__}: {e}",
                       param="tokens") from e


def check_context(req: GenerationRequest, max_model_len: int) -> None:
    """As OpenAI and vLLM: asking for more tokens than the context holds is a 400, not a silent cut."""
    want = (req.params.max_new_tokens if req.asked_tokens is None else req.asked_tokens) if req.asked_length else None
    for p in req.prompts:
        if len(p) >= max_model_len:
            raise ApiError(400, f"the prompt has {len(p)} tokens, which leaves no room under this model's maximum "
                                f"context length of {max_model_len} tokens",
                           param="messages" if req.chat else "prompt",  # the field the client sent
                           code="context_length_exceeded")
        if want is not None and len(p) + want > max_model_len:  # named as sent: max_completion_tokens or max_tokens
            raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{len(p)} tokens and {req.length_field} asks for {want} more",
                           param=req.length_field, code="context_length_exceeded")
        if want is None and len(p) + req.params.min_tokens > max_model_len:  # chat without max_tokens
            raise ApiError(400, f"min_tokens ({req.params.min_tokens}) is more than the {max_model_len - len(p)} "
                                f"tokens this model's maximum context length of {max_model_len} leaves after the "
                                f"prompt's {len(p)}", param="min_tokens", code="context_length_exceeded")
    if req.capped is not None:
        raise req.capped


# ---------------------------------------------------------------------------------------------- responses
def new_id(chat: bool, base: str | None = None) -> str:
    """A response's id: `base` (the client's X-Request-Id header, else its body's request_id, as vLLM takes them)
    after the endpoint's prefix, else a fresh uuid."""
    return ("chatcmpl-" if chat else "cmpl-") + (base or uuid.uuid4().hex)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `cached_tokens` (--enable-prompt-tokens-details, else None: no such field) adds vLLM's
    prompt_tokens_details, null when the prefix cache held none of the prompt (vLLM fills it only with a hit)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens} if cached_tokens else None
    return out


def _tok(tokenizer, token_id: int, as_id: bool = False) -> str:
    """A logprobs entry's token: its text, or with return_tokens_as_token_ids vLLM's "token_id:ID"."""
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id])


MIN_LOGPROB = -9999.0  # what a reply's logprobs show for -inf (a token its grammar masked), as vLLM shows it


def _lp(logprob: float | None) -> float | None:
    """A reply's logprob as JSON can hold it: -inf (a top token its grammar does not allow) as MIN_LOGPROB."""
    return logprob if logprob is None else max(logprob, MIN_LOGPROB)


def completion_logprobs(records: list[dict], tokenizer, offset: int = 0, as_ids: bool = False) -> dict:
    """The legacy completions logprobs object; text_offset counts characters of the tokens' strings from `offset`
    (with `as_ids`, return_tokens_as_token_ids, the "token_id:ID" strings', as vLLM counts them)."""
    tokens = [_tok(tokenizer, r["token_id"], as_ids) for r in records]
    text_offset, pos = [], offset
    for t in tokens:
        text_offset.append(pos)
        pos += len(t)
    # as OpenAI and vLLM: the sampled token is always among its position's top_logprobs (first), so an entry holds
    # up to logprobs + 1 tokens, and logprobs: 0 still gives the sampled one
    tops = []
    for tok, r in zip(tokens, records):
        if r["logprob"] is None:  # an echoed prompt's first token: nothing predicts it (null, as OpenAI)
            tops.append(None)
            continue
        top = {tok: _lp(r["logprob"])}
        for x in r.get("top_logprobs", []):
            top.setdefault(_tok(tokenizer, x["token_id"], as_ids), _lp(x["logprob"]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_lp(r["logprob"]) for r in records], "top_logprobs": tops,
            "text_offset": text_offset}


def prompt_logprobs(records: list[dict | None], tokenizer, k: int | None = None) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (null for the first), {token id: {logprob, rank, decoded_token}}
    for the prompt's own token and the top-k (`k`: the body's prompt_logprobs, when the engine computed more for
    echo's logprobs). A prompt token among the top-k has its place there as its rank, as vLLM's dict (the top-k
    entries written after the token's own) gives it: the same as its own rank unless it ties with another."""
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": _tok(tokenizer, token_id)}
    out = []
    for r in records:
        if r is None:
            out.append(None)
            continue
        e = {str(r["token_id"]): entry(r["token_id"], r["logprob"], r["rank"])}
        for j, x in enumerate(r.get("top_logprobs", [])[:k]):
            e[str(x["token_id"])] = entry(x["token_id"], x["logprob"], j + 1)  # (the token's own key keeps its place)
        out.append(e)
    return out


def chat_logprobs(records: list[dict], tokenizer, as_ids: bool = False) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        t = _tok(tokenizer, token_id, as_ids)
        return {"token": t, "logprob": _lp(logprob), "bytes": list(t.encode("utf-8"))}
    return {"content": [{**entry(r["token_id"], r["logprob"]),
                         "top_logprobs": [entry(x["token_id"], x["logprob"]) for x in r.get("top_logprobs", [])]}
                        for r in records]}


def choice(req: GenerationRequest, index: int, text: str, records: list[dict] | None, tokenizer,
           finish_reason: str | None, delta: bool = False, first: bool = False, token_ids: list[int] | None = None,
           prompt_token_ids: list[int] | None = None, text_offset: int = 0,
           stop_reason: int | str | None = None, tool_calls: list[dict] | None = None,
           reasoning: str | None = None) -> dict:
    """One choice of a response or of a streamed chunk; `text_offset`: where this chunk's text starts in the
    choice's whole text (a completion's logprobs.text_offset counts from the start of the choice, chunk after chunk).
    `stop_reason` (vLLM's field): the stop token id or stop string that ended the choice, None for EOS or a length
    limit. With --reasoning-parser (serve/reasoning.py), a chat message carries vLLM's `reasoning` (null when there
    is none, and `text` None is a null content), a delta carries it when it has some; with include_reasoning false
    a message's is null and no delta carries it (vLLM's rule)."""
    lp = None
    if records is not None:
        lp = chat_logprobs(records, tokenizer, req.tokens_as_ids) if req.chat else \
            completion_logprobs(records, tokenizer, text_offset, req.tokens_as_ids)
    if not req.chat:
        out = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
    elif delta:
        body = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        out = {"index": index, "delta": body, "logprobs": lp, "finish_reason": finish_reason}
    else:
        out = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
               "finish_reason": finish_reason}
    if tool_calls:  # the reply is the calls, after `text` if any (OpenAI: else content null; finish_reason tool_calls)
        message = out["delta" if delta else "message"]
        message["content"], message["tool_calls"] = text or None, tool_calls
        if delta:
            message["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        # the calls read whole, though the reply ran on to max_tokens after them ("auto"): "tool_calls", as vLLM
        # answers, so that a client that acts on the finish_reason makes them
        out["finish_reason"] = "tool_calls" if finish_reason in ("stop", "length") else finish_reason
    if req.chat and req.reasoning is not None and (reasoning or not delta):
        out["delta" if delta else "message"]["reasoning"] = reasoning if req.reasoning.include else None
    out["stop_reason"] = stop_reason if finish_reason == "stop" else None
    if req.return_token_ids and token_ids is not None:
        out["token_ids"] = list(token_ids)
        if prompt_token_ids is not None:
            out["prompt_token_ids"] = list(prompt_token_ids)
    return out


def envelope(req: GenerationRequest, rid: str, model: str, created: int, choices: list[dict],
             usage_obj: dict | None, chunk: bool) -> dict:
    kind = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    out = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
           "system_fingerprint": None}
    if not chunk or req.include_usage:
        out["usage"] = usage_obj
    return out


def reply_parts(req: GenerationRequest, text: str) -> tuple[str | None, str | None, list[dict] | None]:
    """(reasoning, content, calls) of a finished chat reply: the reasoning split first, then the calls read from
    the content only (openai's from the whole reply: harmony's calls are messages of their own, its content the final
    channel's text, null without one, as vLLM's)."""
    thought, whole, calls = None, text, None
    if req.reasoning is not None:
        thought, text = reasoning_split(req.reasoning, text)
    if reads_whole_reply(req.tools):
        text, calls = split_tools(req.tools, whole)
        text = text or None
    elif req.tools is not None and text is not None:
        text, calls = split_tools(req.tools, text)
    return thought, text, calls


class WholeResponse:
    """The body of a response that is not streamed, built from its choices' finished outputs (none failed): what the
    server answers and what `infer run --output-format openai` writes as a batch line's response body. Pure (no web
    framework), so that both use it."""

    def __init__(self, req: GenerationRequest, tokenizer):
        self.req, self.tokenizer = req, tokenizer
        self.choices: dict[int, dict] = {}
        self.prompt_lp: dict[int, list] = {}
        self.prompt_ids: dict[int, list[int]] = {}  # return_token_ids: each choice's prompt (a chat response's too)
        self.prompt_n = self.completion_n = 0
        # (--enable-prompt-tokens-details) the cached prompt tokens the usage reports: as vLLM's, the last prompt's
        # (a completions request's batch of prompts), of its first sample (n > 1: as LLM.generate's merged output)
        self.cached_at, self.cached = -1, 0

    def add(self, i: int, out: RequestOutput) -> None:
        """Choice `i`'s finished output (finish_reason stop or length)."""
        req, tokenizer = self.req, self.tokenizer
        text, records = echoed(req, i, out, tokenizer) if req.echo else (out.text, out.logprobs)
        reason = "length" if req.prompt_only else finish_reason(out)
        ids_out = [] if req.prompt_only else out.token_ids  # not the one token generated and left out
        thought, text, calls = reply_parts(req, text)
        self.choices[i] = choice(req, i, text, records, tokenizer, reason, token_ids=ids_out,
                                 prompt_token_ids=out.prompt_token_ids, stop_reason=out.stop_reason,
                                 tool_calls=calls, reasoning=thought)
        if req.echo_text:  # chat's echo: the last message's text before the content (vLLM's, after the parsers)
            message = self.choices[i]["message"]
            message["content"] = req.echo_text + (message["content"] or "")
        if out.prompt_logprobs is not None and req.asked_prompt_logprobs is not None:
            # vLLM's field: a completion choice's, a chat response's
            self.prompt_lp[i] = prompt_logprobs(out.prompt_logprobs, tokenizer, req.asked_prompt_logprobs)
            if not req.chat:
                self.choices[i]["prompt_logprobs"] = self.prompt_lp[i]
        if req.return_token_ids:
            self.prompt_ids[i] = list(out.prompt_token_ids)
        self.prompt_n += len(out.prompt_token_ids) if req.counts_prompt(i) else 0
        self.completion_n += 0 if req.prompt_only else out.num_generated
        if req.counts_prompt(i) and i > self.cached_at:
            self.cached_at, self.cached = i, out.num_cached_tokens

    def body(self, rid: str, model: str, created: int) -> dict:
        body = envelope(self.req, rid, model, created, [self.choices[i] for i in sorted(self.choices)],
                        usage(self.prompt_n, self.completion_n, self.cached if self.req.cached_details else None),
                        chunk=False)
        if self.req.chat and self.prompt_lp:
            body["prompt_logprobs"] = self.prompt_lp[min(self.prompt_lp)]
        if self.req.chat and self.prompt_ids:  # vLLM's chat response holds the prompt's ids at its top (a client
            # reads response.prompt_token_ids); the choice's copy stays for the clients that read it there
            body["prompt_token_ids"] = self.prompt_ids[min(self.prompt_ids)]
        return body


def engine_error(out: RequestOutput) -> ApiError:
    """The error a request the engine ended with an error answers: 400 when its own constraints reached a dead end
    (the client's to change), else 500."""
    if getattr(out, "bad_request", False):
        return ApiError(400, out.error, code="no_token_left", param=bad_request(out.error).param)  # bad_words
    return ApiError(500, out.error or "the request failed in the engine", type="server_error", code="engine_error")


def finish_reason(out: RequestOutput) -> str:
    return out.finish_reason if out.finish_reason in ("stop", "length", "abort") else "stop"


def now() -> int:
    return int(time.time())
