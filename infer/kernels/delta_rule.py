"""The gated delta rule of Gated DeltaNet layers (Qwen3.5's and Qwen3-Next's linear attention), and their causal
depthwise conv1d, in torch: the CPU path and the oracle (transformers' torch_chunk_gated_delta_rule and
torch_recurrent_gated_delta_rule, the same ops in the same order). A step's ops on states kept at slots of a pool
(a decode step's causal_conv1d_update and recurrent_gated_delta_rule_slots, a prefill step's conv,
causal_conv1d_varlen) have Triton kernels on CUDA (kernels.delta_triton, dispatched by kernels.causal_conv1d_update,
kernels.gated_delta_decode and kernels.causal_conv1d_varlen); a prefill step's chunked rule runs over all its
sequences in one call (chunk_gated_delta_rule_varlen: chunks of one sequence each, batched), its intra-chunk
terms, inter-chunk recurrence and output in Triton on CUDA (kernels.gated_delta_prefill).

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
    (transformers' torch_chunk_gated_delta_rule: chunk_gated_delta_rule_varlen on a pool of that one state)."""
    states = state.to(torch.float32)[None].clone()
    zero = torch.zeros(1, dtype=torch.long, device=v.device)
    bounds = torch.tensor([0, v.shape[0]], device=v.device)
    o = chunk_gated_delta_rule_varlen(q, k, v, g, beta, states, bounds, zero, zero == 0, chunk)
    return o, states[0]


def chunk_layout(query_start_loc: torch.Tensor, chunk: int = 64) -> dict:
    """A prefill step's chunks: each sequence's tokens cut into chunks of `chunk` (its last one shorter; no chunk
    spans two sequences). {"first": [B + 1] each sequence's first chunk (the chunks after it, to first[i + 1], are its
    next ones), "start" / "end": [NC] each chunk's first token and the end of its tokens, "rows": [NC, chunk] the
    token rows of each chunk's positions (T, one past the last token, past its end), "counts": [B] the chunks of
    each sequence, "most": the most chunks of a sequence (an int)}."""
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    counts = (ends - starts + chunk - 1) // chunk
    first = F.pad(counts.cumsum(0), (1, 0))
    seq = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    start = starts[seq] + (torch.arange(len(seq), device=seq.device) - first[seq]) * chunk
    end = torch.minimum(start + chunk, ends[seq])
    rows = start[:, None] + torch.arange(chunk, device=start.device)
    total = int(query_start_loc[-1])
    rows = torch.where(rows < end[:, None], rows, total)
    return dict(first=first, start=start, end=end, rows=rows, counts=counts,
                most=int(counts.max()) if len(counts) else 0)


def chunk_terms(q, k, v, g, beta, rows: torch.Tensor):
    """The intra-chunk part of the chunked rule (transformers' torch_chunk_gated_delta_rule up to its loop over
    chunks) for the chunks of `rows` ([NC, C], chunk_layout's): [Hv, NC, C, ...] float32 (u: the WY values,
    w: the decayed keys' WY transform, inner: the decayed causal q k^T in a chunk, qd: q decayed to the chunk's
    start, kd: k decayed to its end), last [Hv, NC]: exp of the chunk's total log decay. Zero past a sequence's
    end."""
    q, k, v, g, beta = _prepared(q, k, v, g, beta)
    q, k, v = (F.pad(x, (0, 0, 0, 1))[:, rows] for x in (q, k, v))  # (row T: zeros)
    beta, g = (F.pad(x, (0, 1))[:, rows] for x in (beta, g))
    chunk = rows.shape[1]
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    g = g.cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    inner = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    return dict(u=u, w=w, inner=inner, qd=q * g.exp().unsqueeze(-1), kd=k * (g[..., -1:] - g).exp().unsqueeze(-1),
                last=g[..., -1].exp())


