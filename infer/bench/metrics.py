"""Per-request records, the result of one benchmark run, and vLLM's benchmark_serving metrics over them.

Definitions (the same as vLLM's `benchmark_serving.py` / `vllm bench serve`):

- a request is *completed* when it succeeded (it produced at least one token and no error); otherwise *failed*;
- total_input_tokens / total_output_tokens count completed requests only;
- request_throughput = completed / duration, output_throughput = total_output_tokens / duration,
  total_token_throughput = (total_input_tokens + total_output_tokens) / duration, where duration is the
  wall time of the whole run (first send to last reply);
- TTFT = first token (chunk) time - send time;
- E2EL = last token (chunk) time - send time;
- TPOT = (E2EL - TTFT) / (output_tokens - 1), the first token excluded; requests with one token are skipped;
- ITL = every gap between consecutive chunks, over all completed requests;
- each of TTFT, TPOT, ITL, E2EL is summarised as mean_/median_/std_/pNN_ + `<name>_ms`, with numpy's
  (linear) percentiles, and an empty list counts as 0 (as vLLM does);
- request_goodput (with service level objectives, vLLM's --goodput): completed requests whose TTFT, TPOT and
  E2EL (those the objectives name, in ms) are each at most the objective, per second of duration (a request of
  one token has a TPOT of 0 here, as in vLLM);
- chars_per_s = characters of reply text of completed requests / duration (the figure of merit of the liteqwen
  comparison, and the one figure that does not depend on the tokenizer).

The "send time" is when the request was handed to the server, or in-process when it arrived (or a slot came
free) even if the engine was then in a step: time spent waiting for a free concurrency slot is not latency (vLLM
takes its start time after acquiring its semaphore, too).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

DEFAULT_PERCENTILES = (90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
THROUGHPUT_KEYS = ("request_throughput", "output_throughput", "total_token_throughput", "chars_per_s")
# a pooling run's (embeddings: --runner pooling): vectors per second and prompt tokens per second; its ratios
EMBED_KEYS = ("embedding_throughput", "input_throughput")
# the latency figures a baseline's ratios cover besides THROUGHPUT_KEYS (ours / baseline: below 1 is faster)
LATENCY_RATIO_KEYS = tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99"))
SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may set an objective on (vLLM's names), in ms


@dataclass
class RequestRecord:
    """What happened to one request. Times are `time.perf_counter()` seconds."""

    index: int  # position in the workload
    prompt_tokens: int
    send_time: float
    chunk_times: list[float] = field(default_factory=list)  # one per streamed chunk / engine step with tokens
    output_tokens: int = 0
    text: str = ""
    success: bool = False
    error: str | None = None
    finish_reason: str | None = None
    lora: str | None = None
    end_time: float | None = None  # when the request finished (defaults to the last chunk)
    # prompt tokens found in the prefix cache (a server's usage.prompt_tokens_details.cached_tokens, the engine's
    # num_cached_tokens in-process); None where not reported
    cached_tokens: int | None = None

    @property
    def first_token_time(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def ttft(self) -> float | None:
        return None if not self.chunk_times else self.chunk_times[0] - self.send_time

    @property
    def e2el(self) -> float | None:
        end = self.chunk_times[-1] if self.chunk_times else self.end_time
        return None if end is None else end - self.send_time

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1 or not self.chunk_times:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclass
class RunResult:
    """One benchmark run (one backend at one concurrency level).

    `timeline` holds samples {"t": seconds since start, "rss_bytes", "gpu_bytes", "in_flight", and for the
    in-process engine "kv_usage", "num_running", "num_waiting", "prefix_cache_hit_rate", "num_preemptions",
    "lora_swaps"}; `engine_stats` is the engine's last stats() (empty for HTTP / HF runs).
    """

    backend: str  # "infer" | "http" | "hf"
    concurrency: int
    records: list[RequestRecord]
    duration_s: float
    num_requests: int  # how many the workload had (records may be fewer when partial)
    request_rate: float = math.inf
    partial: bool = False  # interrupted (Ctrl-C) or stopped by an error: records hold only what finished
    aborted: int = 0  # requests in flight when interrupted (aborted, not in records)
    peak_rss_bytes: int | None = None
    peak_gpu_bytes: int | None = None
    timeline: list[dict] = field(default_factory=list)
    engine_stats: dict = field(default_factory=dict)
    start_time: float = 0.0  # perf_counter() when the run started (records' times are on the same clock)
    label: str | None = None  # how the report names this run, when more than its backend says (default: backend)
    goodput: dict | None = None  # service level objectives {"ttft" | "tpot" | "e2el": ms}: adds request_goodput
    error: str | None = None  # the error that stopped the run half way (then partial), None when it ran to its end
    pooling: bool = False  # embeddings (--runner pooling): a request is a prompt in, a vector out, no token made

    @property
    def peak_memory_bytes(self) -> int | None:
        """GPU peak (torch.cuda.max_memory_allocated) when on a GPU, else the peak resident set size; None for a
        server driven over HTTP (its memory is not seen from here: peak_rss_bytes is this client's)."""
        if self.backend == "http":
            return None
        return self.peak_gpu_bytes if self.peak_gpu_bytes else self.peak_rss_bytes

    def metrics(self, percentiles=DEFAULT_PERCENTILES) -> dict:
        out = compute_metrics(self.records, self.duration_s, percentiles, goodput=self.goodput)
        if self.pooling:  # (its request_throughput is vectors per second, its total_token_throughput the prompts')
            out.update(embedding_throughput=out["request_throughput"], input_throughput=out["total_token_throughput"])
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return d


def ended(result: RunResult, failure: Exception | None) -> RunResult:
    """A run's result once it has ended: returned, or, where the error `failure` stopped it half way, raised with
    the partial result (the error noted in it) attached as failure.bench_partial."""
    if failure is None:
        return result
    result.error = f"{type(failure).__name__}: {failure}"
    failure.bench_partial = result
    raise failure


def _ms_stats(name: str, values: list[float], percentiles) -> dict:
    arr = np.asarray(values or [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(arr)), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(np.std(arr))}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def meets_slos(rec: RequestRecord, slos: dict) -> bool:
    """Whether a completed request's TTFT, TPOT and E2EL are each within the objective (ms) `slos` sets on it."""
    got = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.e2el}
    return all(got[k] * 1000.0 <= v for k, v in slos.items())


