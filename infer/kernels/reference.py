"""Torch reference for every kernel: the CPU path and the test oracle.

Each function states its math in a `Semantics:` line. The Triton ops in this package take the same arguments
and must compute the same function (up to floating-point rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------- small ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Semantics: if residual is given, h = x + residual, else h = x; y = weight * (h / sqrt(mean(h^2) + eps)),
    the normalisation computed in float32 and cast back to x's dtype before the weight multiply (as HF does).
    Returns y, or (y, h) when residual is given (h becomes the next residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(x.dtype)
    return y if residual is None else (y, residual)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int):
    """Semantics: rotate q [T, Hq*head_dim] and k [T, Hk*head_dim] by the angles of their token's position,
    NeoX style (the first and second halves of the rotary dims form the pairs, HF's rotate_half):
    x1, x2 = halves; out = (x1*cos - x2*sin, x2*cos + x1*sin), with cos, sin = cos_sin_cache[positions].chunk(2).
    cos_sin_cache is [max_positions, rot_dim] holding cos | sin; dims past rot_dim pass through. Returns (q, k)."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rot_dim/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, head_dim)
        rot = cos.shape[-1] * 2
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        x1, x2 = x_rot.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if x_pass.shape[-1]:
            out = torch.cat((out, x_pass), dim=-1)
        return out.reshape(shape)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: gate, up = x.chunk(2, dim=-1); y = silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------- GPTQ
def gptq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int, zeros_v1: bool = True, group_size: int | None = None,
                interleave: int = 1) -> torch.Tensor:
    """Semantics: y = x @ W^T with W[o, i] = (q[i, o] - z[g_idx[i], o]) * scales[g_idx[i], o], where q and z are the
    `bits`-wide values packed in qweight [in/pack, out] (along the input) and qzeros [groups, out/pack] (along the
    output), z stored minus one when zeros_v1, the product rounded to the scales' dtype (fp16) as GPTQ runtimes do;
    accumulated in float32, returned in x's dtype. x is [..., in], y [..., out]. `group_size` (optional) is a
    promise that g_idx[i] == i // group_size (-1: one group); it lets a kernel skip reading g_idx, never changes y.
    `interleave` > 1: qweight's rows are in the interleaved layout of `packing.field_rows`."""
    from .packing import deinterleave_rows, dequantize
    qweight = deinterleave_rows(qweight, bits, interleave)
    w = dequantize(qweight, qzeros, scales, g_idx, bits, zeros_v1, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)


