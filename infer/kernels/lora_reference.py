"""Torch reference of the multi-LoRA ops: the CPU path, and the oracle of the Triton ops (kernels.lora_ops).

Each function states its math in a `Semantics:` line, in terms of every token's adapter slot s (-1: no adapter).
The ops do not take the per-token slots but the batch's tokens grouped by slot, which the caller computes once per
step (`infer.lora.batch.lora_groups`) and every op of the step shares: any object with these attributes (the
`SlotGroups` protocol; the kernels never import infer.lora, which sits above them):

    order [T] int64     the token indices sorted by slot (stable), the tokens without adapter (slot -1) first
    starts [S + 2] int64  starts[0] = 0; the tokens of slot s are order[starts[s + 1]:starts[s + 2]]
    in_order            the tokens are already sorted by slot (order is the identity): the reference then reads
                        every slot's rows as a slice instead of gathering them
    cache               a dict this module fills with what it derives on the host from order and starts (segment
                        bounds, the plan, gather indices), so that it is computed once per step, not per layer;
                        it must be emptied whenever order or starts change

The Triton ops read only `order` and `starts`, on the device and without a host sync, so that a CUDA graph can
replay them with new contents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class SlotGroups(Protocol):
    """A batch's tokens grouped by adapter slot (see the module docstring)."""

    order: torch.Tensor
    starts: torch.Tensor
    in_order: bool
    cache: dict


# ----------------------------------------------------------------------------------------------- per-step plan
_BATCHED_MAX_PER_SLOT = 2  # segments up to this long run as one padded bmm instead of a loop of matmuls


def segments(groups: SlotGroups) -> list[tuple[int, int, int]]:
    """(slot, begin, end) for every slot with tokens, as Python ints (a device sync on CUDA, done once a step)."""
    segs = groups.cache.get("segments")
    if segs is None:
        bounds = groups.starts.tolist()
        segs = groups.cache["segments"] = [(s - 1, bounds[s], bounds[s + 1]) for s in range(1, len(bounds) - 1)
                                           if bounds[s + 1] > bounds[s]]
    return segs


def plan(groups: SlotGroups) -> tuple:
    """How the reference runs this step's shrinks and expands, decided once per step: ("empty",) no token has an
    adapter; ("whole", slot) one adapter has every token; ("uniform", first, p, s0, n) tokens in slot order, n
    consecutive slots from s0 with p <= 2 tokens each, from token `first` on; ("padded",) many slots with a token
    or two each, gathered into one bmm; ("loop",) a matmul per slot (prefill)."""
    found = groups.cache.get("plan")
    if found is None:
        found = groups.cache["plan"] = _make_plan(groups)
    return found


def _make_plan(groups: SlotGroups) -> tuple:
    segs = segments(groups)
    if not segs:
        return ("empty",)
    if len(segs) == 1 and segs[0][1] == 0 and segs[0][2] == groups.order.shape[0]:
        return ("whole", segs[0][0])
    if len(segs) <= 2 or max(end - begin for _, begin, end in segs) > _BATCHED_MAX_PER_SLOT:
        return ("loop",)
    uni = _uniform(groups, segs)
    return ("padded",) if uni is None else ("uniform", *uni, len(segs))


def _uniform(groups: SlotGroups, segs) -> tuple[int, int, int] | None:
    """(first token, tokens per slot p, first slot s0) when the tokens are in slot order and the used slots are
    consecutive with p tokens each: tokens first..first+n*p then view as [n, p, :] against weights[s0:s0+n]."""
    if not groups.in_order:
        return None
    first, p, s0 = segs[0][1], segs[0][2] - segs[0][1], segs[0][0]
    for k, (slot, begin, end) in enumerate(segs):
        if slot != s0 + k or begin != first + k * p or end - begin != p:
            return None
    return first, p, s0


def _padded_tokens(groups: SlotGroups, device) -> tuple:
    """(token index per [slot, pad] position (0 where a slot has fewer tokens), the pad width, the slots used (None:
    all, in order), the positions holding a token (None: all), the tokens at those positions); once per step."""
    found = groups.cache.get("padded")
    if found is None:
        segs = segments(groups)
        pad = max(end - begin for _, begin, end in segs)
        order = groups.order.tolist()
        tok = [order[b + j] if b + j < e else -1 for _, b, e in segs for j in range(pad)]
        slots = [slot for slot, _, _ in segs]
        used = None if slots == list(range(groups.starts.shape[0] - 2)) else torch.tensor(slots, device=device)
        rows = [i for i, t in enumerate(tok) if t >= 0]  # the padded positions that hold a token
        found = groups.cache["padded"] = (
            torch.tensor([max(t, 0) for t in tok], device=device), pad, used,
            None if len(rows) == len(tok) else torch.tensor(rows, device=device),
            torch.tensor([t for t in tok if t >= 0], device=device))
    return found


