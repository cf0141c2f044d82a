"""Mamba-2's selective scan (state space duality, SSD) in torch, for one sequence's prefill chunk (`chunk_scan`) and
for one token of each of a batch of sequences (`state_update`), as transformers' reference (mamba2_chunk_scan,
mamba2_selective_state_update of modeling_granitemoehybrid / modeling_mamba2) computes them, in float32 (but for the
state carried from chunk to chunk: linear in the chunks, as mamba_ssm's state passing, where transformers' segsum
over the chunks is quadratic).

Shapes: H heads of P dims, G groups of N state dims (each group's B and C shared by H / G heads); the state
[H, P, N] per sequence. dt is the raw time step (before dt_bias and softplus); A = -exp(A_log) [H]. In half precision
each rounds where transformers does: dt + dt_bias and its softplus in the model's dtype; the scan in float32, its
output float32; the step's dt * B * x, its read of the state and its output in the model's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


SCAN_GROUP_CHUNKS = 4  # chunks whose [H, L, L] scores a prefill's scan holds at once (memory.sizes.mamba_scan_bytes)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., i, j] = a[j + 1] + ... + a[i] for j <= i (0 on the diagonal), -inf above
    it (the masked cumulative sums of transformers' segment_sum: no differences of large sums)."""
    n = a.shape[-1]
    x = a[..., None].expand(*a.shape, n)
    below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    s = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device)), -torch.inf)


def _discretized_dt(dt, dt_bias, limit=None, clamp=None):
    """softplus(dt + dt_bias) in dt's dtype, clamped to `limit` (of the tokens `clamp` [T] bool marks; None: all)."""
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    if limit is None:
        return dt
    clamped = dt.clamp(limit[0], limit[1])
    return clamped if clamp is None else torch.where(clamp[:, None], clamped, dt)


def chunk_scan(x, dt, A, B, C, D, dt_bias, chunk: int, state: torch.Tensor, limit=(0.0, float("inf")), clamp=None):
    """One sequence's T tokens from `state` [H, P, N]: (y [T, H, P] float32 with the D skip, the final state).
    x [T, H, P], dt [T, H], B and C [T, G, N]; dt clamped to `limit` (time_step_limit) after softplus: every token's,
    or those `clamp` [T] bool marks (a prompt's: transformers clamps a prompt's dt, not a decode step's)."""
    t, h, p = x.shape
    rep = h // B.shape[1]
    dt = _discretized_dt(dt, dt_bias, limit, clamp).float()
    x = x.float()
    skip = x * D.float()[:, None]
    B = B.float().repeat_interleave(rep, dim=1)  # [T, H, N]
    C = C.float().repeat_interleave(rep, dim=1)
    pad = (-t) % chunk
    xd = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).reshape(-1, chunk, h, p)  # [c, l, H, P]
    a = F.pad(A.float() * dt, (0, 0, 0, pad)).reshape(-1, chunk, h).permute(2, 0, 1)  # [H, c, l]
    B = F.pad(B, (0, 0, 0, 0, 0, pad)).reshape(-1, chunk, h, B.shape[-1])
    C = F.pad(C, (0, 0, 0, 0, 0, pad)).reshape(-1, chunk, h, C.shape[-1])
    cum = torch.cumsum(a, dim=-1)  # [H, c, l]
    # each chunk's own contribution to the state at its end, then the states carried from chunk to chunk
    to_end = torch.exp(cum[..., -1:] - cum)  # [H, c, l]
    chunk_states = torch.einsum("clhn,clhp->chpn", B * to_end.permute(1, 2, 0)[..., None], xd)
    states = torch.cat([state[None].float(), chunk_states])  # [c + 1, H, P, N]
    # z: the state at chunk z's start (the last: the end), each the one before it decayed by its chunk's total decay
    # plus that chunk's own, in place: linear in the chunks (transformers' carry is a [H, c + 1, c + 1] segsum, an
    # O(c^2 H P N) einsum); the same as mamba2_triton's _state_passing_kernel
    total = torch.exp(cum[..., -1]).t()[..., None, None]  # [c, H, 1, 1]
    for z in range(chunk_states.shape[0]):
        states[z + 1] += states[z] * total[z]
    carried = torch.einsum("clhn,chpn->clhp", C, states[:-1]) * torch.exp(cum).permute(1, 2, 0)[..., None]
    y = torch.empty_like(xd)
    # the [H, l, l] temporaries of a group of chunks at a time; no group of one chunk after others (einsum would
    # squeeze its chunk dimension and contract by another kernel: the output would differ in its last bits)
    ends = list(range(SCAN_GROUP_CHUNKS, xd.shape[0], SCAN_GROUP_CHUNKS))
    ends = ends[:-1] if ends and xd.shape[0] - ends[-1] == 1 else ends
    for lo, hi in zip([0] + ends, ends + [xd.shape[0]]):
        k = slice(lo, hi)
        # within each chunk: attention-like scores C_l . B_s decayed from s to l
        decay = torch.exp(_segsum(a[:, k]))  # [H, c, l, s]
        scores = torch.einsum("clhn,cshn->clsh", C[k], B[k]) * decay.permute(1, 2, 3, 0)
        y[k] = torch.einsum("clsh,cshp->clhp", scores, xd[k]) + carried[k]
    return y.reshape(-1, h, p)[:t] + skip, states[-1]


