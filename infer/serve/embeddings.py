"""POST /v1/embeddings (OpenAI's format, vLLM's pooling runner): the body read and checked, its inputs tokenized
off the event loop, run as pooling requests, answered with one vector per input (floats, or base64 of little-endian
float32, as vLLM writes them) and the prompt tokens counted. A server started without --runner pooling refuses the
route; a pooling server refuses the generation routes (generation_refusal)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import re
import sys
import time
import uuid
from contextlib import aclosing
import torch

from ..engine.inputs import encode_prompt
from ..engine.pooling import EMBED_DTYPES, EMBED_ONLY, GENERATE_ONLY, Encoding, PoolingParams, embedding_fields, \
    embedding_inputs, embedding_request_id, pooling_task_params
from ..engine.classify import NOT_EMBEDDER, TOKEN_CLASSIFIER_ONLY, not_generating
from ..errors import RequestError
from . import protocol as p
from .body import DEFAULT_MAX_JSON_DEPTH, check_values, load_json


@dataclasses.dataclass
class EmbeddingRequest:
    """A checked body: what Server.submit reads of a request (its prompts, one choice each, the params of each)."""

    model: str | None
    prompts: list[list[int]]
    params: PoolingParams
    encoding_format: Encoding = Encoding()
    field: str = "input"  # the body's field of the prompts (messages: the chat form), what an engine refusal names
    request_id: str | None = None  # vLLM's field: the response's id is embd- and it (the X-Request-Id header first)
    # the body's name of each prompt where it is not field[i] (a score's text_1 / text_2[3], a rerank's query /
    # documents[3]): what a refusal of one names, every prompt checked before the first wave
    labels: tuple[str, ...] | None = None
    n = 1
    beam = None

    def params_for(self, i: int) -> PoolingParams:
        return self.params


# the fields of an embeddings body an error may start with (input[2] -> input); an error about the prompt itself
# (too long for the context...) names input
_FIELDS = ("input", "model", "encoding_format", "dimensions", "normalize", "truncate_prompt_tokens", "priority",
           "add_special_tokens", "embed_dtype", "endianness", "request_id", "task", "use_activation")


def _refused(e: RequestError) -> p.ApiError:
    """A 400 whose param is the body's field the error names (input when it names none of them)."""
    word = re.match(r"[a-z_]*", e.message).group(0)
    return p.bad_request(e, param=word if word in _FIELDS else "input")


def parse(raw: bytes, tokenizer, max_model_len: int, trust_template: bool = False,
          max_depth: int = DEFAULT_MAX_JSON_DEPTH, pooler=None) -> EmbeddingRequest:
    """The body of POST /v1/embeddings as an EmbeddingRequest; ApiError 400 naming the field otherwise. vLLM's
    chat form (EmbeddingChatRequest): `messages` instead of `input`, rendered as /v1/chat/completions renders them
    (add_generation_prompt defaults to false there, as vLLM's); `trust_template`: --trust-request-chat-template.
    The body is read as the generation routes read theirs (`max_depth`: --max-json-depth; a body nested past
    Python's recursion limit was a 500), every string valid Unicode and every number finite. `pooler` (the
    engine's): the body is POST /pooling's, its task (and a classifier's use_activation) read against it."""
    body = load_json(raw, max_depth)
    check_values(body)
    if not isinstance(body, dict):
        raise p.ApiError(400, "the body must be a JSON object with 'input'")
    chat = body.get("messages") is not None
    if chat and body.get("input") is not None:
        raise p.ApiError(400, "send either input or messages, not both", param="input")
    if not chat and "input" not in body:
        raise p.ApiError(400, "input is required: the text (or token ids) to embed (or messages, a chat rendered "
                              "with the chat template)", param="input")
    try:
        params, fmt = embedding_fields(body, chat=chat)
        if pooler is not None:
            params = pooling_task_params(body, params, pooler.classifies, pooler)
        rid = embedding_request_id(body)
        keep = params.truncate_prompt_tokens is not None
        if chat:
            if body.get("add_generation_prompt") is None:  # (a non-boolean is refused when rendered: "yes" was false)
                body = {**body, "add_generation_prompt": False}
            ids = p.chat_prompt_ids(body, tokenizer, None if keep else max_model_len, trust_template)
            return EmbeddingRequest(body.get("model"), [ids], params, fmt, field="messages", request_id=rid)
        prompts = _token_ids(embedding_inputs(body["input"]), tokenizer, None if keep else max_model_len)
    except RequestError as e:
        raise _refused(e) from None
    return EmbeddingRequest(body.get("model"), prompts, params, fmt, request_id=rid)


