"""The "split" LoRA policy of older servers, as a baseline for the engine's mixed-adapter batches.

    from infer.bench.lora_split import run_split
    result = run_split(engine, workload.requests, concurrency=16)   # -> RunResult (backend "infer-split")

The same requests go through the same engine, but two different adapters never share a batch: the requests are
grouped by adapter (the base model, None, is a group of its own; groups in order of first appearance), and a
group is fed only when the previous one has drained, at most `concurrency` requests of the group in flight.
This is what a server does that splits its batch whenever the adapter changes. Requests are sent at once
(an infinite request rate); Ctrl-C returns what finished, `partial=True`; an error raised half way carries what
finished before it (every group's) as its `bench_partial`, as run_in_process's does.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..errors import ConfigError
from .datasets import BenchRequest
from .driver import run_in_process
from .metrics import RunResult
from .monitor import ResourceSampler


def group_by_adapter(requests: list[BenchRequest]) -> list[list[int]]:
    """Indices of `requests`, one list per adapter, in order of each adapter's first request."""
    groups: dict[str | None, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.lora, []).append(i)
    return list(groups.values())


def _merge(runs: list[tuple[list[int], RunResult]], num_requests: int, concurrency: int) -> RunResult:
    """One RunResult over consecutive group runs: records re-indexed into the workload, one timeline."""
    t0 = runs[0][1].start_time
    records, timeline, stats = [], [], {}
    for indices, run in runs:
        records += [replace(rec, index=indices[rec.index]) for rec in run.records]
        shift = run.start_time - t0
        timeline += [dict(s, t=s["t"] + shift) for s in run.timeline]
        for k, v in run.engine_stats.items():  # per-run counters add up; the rest is the last group's state
            stats[k] = stats.get(k, 0) + v if k.startswith("run_") else v
    last = runs[-1][1]
    end = last.start_time + last.duration_s
    peaks = [r.peak_gpu_bytes for _, r in runs if r.peak_gpu_bytes]
    records.sort(key=lambda r: r.index)
    return RunResult("infer-split", concurrency, records, duration_s=end - t0, num_requests=num_requests,
                     partial=any(r.partial for _, r in runs), aborted=sum(r.aborted for _, r in runs),
                     peak_rss_bytes=max((r.peak_rss_bytes or 0) for _, r in runs) or None,
                     peak_gpu_bytes=max(peaks) if peaks else None, timeline=timeline, engine_stats=stats,
                     start_time=t0)


def run_split(engine, requests: list[BenchRequest], concurrency: int, request_rate: float = math.inf,
              seed: int = 0, progress: bool = True, temperature: float = 0.0) -> RunResult:
    """Run `requests` through `engine` one adapter group at a time (see the module docstring)."""
    if not math.isinf(request_rate):
        raise ConfigError("--lora-policy split sends every group at once; it takes no --request-rate",
                          "drop --request-rate, or use --lora-policy mixed")
    if concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {concurrency}")
    if not requests:
        raise ConfigError("the workload has no requests")
    runs: list[tuple[list[int], RunResult]] = []
    for indices in group_by_adapter(requests):
        group = [requests[i] for i in indices]
        try:
            run = run_in_process(engine, group, concurrency, seed=seed, progress=progress,
                                 sampler=ResourceSampler(engine), temperature=temperature)
        except Exception as e:  # the groups before it, and what of this one finished, go back with the error
            part = getattr(e, "bench_partial", None)
            if isinstance(part, RunResult):
                e.bench_partial = _merge(runs + [(indices, part)], len(requests), concurrency)
                e.bench_partial.error = part.error
            raise
        runs.append((indices, run))
        if run.partial:  # Ctrl-C: the groups not started are neither run nor counted as aborted
            break
    return _merge(runs, len(requests), concurrency)
