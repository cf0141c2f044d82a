"""vLLM's pause/resume routes (an RL trainer's, around a weight update), on every server of one engine:

    POST /pause?mode=abort       the requests in flight end (finish_reason "abort"; mode=wait: they run to their
                                 end before /pause answers; mode=keep: they are frozen and go on after /resume);
                                 &clear_cache=true (the default) forgets the prefix cache; &timeout=SECONDS (mode
                                 wait): 504 pause_timeout if requests still run then (generation stays paused);
                                 vLLM's older &wait_for_inflight_requests=true is mode=wait
    POST /resume                 every request runs again: {"status": "resumed"}
    GET  /is_paused              {"is_paused": true|false}

As vLLM's, /pause answers {"status": "paused"} once done, and requests that arrive while paused are not refused:
they wait (streamed or not) and run after /resume; a client that goes away meanwhile frees its place. A request
/pause aborted ends as vLLM's: a whole reply with finish_reason "abort" (200, the text it had), a stream with a last
chunk whose finish_reason is "abort". Pause and sleep (POST /sleep) are independent: a server asleep refuses new
requests (503 engine_sleeping) whether paused or not, and runs requests once awake and resumed (those that
waited for a /resume that came while asleep wait on for /wake_up). A server stopped while paused ends at once the
requests that wait for /resume (a 503 each: no /resume can come), not after --shutdown-timeout. With
--data-parallel the routes answer 400 (pause runs one engine); --api-key guards them as every route.

The requests that wait for /resume count in /metrics' infer:num_requests_waiting (and /health's num_waiting). A
beam search (use_beam_search) goes on after /resume with mode keep or wait (its later steps wait, as any request
that arrives while paused); mode abort ends it at once: a 200 whose choices say finish_reason "abort" with the best
beams it had (serve/beams.py). A mode=wait whose timeout ran out (504) is over once another /pause or a /resume
comes: that call's mode and clear_cache hold, the earlier one's no longer.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from ..engine.sleep import MODES
from ..errors import PauseTimeoutError
from . import protocol as p
from .body import SafeJSONResponse
from .sleep import _check, _run, http_message, query_timeout

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def add_pause_routes(app: FastAPI, server) -> None:
    @app.post("/pause")
    async def pause(request: Request):
        _check(server, request, "pause")
        query = request.query_params
        mode = query.get("mode", "abort")
        if mode not in MODES:
            raise p.ApiError(400, f"mode must be abort, wait or keep, got {mode!r}"[:200] + " (abort ends the "
                                  "requests in flight, wait lets them finish first, keep freezes them until POST "
                                  "/resume; e.g. POST /pause?mode=keep)", param="mode")
        clear_cache = _flag(query, "clear_cache", True)
        if _flag(query, "wait_for_inflight_requests", False):  # vLLM's older name of mode=wait
            if "mode" in query and mode != "wait":
                raise p.ApiError(400, f"wait_for_inflight_requests=true and mode={mode} contradict each other (give "
                                      "mode=wait alone)"[:200], param="wait_for_inflight_requests")
            mode = "wait"
        timeout = query_timeout(query.get("timeout"), mode, "/pause")
        await _run(server, _pause(server, mode, clear_cache, timeout))
        return SafeJSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume(request: Request):
        _check(server, request, "pause")
        await _run(server, server.aengine.resume())
        return SafeJSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused(request: Request):
        _check(server, request, "pause")
        return {"is_paused": server.aengine.is_paused()}


async def _pause(server, mode: str, clear_cache: bool, timeout: float | None) -> None:
    try:
        await server.aengine.pause(mode, clear_cache, timeout)
    except PauseTimeoutError as e:  # (before _run's 400 of a PauseError)
        raise p.ApiError(504, http_message(e), type="timeout", code="pause_timeout") from None


def _flag(query, name: str, default: bool) -> bool:
    raw = query.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE + _FALSE:
        return raw.lower() in _TRUE
    raise p.ApiError(400, f"{name} must be true or false, got {raw!r}"[:200] + f" (e.g. POST /pause?{name}=false)",
                     param=name)


