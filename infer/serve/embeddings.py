"""POST /v1/embeddings (OpenAI's format, vLLM's pooling runner): the body read and checked, its inputs tokenized
off the event loop, run as pooling requests, answered with one vector per input (floats, or base64 of little-endian
float32, as vLLM writes them) and the prompt tokens counted. A server started without --runner pooling refuses the
route; a pooling server refuses the generation routes (generation_refusal)."""

from __future__ import annotations

import asyncio
import base64
import json
import numbers
import time
import uuid
from dataclasses import dataclass

from ..engine.inputs import encode_prompt
from ..engine.pooling import EMBED_ONLY, GENERATE_ONLY, PoolingParams
from ..errors import RequestError
from . import protocol as p

ENCODINGS = ("float", "base64")


@dataclass
class EmbeddingRequest:
    """A checked body: what Server.submit reads of a request (its prompts, one choice each, the params of each)."""

    model: str | None
    prompts: list[list[int]]
    params: PoolingParams
    encoding_format: str = "float"
    n = 1
    beam = None

    def params_for(self, i: int) -> PoolingParams:
        return self.params


def _inputs(value) -> list:
    """The body's `input` as a list of prompts, each text or a list of token ids (OpenAI's four forms)."""
    hint = "give a string, a list of strings, a list of token ids, or a list of token-id lists"
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_id(t) for t in value):
        value = [value]
    if not isinstance(value, list):
        raise p.ApiError(400, f"input must be text or token ids, got {type(value).__name__}", param="input")
    if not value:
        raise p.ApiError(400, f"input is an empty list: {hint}", param="input")
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise p.ApiError(400, f"input[{i}] is an empty string: there is nothing to embed", param="input")
        elif isinstance(item, list) and all(_is_id(t) for t in item):
            if not item:
                raise p.ApiError(400, f"input[{i}] is an empty list of token ids", param="input")
        else:
            raise p.ApiError(400, f"input[{i}] is neither text nor a list of token ids (integers): {hint}",
                             param="input")
    return value


def _is_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def parse(raw: bytes, tokenizer, max_model_len: int) -> EmbeddingRequest:
    """The body of POST /v1/embeddings as an EmbeddingRequest; ApiError 400 naming the field otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise p.ApiError(400, f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise p.ApiError(400, "the body must be a JSON object with 'input'")
    if "input" not in body:
        raise p.ApiError(400, "input is required: the text (or token ids) to embed", param="input")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise p.ApiError(400, f"model must be a string, got {type(model).__name__}", param="model")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODINGS:
        raise p.ApiError(400, f"encoding_format {fmt!r} is not one of {', '.join(ENCODINGS)}",
                         param="encoding_format")
    params = PoolingParams(dimensions=body.get("dimensions"), normalize=body.get("normalize"),
                           truncate_prompt_tokens=body.get("truncate_prompt_tokens"))
    try:
        params.checked()
    except RequestError as e:
        raise p.bad_request(e, param=str(e).split(" ", 1)[0]) from None
    keep = params.truncate_prompt_tokens is not None
    prompts = []
    for item in _inputs(body["input"]):
        try:
            prompts.append(list(map(int, item)) if isinstance(item, list) else
                           encode_prompt(tokenizer, prompt=item, max_tokens=None if keep else max_model_len))
        except RequestError as e:
            raise p.bad_request(e, param="input") from None
    return EmbeddingRequest(model, prompts, params, fmt)


def _encoded(vec, fmt: str):
    if fmt == "base64":
        return base64.b64encode(vec.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def generation_refusal(server, api: str) -> None:
    """A pooling server's answer to a generation route (vLLM's: the model does not support that API)."""
    if getattr(server.engine, "pooler", None) is not None:
        raise p.ApiError(400, f"The model does not support {api} API: {GENERATE_ONLY}",
                         code="model_not_supported")


async def create(server, request, raw: bytes):
    """The response of POST /v1/embeddings (a SafeJSONResponse body as a dict, or an ApiError raised)."""
    from .app import _ClientGone, _error  # (the app imports this module)
    arrival = time.monotonic()
    if getattr(server.engine, "pooler", None) is None:
        raise p.ApiError(400, f"The model does not support Embeddings API: {EMBED_ONLY}", code="model_not_supported")
    req = await asyncio.to_thread(parse, raw, server.tokenizer, server.engine.max_model_len)
    lora = server.lora_for(req.model)
    queue, ids = server.submit(req, lora, "embd-" + uuid.uuid4().hex)
    vectors: dict[int, object] = {}
    tokens = 0
    try:
        async for i, out in server.outputs(queue, ids, request, arrival):
            if not out.finished:
                continue
            if out.error is not None or out.finish_reason != "stop":
                raise _error(out)
            vectors[i] = out.outputs.data
            tokens += len(out.prompt_token_ids)
    except _ClientGone:
        return None
    data = [{"index": i, "object": "embedding", "embedding": _encoded(vectors[i], req.encoding_format)}
            for i in range(len(ids))]
    return {"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": p.now(),
            "model": req.model or server.model_id, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
