"""GPTQ int4 matmul micro-benchmark: infer's kernel beside cuBLAS fp16 and torch's tinygemm int4, in one run.

    python -m infer.bench.kernels --out kernels.csv                 # the table
    python -m infer.bench.kernels --tune --tuned-out h100.json ...  # tune first (kernels.gptq_tune), then the table
    python -m infer.bench.kernels --tune --quick --tune-m 1 16 64   # only the engine start's candidates, some M
    python -m infer.bench.kernels --lora --out lora_kernels.csv     # multi-LoRA kernels (infer.bench.lora_kernels)
    python -m infer.bench.kernels --attention --out attention.csv   # decode attention (infer.bench.attention_kernels)
    python -m infer.bench.kernels --pdl --m 1 16 --models 7B ...    # also with programmatic dependent launch
    python -m infer.bench.kernels --pdl --pdl-prefetch 0 2 8 ...    # ... prefetching 0, 2, 8 K steps of weights

Shapes are the fused projections of a 7B (Llama-2) and a 14B (Qwen1.5) model: qkv, o, gate_up, down. Every
kernel is timed from a CUDA graph that cycles through enough copies of its weights to defeat the L2 cache (the
way a decode step meets them), on random inputs. The floor is the int4 weight bytes over the copy bandwidth
measured in the same run; `vs_fp16` > 1 means faster than cuBLAS on the fp16 weight; `other_us` is the same tile
with the other unpacking of the words (PAIRS on or off for the field mma / mmat, INPLACE for gemv); `shift_us` is a
field tile with its 4-bit fields shifted out one at a time instead of taken by byte permute (the default), and
`byte_gain` shift_us / infer_us; `joined_us` a transposed 4-warp tile with one dot per byte's two fields instead
of one per field (the default), and `byte_dots_gain` infer_us / joined_us (what BYTE_DOTS would give); `sync_us` a
transposed field tile with its dots as mma.sync instead of wgmma (SYNC_MMA), or as wgmma where the table chose
mma.sync, and `sync_gain` infer_us / sync_us; `late_us` a
tensor-core tile that loads each K step's scales in that step, or a one-row gemv its whole step, instead of during
the step before (the default, AHEAD), and `ahead_gain` late_us / infer_us; from 32 rows,
`dequant_us` / `chunks_us` are dequantize + cuBLAS on the whole matrix / in L2-sized column blocks; with --pdl,
`pdl_us` is the same kernel launched with programmatic dependent launch (each launch of the graph starts, and
prefetches its first weights, while the one before finishes: kernels.pdl) and `pdl_gain` infer_us / pdl_us; with
--pdl-prefetch, `pdl_us_prefetchP` the same prefetching P K steps before the wait. The gate_up rows whose tile applies
the MLP's activation in its epilogue (`gptq_gemm.gated_fits`: up to 32 rows) are also timed gated, fused and apart:
`silu_us` / `gelu_us` the matmul applying silu_and_mul / Gemma's gelu_tanh_and_mul in its epilogue (one launch, half
the output written), `silu_apart_us` / `gelu_apart_us` the plain matmul and the activation's launch after it, and
`silu_gain` / `gelu_gain` apart / fused (above 1: the epilogue is faster). Every fused gate_up row is also timed as
an MLP without gate's up projection of that shape (StarCoder2's gelu_tanh, Arcee's and Nemotron's relu2, Apertus's
xIELU: `ungated_times`): `ACT_us` the activation in the epilogue, `ACT_apart_us` the plain matmul and the launch
after it that the engine runs otherwise (torch's gelu; fused.ungated_act's one Triton launch for relu2 and xIELU),
`ACT_gain` apart / fused, and for relu2 / xIELU `ACT_torch_us` the matmul and torch's ops (two launches, a dozen).
A shape and M bucket that the
GPU's table lacks (no table ships for it, and no engine start has tuned it there) is first tuned with the quick
candidate set, as an engine's first start does, so that every row times what an engine would run. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..kernels.gptq_tune import BUCKETS, random_gptq  # noqa: F401  (random_gptq: part of this module's API)

MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 2048)
SHAPES = {"7B": {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)},
          "14B": {"qkv": (5120, 15360), "o": (5120, 5120), "gate_up": (5120, 27392), "down": (13696, 5120)},
          # Llama-3-8B: grouped-query attention (8 KV heads), so a narrower qkv and a wider MLP
          "8B": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}}


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    from ..kernels.gptq_tune import time_graph
    a = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    us = time_graph([lambda: b.copy_(a)])
    return 2 * a.numel() * 2 / (us * 1e-6)


def _tinygemm(k: int, n: int, copies: int):
    """torch's int4 kernel (`_weight_int4pack_mm`, bf16 activations, g128) or None where this torch lacks it."""
    try:
        packs = []
        for _ in range(copies):
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            packed = torch.ops.aten._convert_weight_to_int4pack(w, 8)
            sz = torch.rand(k // 128, n, 2, device="cuda", dtype=torch.bfloat16)
            packs.append((packed, sz))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm(x, packs[0][0], 128, packs[0][1])
        return packs
    except Exception as e:  # not every build has it for this GPU / shape
        print(f"tinygemm unavailable for {k}x{n}: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def kernel_label(cfg: dict) -> str:
    """'mma fields pairs', 'gemv in place', 'dequant 1024-column blocks', ...: the kernel and its options."""
    flags = [("FIELD", "fields"), ("PAIRS", "pairs"), ("SCALE_W", "scale-w"), ("INPLACE", "in place")]
    chunks = [f"{cfg['CHUNK_N']}-column blocks"] if cfg.get("CHUNK_N") else []
    return " ".join([cfg.get("kernel", "mma")] + [name for key, name in flags if cfg.get(key)] + chunks)


def toggled(cfg: dict) -> dict | None:
    """The configuration with the other way of unpacking the words (PAIRS for field mma / mmat, INPLACE for gemv),
    or None where there is none: the bench times both so one run shows what the option is worth."""
    if cfg.get("kernel") in ("mma", "mmat") and cfg.get("FIELD"):
        return dict(cfg, PAIRS=not cfg.get("PAIRS", False))
    if cfg.get("kernel") == "gemv" and "BLOCK_M" not in cfg:
        return dict(cfg, INPLACE=not cfg.get("INPLACE", False))
    return None


def shifted(cfg: dict) -> dict | None:
    """A field tile that takes its 4-bit fields by byte permute (the default: gptq_kernels._byte_fields) with them
    shifted out one at a time instead, or None for the other kernels: the bench times both (`byte_gain`)."""
    if cfg.get("kernel") in ("mma", "mmat") and cfg.get("FIELD") and not cfg.get("PAIRS") and cfg.get("BYTES", True):
        return dict(cfg, BYTES=False)
    return None


def joined(cfg: dict) -> dict | None:
    """A transposed 4-warp field tile that makes one dot per field (the default) with one dot per byte's two fields
    instead (gptq_gemm's BYTE_DOTS), or None for the other kernels: the bench times both (`byte_dots_gain`)."""
    if shifted(cfg) is not None and cfg["kernel"] == "mmat" and cfg["num_warps"] == 4 and not cfg.get("BYTE_DOTS"):
        return dict(cfg, BYTE_DOTS=True)
    return None


def synced(cfg: dict) -> dict | None:
    """A transposed field tile with one dot per field with its dots switched between wgmma (the default) and
    warp-synchronous mma.sync (SYNC_MMA, one slice of columns per warp: gptq_kernels._dot_fields), or None where
    the launcher would not take SYNC_MMA (other kernels, two fields per dot, one dot per byte, fewer than 16 columns
    a warp): the bench times both (`sync_gain` infer_us / sync_us, above 1 where the other one is faster)."""
    if cfg.get("kernel") != "mmat" or not cfg.get("FIELD") or cfg.get("PAIRS") or cfg.get("BYTE_DOTS") \
            or cfg["BLOCK_N"] % (16 * cfg["num_warps"]):
        return None
    return dict(cfg, SYNC_MMA=not cfg.get("SYNC_MMA", False))


def late_loads(cfg: dict) -> dict | None:
    """A kernel that issues a K step's loads during the step before (`gptq_gemm.loads_ahead_for`: the tensor-core
    tiles their scales, the narrow one-row gemv its whole step) with them issued in their own step instead, or None
    for the others (wider gemv, the gemv over a few rows, dequantize + cuBLAS): the bench times both
    (`ahead_gain`)."""
    from ..kernels.gptq_gemm import loads_ahead_for
    if cfg.get("kernel") in ("mma", "mmat", "gemv") and loads_ahead_for(cfg["kernel"], cfg, 4):
        return dict(cfg, AHEAD=False)
    return None


def gated_times(name: str, x, copies, wp: int, k: int, n: int) -> dict:
    """A gate_up layer at x's rows where its kernel applies the MLP's activation in its epilogue
    (`gptq_gemm.gated_fits`): each activation (silu, Gemma's gelu_tanh) timed fused (`ACT_us`) and as the plain
    matmul with the activation's launch after it (`ACT_apart_us`), and `ACT_gain` apart / fused; {} elsewhere."""
    from ..kernels import fused, gptq_gemm
    from ..kernels.gptq_tune import time_graph
    kind, cfg, is_fused = gptq_gemm._choice(x.shape[0], n, k, 4, 128, wp, None, x.device)
    if name != "gate_up" or not is_fused or not gptq_gemm.gated_fits(kind, cfg, n):
        return {}
    out = {}
    for act, label in (("silu", "silu"), ("gelu_tanh", "gelu")):
        gelu = act == "gelu_tanh"
        out[f"{label}_us"] = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp, gated=act)
                                         for t in copies])
        out[f"{label}_apart_us"] = time_graph([lambda t=t: fused.silu_and_mul(
            gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp), gelu=gelu) for t in copies])
        out[f"{label}_gain"] = out[f"{label}_apart_us"] / out[f"{label}_us"]
    return out


