"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine, SSE streaming, auth, errors, metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Sequence
from contextlib import aclosing, asynccontextmanager, contextmanager
from pathlib import PurePath

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.inputs import MAX_LOGPROBS, MAX_TOKENS_CAP, openai_sampling_defaults
from ..engine.sleep import PAUSED, SLEPT
from ..errors import LoRAError, RequestError, SleepModeError
from . import protocol as p
from . import embeddings, scoring
from .adapters import add_adapter_routes
from .async_engine import NO_ENGINE, AsyncEngine, NoEngineError, QueueFullError, ShuttingDownError
from .beams import ServedBeamSearch
from .body import BodyLimits, SafeJSONResponse, request_body
from .cors import CorsOptions
from .guard import ErrorGuardMiddleware, server_error_body
from .lifecycle import uvicorn_server
from .metrics import CONTENT_TYPE, HttpMetricsMiddleware, ServerMetrics
from .parse import ParsePool
from .pause import add_pause_routes
from .reasoning import parts as reasoning_parts
from .responses import add_routes as add_responses_routes
from .sleep import add_sleep_routes, http_message
from .tools import reads_whole_reply, split, visible
from .toolstream import CallStream, partial_calls

log = logging.getLogger("infer.serve")
DISCONNECT_POLL_S = 0.25
UNHEALTHY_AFTER_FAILED_STEPS = 3  # engine steps failed in a row before /health answers 503 (as vLLM's dead engine)


class _ClientGone(Exception):
    pass


