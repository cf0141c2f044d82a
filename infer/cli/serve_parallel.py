"""`infer serve --data-parallel N`: one OpenAI-compatible endpoint over N engine replicas (Ray actors), built by
parallel/serve.py; this file starts the Ray runtime and runs uvicorn as `infer serve` does for one engine."""

from __future__ import annotations

import logging
import socket

import typer

from ..parallel.pool import MAX_RESTARTS
from ..parallel.runtime import PLACEMENT_TIMEOUT_S, local_cpus, placement, ray_runtime, require_ray
from ..parallel.serve import build_server
from .banner import replica_traits
from .serve import VERBOSE, _quiet_signals, url_host


def serve_data_parallel(cfg, sock: socket.socket, host: str, model_id: str | list[str], api_key: str | None,
                        max_queue: int | None, shutdown_timeout: float, log_level: str, replicas: int,
                        address: str | None, limits=None, runtime_lora: bool = False,
                        tool_parser: str | None = None, reasoning_parser: str | None = None,
                        trust_request_chat_template: bool = False, cors=None, tokens_as_ids: bool = False,
                        prompt_tokens_details: bool = False,
                        max_restarts: int = MAX_RESTARTS, placement_timeout: float = PLACEMENT_TIMEOUT_S) -> None:
    """`max_restarts`: how many times a replica that stops is replaced by a fresh one (--max-replica-restarts);
    `placement_timeout`: how long Ray may take to place a replica (--replica-placement-timeout)."""
    require_ray()
    from ..serve.app import create_app
    from ..serve.lifecycle import uvicorn_server
    from .entry import terminate_as_interrupt
    with ray_runtime(address, local_cpus(replicas)) as ray:
        with terminate_as_interrupt():  # SIGTERM while the replicas load: "terminated", exit 143, Ray shut down
            server, infos = build_server(ray, cfg, replicas, model_id, api_key, max_queue, shutdown_timeout, limits,
                                         runtime_lora, tool_parser, reasoning_parser,
                                         trust_request_chat_template=trust_request_chat_template, cors=cors,
                                         max_restarts=max_restarts, placement_timeout=placement_timeout)
        server.tokens_as_ids = tokens_as_ids
        server.prompt_tokens_details = prompt_tokens_details  # (the app reads it per request, as tokens_as_ids)
        try:
            where = placement(infos)
            names = (", ".join(server.adapters()) or "none") + (" (more can be loaded)" if runtime_lora else "")
            typer.echo(f"infer: serving {server.model_id} over {replicas} replicas ({where}; "
                       f"{replica_traits(infos, cfg)}) on http://{url_host(host)}:{sock.getsockname()[1]}  "
                       f"adapters: {names}", err=True)
            logging.getLogger("infer").setLevel(logging.INFO if log_level in VERBOSE else logging.WARNING)
            uv = uvicorn_server(server, create_app(server), shutdown_timeout, log_level=log_level,
                                access_log=log_level in VERBOSE)
            with _quiet_signals():
                uv.run(sockets=[sock])
        finally:
            server.aengine.shutdown(0)
        typer.echo("infer: server stopped", err=True)