UNGATED = (("gelu_tanh", "gelu_up"), ("relu2", "relu2"), ("xielu", "xielu"))  # (activation, column label)
XIELU_SCALARS = (1.1708984375, 1.3544921875, 0.5, -1.0132789611816406e-06)  # (float16 values: softplus(0.8), ...)


def ungated_times(name: str, x, copies, wp: int, k: int, n: int) -> dict:
    """A gate_up layer's shape at x's rows as an MLP without gate's up projection, where a fused kernel runs it:
    each activation timed in the epilogue (`ACT_us`), as the plain matmul with the launch after it that the engine
    runs otherwise (`ACT_apart_us`) and `ACT_gain` apart / fused; relu2's and xIELU's also with torch's ops after
    the matmul (`ACT_torch_us`: what fused.ungated_act replaces); {} elsewhere."""
    from ..kernels import fused, gptq_gemm, reference
    from ..kernels.gptq_tune import time_graph
    if name != "gate_up" or not gptq_gemm._choice(x.shape[0], n, k, 4, 128, wp, None, x.device)[2]:
        return {}
    out = {}
    for act, label in UNGATED:
        out[f"{label}_us"] = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp, act=act,
                                                                            act_scalars=XIELU_SCALARS)
                                         for t in copies])
        after = reference.ungated_act if act == "gelu_tanh" else fused.ungated_act  # (gptq_matmul's way apart)
        out[f"{label}_apart_us"] = time_graph([lambda t=t, after=after: after(
            gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp), act, XIELU_SCALARS) for t in copies])
        out[f"{label}_gain"] = out[f"{label}_apart_us"] / out[f"{label}_us"]
        if act != "gelu_tanh":
            out[f"{label}_torch_us"] = time_graph([lambda t=t: reference.ungated_act(
                gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp), act, XIELU_SCALARS) for t in copies])
    return out


