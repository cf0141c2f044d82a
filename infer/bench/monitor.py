"""Resource monitor: `ResourceSampler` takes memory and engine-state samples over a benchmark run (for peaks and
timeline plots)."""

from __future__ import annotations

import time

_COUNTERS = ("num_preemptions", "lora_swaps", "num_steps", "cuda_graph_replays",  # cumulative: also per run
             "piecewise_graph_steps", "draft_cuda_graph_replays", "draft_eager_forwards", "spec_decode_num_drafts",
             "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "draft_context_skipped_steps",
             "prefix_cache_queries", "prefix_cache_hits")
_STAT_KEYS = ("kv_usage", "kv_blocks_used", "num_running", "num_waiting", "prefix_cache_hit_rate",
              "num_preemptions", "lora_swaps")


def _reset_rss_peak() -> bool:
    """Reset the kernel's peak resident set size of this process (Linux's VmHWM); False where it cannot be."""
    from ..memory.meter import reset_peak_rss
    return reset_peak_rss()


def _rss_peak() -> int | None:
    """The kernel's peak resident set size of this process since its last reset (VmHWM), in bytes, or None."""
    from ..memory.meter import peak_rss_bytes
    try:
        return peak_rss_bytes()
    except (OSError, ValueError, IndexError):
        return None


def _cuda_in_use() -> bool:
    try:
        import torch
        return torch.cuda.is_available() and torch.cuda.is_initialized()
    except Exception:  # no torch / broken driver: no GPU figures
        return False


def run_counters(before: dict, after: dict) -> dict:
    """`after` (an engine's stats()) with run_<name> for each cumulative counter: its change since `before`."""
    out = dict(after)
    for k in _COUNTERS:
        if k in after:
            out[f"run_{k}"] = after[k] - before.get(k, 0)
    return out


class ResourceSampler:
    """Call `sample(in_flight)` often (each engine step); it records at most one sample per `interval_s`.
    The peak RSS is the kernel's (Linux's VmHWM, reset by `start()`), so a peak between two samples (a large
    prefill's activations) counts; elsewhere it is the largest RSS sampled. With an `engine`, each sample also
    holds its stats().
    GPU figures come from torch.cuda (max_memory_allocated is reset by `start()`). The engine's cumulative
    counters (num_preemptions, lora_swaps, num_steps, cuda_graph_replays, piecewise_graph_steps, a draft model's
    draft_cuda_graph_replays, draft_eager_forwards and draft_context_skipped_steps, the spec_decode counts) also
    appear as run_<name>: their change since `start()`."""

    def __init__(self, engine=None, interval_s: float = 0.05):
        import psutil
        self.engine = engine
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self.timeline: list[dict] = []
        self.peak_rss_bytes = 0
        self.peak_gpu_bytes: int | None = None
        self.last_stats: dict = {}
        self._t0 = time.perf_counter()
        self._last = -float("inf")
        self._cuda = False
        self._stats0: dict = {}
        self._kernel_peak = False

    def start(self, t0: float | None = None) -> None:
        self._t0 = time.perf_counter() if t0 is None else t0
        self._cuda = _cuda_in_use()
        self._kernel_peak = _reset_rss_peak()
        self._stats0 = dict(self.engine.stats()) if self.engine is not None else {}
        if self._cuda:
            import torch
            torch.cuda.reset_peak_memory_stats()

    def sample(self, in_flight: int = 0, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        rss = self._proc.memory_info().rss
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss, (_rss_peak() or 0) if self._kernel_peak else 0)
        row = {"t": now - self._t0, "rss_bytes": rss, "in_flight": in_flight}
        if self._cuda:
            import torch
            row["gpu_bytes"] = torch.cuda.memory_allocated()
            self.peak_gpu_bytes = torch.cuda.max_memory_allocated()
        if self.engine is not None:
            self.last_stats = run_counters(self._stats0, self.engine.stats())
            row.update({k: self.last_stats[k] for k in _STAT_KEYS if k in self.last_stats})
        self.timeline.append(row)
