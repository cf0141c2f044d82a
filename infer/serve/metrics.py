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
# first --served-model-name) and engine (the engine's index: "0", or with --data-parallel each replica's, as vLLM
# labels each of its data-parallel engines)
LABELS = ("model_name", "engine")


class _EngineCollector:
    """Gauges read from `stats_fn()` (a dict as LLMEngine.stats() returns it) when Prometheus scrapes. With
    data-parallel replicas, the dict's "engines" holds each replica's stats (as its index): one series each."""

    def __init__(self, stats_fn, labels: list[str]):
        self.stats_fn, self.labels = stats_fn, labels

    def collect(self):
        s = self.stats_fn()
        engines = s.get("engines")
        rows = [(self.labels, s)] if not engines else [([self.labels[0], str(i)], e) for i, e in enumerate(engines)]
        gauges = [
            ("infer:num_requests_waiting", "Requests waiting for the engine (queue depth).", "num_waiting", 0),
            ("infer:num_requests_running", "Requests running in the engine.", "num_running", 0),
            ("infer:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", "kv_usage", 0.0),
            ("infer:kv_cache_blocks_used", "KV cache blocks in use.", "kv_blocks_used", 0),
            ("infer:kv_cache_blocks_total", "KV cache blocks in all.", "kv_blocks_total", 0),
            ("infer:num_requests_in_flight", "Requests the server has accepted and not yet answered.",
             "num_in_flight", 0),
        ]
        for name, doc, key, default in gauges:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            for labels, e in rows:
                g.add_metric(labels, float(e.get(key, default)))
            yield g
        counters = [
            ("infer:num_preemptions", "Requests the scheduler preempted (their KV blocks freed, to be recomputed).",
             "num_preemptions"),
            ("infer:prefix_cache_queries", "Prefix cache queries, in tokens looked up.", "prefix_cache_queries"),
            ("infer:prefix_cache_hits", "Prefix cache hits, in tokens found cached.", "prefix_cache_hits"),
        ]
        if "kv_blocks_freed_window" in s:  # a sliding window's model
            counters.append(("infer:kv_cache_window_freed_blocks", "KV cache blocks freed behind running requests' "
                             "sliding windows.", "kv_blocks_freed_window"))
        if s.get("lora_max"):  # an engine with adapter slots
            counters.append(("infer:lora_swaps", "Adapters copied into a device slot (--max-loras slots).",
                             "lora_swaps"))
        if "spec_decode_num_drafts" in s:  # speculative decoding (vLLM's spec_decode counters)
            counters += [
                ("infer:spec_decode_num_drafts", "Speculative drafts verified (one per request and step with drafts).",
                 "spec_decode_num_drafts"),
                ("infer:spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_decode_num_draft_tokens"),
                ("infer:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens")]
        for name, doc, key in counters:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            for labels, e in rows:
                c.add_metric(labels, float(e.get(key, 0)))
            yield c
        if "spec_decode_num_accepted_tokens_per_pos" in s:
            c = CounterMetricFamily("infer:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by their position in the draft.",
                                    labels=[*LABELS, "position"])
            positions = len(s["spec_decode_num_accepted_tokens_per_pos"])
            for labels, e in rows:  # every engine shows every position (0 where it has none)
                per_pos = list(e.get("spec_decode_num_accepted_tokens_per_pos", []))
                for pos, value in enumerate(per_pos + [0] * (positions - len(per_pos))):
                    c.add_metric([*labels, str(pos)], float(value))
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


class _Series:
    """One engine's request counters and histograms (its model_name and engine labels bound)."""

    def __init__(self, families: dict, labels: list[str]):
        self.finished = _Finished(families["finished"], labels)
        for reason in ("stop", "length", "abort"):  # shown from the start at 0, as vLLM's are
            self.finished.labels(reason)
        for name, family in families.items():
            if name != "finished":
                setattr(self, name, family.labels(*labels))


