"""Host overhead of one engine step: where the time of a steady decode step goes, phase by phase.

    python -m infer.bench.step_overhead --concurrency 16 64 --steps 300                 # CPU, tiny-llama
    python -m infer.bench.step_overhead --device cuda --overlap off|on --gpu-busy         # GPU
    python -m infer.bench.step_overhead --penalties --prompt-len 2000                     # repetition + frequency
    python -m infer.bench.step_overhead --adapters 16                                     # 16 mixed LoRA adapters

It starts `concurrency` requests (random prompts of --prompt-len tokens, 32 by default, ignore_eos, long enough that
none finishes; with --penalties each has a repetition and a frequency penalty; with --adapters N, N random rank-16
LoRA adapters on every projection, given to the requests round-robin, all resident at once), runs until
every one decodes, then times `steps` decode steps twice. First untouched: `wall_step_ms_uninstrumented`, the
real step time (with overlap, the steady rate of steps). Then with the engine's parts wrapped in timers, split into:
schedule (Scheduler.schedule), prepare (ModelRunner.prepare: token ids, positions, block tables, slot mapping),
forward (the model, CUDA-graph replay included), logits (the LM head), sample (the batched sampler) and rest
(launch bookkeeping, the wait for the sampled tokens, appending them, stop checks, detokenizing, outputs); `host`
is the step minus forward. On a GPU every timed phase is synchronised so that it includes its GPU work (which also
undoes any overlap: read the un-instrumented step time for that). Clocks: `cpu` (default on CPU) is the main
thread's CPU time, steady on a machine shared with other work (torch runs on --threads 1 by default); `wall` (the
default on a GPU) is elapsed time. Medians over the steps. `--gpu-busy`: the GPU's busy fraction over 50 steps
(torch.profiler); `--profile`: cProfile hot spots. Nothing here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

# cpu: this thread's CPU time (steady on a machine shared with other work; the host overhead is this thread's
# work when torch runs on one thread); wall: elapsed time (what a GPU run must use: it includes waiting)
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
PHASES = ("schedule", "prepare", "forward", "logits", "sample")


class PhaseTimer:
    """Wraps methods of live objects so that every call adds its wall time to a named phase."""

    def __init__(self, sync, clock=time.perf_counter):
        self.sync, self.clock, self.totals, self.active = sync, clock, defaultdict(float), True

    def wrap(self, obj, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            if not self.active:
                return inner(*args, **kwargs)
            t0 = self.clock()
            out = inner(*args, **kwargs)
            self.sync()
            self.totals[phase] += self.clock() - t0
            return out

        setattr(obj, attr, timed)


ADAPTER_RANK = 16


def write_adapters(model: str, num: int, out: Path) -> dict[str, str]:
    """`num` random rank-ADAPTER_RANK PEFT adapters for `model` (every projection of every layer) under `out`."""
    from transformers import AutoConfig

    from ..models.resolve import resolve_model
    from .e2e_models import write_random_adapters
    return write_random_adapters(AutoConfig.from_pretrained(str(resolve_model(model))), out, num, ADAPTER_RANK)


def build_engine(model: str, concurrency: int, device: str, overlap: bool | None, max_model_len: int = 1024,
                 loras: dict[str, str] | None = None):
    from ..engine.config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    opts = dict(model=model, device=device, max_num_seqs=max(concurrency, 1), max_model_len=max_model_len,
                num_kv_blocks=concurrency * -(-max_model_len // 16) + 8, block_size=16)
    if overlap is not None:
        opts["overlap"] = overlap
    if loras:  # all resident: the step's cost, not the adapters' swapping
        opts.update(loras=dict(loras), max_loras=len(loras), max_lora_rank=ADAPTER_RANK)
    return LLMEngine(EngineConfig(**opts))


def start_requests(engine, concurrency: int, prompt_len: int, seed: int = 0, penalties: bool = False,
                   adapters: list[str] | None = None) -> None:
    """`concurrency` requests; with `adapters`, request i runs adapter i % len(adapters)."""
    from ..engine.sampling_params import SamplingParams
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=engine.max_model_len - prompt_len, ignore_eos=True,
                            **(dict(repetition_penalty=1.1, frequency_penalty=0.2) if penalties else {}))
    for i in range(concurrency):
        lora = adapters[i % len(adapters)] if adapters else None
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)], params, lora=lora)
    while len(engine.scheduler.waiting) or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # steady state: allocations, caches
        engine.step()


def instrument(engine, clock) -> PhaseTimer:
    dev = engine.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    timer = PhaseTimer(sync, clock)
    runner = engine.runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner, "prepare", "prepare")
    timer.wrap(runner.model, "forward", "forward")  # nn.Module.__call__ looks forward up on the instance
    if runner.graphs is not None:
        timer.wrap(runner.graphs, "run", "forward")
    timer.wrap(runner.model, "compute_logits", "logits")
    if hasattr(runner.sampler, "sample"):
        timer.wrap(runner.sampler, "sample", "sample")
    else:  # the per-row sampler before batched sampling, for a side-by-side run of an older tree
        runner.sampler = _Callable(runner.sampler)
        timer.wrap(runner.sampler, "call", "sample")
    return timer


class _Callable:
    """A stand-in for an object whose __call__ is timed (special methods are looked up on the type)."""

    def __init__(self, inner):
        self.inner, self.call = inner, inner.__call__

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def measure(engine, steps: int, timer: PhaseTimer | None, profile: bool, clock=time.perf_counter) -> dict:
    """Median over `steps` steps of the step time and of each phase (medians: other processes on the machine
    disturb a few steps a lot)."""
    prof = cProfile.Profile() if profile else None
    sync = timer.sync if timer is not None else (lambda: None)
    records = []
    if prof:
        prof.enable()
    for _ in range(steps):
        if timer is not None:
            timer.totals.clear()
        t0 = clock()
        engine.step()
        sync()
        rec = {p: (timer.totals[p] if timer else 0.0) for p in PHASES}
        records.append({"step": clock() - t0, **rec})
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    med = {k: statistics.median(r[k] for r in records) * 1e3 for k in records[0]}
    out = {"step_ms": round(med["step"], 4)}
    if timer is not None:
        out.update({f"{p}_ms": round(med[p], 4) for p in PHASES})
        rest = statistics.median((r["step"] - sum(r[p] for p in PHASES)) for r in records) * 1e3
        out["rest_ms"] = round(rest, 4)
        out["host_ms"] = round(statistics.median((r["step"] - r["forward"]) for r in records) * 1e3, 4)
    return out


def gpu_busy(engine, steps: int) -> float:
    """Fraction of the span of `steps` decode steps during which the GPU runs a kernel or a copy (torch.profiler;
    overlapping activities counted once). What issue 13 asks of a steady decode step: >= 0.9."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(engine.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize(engine.device)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return float("nan")
    busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy / (spans[-1][1] - spans[0][0])


