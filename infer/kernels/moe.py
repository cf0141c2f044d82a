"""Triton version of reference.fused_moe: a mixture of experts' SwiGLU MLPs over the tokens each expert was chosen
by, in three launches of fixed grids (a CUDA graph records them; no host sync, no shape that depends on routing);
with the experts' adapters four more _moe_gemm launches over the pairs aligned by (adapter slot, expert).

`align` sorts the T * k (token, choice) pairs by expert into segments of BLOCK_M rows, each expert's segment padded
to a multiple of BLOCK_M with an invalid row (T * k), all on the device: counts by scatter-add, the segments' starts
by cumsum, each pair's slot by a stable sort. The padded length is at most T * k + E * (BLOCK_M - 1), the grid's
fixed bound; blocks past the real end (`post`: the padded length, a device scalar) return at once. vLLM's
moe_align_block_size does the same in one CUDA kernel. BLOCK_M is the step's (`choose_block_m`: 16 at decode, up to
128 rows for a prefill's many rows per expert), a function of its static shape alone (CUDA graphs).

`_moe_gemm` runs a block of BLOCK_M sorted rows against their one expert's weight [N, K] (its expert per block:
`block_expert`), reading the rows of x (the token of pair p is p // k for the gate_up matmul, p itself for the down
matmul over the activations), and stores each row's output at its pair; the down matmul multiplies each row by its
routing weight (in float32) before rounding. Between them silu_and_mul (fused.py); after, the k rows of a token
summed.

Launch parameters (`step_config`): a table tuned on this GPU (kernels.moe_tune, gptq_configs' files of section
"moe", keyed by `layer_key` and the step's bucket of tokens) chooses BLOCK_M, BLOCK_N, num_warps and num_stages of
both matmuls of a step; without an entry the heuristics (`choose_block_m`, `tiles`, `launch_options`). BLOCK_K stays
the layer's (`tiles`, `int4_tiles`): each row's sums over K in the same order whatever the step or the entry.

MXFP4 experts (gpt-oss's as the hub stores them, reference.Mxfp4Experts): `_moe_gemm_mxfp4` reads each K step's
bytes and e8m0 scales and dequantizes the tile in registers (exact values, rounded to x's dtype as the reference),
in the float kernel's tiles (`mxfp4_tiles`), launches and epilogue; no tuned table (kernels.moe_tune skips them):
the heuristics' launch configs.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .gptq_kernels import _f16_1024, _fields
from .intmath import cdiv

BLOCK_M = 16  # a block's rows at decode (the fewest: `choose_block_m`)
MAX_BLOCK_M = 128
SMS = 132  # an H100's (and an H200's) streaming multiprocessors: the GPU the tiles are sized for
INT4_STAGES = 4  # the int4 kernel's pipeline depth: K steps of words in flight per program (`tiles`)
SECTION = "moe"  # the tuned tables' section (gptq_configs' files under kernels/moe/)
SM90_SMEM = 232448  # the shared memory one program may take on sm_90 (227 KiB): `smem_bytes`'s bound


def choose_block_m(tokens: int, top_k: int, experts: int) -> int:
    """BLOCK_M of a step of `tokens` tokens routed to `top_k` of `experts` experts (the pairs' "virtual experts" of
    _LoRAPairs too): the largest power of two at most the rows an expert gets on average (T * k / E), from 16
    (decode) to MAX_BLOCK_M (a prefill): more rows a program reuse each weight tile it reads (vLLM's fused_moe
    picks BLOCK_SIZE_M by the count of tokens as well), the padding of an expert's segment at most about its rows.
    A pure function of the step's static shape (a CUDA graph's captured count of tokens), never of the routing:
    Qwen3-30B-A3B (top-8 of 128) takes 16 up to 511 tokens, 32 from 512, 64 from 1024, 128 from 2048; Mixtral
    (top-2 of 8) 16 up to 127 tokens, 32 from 128, 128 from 512."""
    rows = tokens * top_k // max(1, experts)
    m = BLOCK_M
    while 2 * m <= min(rows, MAX_BLOCK_M):
        m *= 2
    return m


def block_m_steps(max_tokens: int, top_k: int, experts: int) -> dict[int, int]:
    """{BLOCK_M: the fewest tokens of a step that choose it} over steps of 1 to max_tokens tokens: the variants an
    engine's steps can launch (LLMEngine.warm_kernels compiles each)."""
    steps = {}
    for m in (BLOCK_M, 2 * BLOCK_M, 4 * BLOCK_M, MAX_BLOCK_M):
        t = 1 if m == BLOCK_M else cdiv(m * experts, top_k)
        if t <= max_tokens and choose_block_m(t, top_k, experts) == m:
            steps[m] = t
    return steps


def layer_key(experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, w13=None, w2=None,
              mxfp4: bool = False) -> str:
    """The tuned table's key of a sparse layer: E, H, I, top-k and x's dtype; int4 experts (reference.Int4Experts)
    add their group layout (each stack's group size, 0: act-order read per row, and whether it is sorted by group):
    it fixes BLOCK_K and the kernel's loads; MXFP4 experts (reference.Mxfp4Experts) "mxfp4-" (kernels.moe_tune
    tunes none: the heuristics' tiles)."""
    kind = ("mxfp4-" if mxfp4 else "") + str(dtype).removeprefix("torch.")
    if w13 is not None:
        kind = "int4-g" + "/".join(f"{w.group_size}{'p' if w.perm is not None else ''}" for w in (w13, w2)) + \
            f"-{kind}"
    return f"{experts},{hidden},{inter},{top_k},{kind}"


