"""One OpenAI-compatible server over N engine replicas (Ray actors), for `infer serve --data-parallel N`
(cli/serve_parallel.py): /health lists every replica, /metrics has per-replica gauges (label `replica`)."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from .pool import MAX_RESTARTS
from .runtime import PLACEMENT_TIMEOUT_S, start_replicas, stop_replicas


class ReplicaCollector:
    """Prometheus gauges per replica, read from the driver's latest snapshot at scrape time."""

    GAUGES = (("infer:replica_up", "1 while the engine replica answers, 0 once it stopped.", "alive"),
              ("infer:replica_num_requests_running", "Requests running in the replica.", "num_running"),
              ("infer:replica_num_requests_waiting", "Requests waiting in the replica.", "num_waiting"),
              ("infer:replica_num_requests_in_flight", "Requests sent to the replica and not finished.",
               "num_in_flight"),
              ("infer:replica_kv_cache_usage_perc", "Fraction of the replica's KV cache blocks in use.", "kv_usage"),
              ("infer:replica_restarts", "Fresh replicas started in place of this one after it stopped.", "restarts"))

    def __init__(self, aengine):
        self.aengine = aengine

    def collect(self):
        replicas = self.aengine.stats.get("replicas", [])
        for name, doc, key in self.GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            for r in replicas:
                g.add_metric([str(r["replica"])], float(r.get(key, 0)))
            yield g


def build_server(ray, engine_config, replicas: int, model_id: str | list[str], api_key: str | None,
                 max_queue: int | None, shutdown_timeout: float, limits=None, runtime_lora: bool = False,
                 tool_parser: str | None = None,
                 reasoning_parser: str | None = None, trust_request_chat_template: bool = False, cors=None,
                 max_restarts: int = MAX_RESTARTS, placement_timeout: float = PLACEMENT_TIMEOUT_S):
    """Start the replicas, compile their kernels (`warm_kernels`), and return (Server, replica infos) for the app.
    A replica that stops is replaced by a fresh one `max_restarts` times at most (RayAsyncEngine); one Ray has not
    placed after `placement_timeout` seconds fails (start_replicas: the server does not start; a fresh one: it
    stays stopped, or another is started)."""
    from ..engine.setup import load_tokenizer
    from ..models.resolve import resolve_model
    from ..serve.app import Server
    from .serve_engine import RayAsyncEngine, ReplicaView
    model_path = resolve_model(engine_config.model)
    tokenizer = load_tokenizer(model_path, engine_config.chat_template)
    handles, infos = start_replicas(ray, engine_config, model_path, replicas, placement_timeout=placement_timeout)
    try:
        ray.get([h.warm_kernels.remote() for h in handles])
        view = ReplicaView(engine_config, model_path, tokenizer, infos[0])
        aengine = RayAsyncEngine(ray, handles, infos, view, max_queue, restart=getattr(handles, "restart", None),
                                 max_restarts=max_restarts, placement_timeout=placement_timeout)
    except BaseException:
        stop_replicas(ray, handles)
        raise
    server = Server(aengine, model_id, api_key=api_key, graceful_timeout=shutdown_timeout, limits=limits,
                    runtime_lora=runtime_lora, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                    trust_request_chat_template=trust_request_chat_template, cors=cors)
    server.metrics.registry.register(ReplicaCollector(aengine))
    return server, infos