# ----------------------------------------------------------------------------------------------- paged KV
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Semantics: for every token t with slot_mapping[t] >= 0, write k[t], v[t] ([Hk, D]) into the flat slot
    slot_mapping[t] of k_cache / v_cache ([num_blocks, block_size, Hk, D]; slot = block * block_size + offset).
    Tokens with slot -1 (padding) are skipped."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    kc.index_copy_(0, slot_mapping, k.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, v.to(vc.dtype))


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's paged cache, as [length, Hk, D]."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    return cache.index_select(0, block_table[:nblocks].long()).flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, max_query_len: int | None = None) -> torch.Tensor:
    """Semantics: for each sequence b, its queries q[query_start_loc[b]:query_start_loc[b+1]] ([n_b, Hq, D]) are the
    last n_b tokens of a sequence of seq_lens[b] tokens whose keys/values sit in the paged cache at the blocks
    block_tables[b] ([num_blocks, block_size, Hk, D]). Query i (position p = seq_lens[b] - n_b + i) attends to the
    keys at positions 0..p: out = softmax(scale * q K^T) V, head h reading KV head h // (Hq / Hk) (GQA).
    Returns [T, Hq, D] in q's dtype; the softmax is computed in float32."""
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(num_seqs) if qsl[b + 1] - qsl[b] == 1]
    if decode:
        _decode_attention(q, k_cache, v_cache, block_tables, lens, qsl, decode, scale, out)
    for b in range(num_seqs):
        n = qsl[b + 1] - qsl[b]
        if n <= 1:
            continue
        k = _gather_kv(k_cache, block_tables[b], lens[b])
        v = _gather_kv(v_cache, block_tables[b], lens[b])
        out[qsl[b]:qsl[b + 1]] = _attend(q[qsl[b]:qsl[b + 1]], k, v, scale, lens[b] - n)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int) -> torch.Tensor:
    """Causal attention of n queries at positions offset..offset+n-1 over L = offset + n keys.
    (4-D inputs: with 3-D ones torch's CPU SDPA falls back to a path that materialises the n x L scores.)"""
    n = q.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = qh.shape[1] != kh.shape[1]
    if offset == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        pos_q = torch.arange(offset, offset + n, device=q.device).unsqueeze(1)
        mask = torch.arange(k.shape[0], device=q.device).unsqueeze(0) <= pos_q
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, block_tables, lens, qsl, rows, scale, out) -> None:
    """One query per sequence: gather every sequence's blocks into one padded batch and attend at once."""
    idx = torch.tensor(rows, device=q.device)
    lens_t = torch.tensor([lens[b] for b in rows], device=q.device)
    max_len = int(lens_t.max())
    nblocks = (max_len + k_cache.shape[1] - 1) // k_cache.shape[1]
    tables = block_tables.index_select(0, idx)[:, :nblocks].long()
    r, flat = tables.shape[0], tables.flatten()
    k = k_cache.index_select(0, flat).view(r, -1, *k_cache.shape[2:])[:, :max_len].transpose(1, 2)  # [R,Hk,L,D]
    v = v_cache.index_select(0, flat).view(r, -1, *v_cache.shape[2:])[:, :max_len].transpose(1, 2)
    qstart = torch.tensor([qsl[b] for b in rows], device=q.device)
    qr = q.index_select(0, qstart).unsqueeze(2)  # [R, Hq, 1, D]
    mask = (torch.arange(max_len, device=q.device)[None] < lens_t[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=qr.shape[1] != k.shape[1])
    out.index_copy_(0, qstart, o[:, :, 0].to(out.dtype))


# ----------------------------------------------------------------------------------------------- LoRA
@dataclass
class LoRAGroups:
    """The tokens of one batch grouped by adapter slot; computed once per step and shared by every LoRA op.

    `order` [T] int64 holds the token indices sorted by slot (stable), the tokens without adapter (slot -1) first;
    the tokens of slot s are order[starts[s + 1]:starts[s + 2]] (`starts` [S + 2] int64, starts[0] = 0).
    `in_order` says the batch's tokens are already sorted by slot (order is the identity): the model runner orders
    a batch's sequences by adapter, so that the decode path reads every slot's tokens as a view, without gathers.
    """

    order: torch.Tensor
    starts: torch.Tensor
    in_order: bool = False
    _segments: list[tuple[int, int, int]] | None = None
    _padded: tuple | None = None
    _plan: tuple | None = None

    def plan(self) -> tuple:
        """How the CPU reference runs this step's shrinks and expands, decided once per step: ("empty",) no token
        has an adapter; ("whole", slot) one adapter has every token; ("uniform", first, p, s0, n) tokens in slot
        order, n consecutive slots from s0 with p <= 2 tokens each, from token `first` on; ("padded",) many slots
        with a token or two each, gathered into one bmm; ("loop",) a matmul per slot (prefill)."""
        if self._plan is None:
            segs = self.segments()
            total = self.order.shape[0]
            if not segs:
                self._plan = ("empty",)
            elif len(segs) == 1 and segs[0][1] == 0 and segs[0][2] == total:
                self._plan = ("whole", segs[0][0])
            elif _batched(segs):
                uni = _uniform(self, segs)
                self._plan = ("padded",) if uni is None else ("uniform", *uni, len(segs))
            else:
                self._plan = ("loop",)
        return self._plan

    def segments(self) -> list[tuple[int, int, int]]:
        """(slot, begin, end) for every slot with tokens, as Python ints (a device sync on CUDA, done once)."""
        if self._segments is None:
            bounds = self.starts.tolist()
            self._segments = [(s - 1, bounds[s], bounds[s + 1]) for s in range(1, len(bounds) - 1)
                              if bounds[s + 1] > bounds[s]]
        return self._segments


_BATCHED_MAX_PER_SLOT = 2  # segments up to this long run as one padded bmm instead of a loop of matmuls


def _batched(segs) -> bool:
    return len(segs) > 2 and max(end - begin for _, begin, end in segs) <= _BATCHED_MAX_PER_SLOT


def _padded_tokens(groups: "LoRAGroups", segs, device):
    """(token index per [slot, pad] position (0 where a slot has fewer tokens), the pad width, the slots used (None:
    all, in order), the positions holding a token (None: all), the tokens at those positions); computed once per
    step, since every layer shares `groups`."""
    if groups._padded is None:
        pad = max(end - begin for _, begin, end in segs)
        order = groups.order.tolist()
        tok = [order[b + j] if b + j < e else -1 for _, b, e in segs for j in range(pad)]
        slots = [slot for slot, _, _ in segs]
        used = None if slots == list(range(groups.starts.shape[0] - 2)) else torch.tensor(slots, device=device)
        rows = [i for i, t in enumerate(tok) if t >= 0]  # the padded positions that hold a token
        groups._padded = (torch.tensor([max(t, 0) for t in tok], device=device), pad, used,
                          None if len(rows) == len(tok) else torch.tensor(rows, device=device),
                          torch.tensor([t for t in tok if t >= 0], device=device))
    return groups._padded


def _uniform(groups: "LoRAGroups", segs) -> tuple[int, int, int] | None:
    """(first token, tokens per slot p, first slot s0) when the tokens are in slot order and the used slots are
    consecutive with p tokens each: tokens first..first+n*p then view as [n, p, :] against weights[s0:s0+n]."""
    if not groups.in_order or len(segs) < 2:
        return None
    first, p, s0 = segs[0][1], segs[0][2] - segs[0][1], segs[0][0]
    for k, (slot, begin, end) in enumerate(segs):
        if slot != s0 + k or begin != first + k * p or end - begin != p:
            return None
    return first, p, s0


def _slots(w: torch.Tensor, used: torch.Tensor | None) -> torch.Tensor:
    return w if used is None else w.index_select(0, used)


def lora_groups(token_slots: torch.Tensor, num_slots: int, in_order: bool = False) -> LoRAGroups:
    """Semantics: group token indices by token_slots[t] in -1..num_slots-1 (see LoRAGroups); no host sync.
    in_order: the caller knows token_slots is non-decreasing."""
    key = token_slots.long() + 1
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_slots + 1)
    starts = torch.zeros(num_slots + 2, dtype=torch.long, device=key.device)
    torch.cumsum(counts, 0, out=starts[1:])
    return LoRAGroups(order, starts, in_order)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, scale: float = 1.0,
                groups: LoRAGroups | None = None) -> torch.Tensor:
    """Semantics: out[t] = scale * x[t] @ lora_a[token_slots[t]]^T for tokens with a slot >= 0, out[t] = 0 for
    slot -1, accumulated and returned in float32 as [T, R]. x is [T, in], lora_a [S, R, in] (for a merged layer the
    shards' A matrices are stacked along R). `groups` = lora_groups(token_slots, S) may be passed to reuse it."""
    groups = groups if groups is not None else lora_groups(token_slots, lora_a.shape[0])
    rank = lora_a.shape[1]
    kind, *arg = groups.plan()
    if kind == "whole":  # one adapter for the whole batch
        return (x.float() @ lora_a[arg[0]].float().t()).mul_(scale)
    if kind == "uniform":  # decoding, tokens in slot order: one bmm over views, no gathers
        first, p, s0, n = arg
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
    out = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    segs = groups.segments()
    if kind == "empty":
        return out
    if kind == "padded":  # many adapters with a token or two each (decoding): one bmm over the slots
        tok, pad, used, rows, dest = _padded_tokens(groups, segs, x.device)
        xs = x.float().index_select(0, tok).view(len(segs), pad, -1)
        res = torch.bmm(xs, _slots(lora_a, used).float().transpose(1, 2)).view(-1, rank)  # [S*pad, R]
        out.index_copy_(0, dest, (res if rows is None else res.index_select(0, rows)).mul_(scale))
        return out
    first = segs[0][1]
    if groups.in_order:  # tokens already grouped: every slot's rows are a slice of x and of out
        for slot, begin, end in segs:
            torch.matmul(x[begin:end].float(), lora_a[slot].float().t(), out=out[begin:end])
        if scale != 1.0:
            out[first:].mul_(scale)
        return out
    idx = groups.order[first:]
    xs = x.index_select(0, idx).float()
    res = torch.empty(xs.shape[0], rank, dtype=torch.float32, device=x.device)
    for slot, begin, end in segs:
        torch.matmul(xs[begin - first:end - first], lora_a[slot].float().t(), out=res[begin - first:end - first])
    out.index_copy_(0, idx, res.mul_(scale))
    return out


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, scalings: torch.Tensor,
                y: torch.Tensor, offset: int = 0, groups: LoRAGroups | None = None) -> None:
    """Semantics: y[t, offset:offset+out] += scalings[s] * h[t] @ lora_b[s]^T (computed in float32, added in y's
    dtype) for s = token_slots[t] >= 0, in place; rows with slot -1 are untouched. h is [T, R] float32 (any
    strides: a merged layer passes the column slice of the shrink output that belongs to shard i, with offset =
    that shard's first output column), lora_b [S, out, R], scalings [S] float32, y [T, out_total]."""
    groups = groups if groups is not None else lora_groups(token_slots, lora_b.shape[0])
    kind, *arg = groups.plan()
    if kind == "empty":
        return
    out_size = lora_b.shape[1]
    target = y.narrow(1, offset, out_size)
    if kind == "uniform":  # decoding, tokens in slot order: one bmm over views, added in place, no gathers
        first, p, s0, n = arg
        hs = h[first:first + n * p].float().reshape(n, p, -1) * scalings[s0:s0 + n].float().view(-1, 1, 1)
        dst = target[first:first + n * p].view(n, p, out_size)
        dst.add_(torch.bmm(hs, lora_b[s0:s0 + n].float().transpose(1, 2)).to(y.dtype))
        return
    scal = scalings.tolist()
    if kind == "whole":
        slot = arg[0]
        target.add_((h.float() @ lora_b[slot].float().t()).mul_(scal[slot]).to(y.dtype))
        return
    segs = groups.segments()
    if kind == "padded":  # many adapters with a token or two each (decoding): one bmm over the slots
        tok, pad, used, rows, dest = _padded_tokens(groups, segs, h.device)
        hs = h.float().index_select(0, tok).view(len(segs), pad, -1)
        hs = hs * _slots(scalings.float(), used).view(-1, 1, 1)
        res = torch.bmm(hs, _slots(lora_b, used).float().transpose(1, 2)).view(-1, out_size)
        target.index_add_(0, dest, (res if rows is None else res.index_select(0, rows)).to(y.dtype))
        return
    first = segs[0][1]
    if groups.in_order:  # tokens already grouped: every slot's rows are a slice of h and of y
        for slot, begin, end in segs:
            res = torch.matmul(h[begin:end].float(), lora_b[slot].float().t()).mul_(scal[slot])
            target[begin:end].add_(res.to(y.dtype))
        return
    idx = groups.order[first:]
    hs = h.index_select(0, idx).float()
    res = torch.empty(hs.shape[0], out_size, dtype=torch.float32, device=h.device)
    for slot, begin, end in segs:
        part = res[begin - first:end - first]
        torch.matmul(hs[begin - first:end - first], lora_b[slot].float().t(), out=part)
        part.mul_(scal[slot])
    target.index_add_(0, idx, res.to(y.dtype))