def state_update(state, x, dt, A, B, C, D, dt_bias):
    """One token of each of S sequences: (y [S, H, P] in x's dtype with the D skip, the new float32 states
    [S, H, P, N]). state [S, H, P, N] float32, x [S, H, P], dt [S, H], B and C [S, G, N]. (No time_step_limit:
    transformers' and mamba_ssm's selective_state_update do not clamp dt.)"""
    rep = x.shape[1] // B.shape[1]
    dt = _discretized_dt(dt, dt_bias)[..., None, None]  # [S, H, 1, 1]
    B = B.repeat_interleave(rep, dim=1)[:, :, None]  # [S, H, 1, N]
    C = C.repeat_interleave(rep, dim=1)
    state = state * torch.exp(dt.float() * A.float()[:, None, None]) + dt * B * x[..., None]
    y = torch.einsum("shpn,shn->shp", state.to(x.dtype), C) + x * D.to(x.dtype)[:, None]
    return y, state


def state_update_slots(x, dt, A, B, C, D, dt_bias, states: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor):
    """state_update with each sequence's state at its slot of `states` [slots, H, P, N] float32 (`slots` [S]; zero
    where `kept` [S] is False: torch.where, a slot that holds NaN gives zero), the states after the token written
    back there. Returns y [S, H, P] in x's dtype."""
    state = torch.where(kept[:, None, None, None], states.index_select(0, slots), 0)
    y, state = state_update(state, x, dt, A, B, C, D, dt_bias)
    states.index_copy_(0, slots, state)
    return y


def chunk_scan_varlen(x, dt, A, B, C, D, dt_bias, chunk: int, states: torch.Tensor, query_start_loc: torch.Tensor,
                      slots: torch.Tensor, kept: torch.Tensor, limit=(0.0, float("inf")), clamp=None):
    """A prefill step's scan (chunk_scan) of each sequence's tokens query_start_loc[i]:query_start_loc[i + 1] (x [T,
    H, P], dt [T, H], B and C [T, G, N]) from its state at slots[i] of `states` [slots, H, P, N] float32 (zero where
    not kept[i]), the state after them written back there; `clamp` [T] bool: the tokens whose dt `limit` clamps
    (None: all). Returns y [T, H, P] float32. (The CPU path: one chunk_scan a sequence; mamba2_triton's runs every
    chunk of the step at once.)"""
    y = x.new_empty(x.shape, dtype=torch.float32)
    bounds = query_start_loc.tolist()
    for s, e, slot, k in zip(bounds[:-1], bounds[1:], slots.tolist(), kept.tolist()):
        state = states[slot] if k else torch.zeros_like(states[slot])
        y[s:e], states[slot] = chunk_scan(x[s:e], dt[s:e], A, B[s:e], C[s:e], D, dt_bias, chunk, state, limit,
                                          None if clamp is None else clamp[s:e])
    return y


def varlen_scan_bytes(tokens: int, seqs: int, heads: int, dim: int, dstate: int, chunk: int) -> int:
    """The temporaries of mamba2_triton.chunk_scan_varlen (the GPU path) over `tokens` tokens of at most `seqs`
    sequences: each chunk's state [NC, H, P, N] and its dt and cumulative sums [H, NC, L] (float32), the chunk
    layout's rows [NC, L] (int64), the float32 output [T, H, P]; at most one partial chunk a sequence."""
    nc = -(-tokens // chunk) + seqs - 1 if tokens > 0 else 0
    return nc * (heads * dim * dstate * 4 + 2 * heads * chunk * 4 + chunk * 8) + tokens * heads * dim * 4
