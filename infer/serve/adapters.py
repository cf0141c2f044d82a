"""Adapters while serving: vLLM's runtime LoRA routes, on when the server runs with --allow-runtime-lora.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/srv/adapters/sql"}
                                  (with "load_inplace": true, vLLM's, new weights for a name already loaded)
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

A loaded adapter is validated against the base first (what `infer lora-validate` checks), then listed by
/v1/models and picked by a request's `model` at once; the folder is read on a worker thread, so requests in flight
go on meanwhile. An unloaded one is refused to new requests at once; requests accepted before finish with it, and its
memory is freed after the last of them (the name may be loaded again at once, as in vLLM). An adapter loaded in
place of one of the same name serves the requests accepted after the call; those accepted before finish with the
weights they started with, and the prefix cache never gives K/V of one to the other (vLLM swaps the weights under
running requests, and keys its cache by the name). The path is read on the server's host (with --data-parallel, on
every replica's host). The routes answer 404 on a server started without the flag: they let a client make the server
read a folder of its choosing, so they are off unless asked for (and --api-key guards them as every route).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ..errors import LoRAError, LoRANameError, SleepModeError
from . import protocol as p
from .async_engine import NoEngineError, ShuttingDownError
from .body import check_values, load_json, read_body

log = logging.getLogger("infer.serve")
MAX_BODY = 64 * 1024  # a name and a path


def add_adapter_routes(app: FastAPI, server) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _body(server, request)
        name, path = _string(body, "lora_name"), _string(body, "lora_path")
        inplace = body.get("load_inplace", False)
        if not isinstance(inplace, bool):  # vLLM's field: a name already loaded takes the new weights
            raise p.ApiError(400, f"load_inplace must be a boolean, got {inplace!r}", param="load_inplace")
        base = getattr(server.engine, "model_path", None)
        if name in (*server.model_ids, server.engine.config.model, *([str(base)] if base is not None else [])):
            raise p.ApiError(400, f"lora_name {name!r} is the base model's id, so no request could pick the adapter",
                             param="lora_name")
        try:
            await server.aengine.add_lora(name, path, replace=inplace)
        except LoRAError as e:
            raise p.ApiError(400, str(e), param="lora_name" if isinstance(e, LoRANameError) else "lora_path",
                             code="invalid_lora_adapter") from None
        except ShuttingDownError as e:
            raise _unavailable(e) from None
        except SleepModeError as e:  # (sleep mode: its adapter slots are freed until POST /wake_up)
            raise _asleep(e) from None
        except NoEngineError as e:  # every replica died (or the engine thread): as a request is answered then
            raise _no_engine(server, e) from None
        log.info("LoRA adapter %r loaded from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _body(server, request)
        name = _string(body, "lora_name")
        try:
            running = await server.aengine.remove_lora(name)
        except LoRAError as e:
            raise p.ApiError(404, str(e), param="lora_name", code="model_not_found") from None
        except ShuttingDownError as e:
            raise _unavailable(e) from None
        except SleepModeError as e:
            raise _asleep(e) from None
        except NoEngineError as e:
            raise _no_engine(server, e) from None
        log.info("LoRA adapter %r unloaded (%d request(s) still finishing with it)", name, running)
        tail = (f" {running} request(s) accepted before (running or queued) finish with it first; its memory is freed "
                "after them.") if running else ""
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.{tail}")


async def _body(server, request: Request) -> dict:
    server.check_auth(request)
    if not server.runtime_lora:
        raise p.ApiError(404, "loading and unloading adapters while serving is off on this server: start it with "
                              "--allow-runtime-lora (or INFER_ALLOW_RUNTIME_LORA=1)", code="not_found")
    body = load_json(await read_body(request, MAX_BODY, server.limits.body_idle_timeout), server.limits.max_json_depth)
    check_values(body)
    if not isinstance(body, dict):
        raise p.ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _string(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "nothing" if value is None else repr(value)
        raise p.ApiError(400, f"{key} must be a non-empty string, got {got}", param=key)
    return value


def _no_engine(server, e: NoEngineError) -> p.ApiError:
    return p.ApiError(503, str(e), type="server_unavailable", code="no_engine_replica",
                      headers={"Retry-After": str(server.retry_after)})


def _unavailable(e: ShuttingDownError) -> p.ApiError:
    return p.shutting_down(str(e))


def _asleep(e: SleepModeError) -> p.ApiError:
    from .sleep import http_message
    return p.ApiError(503, http_message(e), type="server_unavailable", code="engine_sleeping")
