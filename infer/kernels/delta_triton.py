"""Triton kernels of a Gated DeltaNet layer's decode step (Qwen3.5's and Qwen3-Next's linear attention), in the
manner of flash-linear-attention's fused recurrent form and vLLM's causal_conv1d_update: the states are read and
written in place at each sequence's slot of the pool (`slots`, a tensor: a CUDA graph replays them through its static
buffer), zero where a sequence's step starts from zero state (`kept` False: masked loads, so a slot that holds NaN
gives zero, as the reference's torch.where). Padding rows of a graph's step name the model's padding slot (several
rows may write it: it is never read as a state).

Same semantics as their references in `delta_rule.py` (causal_conv1d_update, recurrent_gated_delta_rule_slots):
float32 arithmetic, each output rounded once to its tensor's dtype (the conv's output to the weight's dtype first,
as F.conv1d rounds it, before the silu)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .intmath import cdiv, next_power_of_2

def _vectors(*xs: torch.Tensor) -> list[torch.Tensor]:
    """The per-sequence vectors (slots, kept, query_start_loc) as the kernels index them: unit stride (a strided
    view, say every other entry of a tensor, copied; no copy, so no work in a CUDA graph, for the usual ones)."""
    return [x.contiguous() for x in xs]


CONV_BLOCK = 256  # channels a causal_conv1d_update program computes
VALUE_BLOCK = 32  # value columns of a recurrent program's state tile [Dk, VALUE_BLOCK] (float32 in registers)


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, out_ptr, state_ptr, slots_ptr, kept_ptr, bias_ptr, channels, s_x, s_o, s_w, s_s,
                        s_sc, TAPS: tl.constexpr, TAPS_P2: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SILU: tl.constexpr):
    """One sequence's token, BLOCK channels: out = silu(w[:, :K-1] . state + w[:, K-1] x) (without silu where not
    SILU: LFM2's); the state shifted by one token (its oldest column dropped, x the newest)."""
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, TAPS_P2)
    mask = offs < channels
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kept = tl.load(kept_ptr + b).to(tl.int32) != 0
    x = tl.load(x_ptr + b * s_x + offs, mask=mask, other=0.0)
    rows = state_ptr + slot * s_s + offs[:, None] * s_sc
    old_mask = mask[:, None] & (cols[None, :] < tl.where(kept, TAPS - 1, 0))  # (no state columns where not kept)
    old = tl.load(rows + cols[None, :], mask=old_mask, other=0.0)
    # the state after this token: column j holds the old column j + 1, the last one x
    shift_mask = mask[:, None] & (cols[None, :] < tl.where(kept, TAPS - 2, 0))
    shifted = tl.load(rows + cols[None, :] + 1, mask=shift_mask, other=0.0)
    new = tl.where(cols[None, :] == TAPS - 2, x.to(state_ptr.dtype.element_ty)[:, None], shifted)
    w = tl.load(w_ptr + offs[:, None] * s_w + cols[None, :], mask=mask[:, None] & (cols[None, :] < TAPS - 1),
                other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + offs * s_w + TAPS - 1, mask=mask, other=0.0).to(tl.float32)
    acc = tl.sum(w * old.to(w_ptr.dtype.element_ty).to(tl.float32), axis=1)
    acc += w_last * x.to(w_ptr.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:  # (Mamba-2's conv1d bias, added before the rounding as F.conv1d adds it)
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * s_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()  # (every thread's reads of the state before any write: another thread may hold a column)
    tl.store(rows + cols[None, :], new, mask=mask[:, None] & (cols[None, :] < TAPS - 1))


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                         kept: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """delta_rule.causal_conv1d_update in one launch: x [B, C] (unit stride along C), weight [C, 1, K], states
    [slots, C, K - 1] written in place at `slots` [B]; `kept` [B] bool; `bias` [C] or None (Mamba-2's conv has
    one). Returns silu(conv) [B, C] (the conv itself where not `silu`: LFM2's) in x's dtype."""
    b, c = x.shape
    taps = weight.shape[-1]
    slots, kept = _vectors(slots, kept)
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert states.stride(-1) == 1 and weight.stride(-1) == 1 and taps >= 2, "contiguous conv state and weight"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if b:
        _conv_update_kernel[(b, cdiv(c, CONV_BLOCK))](
            x, weight, out, states, slots, kept, weight if bias is None else bias, c, x.stride(0), out.stride(0),
            weight.stride(0), states.stride(0), states.stride(1), TAPS=taps, TAPS_P2=next_power_of_2(taps - 1),
            BLOCK=CONV_BLOCK, HAS_BIAS=bias is not None, SILU=silu)
    return out


VARLEN_TOKENS = 32  # tokens of a causal_conv1d_varlen program (at least K - 1: only a sequence's first tile reads
VARLEN_CHANNELS = 128  # its state)


@triton.jit
def _conv_varlen_kernel(x_ptr, w_ptr, out_ptr, state_ptr, starts_ptr, slots_ptr, kept_ptr, bias_ptr, channels, s_x, s_o,
                        s_w, s_s, s_sc, TAPS: tl.constexpr, TAPS_P2: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """BT tokens of one sequence, BC channels: each token's conv over the K - 1 inputs before it (from x inside the
    sequence, from the slot's state before its start: zero where not kept) and itself, silu (where SILU); the first
    tile also writes the state after its last token (its K - 1 last inputs), after every read of the old one."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    offs_c = tl.program_id(2) * BC + tl.arange(0, BC)
    mc = offs_c < channels
    start = tl.load(starts_ptr + seq).to(tl.int64)  # (token rows in int64: T x x's row stride passes 2^31 at
    end = tl.load(starts_ptr + seq + 1).to(tl.int64)  # 174,763 tokens of Qwen3.5-9B's in_proj_qkv view, stride 12288)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    kept = tl.load(kept_ptr + seq).to(tl.int32) != 0
    rows = state_ptr + slot * s_s + offs_c * s_sc
    lo = tl.where(kept, start - (TAPS - 1), start)  # the first input a token may read (the state's only where kept)
    t0 = start + tile * BT
    if t0 < end:
        offs_t = t0 + tl.arange(0, BT)
        mt = offs_t < end
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(TAPS):
            p = offs_t - (TAPS - 1) + j  # the input tap j multiplies
            xv = tl.load(x_ptr + p[:, None] * s_x + offs_c[None, :], mask=(mt & (p >= start))[:, None] & mc[None, :],
                         other=0.0)
            sv = tl.load(rows[None, :] + (TAPS - 1 + p - start)[:, None],
                         mask=(mt & (p < start) & (p >= lo))[:, None] & mc[None, :], other=0.0)
            w = tl.load(w_ptr + offs_c * s_w + j, mask=mc, other=0.0).to(tl.float32)
            acc += w[None, :] * (xv.to(w_ptr.dtype.element_ty).to(tl.float32)
                                 + sv.to(w_ptr.dtype.element_ty).to(tl.float32))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
        acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + offs_t[:, None] * s_o + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mt[:, None] & mc[None, :])
    if tile == 0:
        cols = tl.arange(0, TAPS_P2)
        p = end - (TAPS - 1) + cols  # the input state column i holds after the sequence
        mcol = cols < TAPS - 1
        xv = tl.load(x_ptr + p[None, :] * s_x + offs_c[:, None], mask=mc[:, None] & (mcol & (p >= start))[None, :],
                     other=0.0)
        sv = tl.load(rows[:, None] + (TAPS - 1 + p - start)[None, :],
                     mask=mc[:, None] & (mcol & (p < start) & (p >= lo))[None, :], other=0.0)
        new = tl.where((p >= start)[None, :], xv.to(state_ptr.dtype.element_ty), sv)
        tl.debug_barrier()  # (every read of the old state, this program's outputs' included, before the write)
        tl.store(rows[:, None] + cols[None, :], new, mask=mc[:, None] & mcol[None, :])


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, query_start_loc: torch.Tensor,
                         slots: torch.Tensor, kept: torch.Tensor, max_len: int,
                         bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """delta_rule.causal_conv1d_varlen in one launch: x [T, C] (unit stride along C), each sequence's tokens
    query_start_loc[i]:query_start_loc[i + 1] (at most `max_len`) after its conv state at slots[i] (zero where not
    kept[i]), the states after them written in place; `bias` [C] or None. Returns silu(conv) [T, C] (the conv
    itself where not `silu`: LFM2's) in x's dtype."""
    c, taps = x.shape[1], weight.shape[-1]
    query_start_loc, slots, kept = _vectors(query_start_loc, slots, kept)
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert states.stride(-1) == 1 and weight.stride(-1) == 1 and taps - 1 <= VARLEN_TOKENS, "conv state, weight"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = slots.shape[0]
    if n and max_len > 0:
        _conv_varlen_kernel[(n, cdiv(max_len, VARLEN_TOKENS), cdiv(c, VARLEN_CHANNELS))](
            x, weight, out, states, query_start_loc, slots, kept, weight if bias is None else bias, c, x.stride(0),
            out.stride(0), weight.stride(0), states.stride(0), states.stride(1), TAPS=taps,
            TAPS_P2=next_power_of_2(taps - 1), BT=VARLEN_TOKENS, BC=VARLEN_CHANNELS, HAS_BIAS=bias is not None,
            SILU=silu)
    return out


@triton.jit
def _l2normed(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _head_tile(dk, dv, BK: tl.constexpr, BV: tl.constexpr):
    """The key offsets [BK] and this program's value columns [BV] (its third grid axis), each with its mask."""
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    return offs_k, offs_v, offs_k < dk, offs_v < dv


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, kept_ptr, dk, dv, root,
                      s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_bb, s_ob, s_oh, s_s, s_sh, s_sk,
                      GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One sequence's token, one value head, BV value columns: the state tile [Dk, BV] loaded from the slot (zero
    where not kept), decayed by exp(g), corrected by the delta rule (k L2-normed, beta), read by q (L2-normed,
    divided by sqrt(Dk)); the output and the tile stored."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP  # (the key head of value head h: transformers' repeat_interleave)
    offs_k, offs_v, mk, mv = _head_tile(dk, dv, BK, BV)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kept = tl.load(kept_ptr + b).to(tl.int32) != 0
    q = tl.load(q_ptr + b * s_qb + hk * s_qh + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * s_kb + hk * s_kh + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * s_vb + h * s_vh + offs_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * s_gb + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * s_bb + h).to(tl.float32)
    q = _l2normed(q) / root
    k = _l2normed(k)
    tile = state_ptr + slot * s_s + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(tile, mask=(offs_k < tl.where(kept, dk, 0))[:, None] & mv[None, :], other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + b * s_ob + h * s_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)
    tl.store(tile, s, mask=mask)


def recurrent_gated_delta_rule_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                                     kept: torch.Tensor) -> torch.Tensor:
    """delta_rule.recurrent_gated_delta_rule_slots in one launch: q, k [B, Hk, Dk], v [B, Hv, Dv] (each unit stride
    along its last dim), g and beta [B, Hv], states [slots, Hv, Dk, Dv] float32 written in place at `slots` [B];
    `kept` [B] bool. Returns o [B, Hv, Dv] in v's dtype."""
    bsz, hv, dv = v.shape
    hk, dk = k.shape[1], k.shape[2]
    slots, kept = _vectors(slots, kept)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, beta))
    assert states.dtype == torch.float32 and states.stride(-1) == 1, "float32 states, unit stride along Dv"
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    bv = min(VALUE_BLOCK, next_power_of_2(dv))
    if bsz:
        _recurrent_kernel[(bsz, hv, cdiv(dv, bv))](
            q, k, v, g, beta, out, states, slots, kept, dk, dv, float(dk ** 0.5),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2),
            GROUP=hv // hk, BK=next_power_of_2(dk), BV=bv)
    return out