def _slots(w: torch.Tensor, used: torch.Tensor | None) -> torch.Tensor:
    return w if used is None else w.index_select(0, used)


def _held(res: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The rows of a padded result that hold a token (see _padded_tokens)."""
    return res if rows is None else res.index_select(0, rows)


def _per_slot(src: torch.Tensor, weights: torch.Tensor, groups: SlotGroups, dst: torch.Tensor,
              scal: list[float] | None = None) -> torch.Tensor | None:
    """The loop over slots (prefill): dst[k] = src[token_k] @ weights[slot]^T in float32, times scal[slot] when
    given, for the k-th token with an adapter in slot order (dst has T - first rows, first = the tokens without
    adapter). Returns the token of every dst row: None when the tokens are in order (dst[k] is token first + k)."""
    segs = segments(groups)
    first = segs[0][1]
    idx = None if groups.in_order else groups.order[first:]
    rows = src[first:] if idx is None else src.index_select(0, idx)
    for slot, begin, end in segs:
        part = dst[begin - first:end - first]
        torch.matmul(rows[begin - first:end - first].float(), weights[slot].float().t(), out=part)
        if scal is not None:
            part.mul_(scal[slot])
    return idx


# ----------------------------------------------------------------------------------------------- ops
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, groups: SlotGroups, scale: float = 1.0) -> torch.Tensor:
    """Semantics: out[t] = scale * x[t] @ lora_a[s]^T for tokens with a slot s >= 0, out[t] = 0 for slot -1,
    accumulated and returned in float32 as [T, R]. x is [T, in], lora_a [S, R, in] (for a merged layer the shards'
    A matrices are stacked along R)."""
    kind, *arg = plan(groups)
    if kind == "whole":  # one adapter for the whole batch
        return (x.float() @ lora_a[arg[0]].float().t()).mul_(scale)
    if kind == "uniform":
        return _shrink_uniform(x, lora_a, scale, *arg)
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    if kind == "padded":  # many adapters with a token or two each (decoding): one bmm over the slots
        tok, pad, used, rows, dest = _padded_tokens(groups, x.device)
        xs = x.float().index_select(0, tok).view(-1, pad, x.shape[1])
        res = torch.bmm(xs, _slots(lora_a, used).float().transpose(1, 2)).view(-1, lora_a.shape[1])  # [S*pad, R]
        out.index_copy_(0, dest, _held(res, rows).mul_(scale))
    elif kind == "loop":
        first = segments(groups)[0][1]
        dst = out[first:] if groups.in_order else torch.empty_like(out[first:])  # in order: straight into out
        idx = _per_slot(x, lora_a, groups, dst)
        if scale != 1.0:
            dst.mul_(scale)
        if idx is not None:
            out.index_copy_(0, idx, dst)
    return out


def _shrink_uniform(x: torch.Tensor, lora_a: torch.Tensor, scale: float, first: int, p: int, s0: int,
                    n: int) -> torch.Tensor:
    """Decoding, tokens in slot order: one bmm over views, no gathers (see plan)."""
    rank = lora_a.shape[1]
    xs = x[first:first + n * p].float().reshape(n, p, -1)
    # A [n, R, in] @ x^T [n, in, p]: the matrix-vector form streams A row by row (1.5x the x @ A^T form)
    res = torch.bmm(lora_a[s0:s0 + n].float(), xs.transpose(1, 2)).transpose(1, 2).reshape(n * p, rank)
    if scale != 1.0:
        res.mul_(scale)
    if first == 0 and n * p == x.shape[0]:
        return res
    out = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    out[first:first + n * p] = res
    return out


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, groups: SlotGroups, scalings: torch.Tensor,
                y: torch.Tensor, offset: int = 0) -> None:
    """Semantics: y[t, offset:offset+out] += scalings[s] * h[t] @ lora_b[s]^T (computed in float32, added in y's
    dtype) for tokens with a slot s >= 0, in place; rows with slot -1 are untouched. h is [T, R] float32 (any
    strides: a merged layer passes the column slice of the shrink output that belongs to shard i, with offset =
    that shard's first output column), lora_b [S, out, R], scalings [S] float32, y [T, out_total]."""
    kind, *arg = plan(groups)
    if kind == "empty":
        return
    out_size = lora_b.shape[1]
    target = y.narrow(1, offset, out_size)
    if kind == "uniform":  # decoding, tokens in slot order: one bmm over views, added in place, no gathers
        first, p, s0, n = arg
        hs = h[first:first + n * p].float().reshape(n, p, -1) * scalings[s0:s0 + n].float().view(-1, 1, 1)
        dst = target[first:first + n * p].view(n, p, out_size)
        dst.add_(torch.bmm(hs, lora_b[s0:s0 + n].float().transpose(1, 2)).to(y.dtype))
    elif kind == "whole":
        slot = arg[0]
        target.add_((h.float() @ lora_b[slot].float().t()).mul_(float(scalings[slot])).to(y.dtype))
    elif kind == "padded":  # many adapters with a token or two each (decoding): one bmm over the slots
        tok, pad, used, rows, dest = _padded_tokens(groups, h.device)
        hs = h.float().index_select(0, tok).view(-1, pad, h.shape[1])
        hs = hs * _slots(scalings.float(), used).view(-1, 1, 1)
        res = torch.bmm(hs, _slots(lora_b, used).float().transpose(1, 2)).view(-1, out_size)
        target.index_add_(0, dest, _held(res, rows).to(y.dtype))
    else:
        first = segments(groups)[0][1]
        res = torch.empty(h.shape[0] - first, out_size, dtype=torch.float32, device=h.device)
        idx = _per_slot(h, lora_b, groups, res, scalings.tolist())
        if idx is None:
            target[first:].add_(res.to(y.dtype))
        else:
            target.index_add_(0, idx, res.to(y.dtype))


def lora_apply(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scalings: torch.Tensor, bounds: list[int], groups: SlotGroups,
               ranks: torch.Tensor | None = None) -> None:
    """Semantics: the LoRA of every shard of a merged layer, in place. Shard i (of n = len(bounds) - 1, rank
    R = lora_a.shape[1] // n, width w_i = bounds[i+1] - bounds[i]) owns y columns bounds[i]:bounds[i+1]; its B^T is
    Bt_i = lora_b[S*R*(bounds[i] - bounds[0]):S*R*(bounds[i+1] - bounds[0])].view(S, R, w_i) (lora_b is one flat
    buffer, shard after shard). For a token t with slot s >= 0, y[t, bounds[i]:bounds[i+1]] += scalings[i, s] *
    (x[t] @ A_i[s]^T) @ Bt_i[s] with A_i = lora_a[:, i*R:(i+1)*R]; rows with slot -1 untouched. ranks [n, S]
    int32, optional: rows r >= ranks[i, s] of A_i[s] and Bt_i[s] are zero (the Triton op skips them; the result is
    the same without it). Equal to one lora_shrink over lora_a and one lora_expand per shard."""
    n = len(bounds) - 1
    slots, rank = lora_a.shape[0], lora_a.shape[1] // n
    shard_b = [lora_b[slots * rank * (bounds[i] - bounds[0]):slots * rank * (bounds[i + 1] - bounds[0])]
               .view(slots, rank, bounds[i + 1] - bounds[i]) for i in range(n)]  # [S, R, w_i], contiguous
    kind, *arg = plan(groups)
    if kind == "uniform":
        _apply_uniform(x, y, lora_a, shard_b, scalings, bounds, *arg)
        return
    h = lora_shrink(x, lora_a, groups)
    for i, b in enumerate(shard_b):
        lora_expand(h[:, i * rank:(i + 1) * rank], b.transpose(1, 2), groups, scalings[i], y, bounds[i])


def _apply_uniform(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, shard_b: list[torch.Tensor],
                   scalings: torch.Tensor, bounds: list[int], first: int, p: int, s0: int, m: int) -> None:
    """lora_apply when decoding with the tokens in slot order: every product a bmm over views, no gathers."""
    n, rank = len(shard_b), lora_a.shape[1] // len(shard_b)
    whole = s0 == 0 and m == lora_a.shape[0]  # (the common case, spelled out: every op here costs ~2 us)
    xs = (x if first == 0 and m * p == x.shape[0] else x[first:first + m * p]).reshape(m, p, -1)
    a = lora_a if whole else lora_a[s0:s0 + m]
    if xs.dtype != torch.float32:
        xs, a = xs.float(), a.float()
    h = torch.bmm(a, xs.transpose(1, 2))  # [m, shards*R, p]: the matrix-vector form, 1.5x x @ A^T on CPU
    scal = scalings.t() if whole else scalings[:, s0:s0 + m].t()  # [m, shards]
    h = h.view(m, n, rank, p).mul_(scal.reshape(m, n, 1, 1)).view(m, n * rank, p).transpose(1, 2)
    rows = y if first == 0 and m * p == y.shape[0] else y[first:first + m * p]
    for i, b in enumerate(shard_b):
        bt = b if whole else b[s0:s0 + m]
        bt = bt if bt.dtype == torch.float32 else bt.float()
        res = torch.bmm(h[:, :, i * rank:(i + 1) * rank], bt)  # (bmm + add_: 1.7x faster than baddbmm_ here)
        rows.narrow(1, bounds[i], bt.shape[2]).view(m, p, -1).add_(res)


# ----------------------------------------------------------------------------------------------- fused expand
@dataclass
class LoRADelta:
    """A merged layer's adapter products for one batch, ready to be expanded into the layer's output: what an int4
    matmul adds in its epilogue (`gptq_matmul(..., lora=)`), so that the expand needs no launch of its own.

    hp [P, T, n*R] float32: P partial sums (over slices of the input) of x[t] @ A[s]^T for every token t with slot
    s = token_slots[t] >= 0, indexed by token (rows of slot -1 and rank padding are never read); lora_b, scalings,
    ranks and bounds as in `lora_apply` (bounds[0] == 0); groups the batch's `SlotGroups` (for an expand launched
    on its own when the matmul cannot add it, see `lora_ops.expand`). `fuse`: True adds it in the epilogue of every
    kernel that can (`gptq_gemm.fuses_lora`), None only where the epilogue's walk over the tile's adapters is short
    (one row, or few slots): never changes the result, only which kernel adds it."""

    hp: torch.Tensor
    lora_b: torch.Tensor
    token_slots: torch.Tensor
    scalings: torch.Tensor
    ranks: torch.Tensor
    bounds: list[int]
    groups: SlotGroups
    fuse: bool | None = True

    @property
    def rank(self) -> int:
        return self.hp.shape[2] // (len(self.bounds) - 1)


def lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scalings: torch.Tensor,
               bounds: list[int], groups: SlotGroups, ranks: torch.Tensor, token_slots: torch.Tensor,
               fuse: bool | None = True) -> LoRADelta:
    """Semantics: the shrink half of `lora_apply` (x [T, in] against every shard's A), kept for an expand that the
    int4 matmul adds in its epilogue (`add_delta`); one partial sum (P = 1)."""
    return LoRADelta(lora_shrink(x, lora_a, groups).unsqueeze(0), lora_b, token_slots, scalings, ranks,
                     list(bounds), groups, fuse)


def add_delta(delta: LoRADelta, y: torch.Tensor) -> None:
    """Semantics: the expand half of `lora_apply` from a `LoRADelta`, in place: for every token t with slot
    s >= 0 and shard i, y[t, bounds[i]:bounds[i+1]] += scalings[i, s] * h[t, i*R:(i+1)*R] @ Bt_i[s], with h the sum
    of the P partials, computed in float32 and added in y's dtype."""
    n, slots = len(delta.bounds) - 1, delta.scalings.shape[1]
    rank, h = delta.rank, delta.hp.sum(0)
    for i in range(n):
        lo, hi = delta.bounds[i], delta.bounds[i + 1]
        bt = delta.lora_b[slots * rank * lo:slots * rank * hi].view(slots, rank, hi - lo)
        for s in delta.token_slots.unique().tolist():
            if s < 0:
                continue
            rows = (delta.token_slots == s).nonzero().flatten()
            part = h.index_select(0, rows)[:, i * rank:(i + 1) * rank] @ bt[s].float()
            y[rows, lo:hi] = (y[rows, lo:hi].float() + part * delta.scalings[i, s]).to(y.dtype)