def measure_shape(model: str, name: str, k: int, n: int, ms, bandwidth: float, device: str = "cuda",
                  with_pdl: bool = False, pdl_prefetch=()) -> list[dict]:
    """One row per M for a K x N layer (device: "cuda"; the tests run the same code on "cpu", interpreted);
    with_pdl: also timed with programmatic dependent launch (`pdl_us`), and prefetching each of `pdl_prefetch` K
    steps of weights before the wait."""
    from ..kernels import gptq_configs, gptq_gemm, pdl, reference
    from ..kernels.gptq_tune import L2_BUST_BYTES, chunked, time_graph
    copies = [random_gptq(k, n, 4, 128, device) for _ in range(max(2, -(-L2_BUST_BYTES // (k * n // 2))))]
    w16 = [torch.randn(n, k, device=device, dtype=torch.float16) * 0.02 for _ in range(2)]
    tiny = _tinygemm(k, n, len(copies)) if device == "cuda" else None
    wp = gptq_configs.interleave_for(128, k, 8)  # the layout the linear method gives such a layer on CUDA
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.float16)
        cfg = gptq_configs.choose(m, n, k, x.device)
        y = gptq_gemm.gptq_matmul(x, *copies[0], 4, True, 128, wp)
        want = reference.gptq_matmul(x, *copies[0], 4, True, 128, wp)
        err = ((y.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
        with pdl.forced(False):  # whatever an engine in this process chose
            ours = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp) for t in copies])
        fp16 = time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in w16])
        row = {"model": model, "layer": name, "M": m, "K": k, "N": n, "infer_us": ours, "cublas_fp16_us": fp16,
               "floor_us": k * n / 2 / bandwidth * 1e6, "vs_fp16": fp16 / ours, "kernel": kernel_label(cfg),
               "config": json.dumps(cfg), "max_rel_err": err}
        if with_pdl:
            with pdl.forced(True):
                row["pdl_us"] = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp) for t in copies])
                row["pdl_gain"] = ours / row["pdl_us"]
                default = pdl.prefetch()
                try:
                    for steps in pdl_prefetch:
                        pdl.prefetch_steps = steps
                        row[f"pdl_us_prefetch{steps}"] = time_graph(
                            [lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp) for t in copies])
                finally:
                    pdl.prefetch_steps = default
        if shifted(cfg) is not None:  # the same tile with its fields shifted out one at a time (no byte permute)
            row["shift_us"] = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp,
                                                                             config=shifted(cfg)) for t in copies])
            row["byte_gain"] = row["shift_us"] / ours
        if joined(cfg) is not None:  # and with one dot per byte's two fields (the byte permute kept)
            joined_cfg = joined(cfg)
            row["joined_us"] = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp,
                                                                              config=joined_cfg) for t in copies])
            row["byte_dots_gain"] = ours / row["joined_us"]
        if synced(cfg) is not None:  # the same tile's dots as mma.sync instead of wgmma, or the other way round
            sync_cfg = synced(cfg)
            row["sync_us"] = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp,
                                                                            config=sync_cfg) for t in copies])
            row["sync_gain"] = ours / row["sync_us"]
        if late_loads(cfg) is not None:  # the same kernel with each step's loads issued in that step
            late_cfg = late_loads(cfg)
            row["late_us"] = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp,
                                                                              config=late_cfg) for t in copies])
            row["ahead_gain"] = row["late_us"] / ours
        other = toggled(cfg)
        if other is not None:  # the same tile with the other unpacking, timed in the same run
            row["other"] = kernel_label(other)
            row["other_us"] = time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp, config=other)
                                          for t in copies])
        if m >= 32:  # the dequantize + cuBLAS ways, whole matrix and in L2-sized column blocks (best of them)
            def timed(c):
                return time_graph([lambda t=t: gptq_gemm.gptq_matmul(x, *t, 4, True, 128, wp, config=c)
                                   for t in copies])
            row["dequant_us"] = timed({"kernel": "dequant"})
            row["chunks_us"], row["chunks"] = min((timed(c), c["CHUNK_N"]) for c in chunked(k))
        row.update(gated_times(name, x, copies, wp, k, n))
        row.update(ungated_times(name, x, copies, wp, k, n))
        if tiny is not None:
            xb = x.to(torch.bfloat16)
            row["tinygemm_us"] = time_graph([lambda p=p: torch.ops.aten._weight_int4pack_mm(xb, p[0], 128, p[1])
                                             for p in tiny])
            row["tinygemm_vs_fp16"] = fp16 / row["tinygemm_us"]
        rows.append(row)
    del copies, w16, tiny
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def tune(models, out: str | None, buckets=BUCKETS, quick: bool = False) -> dict:
    """Tune every shape of `models`; each shape's winners are saved (cache file, and `out`) as soon as it is done."""
    from ..kernels import gptq_configs
    from ..kernels.gptq_tune import tune_shape
    name = gptq_configs.gpu_name(torch.device("cuda"))
    found: dict = {}
    for model in models:
        for k, n in SHAPES[model].values():
            res = tune_shape(n, k, buckets, log=lambda s: print(s, flush=True), quick=quick)
            found[f"{n},{k}"] = {b: cfg for b, (cfg, _) in res.items() if cfg is not None}
            path = gptq_configs.save(name, {f"{n},{k}": found[f"{n},{k}"]})
            if out:
                with open(out, "w") as f:
                    json.dump({s: {str(b): c for b, c in by.items()} for s, by in found.items()}, f, indent=1,
                              sort_keys=True)
    print(f"tuned configs saved to {path}" if path else "tuned configs not saved (the cache file is not writable: "
          "set INFER_CACHE to a writable folder; --out writes them too)")
    return found


