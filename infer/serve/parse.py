"""Request bodies -> GenerationRequest on worker threads, so that parsing, checking and tokenizing a large body
never blocks the event loop (other requests, /health and /metrics keep answering while it runs)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from ..engine.inputs import whole_numbers
from ..errors import RequestError
from . import protocol as p
from .body import BodyLimits, check_values, load_json

log = logging.getLogger("infer.serve")
PARSE_THREADS = 2  # a big body does not hold up small ones; few enough that bodies in flight stay bounded


def parse_body(raw: bytes, chat: bool, tokenizer, limits: BodyLimits, max_tokens: int | None = None,
               defaults: dict | None = None, grammars=None, tool_parser: str | None = None,
               reasoning_parser: str | None = None, trust_template: bool = False,
               bad_words=None, max_prompts: int | None = None, convert=None) -> p.GenerationRequest:
    """The whole pipeline for one body (raises ApiError with a 4xx for anything a client can send); a prompt
    certainly longer than `max_tokens` (the context) is refused before it is tokenized; `defaults` fill the sampling
    fields it leaves out. A structured output is compiled here by `grammars` (the engine's GrammarBackend, which
    caches it), not on the engine's thread. `tool_parser`: the server's --tool-call-parser (serve/tools.py);
    `reasoning_parser`: its --reasoning-parser (serve/reasoning.py); `trust_template`: --trust-request-chat-template
    (a chat body's own chat_template is used). `bad_words`: the engine's bad_word_ids, which tokenizes the words here
    (and caches them), not on the event loop or the engine's thread, which check and add every choice.
    `max_prompts`: what the server can hold at once (AsyncEngine.capacity: its running slots and --max-queue); a
    completion with more prompts (x n) is refused before its values are
    walked and its prompts read (an 8 MB body of 1.9 million one-token prompts held a parse thread for a minute).
    `convert`: turns another endpoint's body into the chat body it runs as (serve/responses.py's to_chat)."""
    body = whole_numbers(load_json(raw, limits.max_json_depth))  # max_tokens 5.0 is 5, as vLLM reads it
    if convert is not None:
        check_values(body)
        body = convert(body)
    if not chat and max_prompts is not None and isinstance(body, dict):
        prompts, n = p.prompt_count(body.get("prompt")), body.get("n")
        n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= p.MAX_N else 1
        if prompts * n > max_prompts:
            raise p.too_many_choices(prompts, n, max_prompts)
    check_values(body)
    req = (p.parse_chat(body, tokenizer, max_tokens, defaults, tool_parser, reasoning_parser, trust_template) if chat
           else p.parse_completion(body, tokenizer, max_tokens, defaults))
    ignored = p.ignored_fields(body)
    if ignored:  # as vLLM's log line: the client gets its reply, the operator sees what did nothing
        log.warning("the following fields were present in the request but ignored: %s", ", ".join(ignored))
    spec = req.params.structured_outputs
    if spec is not None and grammars is not None:
        try:
            grammars.matcher(spec, req.params.prefix_token_ids)
        except RequestError as e:
            raise p.ApiError(400, str(e), param=req.structured_field) from e
    if req.params.bad_words and bad_words is not None:
        try:
            bad_words(req.params.bad_words)
        except RequestError as e:
            raise p.ApiError(400, str(e), param="bad_words") from e
    return req


def tokenize_body(raw: bytes, tokenizer, limits: BodyLimits, max_model_len: int,
                  trust_template: bool = False) -> tuple[str | None, dict]:
    """POST /tokenize's body -> (model, response), on a parse thread as the chat rendering it shares."""
    body = load_json(raw, limits.max_json_depth)
    check_values(body)
    return p.tokenize(body, tokenizer, max_model_len, trust_template)


def max_token_id(tokenizer) -> int:
    """The largest id the tokenizer knows (added tokens included): vLLM's bound for the ids it decodes."""
    vocab = tokenizer.get_vocab()
    return max(vocab.values()) if vocab else len(tokenizer) - 1


def detokenize_body(raw: bytes, tokenizer, limits: BodyLimits, pool: "ParsePool") -> tuple[str | None, dict]:
    """POST /detokenize's body -> (model, response): ids of the model's vocab_size (padded past the tokenizer's
    length: ids the model can produce, which /v1/completions takes as a prompt) and of the tokenizer (an added token
    past vocab_size) are decoded, as vLLM bounds them."""
    body = load_json(raw, limits.max_json_depth)
    check_values(body)
    if pool.max_token_id is None:  # once: get_vocab builds the whole vocabulary
        pool.max_token_id = max_token_id(tokenizer)
    known = pool.max_token_id
    bound = known if pool.vocab_size is None else max(known, pool.vocab_size - 1)
    return p.detokenize(body, tokenizer, bound, known)


class ParsePool:
    def __init__(self, tokenizer, limits: BodyLimits, threads: int = PARSE_THREADS, max_tokens: int | None = None,
                 defaults: dict | None = None, grammars=None, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, trust_template: bool = False, bad_words=None,
                 max_prompts: int | None = None, vocab_size: int | None = None):
        self.tokenizer, self.limits, self.max_tokens, self.defaults = tokenizer, limits, max_tokens, defaults
        self.vocab_size = vocab_size  # the model's (config.json): /detokenize's bound
        self.grammars, self.tool_parser, self.reasoning_parser = grammars, tool_parser, reasoning_parser
        self.trust_template, self.bad_words, self.max_prompts = trust_template, bad_words, max_prompts
        self.max_token_id: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="infer-parse")

    async def parse(self, raw: bytes, chat: bool, convert=None) -> p.GenerationRequest:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, parse_body, raw, chat, self.tokenizer, self.limits,
                                          self.max_tokens, self.defaults, self.grammars, self.tool_parser,
                                          self.reasoning_parser, self.trust_template, self.bad_words,
                                          self.max_prompts, convert)

    async def tokenize(self, raw: bytes, max_model_len: int) -> tuple[str | None, dict]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, tokenize_body, raw, self.tokenizer, self.limits, max_model_len,
                                          self.trust_template)

    async def detokenize(self, raw: bytes) -> tuple[str | None, dict]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, detokenize_body, raw, self.tokenizer, self.limits, self)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
