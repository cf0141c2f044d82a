"""Paged attention of multi-head latent attention (DeepSeek-V2/V3's MLA) with the weights absorbed: every token of a
layer keeps ONE cache row of width L + R (L = kv_lora_rank, the latent c_kv; R = qk_rope_head_dim, the rotated k_pe)
shared by all H query heads; the absorbed query of a head is L + R wide too, and the values are the rows' first L
dims (no V cache). `mla_paged_attention` (signature below) is, by definition, reference.paged_attention(q, cache,
cache, ...)[..., :L]: on CPU it is computed so; on CUDA tensors (kernels.use_triton; tests force it on CPU tensors
under TRITON_INTERPRET=1) by the Triton kernels here, which read a key tile ONCE for the scores and the values and
never pad L + R (576) to a power of two (1024): the score is the L part's dot plus the R part's, each its own
power-of-two width (512 and 64), and the value product reuses the L part already in registers. A float8 cache
(--kv-cache-dtype fp8 / fp8_e5m2: rows written saturated and rounded, scale 1.0, as every infer fp8 cache) is read as
stored, one byte an element, each tile upcast to q's dtype in registers (exact): a decode reads half the bytes, in
tiles of FP8_BLOCK_N keys (`decode_tile`).

* decode (every sequence's query length 1), flash-decoding: a program per (block of `heads` query heads in rows of
  BLOCK_H = max(16, heads), sequence, split of the context). The head block is the grid's fastest axis, so the H /
  heads programs that read the same key tiles run side by side and all but the first find them in L2. Splits cut a
  sequence's key blocks (whole BLOCK_N tiles) `parts` ways; with one split the program writes the output, else each
  writes its partial (acc [BLOCK_H, L] float32, running max and sum) and a second small kernel (`_merge_kernel`, a
  program per sequence and head) merges them. The grid depends on T and the sizes only (no host sync: graph-safe).
* otherwise (prefills, mixed steps) a flash-attention kernel: a program per (tile of BLOCK_Q query tokens of one
  sequence x BLOCK_H heads, head block), rows = (token, head) pairs, causal within the sequence's new tokens.

Head block and programs per SM (H100: 132 SMs, 228 KiB shared memory and 64 K registers an SM). A decode step must
read every sequence's context once from HBM, (L + R) x 2 = 1,152 bytes a key in bf16 (V3 at batch 64 and 32k context:
2.4 GB, about 0.75 ms at 3.3 TB/s); q and the output add H x 2,176 bytes a sequence. Each of the H / heads head
blocks reads the same tiles again, from L2 when they run side by side, so fewer, wider head blocks spare L2; but a
program's float32 accumulator is heads x L: 16 x 512 is 64 registers a thread at 4 warps, 32 x 512 the same at 8
warps. Compiled for sm_90 (tests/test_probes_session65_mla.py): 16 heads take about 200 registers a thread at 4 warps
and 55 KiB of shared memory (a key tile of BLOCK_N = 32 rows is 36 KiB, double-buffered): 2 programs an SM; 32 heads
about 190 at 8 warps and 74 KiB: 1 an SM. So V2-Lite (H = 16) is one head block of 16, V3 (H = 128) four of 32 (L2
reads 4 x 1,152 bytes a key, not 8 x; its 256 programs at batch 64 are two waves). The splits make up the rest:
`decode_plan` gives batch x head blocks x splits >= 2 x 132 programs where the widest context has that many tiles of
32 keys, and where even one split a tile cannot give every SM a program (batch 1, 1k context: 32 tiles), fewer heads
a program (down to 4 in rows of 16, the padding rows' dots free while a step is bound by its bytes: 16 heads do 30
flops a byte read). At batch 1-64 and contexts 1k-32k that is 128-264 programs: V2-Lite batch 1 1k: 4 head blocks x
32 splits; 8k: 256 splits; batch 64: 4 splits. V3 batch 1 8k: 4 x 66 splits; batch 16: 4 x 4; batch 64: 4 x 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import kernels
from . import pdl, reference
from .attention import LOG2E, _decode_programs, _interpreted_bf16, _merge, _tile_of
from .intmath import PROGRAMS_PER_SM, cdiv, decode_parts, next_power_of_2

BLOCK_N = 32  # keys a decode tile: (L + R) x 32 x 2 bytes = 36 KiB at V3's widths in bf16
# keys a decode tile over a float8 cache, (L + R) x 16 bytes = 9 KiB at V3's widths as stored: tiles of 32 keys
# spilled registers in the decode's main loop on sm_90 at 32 heads a program (the e4m3 tile upcast beside the bf16
# one; compiled in tests/test_probes_session66_mlafp8.py)
FP8_BLOCK_N = 16
PREFILL_BLOCK_N = 16  # keys a prefill tile (beside its 32 rows of q: within sm_89's 99 KiB a program, two stages)
PROGRAMS_PER_SM_MLA = 2  # decode programs an SM holds at once (16 heads: ~200 registers a thread at 4 warps)
MERGE_CHUNK = 16  # the partials the merge reads a step


def head_block(num_heads: int) -> int:
    """Query heads a decode program attends at most (see the module docstring): 16, or 32 above 16 heads."""
    return 16 if num_heads <= 16 else 32


@triton.jit
def _attend_tiles(acc, m_i, l_i, q_l, q_r, pos, c_ptr, table_ptr, lo, hi, s_cb, s_cs, s_cd, qk_scale,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr, FUTURE: tl.constexpr):
    """Online softmax (base 2) of the rows q_l | q_r ([M, BLOCK_L], [M, BLOCK_R]; row i at position pos[i]) over
    the keys lo..hi-1 (causal). A key tile's L part is loaded once: the scores' first dot, and the values.
    FUTURE (a prefill's tile): keys past some row's position may be in lo..hi-1; a value there that is not finite
    (a token the model overflowed on) is kept from the rows that do not attend to it (0 x NaN in the value
    product); a row that does gets NaN through its score."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    first = tl.min(pos, 0)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        mask_n = keys < hi
        block = tl.load(table_ptr + keys // PAGE, mask=mask_n, other=0).to(tl.int64)
        row = c_ptr + block * s_cb + (keys % PAGE) * s_cs
        # (a float8 cache's rows upcast to q's dtype in registers: exact, every e4m3 and e5m2 value is one)
        kv = tl.load(row[:, None] + offs_l[None, :] * s_cd, mask=mask_n[:, None] & (offs_l < LATENT)[None, :],
                     other=0.0).to(q_l.dtype)
        kr = tl.load(row[:, None] + (LATENT + offs_r)[None, :] * s_cd,
                     mask=mask_n[:, None] & (offs_r < ROPE)[None, :], other=0.0).to(q_r.dtype)
        if IEEE:  # float32 operands (a bf16 q under the interpreter, whose bf16 tl.dot is wrong: attention._meta)
            s = tl.dot(q_l.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
            s += tl.dot(q_r.to(tl.float32), tl.trans(kr.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q_l, tl.trans(kv))
            s = tl.dot(q_r, tl.trans(kr), s)
        seen = mask_n[None, :] & (keys[None, :] <= pos[:, None])
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FUTURE:
            if start + BLOCK_N - 1 > first:  # (a tile past the first row's position)
                kv = tl.where((kv == kv) & (tl.abs(kv.to(tl.float32)) != float("inf")), kv, 0.0).to(kv.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype).to(tl.float32), kv.to(tl.float32),
                                                input_precision="ieee")
        else:
            acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _span(seq_len, num_parts, BLOCK_N: tl.constexpr):
    """The keys of a split: the sequence's key tiles shared out num_parts ways (whole tiles, at least one)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_parts), 1) * BLOCK_N


@triton.jit(do_not_specialize=["s_bt", "num_parts"])
def _decode_kernel(q_ptr, c_ptr, out_ptr, pacc_ptr, pml_ptr, tables_ptr, lens_ptr, qsl_ptr, qk_scale, num_heads,
                   num_parts, s_qt, s_qh, s_qd, s_ot, s_oh, s_od, s_bt, s_cb, s_cs, s_cd,
                   HEADS: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                   SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (head block, sequence b, split): the keys part * span..+span of b (span: b's key tiles shared out
    num_parts ways); b's query (if its query length is 1) of the HEADS heads hb * HEADS.. (rows of BLOCK_H >= 16,
    tl.dot's least, the rest masked). SPLIT: the partials at rows
    (b * num_heads + head) * num_parts + part of pacc [., BLOCK_L] and pml [., 2] (max, sum); a split past b's
    keys writes nothing (`_merge_kernel` reads the used ones only)."""
    pdl.start(PDL)
    hb, b, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    seq_len = tl.load(lens_ptr + b)
    if SPLIT:
        span = _span(seq_len, num_parts, BLOCK_N)
    else:
        span = seq_len
    lo = part * span
    if (tl.load(qsl_ptr + b + 1) - q_start == 1) & (lo < seq_len):
        rows = tl.arange(0, BLOCK_H)
        head = hb * HEADS + rows
        mask_h = (rows < HEADS) & (head < num_heads)
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        mask = mask_h[:, None] & (offs_l < LATENT)[None, :]
        tok = q_start.to(tl.int64)
        q_at = q_ptr + tok * s_qt + head[:, None] * s_qh
        q_l = tl.load(q_at + offs_l[None, :] * s_qd, mask=mask, other=0.0)
        q_r = tl.load(q_at + (LATENT + offs_r)[None, :] * s_qd, mask=mask_h[:, None] & (offs_r < ROPE)[None, :],
                      other=0.0)
        pos = tl.zeros((BLOCK_H,), tl.int32) + seq_len - 1
        m_i = tl.full((BLOCK_H,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q_l, q_r, pos, c_ptr, tables_ptr + b.to(tl.int64) * s_bt, lo,
                                      tl.minimum(seq_len, lo + span), s_cb, s_cs, s_cd, qk_scale, PAGE, BLOCK_N,
                                      LATENT, ROPE, BLOCK_L, BLOCK_R, IEEE, False)
        if SPLIT:
            prow = (b * num_heads + head).to(tl.int64) * num_parts + part
            tl.store(pacc_ptr + prow[:, None] * BLOCK_L + offs_l[None, :], acc, mask=mask)
            tl.store(pml_ptr + prow * 2, m_i, mask=mask_h)
            tl.store(pml_ptr + prow * 2 + 1, l_i, mask=mask_h)
        else:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + tok * s_ot + head[:, None] * s_oh + offs_l[None, :] * s_od,
                     acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_parts"])
def _merge_kernel(out_ptr, pacc_ptr, pml_ptr, lens_ptr, qsl_ptr, num_heads, num_parts, s_ot, s_oh, s_od,
                  BLOCK_N: tl.constexpr, LATENT: tl.constexpr, BLOCK_L: tl.constexpr, CHUNK: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Program (head, sequence b): b's output of that head from the partials of its splits that hold keys (as
    `_decode_kernel` cuts them), CHUNK at a time, by their max and sum (the generic decode's `_merge`)."""
    pdl.start(PDL)
    h, b = tl.program_id(0), tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    if tl.load(qsl_ptr + b + 1) - q_start == 1:
        seq_len = tl.load(lens_ptr + b)
        used = tl.cdiv(seq_len, _span(seq_len, num_parts, BLOCK_N))
        _merge(out_ptr + q_start.to(tl.int64) * s_ot, pacc_ptr, pml_ptr, h, (b * num_heads + h).to(tl.int64)
               * num_parts, used, s_oh, s_od, lens_ptr, BLOCK_L, LATENT, CHUNK)


@triton.jit(do_not_specialize=["num_seqs", "s_bt"])
def _prefill_kernel(q_ptr, c_ptr, out_ptr, tables_ptr, lens_ptr, qsl_ptr, num_seqs, qk_scale, num_heads,
                    s_qt, s_qh, s_qd, s_ot, s_oh, s_od, s_bt, s_cb, s_cs, s_cd,
                    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                    IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (tile, head block): tile is the sequence b's local-th tile of BLOCK_Q query tokens (b found by a
    binary search over query_start_loc); its rows the (token, head) pairs of those tokens and the block's heads."""
    pdl.start(PDL)
    tile, hb = tl.program_id(0), tl.program_id(1)
    b, q_start, n, local = _tile_of(qsl_ptr, num_seqs, tile, BLOCK_Q)
    if local * BLOCK_Q < n:
        seq_len = tl.load(lens_ptr + b)
        rows = tl.arange(0, BLOCK_Q * BLOCK_H)
        q_idx = local * BLOCK_Q + rows // BLOCK_H
        head = hb * BLOCK_H + rows % BLOCK_H
        mask_m = (q_idx < n) & (head < num_heads)
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        mask = mask_m[:, None] & (offs_l < LATENT)[None, :]
        tok = (q_start + q_idx).to(tl.int64)
        q_at = q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh
        q_l = tl.load(q_at + offs_l[None, :] * s_qd, mask=mask, other=0.0)
        q_r = tl.load(q_at + (LATENT + offs_r)[None, :] * s_qd, mask=mask_m[:, None] & (offs_r < ROPE)[None, :],
                      other=0.0)
        m_i = tl.full((BLOCK_Q * BLOCK_H,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_Q * BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_Q * BLOCK_H, BLOCK_L), tl.float32)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q_l, q_r, seq_len - n + q_idx, c_ptr,
                                      tables_ptr + b.to(tl.int64) * s_bt, 0,
                                      seq_len - n + tl.minimum(n, (local + 1) * BLOCK_Q), s_cb, s_cs, s_cd, qk_scale,
                                      PAGE, BLOCK_N, LATENT, ROPE, BLOCK_L, BLOCK_R, IEEE, True)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + offs_l[None, :] * s_od,
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(q: torch.Tensor, cache: torch.Tensor, latent_dim: int, out: torch.Tensor | None) -> None:
    """A ValueError naming what does not fit the MLA layout (q [T, H, L+R], cache [blocks, block_size, 1, L+R])."""
    if q.dim() != 3 or cache.dim() != 4:
        raise ValueError(f"mla_paged_attention takes q [T, H, L+R] and a cache [num_blocks, block_size, 1, L+R], "
                         f"not q {tuple(q.shape)} and a cache {tuple(cache.shape)}")
    if cache.shape[2] != 1 or cache.shape[3] != q.shape[2]:
        raise ValueError(f"the MLA cache holds one row of q's width {q.shape[2]} a token (one KV head): "
                         f"{tuple(cache.shape)} is not [num_blocks, block_size, 1, {q.shape[2]}]")
    if not 0 < latent_dim < q.shape[2]:
        raise ValueError(f"latent_dim {latent_dim}: give kv_lora_rank, between 1 and q's width {q.shape[2]} less "
                         f"the rotary dims (qk_rope_head_dim >= 1)")
    if cache.dtype != q.dtype and not reference.is_fp8(cache.dtype):
        raise ValueError(f"the cache's dtype {cache.dtype} differs from q's {q.dtype}: store the cache in q's dtype, "
                         f"or in float8 (torch.float8_e4m3fn, torch.float8_e5m2: --kv-cache-dtype fp8, fp8_e5m2)")
    want = (q.shape[0], q.shape[1], latent_dim)
    if out is not None and (tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {want} on {q.device}, not {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")


def _widths(q: torch.Tensor, cache: torch.Tensor, latent_dim: int) -> dict:
    """The kernels' width constexprs: L and R each padded to its own power of two (at least 16, tl.dot's K)."""
    rope = q.shape[2] - latent_dim
    return dict(PAGE=cache.shape[1], LATENT=latent_dim, ROPE=rope, BLOCK_L=max(16, next_power_of_2(latent_dim)),
                BLOCK_R=max(16, next_power_of_2(rope)), IEEE=q.dtype == torch.float32 or _interpreted_bf16(q),
                PDL=pdl.on(q.device), **pdl.launch(q.device))


def decode_tile(cache_dtype: torch.dtype) -> int:
    """Keys a decode tile over a cache of `cache_dtype`: BLOCK_N, FP8_BLOCK_N for a float8 one."""
    return FP8_BLOCK_N if reference.is_fp8(cache_dtype) else BLOCK_N


def decode_plan(num_seqs: int, num_heads: int, context: int, device: torch.device,
                block_n: int | None = None) -> tuple[int, int]:
    """(heads a program, splits a sequence) of a decode launch, from sizes only (the block tables' width: `context`
    keys; tiles of `block_n` keys, BLOCK_N by default: `decode_tile`). Heads: `head_block`'s, halved (down to 4)
    while the batch's head blocks x key tiles could not give every SM a program; splits: enough for batch x head
    blocks x splits to fill PROGRAMS_PER_SM_MLA programs an SM (`decode_parts`), at most one a key tile."""
    block_n = block_n or BLOCK_N
    sms = _decode_programs(device) // PROGRAMS_PER_SM
    heads, tiles = head_block(num_heads), cdiv(context, block_n)
    while heads > 4 and num_seqs * cdiv(num_heads, heads) * tiles < sms:
        heads //= 2
    blocks = cdiv(num_heads, heads)
    return heads, decode_parts(num_seqs, blocks, context, block_n, sms * PROGRAMS_PER_SM_MLA)


def _decode(q, cache, block_tables, seq_lens, query_start_loc, qk_scale, out, meta, parts: int | None = None,
            heads: int | None = None, compile_only: bool = False) -> None:
    """The decode launch(es): `heads` a program and `parts` splits a sequence (`decode_plan`'s by default), tiles
    of `decode_tile` keys; compile_only: compile both kernels, launch nothing."""
    num_seqs, num_heads, block_n = seq_lens.shape[0], q.shape[1], decode_tile(cache.dtype)
    plan = decode_plan(num_seqs, num_heads, block_tables.shape[1] * cache.shape[1], q.device, block_n)
    heads, parts = heads or plan[0], parts or plan[1]
    block_h = max(16, heads)
    if parts > 1:
        pacc = torch.empty(num_seqs, num_heads, parts, meta["BLOCK_L"], dtype=torch.float32, device=q.device)
        pml = torch.empty(num_seqs, num_heads, parts, 2, dtype=torch.float32, device=q.device)
    else:
        pacc = pml = out  # unused
    grid = (cdiv(num_heads, heads), num_seqs, parts)
    run = _decode_kernel.warmup if compile_only else _decode_kernel[grid]
    run(q, cache, out, pacc, pml, block_tables, seq_lens, query_start_loc, qk_scale, num_heads, parts,
        *q.stride(), *out.stride(), block_tables.stride(0), cache.stride(0), cache.stride(1), cache.stride(3),
        HEADS=heads, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=parts > 1, num_warps=4 if block_h <= 16 else 8,
        num_stages=2,        **meta, **({"grid": grid} if compile_only else {}))
    if parts > 1:
        grid = (num_heads, num_seqs)
        run = _merge_kernel.warmup if compile_only else _merge_kernel[grid]
        launch = {k: meta[k] for k in ("LATENT", "BLOCK_L", "PDL", "launch_pdl") if k in meta}
        run(out, pacc, pml, seq_lens, query_start_loc, num_heads, parts, *out.stride(), BLOCK_N=block_n,
            CHUNK=MERGE_CHUNK, num_warps=4, **launch, **({"grid": grid} if compile_only else {}))


def _prefill(q, cache, block_tables, seq_lens, query_start_loc, qk_scale, out, meta,
             compile_only: bool = False) -> None:
    """The prefill / mixed launch: tiles of BLOCK_Q tokens x BLOCK_H heads, 32 rows (a head block of 16 at most,
    so that a tile holds 2 tokens or more of a model with many heads)."""
    num_seqs, num_heads = seq_lens.shape[0], q.shape[1]
    block_h = min(16, next_power_of_2(num_heads))
    block_q = 32 // block_h
    grid = (q.shape[0] // block_q + num_seqs, cdiv(num_heads, block_h))
    run = _prefill_kernel.warmup if compile_only else _prefill_kernel[grid]
    run(q, cache, out, block_tables, seq_lens, query_start_loc, num_seqs, qk_scale, num_heads,
        *q.stride(), *out.stride(), block_tables.stride(0), cache.stride(0), cache.stride(1), cache.stride(3),
        BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=PREFILL_BLOCK_N, num_warps=8, num_stages=2, **meta,
        **({"grid": grid} if compile_only else {}))


def mla_paged_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, latent_dim: int,
                        max_query_len: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's absorbed paged attention: q [T, H, L+R] (L = latent_dim), cache [num_blocks, block_size, 1, L+R] in q's
    dtype or float8 (its values upcast exactly to q's dtype: the kernels read one byte an element); block_tables,
    seq_lens and query_start_loc as reference.paged_attention's. Returns out [T, H, L] (written in place when
    given): reference.paged_attention(q, cache, cache, ...)[..., :L], causal within each sequence's new tokens, the
    softmax in float32. Where kernels.use_triton(q) (CUDA tensors) the Triton kernels: the decode
    ones when max_query_len is 1, else the prefill kernel; pass max_query_len under a CUDA graph (None: read from
    query_start_loc, a host sync)."""
    _check(q, cache, latent_dim, out)
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if not kernels.use_triton(q):
        out.copy_(reference.paged_attention(q, cache, cache, block_tables, seq_lens, query_start_loc, scale,
                                            max_query_len)[..., :latent_dim])
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    launch = _decode if max_query_len == 1 else _prefill
    launch(q, cache, block_tables, seq_lens, query_start_loc, float(scale) * LOG2E, out,
           _widths(q, cache, latent_dim))
    return out
