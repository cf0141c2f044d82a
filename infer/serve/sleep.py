"""vLLM's sleep-mode routes (its dev-mode endpoints), for a server started with --enable-sleep-mode:

    POST /sleep?level=1          weights to host memory, KV cache freed (level=2: both freed, no copy kept);
                                 &mode=abort (the default), wait or keep: the requests in flight end, finish
                                 first, or are paused until /wake_up (vLLM's)
                                 &timeout=SECONDS (mode=wait): 504 sleep_timeout if requests still run then
                                 (the engine goes to sleep once they end, new requests refused meanwhile)
    POST /wake_up                everything back (?tags=weights, ?tags=kv_cache: one part; repeat tags for both)
    GET  /is_sleeping            {"is_sleeping": true|false}
    POST /collective_rpc         {"method": "reload_weights"}: a worker method (engine.worker), {"results": [...]}

As vLLM's, /sleep and /wake_up answer 200 with no body once done. The requests in flight when /sleep runs end with
finish_reason "abort" (a stream: its last chunk; a whole reply: 503 engine_sleeping), or with mode=wait run to their
end before /sleep answers, or with mode=keep go on after /wake_up; a request while asleep (or while a mode=wait
sleep waits, or after level 2, before reload_weights) is refused with 503 engine_sleeping. Without
--enable-sleep-mode /sleep and
/collective_rpc answer 400 naming the flag; with --data-parallel the routes answer 400 (sleep mode runs one engine).
--api-key guards them as every route.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..engine.sleep import MODES, TAGS
from ..errors import ModelLoadError, OutOfMemoryError, RequestError, SleepModeError, SleepTimeoutError
from . import protocol as p
from .async_engine import NoEngineError, ShuttingDownError
from .body import SafeJSONResponse, check_values, load_json, read_body

MAX_BODY = 64 * 1024  # a method name and its arguments


def add_sleep_routes(app: FastAPI, server) -> None:
    @app.post("/sleep")
    async def sleep(request: Request):
        _check(server, request)
        raw = request.query_params.get("level", "1")
        try:
            level = int(raw)
        except ValueError:
            level = None
        if level not in (1, 2):  # said in the route's terms (the engine's error names its Python API)
            raise p.ApiError(400, f"level must be 1 (weights to host memory, KV cache freed) or 2 (both freed), got "
                                  f"{raw!r}"[:200] + " (e.g. POST /sleep?level=1)", param="level")
        mode = request.query_params.get("mode", "abort")  # vLLM's: what becomes of the requests in flight
        if mode not in MODES:
            raise p.ApiError(400, f"mode must be abort, wait or keep, got {mode!r}"[:200] + " (abort ends the "
                                  "requests in flight, wait lets them finish first, keep pauses them until POST "
                                  "/wake_up; e.g. POST /sleep?level=1&mode=wait)", param="mode")
        timeout = query_timeout(request.query_params.get("timeout"), mode, f"/sleep?level={level}")
        await _run(server, _sleep(server, level, mode, timeout))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request):
        _check(server, request)
        tags = request.query_params.getlist("tags") or None  # none given: every tag (vLLM's)
        unknown = sorted(set(tags or ()) - set(TAGS))
        if unknown:
            raise p.ApiError(400, f"unknown tag {unknown[0]!r}"[:200] + " (the tags are weights and kv_cache: POST "
                                  "/wake_up?tags=weights, then POST /wake_up?tags=kv_cache; no tags wakes both)",
                             param="tags")
        await _run(server, server.aengine.wake_up(tags))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request):
        _check(server, request)
        return {"is_sleeping": server.aengine.is_sleeping()}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        _check(server, request)
        config = getattr(server.engine, "config", None)
        if not getattr(config, "enable_sleep_mode", False):  # (any client could reload the weights, read the model)
            raise p.ApiError(400, "POST /collective_rpc needs a server started with --enable-sleep-mode",
                             code="not_supported")
        body = load_json(await read_body(request, MAX_BODY, server.limits.body_idle_timeout),
                         server.limits.max_json_depth)
        check_values(body)
        if not isinstance(body, dict) or not isinstance(body.get("method"), str) or not body["method"]:
            raise p.ApiError(400, "the body must be a JSON object with a method name, e.g. {\"method\": "
                                  "\"reload_weights\"}", param="method")
        args, kwargs, timeout = body.get("args") or [], body.get("kwargs") or {}, body.get("timeout")
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise p.ApiError(400, "args must be a list and kwargs an object", param="args")
        results = await _run(server, server.aengine.collective_rpc(body["method"], timeout, tuple(args), kwargs))
        return SafeJSONResponse({"results": [_jsonable(r) for r in results]})


async def _sleep(server, level: int, mode: str, timeout: float | None) -> None:
    try:
        await server.aengine.sleep(level, mode, timeout)
    except SleepTimeoutError as e:  # (before _run's 400 of a SleepModeError)
        raise p.ApiError(504, http_message(e), type="timeout", code="sleep_timeout") from None


def query_timeout(raw: str | None, mode: str, route: str) -> float | None:
    """A "wait" route's ?timeout= (seconds above 0, with mode=wait), or None."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise p.ApiError(400, f"timeout must be a number of seconds above 0, got {raw!r}"[:200] + f" (e.g. POST "
                              f"{route}{'&' if '?' in route else '?'}mode=wait&timeout=30)", param="timeout")
    if mode != "wait":
        raise p.ApiError(400, f"timeout is for mode=wait (mode={mode} does not wait for the requests in flight)",
                         param="timeout")
    return value


def _check(server, request: Request, what: str = "sleep mode") -> None:
    server.check_auth(request)
    if getattr(server.aengine, "replicas", None) is not None:  # (parallel.serve_engine's data-parallel driver)
        raise p.ApiError(400, f"{what} runs on a server of one engine, not with --data-parallel",
                         code="not_supported")


async def _run(server, call):
    try:
        return await call
    except (SleepModeError, RequestError, ModelLoadError, OutOfMemoryError) as e:  # (the last two: reload_weights
        raise p.ApiError(400, http_message(e)) from None  # of a checkpoint it refuses, the engine serving on)
    except ShuttingDownError as e:
        raise p.shutting_down(str(e)) from None
    except NoEngineError as e:
        raise p.ApiError(503, str(e), type="server_unavailable", code="no_engine_replica",
                         headers={"Retry-After": str(server.retry_after)}) from None


def http_message(e: Exception) -> str:
    """A sleep-mode error in an HTTP client's terms: its message and the route to call (POST /wake_up), not the
    Python API's wake_up()."""
    route = getattr(e, "route", None)
    return f"{e.message} ({route})" if route and isinstance(e, SleepModeError) else str(e)


def _jsonable(value):
    """A worker method's result as JSON has it (None, numbers, strings, lists, objects); another: its repr."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)[:1000]
