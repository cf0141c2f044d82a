"""In-process benchmark driver: keeps at most `concurrency` requests in an LLMEngine and steps it.

    from infer.bench.driver import run_in_process
    result = run_in_process(engine, workload.requests, concurrency=16)   # -> RunResult
    result.metrics()["output_throughput"]

A request is sent (added to the engine) when a slot is free and, with a finite `request_rate`, its Poisson
arrival time has come; its send time, which latencies count from, is its arrival (or when a slot came free, if
none was free then), as a client's that sends it to a server while a step runs. Each engine step's tokens are
time-stamped when step() returns. Ctrl-C aborts the
requests in flight and returns what finished, with `partial=True`. An error that stops the run half way (the GPU
ran out of memory, a bug in a step) aborts the requests in flight too and is raised again, carrying what finished
before it as its `bench_partial` attribute (a RunResult with `partial=True` and `error` set), so that the report
keeps it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid

import numpy as np

from ..errors import InferError
from .datasets import BenchRequest
from .metrics import RequestRecord, RunResult, ended
from .monitor import ResourceSampler

log = logging.getLogger("infer")


def arrival_offsets(n: int, request_rate: float = math.inf, seed: int = 0) -> list[float]:
    """Send time of each request after the start: all 0 for an infinite rate, else a Poisson process
    (exponential gaps of mean 1/request_rate, seeded)."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise InferError(f"--request-rate must be > 0, got {request_rate}", "use inf to send everything at once")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist() if n else []


def sampling_params_for(req: BenchRequest, temperature: float = 0.0, seed: int | None = None):
    """The engine's SamplingParams for one benchmark request (greedy unless temperature > 0)."""
    from ..engine.sampling_params import SamplingParams
    return SamplingParams(max_new_tokens=req.output_len, max_length=req.max_length, temperature=temperature,
                          ignore_eos=req.ignore_eos, seed=seed)


def request_params(engine, req: BenchRequest, temperature: float = 0.0, seed: int | None = None):
    """What the engine runs a benchmark request with: a pooling engine's (--runner pooling) PoolingParams (the
    prompt in, its vector out), else sampling_params_for's."""
    if getattr(engine, "pooler", None) is not None:
        from ..engine.pooling import PoolingParams
        return PoolingParams()
    return sampling_params_for(req, temperature, seed)


class Progress:
    """A rich progress bar counting finished requests (a no-op when disabled, or where its console is no terminal),
    on `console` if given."""

    def __init__(self, enabled: bool, total: int, label: str, console=None):
        self._bar = None
        self._stack = contextlib.ExitStack()
        if enabled:
            from rich import get_console
            shown_on = console if console is not None else get_console()  # (rich's own: sys.stdout)
            # a bar draws only on a terminal; elsewhere (a file, a pipe, a CI log) rich's Progress draws nothing
            # but prints an empty line when it stops (to show a final frame, which transient=True leaves empty)
            enabled = shown_on.is_terminal and not shown_on.is_dumb_terminal
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TimeElapsedColumn
            # on a console of its own (the terminal, while other libraries' output is hidden), the bar does not
            # take over sys.stdout and sys.stderr: what a library prints there stays hidden
            own = {} if console is None else dict(console=console, redirect_stdout=False, redirect_stderr=False)
            self._bar = RichProgress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), transient=True, **own)
            self._task = self._bar.add_task(label, total=total)

    def __enter__(self):
        if self._bar is not None:
            self._stack.enter_context(self._bar)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)