class Server:
    """What the routes need: the engine wrapper, model ids, auth and metrics."""

    def __init__(self, aengine: AsyncEngine, model_id: str | Sequence[str],
                 api_key: str | Sequence[str] | None = None,
                 retry_after: int = 1, graceful_timeout: float = 30.0, limits: BodyLimits | None = None,
                 runtime_lora: bool = False,
                 tool_parser: str | None = None, reasoning_parser: str | None = None,
                 trust_request_chat_template: bool = False, cors: CorsOptions | None = None,
                 tokens_as_ids: bool = False, prompt_tokens_details: bool = False):
        """`model_id`: the base model's id, or its ids (--served-model-name A B): a request's `model` may be any of
        them; the first names the base where a name is reported without a request's (/health, adapters' parent).
        `runtime_lora`: the routes that load and unload adapters while serving are on (serve/adapters.py).
        `tool_parser`: --tool-call-parser, which reads the calls of tool_choice "auto" (serve/tools.py).
        `reasoning_parser`: --reasoning-parser, which splits a chat reply's reasoning from its content
        (serve/reasoning.py). `trust_request_chat_template`: a chat request's own chat_template renders it (else it
        is a 400). `cors`: --allowed-origins and the like (serve/cors.py; default: vLLM's, every origin).
        `tokens_as_ids`: --return-tokens-as-token-ids, the return_tokens_as_token_ids of requests that send none.
        `prompt_tokens_details`: --enable-prompt-tokens-details, usage.prompt_tokens_details.cached_tokens (vLLM's).
        `api_key`: the key, or keys (--api-key A B, as vLLM's), each accepted in 'Authorization: Bearer KEY'."""
        self.model_ids = [model_id] if isinstance(model_id, str) else list(model_id)
        # the keys as a client can send them: a header value never holds surrounding whitespace (h11 strips it, as
        # check_auth does), so a key read with its trailing newline (a secret file, a Kubernetes secret) matched none
        keys = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
        self.api_keys = [key.strip().encode() for key in keys]
        self.aengine, self.model_id, self.api_key = aengine, self.model_ids[0], api_key
        self.cors = cors or CorsOptions()
        self.runtime_lora = runtime_lora
        self.tokens_as_ids = tokens_as_ids
        self.prompt_tokens_details = prompt_tokens_details
        self.limits = limits or BodyLimits()
        self.retry_after, self.graceful_timeout = retry_after, graceful_timeout
        self.engine = aengine.engine
        self.tokenizer = self.engine.tokenizer
        self.metrics = ServerMetrics(self.stats, self.engine.max_model_len, self.model_id,
                                     engines=getattr(aengine, "num_engines", 1))
        aengine.on_step = self.metrics.observe_step  # every step's tokens, from the engine thread
        self.created = p.now()
        # what a request gets for the sampling fields it leaves out: the model's generation_config.json, else
        # OpenAI's temperature 1 (vLLM's rule); LLM and plain `infer run` lines stay greedy by default
        self.sampling_defaults = openai_sampling_defaults(self.engine.model_path)
        if MAX_TOKENS_CAP in self.sampling_defaults:  # as vLLM says it at start
            log.warning("the model's generation_config.json has max_new_tokens %d: every request's reply is capped "
                        "at it, as vLLM caps it (remove it from the file to lift the cap)",
                        self.sampling_defaults[MAX_TOKENS_CAP])
        # the engine's max_logprobs: the most logprobs / top_logprobs a request may ask for (protocol._common)
        self.sampling_defaults[MAX_LOGPROBS] = getattr(getattr(self.engine, "config", None), "max_logprobs", 20)
        self._beams: dict[str, ServedBeamSearch] = {}  # a beam search's choice ids -> the search (serve/beams.py)
        self.parser = ParsePool(self.tokenizer, self.limits, max_tokens=self.engine.max_model_len,
                                defaults=self.sampling_defaults, grammars=self.engine.grammars,
                                tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                                trust_template=trust_request_chat_template,
                                bad_words=getattr(self.engine, "bad_word_ids", None), max_prompts=aengine.capacity(),
                                vocab_size=self.engine.model_config.vocab_size)

    def stats(self) -> dict:
        stats = {**self.aengine.stats, "num_in_flight": self.aengine.num_in_flight(),
                 "num_step_errors": self.aengine.num_step_errors}
        held = self.aengine.num_held()  # (accepted while paused: they wait for POST /resume, the engine has none)
        if held:
            stats["num_waiting"] = stats.get("num_waiting", 0) + held
        return stats

    def adapters(self) -> list[str]:
        lm = self.engine.lora_manager
        return sorted(lm.names()) if lm is not None else []

    def model_cards(self) -> list[dict]:
        """/v1/models' entries: the base under each of its ids, then every adapter (its parent: the first id)."""
        card = {"object": "model", "created": self.created, "owned_by": "infer"}
        card["max_model_len"] = self.engine.max_model_len  # as vLLM's cards: clients size prompts from it
        data = [{"id": name, **card, "root": str(self.engine.model_path), "parent": None} for name in self.model_ids]
        lm = self.engine.lora_manager
        return data + [{"id": name, **card, "root": _adapter_root(lm, name), "parent": self.model_id}
                       for name in self.adapters()]

    def lora_for(self, model: str | None) -> str | None:
        """vLLM's rule: the base id (or no model, or an empty name) runs the base; an adapter's name runs that
        adapter."""
        if not model or model in self.model_ids or model in self._model_path_ids():
            return None
        if model in self.adapters():
            return model
        how = ("load an adapter with POST /v1/load_lora_adapter first" if self.runtime_lora else
               "an adapter is served when the server starts with --lora NAME=PATH")
        raise p.ApiError(404, f"the model {model!r} does not exist; available: "
                              f"{', '.join([*self.model_ids, *self.adapters()])} ({how})", param="model",
                         code="model_not_found")

    def _model_path_ids(self) -> tuple[str, ...]:
        """MODEL as given, which vLLM serves under when there is no --served-model-name (infer lists its folder's
        name): accepted then only; with --served-model-name the ids are those names alone (vLLM's 404)."""
        model = self.engine.config.model
        default = PurePath(model.rstrip("/\\")).name or model  # cli.options.base_model_id's rule
        return (model,) if self.model_ids == [default] else ()

    def check_auth(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        sent = token.strip().encode()
        matches = [hmac.compare_digest(sent, key) for key in self.api_keys]  # every key compared: no timing hint
        if scheme.lower() != "bearer" or not sent or not any(matches):  # (a blank key never matches)
            raise p.ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer KEY'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------------------------ generation
    def submit(self, req: p.GenerationRequest, lora: str | None, base_id: str) -> tuple[asyncio.Queue, list[str]]:
        limit = self.aengine.capacity()
        if limit is not None and len(req.prompts) > limit:  # a 503 would make the client retry for ever
            raise p.too_many_choices(len(req.prompts) // req.n, req.n, limit)
        queue: asyncio.Queue = asyncio.Queue()
        ids = [f"{base_id}-{i}" for i in range(len(req.prompts))]
        done: list[str] = []
        try:
            if req.beam is not None:  # vLLM's use_beam_search: one search, its steps on the engine loop
                search = ServedBeamSearch(self.aengine, self.tokenizer, self._eos(), self.engine.max_model_len,
                                          req.prompts, req.n, req.beam, req.params, lora, base_id, self.metrics)
                search.start()
                for rid in search.ids:
                    self._beams[rid] = search
                return search.queue, search.ids
            with self.aengine.admitting():  # every choice with the same adapter weights: no reload in between
                for i, (rid, prompt) in enumerate(zip(ids, req.prompts)):
                    self.aengine.add(rid, prompt, req.params_for(i), lora, queue)
                    done.append(rid)
        except RequestError as e:
            self._abort(done)
            if lora is not None and lora not in self.adapters():  # unloaded since lora_for found it (an unload ran
                self.lora_for(lora)  # on the engine thread meanwhile): the 404 of a request that names it after
            named = p.bad_request(e)  # a field the engine refused (logit_bias, allowed_token_ids...) is named
            raise (named if named.param else p.bad_request(e, param="prompt")) from e
        except QueueFullError as e:
            self._abort(done)
            raise p.ApiError(503, str(e), type="server_overloaded", code="queue_full",
                             headers={"Retry-After": str(self.retry_after)}) from e
        except ShuttingDownError as e:
            self._abort(done)
            raise p.shutting_down(str(e), self.retry_after) from e
        except SleepModeError as e:  # asleep (sleep mode): POST /wake_up first
            self._abort(done)
            raise p.ApiError(503, http_message(e), type="server_unavailable", code="engine_sleeping",
                             headers={"Retry-After": str(self.retry_after)}) from e
        except NoEngineError as e:  # a load balancer retries it elsewhere, as /health already says 503
            self._abort(done)
            raise p.ApiError(503, str(e), type="server_unavailable", code="no_engine_replica",
                             headers={"Retry-After": str(self.retry_after)}) from e
        return queue, ids

    def _abort(self, ids) -> None:
        for rid in ids:
            search = self._beams.pop(rid, None)
            if search is not None:  # a beam search's choice: the search ends (its steps in flight are aborted)
                search.abort()
            else:
                self.aengine.abort(rid)

    def _eos(self) -> set[int]:
        eos = getattr(self.engine, "eos_token_ids", None)
        return set(eos) if eos else {self.tokenizer.eos_token_id}

    async def outputs(self, queue: asyncio.Queue, ids: list[str], request: Request | None, arrival: float):
        """Yield (choice index, RequestOutput) until every request is finished. With `request`, a client that
        goes away raises _ClientGone (streams rely on Starlette cancelling them instead)."""
        index = {rid: i for i, rid in enumerate(ids)}
        left = set(ids)
        counted: dict[str, tuple] = {}  # what the metrics counted of each request so far
        checked = time.monotonic()
        try:
            while left:
                if request is not None and time.monotonic() - checked >= DISCONNECT_POLL_S:
                    if await request.is_disconnected():
                        raise _ClientGone()
                    checked = time.monotonic()
                try:
                    out = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S) if request else await queue.get()
                except asyncio.TimeoutError:
                    continue
                beam = out.request_id in self._beams  # a beam search's choice: its steps are what /metrics counts
                if not beam:
                    self.metrics.observe_output(out, arrival, counted)
                if out.finished:
                    left.discard(out.request_id)
                    self._beams.pop(out.request_id, None)
                    if not beam:
                        self.metrics.observe_finished(out, arrival, time.monotonic())
                yield index[out.request_id], out
        finally:
            if left:  # client gone, cancelled, or an error: free the engine's KV blocks now
                for rid in left:  # (a beam search counts the aborts of its steps, on their engines)
                    if rid not in self._beams:
                        self.metrics.engine(self.aengine.engine_of(rid)).finished.labels("abort").inc()
                self._abort(left)


# Characters Python's str.splitlines() (httpx's aiter_lines, many SSE readers) breaks a line at, beside CR and LF
# (which JSON always escapes): escaped, so a streamed event stays on one line; a JSON reader gets the same string.
# And lone surrogates, which UTF-8 cannot hold (a tool call's arguments that a model wrote with a "\\ud800" escape,
# read and written again): escaped, as the whole response's SafeJSONResponse writes them, not a stream cut short
_ESCAPED = str.maketrans({c: f"\\u{ord(c):04x}" for c in [*"\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029",
                                                             *map(chr, range(0xD800, 0xE000))]})


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_ESCAPED)


