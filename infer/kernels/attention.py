"""Triton paged attention over a flat batch that mixes decodes and prefill chunks with cached prefixes.

Same signature and semantics as `reference.paged_attention`. Two paths, both reading K/V through the block table
one key at a time (so any block size works) and keeping the softmax in float32 (online, base 2):

* decode only (max_query_len == 1), flash-decoding style: a program per (sequence, KV head, partition) computes
  the attention of all the query heads of that GQA group at once (K/V loaded once for the group). A sequence's
  keys are cut into `parts` partitions of whole key blocks by its own length (`decode_parts` picks the count at
  launch, from the batch's size: enough programs to fill the GPU), so a short context's few blocks go to as many
  programs rather than one program's loop; the program that finishes a sequence's partitions last merges their
  partial results by their max/sum (no second launch).
* otherwise one "unified" kernel, flash-attention style: a program per (tile of BLOCK_Q query tokens of one
  sequence, KV head), the tile's rows being every (token, query head of the group) pair; it walks the keys
  0..last position of the tile, causal. Programs find their sequence by a binary search over query_start_loc, so
  nothing is synchronised with the host.

Each kernel's PDL constexpr: launched with programmatic dependent launch (`pdl`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import fp8, pdl
from .gptq_gemm import _locks
from .intmath import PROGRAMS_PER_SM, cdiv, decode_parts, next_power_of_2

REDUCE_CHUNK = 16  # partitions the merge reads per step
_SMS: dict = {}  # device -> its SM count
LOG2E = 1.4426950408889634
# the decode kernel's LoRA variant: at most this many registers a thread (ptxas would take about 145 at 7B shapes,
# three programs per SM where the variant without adapters fits four; the excess spills outside the key loop)
LORA_MAX_REGS = 128


@triton.jit
def _capped(s, qk_scale, SOFTCAP: tl.constexpr):
    """The scores q.k scaled (base 2: qk_scale holds log2(e)), soft-capped where SOFTCAP > 0 (Gemma 2's
    attn_logit_softcapping times log2(e)): SOFTCAP * tanh(s * qk_scale / SOFTCAP), which is the cap of the natural
    score, cap * tanh(scale * q.k / cap), times log2(e). tanh(u) = 1 - 2 / (1 + exp(2u)), in float32."""
    s = s * qk_scale
    if SOFTCAP > 0:
        s = SOFTCAP - 2.0 * SOFTCAP / (1.0 + tl.exp(2.0 * s / SOFTCAP))
    return s


@triton.jit
def _attend_keys(acc, m_i, l_i, q, pos, k_ptr, v_ptr, table_ptr, kv_head, lo, hi,
                 s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, qk_scale,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 IEEE: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = 0,
                 FUTURE: tl.constexpr = False, CHUNKED: tl.constexpr = False):
    """Online softmax of the rows of q ([M, BLOCK_D], row i at position pos[i]) over keys lo..hi-1 (causal); the
    scores soft-capped where SOFTCAP > 0 (`_capped`); WINDOW > 0 (a sliding-window layer): row i over the keys
    pos[i] - WINDOW + 1..pos[i] only; CHUNKED too (Llama 4's chunked attention, WINDOW its chunk): over the keys of
    its chunk, pos[i] - pos[i] % WINDOW..pos[i] (`_chunk_start`).
    FUTURE: keys past some row's position (or, WINDOW > 0, before some row's window) may be in lo..hi-1 (a
    prefill's tile of queries): a value there that is not finite (a token the model overflowed on) is kept from the
    rows that do not attend to it, whose masked weights (0) would make it NaN in the product with the values; a row
    that attends to it gets NaN (as 0 x NaN would have).
    Returns acc, m_i, l_i and the rows that attended to a value that is not finite (FUTURE; else none)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    hit = tl.zeros(pos.shape, tl.int32)
    first = tl.min(pos, 0)  # every row attends to the keys up to here
    last = tl.max(pos, 0)  # (WINDOW: every row attends to the keys from last - WINDOW + 1 on)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        mask_n = keys < hi
        block = tl.load(table_ptr + keys // PAGE, mask=mask_n, other=0).to(tl.int64)
        slot = keys % PAGE
        k = tl.load(k_ptr + block[None, :] * s_kb + slot[None, :] * s_ks + kv_head * s_kh + offs_d[:, None] * s_kd,
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0).to(q.dtype)  # a float8 cache: exact
        if IEEE:  # float32 operands (exact for a bf16 q: the interpreter's bf16 tl.dot is wrong, see `_meta`)
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        seen = mask_n[None, :] & (keys[None, :] <= pos[:, None])
        if CHUNKED:
            seen = seen & (keys[None, :] >= _chunk_start(pos, WINDOW)[:, None])
        elif WINDOW > 0:
            seen = seen & (keys[None, :] > pos[:, None] - WINDOW)
        s = tl.where(seen, _capped(s, qk_scale, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * s_vb + slot[:, None] * s_vs + kv_head * s_vh + offs_d[None, :] * s_vd,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        if FUTURE:
            past = start + BLOCK_N - 1 > first  # (a tile of keys past the first row's position)
            if CHUNKED:  # or before the last row's chunk: masked for that row, 0 x NaN would reach it too
                past = past | (start < _chunk_start(last, WINDOW))
            elif WINDOW > 0:  # or before the last row's window: masked for that row, 0 x NaN would reach it too
                past = past | (start < last - WINDOW + 1)
            if past:
                bad = (v != v) | (tl.abs(v.to(tl.float32)) == float("inf"))
                v = tl.where(bad, 0.0, v).to(q.dtype)
                took = seen & (tl.max(bad.to(tl.int32), 1)[None, :] > 0)  # (rows that attend to such a key)
                hit = tl.maximum(hit, tl.max(took.to(tl.int32), 1))
        if IEEE:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            acc = acc * alpha[:, None] + pv
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i, hit


@triton.jit
def _chunk_start(pos, CHUNK: tl.constexpr):
    """The first position of the chunk of CHUNK positions that `pos` lies in (Llama 4's chunked attention)."""
    return pos - pos % CHUNK


@triton.jit
def _normed(acc, m_i, l_i, sink_ptr, head, mask, SINKS: tl.constexpr):
    """The softmax's output acc / l_i (rows of one query head each: head [M], `mask` the real ones); with SINKS
    (gpt-oss's attention sinks, sink_ptr [Hq] float32 in base-2 units: sinks * log2(e)) each row's denominator adds
    exp2(sink - m_i) (against the running max m_i, both rescaled to max(m_i, sink))."""
    if SINKS:
        sk = tl.load(sink_ptr + head, mask=mask, other=float("-inf"))
        top = tl.maximum(m_i, sk)
        rescale = tl.exp2(m_i - top)
        l_i = l_i * rescale + tl.exp2(sk - top)
        acc = acc * rescale[:, None]
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence b whose tiles hold `tile`: the last b with qsl[b] // BLOCK_Q + b <= tile."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _tile_of(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Program `tile`'s sequence b (`_find_seq`), b's first query token and query count, and the tile's index among
    b's tiles of BLOCK_Q queries (past b's queries: none are the tile's)."""
    b = _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    return b, q_start, tl.load(qsl_ptr + b + 1) - q_start, tile - (q_start // BLOCK_Q + b)


# Neither the batch size nor the block tables' width (their row stride s_bt: 1, or a multiple of 16, would each
# specialize) may compile a variant of its own on a user's request: warm_kernels() cannot reach every width.
@triton.jit(do_not_specialize=["num_seqs", "s_bt"])
def _unified_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, qsl_ptr, sink_ptr, num_seqs, qk_scale,
                    s_qt, s_qh, s_qd, s_ot, s_oh, s_od, s_bt,
                    s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
                    PDL: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = 0,
                    SINKS: tl.constexpr = False, CHUNKED: tl.constexpr = False):
    pdl.start(PDL)
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    b, q_start, n, local = _tile_of(qsl_ptr, num_seqs, tile, BLOCK_Q)
    if local * BLOCK_Q < n:
        seq_len = tl.load(lens_ptr + b)
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        q_idx = local * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        mask_m = (q_idx < n) & (rows % GROUP_PAD < GROUP)
        pos = seq_len - n + q_idx
        offs_d = tl.arange(0, BLOCK_D)
        mask = mask_m[:, None] & (offs_d[None, :] < HEAD_DIM)
        tok = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :] * s_qd, mask=mask,
                    other=0.0)
        m_i = tl.full((BLOCK_Q * GROUP_PAD,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_Q * GROUP_PAD,), tl.float32)
        acc = tl.zeros((BLOCK_Q * GROUP_PAD, BLOCK_D), tl.float32)
        hi = seq_len - n + tl.minimum(n, (local + 1) * BLOCK_Q)
        lo = 0
        if CHUNKED:  # the keys before the tile's first query's chunk are skipped (the rest masked per row)
            lo = _chunk_start(seq_len - n + local * BLOCK_Q, WINDOW)
        elif WINDOW > 0:  # the keys before the tile's first query's window are skipped (the rest masked per row)
            lo = tl.maximum(seq_len - n + local * BLOCK_Q - WINDOW + 1, 0)
        acc, m_i, l_i, hit = _attend_keys(acc, m_i, l_i, q, pos, k_ptr, v_ptr, tables_ptr + b.to(tl.int64) * s_bt,
                                          kv_head, lo, hi, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, qk_scale,
                                          PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, IEEE, SOFTCAP, WINDOW, FUTURE=True,
                                          CHUNKED=CHUNKED)
        acc = tl.where(hit[:, None] > 0, float("nan"), _normed(acc, m_i, l_i, sink_ptr, head, mask_m, SINKS))
        tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x, xp, cos, sin):
    """x rotated NeoX style, given its rotary partner xp (dimension d +- HALF) and per-dimension cos and signed sin
    (1 and 0 past the rotary dims): x*cos - x2*sin in the first half, x2*cos + x1*sin in the second, in float32,
    rounded to x's dtype as the reference returns it."""
    return (x.to(tl.float32) * cos + xp.to(tl.float32) * sin).to(x.dtype)


@triton.jit
def _cols_delta(h, b_ptr, width, cols, mask, rank, BLOCK_R: tl.constexpr):
    """h @ B^T[:, cols] for one token (h [BLOCK_R] float32, its products with A, zero past `rank`; b_ptr the slot's
    B^T [R, width] of one shard, rows past `rank` never read), float32, cols' shape ([BLOCK_D])."""
    r = tl.arange(0, BLOCK_R)
    bb = tl.load(b_ptr + r[:, None] * width + cols[None, :], mask=(r[:, None] < rank) & mask[None, :], other=0.0)
    return tl.sum(h[:, None] * bb.to(tl.float32), 0)


@triton.jit
def _pick(values, s, slot):
    return tl.sum(tl.where(s == slot, values, 0), 0)


@triton.jit
def _plus(x, d):
    return (x.to(tl.float32) + d).to(x.dtype)


@triton.jit
def _qkv_lora(q, qp, k, kp, v, slot, tok, kv_head, offs_d, partner, mask_d, rows, hp_ptr, lb_ptr,
              rank_q, rank_k, rank_v, scal_q, scal_k, scal_v, S, R, sh_p, sh_t, q_width, kv_width,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr):
    """The qkv layer's adapter delta of token `tok` (slot >= 0; a LoRADelta by token: hp [SPLIT, T, 3R], B^T of
    q, k and v shard after shard) added to its query heads of this KV head's group (q, and qp at the rotary partner
    dimensions, [GROUP_PAD, BLOCK_D]) and to its key (k, kp) and value, each rounded to its dtype as the layer's
    expand leaves them."""
    r = tl.arange(0, BLOCK_R)
    at = hp_ptr + tl.arange(0, SPLIT)[:, None] * sh_p + tok * sh_t + r[None, :]
    hq = tl.sum(tl.load(at, mask=r[None, :] < rank_q, other=0.0), 0)
    hk = tl.sum(tl.load(at + R, mask=r[None, :] < rank_k, other=0.0), 0)
    hv = tl.sum(tl.load(at + 2 * R, mask=r[None, :] < rank_v, other=0.0), 0)
    b_q = lb_ptr + slot.to(tl.int64) * R * q_width
    b_k = lb_ptr + tl.cast(S, tl.int64) * R * q_width + slot.to(tl.int64) * R * kv_width
    b_v = b_k + tl.cast(S, tl.int64) * R * kv_width
    c = kv_head * HEAD_DIM
    k = _plus(k, _cols_delta(hk, b_k, kv_width, c + offs_d, mask_d, rank_k, BLOCK_R) * scal_k)
    kp = _plus(kp, _cols_delta(hk, b_k, kv_width, c + partner, mask_d, rank_k, BLOCK_R) * scal_k)
    v = _plus(v, _cols_delta(hv, b_v, kv_width, c + offs_d, mask_d, rank_v, BLOCK_R) * scal_v)
    for gi in tl.static_range(GROUP):  # one query head of the group at a time: B^T's tile [BLOCK_R, BLOCK_D]
        cq = (kv_head * GROUP + gi) * HEAD_DIM
        one = rows[:, None] == gi  # (no float32 tile of the group's deltas: fewer registers, more programs per SM)
        q = tl.where(one, _plus(q, _cols_delta(hq, b_q, q_width, cq + offs_d, mask_d, rank_q, BLOCK_R)[None, :]
                                * scal_q), q)
        qp = tl.where(one, _plus(qp, _cols_delta(hq, b_q, q_width, cq + partner, mask_d, rank_q, BLOCK_R)[None, :]
                                 * scal_q), qp)
    return q, qp, k, kp, v


# eager decode steps (--eager) of any context compile two variants only (one partition, or several): the block
# table's width and the partition count are runtime integers, never specialized (nor the partials' stride sh_p,
# T x 3R: its divisibility by 16 follows T's parity at small ranks)
@triton.jit
def _merge(o_row, part_acc_ptr, part_ml_ptr, head, row0, used, s_oh, s_od, sink_ptr, BLOCK_D: tl.constexpr,
           HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, SINKS: tl.constexpr = False):
    """One query head's output (the token's row o_row) from its `used` partial results (rows row0..row0+used-1),
    CHUNK at a time (a running max and sum, as the attention itself keeps); read past L1 (other SMs wrote them)."""
    offs_d = tl.arange(0, BLOCK_D)
    m_run = tl.full((1,), float("-inf"), tl.float32)
    l_run = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for c in range(0, used, CHUNK):
        parts = c + tl.arange(0, CHUNK)
        valid = parts < used
        prow = row0 + parts
        m = tl.load(part_ml_ptr + prow * 2, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + prow * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.exp2(m_run - m_new)  # 0 on the first chunk (m_run is -inf there)
        w = tl.where(valid, tl.exp2(m - m_new), 0.0)
        a = tl.load(part_acc_ptr + prow[:, None] * BLOCK_D + offs_d[None, :], mask=valid[:, None], other=0.0,
                    cache_modifier=".cg")
        acc = acc * alpha + tl.sum(a * w[:, None], 0)
        l_run = l_run * alpha + tl.sum(l_s * w, 0)
        m_run = m_new
    if SINKS:  # (`_normed`'s sink, of this head)
        sk = tl.load(sink_ptr + head + tl.zeros((1,), tl.int32))
        top = tl.maximum(m_run, sk)
        acc = acc * tl.exp2(m_run - top)
        l_run = l_run * tl.exp2(m_run - top) + tl.exp2(sk - top)
    tl.store(o_row + head * s_oh + offs_d * s_od, (acc / l_run).to(o_row.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["s_bt", "num_parts", "sh_p"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, cnt_ptr, tables_ptr, lens_ptr, qsl_ptr,
                   sink_ptr, qk_scale, s_qt, s_qh, s_qd, s_ot, s_oh, s_od, s_bt,
                   s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, num_parts,
                   pos_ptr, kn_ptr, vn_ptr, cs_ptr, slot_ptr, s_kn, s_vn, s_cs,
                   hp_ptr, lb_ptr, ls_ptr, lr_ptr, lc_ptr, S, R, sh_p, sh_t, sr_i, sr_s, sc_i, sc_s, q_width, kv_width,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr,
                   IEEE: tl.constexpr, ROPE: tl.constexpr = False, HALF: tl.constexpr = 1,
                   LORA: tl.constexpr = False, LSPLIT: tl.constexpr = 1, BLOCK_R: tl.constexpr = 16,
                   S_P2: tl.constexpr = 2, PDL: tl.constexpr = False, FP8: tl.constexpr = 0,
                   SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = 0, SINKS: tl.constexpr = False,
                   CHUNKED: tl.constexpr = False):
    """With ROPE (`decode_attention`): q is the unrotated query, and the step's own key and value (token rows
    kn/vn, s_kn/s_vn apart; head h at h * HEAD_DIM) are rotated here by the token's position (cos | sin rows of
    cs_ptr, s_cs apart; HALF = rotary dims / 2) and written into the cache slot slot_ptr[token] (-1: none) by the
    program whose partition holds the query's position; that program attends to the new key from its registers
    and to the cache's keys before it, so nothing reads the slot this launch writes. With LORA too, the qkv
    layer's adapter delta (a LoRADelta by token: partials hp, B^T lb, token slots ls, ranks lr and scalings lc
    [3, S]; q_width and kv_width the shards' columns) is added to q, k and v first (`_qkv_lora`).
    SPLIT (num_parts > 1): partition `part` of a sequence takes `span` keys from part * span, span being the
    sequence's key blocks shared out num_parts ways (whole blocks of BLOCK_N); where one partition holds them all it
    writes the output, else each stores its partial result and the last to count itself in at cnt_ptr (one counter
    per sequence and KV head, zero between launches) merges them (`_merge`) and resets the counter. FP8: the
    caches' float8 format (fp8.code; 0: none): the new key and value are rounded to it (fp8.to_cache) before
    they are written and attended, as every key the cache holds. SOFTCAP: the scores soft-capped (`_capped`).
    WINDOW > 0 (a sliding-window layer): the query attends to the last WINDOW keys only, seq_len - WINDOW on (the
    partitions share out those keys; the blocks before them are never read); CHUNKED too: the keys of its chunk
    (`_chunk_start` of its position seq_len - 1) only. SINKS: each head's denominator adds
    its sink (`_normed`; the merge too)."""
    pdl.start(PDL)
    b, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    seq_len = tl.load(lens_ptr + b)
    base = 0
    if CHUNKED:
        base = _chunk_start(seq_len - 1, WINDOW)
    elif WINDOW > 0:
        base = tl.maximum(seq_len - WINDOW, 0)
    if SPLIT:
        span = tl.maximum(tl.cdiv(tl.cdiv(seq_len - base, BLOCK_N), num_parts), 1) * BLOCK_N
    else:
        span = seq_len - base
    lo = base + part * span
    if (tl.load(qsl_ptr + b + 1) - q_start == 1) & (lo < seq_len):
        rows = tl.arange(0, GROUP_PAD)
        head = kv_head * GROUP + rows
        mask_m = rows < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask = mask_m[:, None] & (offs_d[None, :] < HEAD_DIM)
        tok = q_start.to(tl.int64)
        q_at = q_ptr + tok * s_qt + head[:, None] * s_qh
        hi = tl.minimum(seq_len, lo + span)
        if ROPE:
            mask_d = offs_d < HEAD_DIM
            rot = offs_d < 2 * HALF
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, tl.where(rot, offs_d - HALF, offs_d))
            j = tl.where(first, offs_d, offs_d - HALF)
            at = tl.load(pos_ptr + tok).to(tl.int64) * s_cs
            cos = tl.load(cs_ptr + at + j, mask=rot & mask_d, other=1.0).to(tl.float32)
            sin = tl.load(cs_ptr + at + HALF + j, mask=rot & mask_d, other=0.0).to(tl.float32)
            sin = tl.where(first, -sin, sin)
            q = tl.load(q_at + offs_d[None, :] * s_qd, mask=mask, other=0.0)
            qp = tl.load(q_at + partner[None, :] * s_qd, mask=mask, other=0.0)
            k_at = kn_ptr + tok * s_kn + kv_head * HEAD_DIM
            k_new = tl.load(k_at + offs_d, mask=mask_d, other=0.0)
            kp = tl.load(k_at + partner, mask=mask_d, other=0.0)
            v_new = tl.load(vn_ptr + tok * s_vn + kv_head * HEAD_DIM + offs_d, mask=mask_d, other=0.0)
            if LORA:
                # the token's slot, and every slot's ranks and scalings of the three shards (picked by the slot
                # after), requested beside q, k and v: the partials and B's tiles then wait for one round trip
                slot = tl.load(ls_ptr + tok).to(tl.int32)
                sl = tl.arange(0, S_P2)
                live = sl < S
                r_q = tl.load(lr_ptr + sl * sr_s, mask=live, other=0)
                r_k = tl.load(lr_ptr + sr_i + sl * sr_s, mask=live, other=0)
                r_v = tl.load(lr_ptr + 2 * sr_i + sl * sr_s, mask=live, other=0)
                c_q = tl.load(lc_ptr + sl * sc_s, mask=live, other=0.0)
                c_k = tl.load(lc_ptr + sc_i + sl * sc_s, mask=live, other=0.0)
                c_v = tl.load(lc_ptr + 2 * sc_i + sl * sc_s, mask=live, other=0.0)
                if slot >= 0:
                    q, qp, k_new, kp, v_new = _qkv_lora(
                        q, qp, k_new, kp, v_new, slot, tok, kv_head, offs_d, partner, mask_d, rows, hp_ptr, lb_ptr,
                        _pick(r_q, sl, slot), _pick(r_k, sl, slot), _pick(r_v, sl, slot),
                        _pick(c_q, sl, slot), _pick(c_k, sl, slot), _pick(c_v, sl, slot),
                        S, R, sh_p, sh_t, q_width, kv_width, GROUP, HEAD_DIM, LSPLIT, BLOCK_R)
            q = _rotate(q, qp, cos[None, :], sin[None, :])
            k_new = fp8.to_cache(_rotate(k_new, kp, cos, sin), k_ptr, FP8)
            v_new = fp8.to_cache(v_new, v_ptr, FP8)
            own = hi == seq_len  # this partition holds the query's position, seq_len - 1: the new key
            if own:
                slot_kv = tl.load(slot_ptr + tok).to(tl.int64)  # block x stride past 2**31 (an int32 slot_mapping)
                if slot_kv >= 0:
                    blk, off = slot_kv // PAGE, slot_kv % PAGE
                    tl.store(k_ptr + blk * s_kb + off * s_ks + kv_head * s_kh + offs_d * s_kd, k_new, mask=mask_d)
                    tl.store(v_ptr + blk * s_vb + off * s_vs + kv_head * s_vh + offs_d * s_vd, v_new, mask=mask_d)
                hi = seq_len - 1  # the cache's keys before it
        else:
            q = tl.load(q_at + offs_d[None, :] * s_qd, mask=mask, other=0.0)
        pos = tl.zeros((GROUP_PAD,), tl.int32) + seq_len - 1
        m_i = tl.full((GROUP_PAD,), -1.0e30, tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
        if ROPE:
            if own:  # the new key first (the online softmax takes keys in any order): its score is the running max,
                # its weight 1, and k_new, v_new are dead before the key loop (fewer registers held through it)
                m_i = _capped(tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1), qk_scale, SOFTCAP)
                l_i = tl.full((GROUP_PAD,), 1.0, tl.float32)
                acc = acc + v_new.to(tl.float32)[None, :]
        acc, m_i, l_i, _ = _attend_keys(acc, m_i, l_i, q, pos, k_ptr, v_ptr, tables_ptr + b.to(tl.int64) * s_bt,
                                        kv_head, lo, hi, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, qk_scale,
                                        PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, IEEE, SOFTCAP, WINDOW,
                                        CHUNKED=CHUNKED)
        if SPLIT:
            used = tl.cdiv(seq_len - base, span)  # the sequence's partitions that hold keys (>= 1)
        else:
            used = 1
        if used == 1:
            acc = _normed(acc, m_i, l_i, sink_ptr, head, mask_m, SINKS)
            tl.store(out_ptr + tok * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # partials laid out [B, Hq, num_parts, BLOCK_D] and [B, Hq, num_parts, 2] (max, sum)
            row0 = (b * (tl.num_programs(1) * GROUP) + head).to(tl.int64) * num_parts
            prow = row0 + part
            tl.store(part_acc_ptr + prow[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_m[:, None])
            tl.store(part_ml_ptr + prow * 2, m_i, mask=mask_m)
            tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=mask_m)
            tl.debug_barrier()  # every thread's partial is written before the counter moves (release below)
            cnt = cnt_ptr + b * tl.num_programs(1) + kv_head
            if tl.atomic_add(cnt, 1, sem="acq_rel") == used - 1:  # the last partition: merge every head's
                o_row = out_ptr + tok * s_ot
                for gi in tl.static_range(GROUP):
                    h = kv_head * GROUP + gi
                    _merge(o_row, part_acc_ptr, part_ml_ptr, h, (b * (tl.num_programs(1) * GROUP) + h).to(tl.int64)
                           * num_parts, used, s_oh, s_od, sink_ptr, BLOCK_D, HEAD_DIM, CHUNK, SINKS)
                tl.atomic_xchg(cnt, 0)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _decode_programs(device: torch.device) -> int:
    """Decode attention programs the device runs at once (PROGRAMS_PER_SM per SM; an H100's 132 SMs for the
    interpreter)."""
    sms = _SMS.get(device)
    if sms is None:
        sms = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 132
    return PROGRAMS_PER_SM * sms


def _decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, qk_scale, out, meta, rope=None, lora=None,
            compile_only: bool = False, parts: int | None = None, sinks=None) -> None:
    """rope: (positions, k rows [T, Hk*D], v rows, cos_sin [P, rot_dim], slot_mapping) for `decode_attention`;
    lora: the qkv layer's LoRADelta there. compile_only: compile the decode kernel, launch nothing. parts: the
    partitions a sequence's keys are cut into (`decode_parts` by default). sinks: `_sink_logits`' (or None)."""
    num_seqs, hk = seq_lens.shape[0], k_cache.shape[2]
    if parts is None:
        parts = decode_parts(num_seqs, hk, block_tables.shape[1] * k_cache.shape[1], meta["BLOCK_N"],
                             _decode_programs(q.device))
    if parts > 1:
        hq = q.shape[1]
        part_acc = torch.empty(num_seqs, hq, parts, meta["BLOCK_D"], dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, hq, parts, 2, dtype=torch.float32, device=q.device)
        counters = _locks(q.device, num_seqs * hk, "attention")
    else:
        part_acc = part_ml = out  # unused
        counters = seq_lens  # unused
    if rope is None:
        extra = (seq_lens, q, q, seq_lens, seq_lens, 0, 0, 0)  # unused
    else:
        positions, k, v, cos_sin, slots = rope
        extra = (positions, k, v, cos_sin, slots, k.stride(0), v.stride(0), cos_sin.stride(0))
        meta = dict(meta, ROPE=True, HALF=cos_sin.shape[-1] // 2, FP8=fp8.code(k_cache.dtype))
    if lora is None:
        extra += (seq_lens,) * 5 + (0,) * 10  # unused
    else:
        split, _, nr = lora.hp.shape
        num_slots = lora.scalings.shape[1]
        extra += (lora.hp, lora.lora_b, lora.token_slots, lora.ranks, lora.scalings, num_slots, nr // 3,
                  lora.hp.stride(0), lora.hp.stride(1), *lora.ranks.stride(), *lora.scalings.stride(),
                  lora.bounds[1], lora.bounds[2] - lora.bounds[1])
        meta = dict(meta, LORA=True, LSPLIT=split, BLOCK_R=max(16, next_power_of_2(nr // 3)),
                    S_P2=max(2, next_power_of_2(num_slots)), maxnreg=LORA_MAX_REGS)
    grid = (num_seqs, hk, parts)
    run = _decode_kernel.warmup if compile_only else _decode_kernel[grid]
    run(q, k_cache, v_cache, out, part_acc, part_ml, counters, block_tables, seq_lens, query_start_loc,
        seq_lens if sinks is None else sinks, qk_scale,
        *_strides(q), *_strides(out), block_tables.stride(0), *_strides(k_cache), *_strides(v_cache), parts,
        *extra, SPLIT=parts > 1, CHUNK=REDUCE_CHUNK, **meta, **({"grid": grid} if compile_only else {}))


def _unified(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, qk_scale, out, max_query_len,
             meta, sinks=None) -> None:
    group_pad = meta["GROUP_PAD"]
    rows_max = max(64, group_pad)  # rows (token x head pairs) per tile
    # two tile heights only (short and long queries), so `LLMEngine.warm_kernels()` compiles every variant a step
    # can need
    block_q = max(1, min(16 if max_query_len <= 16 else 64, rows_max // group_pad))
    block_q = max(block_q, 16 // min(group_pad, 16))  # tl.dot needs at least 16 rows
    num_seqs = seq_lens.shape[0]
    grid = (q.shape[0] // block_q + num_seqs, k_cache.shape[2])
    _unified_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, seq_lens if sinks is None else sinks,
        num_seqs, qk_scale,
        *_strides(q), *_strides(out), block_tables.stride(0), *_strides(k_cache), *_strides(v_cache),
        BLOCK_Q=block_q, **meta)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int | None = None, softcap: float = 0.0, window: int = 0,
                    sinks: torch.Tensor | None = None, chunked: bool = False) -> torch.Tensor:
    """Triton version of reference.paged_attention: q [T, Hq, D], caches [num_blocks, block_size, Hk, D]."""
    out = torch.empty_like(q)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    meta = _meta(q, k_cache, softcap, window, sinks, chunked)
    qk_scale = float(scale) * LOG2E
    sinks = _sink_logits(sinks)
    if max_query_len == 1:
        _decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, qk_scale, out, meta, sinks=sinks)
    else:
        meta["GROUP_PAD"] = next_power_of_2(meta["GROUP"])
        _unified(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, qk_scale, out, max_query_len, meta,
                 sinks)
    return out


def _interpreted_bf16(q: torch.Tensor) -> bool:
    """A bf16 q under TRITON_INTERPRET, whose bf16 tl.dot is wrong (as `gptq_gemm`'s DOT_F32): the kernels then
    take the IEEE path, which multiplies the same bf16 values (and p rounded to bf16) in float32."""
    return q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _sink_logits(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """gpt-oss's sinks [Hq] as the kernels read them: float32, in the base-2 units of their softmax (x log2(e))."""
    return None if sinks is None else sinks.float() * LOG2E


def _meta(q: torch.Tensor, k_cache: torch.Tensor, softcap: float = 0.0, window: int = 0, sinks=None,
          chunked: bool = False) -> dict:
    hq, hk, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    group = hq // hk
    meta = dict(GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), PAGE=k_cache.shape[1],
                BLOCK_N=32 if head_dim > 128 else 64, BLOCK_D=max(16, next_power_of_2(head_dim)),
                HEAD_DIM=head_dim, IEEE=q.dtype == torch.float32 or _interpreted_bf16(q), PDL=pdl.on(q.device),
                **pdl.launch(q.device))
    if softcap:  # Gemma 2's soft-capped scores, in the base-2 units of the kernels' softmax: a variant of its own
        meta["SOFTCAP"] = float(softcap) * LOG2E
    if window:  # a sliding-window layer's window: a variant of its own (full layers compile the kernels as before)
        meta["WINDOW"] = int(window)
        if chunked:  # (Llama 4's chunked attention: the window its chunk, a variant of its own)
            meta["CHUNKED"] = True
    if sinks is not None:  # gpt-oss's attention sinks: a variant of its own
        meta["SINKS"] = True
    return meta


def decode_attention(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, lora=None,
                     compile_only: bool = False, parts: int | None = None, softcap: float = 0.0,
                     window: int = 0, sinks: torch.Tensor | None = None, chunked: bool = False) -> torch.Tensor:
    """Triton version of reference.decode_attention, in one launch: the
    rotary embedding, the KV-cache write and the decode attention of `rotary_store_kv` then `paged_attention`,
    without the rotated q's and k's round trip through memory; with `lora` (the qkv layer's LoRADelta, by token),
    its delta added to q, k and v first (the layer's expand needs no launch of its own). q [T, Hq*D], k and v
    [T, Hk*D] (rows of the qkv output: any row stride); returns [T, Hq, D]. compile_only: compile the kernel this
    call would launch, launch nothing (the output is then unwritten); parts: its partitions a sequence (by
    default `decode_parts`: a compile names 1 and 2 to reach both variants)."""
    t = q.shape[0]
    q3 = q.view(t, -1, head_dim)
    out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    if t == 0 or seq_lens.shape[0] == 0:
        return out
    k2, v2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (k.view(t, -1), v.view(t, -1)))
    if k2.shape[1] != k_cache.shape[2] * head_dim or v2.shape[1] != v_cache.shape[2] * head_dim:
        raise ValueError(f"k/v of width {k2.shape[1]}/{v2.shape[1]} do not match the cache's "
                         f"{tuple(k_cache.shape[-2:])}")
    if lora is not None:
        width_q, width_kv = q3.shape[1] * head_dim, k2.shape[1]
        want = [0, width_q, width_q + width_kv, width_q + 2 * width_kv]
        if list(lora.bounds) != want or lora.hp.shape[1] != t:
            raise ValueError(f"decode_attention adds the delta of a q|k|v layer of bounds {want} for {t} tokens, "
                             f"not of bounds {list(lora.bounds)} for {lora.hp.shape[1]}")
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    _decode(q3, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale) * LOG2E, out,
            _meta(q3, k_cache, softcap, window, sinks, chunked), rope=(positions, k2, v2, cache, slot_mapping),
            lora=lora,
            compile_only=compile_only, parts=parts, sinks=_sink_logits(sinks))
    return out