def untuned(models, ms, device) -> dict:
    """{(N, K): [M buckets]}: the shapes of `models` and token counts `ms` that this GPU's table (the shipped one, the
    user's cache on top) holds no config for; `gptq_configs.choose` would time `heuristic`'s guess for them."""
    from ..kernels import gptq_configs
    todo: dict = {}
    for model in models:
        for k, n in SHAPES[model].values():
            missing = sorted({gptq_configs.bucket(m) for m in ms if gptq_configs.tuned(m, n, k, device) is None})
            if missing and (n, k) not in todo:
                todo[(n, k)] = missing
    return todo


def tune_missing(models, ms, device, log=print) -> dict:
    """Tune what `untuned` names with the quick candidate set and save it to the cache file, as an engine's first
    start on this GPU does (`gptq_tune.tune_model`), so that the table times the kernels an engine here would run:
    on a GPU without a shipped table (an H200, an A100...) it timed the heuristic's configs before."""
    from ..kernels import gptq_configs
    from ..kernels import gptq_tune
    todo = untuned(models, ms, device)
    if not todo:
        return {}
    name = gptq_configs.gpu_name(device)
    log(f"{name}: no tuned config for {sum(len(b) for b in todo.values())} (shape, M bucket) pairs; tuning them with "
        f"the quick candidate set first, as an engine's first start here does (--tune times the full set)")
    found = {}
    for (n, k), buckets in todo.items():
        res = gptq_tune.tune_shape(n, k, buckets, device=device, log=log, quick=True)
        found[f"{n},{k}"] = {b: cfg for b, (cfg, _) in res.items() if cfg is not None}
    gptq_configs.save(name, found)
    return found