def paused(out) -> bool:
    """Whether POST /pause (mode abort) ended the request: its reply says finish_reason "abort", as vLLM's."""
    return out.finish_reason == "abort" and out.error == PAUSED


def _error(out) -> p.ApiError:
    if out.finish_reason == "abort" and out.error == SLEPT:  # aborted by POST /sleep (sleep mode), not a shutdown
        return p.ApiError(503, f"{SLEPT}: POST /wake_up, then retry", type="server_unavailable",
                          code="engine_sleeping", headers={"Retry-After": "1"})
    if out.finish_reason == "abort" and out.error == PAUSED:  # (a reply that cannot say finish_reason "abort")
        return p.ApiError(503, f"{PAUSED}: retry after POST /resume", type="server_unavailable",
                          code="generation_paused", headers={"Retry-After": "1"})
    if out.finish_reason == "abort":  # ended by the server's shutdown (lifecycle.py): another replica may answer
        return p.shutting_down(out.error or "the server shut down before the request finished")
    if out.error == NO_ENGINE:  # accepted, then its replica and every other died: as a request refused for it
        return p.ApiError(503, out.error, type="server_unavailable", code="no_engine_replica",
                          headers={"Retry-After": "1"})
    return p.engine_error(out)  # its own constraints reached a dead end (400), or the engine failed (500)


