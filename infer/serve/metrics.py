"""Prometheus metrics for the server (names follow vLLM's, with an `infer:` prefix).

Token counters, the time to first token and the inter-token latency are updated as the engine's outputs arrive (as
vLLM counts them, step by step); the finish counter and the per-request histograms (latency, queue / prefill / decode /
inference time, time per output token, prompt and generation tokens) as requests finish, the histograms for requests
that ended by stop or length. Engine gauges (queue depth, running, KV usage) and counters (preemptions, prefix cache
queries and hits, in tokens) are read from the engine thread's latest stats snapshot at scrape time; the tokens of each
engine step (iteration_tokens_total) are observed by the engine thread as the step ends (AsyncEngine.on_step). Every
time is a difference of the engine's own timestamps (RequestOutput), so nothing is timed in the engine's step for it.
Each server has its own CollectorRegistry.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: they double the output and nobody graphs them
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's (up to 2560 s: a request queued behind a long batch waits minutes for its first token, and a histogram's
# quantile can never read above its last finite bucket)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
# vLLM's request latency buckets (up to 7680 s), with finer ones below its first
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's, with finer buckets below its first (a small int4 model's decode step takes milliseconds)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


def token_buckets(max_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to `max_len` (the model's length): 1, 2, 5, 10, 20, 50, ..."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# vLLM's labels on every engine metric: a dashboard built for vLLM filters on model_name (the served model's id, the
# first --served-model-name) and engine (the engine's index; one engine here, replicas are summed into it)
LABELS = ("model_name", "engine")


class _EngineCollector:
    """Gauges read from `stats_fn()` (a dict as LLMEngine.stats() returns it) when Prometheus scrapes."""

    def __init__(self, stats_fn, labels: list[str]):
        self.stats_fn, self.labels = stats_fn, labels

    def collect(self):
        s = self.stats_fn()
        gauges = [
            ("infer:num_requests_waiting", "Requests waiting for the engine (queue depth).", s.get("num_waiting", 0)),
            ("infer:num_requests_running", "Requests running in the engine.", s.get("num_running", 0)),
            ("infer:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s.get("kv_usage", 0.0)),
            ("infer:kv_cache_blocks_used", "KV cache blocks in use.", s.get("kv_blocks_used", 0)),
            ("infer:kv_cache_blocks_total", "KV cache blocks in all.", s.get("kv_blocks_total", 0)),
            ("infer:num_requests_in_flight", "Requests the server has accepted and not yet answered.",
             s.get("num_in_flight", 0)),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, float(value))
            yield g
        counters = [
            ("infer:num_preemptions", "Requests the scheduler preempted (their KV blocks freed, to be recomputed).",
             s.get("num_preemptions", 0)),
            ("infer:prefix_cache_queries", "Prefix cache queries, in tokens looked up.",
             s.get("prefix_cache_queries", 0)),
            ("infer:prefix_cache_hits", "Prefix cache hits, in tokens found cached.", s.get("prefix_cache_hits", 0)),
        ]
        if s.get("lora_max"):  # an engine with adapter slots
            counters.append(("infer:lora_swaps", "Adapters copied into a device slot (--max-loras slots).",
                             s.get("lora_swaps", 0)))
        if "spec_decode_num_drafts" in s:  # speculative decoding (vLLM's spec_decode counters)
            counters += [
                ("infer:spec_decode_num_drafts", "Speculative drafts verified (one per request and step with drafts).",
                 s["spec_decode_num_drafts"]),
                ("infer:spec_decode_num_draft_tokens", "Draft tokens verified.", s["spec_decode_num_draft_tokens"]),
                ("infer:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 s["spec_decode_num_accepted_tokens"])]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, float(value))
            yield c
        if "spec_decode_num_accepted_tokens_per_pos" in s:
            c = CounterMetricFamily("infer:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by their position in the draft.",
                                    labels=[*LABELS, "position"])
            for pos, value in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                c.add_metric([*self.labels, str(pos)], float(value))
            yield c
        if s.get("lora_max"):  # vLLM's: its labels say which adapters requests wait for and run with; the value is
            g = GaugeMetricFamily("infer:lora_requests_info", "Running stats on LoRA requests.",  # when it was read
                                  labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            g.add_metric([str(s["lora_max"]), ",".join(s.get("lora_waiting", [])), ",".join(s.get("lora_running", []))],
                         time.time())
            yield g


class _Finished:
    """The finish counters (infer's request_finished and vLLM's request_success, the same counts), model_name and
    engine set: `.labels(reason).inc()` counts one request that ended by `reason`."""

    def __init__(self, counters: list[Counter], labels: list[str]):
        self.counters, self.bound = counters, labels

    def labels(self, reason: str) -> _Finished._Child:
        return self._Child([c.labels(*self.bound, reason) for c in self.counters])

    class _Child:
        def __init__(self, children):
            self.children = children

        def inc(self, amount: float = 1) -> None:
            for c in self.children:
                c.inc(amount)


class ServerMetrics:
    def __init__(self, stats_fn, max_model_len: int = 8192, model_name: str = "model"):
        """`model_name`: the value of vLLM's model_name label (the served model's first id)."""
        self.registry = CollectorRegistry()
        r = self.registry
        labels = [model_name, "0"]
        self.http = Counter("infer:http_requests", "HTTP requests by route and status code.",
                            ["route", "status"], registry=r)
        finished = [Counter("infer:request_finished", "Generation requests by how they ended.",
                            [*LABELS, "finished_reason"], registry=r),
                    Counter("infer:request_success", "Generation requests by how they ended (vLLM's name; the same "
                            "counts as infer:request_finished_total).", [*LABELS, "finished_reason"], registry=r)]
        self.finished = _Finished(finished, labels)
        for reason in ("stop", "length", "abort"):  # shown from the start at 0, as vLLM's are
            self.finished.labels(reason)
        self.prompt_tokens = Counter("infer:prompt_tokens", "Prompt tokens of the requests the engine started.",
                                     labelnames=LABELS, registry=r).labels(*labels)
        self.generation_tokens = Counter("infer:generation_tokens", "Generated tokens, counted as they are generated.",
                                         labelnames=LABELS, registry=r).labels(*labels)
        self.ttft = Histogram("infer:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              buckets=TTFT_BUCKETS, labelnames=LABELS, registry=r).labels(*labels)
        self.e2e = Histogram("infer:e2e_request_latency_seconds", "Request latency (arrival to last token).",
                             buckets=E2E_BUCKETS, labelnames=LABELS, registry=r).labels(*labels)
        self.itl = Histogram("infer:inter_token_latency_seconds", "Time between a request's successive tokens.",
                             buckets=ITL_BUCKETS, labelnames=LABELS, registry=r).labels(*labels)
        self.tpot = Histogram("infer:request_time_per_output_token_seconds", "A request's mean time per output token "
                              "after the first (its decode time over its tokens but one).", buckets=ITL_BUCKETS,
                              labelnames=LABELS, registry=r).labels(*labels)

        def phase(name, doc):
            return Histogram(f"infer:request_{name}_time_seconds", doc, buckets=PHASE_BUCKETS, labelnames=LABELS,
                             registry=r).labels(*labels)
        self.queue_time = phase("queue", "Time a request waited before its first step (arrival to first scheduled).")
        self.prefill_time = phase("prefill", "A request's prefill time (first scheduled to first token).")
        self.decode_time = phase("decode", "A request's decode time (first token to last token).")
        self.inference_time = phase("inference", "A request's time in the engine's steps (first scheduled to last "
                                                 "token).")
        sizes = token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram("infer:request_prompt_tokens", "Prompt tokens of a finished request.",
                                               buckets=sizes, labelnames=LABELS, registry=r).labels(*labels)
        self.request_generation_tokens = Histogram("infer:request_generation_tokens", "Tokens a finished request "
                                                   "generated.", buckets=sizes, labelnames=LABELS,
                                                   registry=r).labels(*labels)
        self.iteration_tokens = Histogram("infer:iteration_tokens_total", "Tokens an engine step computed (prompt "
                                          "chunks and generated tokens).", buckets=ITERATION_BUCKETS,
                                          labelnames=LABELS, registry=r).labels(*labels)
        r.register(_EngineCollector(stats_fn, labels))

    def observe_output(self, out, arrival: float, counted: dict) -> None:
        """Count one engine output as vLLM counts it, step by step: the prompt at the request's first output, each
        token as it comes and the time to the first token once there is one (a long request shows while it runs, and
        a request its client abandoned is counted too). `arrival`: a time.monotonic() value; `counted`: request id ->
        (tokens counted so far, whether its first token was timed)."""
        before, timed = counted.get(out.request_id, (None, False))
        if before is None:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            before = 0
        made = out.num_generated
        if made > before:
            self.generation_tokens.inc(made - before)
            times = out.token_times_from(max(before - 1, 0))  # the last token counted before, then the new ones
            for a, b in zip(times, times[1:]):
                self.itl.observe(max(0.0, b - a))
            before = made
        if not timed and out.first_token_time is not None:
            self.ttft.observe(max(0.0, out.first_token_time - arrival))
            timed = True
        counted[out.request_id] = (before, timed)

    def observe_finished(self, out, arrival: float, end: float) -> None:
        """One engine request ended (any reason); `arrival`/`end` are time.monotonic() values."""
        self.finished.labels(out.finish_reason or "unknown").inc()
        if out.finish_reason not in ("stop", "length"):
            return
        self.e2e.observe(max(0.0, end - arrival))
        made = out.num_generated
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(made)
        scheduled, first = out.first_scheduled_time, out.first_token_time
        times = out.token_times_from(made - 1) if made > 0 else []
        last = times[-1] if times else None
        if scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - out.arrival_time))
        if first is None or last is None:  # no token generated (a prompt only): no prefill or decode to time
            return
        if scheduled is not None:
            self.prefill_time.observe(max(0.0, first - scheduled))
            self.inference_time.observe(max(0.0, last - scheduled))
        self.decode_time.observe(max(0.0, last - first))
        if made > 1:
            self.tpot.observe(max(0.0, last - first) / (made - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HttpMetricsMiddleware:
    """Pure ASGI middleware (it does not wrap streaming bodies): counts responses by route and status."""

    def __init__(self, app, metrics_fn):
        self.app = app
        self.metrics_fn = metrics_fn

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                metrics = self.metrics_fn()
                if metrics is not None:
                    route = scope.get("route")
                    path = getattr(route, "path", None) or "other"
                    metrics.http.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send=counting_send)
