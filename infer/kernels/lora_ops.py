"""Triton multi-LoRA for a batch whose tokens use different adapters: one shrink and one expand launch per layer.

Layout (kept by infer.lora.layer.LoRALayer, semantics in `lora_reference.lora_apply`): lora_a [S, n*R, K] (shard
i's A in rows i*R..), lora_b flat [S*R*N] (shard after shard, each shard's B^T [S, R, out_i] contiguous), scalings
[n, S] float32, ranks [n, S] int32 (rows r >= ranks[i, s] of shard i are zero padding: the kernels never read them).

Work is cut into tiles of up to BLOCK_M tokens of one adapter (segmented by slot, as Punica's SGMV): the tokens are
sorted by slot (`groups.order`; of the `lora_reference.SlotGroups` contract only order and starts are read here)
and slot s owns sorted positions starts[s+1]..starts[s+2]. Every program finds its (slot, rows) from `starts`
itself, by a prefix sum over the S slots' tile counts, so the grid has a static size, T // BLOCK_M + min(S, T)
tiles, whatever the mix of adapters (a CUDA graph replays it with any token->slot map, and nothing is decided on
the host). A decode step where every token has its own adapter is a grid of one-token tiles
(BGMV); tokens that share an adapter share one read of its weights.

shrink: grid (tiles, SPLIT_K). Program (p, k) multiplies its rows of x by the slot's stacked A (every shard at once)
  over one SPLIT_K-th of K and stores the float32 partial sums at hp[k, sorted position, :]. No atomics and no
  zeroing: the expand adds the SPLIT_K partials as it reads them. SPLIT_K spreads the long K over more SMs at
  decode sizes (the output is a few dozen columns), bounded because every expand program reads all the partials.
expand: grid (tiles, BLOCK_N-wide column tiles of every shard). Program (p, j) sums its rows' partials of its shard,
  multiplies them by the slot's B over its columns, scales, and adds the result into y in place.
Both kernels' PDL constexpr: launched with programmatic dependent launch (`pdl`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .intmath import LORA_K_PER_SPLIT, LORA_MAX_SPLIT, cdiv, next_power_of_2
from .lora_reference import LoRADelta, SlotGroups
from .options import env_choice

MAX_SHARDS = 4  # shards one expand launch covers (a merged qkv has 3)
# Launch constants, measured on an H100 at 7B shapes, rank 16, 16 tokens x 16 adapters, under CUDA graphs (us):
# SPLIT_K 4 / 8 / 16, shrink + best expand: qkv 11.2 / 10.7 / 11.4, gate_up 12.3 / 12.7 / 14.1, down (K = 11008)
# 11.5 / 9.9 / 9.0: more splits feed more SMs in the shrink but make every expand program read more partials, so a
# shrink program takes about K_PER_PROGRAM of K. Expand columns per program 256 / 512 / 1024 (4 warps, split 4):
# qkv 5.8 / 5.5 / 6.0, gate_up 8.0 / 7.8 / 8.7 (128 was 12.4 and 20.3 at split 16).
TARGET_PROGRAMS = 256  # shrink programs to aim for at most: about two per SM of an H100 (132 SMs)
MAX_SPLIT = LORA_MAX_SPLIT  # (intmath: the memory plan sizes the partials by them)
K_PER_PROGRAM = LORA_K_PER_SPLIT  # split K no finer than this
BLOCK_N = 512  # expand: output columns per program, 16-token tiles (decode)
BLOCK_N_BIG_M = 128  # the same for 64-token tiles (prefill): the accumulator stays at 8K floats
EXPAND_WARPS = 4
# The expand's load order (`_expand_kernel`'s EARLY): None: INFER_LORA_EXPAND_LOADS, "late" (the default) or "early".
# Early (the default of 2026-11-27's twenty-sixth to thirty-first sessions) requests everything before shared memory;
# on an H200 (2026-11-27, `python -m infer.bench.kernels --lora`, weights from device memory) the late order was
# faster by token in every 16- and 64-token row with 16 adapters: 7B qkv 9.6 -> 8.2 us, gate_up 14.9 -> 13.4, 14B qkv
# 16.1 -> 11.3, gate_up 24.1 -> 18.5; on the H100 every expand averaged 7.4 us in the step before the early order
# and 9.2 after.
expand_loads: str | None = None
# How an expand of at most GATHER_MAX_TOKENS tokens whose partials are stored by token finds each token's adapter
# (`expand_gather`): None: INFER_LORA_EXPAND, "auto" (the default: gathers up to GATHER_AUTO_TOKENS tokens, tiles of
# one slot's tokens above), "segments" (always tiles of one slot's tokens, `_expand_kernel`) or "gather" (every
# program takes up to 16 tokens of any slots and gathers each one's B, up to GATHER_MAX_TOKENS tokens:
# `_expand_gather_kernel`). On an H200 (2026-12-04, 7B int4, 16 mixed rank-16 adapters, decode CUDA graphs) the
# gathers gave 1.050x the throughput of the segments at 16 concurrent, 1.018x at 32 and 0.972x at 64.
expand_by: str | None = None
GATHER_MAX_TOKENS = 64
GATHER_AUTO_TOKENS = 32
GATHER_ELEMENTS = 8192  # B elements a gather program holds at once (tokens x rank x columns): 128 a thread
# Warps of a gather program. sm_90 code (Triton 3.6, 16 tokens x 32 columns, rank 16, split 4): 4 warps 736
# instructions a warp (2,944 a program), 9 barriers (the rank's sum crosses warps); 2 warps 960 (1,920), 4 barriers;
# 1 warp 1,352, none, 175 registers. Untimed: the LoRA bench sweeps 1, 2 and 4 (`gather_w{N}_us`).
GATHER_WARPS = 2


def gather_limit() -> int:
    """The most tokens an expand by token takes as a gather (0: none): by `expand_by`, else INFER_LORA_EXPAND, else
    "auto" (ConfigError for another value)."""
    global expand_by
    if expand_by is None:
        expand_by = env_choice("INFER_LORA_EXPAND", ("auto", "segments", "gather"), "a way of the LoRA expand")
    return {"auto": GATHER_AUTO_TOKENS, "gather": GATHER_MAX_TOKENS}.get(expand_by, 0)


def gathers(t: int) -> bool:
    """Whether an expand of t tokens by token is the gather kernel's (`gather_limit`): a function of the token count
    only, as a CUDA graph needs."""
    return t <= gather_limit()


def early_loads() -> bool:
    """Whether the expand requests y's tile, the scale and B's tile before shared memory (`expand_loads`, else the
    environment's INFER_LORA_EXPAND_LOADS, else "late": False); ConfigError for another value."""
    global expand_loads
    if expand_loads is None:
        expand_loads = env_choice("INFER_LORA_EXPAND_LOADS", ("late", "early"), "an order of the LoRA expand's loads")
    return expand_loads == "early"


@triton.jit
def _tile(starts_ptr, pid, S, BLOCK_M: tl.constexpr, S_P2: tl.constexpr):
    """(slot, first sorted position, end of the slot's segment) of tile `pid`; past the last tile, an empty range
    (and slot S - 1, so that addresses computed from it stay inside the tensors)."""
    offs = tl.arange(0, S_P2)
    valid = offs < S
    begin = tl.load(starts_ptr + 1 + offs, mask=valid, other=0)
    end = tl.load(starts_ptr + 2 + offs, mask=valid, other=0)
    tiles = (end - begin + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # tiles of slots 0..s
    slot = tl.sum((last <= pid).to(tl.int32), 0)
    pick = offs == slot
    first_tile = tl.sum(tl.where(pick, last - tiles, 0), 0)
    row0 = tl.sum(tl.where(pick, begin, 0), 0) + (pid - first_tile) * BLOCK_M
    return tl.minimum(slot, S - 1), row0, tl.sum(tl.where(pick, end, 0), 0)


@triton.jit(do_not_specialize=["sh_p"])  # (T * n*R: its divisibility by 16 follows T's parity at small ranks)
def _shrink_kernel(x_ptr, a_ptr, hp_ptr, order_ptr, starts_ptr, rank_ptr, S, K, NR, R, k_per_split,
                   sx_t, sx_k, sa_s, sa_j, sa_k, sh_p, sh_t, sr_i, sr_s,
                   BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, S_P2: tl.constexpr,
                   IEEE: tl.constexpr, BY_TOKEN: tl.constexpr = False, PDL: tl.constexpr = False,
                   EVEN_K: tl.constexpr = False):
    """EVEN_K: every K step lies whole in its split (K a multiple of BLOCK_K; k_per_split is one): no masks along
    K, whose compares and selects are a third of the loop's instructions on sm_90."""
    pdl.start(PDL)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    slot, row0, seg_end = _tile(starts_ptr, pid, S, BLOCK_M, S_P2)
    offs_j = tl.arange(0, BLOCK_J)
    rank = tl.load(rank_ptr + (offs_j // R) * sr_i + slot * sr_s, mask=offs_j < NR, other=0)
    mask_j = (offs_j % R) < rank  # false past NR too (rank 0 there)
    rows = row0 + tl.arange(0, BLOCK_M)
    mask_m = rows < seg_end
    tok = tl.load(order_ptr + rows, mask=mask_m, other=0)  # beside the ranks' load, not after it (one round trip)
    if (row0 < seg_end) & (tl.max(rank, 0) > 0):
        a_base = a_ptr + slot.to(tl.int64) * sa_s
        acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = (offs_k < k_hi) | EVEN_K
            xa = tl.load(x_ptr + tok[:, None] * sx_t + offs_k[None, :] * sx_k,
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            aa = tl.load(a_base + offs_j[None, :] * sa_j + offs_k[:, None] * sa_k,
                         mask=mask_j[None, :] & mask_k[:, None], other=0.0).to(xa.dtype)
            if IEEE:  # float32 operands: exact for bf16 ones (the interpreter's bf16 tl.dot is wrong: `shrink`)
                acc += tl.dot(xa.to(tl.float32), aa.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xa, aa)
        at = tok if BY_TOKEN else rows  # by token: for the int4 matmul's epilogue (LoRADelta)
        tl.store(hp_ptr + pid_k * sh_p + at[:, None] * sh_t + offs_j[None, :], acc,
                 mask=mask_m[:, None] & (offs_j < NR)[None, :])


@triton.jit
def _pick(i, v0, v1, v2, v3):
    return tl.where(i == 0, v0, tl.where(i == 1, v1, tl.where(i == 2, v2, v3)))


@triton.jit(do_not_specialize=["sh_p"])
def _expand_kernel(hp_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, rank_ptr, scal_ptr, S, R, shard0,
                   t1, t2, t3, c0, c1, c2, c3, c4,
                   sh_p, sh_t, sy_t, sy_n, sr_i, sr_s, sc_i, sc_s,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
                   S_P2: tl.constexpr, IEEE: tl.constexpr, BY_TOKEN: tl.constexpr = False, PDL: tl.constexpr = False,
                   EARLY: tl.constexpr = True):
    """EARLY: y's tile, the scale and B's tile are requested beside the partials, before anything goes through shared
    memory (three waits for memory); False (the default; `early_loads`): the partials' sum before B is requested, the
    scale and y's tile after the dot (five waits, fewer values held at once: faster on an H200, see expand_loads)."""
    pdl.start(PDL)
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    local = (pid_n >= t1).to(tl.int32) + (pid_n >= t2).to(tl.int32) + (pid_n >= t3).to(tl.int32)
    shard = shard0 + local
    slot, row0, seg_end = _tile(starts_ptr, pid, S, BLOCK_M, S_P2)
    rank = tl.load(rank_ptr + shard * sr_i + slot * sr_s)
    if EARLY:
        scale = tl.load(scal_ptr + shard * sc_i + slot * sc_s)  # beside the rank's
    rows = row0 + tl.arange(0, BLOCK_M)
    mask_m = rows < seg_end
    tok = tl.load(order_ptr + rows, mask=mask_m, other=0)  # beside the rank's load, not after it (one round trip)
    lo, hi = _pick(local, c0, c1, c2, c3), _pick(local, c1, c2, c3, c4)  # the shard's columns
    cols = lo + (pid_n - _pick(local, 0, t1, t2, t3)) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < hi
    mask = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + tok[:, None] * sy_t + cols[None, :] * sy_n
    if EARLY:
        y = tl.load(y_ptrs, mask=mask, other=0.0)  # y's tile needs only the tokens: read beside the partials and B
    if (row0 < seg_end) & (rank > 0):
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_p = tl.arange(0, SPLIT)
        at = tok if BY_TOKEN else rows
        parts = tl.load(hp_ptr + offs_p[:, None, None] * sh_p + at[None, :, None] * sh_t
                        + (shard * R + offs_r)[None, None, :],
                        mask=mask_m[None, :, None] & mask_r[None, None, :], other=0.0)
        if not EARLY:
            h = tl.sum(parts, 0)
        width = hi - lo  # shard's B^T block [S, R, width] starts S*R*(lo - c0) elements in
        b_base = b_ptr + (lo - c0).to(tl.int64) * S * R + slot.to(tl.int64) * R * width
        bb = tl.load(b_base + offs_r[:, None] * width + (cols - lo)[None, :],
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        # EARLY: every load above is in flight before the first use: the partials' sum and B's layout change go
        # through shared memory, and a load written after either would wait for its data (one more round trip)
        if EARLY:
            h = tl.sum(parts, 0)  # [BLOCK_M, BLOCK_R]: the SPLIT_K partial sums of the shrink
        bb = bb.to(tl.float32)
        if IEEE:
            acc = tl.dot(h, bb, input_precision="ieee")
        else:
            acc = tl.dot(h, bb)
        if not EARLY:
            scale = tl.load(scal_ptr + shard * sc_i + slot * sc_s)
            y = tl.load(y_ptrs, mask=mask, other=0.0)
        acc = acc * scale
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


@triton.jit(do_not_specialize=["sh_p", "T"])  # (T: one compiled variant per tile shape, `gather_tokens`)
def _expand_gather_kernel(hp_ptr, b_ptr, y_ptr, slot_ptr, rank_ptr, scal_ptr, T, S, R, shard0,
                          t1, t2, t3, c0, c1, c2, c3, c4,
                          sh_p, sh_t, sy_t, sy_n, sr_i, sr_s, sc_i, sc_s,
                          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
                          PDL: tl.constexpr = False):
    """The expand as a gather (Punica's BGMV): program (p, j) takes tokens p * BLOCK_T.. of the step, whatever their
    slots, and BLOCK_N columns of one shard; it reads each token's slot, then everything else at once (the token's
    partials, the rows of its slot's B over the columns, the scale, y's row), so a program waits for memory twice
    where `_expand_kernel` waits three to five times, and a step whose tokens all have their own adapter runs
    T / BLOCK_T programs per column tile instead of one per token. The rank is contracted on CUDA cores in float32
    (h [T, R] x B [T, R, N] summed over R); tokens of slot -1, or of rank 0 in the shard, are left untouched."""
    pdl.start(PDL)
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    local = (pid_n >= t1).to(tl.int32) + (pid_n >= t2).to(tl.int32) + (pid_n >= t3).to(tl.int32)
    shard = shard0 + local
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = toks < T
    slot = tl.load(slot_ptr + toks, mask=mask_t, other=-1).to(tl.int32)
    lo, hi = _pick(local, c0, c1, c2, c3), _pick(local, c1, c2, c3, c4)  # the shard's columns
    cols = lo + (pid_n - _pick(local, 0, t1, t2, t3)) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < hi
    has = slot >= 0
    slot = tl.where(has, slot, 0)
    rank = tl.load(rank_ptr + shard * sr_i + slot * sr_s, mask=has, other=0)
    scale = tl.load(scal_ptr + shard * sc_i + slot * sc_s, mask=has, other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r[None, :] < rank[:, None]  # [T, R]: false for slot -1 (rank 0 there)
    parts = tl.load(hp_ptr + tl.arange(0, SPLIT)[:, None, None] * sh_p + toks[None, :, None] * sh_t
                    + (shard * R + offs_r)[None, None, :], mask=mask_r[None, :, :], other=0.0)
    width = hi - lo  # shard's B^T block [S, R, width] starts S*R*(lo - c0) elements in
    b_rows = b_ptr + (lo - c0).to(tl.int64) * S * R + slot.to(tl.int64) * R * width  # [T]
    bb = tl.load(b_rows[:, None, None] + (offs_r[None, :, None] * width + (cols - lo)[None, None, :]),
                 mask=mask_r[:, :, None] & mask_n[None, None, :], other=0.0)
    y_ptrs = y_ptr + toks[:, None] * sy_t + cols[None, :] * sy_n
    mask = (rank > 0)[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    h = tl.sum(parts, 0)  # [T, R]: the SPLIT partial sums of the shrink
    acc = tl.sum(h[:, :, None] * bb.to(tl.float32), 1)  # [T, N]
    tl.store(y_ptrs, (y.to(tl.float32) + acc * scale[:, None]).to(y.dtype), mask=mask)


def gather_tiles(t: int, rank: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_N, BLOCK_R) of the gather expand for t tokens of rank `rank`: up to 16 tokens a program (8
    at rank 64, 4 at 128) and GATHER_ELEMENTS of B in flight, 16-128 columns (32 for 16 tokens at rank 16)."""
    block_r = _p2(rank, 16)
    block_t = max(1, min(16, _p2(t), GATHER_ELEMENTS // (16 * block_r)))
    return block_t, max(16, min(128, GATHER_ELEMENTS // (block_t * block_r))), block_r


def gather_tokens(max_tokens: int, rank: int) -> list[int]:
    """The fewest token counts in 1..max_tokens whose gather expands compile every variant the others launch (one
    per `gather_tiles` shape, its smallest member); none unless the gather is in use (`gathers`)."""
    first: dict[tuple, int] = {}
    for t in range(1, min(max_tokens, GATHER_MAX_TOKENS) + 1):
        if gathers(t):
            first.setdefault(gather_tiles(t, rank), t)
    return sorted(first.values())


def expand_gather(hp: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, scalings: torch.Tensor,
                  bounds: list[int], token_slots: torch.Tensor, ranks: torch.Tensor,
                  compile_only: bool = False, num_warps: int | None = None) -> None:
    """`expand` of partials stored by token (`shrink(..., by_token=True)`), with token t's adapter token_slots[t]
    (-1: none) read by the kernel (`_expand_gather_kernel`): the same sums as `expand`, the rank contracted in
    float32 (where `expand`'s tensor-core dot takes float16 adapters' partials as TF32). compile_only: compile,
    launch nothing. num_warps: other than GATHER_WARPS (the kernel bench's sweep)."""
    split, t, nr = hp.shape
    num_slots, rank = ranks.shape[1], nr // (len(bounds) - 1)
    block_t, block_n, block_r = gather_tiles(t, rank)
    for first, tiles, shard_args, b in _shard_launches(bounds, block_n, lora_b, num_slots, rank):
        grid = (cdiv(t, block_t), tiles)
        run = _expand_gather_kernel.warmup if compile_only else _expand_gather_kernel[grid]
        run(hp, b, y, token_slots, ranks, scalings, t, num_slots, rank, first, *shard_args,
            hp.stride(0), hp.stride(1), y.stride(0), y.stride(1), *ranks.stride(), *scalings.stride(),
            BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT=split, num_warps=num_warps or GATHER_WARPS,
            PDL=pdl.on(y.device), **pdl.launch(y.device), **({"grid": grid} if compile_only else {}))


def _shard_launches(bounds: list[int], block_n: int, lora_b: torch.Tensor, num_slots: int, rank: int):
    """For each expand launch (up to MAX_SHARDS shards of a layer's columns `bounds`): (its first shard, its column
    tiles of block_n, the kernel's shard arguments t1..t3 (cumulative tiles) and c0..c4 (column bounds), the flat B
    from its first shard on)."""
    for first in range(0, len(bounds) - 1, MAX_SHARDS):
        cols = list(bounds[first:first + MAX_SHARDS + 1])
        tiles = [cdiv(b - a, block_n) for a, b in zip(cols, cols[1:])]
        cum = [sum(tiles[:i]) if i < len(tiles) else 2 ** 30 for i in range(1, MAX_SHARDS)]  # 2**30: no shard
        cols += [cols[-1]] * (MAX_SHARDS + 1 - len(cols))
        yield first, sum(tiles), cum + cols, lora_b[num_slots * rank * (bounds[first] - bounds[0]):]


def _p2(n: int, lo: int = 1) -> int:
    return max(lo, next_power_of_2(max(1, n)))


def _interpreted_bf16(x: torch.Tensor) -> bool:
    """bf16 x under TRITON_INTERPRET, whose bf16 tl.dot is wrong (as `gptq_gemm`'s DOT_F32): the shrink then takes
    its IEEE path, the float32 dot of the same bf16 values (a GPU's compiled shrink is unchanged)."""
    return x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def partials(split: int, t: int, nr: int, device) -> torch.Tensor:
    """The shrink's output [SPLIT_K, T, n*R] float32, uninitialized: the expand reads only what the shrink wrote."""
    return torch.empty(split, t, nr, dtype=torch.float32, device=device)


def plan(t: int, num_slots: int, k: int, split: int | None = None) -> dict:
    """Launch sizes for T tokens, S slots and input width K: a function of the shapes only (never of the adapter
    mix), so that a CUDA graph's launches stay valid for any token->slot map. `split`: the shrink's SPLIT_K instead
    of the one chosen here (the kernel bench's sweep)."""
    block_m = 16 if t <= 256 else 64
    tiles = t // block_m + min(num_slots, t)
    busy = min(tiles, t)  # tiles that can hold tokens at once
    if split is None:
        split = 1
        while split < MAX_SPLIT and busy * split * 2 <= TARGET_PROGRAMS and k > split * K_PER_PROGRAM:
            split *= 2
    elif split < 1 or split & (split - 1):
        raise ValueError(f"split must be a power of two (the expand sums the partials with one arange), not {split}")
    block_k = min(128, _p2(cdiv(k, split), 16))
    k_per_split = cdiv(cdiv(k, split), block_k) * block_k
    return {"block_m": block_m, "tiles": tiles, "split": split, "block_k": block_k, "k_per_split": k_per_split,
            "block_n": BLOCK_N if block_m == 16 else BLOCK_N_BIG_M}


def plan_key(t: int, num_slots: int, k: int) -> tuple:
    """What of `plan(t, ...)` the compiled kernels depend on: T tokens and T' tokens with the same key launch the
    same shrink and expand variants (the grid and the integers the kernels do not specialize on may differ), and
    the same way of expanding by token (`gathers`: where the expand gathers, a decode graph's shrink stores by
    token)."""
    p = plan(t, num_slots, k)
    return p["block_m"], p["split"], p["block_k"], p["block_n"], gathers(t)


def plan_tokens(max_tokens: int, num_slots: int, k: int, want=lambda t: True) -> list[int]:
    """The fewest token counts in 1..max_tokens (among those `want` accepts) whose launches compile every kernel
    variant the others launch: one per distinct `plan_key`, its smallest member (an engine start compiles these)."""
    first: dict[tuple, int] = {}
    for t in range(1, max_tokens + 1):
        if want(t):
            first.setdefault(plan_key(t, num_slots, k), t)
    return sorted(first.values())


def lora_apply(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scalings: torch.Tensor, bounds: list[int], groups: SlotGroups,
               ranks: torch.Tensor | None = None) -> None:
    """Triton version of lora_reference.lora_apply: one shrink launch for every shard and slot, then one expand launch
    (per MAX_SHARDS shards) that adds every shard's delta into its columns of y in place."""
    if x.shape[0] == 0:
        return
    num_slots, n = lora_a.shape[0], len(bounds) - 1
    if ranks is None:
        ranks = torch.full((n, num_slots), lora_a.shape[1] // n, dtype=torch.int32, device=y.device)
    hp = shrink(x, lora_a, n, groups, ranks)
    expand(hp, y, lora_b, scalings, bounds, groups, ranks)


def delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scalings: torch.Tensor, bounds: list[int],
          groups: SlotGroups, ranks: torch.Tensor, token_slots: torch.Tensor, fuse: bool | None = True) -> LoRADelta:
    """Triton version of lora_reference.lora_delta: the shrink launch alone, its partials stored by token, for the
    int4 matmul to expand in its epilogue (`gptq_matmul(..., lora=)`: the layer's expand costs no launch)."""
    hp = shrink(x, lora_a, len(bounds) - 1, groups, ranks, by_token=True)
    return LoRADelta(hp, lora_b, token_slots, scalings, ranks, list(bounds), groups, fuse)


def partials_for(x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    """The (uninitialized) hp that `shrink(x, lora_a, ...)` writes, for a caller that allocates it beforehand."""
    num_slots, nr, k = lora_a.shape
    return partials(plan(x.shape[0], num_slots, k)["split"], x.shape[0], nr, x.device)


def shrink(x: torch.Tensor, lora_a: torch.Tensor, n: int, groups: SlotGroups, ranks: torch.Tensor,
           by_token: bool = False, compile_only: bool = False, out: torch.Tensor | None = None,
           split: int | None = None) -> torch.Tensor:
    """The partial sums hp [SPLIT_K, T, n*R] float32 of x @ A[slot]^T, at sorted positions (see the module doc), or
    at the tokens' own rows with by_token; into `out` (from `partials_for`) when given. compile_only: compile the
    kernel this call would launch (Triton's `warmup`, see `plan_tokens`), launch nothing; hp is then unwritten.
    split: SPLIT_K other than `plan`'s (the expand follows hp's)."""
    num_slots, nr, k = lora_a.shape
    t = x.shape[0]
    p = plan(t, num_slots, k, split)
    hp = partials(p["split"], t, nr, x.device) if out is None else out
    if tuple(hp.shape) != (p["split"], t, nr):
        raise ValueError(f"shrink: out has shape {tuple(hp.shape)}, the plan writes {(p['split'], t, nr)}")
    grid = (p["tiles"], p["split"])
    run = _shrink_kernel.warmup if compile_only else _shrink_kernel[grid]
    run(x, lora_a, hp, groups.order, groups.starts, ranks, num_slots, k, nr, nr // n, p["k_per_split"],
        x.stride(0), x.stride(1), *lora_a.stride(), hp.stride(0), hp.stride(1), *ranks.stride(),
        BLOCK_M=p["block_m"], BLOCK_J=_p2(nr, 16), BLOCK_K=p["block_k"], S_P2=_p2(num_slots, 2),
        IEEE=x.dtype == torch.float32 or _interpreted_bf16(x), BY_TOKEN=by_token, PDL=pdl.on(x.device),
        EVEN_K=k % p["block_k"] == 0,
        **pdl.launch(x.device), **({"grid": grid} if compile_only else {}))
    return hp


def expand(hp: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, scalings: torch.Tensor, bounds: list[int],
           groups: SlotGroups, ranks: torch.Tensor, block_n: int | None = None, by_token: bool = False,
           compile_only: bool = False, early: bool | None = None) -> None:
    """y[t, shard i's columns] += scalings[i, s] * (sum of hp's partials) @ B_i^T[s], in place (lora_b flat); hp at
    sorted positions, or by token (a LoRADelta's) with by_token. compile_only: compile, launch nothing. y may be a
    float32 buffer for a float16/bfloat16 model (`LoRALayer.apply_beside`): the products are the same (the dot's
    precision follows the adapter weights' dtype), only the sum is kept in float32. early: the kernel's load order
    (None: `early_loads()`)."""
    split, t, nr = hp.shape
    num_slots, rank = ranks.shape[1], nr // (len(bounds) - 1)
    p = plan(t, num_slots, 0)
    block_n = block_n or p["block_n"]
    for first, tiles, shard_args, b in _shard_launches(bounds, block_n, lora_b, num_slots, rank):
        grid = (p["tiles"], tiles)
        run = _expand_kernel.warmup if compile_only else _expand_kernel[grid]
        run(hp, b, y, groups.order, groups.starts, ranks, scalings, num_slots, rank, first, *shard_args,
            hp.stride(0), hp.stride(1), y.stride(0), y.stride(1), *ranks.stride(), *scalings.stride(),
            BLOCK_M=p["block_m"], BLOCK_N=block_n, BLOCK_R=_p2(rank, 16), SPLIT=split, S_P2=_p2(num_slots, 2),
            IEEE=lora_b.dtype == torch.float32, BY_TOKEN=by_token, num_warps=EXPAND_WARPS, PDL=pdl.on(y.device),
            EARLY=early_loads() if early is None else early, **pdl.launch(y.device),
            **({"grid": grid} if compile_only else {}))


def add_delta(d: LoRADelta, y: torch.Tensor) -> None:
    """Triton version of lora_reference.add_delta: the expand launched on its own (the int4 matmul's dequantize +
    cuBLAS path, which has no epilogue of ours), by segments or as a gather (`gathers`)."""
    if gathers(d.hp.shape[1]):
        expand_gather(d.hp, y, d.lora_b, d.scalings, d.bounds, d.token_slots, d.ranks)
    else:
        expand(d.hp, y, d.lora_b, d.scalings, d.bounds, d.groups, d.ranks, by_token=True)