async def _complete(server: Server, req: p.GenerationRequest, rid: str, model: str, queue, ids, request,
                    arrival: float) -> SafeJSONResponse:
    response = p.WholeResponse(req, server.tokenizer)
    try:
        async with aclosing(server.outputs(queue, ids, request, arrival)) as outs:
            async for i, out in outs:
                if not out.finished:
                    continue
                if out.finish_reason in ("error", "abort") and not paused(out):
                    raise _error(out)
                response.add(i, out)  # (one POST /pause aborted: finish_reason "abort" and its text, as vLLM's)
    except _ClientGone:
        return SafeJSONResponse({}, status_code=499)  # nobody reads it
    return SafeJSONResponse(response.body(rid, model, p.now()))


async def _stream(server: Server, req: p.GenerationRequest, rid: str, model: str, queue, ids, arrival: float):
    """The SSE events of a streamed reply, ending in `data: [DONE]`. An unexpected error once the stream started
    (the status is sent: there is no 500 to answer) is an error event, then [DONE], as vLLM ends such a stream, and
    the requests still running are aborted; it is logged with its traceback."""
    try:
        async with aclosing(_stream_events(server, req, rid, model, queue, ids, arrival)) as events:
            async for chunk in events:  # closed with this one (a client gone): its requests are aborted at once
                yield chunk
    except Exception as e:  # noqa: BLE001 (a bug of the server: the client is told, not left with a cut stream)
        log.exception("unhandled error in the stream %s", rid)
        yield f"data: {_dumps(server_error_body(e))}\n\n"
    yield "data: [DONE]\n\n"


