"""`infer serve --data-parallel N`: one OpenAI-compatible endpoint over N engine replicas (Ray actors).
/health lists every replica, /metrics has per-replica gauges (label `replica`) beside the usual ones."""

from __future__ import annotations

import logging
import socket

import typer
from prometheus_client.core import GaugeMetricFamily

from .runtime import local_cpus, ray_runtime, require_ray, start_replicas, stop_replicas


class ReplicaCollector:
    """Prometheus gauges per replica, read from the driver's latest snapshot at scrape time."""

    GAUGES = (("infer:replica_up", "1 while the engine replica answers, 0 once it stopped.", "alive"),
              ("infer:replica_num_requests_running", "Requests running in the replica.", "num_running"),
              ("infer:replica_num_requests_waiting", "Requests waiting in the replica.", "num_waiting"),
              ("infer:replica_num_requests_in_flight", "Requests sent to the replica and not finished.",
               "num_in_flight"),
              ("infer:replica_kv_cache_usage_perc", "Fraction of the replica's KV cache blocks in use.", "kv_usage"))

    def __init__(self, aengine):
        self.aengine = aengine

    def collect(self):
        replicas = self.aengine.stats.get("replicas", [])
        for name, doc, key in self.GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            for r in replicas:
                g.add_metric([str(r["replica"])], float(r[key]))
            yield g


def build_server(ray, cfg, replicas: int, model_id: str, api_key: str | None, max_queue: int | None,
                 shutdown_timeout: float):
    """Start the replicas, warm them up, and return (Server, replica infos) for the app."""
    from ..engine.setup import load_tokenizer
    from ..models.resolve import resolve_model
    from ..serve.app import Server
    from .serve_engine import RayAsyncEngine, ReplicaView
    model_path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(model_path)
    handles, infos = start_replicas(ray, cfg, model_path, replicas)
    try:
        ray.get([h.warmup.remote() for h in handles])
        aengine = RayAsyncEngine(ray, handles, infos, ReplicaView(cfg, model_path, tokenizer, infos[0]), max_queue)
    except BaseException:
        stop_replicas(ray, handles)
        raise
    server = Server(aengine, model_id, api_key=api_key, graceful_timeout=shutdown_timeout)
    server.metrics.registry.register(ReplicaCollector(aengine))
    return server, infos


def serve_data_parallel(cfg, sock: socket.socket, host: str, model_id: str, api_key: str | None,
                        max_queue: int | None, shutdown_timeout: float, log_level: str, replicas: int,
                        address: str | None) -> None:
    require_ray()
    import uvicorn

    from ..cli.serve import _quiet_signals
    from ..serve.app import create_app
    from .batch import placement
    with ray_runtime(address, local_cpus(replicas)) as ray:
        server, infos = build_server(ray, cfg, replicas, model_id, api_key, max_queue, shutdown_timeout)
        try:
            where = placement(infos)
            names = ", ".join(server.adapters()) or "none"
            typer.echo(f"infer: serving {server.model_id} over {replicas} replicas ({where}; KV "
                       f"{infos[0]['num_blocks']} blocks each) on http://{host}:{sock.getsockname()[1]}  "
                       f"adapters: {names}", err=True)
            logging.getLogger("infer").setLevel(logging.INFO if log_level in ("info", "debug") else logging.WARNING)
            config = uvicorn.Config(create_app(server), log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                                    access_log=log_level in ("info", "debug"))
            with _quiet_signals():
                uvicorn.Server(config).run(sockets=[sock])
        finally:
            server.aengine.shutdown(0)
        typer.echo("infer: server stopped", err=True)
