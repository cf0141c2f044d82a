"""POST /v1/embeddings (OpenAI's format, vLLM's pooling runner): the body read and checked, its inputs tokenized
off the event loop, run as pooling requests, answered with one vector per input (floats, or base64 of little-endian
float32, as vLLM writes them) and the prompt tokens counted. A server started without --runner pooling refuses the
route; a pooling server refuses the generation routes (generation_refusal)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from ..engine.inputs import encode_prompt
from ..engine.pooling import EMBED_ONLY, GENERATE_ONLY, PoolingParams, embedding_fields, embedding_inputs
from ..errors import RequestError
from . import protocol as p


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


# the fields of an embeddings body an error may start with (input[2] -> input); an error about the prompt itself
# (too long for the context...) names input
_FIELDS = ("input", "model", "encoding_format", "dimensions", "normalize", "truncate_prompt_tokens", "priority",
           "add_special_tokens")


def _refused(e: RequestError) -> p.ApiError:
    """A 400 whose param is the body's field the error names (input when it names none of them)."""
    word = re.match(r"[a-z_]*", e.message).group(0)
    return p.bad_request(e, param=word if word in _FIELDS else "input")


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
    try:
        params, fmt = embedding_fields(body)
        inputs = embedding_inputs(body["input"])
        keep = params.truncate_prompt_tokens is not None
        prompts = [list(map(int, item)) if isinstance(item, list) else
                   encode_prompt(tokenizer, prompt=item, max_tokens=None if keep else max_model_len)
                   for item in inputs]
    except RequestError as e:
        raise _refused(e) from None
    return EmbeddingRequest(body.get("model"), prompts, params, fmt)


def response_body(vectors: list, prompt_tokens: int, model: str, fmt: str) -> dict:
    """OpenAI's embeddings response: one entry per vector (a float32 tensor), in order, and the tokens counted."""
    data = [{"index": i, "object": "embedding", "embedding": _encoded(v, fmt)} for i, v in enumerate(vectors)]
    return {"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": p.now(), "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


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
    try:  # (the engine refuses it too, as a request's error: named here as the body's field)
        req.params.check_dimensions(server.engine.pooler, str(server.engine.config.model))
    except RequestError as e:
        raise p.bad_request(e, param="dimensions") from None
    lora = server.lora_for(req.model)
    try:
        queue, ids = server.submit(req, lora, "embd-" + uuid.uuid4().hex)
    except p.ApiError as e:  # what the engine refuses of an input (too long, a token outside the vocabulary...):
        if e.param == "prompt":  # the body's field is input
            e.param = "input"
        raise
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
        return None
    return response_body([vectors[i] for i in range(len(ids))], tokens, req.model or server.model_id,
                         req.encoding_format)
