"""Request bodies in, safely: a size limit checked while the bytes arrive, then (off the event loop) JSON with a
bounded nesting depth, and every string and number checked before anything reads them.

`read_body` runs on the event loop but only counts bytes; `load_json` and `check_values` are meant for a worker
thread (the routes call them through the server's parse executor), so one huge body never stalls other requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect, Request

from ..engine.inputs import check_text
from ..errors import RequestError, json_problem
from .protocol import ApiError

DEFAULT_MAX_BODY_SIZE = 8 * 2**20  # bytes (8 MiB)
DEFAULT_MAX_JSON_DEPTH = 64  # nested arrays/objects; OpenAI bodies need about 5
DEFAULT_BODY_IDLE_TIMEOUT_S = 60.0  # a body none of whose bytes arrive for this long is given up with a 408
# a string, or one left open (it runs to the end of the body): a match never fails, so no part of the body is scanned
# twice (an open string of escaped quotes was rescanned from each of them: quadratic, holding the GIL for hours)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


@dataclass(frozen=True)
class BodyLimits:
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    body_idle_timeout: float | None = DEFAULT_BODY_IDLE_TIMEOUT_S  # seconds (None: wait for ever)


class ClientGone(Exception):
    """The client closed the connection before its body arrived: nobody is left to answer."""


class SafeJSONResponse(JSONResponse):
    """A JSON response that never fails to render: text that UTF-8 cannot hold (a lone surrogate echoed from a
    request) is written \\u-escaped instead of raising."""

    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's limit of {limit:,} bytes",
                    code="request_too_large")


async def read_body(request: Request, limit: int, idle_timeout: float | None = None) -> bytes:
    """The whole body, or ApiError 413 as soon as it is known to pass `limit` bytes: from Content-Length before
    a byte is read, and by counting what arrives for a chunked body (nothing past the limit is kept). A client that
    sends part of its body and then nothing for `idle_timeout` seconds gets a 408 and the connection is closed
    (uvicorn has no such limit: a stalled body held its connection and handler for ever)."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # it would fail as JSON with a message about the bytes, not the encoding
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                       code="unsupported_content_encoding", headers={"Accept-Encoding": "identity"})
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), idle_timeout)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                raise ApiError(408, f"no byte of the request body arrived for {idle_timeout:g} s "
                                    f"({size:,} bytes came): send the whole body at once", code="request_timeout",
                               headers={"Connection": "close"}) from None
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in `raw` (brackets inside strings do not count). Linear, no recursion."""
    brackets = _STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_STEP[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int64).max())


def load_json(raw: bytes, max_depth: int) -> Any:
    """Parse a request body; every way it can be unreadable is an ApiError 400 that says why."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    depth = json_depth(raw)
    if depth > max_depth:
        raise ApiError(400, f"the request body nests arrays/objects {depth} levels deep; the limit is {max_depth}",
                       code="json_too_deep")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
            from None
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start + 1})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="json_too_deep") from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's advice to raise the limit left out)
        raise ApiError(400, f"the request body is not valid JSON: {json_problem(e)}") from None


def _check_finite(value: Any, name: str) -> None:
    """No NaN or +-Infinity anywhere in `value` (JSON has none; Python's parser reads NaN, Infinity and 1e999)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ApiError(400, f"{name} must be a finite number, got {value!r}", param=name)
        return
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ApiError(400, f"{name} holds a number that is not finite ({item!r})", param=name)
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def check_values(body: Any) -> None:
    """Every string valid Unicode and every number finite, field by field, so the error names the field."""
    if not isinstance(body, dict):
        return  # the parser says what a body must be
    for key, value in body.items():
        try:
            check_text(key, "a field name")
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        try:
            check_text(value, key)
        except RequestError as e:
            raise ApiError(400, str(e), param=key) from None
        _check_finite(value, key)


async def request_body(server, request) -> bytes | None:
    """A generation route's start: the API key checked, then the body read (its bytes; None when the client left
    while sending it, answered 499)."""
    server.check_auth(request)
    try:
        return await read_body(request, server.limits.max_body_size, server.limits.body_idle_timeout)
    except ClientGone:
        return None