CHUNK = 64  # tokens of a chunk of the chunked rule (delta_rule.chunk_layout's)
# software-pipeline stages of _chunk_h_kernel's loop over chunks: each stage buffers a chunk's w, u and kd tiles in
# shared memory (Dk 128, value tile 32, float32: 88 KiB at 2 stages; Triton's default 3 take 160 KiB, more than an
# sm_86 / sm_89 GPU's 99 KiB a block, so the launch would fail there)
CHUNK_H_STAGES = 2
SOLVE_BLOCK = 16  # rows of the diagonal blocks _unit_lower_inverse inverts by substitution (tl.dot's smallest tile)
TERMS_WARPS = 4  # warps of a _chunk_terms_kernel program (a chunk's [C, Dk] q and k, [C, C] system in registers)


@triton.jit
def _chunk_h_kernel(w_ptr, u_ptr, kd_ptr, last_ptr, h_ptr, vn_ptr, state_ptr, first_ptr, slots_ptr, kept_ptr,
                    dk, dv, nc, s_s, s_sh, s_sk, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The inter-chunk recurrence of one sequence, one value head, BV value columns (flash-linear-attention's
    chunk_delta_h): the state tile [Dk, BV] from the slot (zero where not kept), then chunk by chunk: h (the state
    before the chunk) stored, v_new = u - w h stored, the state decayed by the chunk's total decay plus kd^T v_new;
    the state after the last chunk stored at the slot."""
    b = tl.program_id(0)
    hh = tl.program_id(1)
    offs_c = tl.arange(0, C)
    offs_k, offs_v, mk, mv = _head_tile(dk, dv, BK, BV)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kept = tl.load(kept_ptr + b).to(tl.int32) != 0
    tile = state_ptr + slot * s_s + hh * s_sh + offs_k[:, None] * s_sk + offs_v[None, :]
    s = tl.load(tile, mask=(offs_k < tl.where(kept, dk, 0))[:, None] & mv[None, :], other=0.0)
    c0 = tl.load(first_ptr + b)
    c1 = tl.load(first_ptr + b + 1)
    for c in range(c0, c1):
        base = (hh * nc + c).to(tl.int64)
        tl.store(h_ptr + base * dk * dv + offs_k[:, None] * dv + offs_v[None, :], s, mask=mk[:, None] & mv[None, :])
        keys = base * C * dk + offs_c[:, None] * dk + offs_k[None, :]
        vals = base * C * dv + offs_c[:, None] * dv + offs_v[None, :]
        w = tl.load(w_ptr + keys, mask=mk[None, :], other=0.0)
        u = tl.load(u_ptr + vals, mask=mv[None, :], other=0.0)
        v_new = u - tl.dot(w, s, input_precision="ieee")
        tl.store(vn_ptr + vals, v_new, mask=mv[None, :])
        kd = tl.load(kd_ptr + keys, mask=mk[None, :], other=0.0)
        s = s * tl.load(last_ptr + base) + tl.dot(tl.trans(kd), v_new, input_precision="ieee")
    tl.store(tile, s, mask=mk[:, None] & mv[None, :])


@triton.jit
def _chunk_o_kernel(qd_ptr, inner_ptr, h_ptr, vn_ptr, o_ptr, start_ptr, end_ptr, dk, dv, nc, s_ot, s_oh,
                    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One chunk's output, one value head, BV value columns (flash-linear-attention's chunk_o): qd h (the state
    before the chunk) + inner v_new, stored at the chunk's token rows in o's dtype."""
    c = tl.program_id(0)
    hh = tl.program_id(1)
    offs_c = tl.arange(0, C)
    offs_k, offs_v, mk, mv = _head_tile(dk, dv, BK, BV)
    base = (hh * nc + c).to(tl.int64)
    qd = tl.load(qd_ptr + base * C * dk + offs_c[:, None] * dk + offs_k[None, :], mask=mk[None, :], other=0.0)
    h = tl.load(h_ptr + base * dk * dv + offs_k[:, None] * dv + offs_v[None, :], mask=mk[:, None] & mv[None, :],
                other=0.0)
    a = tl.load(inner_ptr + base * C * C + offs_c[:, None] * C + offs_c[None, :])
    v_new = tl.load(vn_ptr + base * C * dv + offs_c[:, None] * dv + offs_v[None, :], mask=mv[None, :], other=0.0)
    o = tl.dot(qd, h, input_precision="ieee") + tl.dot(a, v_new, input_precision="ieee")
    rows = tl.load(start_ptr + c) + offs_c
    tl.store(o_ptr + rows[:, None].to(tl.int64) * s_ot + hh * s_oh + offs_v[None, :], o.to(o_ptr.dtype.element_ty),
             mask=(rows < tl.load(end_ptr + c))[:, None] & mv[None, :])


@triton.jit
def _unit_lower_inverse(a, C: tl.constexpr, SUB: tl.constexpr):
    """T = (I + A)^-1 of a chunk's strictly lower A [C, C] (C = NB x SUB), blocked as flash-linear-attention's
    solve_tril: the NB diagonal [SUB, SUB] blocks inverted together by forward substitution, row by row (SUB - 1
    steps on [NB, SUB, SUB]: transformers' loop within a block); then block row by block row: D_r (the inverse of
    block r) and L_r (A's block row r left of its diagonal block), (I + A) T = I gives T_r = D_r - D_r (L_r T), which
    reads the block rows above r only (done): two tl.dot a block row, [SUB, C] x [C, C] and [SUB, SUB] x [SUB, C].
    At C = 64, SUB = 16 (Qwen3.5's and Qwen3-Next's): 15 + 2 x 3 = 21 dependent steps where the row-by-row solve
    (SUB = C) took 63, each of those a pair of reductions over the whole [64, 64] tile; the merge's tl.dot
    3 x (2 x 16 x 64 x 64 + 2 x 16 x 16 x 64) = 0.49 MFLOP beside the kernel's other four (q k^T, beta k k^T, w, u:
    4 x 2 x 64 x 64 x 128 = 4.2 MFLOP at Dk = Dv = 128)."""
    NB: tl.constexpr = C // SUB
    offs = tl.arange(0, C)
    offs_b = tl.arange(0, NB)
    offs_s = tl.arange(0, SUB)
    same = offs_b[:, None, None, None] == offs_b[None, None, :, None]  # [NB, 1, NB, 1]: a diagonal block
    # -A's diagonal blocks [NB, SUB, SUB]; row i of each block's inverse's strict part: -A_i + sum_j (row i so far)_j
    # (rows j < i of the block, done)
    d = -tl.sum(tl.where(same, tl.reshape(a, [NB, SUB, NB, SUB]), 0.0), axis=2)
    at_row = offs_s[None, :, None]
    for i in range(1, SUB):
        row = tl.sum(tl.where(at_row == i, d, 0.0), axis=1)  # [NB, SUB]
        row += tl.sum(row[:, :, None] * d, axis=1)  # (row's entries from i on, d's above its diagonal: zero)
        d = tl.where(at_row == i, row[:, None, :], d)
    d += (at_row == offs_s[None, None, :]).to(tl.float32)
    t = tl.reshape(tl.where(same, d[:, :, None, :], 0.0), [C, C])  # (block diagonal: block row 0 done)
    if NB > 1:
        at_block = offs_b[:, None, None]
        # L's block rows [NB, SUB, C]: A left of its diagonal blocks
        lower = tl.reshape(tl.where((offs[:, None] // SUB) > (offs[None, :] // SUB), a, 0.0), [NB, SUB, C])
        for r in tl.static_range(1, NB):
            l_r = tl.sum(tl.where(at_block == r, lower, 0.0), axis=0)  # [SUB, C]
            d_r = tl.sum(tl.where(at_block == r, d, 0.0), axis=0)  # [SUB, SUB]
            part = -tl.dot(d_r, tl.dot(l_r, t, input_precision="ieee"), input_precision="ieee")  # (left of D_r)
            t = tl.reshape(tl.reshape(t, [NB, SUB, C]) + tl.where(at_block == r, part[None, :, :], 0.0), [C, C])
    return t


@triton.jit
def _chunk_terms_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, start_ptr, end_ptr, u_ptr, w_ptr, inner_ptr, qd_ptr,
                        kd_ptr, last_ptr, dk, dv, nc, scale, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_bt,
                        GROUP: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr):
    """The intra-chunk part of one chunk, one value head (delta_rule.chunk_terms; flash-linear-attention's chunk
    cumsum, scaled dot kkt, solve_tril and WY representation in one program): q and k (its key head's, L2-normed, q
    scaled) and v, g, beta of the chunk's token rows (zero past its end); g's cumulative sum gc; the decay
    exp(gc_i - gc_j) of row i from row j (zero above the diagonal); A = beta k k^T decayed, strictly lower; its unit
    triangular system's inverse T = (I + A)^-1 (_unit_lower_inverse: blocks of SUB rows); then
    w = T (beta k exp(gc)), u = T (beta v) (BV value columns at a time), inner = (q k^T decayed, lower with the
    diagonal), qd = q exp(gc), kd = k exp(gc_last - gc), last = exp(gc_last), stored [Hv, NC, C, ...] as
    _chunk_h_kernel and _chunk_o_kernel read them."""
    c = tl.program_id(0)
    hh = tl.program_id(1)
    hk = hh // GROUP  # (the key head of value head hh: transformers' repeat_interleave)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    mk = offs_k < dk
    start = tl.load(start_ptr + c).to(tl.int64)  # (token rows in int64: T x a row stride may pass 2^31)
    end = tl.load(end_ptr + c).to(tl.int64)
    rows = start + offs_c
    mr = rows < end
    g = tl.load(g_ptr + rows * s_gt + hh, mask=mr, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * s_bt + hh, mask=mr, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, axis=0)
    g_last = tl.sum(tl.where(offs_c == C - 1, gc, 0.0), axis=0)
    lower = offs_c[:, None] >= offs_c[None, :]
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
    mask = mr[:, None] & mk[None, :]
    k = tl.load(k_ptr + rows[:, None] * s_kt + hk * s_kh + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    q = tl.load(q_ptr + rows[:, None] * s_qt + hk * s_qh + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale
    base = (hh * nc + c).to(tl.int64)
    keys = base * C * dk + offs_c[:, None] * dk + offs_k[None, :]
    tl.store(qd_ptr + keys, q * tl.exp(gc)[:, None], mask=mk[None, :])
    tl.store(kd_ptr + keys, k * tl.exp(g_last - gc)[:, None], mask=mk[None, :])
    tl.store(last_ptr + base, tl.exp(g_last))
    square = base * C * C + offs_c[:, None] * C + offs_c[None, :]
    tl.store(inner_ptr + square, tl.dot(q, tl.trans(k), input_precision="ieee") * decay)
    kb = k * beta[:, None]
    a = _unit_lower_inverse(tl.where(offs_c[:, None] > offs_c[None, :],
                                     tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0), C, SUB)
    tl.store(w_ptr + keys, tl.dot(a, kb * tl.exp(gc)[:, None], input_precision="ieee"), mask=mk[None, :])
    for v0 in range(0, dv, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < dv
        v = tl.load(v_ptr + rows[:, None] * s_vt + hh * s_vh + offs_v[None, :], mask=mr[:, None] & mv[None, :],
                    other=0.0).to(tl.float32)
        u = tl.dot(a, v * beta[:, None], input_precision="ieee")
        tl.store(u_ptr + base * C * dv + offs_c[:, None] * dv + offs_v[None, :], u, mask=mv[None, :])


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                lay: dict, solve_block: int = SOLVE_BLOCK) -> dict:
    """delta_rule.chunk_terms in one launch (one program per chunk of `lay`, chunk_layout's at CHUNK tokens, and
    value head): q, k [T, Hk, Dk], v [T, Hv, Dv] (each unit stride along its last dim), g and beta [T, Hv]. Returns
    the same dict of contiguous float32 tensors. (`solve_block` CHUNK: the system solved row by row over the whole
    chunk, C - 1 serial steps and no merge, as session 64's kernel did; infer.bench.delta times both.)"""
    hv, dv = v.shape[1], v.shape[2]
    hk, dk = k.shape[1], k.shape[2]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, beta))
    nc = lay["rows"].shape[0]
    assert solve_block >= 16 and CHUNK % solve_block == 0 and solve_block & (solve_block - 1) == 0, \
        f"chunk {CHUNK}, solve block {solve_block}: whole blocks of a power of 2 >= 16 rows"
    f32 = dict(dtype=torch.float32, device=v.device)
    t = dict(u=torch.empty(hv, nc, CHUNK, dv, **f32), w=torch.empty(hv, nc, CHUNK, dk, **f32),
             inner=torch.empty(hv, nc, CHUNK, CHUNK, **f32), qd=torch.empty(hv, nc, CHUNK, dk, **f32),
             kd=torch.empty(hv, nc, CHUNK, dk, **f32), last=torch.empty(hv, nc, **f32))
    if nc:
        _chunk_terms_kernel[(nc, hv)](
            q, k, v, g, beta, lay["start"], lay["end"], t["u"], t["w"], t["inner"], t["qd"], t["kd"], t["last"],
            dk, dv, nc, dk ** -0.5, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), GROUP=hv // hk, C=CHUNK, SUB=solve_block, BK=max(16, next_power_of_2(dk)),
            BV=max(16, min(VALUE_BLOCK, next_power_of_2(dv))), num_warps=TERMS_WARPS)
    return t


def chunk_gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, states: torch.Tensor, query_start_loc: torch.Tensor,
                                  slots: torch.Tensor, kept: torch.Tensor, torch_terms: bool = False) -> torch.Tensor:
    """delta_rule.chunk_gated_delta_rule_varlen in three launches: its intra-chunk part (chunk_terms: one program
    per chunk and head), its inter-chunk recurrence (one program per sequence, head and value tile, its chunks in
    order) and its output (one program per chunk, head and value tile); states [slots, Hv, Dk, Dv] float32 written in
    place at `slots`. Returns o [T, Hv, Dv] in v's dtype. (`torch_terms`: the intra-chunk part in torch,
    delta_rule.chunk_terms, as infer.bench.delta compares them.)"""
    from . import delta_rule
    t, hv, dv = v.shape
    dk = k.shape[2]
    slots, kept = _vectors(slots, kept)
    assert states.dtype == torch.float32 and states.stride(-1) == 1, "float32 states, unit stride along Dv"
    out = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    if not t:
        return out
    lay = delta_rule.chunk_layout(query_start_loc, CHUNK)
    if torch_terms:
        terms = {n: x.contiguous() for n, x in delta_rule.chunk_terms(q, k, v, g, beta, lay["rows"]).items()}
    else:
        terms = chunk_terms(q, k, v, g, beta, lay)
    nc = lay["rows"].shape[0]
    h = torch.empty(hv, nc, dk, dv, dtype=torch.float32, device=v.device)
    v_new = torch.empty_like(terms["u"])
    bk = max(16, next_power_of_2(dk))  # (tl.dot's smallest tile)
    bv = max(16, min(VALUE_BLOCK, next_power_of_2(dv)))
    _chunk_h_kernel[(len(slots), hv, cdiv(dv, bv))](
        terms["w"], terms["u"], terms["kd"], terms["last"], h, v_new, states, lay["first"], slots, kept, dk, dv, nc,
        states.stride(0), states.stride(1), states.stride(2), C=CHUNK, BK=bk, BV=bv, num_stages=CHUNK_H_STAGES)
    _chunk_o_kernel[(nc, hv, cdiv(dv, bv))](
        terms["qd"], terms["inner"], h, v_new, out, lay["start"], lay["end"], dk, dv, nc, out.stride(0),
        out.stride(1), C=CHUNK, BK=bk, BV=bv)
    return out