async def _stream_events(server: Server, req: p.GenerationRequest, rid: str, model: str, queue, ids,
                         arrival: float):
    created, sent_lp, offsets = p.now(), {}, {}  # offsets: where choice i's next logprobs text_offset starts
    sent = {}  # with tools or reasoning: how much of choice i's content went out
    thought = {}  # with reasoning: how much of choice i's reasoning went out
    streams = {}  # with tools: choice i's calls as they went out
    memos = {}  # choice i's reply's reads kept from token to token (harmony's: serve/reasoning.py's harmony_read)
    prompt_n, completion_n = 0, 0
    cached = None  # (--enable-prompt-tokens-details) as vLLM's stream: the first output's cached prompt tokens
    echoed, prompted = set(), set()  # the choices whose prompt (echo), whose prompt_token_ids went out

    def event(choices, usage=None, top: dict | None = None) -> str:
        body = p.envelope(req, rid, model, created, choices, usage, chunk=True)
        return f"data: {_dumps({**body, **(top or {})})}\n\n"

    if req.chat:
        for i in range(len(ids)):
            usage = p.usage(len(req.prompts[i]), 0) if req.continuous_usage else None
            # return_token_ids: the prompt's ids at the top of each choice's first chunk, as vLLM streams them
            top = {"prompt_token_ids": list(req.prompts[i])} if req.return_token_ids else None
            yield event([p.choice(req, i, "", None, server.tokenizer, None, delta=True, first=True)], usage, top)
        for i in range(len(ids)) if req.echo_text else ():  # echo: the last message's text, after the roles (vLLM)
            usage = p.usage(len(req.prompts[i]), 0) if req.continuous_usage else None
            yield event([p.choice(req, i, req.echo_text, None, server.tokenizer, None, delta=True)], usage)
    async with aclosing(server.outputs(queue, ids, None, arrival)) as outs:
        async for i, out in outs:
            slept = out.finished and out.finish_reason == "abort" and out.error in (SLEPT, PAUSED)
            if out.finished and out.finish_reason in ("error", "abort") and not slept:
                yield f"data: {_dumps(_error(out).body())}\n\n"
                break
            if cached is None:
                cached = out.num_cached_tokens
            records = None
            if out.logprobs is not None:
                records, sent_lp[i] = out.logprobs[sent_lp.get(i, 0):], len(out.logprobs)
            reason = "abort" if slept else p.finish_reason(out) if out.finished else None  # (slept: as vLLM's)
            new_ids = out.new_token_ids if req.return_token_ids else None
            delta, calls, text, reasoning = out.delta_text, None, None, ""  # text: read where needed (a copy)
            read = None  # with tools, finished: the whole reply's calls
            if req.echo:  # (completions) the prompt and its logprobs first, in the choice's first chunk, as vLLM
                if req.prompt_only:  # max_tokens 0: the prompt alone, the one token generated left out
                    delta, records = "", None if records is None else []
                    new_ids, reason = [] if new_ids is not None else None, "length" if out.finished else None
                if i not in echoed:
                    echoed.add(i)
                    head, head_records = p.echoed_prompt(req, i, out, server.tokenizer)
                    delta, records = head + delta, None if records is None else head_records + records
            if req.reasoning is not None:  # the reasoning first: what follows it is the text tools are read from
                whole, text = reasoning_parts(req.reasoning, out.text, out.finished, memos.setdefault(i, {}))
                reasoning, thought[i] = whole[thought.get(i, 0):] if req.reasoning.include else "", len(whole)
                delta = text[sent.get(i, 0):]
            if req.tools is not None and req.tools.mode != "none":  # the content before the calls (none for a
                # constrained call), the calls as they come (serve/toolstream.py), then the finish alone
                text = out.text if text is None or reads_whole_reply(req.tools) else text
                stream = streams.setdefault(i, CallStream(req.tools))
                if out.finished and not slept:
                    content, read = split(req.tools, text)
                    calls = stream.deltas(read or [], finished=True)
                else:
                    content = visible(req.tools, text, memos.setdefault(i, {})) if req.tools.mode == "auto" else ""
                    calls = stream.deltas(partial_calls(req.tools, text, stream.memo))
                delta = content[sent.get(i, 0):]
            sent[i] = sent.get(i, 0) + len(delta)
            if delta or reasoning or records or reason or new_ids or calls:
                # return_token_ids: the prompt's ids ride in the choice's first chunk, as vLLM streams them
                prompt_ids = out.prompt_token_ids if new_ids is not None and i not in prompted else None
                if prompt_ids is not None:
                    prompted.add(i)
                c = p.choice(req, i, delta, records, server.tokenizer, reason, delta=True, token_ids=new_ids,
                             text_offset=offsets.get(i, 0), stop_reason=out.stop_reason if out.finished else None,
                             reasoning=reasoning, prompt_token_ids=prompt_ids)
                if calls:
                    c["delta"]["tool_calls"] = calls
                if reason in ("stop", "length") and read:  # the calls read whole: "tool_calls", as a whole reply's
                    c["finish_reason"] = "tool_calls"
                lp = c.get("logprobs") if not req.chat else None
                if lp and lp["tokens"]:
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                # stream_options.continuous_usage_stats: this choice's tokens so far in every chunk (as vLLM)
                generated = 0 if req.prompt_only else out.num_generated
                now = p.usage(len(out.prompt_token_ids), generated) if req.continuous_usage else None
                if calls and reason:  # the calls, then the finish alone with an empty delta, as OpenAI streams: its
                    # SDK's stream helper only ends (tool_calls.function.arguments.done) a call seen before the finish
                    end = {"index": i, "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"],
                           "stop_reason": c["stop_reason"]}
                    yield event([{**c, "finish_reason": None, "stop_reason": None}], now)
                    c = end
                yield event([c], now)
            if out.finished:
                prompt_n += len(out.prompt_token_ids) if req.counts_prompt(i) else 0
                completion_n += 0 if req.prompt_only else out.num_generated
        else:
            if req.include_usage:
                # the final chunk leaves out a null prompt_tokens_details (vLLM's drops the nulls of that chunk)
                yield event([], p.usage(prompt_n, completion_n, (cached or None) if req.cached_details else None))


