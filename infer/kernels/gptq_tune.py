"""Tune the GPTQ matmul per (M bucket, N, K) on this GPU and remember the winners (gptq_configs' cache file).

Every candidate is timed the way the engine runs it: launched from a CUDA graph, on weights that do not sit in
the L2 cache (the graph cycles through enough copies of the layer to exceed it), after a check that it computes
the same y as the dequantize + cuBLAS path; each bucket's winner is then timed again with the split-K counts that
fill whole waves of programs (`wave_splits`). Called when an engine starts on a GPU (`tune_model`), so no user
request ever waits for tuning, and by `python -m infer.bench.kernels --tune`.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from . import gptq_configs, gptq_gemm
from .intmath import cdiv

BUCKETS = tuple(1 << i for i in range(13))  # 1 .. 4096
TRITON = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2])  # what `_no_spill` was checked with
L2_BUST_BYTES = 160 << 20


def _field(kernel: str, bm: int, bn: int, w: int, split: int, stages: int = 3, scale_w: bool = True,
           pairs: bool = False) -> dict:
    """A field-by-field tensor-core configuration (see gptq_kernels.mma_kernel; pairs: two 4-bit fields per
    dot, `_dot_pairs`)."""
    cfg = dict(kernel=kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SPLIT_K=split, num_warps=w, num_stages=stages,
               FIELD=True, SCALE_W=scale_w, **({"PAIRS": True} if pairs else {}))
    return dict(cfg, GROUP_M=1) if kernel == "mma" else cfg


def _no_spill(cfg: dict) -> bool:
    """False for the configurations whose compiled kernel keeps registers in local memory (a stack) for sm_90
    (`scripts/kernel-sass --audit --full`, Triton 3.6: 10 of the 379 kernels of the full set, none of the quick
    set's; the audit now fails only a kernel that touches it in its main loop): two-fields-per-dot
    16 x 256 with 3+ stages and 32 x 128 with 4 warps without the folded scale; the reshaped (not field) mma 16 x
    128 with BLOCK_K 128; the transposed reshaped mma on 128 rows; the gemv of 2 rows with 64 columns and BLOCK_K
    32."""
    bm, bn, bk = cfg.get("BLOCK_M", 1), cfg["BLOCK_N"], cfg["BLOCK_K"]
    if cfg["kernel"] == "gemv":
        return not (bm == 2 and bn == 64 and bk == 32)
    if cfg["kernel"] == "mmat" and (bm, bn, cfg["num_warps"]) == (64, 256, 4):  # 255 registers: with Triton 3.6
        return cfg["SPLIT_K"] > 1 and TRITON == (3, 6)  # only the unsplit one spills (8 B); with 3.9 both (5 loads)
    if not cfg.get("FIELD"):
        return not ((cfg["kernel"] == "mma" and bm == 16 and bn == 128 and bk == 128)
                    or (cfg["kernel"] == "mmat" and bm == 128))
    if not cfg.get("PAIRS"):
        return True
    w, st = cfg["num_warps"], cfg["num_stages"]
    return not ((bm == 16 and bn == 256 and st >= 3) or (bm == 32 and w == 4 and not cfg["SCALE_W"]))


def _inplace(bn: int, w: int, split: int, stages: int) -> dict:
    """The M = 1 CUDA-core kernel with its fields OR-ed into the mantissa where they lie (gptq_gemv, INPLACE):
    about 5 instructions per weight with 128 weights per thread, where the shifted fields take 6.4-7.2."""
    return dict(kernel="gemv", BLOCK_N=bn, BLOCK_K=128, SPLIT_K=split, num_warps=w, num_stages=stages, INPLACE=True)


def _rows_tile(m: int) -> int:
    """BLOCK_M of the field kernels for 17-256 rows: one tile up to 128 rows (each weight read once)."""
    return 32 if m <= 32 else (64 if m <= 64 else 128)


def _wide_rows(m: int, splits) -> list[dict]:
    """Transposed field tiles of 128 weight columns and 128 rows (4 warps: the weight stays wgmma's register
    operand) or, from 129 rows, 256 rows (8 warps), the group scale folded into the weights. Each dequantized
    weight then serves 128-256 rows, so the tensor cores, not the unpacking, bound the K step on sm_90 (502 and 402
    instructions per warp and K step against 1024 and 2048 tensor-core cycles, `scripts/kernel-sass`)."""
    out = [_field("mmat", 128, 128, 4, s, st) for s in splits for st in (2, 3)]
    if m > 128:
        out += [_field("mmat", 256, 128, 8, s, 2) for s in splits]
    return out


def _wide_cols(bm: int, splits) -> list[dict]:
    """Transposed field tiles of `bm` rows (32 or 64) over 256 weight columns on one warpgroup (4 warps), the group
    scale folded: each tile of x a program reads from L2 serves 256 columns instead of 128. At 64 rows with 128
    columns that re-reading is twice the int4 weight's bytes (7B qkv: 50 MB of L2 reads beside 25 MB of DRAM), and
    every field dot waits for its wgmma (Triton keeps a register operand made in the loop synchronous), so only
    other programs hide the tensor cores' latency. 255 registers for sm_90 with Triton 3.6, nothing spilled, two
    programs per SM (the 8-warp 256-column tile: one); 2 stages (3 spill). The 64-row tile is left out where it
    spills in its loop (`_no_spill`: without split-K, or with a Triton other than 3.6's generation)."""
    return [_field("mmat", bm, 256, 4, s, 2) for s in splits]


def _sync(bm: int, splits, wide: bool = True) -> list[dict]:
    """Transposed field tiles of `bm` rows whose field dots run as warp-synchronous mma.sync (SYNC_MMA, see
    gptq_kernels._dot_fields), one slice of 32 weight columns per warp: 128 columns on 4 warps (3 stages), and with
    `wide` 256 columns on 8 warps (2 stages). Every wgmma a field tile issues waits for itself (Triton keeps a
    register operand made in the loop synchronous), so within a warp only the next field's unpacking hides the
    tensor cores' latency; an mma.sync stalls only the instruction that reads its result, and a K step's 128
    (64 rows) or 64 (32 rows) of them per warp are independent but for their accumulators. For sm_90 with Triton
    3.6, the 4-warp tiles' words read in the dot's slices (`gptq_kernels.slice_cols`): 517 instructions per K step
    at 64 x 128 (433 with wgmma), 168 registers, 3 programs per SM (Triton 3.9: 524 and 169, 2), nothing spilled;
    32 x 128: 440, 127 registers, 4 per SM (3.9: 168, 3); 64 x 256 on 8 warps: 530, 254 registers, 1 per SM."""
    out = [dict(_field("mmat", bm, 128, 4, s), SYNC_MMA=True) for s in splits]
    if wide:
        out += [dict(_field("mmat", bm, 256, 8, s, 2), SYNC_MMA=True) for s in splits]
    return out


def chunked(k: int, mbs=(8, 16, 32)) -> list[dict]:
    """`dequant` a block of columns at a time, each block's fp16 weight (about `mb` MB) small enough to stay in L2
    between the dequantize kernel and cuBLAS (gptq_gemm._dequant_chunks); for 32 rows and more."""
    out = []
    for mb in mbs:
        cols = max(128, (mb << 20) // (2 * k) // 128 * 128)
        if not any(c["CHUNK_N"] == cols for c in out):
            out.append(dict(kernel="dequant", CHUNK_N=cols))
    return out


def quick_candidates(m: int, step: int, k: int | None = None) -> list[dict]:
    """The regions that won on an H100 or that the compiled code favours (engine start; INFER_TUNE=full for all):
    a dozen or two configurations per M bucket instead of ~70-150."""
    out: list[dict] = [dict(kernel="dequant")] + (chunked(k) if k and m >= 32 else [])
    if m == 1:  # CUDA cores, or tensor cores on a tile padded to 16 rows (fewer instructions per weight)
        out += [dict(kernel="gemv", BLOCK_N=bn, BLOCK_K=128, SPLIT_K=s, num_warps=4, num_stages=st)
                for bn in (64, 128) for st in (1, 2) for s in (4, 8, 16)]
        out += [_inplace(bn, w, s, st) for bn, w in ((64, 4), (128, 4), (128, 8)) for st in (1, 2) for s in (4, 8, 16)]
        out += [_field("mma", 16, bn, w, s, 3, False, p) for bn, w in ((128, 4), (256, 8)) for s in (4, 8, 16)
                for p in (False, True)]
    elif m <= 16:
        out += [_field("mma", 16, bn, w, s, st, False, p) for bn, w in ((128, 4), (256, 8)) for st in (2, 3)
                for s in (2, 4, 8, 16) for p in (False, True)]
    if m <= 16:  # the weight as wgmma's register operand (no shared-memory round trip), one or two fields per dot
        out += [_field("mmat", 16, 128, 4, s, 3, False, p) for s in (2, 4, 8, 16) for p in (False, True)]
        if m > 1:  # and the same tile on mma.sync (no dot waits for the tensor cores)
            out += _sync(16, (2, 4, 8, 16), wide=False)
    elif m <= 256:
        bm = _rows_tile(m)
        tiles = ((128, 4), (256, 8)) if bm == 32 else (((128, 4), (128, 8)) if bm == 64 else ((128, 8),))
        out += [_field("mma", bm, bn, w, s, 3, True, p) for bn, w in tiles for s in (1, 2, 4) for p in (False, True)]
        out += [_field("mmat", min(m, 64), bn, 8, s) for bn in (128, 256) for s in (1, 2, 4)]
        if m <= 32:  # the transposed tile with two fields per dot: 511 instructions per step, 577 for `mma`'s
            out += [_field("mmat", 32, 128, 4, s, 3, True, True) for s in (1, 2, 4)]
        if m <= 64:  # the M = 16 winner's tile, 2-4 of them per column block, adjacent (GROUP_M): weights from L2
            out += [dict(_field("mma", 16, 128, 4, s, 3, False, p), GROUP_M=4) for s in (2, 4, 8)
                    for p in (False, True)]
            # and the full set's 33-64-row winner on an H100, the transposed 4-warp tile of all the rows (2026-11-27,
            # 7B at 64 rows: 0.81-0.86x the time of the quick set's best without it)
            out += [_field("mmat", bm, 128, 4, s) for s in (1, 2, 4, 8)]
            out += _wide_cols(bm, (1, 2, 4)) + _sync(bm, (1, 2, 4))
        else:  # the H100's 65-256-row winner (full set), and the tiles with more rows per dequantized weight
            out += [_field("mmat", 64, 128, 4, s) for s in (1, 2, 4)] + _wide_rows(m, (1, 2))
    if m > 256:  # prefill: fused tiles with the most rows per weight, beside dequantize + cuBLAS
        out += [dict(c, GROUP_M=8) for c in _wide_rows(m, (1,))]
    return [c for c in out if c["kernel"] == "dequant" or (c["BLOCK_K"] <= step and _no_spill(c))]


def wave_splits(cfg: dict, m: int, n: int, k: int, sms: int) -> list[dict]:
    """The winner of a bucket with other split-K counts, any integer rather than the candidate lists' powers of
    two: for 1-4 programs per SM, the largest split whose programs (row tiles x column tiles x split) fill that
    many whole waves of `sms` without a part-empty last one, each program keeping at least two K steps. The
    split is given as the launcher will run it (its K range rounded up to whole K steps)."""
    split = cfg.get("SPLIT_K", 1)
    if cfg.get("kernel") not in ("gemv", "mma", "mmat") or split < 2:
        return []
    bk = cfg["BLOCK_K"]

    def effective(s: int) -> int:
        return cdiv(k, cdiv(cdiv(k, s), bk) * bk)
    one_row = cfg["kernel"] == "gemv" and cfg.get("BLOCK_M", 1) == 1
    tiles = (m if one_row else cdiv(m, cfg.get("BLOCK_M", 1))) * cdiv(n, cfg["BLOCK_N"])
    seen, out = {effective(split)}, []
    for waves in (1, 2, 3, 4):
        s = effective(max(1, min(waves * sms // tiles, cdiv(k, bk) // 2)))
        if s >= 2 and s not in seen:
            seen.add(s)
            out.append(dict(cfg, SPLIT_K=s))
    return out


def candidates(m: int, step: int, quick: bool = False, k: int | None = None) -> list[dict]:
    """The configurations worth timing for M rows (step: the largest BLOCK_K the grouping allows; k: the layer's
    input width, for the column blocks of the chunked `dequant`)."""
    if quick:
        return quick_candidates(m, step, k)
    out: list[dict] = chunked(k, (4, 8, 16, 32)) if k and m >= 32 else []
    splits = (2, 4, 8, 16)
    if m == 1:
        out += [dict(kernel="gemv", BLOCK_N=bn, BLOCK_K=128, SPLIT_K=s, num_warps=4, num_stages=st, FIELD=f)
                for bn in (64, 128) for st in (1, 2) for s in splits for f in (False, True)]
        out += [_inplace(bn, w, s, st) for bn, w in ((64, 4), (128, 4), (128, 8), (256, 8)) for st in (1, 2, 3)
                for s in splits]
    if 2 <= m <= 16:
        out += [dict(kernel="gemv", BLOCK_M=min(m, 8), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=4, num_stages=2)
                for bn in (32, 64) for bk in (32, 64) for s in (2, 4, 8)]
    if m <= 16:
        out += [dict(kernel="mma", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, GROUP_M=1, num_warps=4,
                     num_stages=st) for bn in (64, 128) for bk in (64, 128) for st in (2, 3) for s in splits]
        out += [_field("mma", 16, bn, w, s, st, False, p) for bn, w in ((64, 4), (128, 4), (256, 8))
                for st in (2, 3, 4) for s in splits for p in (False, True)]
        out += [dict(kernel="mmat", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=w, num_stages=3)
                for bn, w in ((64, 4), (128, 4), (128, 8)) for bk in (64, 128) for s in (1,) + splits]
        out += [_field("mmat", 16, bn, w, s, st, sw, p) for bn, w in ((128, 4), (256, 8)) for st in (2, 3)
                for sw in (False, True) for s in splits for p in (False, True)]
        out += _sync(16, splits, wide=False)
    if 17 <= m <= 64:  # 16-row tiles, GROUP_M of them walking the same column block (weights read once from DRAM)
        out += [dict(_field("mma", 16, bn, w, s, st, False, p), GROUP_M=4) for bn, w in ((128, 4), (256, 8))
                for st in (2, 3) for s in (2, 4, 8) for p in (False, True)]
    if 17 <= m <= 256:  # one dot per packed field; the weight as the B (mma) or the register A (mmat) operand
        for bm in sorted({_rows_tile(m), min(2 * _rows_tile(m), 128), max(_rows_tile(m) // 2, 32)}):
            tiles = [(128, 4), (128, 8)] + ([(256, 8)] if bm == 32 else [])
            out += [_field("mma", bm, bn, w, s, 3, sw, p) for bn, w in tiles for sw in (False, True)
                    for s in (1, 2, 4, 8) for p in (False, True) if not (bm == 128 and w == 4)]
        out += [_field("mmat", min(m, 64), bn, w, s, 3, sw, p) for bn, w in ((128, 4), (128, 8), (256, 8))
                for sw in (False, True) for s in (1, 2, 4, 8) for p in (False, True)]
    if 17 <= m <= 64:
        out += _wide_cols(_rows_tile(m), (1, 2, 4, 8)) + _sync(_rows_tile(m), (1, 2, 4, 8))
    if 65 <= m <= 256:  # (mma.sync on 128 rows: 8 warps of 16 columns each, 237 registers)
        out += _wide_rows(m, (1, 2, 4)) + [dict(_field("mmat", 128, 128, 8, s), SYNC_MMA=True) for s in (1, 2, 4)]
    if m > 256:
        out += [dict(c, GROUP_M=8) for c in _wide_rows(m, (1,))]
    if m >= 128:
        out += [dict(kernel="mmat", BLOCK_M=bm, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=8, num_stages=3)
                for bm in (64, 128)]
        out += [dict(kernel="mma", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, GROUP_M=8, num_warps=8,
                     num_stages=3)]
    if m >= 512:
        out += [dict(_field("mma", 128, bn, 8, 1, st), GROUP_M=8) for bn in (128, 256) for st in (3, 4)]
    out.append(dict(kernel="dequant"))
    return [c for c in out if c["kernel"] == "dequant" or (c["BLOCK_K"] <= step and _no_spill(c))]


def compile_parallel(calls, workers: int | None = None) -> int:
    """Run `gptq_gemm.gptq_matmul(..., compile_only=True)` calls (no-argument callables) with their compiles
    queued on a thread pool (Triton's AsyncCompileMode: arguments are bound on this thread, the compiler passes and
    ptxas run on the pool and release the GIL), so the kernels are in Triton's cache before anything is timed or
    launched: a tuning pass or an engine start pays for ~100-200 compiles about once per core instead of one after
    the other. Each compiled kernel is then loaded as its first launch would load it (`_load`), so that no launch
    on a user's request builds Triton's launcher. A kernel that does not compile is left to fail where it is
    launched. Returns the calls queued (0 where this Triton has no AsyncCompileMode or one is already active: each
    kernel then compiles at its first launch, as before)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:
        return 0
    if active_mode.get() is not None:  # inside someone else's async compile (Triton allows one): compile at launch
        return 0
    queued = 0
    with ThreadPoolExecutor(workers or max(1, min(32, os.cpu_count() or 1))) as pool, \
            AsyncCompileMode(pool, ignore_errors=True) as mode:
        for call in calls:
            try:
                call()
            except Exception:  # noqa: BLE001 - its launch will raise (and the tuner skips it)
                continue
            queued += 1
        pending = list(getattr(mode, "future_kernels", {}).values())  # (the mode forgets them once it waited)
    _load(getattr(f, "kernel", None) for f in pending)
    return queued


def _load(kernels) -> int:
    """Do now what a compiled Triton kernel's first launch does (`CompiledKernel._init_handles`): load its binary
    onto the GPU and get its launcher, which Triton builds from C source with the host's compiler for each new
    signature (about 0.2 s each, cached on disk by Triton afterwards). Without this, compiled variants that only
    user requests reach (a prefill of a new M bucket, say) built theirs on that request: a 7B engine's first
    prefill of 16 cached prompts took 429 ms instead of 24 on a fresh H100 machine. Returns the kernels loaded;
    one that does not load is left to fail where it is launched."""
    done = 0
    for kernel in kernels:
        init = getattr(kernel, "_init_handles", None)  # None: a compile that failed (or no such Triton)
        if init is None:
            continue
        try:
            init()
        except Exception:  # noqa: BLE001 - its launch will raise
            continue
        done += 1
    return done


def time_graph(fns, reps: int = 3) -> float:
    """Microseconds per call: the callables (one per weight copy) are captured in turn into one CUDA graph, which
    is replayed `reps` times; the fastest replay counts."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    calls = max(len(fns), 12)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    del graph
    return best


def random_gptq(k: int, n: int, bits: int, group_size: int, device) -> tuple:
    """Valid GPTQ tensors (v1 zeros) of any content: random packed weights, every stored zero 7 (zero point 8)
    so the products stay well scaled, small positive scales, a plain g_idx."""
    pack, groups = 32 // bits, 1 if group_size == -1 else k // group_size
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // pack, n), dtype=torch.int32, device=device)
    word = sum(7 << (i * bits) for i in range(pack))
    word -= (word >> 31) << 32  # as a signed int32
    qzeros = torch.full((groups, n // pack), word, dtype=torch.int32, device=device)
    scales = (torch.rand(groups, n, device=device) * 0.02 + 0.001).half()
    g_idx = (torch.arange(k, device=device) // (k if group_size == -1 else group_size)).int()
    return qweight, qzeros, scales, g_idx


def weight_copies(k: int, n: int, bits: int, group_size: int, device, make) -> list[tuple]:
    """Enough copies of a layer's GPTQ tensors that cycling through them defeats the L2 cache."""
    one = k * n * bits // 8
    return [make(k, n, bits, group_size, device) for _ in range(max(2, -(-L2_BUST_BYTES // one)))]


def shipped_winners(n: int, k: int, m: int, own: str | None) -> list[dict]:
    """The configs the tables shipped for other GPUs (every file in gptq_configs.SHIPPED but `own`'s) chose for
    (M's bucket, N, K), each once. A GPU without a table of its own times them beside its candidates, so that its
    first engine start does no worse than a sibling's full tune (an H200 with the H100's winners: on an H200 on
    2026-11-27 they were the configs measured); a config that cannot run there is skipped like any candidate."""
    out: list[dict] = []
    for path in sorted(gptq_configs.SHIPPED.glob("*.json")):
        if path.stem != own:
            cfg = gptq_configs._read(path).get(f"{n},{k}", {}).get(str(gptq_configs.bucket(m)))
            if cfg and cfg not in out:
                out.append(dict(cfg))
    return out


def tune_shape(n: int, k: int, buckets, bits: int = 4, group_size: int = 128, device=None, dtype=torch.float16,
               log=None, quick: bool = False) -> dict:
    """{bucket: (best config, microseconds)} for one (N, K), timed on random GPTQ tensors in the interleaved
    layout the linear method gives such a layer (random words: any layout is random words): the candidate list
    (`candidates`), then other GPUs' shipped winners (`shipped_winners`), then the best one's whole-wave splits."""
    device = torch.device(device or "cuda")
    copies = weight_copies(k, n, bits, group_size, device, random_gptq)
    step = gptq_configs.block_k_limit(group_size, k, 32 // bits)
    wp = gptq_configs.interleave_for(group_size, k, 32 // bits)
    xs = {m: torch.randn(m, k, device=device, dtype=dtype) for m in buckets}
    own = gptq_configs.gpu_name(device) if device.type == "cuda" else None
    cands = {m: candidates(m, step, quick, k) for m in buckets}
    for m in buckets:  # what other GPUs' shipped tables chose for this shape is timed here too
        cands[m] += [c for c in shipped_winners(n, k, m, own) if c not in cands[m]]
    every = [(m, c) for m in buckets for c in cands[m]]
    compile_parallel(lambda m=m, c=c: gptq_gemm.gptq_matmul(xs[m], *copies[0][:4], bits, True, group_size, wp,
                                                            config=c, compile_only=True) for m, c in every)
    result = {}
    for m in buckets:
        x = xs[m]
        want = gptq_gemm.gptq_matmul(x, *copies[0][:4], bits, True, group_size, wp, config={"kernel": "dequant"})
        scale = want.float().abs().max().clamp_min(1e-6)

        def timed(cfg: dict, x=x, want=want, scale=scale) -> float | None:
            """Microseconds of `cfg` on x, or None when it computes a wrong y or cannot run."""
            try:
                got = gptq_gemm.gptq_matmul(x, *copies[0][:4], bits, True, group_size, wp, config=cfg)
                if not bool(((got.float() - want.float()).abs().max() / scale) < 1e-2):
                    return None
                fns = [lambda t=t: gptq_gemm.gptq_matmul(x, *t[:4], bits, True, group_size, wp, config=cfg)
                       for t in copies]
                return time_graph(fns)
            except Exception as e:  # a config the compiler or the GPU cannot run (shared memory, registers)
                if log:
                    log(f"  skip {cfg}: {type(e).__name__}")
                return None
        best = (None, float("inf"))
        for cfg in cands[m]:
            us = timed(cfg)
            if us is not None and us < best[1]:
                best = (cfg, us)
        if best[0] is not None:  # then the winner with the splits that fill whole waves of programs
            for cfg in wave_splits(best[0], m, n, k, gptq_configs.num_sms(device)):
                us = timed(cfg)
                if us is not None and us < best[1]:
                    best = (cfg, us)
        result[m] = best
        if log:
            log(f"N={n} K={k} M={m}: {best[1]:.1f} us {best[0]}")
    return result


def layer_shapes(model) -> set[tuple[int, int, int, int]]:
    """(N, K, bits, group_size) of every GPTQ layer that runs through the fused kernels."""
    shapes = set()
    for mod in model.modules():
        if getattr(mod, "gptq_group_size", None) is not None and getattr(mod, "weight", None) is None \
                and hasattr(mod, "qweight"):
            k, n = mod.qweight.shape[0] * (32 // mod.method.config.bits), mod.qweight.shape[1]
            shapes.add((n, k, mod.method.config.bits, mod.gptq_group_size))
    return shapes


def tune_model(model, max_tokens: int, device, log=None, quick: bool | None = None) -> tuple[int, float]:
    """Tune every (M bucket up to max_tokens, N, K) of the model's GPTQ layers that no table holds yet; save the
    winners to the cache file. Returns (shapes tuned, seconds). At engine start the quick candidate set is timed
    (a dozen or two configurations per M bucket) unless INFER_TUNE=full asks for the whole space."""
    if quick is None:
        from .options import env_choice  # INFER_TUNE=ful (or Full) was a quick tuning, silently
        quick = env_choice("INFER_TUNE", ("quick", "full"), "a tuning of the int4 kernels") == "quick"
    t0 = time.perf_counter()
    buckets = [b for b in BUCKETS if b <= gptq_configs.bucket(max_tokens)]
    todo: dict = {}
    for n, k, bits, gs in layer_shapes(model):
        missing = [b for b in buckets if gptq_configs.tuned(b, n, k, device) is None]
        if missing:
            todo[(n, k, bits, gs)] = missing
    found = {}
    for (n, k, bits, gs), missing in sorted(todo.items()):
        res = tune_shape(n, k, missing, bits, gs, device, log=log, quick=quick)
        found[f"{n},{k}"] = {b: cfg for b, (cfg, _) in res.items() if cfg is not None}
    if found:
        gptq_configs.save(gptq_configs.gpu_name(device), found)
        torch.cuda.empty_cache()  # the tuning copies must not look like the engine's own memory
    return len(todo), time.perf_counter() - t0


def bucket_rows(max_tokens: int) -> list[int]:
    """Row counts that reach every kernel an engine can launch for up to max_tokens rows: the configuration is
    chosen per M bucket (b covers b/2 + 1 .. b rows), and Triton compiles M == 1, M divisible by 16 and any other M
    apart, so each bucket needs one row count of each kind it holds."""
    rows = set()
    for b in BUCKETS:
        lo, hi = b // 2 + 1, min(b, max_tokens)
        if lo > hi:
            break
        rows.update(r for r in (hi, hi - 1, hi // 16 * 16) if lo <= r)
    return sorted(rows)


def compile_model(model, max_tokens: int, dtype: torch.dtype, workers: int | None = None, extra=()) -> int:
    """Compile, in parallel (`compile_parallel`), the kernel every GPTQ layer of `model` will launch for each row
    count up to max_tokens (the tuned or heuristic choice), on the layers' own tensors: an engine start calls this
    after tuning, so graph capture and the first requests find every int4 matmul kernel compiled. A layer with a
    bias compiles its bias epilogue, an MLP's gate_up whose kernel applies silu_and_mul or Gemma's gelu_tanh_and_mul
    (`act_in_gate_up`) its gated one (of that activation), an MLP without gate's up whose kernel applies its
    activation (`act_in_up`: gelu_tanh, relu2, xIELU) that variant; a layer with a LoRA hook that adds its expand in
    the epilogue (`lora.epilogue`) compiles that variant too, besides the plain one (a step where no adapter
    targets the layer). Where some row count's choice is dequantize + cuBLAS, the dequantize kernels are compiled
    once for the layer shape (they do not depend on the rows). `extra`: more compile-only callables to run in the
    same pool (the LoRA kernels, `LoRAManager.compile_calls`). Returns the calls queued."""
    from .lora_reference import LoRADelta
    jobs, deq, seen = [], [], set()
    rows = bucket_rows(max_tokens)
    # gate|up layers whose kernel applies silu_and_mul or Gemma's gelu_tanh_and_mul (the MLP's act_in_gate_up):
    # their gated variants, by activation
    gated = {id(m.gate_up_proj): "gelu_tanh" if getattr(m, "act", "silu") == "gelu_tanh" else "silu"
             for m in model.modules() if getattr(m, "act_in_gate_up", False)}
    # up layers of MLPs without gate whose kernel applies the activation (act_in_up), by ("up", activation); the
    # scalars of xIELU (kernel arguments: no variant of their own), computed here before any graph capture
    scalars = {id(m.up): m.act_scalars() for m in model.modules() if getattr(m, "act_in_up", False)}
    gated.update({id(m.up): ("up", m.act) for m in model.modules() if getattr(m, "act_in_up", False)})
    for mod in model.modules():
        if getattr(mod, "gptq_group_size", None) is None or getattr(mod, "weight", None) is not None \
                or not hasattr(mod, "qweight"):
            continue
        cfg = mod.method.config
        k, n = mod.qweight.shape[0] * (32 // cfg.bits), mod.qweight.shape[1]
        hook = getattr(mod, "lora", None)
        # (lora, gated): an MLP's gate_up its gated variant, and the plain one unless it is gated and has no LoRA
        # hook (with a hook, steps with adapters take the plain or the LoRA variant); the LoRA epilogue's
        variants = ([(None, gated[id(mod)])] if id(mod) in gated else []) + ([(None, False)] if id(mod) not in gated
                                                                   or hook is not None else [])
        variants += [(hook, False)] if hook is not None and hook.epilogue is not False else []
        for lora, act in variants:
            lkey = None if lora is None else (lora.lora_a.shape[0], lora.max_rank, len(lora.bounds))
            key = (n, k, cfg.bits, cfg.zeros_v1, mod.gptq_group_size, mod.gptq_interleave, mod.bias is not None, lkey,
                   act)
            if key not in seen:
                seen.add(key)
                fused = [r for r in rows if gptq_gemm._choice(r, n, k, cfg.bits, mod.gptq_group_size,
                                                              mod.gptq_interleave, None, mod.qweight.device)[2]]
                jobs += [(mod, cfg, r, k, lora, act) for r in fused]
                dequant = [r for r in rows if r not in fused]
                # the dequantize kernels (a gated layer's too: silu_and_mul runs after), at the fewest rows that take
                # them, once per layer shape
                if dequant and lora is None and not (act and (None, False) in variants):
                    deq.append((mod, cfg, dequant[0], k))
    if not jobs and not deq:
        return compile_parallel(list(extra), workers) if extra else 0
    device = (jobs or deq)[0][0].qweight.device
    buf = torch.empty(max((r * k for _, _, r, k, _, _ in jobs), default=1), device=device, dtype=dtype)  # x, in turn
    top = max((r for *_, r, _, _, _ in jobs), default=1)
    widest = max((lora.lora_a.shape[1] for *_, lora, _ in jobs if lora is not None), default=0)
    hp = torch.empty(1, top, widest, device=device, dtype=torch.float32)  # a LoRADelta's partials, by token
    slots = torch.full((top,), -1, device=device, dtype=torch.long)

    def delta(lora, r: int):  # stand-in tensors of the launch's dtypes (the specialization ignores their sizes)
        if lora is None:
            return None
        part = hp[:, :r, :lora.lora_a.shape[1]].contiguous() if widest != lora.lora_a.shape[1] else hp[:, :r]
        return LoRADelta(part, lora.lora_bt, slots[:r], lora.scalings, lora.rank_t, lora.bounds, None, lora.epilogue)

    calls = [lambda mod=mod, cfg=cfg, r=r, k=k, lora=lora, act=act: gptq_gemm.gptq_matmul(
        buf[:r * k].view(r, k), mod.qweight, mod.qzeros, mod.scales, mod.g_idx, cfg.bits, cfg.zeros_v1,
        mod.gptq_group_size, mod.gptq_interleave, compile_only=True, bias=mod.bias, lora=delta(lora, r),
        gated=act if not isinstance(act, tuple) else False, act=act[1] if isinstance(act, tuple) else None,
        act_scalars=scalars.get(id(mod))) for mod, cfg, r, k, lora, act in jobs]
    calls += [lambda mod=mod, cfg=cfg, r=r, k=k: gptq_gemm.gptq_matmul(
        torch.empty(r, k, device=device, dtype=dtype), mod.qweight, mod.qzeros, mod.scales, mod.g_idx, cfg.bits,
        cfg.zeros_v1, mod.gptq_group_size, mod.gptq_interleave, compile_only=True) for mod, cfg, r, k in deq]
    # the activation launched after up where a step takes that way (adapters, dequantize + cuBLAS rows): relu2's
    # and xIELU's Triton kernel (fused.ungated_act; gelu_tanh's is torch's), once per activation
    from . import fused
    acts = sorted({m.act for m in model.modules() if getattr(m, "act_in_up", False)} - {"gelu_tanh"})
    calls += [lambda a=a: fused.ungated_act(buf[:16], a, (0.0,) * 4, compile_only=True) for a in acts]
    return compile_parallel(calls + list(extra), workers)
