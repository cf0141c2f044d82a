"""Triton kernels of a Mamba-2 layer's SSD scan (Granite 4.0's and Nemotron-H's mixers), in the manner of mamba_ssm's
and vLLM's selective_state_update and chunked scan (ssd_chunk_state, ssd_state_passing, ssd_chunk_scan):

- decode (state_update_slots): one token of every sequence of the step in one launch, each sequence's SSM state read
  and written in place at its slot of the pool (`slots`, a tensor: a CUDA graph replays them through its static
  buffer), zero where its step starts from zero state (`kept` False: masked loads, so a slot that holds NaN gives
  zero, as the reference's torch.where); a graph's padding rows name the model's padding slot (several rows may
  write it: it is never read as a state);
- prefill (chunk_scan_varlen): every chunk of the step's sequences at once (delta_rule.chunk_layout: a chunk never
  straddles two sequences, a sequence's last chunk is shorter): each chunk's own state at its end (_chunk_state),
  the states carried from chunk to chunk of each sequence, linear in its chunks (_state_passing: the slot's state
  in, each chunk's own state replaced by the state before it, the state after the last chunk written back to the
  slot), each chunk's output from the state before it and its
  tokens (_chunk_scan).

Same semantics as their torch references in `mamba2.py` (state_update_slots, chunk_scan_varlen): the discretized
dt (dt + dt_bias, softplus, the prefill's time_step_limit) rounded where the reference rounds it; float32
arithmetic; a decode's dt * B * x, its read of the state and its output rounded to the model's dtype as the
reference rounds them; a prefill's output float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .delta_rule import chunk_layout
from .intmath import cdiv, next_power_of_2

DIM_BLOCK = 32  # head dims (P) of a program's state tile [P, N] (float32 in registers)
SCAN_ROWS = 64  # a chunk's output rows (and its source rows a step) that a _chunk_scan program computes
STATE_ROWS = 64  # a chunk's token rows _chunk_state sums a step
# software-pipeline stages of _chunk_scan's loop over a chunk's source rows: Triton's default 3 buffer 105 KiB of
# B and x tiles at granite-4.0-h's shapes, more than an sm_86 / sm_89 GPU's 99 KiB a block
SCAN_STAGES = 2


@triton.jit
def _softplus(v):
    """torch's F.softplus (threshold 20) in float32: log1p(exp(v)) by log(u) * e / (u - 1), exact where 1 + e
    rounds (a plain log(1 + e) loses e's digits below 1's ulp)."""
    e = tl.exp(v)
    u = 1.0 + e
    small = tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0))
    return tl.where(v > 20.0, v, small)


@triton.jit
def _dt(dt_ptr, bias_ptr, h):
    """softplus(dt + dt_bias) (dt at dt_ptr) as the reference rounds it: the sum and the softplus each in dt's
    dtype."""
    dtype = dt_ptr.dtype.element_ty
    v = (tl.load(dt_ptr).to(tl.float32) + tl.load(bias_ptr + h).to(dtype).to(tl.float32)).to(dtype)
    return _softplus(v.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _state_update_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, y_ptr, state_ptr, slots_ptr, kept_ptr,
                         dim, dstate, s_xb, s_xh, s_dtb, s_bb, s_bg, s_cb, s_cg, s_yb, s_yh, s_s, s_sh, s_sp,
                         GROUP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    """One sequence's token, one head, BP head dims: the state tile [BP, N] from the slot (zero where not kept)
    decayed by exp(dt A) plus dt B x; y = the state (in x's dtype) . C + D x; the tile stored back."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // GROUP  # (the group of head h: transformers' repeat_interleave)
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mp, mn = offs_p < dim, offs_n < dstate
    dtype = x_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kept = tl.load(kept_ptr + b).to(tl.int32) != 0
    dt = _dt(dt_ptr + b * s_dtb + h, bias_ptr, h)
    x = tl.load(x_ptr + b * s_xb + h * s_xh + offs_p, mask=mp, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + b * s_bb + g * s_bg + offs_n, mask=mn, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * s_cb + g * s_cg + offs_n, mask=mn, other=0.0).to(tl.float32)
    tile = state_ptr + slot * s_s + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :]
    s = tl.load(tile, mask=(offs_p < tl.where(kept, dim, 0))[:, None] & mn[None, :], other=0.0)
    dbx = ((dt * bv).to(dtype).to(tl.float32)[None, :] * x[:, None]).to(dtype).to(tl.float32)
    s = s * tl.exp(dt * tl.load(a_ptr + h).to(tl.float32)) + dbx
    y = tl.sum(s.to(dtype).to(tl.float32) * cv[None, :], axis=1).to(dtype).to(tl.float32)
    skip = (x * tl.load(d_ptr + h).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(y_ptr + b * s_yb + h * s_yh + offs_p, (y + skip).to(y_ptr.dtype.element_ty), mask=mp)
    tl.store(tile, s, mask=mp[:, None] & mn[None, :])


def _vectors(*xs: torch.Tensor) -> list[torch.Tensor]:
    """The per-sequence vectors (slots, kept, query_start_loc) with unit stride (delta_triton's)."""
    return [x.contiguous() for x in xs]


def _unit(*xs: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor with unit stride along its last dim (the model's split of the conv output gives views)."""
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def state_update_slots(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                       kept: torch.Tensor) -> torch.Tensor:
    """mamba2.state_update_slots in one launch: x [S, H, P], dt [S, H], B and C [S, G, N], A (float32), D and
    dt_bias [H]; states [slots, H, P, N] float32 written in place at `slots` [S]; `kept` [S] bool. Returns y [S, H,
    P] in x's dtype."""
    s, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    slots, kept = _vectors(slots, kept)
    x, dt, B, C = _unit(x, dt, B, C)
    A, D, dt_bias = _vectors(A, D, dt_bias)
    assert states.dtype == torch.float32 and states.stride(-1) == 1, "float32 states, unit stride along N"
    y = torch.empty(s, h, p, dtype=x.dtype, device=x.device)
    bp = min(DIM_BLOCK, next_power_of_2(p))
    if s:
        _state_update_kernel[(s, h, cdiv(p, bp))](
            x, dt, A, B, C, D, dt_bias, y, states, slots, kept, p, n, x.stride(0), x.stride(1), dt.stride(0),
            B.stride(0), B.stride(1), C.stride(0), C.stride(1), y.stride(0), y.stride(1), states.stride(0),
            states.stride(1), states.stride(2), GROUP=h // g, BP=bp, BN=next_power_of_2(n))
    return y


@triton.jit
def _chunk_state_kernel(x_ptr, b_ptr, dt_ptr, cum_ptr, cs_ptr, start_ptr, end_ptr, nc, dim, dstate, s_xt, s_xh,
                        s_bt, s_bg, GROUP: tl.constexpr, L: tl.constexpr, BL: tl.constexpr, BP: tl.constexpr,
                        BN: tl.constexpr):
    """One chunk's own state at its end, one head, BP head dims: sum over its tokens l of x_l dt_l exp(cum_end -
    cum_l) B_l^T [BP, N], stored at chunk c, head h of cs [NC, H, P, N]."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    g = h // GROUP
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mp, mn = offs_p < dim, offs_n < dstate
    base = (h * nc + c).to(tl.int64) * L  # (the chunk's row of the [H, NC, L] dt and cumulative sums)
    start = tl.load(start_ptr + c).to(tl.int64)
    end = tl.load(end_ptr + c).to(tl.int64)
    last = tl.load(cum_ptr + base + L - 1)  # (past a sequence's end dt is 0: the sum stays the last token's)
    acc = tl.zeros([BP, BN], dtype=tl.float32)
    for l0 in tl.static_range(0, L, BL):
        offs_l = l0 + tl.arange(0, BL)
        tok = start + offs_l
        ml = tok < end
        scale = tl.load(dt_ptr + base + offs_l) * tl.exp(last - tl.load(cum_ptr + base + offs_l))
        x = tl.load(x_ptr + tok[:, None] * s_xt + h * s_xh + offs_p[None, :], mask=ml[:, None] & mp[None, :],
                    other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + tok[:, None] * s_bt + g * s_bg + offs_n[None, :], mask=ml[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(x * scale[:, None]), bv, input_precision="ieee")
    out = cs_ptr + ((c.to(tl.int64) * tl.num_programs(1) + h) * dim + offs_p[:, None]) * dstate + offs_n[None, :]
    tl.store(out, acc, mask=mp[:, None] & mn[None, :])


@triton.jit
def _state_passing_kernel(cs_ptr, cum_ptr, state_ptr, first_ptr, slots_ptr, kept_ptr, nc, dim, dstate, s_s, s_sh,
                          s_sp, L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    """One sequence's states carried from chunk to chunk, one head, BP head dims: the tile [BP, N] from the slot
    (zero where not kept); chunk by chunk, the chunk's own state read from cs [NC, H, P, N] and the state before the
    chunk stored in its place (each element only this program's), then the state decayed by the chunk's total
    exp(cum_end) plus the chunk's own; the state after the last chunk stored at the slot."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mp, mn = offs_p < dim, offs_n < dstate
    mask = mp[:, None] & mn[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kept = tl.load(kept_ptr + b).to(tl.int32) != 0
    tile = state_ptr + slot * s_s + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :]
    s = tl.load(tile, mask=(offs_p < tl.where(kept, dim, 0))[:, None] & mn[None, :], other=0.0)
    inner = offs_p[:, None] * dstate + offs_n[None, :]
    for c in range(tl.load(first_ptr + b), tl.load(first_ptr + b + 1)):
        at = cs_ptr + (c * tl.num_programs(1) + h).to(tl.int64) * dim * dstate + inner
        own = tl.load(at, mask=mask, other=0.0)
        tl.store(at, s, mask=mask)
        s = s * tl.exp(tl.load(cum_ptr + (h * nc + c).to(tl.int64) * L + L - 1)) + own
    tl.store(tile, s, mask=mask)


@triton.jit
def _chunk_scan_kernel(x_ptr, b_ptr, c_ptr, d_ptr, dt_ptr, cum_ptr, prev_ptr, y_ptr, start_ptr, end_ptr, nc, dim,
                       dstate, s_xt, s_xh, s_bt, s_bg, s_ct, s_cg, s_yt, s_yh, GROUP: tl.constexpr, L: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    """BM output rows of one chunk, one head, BP head dims: exp(cum_l) C_l . (the state before the chunk) plus the
    chunk's own tokens s <= l, (C_l . B_s) exp(cum_l - cum_s) dt_s x_s, plus D x_l; float32 at the rows of y."""
    c = tl.program_id(0) // (L // BM)
    m0 = (tl.program_id(0) % (L // BM)) * BM
    h = tl.program_id(1)
    g = h // GROUP
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    offs_m = m0 + tl.arange(0, BM)
    mp, mn = offs_p < dim, offs_n < dstate
    start = tl.load(start_ptr + c).to(tl.int64)
    end = tl.load(end_ptr + c).to(tl.int64)
    if start + m0 < end:
        base = (h * nc + c).to(tl.int64) * L
        tok_m = start + offs_m
        mm = tok_m < end
        cum_m = tl.load(cum_ptr + base + offs_m)
        cv = tl.load(c_ptr + tok_m[:, None] * s_ct + g * s_cg + offs_n[None, :], mask=mm[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)
        at = (c.to(tl.int64) * tl.num_programs(1) + h) * dim * dstate
        prev = tl.load(prev_ptr + at + offs_p[None, :] * dstate + offs_n[:, None], mask=mn[:, None] & mp[None, :],
                       other=0.0)  # [N, BP]
        acc = tl.dot(cv, prev, input_precision="ieee") * tl.exp(cum_m)[:, None]
        for k0 in range(0, m0 + BM, BK):
            offs_k = k0 + tl.arange(0, BK)
            tok_k = start + offs_k
            mk = tok_k < end
            bv = tl.load(b_ptr + tok_k[:, None] * s_bt + g * s_bg + offs_n[None, :], mask=mk[:, None] & mn[None, :],
                         other=0.0).to(tl.float32)
            scores = tl.dot(cv, tl.trans(bv), input_precision="ieee")  # [BM, BK]
            cum_k = tl.load(cum_ptr + base + offs_k)
            causal = offs_k[None, :] <= offs_m[:, None]
            decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_k[None, :], -float("inf")))
            xk = tl.load(x_ptr + tok_k[:, None] * s_xt + h * s_xh + offs_p[None, :], mask=mk[:, None] & mp[None, :],
                         other=0.0).to(tl.float32)
            xd = xk * tl.load(dt_ptr + base + offs_k)[:, None]
            acc += tl.dot(scores * decay, xd, input_precision="ieee")
        xm = tl.load(x_ptr + tok_m[:, None] * s_xt + h * s_xh + offs_p[None, :], mask=mm[:, None] & mp[None, :],
                     other=0.0).to(tl.float32)
        acc += xm * tl.load(d_ptr + h).to(tl.float32)
        tl.store(y_ptr + tok_m[:, None] * s_yt + h * s_yh + offs_p[None, :], acc, mask=mm[:, None] & mp[None, :])


def scan_terms(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor, rows: torch.Tensor, limit, clamp=None):
    """The discretized dt and the cumulative sums of dt A within each chunk of `rows` ([NC, L], chunk_layout's):
    ([H, NC, L] float32 each; dt 0 past a sequence's end, so the sums stay its last token's), as mamba2.chunk_scan
    computes them."""
    from .mamba2 import _discretized_dt
    d = F.pad(_discretized_dt(dt, dt_bias, limit, clamp).float(), (0, 0, 0, 1))[rows]  # [NC, L, H] (row T: zero)
    cum = torch.cumsum(A.float() * d, dim=1)
    return d.permute(2, 0, 1).contiguous(), cum.permute(2, 0, 1).contiguous()


def chunk_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor, dt_bias: torch.Tensor, chunk: int, states: torch.Tensor,
                      query_start_loc: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor,
                      limit=(0.0, float("inf")), clamp=None) -> torch.Tensor:
    """mamba2.chunk_scan_varlen over every chunk of the step at once: x [T, H, P], dt [T, H], B and C [T, G, N]
    (each unit stride along its last dim, or copied), states [slots, H, P, N] float32 written in place at `slots`.
    Returns y [T, H, P] float32 (the D skip included)."""
    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    slots, kept = _vectors(slots, kept)
    x, B, C = _unit(x, B, C)
    D = D.contiguous()
    assert states.dtype == torch.float32 and states.stride(-1) == 1, "float32 states, unit stride along N"
    assert chunk >= 16 and chunk & (chunk - 1) == 0, f"mamba_chunk_size {chunk}: the kernels take a power of 2 >= 16"
    y = torch.empty(t, h, p, dtype=torch.float32, device=x.device)
    if not t:
        return y
    lay = chunk_layout(query_start_loc, chunk)
    nc = lay["rows"].shape[0]
    d, cum = scan_terms(dt, A, dt_bias, lay["rows"], limit, clamp)
    # each chunk's own state, then the state before it (mamba2.varlen_scan_bytes counts it)
    chunk_states = torch.empty(nc, h, p, n, dtype=torch.float32, device=x.device)
    bp, bn = max(16, min(DIM_BLOCK, next_power_of_2(p))), max(16, next_power_of_2(n))  # (tl.dot's smallest tile)
    rows = min(SCAN_ROWS, chunk)
    _chunk_state_kernel[(nc, h, cdiv(p, bp))](
        x, B, d, cum, chunk_states, lay["start"], lay["end"], nc, p, n, x.stride(0), x.stride(1), B.stride(0),
        B.stride(1), GROUP=h // g, L=chunk, BL=min(STATE_ROWS, chunk), BP=bp, BN=bn)
    _state_passing_kernel[(len(slots), h, cdiv(p, bp))](
        chunk_states, cum, states, lay["first"], slots, kept, nc, p, n, states.stride(0), states.stride(1),
        states.stride(2), L=chunk, BP=bp, BN=bn)
    _chunk_scan_kernel[(nc * (chunk // rows), h, cdiv(p, bp))](
        x, B, C, D, d, cum, chunk_states, y, lay["start"], lay["end"], nc, p, n, x.stride(0), x.stride(1), B.stride(0),
        B.stride(1), C.stride(0), C.stride(1), y.stride(0), y.stride(1), GROUP=h // g, L=chunk, BM=rows, BK=rows,
        BP=bp, BN=bn, num_stages=SCAN_STAGES)
    return y