class ServerMetrics:
    def __init__(self, stats_fn, max_model_len: int = 8192, model_name: str = "model", engines: int = 1):
        """`model_name`: the value of vLLM's model_name label (the served model's first id); `engines`: the
        data-parallel replicas, each with its own series (label engine, its index), as vLLM's data-parallel engines."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        labels = [model_name, "0"]
        self.http = Counter("infer:http_requests", "HTTP requests by route and status code.",
                            ["route", "status"], registry=r)
        f = self._families = {}
        f["finished"] = [Counter("infer:request_finished", "Generation requests by how they ended.",
                                 [*LABELS, "finished_reason"], registry=r),
                         Counter("infer:request_success", "Generation requests by how they ended (vLLM's name; the "
                                 "same counts as infer:request_finished_total).", [*LABELS, "finished_reason"],
                                 registry=r)]
        f["prompt_tokens"] = Counter("infer:prompt_tokens", "Prompt tokens of the requests the engine started.",
                                     labelnames=LABELS, registry=r)
        f["generation_tokens"] = Counter("infer:generation_tokens", "Generated tokens, counted as they are generated.",
                                         labelnames=LABELS, registry=r)
        f["ttft"] = Histogram("infer:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              buckets=TTFT_BUCKETS, labelnames=LABELS, registry=r)
        f["e2e"] = Histogram("infer:e2e_request_latency_seconds", "Request latency (arrival to last token).",
                             buckets=E2E_BUCKETS, labelnames=LABELS, registry=r)
        f["itl"] = Histogram("infer:inter_token_latency_seconds", "Time between a request's successive tokens.",
                             buckets=ITL_BUCKETS, labelnames=LABELS, registry=r)
        f["tpot"] = Histogram("infer:request_time_per_output_token_seconds", "A request's mean time per output token "
                              "after the first (its decode time over its tokens but one).", buckets=ITL_BUCKETS,
                              labelnames=LABELS, registry=r)

        def phase(name, doc):
            return Histogram(f"infer:request_{name}_time_seconds", doc, buckets=PHASE_BUCKETS, labelnames=LABELS,
                             registry=r)
        f["queue_time"] = phase("queue", "Time a request waited before its first step (arrival to first scheduled).")
        f["prefill_time"] = phase("prefill", "A request's prefill time (first scheduled to first token).")
        f["decode_time"] = phase("decode", "A request's decode time (first token to last token).")
        f["inference_time"] = phase("inference", "A request's time in the engine's steps (first scheduled to last "
                                                 "token).")
        sizes = token_buckets(max_model_len)
        f["request_prompt_tokens"] = Histogram("infer:request_prompt_tokens", "Prompt tokens of a finished request.",
                                               buckets=sizes, labelnames=LABELS, registry=r)
        f["request_generation_tokens"] = Histogram("infer:request_generation_tokens", "Tokens a finished request "
                                                   "generated.", buckets=sizes, labelnames=LABELS, registry=r)
        f["iteration_tokens"] = Histogram("infer:iteration_tokens_total", "Tokens an engine step computed (prompt "
                                          "chunks and generated tokens).", buckets=ITERATION_BUCKETS,
                                          labelnames=LABELS, registry=r)
        self._engines = [_Series(f, [model_name, str(i)]) for i in range(max(engines, 1))]
        first = self._engines[0]  # engine 0's series as attributes (self.prompt_tokens, self.finished, ...)
        self.finished = first.finished
        for name in f:
            if name != "finished":
                setattr(self, name, getattr(first, name))
        r.register(_EngineCollector(stats_fn, labels))

    def engine(self, index: int = 0) -> _Series:
        """Engine `index`'s series (a data-parallel replica's), made on first use."""
        while index >= len(self._engines):
            self._engines.append(_Series(self._families, [self.model_name, str(len(self._engines))]))
        return self._engines[index]

    def observe_step(self, tokens: int, engine: int = 0) -> None:
        """The tokens one step of engine `engine` computed (the engine thread's, or the replicas' driver's)."""
        self.engine(engine).iteration_tokens.observe(tokens)

    def observe_output(self, out, arrival: float, counted: dict) -> None:
        """Count one engine output as vLLM counts it, step by step: the prompt at the request's first output, each
        token as it comes and the time to the first token once there is one (a long request shows while it runs, and
        a request its client abandoned is counted too). `arrival`: a time.monotonic() value; `counted`: request id ->
        (tokens counted so far, whether its first token was timed). Counted on the engine that ran it
        (`out.engine_index`)."""
        s = self.engine(out.engine_index)
        before, timed = counted.get(out.request_id, (None, False))
        if before is None:
            s.prompt_tokens.inc(len(out.prompt_token_ids))
            before = 0
        made = out.num_generated
        if made > before:
            s.generation_tokens.inc(made - before)
            times = out.token_times_from(max(before - 1, 0))  # the last token counted before, then the new ones
            for a, b in zip(times, times[1:]):
                if b != a:  # tokens of one step (a speculative step's accepted drafts) share its time: one latency
                    s.itl.observe(max(0.0, b - a))  # for the step and request, as vLLM observes
            before = made
        if not timed and out.first_token_time is not None:
            s.ttft.observe(max(0.0, out.first_token_time - arrival))
            timed = True
        counted[out.request_id] = (before, timed)

    def observe_finished(self, out, arrival: float, end: float) -> None:
        """One engine request ended (any reason); `arrival`/`end` are time.monotonic() values."""
        s = self.engine(out.engine_index)
        s.finished.labels(out.finish_reason or "unknown").inc()
        if out.finish_reason not in ("stop", "length"):
            return
        s.e2e.observe(max(0.0, end - arrival))
        made = out.num_generated
        s.request_prompt_tokens.observe(len(out.prompt_token_ids))
        s.request_generation_tokens.observe(made)
        scheduled, first = out.first_scheduled_time, out.first_token_time
        times = out.token_times_from(made - 1) if made > 0 else []
        last = times[-1] if times else None
        if scheduled is not None:
            s.queue_time.observe(max(0.0, scheduled - out.arrival_time))
        if first is None or last is None:  # no token generated (a prompt only): no prefill or decode to time
            return
        if scheduled is not None:
            s.prefill_time.observe(max(0.0, first - scheduled))
            s.inference_time.observe(max(0.0, last - scheduled))
        s.decode_time.observe(max(0.0, last - first))
        if made > 1:
            s.tpot.observe(max(0.0, last - first) / (made - 1))

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