def lora_apply(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scalings: torch.Tensor, bounds: list[int], token_slots: torch.Tensor,
               groups: LoRAGroups | None = None, ranks: torch.Tensor | None = None) -> None:
    """Semantics: the LoRA of every shard of a merged layer, in place. Shard i (of n = len(bounds) - 1, rank
    R = lora_a.shape[1] // n, width w_i = bounds[i+1] - bounds[i]) owns y columns bounds[i]:bounds[i+1]; its B^T is
    Bt_i = lora_b[S*R*(bounds[i] - bounds[0]):S*R*(bounds[i+1] - bounds[0])].view(S, R, w_i) (lora_b is one flat
    buffer, shard after shard). For s = token_slots[t] >= 0, y[t, bounds[i]:bounds[i+1]] += scalings[i, s] *
    (x[t] @ A_i[s]^T) @ Bt_i[s] with A_i = lora_a[:, i*R:(i+1)*R]; rows with slot -1 untouched. ranks [n, S]
    int32, optional: rows r >= ranks[i, s] of A_i[s] and Bt_i[s] are zero (the Triton op skips them; the result is
    the same without it). Equal to one lora_shrink over lora_a and one lora_expand per shard."""
    groups = groups if groups is not None else lora_groups(token_slots, lora_a.shape[0])
    n = len(bounds) - 1
    slots, rank = lora_a.shape[0], lora_a.shape[1] // n
    shard_b = [lora_b[slots * rank * (bounds[i] - bounds[0]):slots * rank * (bounds[i + 1] - bounds[0])]
               .view(slots, rank, bounds[i + 1] - bounds[i]) for i in range(n)]  # [S, R, w_i], contiguous
    kind, *arg = groups.plan()
    if kind == "uniform":  # decoding, tokens in slot order: every product a bmm over views, no gathers
        first, p, s0, m = arg
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
        return
    h = lora_shrink(x, lora_a, token_slots, 1.0, groups)
    for i, b in enumerate(shard_b):
        lora_expand(h[:, i * rank:(i + 1) * rank], b.transpose(1, 2), token_slots, scalings[i], y, bounds[i], groups)