class _Run:
    def __init__(self, engine, requests, concurrency, temperature, seed, sampler, bar):
        self.engine, self.requests, self.concurrency = engine, requests, concurrency
        self.temperature, self.seed, self.sampler, self.bar = temperature, seed, sampler, bar
        self.tag = uuid.uuid4().hex[:8]
        self.done: list[RequestRecord] = []
        self.inflight: dict[str, RequestRecord] = {}
        self.end = self.free_since = time.perf_counter()  # free_since: when a slot last came free

    def send(self, i: int, arrival: float) -> None:
        """Add request i, which arrived at `arrival` (perf_counter). Its send time is when a client would have
        sent it: on arrival, or when a slot came free if none was then (vLLM's client sends as its semaphore
        lets it), not when the step running at that moment returned: a server would take it in its next step
        and its TTFT would count the wait."""
        sent = max(arrival, self.free_since)
        req = self.requests[i]
        ids = req.prompt_token_ids
        if ids is None:
            ids = self.engine.tokenizer.encode(req.prompt, add_special_tokens=False)
        seed = None if self.temperature == 0 else self.seed + i
        rid = f"bench-{self.tag}-{i}"
        rec = RequestRecord(i, len(ids), send_time=sent, lora=req.lora)
        try:
            params = request_params(self.engine, req, self.temperature, seed)  # (an output length out of range)
            self.engine.add_request(rid, list(ids), params, lora=req.lora)
        except InferError as e:  # this request can never run: a failure, the others go on
            rec.error, rec.end_time, rec.finish_reason = str(e), time.perf_counter(), "error"
            self._finish(rec)
            return
        self.inflight[rid] = rec

    def on_outputs(self, outs, t: float) -> None:
        full = len(self.inflight) >= self.concurrency
        for o in outs:
            rec = self.inflight.get(o.request_id)
            if rec is None:
                continue
            if o.new_token_ids:
                rec.chunk_times.append(t)
            if o.finished:
                del self.inflight[o.request_id]
                # a pooling request's: its prompt's vector, no token
                vector = hasattr(getattr(o, "outputs", None), "embedding")
                rec.output_tokens, rec.text = (0, "") if vector else (len(o.token_ids), o.text)
                rec.finish_reason, rec.cached_tokens = o.finish_reason, o.num_cached_tokens
                made = vector or rec.output_tokens > 0
                rec.success = o.finish_reason in ("stop", "length") and not o.error and made
                rec.error = o.error or (None if rec.success else f"finished with reason {o.finish_reason!r}")
                rec.end_time = t
                self._finish(rec)
        if full and len(self.inflight) < self.concurrency:
            self.free_since = t

    def _finish(self, rec: RequestRecord) -> None:
        self.done.append(rec)
        self.end = rec.end_time or time.perf_counter()
        self.bar.advance()

    def drop_lost(self) -> None:
        """The engine holds nothing but we still wait on requests: record them as failed instead of hanging."""
        for rid, rec in list(self.inflight.items()):
            rec.error, rec.end_time = "the engine dropped the request", time.perf_counter()
            del self.inflight[rid]
            self._finish(rec)

    def abort_inflight(self) -> int:
        n = len(self.inflight)
        try:
            for rid in list(self.inflight):
                self.engine.abort_request(rid)
            if self.engine.has_unfinished_requests():
                self.engine.step()  # hands back the aborted requests and frees their blocks
        except Exception as e:  # the interrupt may have hit the engine mid-step; report what we have
            log.warning("could not abort the benchmark requests cleanly: %s", e)
        self.inflight.clear()
        return n


def run_in_process(engine, requests: list[BenchRequest], concurrency: int, request_rate: float = math.inf,
                   seed: int = 0, progress: bool = True, sampler: ResourceSampler | None = None,
                   temperature: float = 0.0) -> RunResult:
    """Run `requests` through `engine` (an LLMEngine) with at most `concurrency` in flight; see module doc.

    `sampler` collects memory / engine-stats samples (a fresh ResourceSampler(engine) if None).
    Requests the engine refuses (RequestError) are recorded as failed; the run goes on."""
    if concurrency < 1:
        raise InferError(f"--concurrency must be at least 1, got {concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, seed)
    sampler = sampler or ResourceSampler(engine)
    partial, aborted, nxt, failure = False, 0, 0, None
    with Progress(progress, len(requests), f"infer c={concurrency}") as bar:
        run = _Run(engine, requests, concurrency, temperature, seed, sampler, bar)
        t0 = run.end = run.free_since = time.perf_counter()
        sampler.start(t0)
        try:
            while nxt < len(requests) or run.inflight:
                now = time.perf_counter() - t0
                while nxt < len(requests) and len(run.inflight) < concurrency and offsets[nxt] <= now:
                    run.send(nxt, t0 + offsets[nxt])
                    nxt += 1
                if not run.inflight:
                    if nxt < len(requests):
                        time.sleep(max(0.0, min(offsets[nxt] - now, 0.05)))
                    continue
                if not engine.has_unfinished_requests():
                    run.drop_lost()
                    continue
                run.on_outputs(engine.step(), time.perf_counter())
                sampler.sample(len(run.inflight))
        except KeyboardInterrupt:
            partial, aborted = True, run.abort_inflight()
            run.end = time.perf_counter()
        except Exception as e:  # what finished before the error was measured: it goes back with the error
            failure, partial, aborted = e, True, run.abort_inflight()
            run.end = time.perf_counter()
    with contextlib.suppress(Exception):
        sampler.sample(0, force=True)
    run.done.sort(key=lambda r: r.index)
    return ended(RunResult("infer", concurrency, run.done, duration_s=run.end - t0, num_requests=len(requests),
                           request_rate=request_rate, partial=partial, aborted=aborted,
                           peak_rss_bytes=sampler.peak_rss_bytes, peak_gpu_bytes=sampler.peak_gpu_bytes,
                           timeline=sampler.timeline, engine_stats=sampler.last_stats, start_time=t0,
                           pooling=getattr(engine, "pooler", None) is not None), failure)