def experts_key(w13, w2, top_k: int, dtype: torch.dtype) -> str:
    """layer_key of the experts a fused MoE call takes (float [E, 2I, H] and [E, H, I], or reference.Int4Experts)
    for x of `dtype`."""
    if hasattr(w13, "qweight"):
        return layer_key(w13.qweight.shape[0], w13.in_features, w2.in_features, top_k, dtype, w13, w2)
    if hasattr(w13, "blocks"):  # MXFP4 experts (reference.Mxfp4Experts): a kind of their own, never tuned
        return layer_key(w13.blocks.shape[0], w13.in_features, w2.in_features, top_k, dtype, mxfp4=True)
    return layer_key(w13.shape[0], w13.shape[2], w2.shape[2], top_k, dtype)


def tuned_config(key: str, tokens: int, device: torch.device) -> dict | None:
    """The entry of this GPU's tuned table (gptq_configs.table, section "moe") for the layer `key` at a step of
    `tokens` tokens (its bucket: the next power of two, capped at gptq_configs.MAX_BUCKET), or None."""
    from . import gptq_configs
    return gptq_configs.table(device, SECTION).get(key, {}).get(gptq_configs.bucket(tokens))


def step_config(key: str | None, tokens: int, top_k: int, experts: int, device: torch.device) -> dict:
    """{"BLOCK_M", and where tuned "BLOCK_N", "num_warps", "num_stages"} of a step of `tokens` tokens: the tuned
    entry, else choose_block_m alone (the rest then `tiles` and `launch_options`, per matmul). A pure function of
    the step's static shape (a CUDA graph's captured count of tokens), never of the routing."""
    cfg = tuned_config(key, tokens, device) if key is not None else None
    return dict(cfg) if cfg else {"BLOCK_M": choose_block_m(tokens, top_k, experts)}


def config_steps(max_tokens: int, top_k: int, experts: int, key: str | None, device: torch.device) -> dict:
    """{launch config (a sorted tuple of step_config's items): the fewest tokens of a step that chooses it} over
    steps of 1 to max_tokens tokens: every variant an engine's steps can launch, tuned buckets and heuristic ones
    (models.moe.SparseMoeBlock.warm_block_sizes runs each). The choice is constant between the buckets' first
    counts and choose_block_m's thresholds, so those counts reach all."""
    from . import gptq_configs
    firsts = {1} | {b // 2 + 1 for b in (1 << i for i in range(1, 13))} | set(block_m_steps(max_tokens, top_k,
                                                                                              experts).values())
    firsts |= {gptq_configs.MAX_BUCKET + 1}
    out: dict = {}
    for t in sorted(t for t in firsts if t <= max_tokens):
        out.setdefault(tuple(sorted(step_config(key, t, top_k, experts, device).items())), t)
    return out


TUNED_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")  # a tuned entry's (BLOCK_M required)


def config_error(cfg: dict) -> str | None:
    """Why `cfg` cannot be a tuned entry (a launch config of both matmuls: BLOCK_M 16 to MAX_BLOCK_M, BLOCK_N 16 to
    256, num_warps 1 to 16, each a power of two, num_stages 1 to 8; BLOCK_K is the layer's, never an entry's), or
    None: gptq_configs skips such an entry of a table file (hand-edited, another version's) rather than launch it
    on every step."""
    bounds = {"BLOCK_M": (BLOCK_M, MAX_BLOCK_M), "BLOCK_N": (16, 256), "num_warps": (1, 16), "num_stages": (1, 8)}
    extra = sorted(set(cfg) - set(TUNED_KEYS))
    if extra:
        return f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not tuned (only {', '.join(TUNED_KEYS)})"
    if "BLOCK_M" not in cfg:
        return "it has no BLOCK_M"
    for name, v in cfg.items():
        lo, hi = bounds[name]
        pow2 = name != "num_stages"
        if type(v) is not int or not lo <= v <= hi or (pow2 and v & (v - 1)):
            return f"{name} {json.dumps(v)} is no {'power of two' if pow2 else 'integer'} from {lo} to {hi}"
    return None


