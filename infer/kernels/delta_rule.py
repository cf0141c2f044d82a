"""The gated delta rule of Gated DeltaNet layers (Qwen3.5's and Qwen3-Next's linear attention), and their causal
depthwise conv1d, in torch: the CPU path and the oracle (transformers' torch_chunk_gated_delta_rule and
torch_recurrent_gated_delta_rule, the same ops in the same order). A step's ops on states kept at slots of a pool
(a decode step's causal_conv1d_update and recurrent_gated_delta_rule_slots, a prefill step's conv,
causal_conv1d_varlen) have Triton kernels on CUDA (kernels.delta_triton, dispatched by kernels.causal_conv1d_update,
kernels.gated_delta_decode and kernels.causal_conv1d_varlen); a prefill's chunked rule runs in torch on every device.

Semantics: per value head, a state S [Dk, Dv] (float32) that each token t updates as
S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T, with output o_t = S^T q_t; q and k L2-normed, q scaled by
Dk ** -0.5."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepared(q, k, v, g, beta, divide: bool = False):
    """[H, T, ...] float32 tensors of [T, H, ...] inputs (the k heads repeated to the value heads), q and k
    L2-normed, q scaled (`divide`: divided by sqrt(Dk), as transformers' recurrent form rounds it)."""
    hv, hk = v.shape[1], k.shape[1]
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    q, k, v, beta, g = [x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g)]
    q, k = _l2norm(q), _l2norm(k)
    q = q / q.shape[-1] ** 0.5 if divide else q * q.shape[-1] ** -0.5
    return q, k, v, g, beta


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64):
    """One sequence's T tokens: q, k [T, Hk, Dk], v [T, Hv, Dv], g and beta [T, Hv]; `state` [Hv, Dk, Dv] float32,
    the state before them. Returns (o [T, Hv, Dv] in v's dtype, the state after them), in chunks of `chunk` tokens
    (transformers' torch_chunk_gated_delta_rule)."""
    dtype, t = v.dtype, v.shape[0]
    q, k, v, g, beta = _prepared(q, k, v, g, beta)
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(x.shape[0], -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(g.shape[0], -1, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    inner = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    out = torch.zeros_like(values)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    last = g[..., -1].exp()[..., None, None]
    s = state.to(values)
    for i in range(q.shape[1]):
        v_new = values[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + inner[:, i] @ v_new
        s = s * last[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :t]
    return out.transpose(0, 1).to(dtype), s


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor):
    """One token of each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g and beta [B, Hv]; `state` [B, Hv, Dk,
    Dv] float32. Returns (o [B, Hv, Dv] in v's dtype, the states after it) (transformers'
    torch_recurrent_gated_delta_rule, a step)."""
    dtype = v.dtype
    q, k, v, g, beta = (x.transpose(0, 1) for x in _prepared(q, k, v, g, beta, divide=True))  # (back to batch first)
    s = state.to(torch.float32) * g.exp()[..., None, None]
    mem = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(dim=-2).to(dtype), s


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """x [B, C, T] after the conv state [B, C, K - 1] (the inputs before it): (silu of the depthwise causal conv1d
    [B, C, T] in x's dtype, the new conv state [B, C, K - 1]); weight [C, 1, K] (transformers' causal_conv1d_update:
    F.conv1d over the state and x)."""
    full = torch.cat([state.to(weight.dtype), x.to(weight.dtype)], dim=-1)
    out = F.conv1d(full, weight, None, padding=0, groups=x.shape[1])[..., -x.shape[-1]:]
    return F.silu(out).to(x.dtype), full[..., -state.shape[-1]:]


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                         kept: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: x [B, C], the conv states [slots, C, K - 1] read at `slots` [B] (zero where
    `kept` [B] is False) and written back there, shifted by the token. Returns silu(conv) [B, C] in x's dtype."""
    # (where, not a product: a slot a request that went non-finite left holds NaN, and NaN * 0 is NaN)
    conv = torch.where(kept[:, None, None], states.index_select(0, slots), 0)
    out, conv = causal_conv1d(x.unsqueeze(-1), weight, conv)
    states.index_copy_(0, slots, conv.to(states.dtype))
    return out.squeeze(-1)


def recurrent_gated_delta_rule_slots(q, k, v, g, beta, states: torch.Tensor, slots: torch.Tensor,
                                     kept: torch.Tensor) -> torch.Tensor:
    """recurrent_gated_delta_rule with each sequence's state at its slot of `states` [slots, Hv, Dk, Dv] float32
    (`slots` [B]; zero where `kept` [B] is False), the states after the token written back there. Returns o."""
    state = torch.where(kept[:, None, None, None], states.index_select(0, slots), 0)
    o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    states.index_copy_(0, slots, state)
    return o


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, query_start_loc: torch.Tensor,
                         slots: torch.Tensor, kept: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """A step's conv over each sequence's tokens x[query_start_loc[i]:query_start_loc[i + 1]] ([T, C] in all) after
    its conv state at slots[i] (zero where kept[i] is False), the state after them written back there. Returns
    silu(conv) [T, C] in x's dtype. (`max_len`, the longest sequence, sizes the Triton launch.)"""
    outs = []
    bounds = query_start_loc.tolist()
    for s, e, slot, k in zip(bounds[:-1], bounds[1:], slots.tolist(), kept.tolist()):
        conv = states[slot:slot + 1] if k else states.new_zeros(1, *states.shape[1:])
        out, conv = causal_conv1d(x[s:e].t().unsqueeze(0), weight, conv)
        states[slot] = conv[0]
        outs.append(out[0].t())
    return torch.cat(outs) if outs else x.new_empty(0, x.shape[1])