def run_one(model: str, concurrency: int, steps: int, device: str, profile: bool, overlap: bool | None,
            clock_name: str, busy: bool = False, prompt_len: int = 32, penalties: bool = False,
            adapters: int = 0) -> dict:
    clock = CLOCKS[clock_name]
    with tempfile.TemporaryDirectory() as tmp:  # the adapters' folders, for as long as the engine may read them
        loras = write_adapters(model, adapters, Path(tmp)) if adapters else None
        # room for the prompt, the steps before timing, both timed runs and the GPU-busy run
        engine = build_engine(model, concurrency, device, overlap, max(1024, prompt_len + 3 * steps + 128), loras)
        start_requests(engine, concurrency, prompt_len, penalties=penalties, adapters=list(loras or ()))
        plain = measure(engine, steps, None, False, time.perf_counter)  # un-instrumented wall time of a step
        extra = {"gpu_busy": round(gpu_busy(engine, min(steps, 50)), 4)} if busy else {}
        timer = instrument(engine, clock)
        phases = measure(engine, steps, timer, profile, clock)
    return {"model": model, "device": str(engine.device), "concurrency": concurrency, "steps": steps,
            "overlap": getattr(engine, "overlap", False), "clock": clock_name, "prompt_len": prompt_len,
            "penalties": penalties, "adapters": adapters,
            "wall_step_ms_uninstrumented": plain["step_ms"], **extra, **phases}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier host timings)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default=None,
                    help="cpu: the main thread's CPU time (default on CPU); wall: elapsed time (default on GPU)")
    ap.add_argument("--gpu-busy", action="store_true", help="CUDA: also the GPU's busy fraction (torch.profiler)")
    ap.add_argument("--profile", action="store_true", help="print cProfile hot spots of the timed steps")
    ap.add_argument("--overlap", choices=["on", "off", "default"], default="default",
                    help="EngineConfig.overlap (overlap the host work of step n+1 with step n)")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens of each random prompt")
    ap.add_argument("--penalties", action="store_true",
                    help="every request with repetition_penalty=1.1 and frequency_penalty=0.2")
    ap.add_argument("--adapters", type=int, default=0,
                    help="N random rank-16 LoRA adapters, given to the requests round-robin (0: none)")
    args = ap.parse_args(argv)
    if args.adapters < 0:
        ap.error("--adapters must be 0 or more")
    torch.set_num_threads(args.threads)
    overlap = None if args.overlap == "default" else args.overlap == "on"
    clock = args.clock or ("cpu" if args.device == "cpu" else "wall")
    for c in args.concurrency:
        print(json.dumps(run_one(args.model, c, args.steps, args.device, args.profile, overlap, clock,
                                 args.gpu_busy, args.prompt_len, args.penalties, args.adapters)), flush=True)


if __name__ == "__main__":
    main()