def smem_bytes(cfg: dict, block_k: int, elem: int, int4: bool = False) -> int:
    """Shared memory a config's pipelined loads take at most: num_stages buffers of the A tile [BLOCK_M, BLOCK_K]
    in x's dtype (`elem` bytes) and of the weight tile: float [BLOCK_K, BLOCK_N] in x's dtype; int4 its words
    (half a byte a weight) and a row of zeros and scales (6 bytes a column), plus one dequantized [BLOCK_K,
    BLOCK_N] tile staged for the dot. (An act-order step's per-row gathers of zeros and scales are not counted:
    the tuner skips a config the GPU cannot launch anyway. There, group size 0, K 256, sm_90 compiles took 20 to
    141 KiB more than this bound, with no simple law in stages and tiles: no bound for such layers.)"""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if int4:
        return cfg["num_stages"] * (bm * block_k * elem + block_k * bn // 2 + 6 * bn) + block_k * bn * elem
    return cfg["num_stages"] * (bm * block_k + block_k * bn) * elem


def launch_options(block_m: int, int4: bool) -> dict:
    """num_warps / num_stages of a block of `block_m` rows: 4 warps, 8 for 128-row tiles (a [128, 64] float32
    accumulator is 32 registers a thread of 256); the int4 kernel's INT4_STAGES K steps in flight, 3 at 128 rows
    (each stage's A tile [128, BLOCK_K] in bf16 is 32 KiB of shared memory), the float kernel Triton's 3."""
    return {"num_warps": 8 if block_m >= 128 else 4,
            "num_stages": INT4_STAGES if int4 and block_m < 128 else 3}


def tiles(n: int, k: int, top_k: int, block_m: int = BLOCK_M) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a grouped matmul of N outputs and K inputs over the pairs of a top-k routing: fixed by
    the layer's shape (one compiled variant per layer and dtype, whatever the step's count of tokens), the same for
    the float and the int4 kernels (the same sums over K in the same order). BLOCK_K 128 from K = 256 (half the
    loop's steps and their fixed costs: each step reads [16, BLOCK_N] words, 64 * BLOCK_N bytes of int4 weights,
    4 steps in flight); BLOCK_N 64, or 32 where a decode step (one token: top_k blocks of rows) would give fewer
    than two programs per SM (SMS): at Qwen3-30B-A3B (top-8 of 128, H 2048, I 768) 8 * 1536 / 64 = 192 and
    8 * 2048 / 64 = 256 tiles < 264, so 32 (384 and 512 programs, 32 and 12 KiB of words each); at Mixtral-8x7B
    (top-2 of 8, H 4096, I 14336) the gate_up's 2 * 28672 / 64 = 896 tiles keep 64 (128 KiB each), the down's
    2 * 4096 / 64 = 128 take 32 (256 programs of 224 KiB). Blocks of more rows than 16 (`choose_block_m`: an expert's
    rows >= block_m on average, so at least E blocks of rows) keep 64: the grid is wide already, and a wider tile
    reads each row of x for more outputs. BLOCK_K does not depend on block_m (each row's sums over K in the same
    steps, decode or prefill)."""
    block_k = 128 if k >= 256 else min(64, max(16, triton.next_power_of_2(k)))
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    if block_n == 64 and block_m == BLOCK_M and top_k * cdiv(n, 64) < 2 * SMS:
        block_n = 32
    return block_n, block_k


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """(sorted pairs [P] (pair index, or T * k for padding), each block's expert [P / block_m], the padded length
    (an int32 device scalar)) for the routing `ids` [T, k]; P = T * k + E * (block_m - 1) rounded up to block_m."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    dev = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices  # the pairs by expert
    sorted_experts = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    slot = starts[sorted_experts] + torch.arange(pairs, device=dev) - first[sorted_experts]
    total = cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((total,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    block_starts = torch.arange(0, total, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_expert, ends[-1:].to(torch.int32)


@triton.jit
def _block_rows(pairs_ptr, experts_ptr, num_pairs, top_k, pid_m, ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block pid_m's BLOCK_M sorted rows: (each row's pair, whether it is one (not padding), the row of x it reads
    (the pair's token where ROW_DIV, else the pair itself), the block's expert)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    if ROW_DIV:
        a_row = pair // top_k
    else:
        a_row = pair
    a_row = tl.where(valid, a_row, 0).to(tl.int64)
    e = tl.load(experts_ptr + pid_m).to(tl.int64)
    return pair, valid, a_row, e


@triton.jit
def _dot(acc, a, w, IEEE: tl.constexpr):
    """acc plus a @ w (the MoE kernels' K step)."""
    if IEEE:  # float32 weights (and under the interpreter, whose half-precision dot is wrong): no TF32
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(a, w)
    return acc


@triton.jit
def _store_rows(out_ptr, weights_ptr, acc, pair, valid, offs_n, n, s_out, b_ptr, e, s_be, alpha, limit,
                WEIGHTED: tl.constexpr, HAS_BIAS: tl.constexpr, OAI: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Each valid row's output at its pair; where WEIGHTED, rounded to x's dtype (the expert's output, as
    F.linear's) and multiplied by the pair's routing weight in float32 first. HAS_BIAS (gpt-oss): the block's
    expert's bias row (b_ptr [E, n], s_be apart) added to the rounded product first, in float32 and rounded once
    (the bits of the add in x's dtype: reference.fused_moe's x @ W + b). OAI (gpt-oss's gate_up, whose columns
    interleave gate and up: 2j unit j's gate, 2j + 1 its up, so a tile holds both of its BLOCK_N / 2 units): the
    tile's reference.oai_swiglu, out [pairs, n / 2], each torch op's rounding to x's dtype restated in float32
    (gate clamped above at limit, up to [-limit, limit], (up + 1) * (gate * sigmoid(gate * alpha)))."""
    out_row = tl.where(valid, pair, 0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        b = tl.load(b_ptr + e * s_be + offs_n, mask=offs_n < n, other=0.0).to(tl.float32)
        acc = (acc.to(dt).to(tl.float32) + b[None, :]).to(dt).to(tl.float32)
    if WEIGHTED:
        acc = acc.to(dt).to(tl.float32)
        rw = tl.load(weights_ptr + out_row, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    if OAI:
        H: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.reshape(acc.to(dt).to(tl.float32), (BLOCK_M, H, 2)))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        ga = (gate * alpha).to(dt).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-ga))).to(dt).to(tl.float32)
        glu = (gate * sig).to(dt).to(tl.float32)
        up1 = (up + 1.0).to(dt).to(tl.float32)
        cols = tl.min(offs_n, 0) // 2 + tl.arange(0, H)
        tl.store(out_ptr + out_row[:, None] * s_out + cols[None, :], (up1 * glu).to(dt),
                 mask=valid[:, None] & (cols[None, :] < n // 2))
    else:
        tl.store(out_ptr + out_row[:, None] * s_out + offs_n[None, :], acc.to(dt),
                 mask=valid[:, None] & (offs_n[None, :] < n))


@triton.jit(do_not_specialize=["num_pairs"])  # (T * k: one compiled variant a BLOCK_M, whatever the count of pairs)
def _moe_gemm(a_ptr, w_ptr, out_ptr, weights_ptr, pairs_ptr, experts_ptr, post_ptr, num_pairs, n, k, top_k,
              s_a, s_we, s_wn, s_out, b_ptr, s_be, alpha, limit, ROW_DIV: tl.constexpr, WEIGHTED: tl.constexpr,
              IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              HAS_BIAS: tl.constexpr = False, OAI: tl.constexpr = False):
    """The grouped matmul of block pid_m's rows against its expert's w [E, n, k], in `_store_rows`'s epilogue
    (HAS_BIAS, OAI: gpt-oss's expert bias and clamped SwiGLU)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    pair, valid, a_row, e = _block_rows(pairs_ptr, experts_ptr, num_pairs, top_k, pid_m, ROW_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_row[:, None] * s_a + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < k),
                    other=0.0)
        w = tl.load(w_ptr + e * s_we + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None],
                    mask=(offs_n[None, :] < n) & (offs_k[:, None] < k), other=0.0)
        acc = _dot(acc, a, w, IEEE)
    _store_rows(out_ptr, weights_ptr, acc, pair, valid, offs_n, n, s_out, b_ptr, e, s_be, alpha, limit, WEIGHTED,
                HAS_BIAS, OAI, BLOCK_M, BLOCK_N)


def _launch(aligned: Aligned, n: int, block_n: int, int4: bool, cfg: dict | None, compile_only: bool = False):
    """(grid, BLOCK_N, num_warps / num_stages, and the grid too where compile_only) of a launch: `cfg`'s (a tuned
    entry) where it has them, else the heuristics' (`block_n` from `tiles`, `launch_options`)."""
    cfg = cfg or {}
    block_n = cfg.get("BLOCK_N", block_n)
    options = launch_options(aligned.block_m, int4)
    options.update({o: cfg[o] for o in ("num_warps", "num_stages") if o in cfg})
    grid = (aligned.block_expert.shape[0], cdiv(n, block_n))
    return grid, block_n, dict(options, grid=grid) if compile_only else options


def compile_variants(x: torch.Tensor, w13, w2, top_k: int, weight_dtype: torch.dtype, configs) -> list:
    """No-argument callables that each compile (Triton's `warmup`, nothing launched) both matmuls of a fused MoE
    step of these experts (float [E, N, K] or reference.Int4Experts) at one launch config of `configs`: the
    gate_up (ROW_DIV) and the weighted down, on stand-ins of the launches' dtypes and strides (for
    gptq_tune.compile_parallel: a tuner's candidates compiled on a thread pool before any is timed)."""
    int4 = hasattr(w13, "qweight")
    hidden, inter = (w13.in_features, w2.in_features) if int4 else (w13.shape[2], w2.shape[2])
    dev = x.device
    ints = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(3)]
    rows = {n: torch.empty(1, n, dtype=x.dtype, device=dev) for n in {hidden, inter, 2 * inter}}
    fw = torch.empty(1, dtype=weight_dtype, device=dev)
    gemm = _gemm_int4 if int4 else _gemm_mxfp4 if hasattr(w13, "blocks") else _gemm
    return [lambda cfg=cfg, a=a, w=w, out=out, first=first: gemm(
        rows[a], w, rows[out], fw, Aligned(*ints, cfg["BLOCK_M"]), top_k, first, not first, cfg, True)
        for cfg in configs for a, w, out, first in ((hidden, w13, 2 * inter, True), (inter, w2, hidden, False))]


def _epilogue(out, bias, act) -> tuple[tuple, dict]:
    """The epilogue's arguments (b_ptr, s_be, alpha, limit) and constexprs of a launch (`_store_rows`): `bias`
    ([E, n]: gpt-oss's expert biases) added, `act` ((alpha, limit): gpt-oss's clamped SwiGLU, out [pairs, n / 2])
    applied; `out` stands in for an absent bias (the kernels' signature never changes)."""
    alpha, limit = act if act is not None else (0.0, 0.0)
    args = (out, 0) if bias is None else (bias, bias.stride(0))
    return (*args, float(alpha), float(limit)), dict(HAS_BIAS=bias is not None, OAI=act is not None)


def _gemm(a, w, out, weights, aligned, top_k, row_div: bool, weighted: bool, cfg: dict | None = None,
          compile_only: bool = False, bias=None, act=None):
    """One _moe_gemm launch over `aligned` (an Aligned: its blocks of block_m rows); cfg: a tuned entry;
    compile_only: only compile it (Triton's `warmup`, `compile_variants`); bias, act: `_epilogue`'s."""
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = tiles(n, k, top_k, aligned.block_m)
    grid, block_n, options = _launch(aligned, n, block_n, False, cfg, compile_only)
    epi, epi_c = _epilogue(out, bias, act)
    run = _moe_gemm.warmup if compile_only else _moe_gemm[grid]
    return run(a, w, out, weights, aligned.sorted_pairs, aligned.block_expert, aligned.post, out.shape[0], n, k,
               top_k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), *epi, ROW_DIV=row_div, WEIGHTED=weighted,
               IEEE=a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
               BLOCK_M=aligned.block_m, BLOCK_N=block_n, BLOCK_K=block_k, **epi_c, **options)


class Aligned(NamedTuple):
    """`align`'s tensors and the block_m they are padded to."""
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    post: torch.Tensor
    block_m: int


def aligned(ids: torch.Tensor, num_experts: int, block_m: int | None = None) -> Aligned:
    """`align` of `ids` [T, k] to block_m rows (None: choose_block_m of the step's shape)."""
    if block_m is None:
        block_m = choose_block_m(ids.shape[0], ids.shape[1], num_experts)
    if block_m < BLOCK_M or block_m & (block_m - 1):
        raise ValueError(f"block_m {block_m} is no power of two from {BLOCK_M}: use 16, 32, 64 or 128")
    return Aligned(*align(ids, num_experts, block_m), block_m)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, lora=None, block_m: int | None = None, config: dict | None = None,
              oai=None, apart: bool = False) -> torch.Tensor:
    """reference.fused_moe in three launches (`_run`; `oai`: gpt-oss's reference.OaiExperts, two launches); block_m:
    the blocks' rows (None: `step_config`'s; a candidate of the bench otherwise, the heuristics' tiles); config: the
    launch config to use (a tuner's candidate; None: `step_config`'s); apart: `_run`'s (the bench's baseline)."""
    w13, w2 = w13.contiguous(), w2.contiguous()
    return _experts(x, w13, w2, weights, ids, w13.shape[0], w13.shape[1], w2.shape[1], lora, block_m, config, _gemm,
                    oai, apart, ungated=w13.shape[1] == w2.shape[2])


def _experts(x, w13, w2, weights, ids, e: int, out13: int, out2: int, lora, block_m, config, gemm, oai,
             apart: bool, ungated: bool = False) -> torch.Tensor:
    """`_run` over the `e` experts w13 (out13 outputs) and w2 (out2), `gemm` (_gemm, _gemm_int4 or _gemm_mxfp4)
    launched on w13 for the gate_up rows and on w2 for the down ones: a step of no tokens zeros (fused_moe's,
    fused_moe_int4's and fused_moe_mxfp4's common part; their arguments)."""
    t, top_k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    return _run(x, ids, weights, e, out13, out2, lora, block_m,
                _config(config, block_m, w13, w2, x.dtype, ids, e),
                lambda a, out, fw, al, row_div, weighted, cfg, bias, act: gemm(
                    a, w13 if row_div else w2, out, fw, al, top_k, row_div, weighted, cfg, bias=bias, act=act), oai,
                apart, ungated=ungated)


def _config(config: dict | None, block_m: int | None, w13, w2, dtype, ids: torch.Tensor, experts: int) -> dict:
    """The launch config of a call: `config` where given, {"BLOCK_M": block_m} where forced, else step_config."""
    if config is not None:
        return config
    if block_m is not None:
        return {"BLOCK_M": block_m}
    return step_config(experts_key(w13, w2, ids.shape[1], dtype), ids.shape[0], ids.shape[1], experts, ids.device)


def _run(x, ids, weights, num_experts: int, out13: int, out2: int, lora, block_m, cfg: dict,
         gemm, oai=None, apart: bool = False, ungated: bool = False) -> torch.Tensor:
    """The fused MoE over the pairs sorted by expert: the gate_up grouped matmul (`gemm(a, out, flat weights,
    aligned, row_div=True, weighted=False, cfg, bias, act)`), silu_and_mul, the down one (weighted by the routing
    weights), the k rows of a token summed. With `lora` (reference.MoELoRA): each pair's delta of its token's adapter
    and its expert (reference.moe_lora_delta; here _LoRAPairs' grouped matmuls, no host sync) added to its gate_up
    row, and to its down row before the routing weight (rounded to x's dtype, times the weight in float32, as the
    kernel's WEIGHTED store). cfg: the launch config of both matmuls over the experts (`_config`); the adapters'
    pairs take the heuristics' (their BLOCK_M `block_m` where forced). With `oai` (gpt-oss's reference.OaiExperts):
    each pair's expert's bias added in the matmuls' epilogue (`_store_rows`: to the gate_up row, and to the down row
    before the routing weight, as transformers' x @ W + b, then the weight), and the activation
    reference.oai_swiglu computed by the gate_up matmul's epilogue too (its gate and up columns interleave): two
    launches in all where the float32 adds, index_selects and the activation's torch ops ran apart. (With adapters
    of gpt-oss's experts, which the loader refuses, the delta would go between: oai_swiglu then runs apart.)
    apart (`python -m infer.bench.moe --oai`'s baseline): gpt-oss's biases and activation as torch ops after plain
    matmuls, as session 60 ran them (index_select adds, reference.oai_swiglu, the routing weight after the bias).
    `ungated` (experts without gate, w13 their up rows alone: Nemotron 3's): relu(up)² in place of silu_and_mul."""
    from . import fused
    t, top_k = ids.shape
    pairs_aligned = aligned(ids, num_experts, cfg["BLOCK_M"])
    pairs = t * top_k
    flat_w = weights.reshape(-1).contiguous()
    b13, b2 = (None, None) if oai is None or apart else (oai.b13, oai.b2)
    if oai is not None and lora is None and not apart:  # the clamped SwiGLU in the gate_up matmul's epilogue
        act = torch.empty(pairs, out13 // 2, dtype=x.dtype, device=x.device)
        gemm(x, act, flat_w, pairs_aligned, True, False, cfg, b13, (oai.alpha, oai.limit))
    else:
        gate_up = torch.empty(pairs, out13, dtype=x.dtype, device=x.device)
        gemm(x, gate_up, flat_w, pairs_aligned, True, False, cfg, b13, None)
        if apart and oai is not None:
            gate_up += oai.b13.index_select(0, ids.reshape(-1))
        if lora is not None:
            adapters = _LoRAPairs(ids, lora, flat_w, block_m)
            gate_up += adapters.delta(x, lora.a13, lora.b13, True)
        if ungated:  # (experts without gate, w13 their up rows alone: Nemotron 3's relu(up)², in place)
            act = gate_up.relu_().square_()
        elif oai is None:
            act = fused.silu_and_mul(gate_up)
        else:
            from .reference import oai_swiglu
            act = oai_swiglu(gate_up, out13 // 2, oai.alpha, oai.limit)
        del gate_up  # (freed before the down stage: the plan counts one of the two alive, sizes.moe_token_bytes)
    down = torch.empty(pairs, out2, dtype=x.dtype, device=x.device)
    late = lora is not None or (apart and oai is not None)  # (the routing weight after the delta / the bias)
    gemm(act, down, flat_w, pairs_aligned, False, not late, cfg, b2, None)
    if apart and oai is not None:
        down += oai.b2.index_select(0, ids.reshape(-1))
    if lora is not None:
        down += adapters.delta(act, lora.a2, lora.b2, False)
    if late:
        down.mul_(flat_w[:, None])  # (in place, computed in float32 and rounded once: no [pairs, H] float32 copies)
    return down.view(t, top_k, -1).sum(dim=1)


class _LoRAPairs:
    """The experts' adapters of one fused MoE call (reference.MoELoRA) as grouped matmuls over the token-expert
    pairs sorted by (slot, expert): each pair's "virtual expert" s * E + e (a token without adapter: slot 0, its
    shrink zeroed), aligned as `align` aligns the experts, so that the shrink (rows against A [S * E, r, K]) and the
    expand (the shrink's [P, r] against B [S * E, N, r]) are _moe_gemm launches of fixed grids: no host sync, no
    gathered weights. Their blocks' rows: `block_m` where the call forces one (a tuner's candidate), else
    choose_block_m of the step's shape over the S * E virtual experts."""

    def __init__(self, ids: torch.Tensor, lora, flat_w: torch.Tensor, block_m: int | None = None):
        slots, e = lora.token_slots, lora.a13.shape[1]
        self.count = lora.a13.shape[0] * e
        self.top_k = ids.shape[1]
        virtual = slots.clamp(min=0).unsqueeze(1) * e + ids.to(slots.dtype)
        self.aligned = aligned(virtual, self.count, block_m)
        self.valid = (slots >= 0).repeat_interleave(self.top_k, output_size=ids.numel()).unsqueeze(1)
        self.flat_w = flat_w

    def delta(self, a: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, row_div: bool) -> torch.Tensor:
        """[P, N]: each pair's b[s, e] @ (a[s, e] @ its row of `a`) (the token's row where row_div, else its own), 0
        for a token without adapter."""
        pairs, (r, k), n = self.valid.shape[0], lora_a.shape[2:], lora_b.shape[2]
        u = torch.empty(pairs, r, dtype=a.dtype, device=a.device)
        _gemm(a, lora_a.reshape(self.count, r, k), u, self.flat_w, self.aligned, self.top_k, row_div, False)
        u *= self.valid.to(u.dtype)
        d = torch.empty(pairs, n, dtype=a.dtype, device=a.device)
        _gemm(u, lora_b.reshape(self.count, n, r), d, self.flat_w, self.aligned, self.top_k, False, False)
        return d


# ------------------------------------------------------------------------------------------------ int4 (GPTQ) experts
@triton.jit(do_not_specialize=("num_pairs",))  # (as _moe_gemm: one compiled variant a BLOCK_M)
def _moe_gemm_int4(a_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, p_ptr, out_ptr, weights_ptr, pairs_ptr, experts_ptr,
                   post_ptr, num_pairs, n, k, top_k, group_size, s_a, s_qe, s_qk, s_ze, s_zg, s_se, s_sg, s_ge, s_pe,
                   s_out, b_ptr, s_be, alpha, limit, ROW_DIV: tl.constexpr, WEIGHTED: tl.constexpr,
                   IEEE: tl.constexpr, ZEROS_V1: tl.constexpr, READ_G: tl.constexpr, ONE_GROUP: tl.constexpr,
                   PERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr = False, OAI: tl.constexpr = False):
    """_moe_gemm over int4 GPTQ experts: qweight [E, K / 8, N] (8 consecutive input rows a word, lowest nibble
    first), qzeros [E, G, N / 8] (fields of zero - 1 where ZEROS_V1), scales [E, G, N] (float16), g_idx [E, K]
    (READ_G: each input row's group read, act-order; else row // group_size; ONE_GROUP: every K step inside one
    group, whose zeros and scales are read once a step); PERM: act-order experts sorted by group at load
    (reference.Int4Experts.sorted_by_group), perm [E, K] the column of x of each sorted input row, the A tile a
    gather of those columns (the groups then plain: ONE_GROUP where the step fits). Each K step's tile of the
    block's expert is dequantized in registers as packing.dequantize does, (q - z) * s rounded to float16, then to
    x's dtype, and multiplied as the float kernel multiplies; its epilogue the float kernel's (`_store_rows`)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    pair, valid, a_row, e = _block_rows(pairs_ptr, experts_ptr, num_pairs, top_k, pid_m, ROW_DIV, BLOCK_M)
    BKW: tl.constexpr = BLOCK_K // 8  # a K step's words per column
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    zshift = ((offs_n % 8) * 4)[None, :]
    qw_cols = qw_ptr + e * s_qe + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        if PERM:  # x's columns of the expert's sorted rows
            cols = tl.load(p_ptr + e * s_pe + offs_k, mask=mask_k, other=0).to(tl.int64)
        else:
            cols = offs_k
        a = tl.load(a_ptr + a_row[:, None] * s_a + cols[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        # the step's [BKW, BLOCK_N] words, each read once (coalesced along N), split into their 8 fields in
        # registers: [8, BKW, N] -> [BKW, 8, N] -> row 8 i + j = field j of word i = input row k0 + 8 i + j, the
        # tile in x's order (x read contiguously, the dot's sum over K in the same order as the float kernel's)
        offs_w = k0 // 8 + tl.arange(0, BKW)
        mask_w = (offs_w < k // 8)[:, None] & mask_n[None, :]
        words = tl.load(qw_cols + offs_w[:, None].to(tl.int64) * s_qk, mask=mask_w, other=0)
        qf = _f16_1024(tl.reshape(tl.permute(_fields(words, 4), (1, 0, 2)), (BLOCK_K, BLOCK_N)))
        if ONE_GROUP:  # the step's group: its zeros and scales [1, BLOCK_N]
            g1 = (k0 // group_size).to(tl.int64)
            zw = tl.load(qz_ptr + e * s_ze + g1 * s_zg + (offs_n // 8)[None, :], mask=mask_n[None, :], other=0)
            s = tl.load(s_ptr + e * s_se + g1 * s_sg + offs_n[None, :], mask=mask_n[None, :], other=0.0)
        else:  # each row's group: [BLOCK_K, BLOCK_N] gathers
            mask = mask_k[:, None] & mask_n[None, :]
            if READ_G:
                g = tl.load(g_ptr + e * s_ge + offs_k, mask=mask_k, other=0).to(tl.int64)
            else:
                g = (offs_k // group_size).to(tl.int64)
            zw = tl.load(qz_ptr + e * s_ze + g[:, None] * s_zg + (offs_n // 8)[None, :], mask=mask, other=0)
            s = tl.load(s_ptr + e * s_se + g[:, None] * s_sg + offs_n[None, :], mask=mask, other=0.0)
        z = (zw >> zshift) & 0xF
        if ZEROS_V1:
            z = (z + 1) & 0xF
        # (1024 + q) - (1024 + z): the exact q - z in float16 without conversions, times the scale in float16
        w = ((qf - _f16_1024(z)) * s).to(a_ptr.dtype.element_ty)
        acc = _dot(acc, a, w, IEEE)
    _store_rows(out_ptr, weights_ptr, acc, pair, valid, offs_n, n, s_out, b_ptr, e, s_be, alpha, limit, WEIGHTED,
                HAS_BIAS, OAI, BLOCK_M, BLOCK_N)


def int4_tiles(n: int, k: int, group_size: int, top_k: int, block_m: int = BLOCK_M) -> tuple[int, int, bool]:
    """`tiles` of int4 experts of this group size (0: act-order read per row), and whether each K step lies in one
    group: a power-of-two group smaller than the step (16 to 64) makes the step one group wide."""
    block_n, block_k = tiles(n, k, top_k, block_m)
    if 16 <= group_size < block_k and group_size & (group_size - 1) == 0:
        block_k = group_size
    return block_n, block_k, group_size > 0 and (group_size >= k or group_size % block_k == 0)


def _gemm_int4(a, w, out, weights, aligned, top_k, row_div: bool, weighted: bool, cfg: dict | None = None,
               compile_only: bool = False, bias=None, act=None):
    n, k, gs = w.out_features, w.in_features, w.group_size
    block_n, block_k, one_group = int4_tiles(n, k, gs, top_k, aligned.block_m)
    grid, block_n, options = _launch(aligned, n, block_n, True, cfg, compile_only)
    epi, epi_c = _epilogue(out, bias, act)
    qw, qz, s, g = w.qweight, w.qzeros, w.scales, w.g_idx
    perm = w.perm if w.perm is not None else g  # (not read without PERM)
    run = _moe_gemm_int4.warmup if compile_only else _moe_gemm_int4[grid]
    return run(a, qw, qz, s, g, perm, out, weights, aligned.sorted_pairs, aligned.block_expert, aligned.post,
               out.shape[0], n, k, top_k, max(1, w.group_size), a.stride(0), qw.stride(0), qw.stride(1),
               qz.stride(0), qz.stride(1), s.stride(0), s.stride(1), g.stride(0), perm.stride(0), out.stride(0),
               *epi, ROW_DIV=row_div, WEIGHTED=weighted,
               IEEE=a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
               ZEROS_V1=bool(w.zeros_v1), READ_G=gs <= 0, ONE_GROUP=one_group, PERM=w.perm is not None,
               BLOCK_M=aligned.block_m, BLOCK_N=block_n, BLOCK_K=block_k, **epi_c, **options)


def fused_moe_int4(x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor, lora=None,
                   block_m: int | None = None, config: dict | None = None, oai=None,
                   apart: bool = False) -> torch.Tensor:
    """fused_moe over int4 GPTQ experts (reference.Int4Experts w13: [E, 2I] outputs of H inputs; w2: [E, H] of I),
    dequantized in registers: the same alignment, launches and grids as the float experts (and the same LoRA)."""
    e = w13.qweight.shape[0]
    return _experts(x, w13, w2, weights, ids, e, w13.out_features, w2.out_features, lora, block_m, config,
                    _gemm_int4, oai, apart, ungated=w13.out_features == w2.in_features)


# ------------------------------------------------------------------------------------------------ MXFP4 experts
@triton.jit
def _e2m1(c):
    """The float32 values of 4-bit e2m1 codes `c` (int32; reference.FP4_VALUES): sign bit 3, exponent bits 1-2
    (bias 1), mantissa bit 0; exponent 0 the subnormals 0 and 0.5. Built from their bits: exact."""
    mag = c & 7
    ex = mag >> 1
    m = mag & 1
    normal = (((ex + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    v = tl.where(ex == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where(c >= 8, -v, v)


@triton.jit
def _e8m0(s):
    """The float32 powers of two 2^(s - 127) of e8m0 scales `s` (int32 0..254; 0: the subnormal 2^-127; 255,
    OCP's NaN: 2^127, the value times 2 after (`_e8m0_over`), torch's ldexp of an int exponent 128 as transformers
    dequantizes: 0 stays 0, 0.5 is 2^127, 1 and beyond inf)."""
    return tl.where(s > 0, tl.minimum(s, 254) << 23, 1 << 22).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_over(s):
    """The factor after `_e8m0`'s of scales `s`: 2 for 255 (2^128 in two steps), else 1."""
    return tl.where(s == 255, 2.0, 1.0)


@triton.jit(do_not_specialize=("num_pairs",))  # (as _moe_gemm: one compiled variant a BLOCK_M)
def _moe_gemm_mxfp4(a_ptr, q_ptr, sc_ptr, out_ptr, weights_ptr, pairs_ptr, experts_ptr, post_ptr, num_pairs, n, k,
                    top_k, s_a, s_qe, s_qn, s_se, s_sn, s_out, b_ptr, s_be, alpha, limit, ROW_DIV: tl.constexpr,
                    WEIGHTED: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr = False, OAI: tl.constexpr = False):
    """_moe_gemm over MXFP4 experts (reference.Mxfp4Experts): blocks uint8 [E, N, K / 2] (a row's K / 32 groups of 16
    bytes, two e2m1 codes a byte, low nibble first), scales uint8 [E, N, K / 32] (e8m0). Each K step reads its
    [BLOCK_K / 2, BLOCK_N] bytes once and its [BLOCK_K / 32, BLOCK_N] scales, splits the bytes into their codes in
    registers ([K / 2, N, 2] -> [K / 2, 2, N] -> row 2 i + j = nibble j of byte i: the tile in x's order), each
    value FP4_VALUES[code] * 2^(scale - 127) in float32 (exact), rounded to x's dtype (as mxfp4_dequantize), then
    the float kernel's dot and epilogue (`_store_rows`). BLOCK_K a multiple of 32 (whole groups a step)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    pair, valid, a_row, e = _block_rows(pairs_ptr, experts_ptr, num_pairs, top_k, pid_m, ROW_DIV, BLOCK_M)
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    q_cols = q_ptr + e * s_qe + offs_n[None, :].to(tl.int64) * s_qn
    sc_cols = sc_ptr + e * s_se + offs_n[None, :].to(tl.int64) * s_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_row[:, None] * s_a + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < k),
                    other=0.0)
        offs_b = k0 // 2 + tl.arange(0, HALF)
        q = tl.load(q_cols + offs_b[:, None], mask=(offs_b[:, None] < k // 2) & mask_n[None, :], other=0)
        q = q.to(tl.int32)
        codes = tl.reshape(tl.permute(tl.join(q & 0xF, q >> 4), (0, 2, 1)), (BLOCK_K, BLOCK_N))
        offs_g = k0 // 32 + tl.arange(0, GROUPS)
        s = tl.load(sc_cols + offs_g[:, None], mask=(offs_g[:, None] < k // 32) & mask_n[None, :], other=127)
        s = s.to(tl.int32)
        w = tl.reshape(tl.reshape(_e2m1(codes), (GROUPS, 32, BLOCK_N)) * _e8m0(s)[:, None, :]
                       * _e8m0_over(s)[:, None, :], (BLOCK_K, BLOCK_N))
        w = w.to(a_ptr.dtype.element_ty)
        acc = _dot(acc, a, w, IEEE)
    _store_rows(out_ptr, weights_ptr, acc, pair, valid, offs_n, n, s_out, b_ptr, e, s_be, alpha, limit, WEIGHTED,
                HAS_BIAS, OAI, BLOCK_M, BLOCK_N)


def mxfp4_tiles(n: int, k: int, top_k: int, block_m: int = BLOCK_M) -> tuple[int, int]:
    """`tiles` of MXFP4 experts: the float kernel's (the same sums over K in the same order), BLOCK_K at least a
    group of 32 (K is a multiple of 32: a K step whole groups)."""
    block_n, block_k = tiles(n, k, top_k, block_m)
    return block_n, max(32, block_k)


def _gemm_mxfp4(a, w, out, weights, aligned, top_k, row_div: bool, weighted: bool, cfg: dict | None = None,
                compile_only: bool = False, bias=None, act=None):
    """One _moe_gemm_mxfp4 launch (as _gemm: cfg a launch config, compile_only Triton's `warmup`)."""
    n, k = w.out_features, w.in_features
    block_n, block_k = mxfp4_tiles(n, k, top_k, aligned.block_m)
    grid, block_n, options = _launch(aligned, n, block_n, False, cfg, compile_only)
    epi, epi_c = _epilogue(out, bias, act)
    q, sc = w.blocks, w.scales
    run = _moe_gemm_mxfp4.warmup if compile_only else _moe_gemm_mxfp4[grid]
    return run(a, q, sc, out, weights, aligned.sorted_pairs, aligned.block_expert, aligned.post, out.shape[0], n, k,
               top_k, a.stride(0), q.stride(0), q.stride(1), sc.stride(0), sc.stride(1), out.stride(0), *epi,
               ROW_DIV=row_div, WEIGHTED=weighted,
               IEEE=a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
               BLOCK_M=aligned.block_m, BLOCK_N=block_n, BLOCK_K=block_k, **epi_c, **options)


def fused_moe_mxfp4(x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor, lora=None,
                    block_m: int | None = None, config: dict | None = None, oai=None,
                    apart: bool = False) -> torch.Tensor:
    """fused_moe over MXFP4 experts (reference.Mxfp4Experts w13: [E, 2I] outputs of H inputs; w2: [E, H] of I),
    dequantized in registers: the same alignment, launches and grids as the float experts (and the same LoRA)."""
    w13, w2 = (type(w)(w.blocks.contiguous(), w.scales.contiguous()) for w in (w13, w2))
    e = w13.blocks.shape[0]
    return _experts(x, w13, w2, weights, ids, e, w13.out_features, w2.out_features, lora, block_m, config,
                    _gemm_mxfp4, oai, apart)