def _token_ids(inputs: list, tokenizer, most: int | None) -> list[list[int]]:
    """Each input's token ids (a text tokenized, certainly longer than `most` refused untokenized); a refusal of one
    of several names it, input[i], as the engine's checks of the ids do (a too-long text of 10,000 did not)."""
    prompts = []
    for i, item in enumerate(inputs):
        try:
            prompts.append(list(map(int, item)) if isinstance(item, list) else
                           encode_prompt(tokenizer, prompt=item, max_tokens=most))
        except RequestError as e:
            if len(inputs) == 1:
                raise
            raise RequestError(f"input[{i}]: {e.message}", e.hint) from None
    return prompts


def response_id(base: str | None = None) -> str:
    """An embeddings response's id, as vLLM's: embd- and `base` (the client's X-Request-Id header, else its body's
    request_id), else a fresh uuid."""
    return "embd-" + (base or uuid.uuid4().hex)


def response_body(vectors: list, prompt_tokens: int, model: str, fmt: Encoding, base_id: str | None = None,
                  pooling: bool = False) -> dict:
    """OpenAI's embeddings response: one entry per vector (a float32 tensor), in order, and the tokens counted;
    `base_id`: the client's id for it (response_id). `pooling`: vLLM's PoolingResponse (POST /pooling): id pool-,
    each entry's tensor in `data` (a per-token task's: a list of rows; base64: its bytes, row after row)."""
    kind, key = ("pooling", "data") if pooling else ("embedding", "embedding")
    data = [{"index": i, "object": kind, key: _encoded(v, fmt)} for i, v in enumerate(vectors)]
    rid = ("pool-" + (base_id or uuid.uuid4().hex)) if pooling else response_id(base_id)
    return {"id": rid, "object": "list", "created": p.now(), "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encoded(vec, fmt: Encoding):
    """JSON floats, or base64 of the vector's bytes as fmt.dtype in fmt.endianness (vLLM's embed_dtype)."""
    if fmt.format != "base64":
        return vec.tolist()
    values = vec.to(EMBED_DTYPES[fmt.dtype]).contiguous()
    raw = values.view(torch.uint8).reshape(-1, values.element_size())  # (the host's byte order)
    if (sys.byteorder if fmt.endianness == "native" else fmt.endianness) != sys.byteorder:
        raw = raw.flip(1)
    return base64.b64encode(raw.numpy().tobytes()).decode("ascii")


POOLING_ONLY = "this model is served for text generation: /pooling needs the server started with --runner pooling"


def generation_refusal(server, api: str) -> None:
    """A pooling server's answer to a generation route (vLLM's: the model does not support that API)."""
    pooler = getattr(server.engine, "pooler", None)
    if pooler is not None:
        why = not_generating(pooler, server=True)[0] if pooler.classifies else GENERATE_ONLY
        raise p.ApiError(400, f"The model does not support {api} API: {why}",
                         code="model_not_supported")


async def create(server, request, raw: bytes, pooling: bool = False):
    """The response of POST /v1/embeddings (a SafeJSONResponse body as a dict, or an ApiError raised); `pooling`:
    of POST /pooling (vLLM's PoolingRequest: a `task` of the model's, embed, classify, token_embed or
    token_classify, by default its own, as vLLM's get_pooling_task; the answer a PoolingResponse)."""
    arrival = time.monotonic()
    pooler = getattr(server.engine, "pooler", None)
    if pooler is None and pooling:
        raise p.ApiError(400, f"The model does not support Pooling API: {POOLING_ONLY}", code="model_not_supported")
    if not pooling and (pooler is None or pooler.task != "embed"):
        why = EMBED_ONLY if pooler is None else TOKEN_CLASSIFIER_ONLY if pooler.task == "token_classify" else \
            NOT_EMBEDDER
        raise p.ApiError(400, f"The model does not support Embeddings API: {why}", code="model_not_supported")
    req = await asyncio.to_thread(parse, raw, server.tokenizer, server.engine.max_model_len,
                                  server.parser.trust_template, server.limits.max_json_depth,
                                  pooler if pooling else None)
    try:  # (the engine refuses it too, as a request's error: named here as the body's field)
        req.params.check_dimensions(server.engine.pooler, str(server.engine.config.model))
    except RequestError as e:
        raise p.bad_request(e, param="dimensions") from None
    got = await pooled(server, request, req, server.lora_for(req.model), "pool-" if pooling else "embd-", arrival)
    if got is None:
        return None
    # the client's id names the response (the engine's ids stay the server's own, as the generation routes')
    given = request.headers.get("x-request-id") if request is not None else None
    return response_body(*got, req.model or server.model_id, req.encoding_format, given or req.request_id, pooling)


async def pooled(server, request, req: EmbeddingRequest, lora, prefix: str, arrival: float
                 ) -> tuple[list, int] | None:
    """(the pooled vector of each of req's prompts, in order; the prompt tokens) run in waves of the running slots
    (every input checked first); None if the client went away (what it held aborted). `arrival`: the body's."""
    base_id = prefix + uuid.uuid4().hex
    wave = _running_slots(server)
    if len(req.prompts) > wave or req.labels:  # every input checked before the first wave (vLLM's): none refused
        await asyncio.to_thread(_check_inputs, server, req, lora)  # after waves ran (a large body: off the loop)
    vectors: list = []
    tokens = 0
    start = 0
    try:
        while start < len(req.prompts):
            if start and request is not None and await request.is_disconnected():
                raise _Gone()  # (a wave shorter than the poll of server.outputs would never see the client leave)
            if start:  # the slots of the replicas alive now (one that stopped meanwhile: a smaller wave, not a 400)
                wave = _running_slots(server)
            part = dataclasses.replace(req, prompts=req.prompts[start:start + wave])
            queue, ids = await _submit(server, part, lora, f"{base_id}-{start}", request, first=start == 0)
            got, n = await _collected(server, queue, ids, request, arrival)
            vectors += got
            tokens += n
            start += len(ids)
    except _Gone:
        return None
    return vectors, tokens


def _check_inputs(server, req: EmbeddingRequest, lora) -> None:
    """A 400 naming the first input the engine would refuse (too long, a token outside the vocabulary), before any
    wave runs: the engine's own read-only checks against its fixed limits (AsyncEngine.add runs them beside the
    engine thread too)."""
    for i, prompt in enumerate(req.prompts):
        try:
            server.engine.validate(prompt, req.params_for(i), lora)
        except RequestError as e:
            named = p.bad_request(e)  # (a field the engine names, as Server.submit's refusal)
            if named.param not in (None, "prompt"):  # a body field's (priority...): the body's, not one input's
                raise named from None
            label = req.labels[i] if req.labels else f"{req.field}[{i}]"
            raise p.ApiError(400, f"{label}: {e}", param=label.split("[")[0]) from None


def _running_slots(server) -> int:
    """How many of a body's inputs run at once (a wave): the running slots, of every live replica under
    --data-parallel-size. A larger body runs in waves: it completes whatever --max-queue, and the requests of other
    clients that arrive meanwhile are queued before its next wave, not behind the whole body."""
    replicas = getattr(server.aengine, "replicas", None)
    alive = sum(1 for r in replicas if r.alive) if replicas else 1
    return server.engine.config.max_num_seqs * max(1, alive)


class _Gone(Exception):
    """The client went away mid-body: what it holds is aborted, nothing is answered."""


async def _submit(server, part: EmbeddingRequest, lora, base_id: str, request, first: bool):
    """Submit one wave of a body's inputs. A later wave that finds the queue full (--max-queue, other clients'
    requests) waits for room: the body's first waves are done and its client waits for the rest."""
    from .app import DISCONNECT_POLL_S
    while True:
        try:
            return server.submit(part, lora, base_id)
        except p.ApiError as e:  # what the engine refuses of an input (too long, a token outside the vocabulary...):
            if e.param == "prompt":  # the body's field is input (messages: the chat form)
                e.param = part.field
            if first or e.code != "queue_full":
                raise
        if request is not None and await request.is_disconnected():
            raise _Gone()
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _collected(server, queue, ids: list[str], request, arrival: float) -> tuple[list, int]:
    """(the vectors in order, the prompt tokens) of a submitted wave; _Gone if the client left (the wave's
    requests aborted), an ApiError if one failed."""
    from .app import _ClientGone, _error  # (the app imports this module)
    vectors: dict[int, object] = {}
    tokens = 0
    try:
        async with aclosing(server.outputs(queue, ids, request, arrival)) as outs:
            async for i, out in outs:
                if not out.finished:
                    continue
                if out.error is not None or out.finish_reason != "stop":
                    raise _error(out)
                vectors[i] = out.outputs.data
                tokens += len(out.prompt_token_ids)
    except _ClientGone:
        raise _Gone() from None
    return [vectors[i] for i in range(len(ids))], tokens
