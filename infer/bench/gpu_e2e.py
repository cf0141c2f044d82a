"""The GPU end-to-end benchmark in one command, with random weights of real shapes built on the device:

    python -m infer.bench.gpu_e2e --out bench-results/gpu-e2e

For each of Llama-2-7B and Qwen1.5-14B (shapes only: nothing is downloaded) it builds the model directly on the GPU
with GPTQ int4 g128 weights (random but valid qweight/qzeros/scales; fp16 weights, said so in the table, when
infer.quant.gptq_linear is missing or --fp16 is given), runs 16 concurrent requests of 44 random prompt tokens and
256 output tokens (EOS ignored) through infer's engine without adapters and with 16 different rank-16 adapters
(one per request, every attention and MLP projection), and the same requests through transformers (fp16 weights,
`generate` at batch 16). It prints output tokens/s and TPOT, and the decode roofline: the bytes one decode step
must read (weights + the KV of the batch at its mean context + the batch's adapters) over the device-to-device
copy bandwidth measured in the same run, and the fraction of it reached. Tables: DIR/results.csv, DIR/results.md.

The parts live beside it in bench/: `e2e_models` (random models of real shapes, tokenizer, adapters), `roofline`
(bandwidth and bytes per step) and `e2e_report` (rows, notes, tables).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..engine.config import KV_CACHE_DTYPES
from ..engine.cuda_graphs import PRIORITY_AUTO_TOKENS
from ..kernels.compiles import watch_compiles
from ..kernels.lora_ops import GATHER_AUTO_TOKENS
from ..memory.plan import plan_memory
from ..memory.sizes import kv_bytes_per_token
from .e2e_models import SHAPES, build_model, dtype_label, hf_config, make_tokenizer, write_random_adapters
from .e2e_report import (GATHERED, HIGH_PRIORITY, LOADS_LATE, LOW_PRIORITY, NO_PIECES, SEGMENTS, SILU_APART, WITH_PDL,
                         result_row, run_notes, write_tables)
from .roofline import copy_bandwidth, decode_roofline, lora_bytes_per_adapter, weight_bytes_per_step

EPILOGUE = "expand in epilogue"  # the mode label of --compare-lora-epilogue
ONE_STREAM = "shrink on the main stream"  # the mode labels of --compare-lora-streams
EXPAND_BESIDE = "expand beside too"
EXPAND_ALONE = "every expand launched alone"  # the mode labels of --compare-lora-fused
IN_CONSUMERS = "qkv/gate_up expands in their consumers"


# ----------------------------------------------------------------------------------------------- engines
def build_engine(model, model_config, tokenizer, device, adapters: dict[str, str], rank: int, concurrency: int,
                 max_len: int, eager: bool = False, slots: int | None = None, batched_tokens: int = 4096,
                 lora_epilogue: bool | None = None, lora_streams: bool | None = None, expand_beside: bool = False,
                 piecewise_tokens: int = 512, pdl: bool | None = None, expand_fused: bool = False,
                 expand_in_norm: bool = True, silu_in_gate_up: bool = True, graph_priority: bool | None = None,
                 kv_cache_dtype: str = "auto"):
    """An LLMEngine over an in-memory model (decode CUDA graphs unless `eager`); `slots` GPU adapter slots (default:
    one per adapter; fewer makes the engine swap adapters, counted in stats()["lora_swaps"]); `batched_tokens` the
    most tokens in one step (longer prompts are prefilled in chunks); `lora_epilogue` True adds every LoRA expand
    in the int4 matmul's epilogue wherever the kernel can (EngineConfig.lora_epilogue; None: where it is cheap);
    `lora_streams` False keeps every LoRA shrink on the main stream in the decode graphs (EngineConfig.lora_streams),
    `expand_beside` puts the expand beside the matmul too (EngineConfig.lora_expand_beside); `piecewise_tokens`
    the longest step (not all decodes) the piecewise graphs take (EngineConfig.cuda_graph_max_tokens; 0: none);
    `pdl` True launches the kernels with programmatic dependent launch where it works (EngineConfig.pdl; None: off);
    `expand_fused` True leaves the gate_up and qkv LoRA expands to silu_and_mul and decode_attention
    (EngineConfig.lora_expand_fused), `expand_in_norm` False launches the o and down expands on their own instead of
    in the rms_norm after them (EngineConfig.lora_expand_in_norm); `silu_in_gate_up` False launches silu_and_mul
    after the int4 gate_up matmul instead of in its epilogue (EngineConfig.silu_in_gate_up); `graph_priority` True
    records every CUDA graph on a high-priority stream, False none, None by the graph's tokens
    (EngineConfig.graph_priority); `kv_cache_dtype` the KV cache's
    elements (EngineConfig.kv_cache_dtype: auto, fp8, fp8_e5m2)."""
    slots = max(1, slots or len(adapters))
    from ..engine import llm_engine
    from ..engine.config import EngineConfig
    from ..engine.setup import EngineParts
    dtype = model.embed_tokens.weight.dtype
    blocks = concurrency * -(-max_len // 16) + concurrency
    engine_config = EngineConfig(f"random-{model_config.model_type}", dtype=str(dtype).split(".")[-1],
                                 device=str(device), max_num_seqs=concurrency, max_model_len=max_len,
                                 num_kv_blocks=blocks, loras=adapters, max_loras=slots, max_lora_rank=rank,
                                 enforce_eager=eager, max_num_batched_tokens=batched_tokens,
                                 lora_epilogue=lora_epilogue, lora_streams=lora_streams,
                                 lora_expand_beside=expand_beside, cuda_graph_max_tokens=piecewise_tokens, pdl=pdl,
                                 lora_expand_fused=expand_fused, lora_expand_in_norm=expand_in_norm,
                                 silu_in_gate_up=silu_in_gate_up, graph_priority=graph_priority,
                                 kv_cache_dtype=kv_cache_dtype)
    manager = None
    if adapters:
        from ..lora.manager import LoRAManager
        manager = LoRAManager(model, slots, rank, device=device, dtype=dtype)
        for name, path in adapters.items():
            manager.register(name, path)
    plan = plan_memory(engine_config, model_config, model, dtype, torch.device(device), max_len)
    parts = EngineParts(Path("."), model, model_config, tokenizer, dtype, torch.device(device), max_len, set(),
                        plan.num_blocks, plan, manager)
    return llm_engine.LLMEngine(engine_config, parts)


def make_requests(vocab: int, num: int, prompt_len: int, output_len: int, adapters: list[str], seed: int = 0,
                  stagger: bool = False):
    """`num` random prompts of prompt_len tokens, each generating output_len tokens; `stagger`: output lengths
    spread over output_len / 2 .. output_len instead, so that requests finish at different steps and the next
    prompts are prefilled beside running decodes (mixed steps), as a server's steps are."""
    from .datasets import BenchRequest
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (num, prompt_len), generator=g).tolist()
    lens = torch.randint(max(1, output_len // 2), output_len + 1, (num,), generator=g).tolist() if stagger \
        else [output_len] * num
    return [BenchRequest(None, ids[i], lens[i], lora=adapters[i % len(adapters)] if adapters else None,
                         ignore_eos=True) for i in range(num)]


def run_engine(engine, requests, concurrency: int) -> dict:
    """Metrics of one measured run, after an unmeasured short run of the same batch (Triton compiles, caches)."""
    from .driver import run_in_process
    run_in_process(engine, [replace(r, output_len=8) for r in requests], concurrency, progress=False)
    return run_in_process(engine, requests, concurrency, progress=False).metrics()


def profile_steps(engine, requests, steps: int = 20, out: Path | None = None) -> dict:
    """One prefill step of every request, then `steps` steady decode steps under torch.profiler: the prefill
    step's time, and per decode step the host (wall) time against the GPU-busy time (sum of kernel times); the
    top kernels by GPU time go to `out` (a text table)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from ..engine.sampling_params import SamplingParams
    for i, r in enumerate(requests):
        engine.add_request(f"prof-{i}", r.prompt_token_ids, SamplingParams(max_new_tokens=steps + 8,
                                                                           ignore_eos=True), r.lora)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
    while engine.has_unfinished_requests():
        engine.step()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in events) / 1e3 / steps
    if out is not None:
        out.write_text(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70))
    return {"prefill_step_ms": round(prefill_ms, 2), "decode_step_host_ms": round(host_ms, 3),
            "decode_step_gpu_busy_ms": round(busy_ms, 3), "gpu_busy_fraction": round(busy_ms / host_ms, 3)}


# ----------------------------------------------------------------------------------------------- the run
@dataclass
class ShapeRun:
    """One model shape's benchmark: its config and tokenizer, the command's options, and where and how it runs."""
    name: str
    model_config: object
    tokenizer: object
    args: argparse.Namespace
    bandwidth: float
    device: str
    dtype: torch.dtype

    @property
    def batch(self) -> int:
        return self.args.concurrency

    @property
    def kv_dtype(self) -> torch.dtype:
        """infer's KV cache elements: --kv-cache-dtype's (fp8: 1 byte), else the model's dtype."""
        return KV_CACHE_DTYPES[getattr(self.args, "kv_cache_dtype", "auto")] or self.dtype

    @property
    def max_len(self) -> int:
        return self.args.input_len + self.args.output_len + 8

    @property
    def mean_context(self) -> float:
        return self.args.input_len + self.args.output_len / 2

    def roofline(self, weight_bytes: int, adapter_bytes: int = 0, num_adapters: int = 0,
                 kv_dtype: torch.dtype | None = None) -> dict:
        """The decode step's floor; its KV term at `kv_dtype`'s bytes (None: infer's cache, --kv-cache-dtype)."""
        kv_per_token = kv_bytes_per_token(self.model_config, kv_dtype or self.kv_dtype)
        return decode_roofline(weight_bytes, kv_per_token, self.batch, self.mean_context, adapter_bytes,
                               num_adapters, self.bandwidth)

    def requests(self, adapters: list[str]):
        return make_requests(self.model_config.vocab_size, self.args.num_prompts, self.args.input_len,
                             self.args.output_len, adapters, stagger=self.args.stagger)


def _free_device_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def bench_model(name: str, args, bandwidth: float, device: str = "cuda", dtype: torch.dtype = torch.float16,
                **shape_overrides) -> list[dict]:
    """infer without and with adapters, then transformers, on one model shape; a result row for each."""
    model_config = hf_config(name, **shape_overrides)
    run = ShapeRun(name, model_config, make_tokenizer(model_config.vocab_size), args, bandwidth, device, dtype)
    rows = infer_rows(run)
    if not args.skip_hf:
        rows += hf_rows(run)
    return rows


def engine_modes(run: ShapeRun, tmp: Path) -> list[tuple[str, dict[str, str], bool]]:
    """(lora label, adapters, eager) of each engine to run: without adapters (graphs, and eagerly too with
    --compare-eager), then with the random adapters written to `tmp` (eagerly too with --compare-eager, through
    fewer slots with --max-loras, with every expand in the int4 matmul's epilogue with --compare-lora-epilogue, and
    with every shrink on the main stream, and with the expand beside the matmul too, with --compare-lora-streams,
    and with the qkv and gate_up expands added by decode_attention and silu_and_mul, then with every expand
    launched on its own, with --compare-lora-fused).
    --compare-piecewise adds each of the two plain modes with graphs for decode steps only, --compare-pdl each of them
    with programmatic dependent launch, --compare-silu the one without adapters with silu_and_mul launched after the
    int4 gate_up matmul (not in its epilogue), --compare-loads the one without adapters with the int4 kernels
    issuing each K step's loads in that step (not during the step before: gptq_gemm.loads_ahead), --compare-priority
    each of the two plain modes with all its CUDA graphs recorded at high priority and with all at the default
    priority (EngineConfig.graph_priority True and False), --compare-expand the one with adapters with all its decode
    steps' LoRA expands as gathers and with all by segments (INFER_LORA_EXPAND=gather and segments)."""
    args = run.args
    both = args.compare_eager and not args.eager  # each of the two plain modes with graphs and without
    pieces = args.compare_piecewise and not args.eager
    modes = [("none", {}, args.eager)] + ([("none", {}, True)] if both else []) \
        + ([(f"none, {NO_PIECES}", {}, False)] if pieces else []) \
        + ([(f"none, {WITH_PDL}", {}, args.eager)] if args.compare_pdl else []) \
        + ([(f"none, {SILU_APART}", {}, args.eager)] if args.compare_silu and not args.fp16 else []) \
        + ([(f"none, {LOADS_LATE}", {}, args.eager)] if args.compare_loads and not args.fp16 else []) \
        + ([(f"none, {v}", {}, False) for v in (HIGH_PRIORITY, LOW_PRIORITY)]
           if args.compare_priority and not args.eager else [])
    if args.num_adapters:
        adapters = write_random_adapters(run.model_config, tmp, args.num_adapters, args.rank)
        mixed = f"{len(adapters)} mixed r{args.rank}"
        modes += [(mixed, adapters, args.eager)] + ([(mixed, adapters, True)] if both else []) \
            + ([(f"{mixed}, {NO_PIECES}", adapters, False)] if pieces else []) \
            + ([(f"{mixed}, {WITH_PDL}", adapters, args.eager)] if args.compare_pdl else []) \
            + ([(f"{mixed}, {v}", adapters, False) for v in (HIGH_PRIORITY, LOW_PRIORITY)]
               if args.compare_priority and not args.eager else []) \
            + ([(f"{mixed}, {v}", adapters, args.eager) for v in (GATHERED, SEGMENTS)] if args.compare_expand else [])
        if args.max_loras and args.max_loras < len(adapters):
            modes.append((f"{len(adapters)} mixed r{args.rank} via {args.max_loras} slots", adapters, args.eager))
        if args.compare_lora_epilogue and not args.fp16:
            modes.append((f"{len(adapters)} mixed r{args.rank}, {EPILOGUE}", adapters, args.eager))
        if args.compare_lora_streams and not args.eager:
            modes.append((f"{len(adapters)} mixed r{args.rank}, {ONE_STREAM}", adapters, False))
            modes.append((f"{len(adapters)} mixed r{args.rank}, {EXPAND_BESIDE}", adapters, False))
        if args.compare_lora_fused:
            modes.append((f"{len(adapters)} mixed r{args.rank}, {IN_CONSUMERS}", adapters, args.eager))
            modes.append((f"{len(adapters)} mixed r{args.rank}, {EXPAND_ALONE}", adapters, args.eager))
    return modes


@contextlib.contextmanager
def int4_loads(mode: str | None):
    """While an engine is built and run: when the int4 kernels issue a K step's loads (gptq_gemm.int4_loads,
    "ahead" or "late"; None: as set)."""
    from ..kernels import gptq_gemm
    old = gptq_gemm.int4_loads
    if mode is not None:
        gptq_gemm.int4_loads = mode
    try:
        yield
    finally:
        gptq_gemm.int4_loads = old


@contextlib.contextmanager
def lora_expand(mode: str | None):
    """While an engine is built and run: how its LoRA expands of up to 64 tokens find their adapters
    (lora_ops.expand_by, "auto", "segments" or "gather"; None: as set)."""
    from ..kernels import lora_ops
    old = lora_ops.expand_by
    if mode is not None:
        lora_ops.expand_by = mode
    try:
        yield
    finally:
        lora_ops.expand_by = old


def infer_rows(run: ShapeRun) -> list[dict]:
    """infer's rows: one model with random weights on the device, one engine over it per mode."""
    model, label = build_model(run.model_config, run.dtype, run.device, quantized=not run.args.fp16)
    weight_bytes = weight_bytes_per_step(model, run.batch)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for lora, adapters, eager in engine_modes(run, Path(tmp)):
            with int4_loads("late" if LOADS_LATE in lora else None), \
                    lora_expand("gather" if GATHERED in lora else "segments" if SEGMENTS in lora else None):
                rows.append(infer_row(run, model, label, weight_bytes, lora, adapters, eager))
    del model
    _free_device_memory()
    return rows


def infer_row(run: ShapeRun, model, label: str, weight_bytes: int, lora: str, adapters: dict[str, str],
              eager: bool) -> dict:
    """One engine's measured run (printed as a JSON line), and its step profile with --profile."""
    args, b = run.args, run.batch
    slots = args.max_loras if "slots" in lora else None
    engine = build_engine(model, run.model_config, run.tokenizer, run.device, adapters, args.rank, b, run.max_len,
                          eager, slots, lora_epilogue=True if EPILOGUE in lora else None,
                          lora_streams=False if ONE_STREAM in lora else None, expand_beside=EXPAND_BESIDE in lora,
                          piecewise_tokens=0 if NO_PIECES in lora else 512, pdl=True if WITH_PDL in lora else None,
                          expand_fused=IN_CONSUMERS in lora, expand_in_norm=EXPAND_ALONE not in lora,
                          silu_in_gate_up=SILU_APART not in lora,
                          graph_priority=True if HIGH_PRIORITY in lora else False if LOW_PRIORITY in lora else None,
                          kv_cache_dtype=args.kv_cache_dtype)
    engine.warm_kernels()  # compiles every kernel path (prefix-cached prefill too) before anything is timed
    names = list(adapters)
    roof = run.roofline(weight_bytes, lora_bytes_per_adapter(model) if names else 0, min(len(names), b))
    reqs = run.requests(names)
    with watch_compiles() as compiled:  # the engine's start should have left nothing to compile on requests
        metrics = run_engine(engine, reqs, b)
    row = result_row(run.name, label, lora, "infer --eager" if eager else "infer", metrics, roof, run.bandwidth)
    row["compiles_on_requests"] = len(compiled)
    if compiled:
        row["compiled_on_requests"] = sorted(set(compiled))
    row["start_s"] = round(sum(engine.start_times.values()), 2)
    row.update({k: round(v, 2) for k, v in engine.start_times.items()})  # its parts: tuning, compile, graphs...
    stats = engine.stats()
    row["lora_swaps"] = stats["lora_swaps"]
    row["piecewise_steps"], row["steps"] = stats["piecewise_graph_steps"], stats["num_steps"]
    check = engine.runner.pieces_check  # the start's check of the pieces against the whole forward (None: none)
    row["piecewise_check"] = None if check is None else float(f"{check:.3g}")
    row["pdl"] = engine.pdl
    row["kv_cache_dtype"] = args.kv_cache_dtype
    print(json.dumps(row), flush=True)
    if args.profile:
        mode = re.sub(r"[^a-z0-9]+", "-", lora).strip("-")  # every mode its own file ("16-mixed-r16-via-8-slots")
        tag = f"{run.name}-{mode}-{'eager' if eager else 'graphs'}-c{b}"
        prof = profile_steps(engine, reqs[:b], out=args.out / f"profile-{tag}.txt")
        print(json.dumps({"profile": tag, **prof}), flush=True)
    del engine
    _free_device_memory()
    return row


def hf_rows(run: ShapeRun) -> list[dict]:
    """The transformers baseline (float weights of the same shape): the plain `generate`, and on CUDA the strong
    one (static cache: transformers compiles its step), both warmed first."""
    from transformers import AutoModelForCausalLM

    from .hf_baseline import HFModel, run_hf_generate
    b = run.batch
    with torch.device(run.device):
        hf = AutoModelForCausalLM.from_config(run.model_config, dtype=run.dtype).eval()
    reqs = run.requests([])
    handle = HFModel(hf, run.tokenizer, torch.device(run.device))
    roof = run.roofline(weight_bytes_per_step(hf, b), kv_dtype=run.dtype)  # transformers' cache: the model's dtype
    rows = []
    for cache, label in ((None, "hf generate"), ("static", "hf generate, static cache")):
        if cache and run.device != "cuda":
            continue
        # the static cache is sized by the output length: warm it with the measured batch's own lengths
        warm = reqs[:b] if cache else [replace(r, output_len=8) for r in reqs[:b]]
        run_hf_generate(handle, warm, b, progress=False, cache_implementation=cache)
        metrics = run_hf_generate(handle, reqs, b, progress=False, cache_implementation=cache).metrics()
        rows.append(result_row(run.name, dtype_label(run.dtype), "none", label, metrics, roof, run.bandwidth))
        print(json.dumps(rows[-1]), flush=True)
    del hf, handle
    _free_device_memory()
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.bench.gpu_e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.csv and results.md")
    p.add_argument("--models", nargs="+", default=["llama-2-7b", "qwen1.5-14b"], choices=list(SHAPES))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=44)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=0,
                   help="also run the adapters through this many GPU slots (swaps), e.g. 8 for 16 adapters")
    for flag, text in {  # switches (store_true): their help
        "--fp16": "fp16 weights instead of GPTQ int4",
        "--skip-hf": "no transformers baseline",
        "--eager": "infer without decode CUDA graphs",
        "--compare-eager": "also run infer --eager, without adapters and with the mixed adapters",
        "--compare-lora-epilogue": "also run the mixed adapters with every LoRA expand added in the int4 matmul's "
            "epilogue wherever the kernel can (by default only where that is cheap: one row or few slots)",
        "--compare-lora-streams": "also run the mixed adapters with every LoRA shrink on the main stream (by default, "
            "in the decode graphs, each runs on a second stream beside the base matmul), and with the expand beside "
            "the matmul too",
        "--compare-lora-fused": "also run the mixed adapters with the gate_up LoRA expand added by silu_and_mul and, "
            "in decode steps, qkv's by decode_attention, and with every expand launched on its own (by default, in "
            "steps of up to 64 tokens, the rms_norm after o and down adds their expands, and the others are launched "
            "after their matmuls)",
        "--stagger": "output lengths spread over output-len / 2 .. output-len: requests finish at different steps, and "
            "with --num-prompts above --concurrency the next prompts join running decodes",
        "--compare-piecewise": "also run infer with CUDA graphs for decode steps only (prefills and mixed steps eager, "
            "--cuda-graph-max-tokens 0), without adapters and with the mixed adapters",
        "--compare-pdl": "also run infer with its kernels launched with programmatic dependent launch (off by default: "
            "slower on an H100), without adapters and with the mixed adapters",
        "--compare-silu": "also run infer without adapters with silu_and_mul launched after the int4 gate_up matmul "
            "(by default its epilogue applies it: one launch fewer per layer)",
        "--compare-loads": "also run infer without adapters with the int4 kernels issuing each K step's loads in that "
            "step instead of during the step before (INFER_INT4_LOADS=late)",
        "--compare-priority": "also run infer with all its CUDA graphs recorded on a high-priority stream, so that the "
            "GPU schedules the base matmuls' programs before the LoRA shrinks beside them, and with all at the default "
            "priority (EngineConfig.graph_priority True and False; the default engine records the graphs of "
            f"{PRIORITY_AUTO_TOKENS} tokens or more at high priority where there are adapters), without adapters and "
            "with the mixed adapters",
        "--compare-expand": "also run infer with the mixed adapters, the LoRA expands of decode steps all as gathers "
            "(each program takes up to 16 tokens of any adapters: INFER_LORA_EXPAND=gather), and all by segments "
            f"(INFER_LORA_EXPAND=segments; the default engine gathers up to {GATHER_AUTO_TOKENS} tokens)",
    }.items():
        p.add_argument(flag, action="store_true", help=text)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="the KV cache's elements in every infer row (--kv-cache-dtype; default: the model's dtype)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one prefill and 20 decode steps of each engine (host vs GPU-busy time)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_e2e needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth("cuda")
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = [row for name in args.models for row in bench_model(name, args, bandwidth)]
    print(write_tables(rows, args.out, run_notes(torch.cuda.get_device_name(), args, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