def latency_series(records: list[RequestRecord]) -> dict[str, list[float]]:
    """The samples (seconds) each of TTFT, TPOT, ITL and E2EL is summarised over, from the completed requests."""
    done = [r for r in records if r.success]
    return {"ttft": [r.ttft for r in done],
            "tpot": [r.tpot for r in done if r.tpot is not None],
            "itl": [gap for r in done for gap in r.itl],
            "e2el": [r.e2el for r in done]}


def compute_metrics(records: list[RequestRecord], duration_s: float, percentiles=DEFAULT_PERCENTILES,
                    goodput: dict | None = None) -> dict:
    """vLLM benchmark_serving metrics over `records` (see the module docstring for each definition); with
    `goodput` objectives ({"ttft": ms, ...}) also request_goodput."""
    done = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    chars = sum(len(r.text) for r in done)
    dur = duration_s if duration_s > 0 else float("nan")
    out = {
        "duration": duration_s, "completed": len(done), "failed": len(records) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / dur, "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur, "chars_per_s": chars / dur,
        "mean_reply_chars": chars / len(done) if done else 0.0,
    }
    if goodput:
        out["request_goodput"] = sum(meets_slos(r, goodput) for r in done) / dur
    series = latency_series(records)
    for name in LATENCY_METRICS:
        out.update(_ms_stats(name, series[name], percentiles))
    return out