def _routing_message(request: Request, e, headers) -> str:
    """The router's bare "Not Found" / "Method Not Allowed" (a client's `curl HOST/completions`, a GET of a POST
    route) as what was asked and what to ask instead."""
    asked = f"{request.method} {request.url.path}"
    if e.status_code == 404 and e.detail == "Not Found" and request.url.path.endswith("_lora_adapter"):
        return (f"no route {asked}: the runtime LoRA routes are off; start the server with --allow-runtime-lora "
                "(it lets clients make the server read a folder they name)")
    if e.status_code == 404 and e.detail == "Not Found":
        return (f"no route {asked}: the OpenAI routes are under /v1 (POST /v1/completions, POST "
                "/v1/chat/completions, POST /v1/responses, GET /v1/models), beside GET /health, GET /metrics, POST "
                "/tokenize, POST /detokenize and GET /version")
    if e.status_code == 405 and e.detail == "Method Not Allowed":
        allow = (headers or {}).get("Allow") or (headers or {}).get("allow")
        return f"{asked} is not allowed" + (f": use {allow}" if allow else "")
    return str(e.detail)


def _install_handlers(app: FastAPI) -> None:
    """Every answer that is not a success is an OpenAI-style error body (ErrorGuardMiddleware makes the 500s)."""
    @app.exception_handler(p.ApiError)
    async def api_error(request: Request, e: p.ApiError):
        return SafeJSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        headers = getattr(e, "headers", None)  # a 405's Allow among them
        return SafeJSONResponse(p.ApiError(e.status_code, _routing_message(request, e, headers)).body(),
                                status_code=e.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return SafeJSONResponse(p.ApiError(400, str(e.errors())).body(), status_code=400)


async def _generate(server: Server, request: Request, chat: bool):
    arrival = time.monotonic()
    raw = await request_body(server, request)
    if raw is None:
        return Response(status_code=499)  # nobody reads it
    embeddings.generation_refusal(server, "Chat Completions" if chat else "Completions")
    req = await server.parser.parse(raw, chat)  # JSON, checks and tokenization run off the event loop
    del raw
    if req.tokens_as_ids is None:  # the field when sent (false too), else the server's option, as vLLM reads them
        req.tokens_as_ids = server.tokens_as_ids
    req.cached_details = server.prompt_tokens_details
    lora = server.lora_for(req.model)
    p.check_context(req, server.engine.max_model_len)
    model = req.model or server.model_id
    # the client's id names the response, as in vLLM (the X-Request-Id header first, then the body's request_id;
    # RequestIdMiddleware sends the header back); the engine's ids stay the server's own, so two requests that send
    # the same id do not collide
    rid = p.new_id(chat, request.headers.get("x-request-id") or req.request_id)
    queue, ids = server.submit(req, lora, p.new_id(chat))
    if req.stream:
        return StreamingResponse(_stream(server, req, rid, model, queue, ids, arrival),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _complete(server, req, rid, model, queue, ids, request, arrival)


async def _tokenization(server: Server, request: Request, detokenize: bool):
    """vLLM's /tokenize and /detokenize: the body is read, checked and (de)tokenized on a parse thread; the model
    may be the base or an adapter (they share the tokenizer), else the 404 of the other routes."""
    raw = await request_body(server, request)
    if raw is None:
        return Response(status_code=499)  # nobody reads it
    if detokenize:
        model, out = await server.parser.detokenize(raw)
    else:
        model, out = await server.parser.tokenize(raw, server.engine.max_model_len)
    server.lora_for(model)
    return SafeJSONResponse(out)


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, but a refused preflight (an origin, method or header not allowed) is answered as every other
    error, an OpenAI-style JSON body with its 400 (Starlette's is a bare text/plain "Disallowed CORS origin")."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        message = response.body.decode("utf-8", "replace")
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-type", "content-length")}
        return SafeJSONResponse(p.ApiError(response.status_code, f"{message}: the preflight of "
                                                                 f"{request_headers.get('origin')!r} is refused by "
                                                                 "--allowed-origins, --allowed-methods or "
                                                                 "--allowed-headers", code="cors_disallowed").body(),
                                status_code=response.status_code, headers=headers)


class RequestIdMiddleware:
    """Pure ASGI middleware: a request's X-Request-Id header comes back on its response, whatever the route and
    status (an error too), as vLLM's --enable-request-id-headers sends it, so a client or a proxy can match them."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = [value for name, value in scope.get("headers", ()) if name.lower() == b"x-request-id"]
        if not given or not given[0]:
            return await self.app(scope, receive, send)

        async def echoing_send(message):
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", given[0])]}
            await send(message)

        await self.app(scope, receive, echoing_send)


def create_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.aengine.start()
        try:
            yield
        finally:  # uvicorn has already waited for (or cancelled) in-flight requests
            await asyncio.to_thread(server.aengine.shutdown, server.graceful_timeout)
            server.parser.close()

    app = FastAPI(title="infer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(ErrorGuardMiddleware)  # inner: its 500s pass through the metrics middleware
    # CORS outside the guard (a 500 gets the CORS headers too, so a page can read it) and before routing, so that a
    # preflight OPTIONS is answered without --api-key (as vLLM); inside the metrics and X-Request-Id middlewares
    app.add_middleware(JsonCORSMiddleware, **server.cors.middleware_kwargs())
    app.add_middleware(HttpMetricsMiddleware, metrics_fn=lambda: server.metrics)
    app.add_middleware(RequestIdMiddleware)  # outermost: a 500 of the guard carries the id too
    _install_handlers(app)
    _add_routes(app, server)
    return app


def _pooling_route(server: Server, handler):
    """A route of serve.scoring's (classify, score, rerank): the body read, the handler's dict answered."""
    async def route(request: Request):
        arrival = time.monotonic()
        raw = await request_body(server, request)
        body = None if raw is None else await handler(server, request, raw, arrival)
        return Response(status_code=499) if body is None else SafeJSONResponse(body)
    return route


def _add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(server, request, chat=True)

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request):
        raw = await request_body(server, request)
        body = None if raw is None else await embeddings.create(server, request, raw)
        return Response(status_code=499) if body is None else SafeJSONResponse(body)

    @app.post("/pooling")
    async def create_pooling(request: Request):  # vLLM's PoolingRequest: any task of the model's
        raw = await request_body(server, request)
        body = None if raw is None else await embeddings.create(server, request, raw, pooling=True)
        return Response(status_code=499) if body is None else SafeJSONResponse(body)

    for route, handler in (("/classify", scoring.classify), ("/score", scoring.score), ("/v1/score", scoring.score),
                           ("/rerank", scoring.rerank), ("/v1/rerank", scoring.rerank),
                           ("/v2/rerank", scoring.rerank)):
        app.add_api_route(route, _pooling_route(server, handler), methods=["POST"])

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": server.model_cards()}

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(request: Request, model: str):
        """OpenAI's retrieve (`client.models.retrieve(id)`): one card, or 404 naming the models there are."""
        server.check_auth(request)
        for card in server.model_cards():
            if card["id"] == model:
                return card
        if not model:  # GET /v1/models/: no id (a request's empty `model` runs the base, not this)
            raise p.ApiError(404, "no model id after /v1/models/; available: "
                                  f"{', '.join(card['id'] for card in server.model_cards())}", param="model",
                             code="model_not_found")
        server.lora_for(model)  # raises the 404 that names the served models
        return server.model_cards()[0]  # the model as given on the command line (a path): the base

    add_adapter_routes(app, server)
    add_sleep_routes(app, server)
    add_pause_routes(app, server)
    add_responses_routes(app, server)

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers and probes often send HEAD
    async def health():
        stats = {k: v for k, v in server.stats().items() if k != "engines"}  # (each replica's: /metrics' series)
        if stats.get("num_replicas_alive", 1) == 0:  # every data-parallel replica died: probes must see it
            coming = stats.get("replicas_restarting", 0)  # (fresh ones loading: requests wait for them)
            return SafeJSONResponse({"status": "unavailable", "model": server.model_id, "engine": stats,
                                     "error": f"every engine replica stopped; {coming} being restarted" if coming
                                     else "no engine replica is left; restart the server"}, status_code=503)
        died = getattr(server.aengine, "died", "")
        if died:  # the engine thread is gone (a bug): nothing runs any more
            return SafeJSONResponse({"status": "unavailable", "model": server.model_id, "engine": stats,
                                     "error": f"the engine loop stopped ({died}); restart the server"},
                                    status_code=503)
        failing = getattr(server.aengine, "failing_steps", 0)
        if failing >= UNHEALTHY_AFTER_FAILED_STEPS:  # every step fails (a lost device): every request is a 500
            return SafeJSONResponse({"status": "unavailable", "model": server.model_id, "engine": stats,
                                     "error": f"the engine's last {failing} steps failed "
                                              f"({server.aengine.last_step_error}); restart the server"},
                                    status_code=503)
        return {"status": "ok", "model": server.model_id, "engine": stats}

    # vLLM's utility routes, outside /v1 as in vLLM; --api-key guards them as every route but /health
    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _tokenization(server, request, detokenize=False)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _tokenization(server, request, detokenize=True)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):  # vLLM's (its dev mode): `infer bench --url` starts levels cold
        server.check_auth(request)
        try:
            done = await server.aengine.reset_prefix_cache()
        except ShuttingDownError as e:
            raise p.shutting_down(str(e)) from None
        except NoEngineError as e:  # the engine thread stopped, or every replica
            raise p.ApiError(503, str(e), type="server_unavailable", code="no_engine_replica",
                             headers={"Retry-After": str(server.retry_after)}) from None
        if not done:
            raise p.ApiError(500, "a replica could not reset its prefix cache", type="server_error")
        return Response(status_code=200)

    @app.get("/version")
    async def version(request: Request):
        server.check_auth(request)
        return {"version": __version__}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request):
        server.check_auth(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)


def _adapter_root(manager, name: str) -> str:
    """An adapter card's `root`: the folder it was loaded from, as vLLM's (its name where the folder is not known)."""
    try:
        return manager.path_of(name) or name
    except (AttributeError, LoRAError):  # a registry that does not know the folders, or removed meanwhile
        return name


@contextmanager
def serve_in_thread(server: Server, host: str = "127.0.0.1", port: int = 0, graceful_timeout: float = 5.0):
    """Run the app with uvicorn in a background thread (tests, in-process benchmarks); yields the base URL."""
    import socket
    import threading

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, port))
    uv = uvicorn_server(server, create_app(server), graceful_timeout, log_level="warning")
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="infer-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=graceful_timeout + 15)
        sock.close()