GATED_COLS = ["model", "layer", "M", "kernel", "infer_us", "silu_us", "silu_apart_us", "silu_gain", "gelu_us",
              "gelu_apart_us", "gelu_gain"]  # (`gated_times`: a table of its own, after the main one)
UNGATED_COLS = ["model", "layer", "M", "kernel"] + [f"{label}_{c}" for _, label in UNGATED
                                                    for c in ("us", "apart_us", "gain", "torch_us")
                                                    if not (label == "gelu_up" and c == "torch_us")]


def print_table(rows: list[dict], title: str, cols: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    cols = cols or ["model", "layer", "M", "infer_us", "tinygemm_us", "cublas_fp16_us", "floor_us", "vs_fp16",
                    "tinygemm_vs_fp16", "kernel", "other_us", "other", "shift_us", "byte_gain", "joined_us",
                    "byte_dots_gain", "sync_us", "sync_gain", "late_us", "ahead_gain", "dequant_us", "chunks_us",
                    "pdl_us", "pdl_gain",
                    "max_rel_err"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("model", "layer", "kernel", "other") else "right")
    for r in rows:
        table.add_row(*(("{:.1f}" if c.endswith("_us") else "{:.2f}x" if c.endswith(("fp16", "gain", "sdpa"))
                         else "{:.1e}"
                         if c == "max_rel_err" else "{}").format(r[c]) if c in r else "-" for c in cols))
    Console(width=200).print(table)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infer.bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="CSV file to write (one row per M x shape)")
    p.add_argument("--m", type=int, nargs="+", default=list(MS), help="batch sizes (tokens)")
    p.add_argument("--models", nargs="+", default=["7B", "14B"], choices=list(SHAPES))
    p.add_argument("--tune", action="store_true", help="tune every shape and M bucket first (minutes)")
    p.add_argument("--tuned-out", help="with --tune: also write the tuned table to this JSON file")
    p.add_argument("--tune-m", type=int, nargs="+", default=list(BUCKETS), help="with --tune: the M buckets")
    p.add_argument("--quick", action="store_true", help="with --tune: only the engine start's quick candidates")
    p.add_argument("--lora", action="store_true", help="time the multi-LoRA shrink/expand kernels instead")
    p.add_argument("--attention", action="store_true",
                   help="time the decode attention instead (infer.bench.attention_kernels; --models 7B 8B 14B)")
    p.add_argument("--pdl", action="store_true",
                   help="also time each kernel launched with programmatic dependent launch (Hopper and newer)")
    p.add_argument("--pdl-prefetch", type=int, nargs="+", default=[], choices=(0, 1, 2, 4, 8, 16),
                   help="with --pdl: also time these numbers of K steps of weights prefetched before the wait")
    return p.parse_args(argv)