def chunk_gated_delta_rule_varlen(q, k, v, g, beta, states: torch.Tensor, query_start_loc: torch.Tensor,
                                  slots: torch.Tensor, kept: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """A prefill step's chunked rule over each sequence's tokens query_start_loc[i]:query_start_loc[i + 1] (q, k
    [T, Hk, Dk], v [T, Hv, Dv], g and beta [T, Hv]) from its state at slots[i] of `states` [slots, Hv, Dk, Dv] float32
    (zero where not kept[i]), the state after them written back there: the intra-chunk part batched over all the
    step's chunks (chunk_terms), the state carried chunk by chunk, batched over the sequences. Returns o [T, Hv, Dv]
    in v's dtype."""
    lay = chunk_layout(query_start_loc, chunk)
    t = chunk_terms(q, k, v, g, beta, lay["rows"])
    s = torch.where(kept[:, None, None, None], states.index_select(0, slots), 0).transpose(0, 1)  # [Hv, B, Dk, Dv]
    out = torch.zeros_like(t["u"])
    for i in range(lay["most"]):
        seqs = (lay["counts"] > i).nonzero().squeeze(1)
        c = lay["first"][seqs] + i
        h = s[:, seqs]
        v_new = t["u"][:, c] - t["w"][:, c] @ h
        out[:, c] = t["qd"][:, c] @ h + t["inner"][:, c] @ v_new
        s[:, seqs] = h * t["last"][:, c, None, None] + t["kd"][:, c].transpose(-1, -2) @ v_new
    states.index_copy_(0, slots, s.transpose(0, 1))
    out = out.flatten(1, 2)[:, (lay["rows"] < v.shape[0]).flatten()]
    return out.transpose(0, 1).to(v.dtype)


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


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None,
                  silu: bool = True):
    """x [B, C, T] after the conv state [B, C, K - 1] (the inputs before it): (silu of the depthwise causal conv1d
    [B, C, T] in x's dtype (the conv itself where not `silu`: LFM2's short conv), the new conv state [B, C, K - 1]);
    weight [C, 1, K], bias [C] or None (Mamba-2's conv has one) (transformers' causal_conv1d_update: F.conv1d over
    the state and x)."""
    full = torch.cat([state.to(weight.dtype), x.to(weight.dtype)], dim=-1)
    out = F.conv1d(full, weight, bias, padding=0, groups=x.shape[1])[..., -x.shape[-1]:]
    return (F.silu(out) if silu else out).to(x.dtype), full[..., -state.shape[-1]:]


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                         kept: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """One token of each of B sequences: x [B, C], the conv states [slots, C, K - 1] read at `slots` [B] (zero where
    `kept` [B] is False) and written back there, shifted by the token; `bias` [C] or None (Mamba-2's conv has
    one). Returns silu(conv) [B, C] (the conv itself where not `silu`) in x's dtype."""
    # (where, not a product: a slot a request that went non-finite left holds NaN, and NaN * 0 is NaN)
    conv = torch.where(kept[:, None, None], states.index_select(0, slots), 0)
    out, conv = causal_conv1d(x.unsqueeze(-1), weight, conv, bias, silu)
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
                         slots: torch.Tensor, kept: torch.Tensor, max_len: int | None = None,
                         bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """A step's conv over each sequence's tokens x[query_start_loc[i]:query_start_loc[i + 1]] ([T, C] in all) after
    its conv state at slots[i] (zero where kept[i] is False), the state after them written back there; `bias` [C] or
    None. Returns silu(conv) [T, C] (the conv itself where not `silu`) in x's dtype. (`max_len`, the longest
    sequence, sizes the Triton launch.)"""
    outs = []
    bounds = query_start_loc.tolist()
    for s, e, slot, k in zip(bounds[:-1], bounds[1:], slots.tolist(), kept.tolist()):
        conv = states[slot:slot + 1] if k else states.new_zeros(1, *states.shape[1:])
        out, conv = causal_conv1d(x[s:e].t().unsqueeze(0), weight, conv, bias, silu)
        states[slot] = conv[0]
        outs.append(out[0].t())
    return torch.cat(outs) if outs else x.new_empty(0, x.shape[1])