def out_problem(out: str, flag: str = "--out") -> str | None:
    """What keeps the CSV file `out` from being written, found before the GPU times anything (it was written at
    the end: a missing folder or a folder given as the file was a traceback after minutes of timing, the rows
    lost), or None."""
    import os
    import tempfile
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        return f"{flag} {out} is a folder: give the CSV file to write, e.g. {flag} {os.path.join(out, 'bench.csv')}"
    if not os.path.isdir(folder):
        return f"{flag} {out}: the folder {folder} does not exist (create it, or give a file in another folder)"
    try:  # (for real, as infer bench's --out: os.access says yes to root on a read-only mount)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        return f"{flag} {out}: {folder} is not writable ({e.strerror or e})"
    return None


def _flag_problem(args) -> str | None:
    """A flag that the run would ignore, or an output it could not write, said before the GPU starts: --quick,
    --tuned-out and --tune-m tune (without --tune nothing is tuned), --pdl-prefetch times with --pdl, and --lora
    and --attention time their own kernels over --out and --models alone."""
    for flag, given in (("--quick", args.quick), ("--tuned-out", args.tuned_out is not None),
                        ("--tune-m", args.tune_m != list(BUCKETS))):
        if given and not args.tune:
            return f"{flag} goes with --tune (without it nothing is tuned): add --tune, or drop {flag}"
    if args.pdl_prefetch and not args.pdl:
        return "--pdl-prefetch times the kernels launched with --pdl: add --pdl, or drop --pdl-prefetch"
    if args.lora and args.attention:
        return "--lora and --attention time different kernels: give one"
    if args.lora or args.attention:
        ignored = [f for f, given in (("--tune", args.tune), ("--m", args.m != list(MS)), ("--pdl", args.pdl))
                   if given]
        if ignored:
            return (f"{'--lora' if args.lora else '--attention'} times its kernels at its own sizes (--out and "
                    f"--models alone): drop {ignored[0]}")
    return out_problem(args.out) or (out_problem(args.tuned_out, "--tuned-out") if args.tuned_out else None)


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = _flag_problem(args)
    if problem:
        print(f"python -m infer.bench.kernels: error: {problem}", file=sys.stderr)
        return 2
    if args.lora:
        from .lora_kernels import main as lora_main
        return lora_main(args.out, args.models)
    if args.attention:
        from .attention_kernels import main as attention_main
        return attention_main(args.out, args.models)
    if not torch.cuda.is_available():
        print("infer.bench.kernels needs a CUDA GPU (the Triton GPTQ kernel runs only there); none was found",
              file=sys.stderr)
        return 2
    import pandas as pd
    if args.tune:
        tune(args.models, args.tuned_out, args.tune_m, args.quick)
    tune_missing(args.models, args.m, torch.device("cuda", torch.cuda.current_device()))
    bandwidth = copy_bandwidth()
    with_pdl = False
    if args.pdl:
        from ..kernels import pdl
        problem = None if pdl.supported(torch.cuda.get_device_capability()) else "needs compute capability 9.0+"
        problem = problem or pdl.probe(torch.device("cuda", torch.cuda.current_device()))
        if problem:
            print(f"--pdl: programmatic dependent launch cannot be used here ({problem}); timed without it",
                  file=sys.stderr)
        with_pdl = problem is None
    rows = [r for model in args.models for name, (k, n) in SHAPES[model].items()
            for r in measure_shape(model, name, k, n, args.m, bandwidth, with_pdl=with_pdl,
                                   pdl_prefetch=args.pdl_prefetch if with_pdl else ())]
    device = torch.cuda.get_device_name()
    for r in rows:
        r.update(device=device, copy_GBps=bandwidth / 1e9)
    print_table(rows, f"GPTQ int4 g128 matmul on {device} (copy bandwidth {bandwidth / 1e12:.2f} TB/s), "
                      f"microseconds under CUDA graphs, L2 defeated")
    gated = [r for r in rows if "silu_gain" in r]
    if gated:
        print_table(gated, "gate_up with the MLP's activation in the epilogue (fused) vs launched after (apart): "
                           "gain = apart / fused", GATED_COLS)
    ungated = [r for r in rows if "relu2_gain" in r]
    if ungated:
        print_table(ungated, "the same shape as an MLP without gate's up projection, its activation in the epilogue "
                             "(fused) vs launched after (apart; torch: torch's ops after): gain = apart / fused",
                    UNGATED_COLS)
    pd.DataFrame(rows).to_csv(args.out, index=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
