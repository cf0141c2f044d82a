"""Torch reference for the GEMM, attention, KV-cache and small kernels: the CPU path and the test oracle (the
multi-LoRA ops have theirs in `lora_reference.py`).

Each function states its math in a `Semantics:` line. The Triton ops in this package take the same arguments
and must compute the same function (up to floating-point rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------- small ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, lora=None,
             unit_offset: bool = False, float_weight: bool = False):
    """Semantics: if residual is given, h = x + residual, else h = x; y = weight * (h / sqrt(mean(h^2) + eps)),
    the normalisation computed in float32 and cast back to x's dtype before the weight multiply (as HF does).
    `unit_offset` (Gemma's RMSNorm): y = (h / sqrt(mean(h^2) + eps)) * (1 + weight), all in float32, rounded to
    x's dtype once. `float_weight` (OLMo 2's and 3's RMSNorm): y = weight * (h / sqrt(mean(h^2) + eps)), all in
    float32, rounded to x's dtype once.
    Returns y, or (y, h) when residual is given (h becomes the next residual). With `lora` (the LoRADelta by token
    of the one-shard layer whose output x is: o_proj, down_proj), x is first a copy with the delta added
    (`add_delta`): the layer's output as its `apply` would have left it."""
    if lora is not None:
        from .lora_reference import add_delta
        x = x.clone()
        add_delta(lora, x.view(-1, x.shape[-1]))
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        y = (y * (1.0 + weight.float())).to(x.dtype)
    elif float_weight:
        y = y.mul_(weight.float()).to(x.dtype)  # (in place: no third float32 copy of the row)
    else:
        y = weight * y.to(x.dtype)
    return y if residual is None else (y, residual)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None):
    """Semantics (transformers' CohereLayerNorm, and nn.LayerNorm in float32): over x's last dim,
    y = weight * (x - mean) / sqrt(var + eps) (+ bias), all in float32, rounded to x's dtype once. weight is [n], or
    [H, n] for x [..., H * n] (Cohere's q and k norms: each head by its own row)."""
    n = weight.shape[-1]
    xf = x.float().reshape(-1, weight.numel() // n, n)
    xf = xf - xf.mean(-1, keepdim=True)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float().reshape(-1, n)
    if bias is not None:
        y = y + bias.float().reshape(-1, n)
    return y.to(x.dtype).reshape(x.shape)


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """Semantics: h = table[ids] (the tokens' embedding rows, [T, hidden]); returns (rms_norm(h, weight, eps), h):
    the first decoder layer's input norm and the first residual."""
    h = F.embedding(ids, table)
    return rms_norm(h, weight, eps), h


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int):
    """Semantics: rotate q [T, Hq*head_dim] and k [T, Hk*head_dim] by the angles of their token's position,
    NeoX style (the first and second halves of the rotary dims form the pairs, HF's rotate_half):
    x1, x2 = halves; out = (x1*cos - x2*sin, x2*cos + x1*sin), with cos, sin = cos_sin_cache[positions].chunk(2).
    cos_sin_cache is [max_positions, rot_dim] holding cos | sin; dims past rot_dim pass through. Returns (q, k).
    In float32, rounded once to q's dtype; a bfloat16 table (a bfloat16 model's on a CPU: models.rope) in bfloat16,
    each product and sum rounded, as transformers rotates."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rot_dim/2]
    as_float = cos_sin_cache.dtype != torch.bfloat16

    def rotate(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, head_dim)
        rot = cos.shape[-1] * 2
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        x1, x2 = (x_rot.float() if as_float else x_rot).chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if x_pass.shape[-1]:
            out = torch.cat((out, x_pass), dim=-1)
        return out.reshape(shape)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor, lora=None) -> torch.Tensor:
    """Semantics: gate, up = x.chunk(2, dim=-1); y = silu(gate) * up. With `lora` (the gate_up layer's
    lora_reference.LoRADelta of this batch, by token; x [T, 2n]), x is first a copy with the delta added
    (`add_delta`): the layer's output as its `apply` would have left it."""
    if lora is not None:
        from .lora_reference import add_delta
        x = x.clone()
        add_delta(lora, x.view(-1, x.shape[-1]))
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor, lora=None) -> torch.Tensor:
    """Semantics: silu_and_mul with the tanh approximation of gelu in place of silu (Gemma's GeGLU MLP:
    transformers' gelu_pytorch_tanh): gate, up = x.chunk(2, dim=-1); y = gelu_tanh(gate) * up, gelu_tanh(g) =
    0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))); `lora` as silu_and_mul's."""
    if lora is not None:
        from .lora_reference import add_delta
        x = x.clone()
        add_delta(lora, x.view(-1, x.shape[-1]))
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# ----------------------------------------------------------------------------------------------- sampling
def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> torch.Tensor:
    """Semantics: a copy of logits [n, V] whose rows `rows` (int64 [R], None: all n) are -inf wherever
    `bitmask` (int32 [R or n, W], on logits' device; bit k of word w is token 32w + k, xgrammar's layout) has a
    0 bit, and at the tokens past its W * 32 bits."""
    vocab = logits.shape[-1]
    # read as bytes (little-endian, as x86 and CUDA are: token 32w + 8b + k is bit k of byte 4w + b): eight times
    # less to shift and compare than the int32 words against 32 shifts
    one = torch.ones(8, dtype=torch.uint8, device=bitmask.device)
    bits = one << torch.arange(8, dtype=torch.uint8, device=bitmask.device)  # made on the device: no copy
    allowed = ((bitmask.view(torch.uint8).unsqueeze(-1) & bits) != 0).view(bitmask.shape[0], -1)[:, :vocab]
    if allowed.shape[1] < vocab:  # a bitmask narrower than the logits (never the engine's: it covers them all)
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], 1)
    if rows is None:
        return torch.where(allowed, logits, float("-inf"))
    return logits.index_copy(0, rows, torch.where(allowed, logits.index_select(0, rows), float("-inf")))


# ----------------------------------------------------------------------------------------------- GPTQ
def gptq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int, zeros_v1: bool = True, group_size: int | None = None,
                interleave: int = 1, bias: torch.Tensor | None = None, lora=None,
                gated: bool | str = False, act: str | None = None, act_scalars=None) -> torch.Tensor:
    """Semantics: y = x @ W^T with W[o, i] = (q[i, o] - z[g_idx[i], o]) * scales[g_idx[i], o], where q and z are the
    `bits`-wide values packed in qweight [in/pack, out] (along the input) and qzeros [groups, out/pack] (along the
    output), z stored minus one when zeros_v1, the product rounded to the scales' dtype (fp16) as GPTQ runtimes do;
    accumulated in float32, returned in x's dtype. x is [..., in], y [..., out]. `group_size` (optional) is a
    promise that g_idx[i] == i // group_size (-1: one group); it lets a kernel skip reading g_idx, never changes y.
    `interleave` > 1: qweight's rows are in the interleaved layout of `packing.field_rows`. Then, in x's dtype,
    y += bias ([out]) when given, and y += the adapters' delta when `lora` (a `lora_reference.LoRADelta` of this
    batch; x [T, in]) is given (`lora_reference.add_delta`): a kernel adds both in its epilogue. `gated` (a merged
    gate|up layer): silu_and_mul of that y (True or "silu"; "gelu_tanh": gelu_tanh_and_mul), [..., out / 2], which a
    kernel computes in its epilogue. `act` (an MLP without gate's up projection): `ungated_act` of that y (xIELU's
    `act_scalars`), which a kernel applies in its epilogue too."""
    from .lora_reference import add_delta
    from .packing import deinterleave_rows, dequantize
    qweight = deinterleave_rows(qweight, bits, interleave)
    w = dequantize(qweight, qzeros, scales, g_idx, bits, zeros_v1, torch.float32)
    y = (x.float() @ w.t()).to(x.dtype)
    if bias is not None:
        y.add_(bias)
    if lora is not None:
        add_delta(lora, y.view(-1, y.shape[-1]))
    if act:
        return ungated_act(y, act, act_scalars)
    if not gated:
        return y
    return gelu_tanh_and_mul(y) if gated == "gelu_tanh" else silu_and_mul(y)


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """Semantics: rotary_embedding of q and k, then store_kv of the rotated k and v ([T, Hk, D] views of k and v);
    returns the rotated q (the attention reads k and v from the cache)."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache, head_dim)
    t = q.shape[0]
    store_kv(k.reshape(t, -1, head_dim), v.reshape(t, -1, head_dim), k_cache, v_cache, slot_mapping)
    return q


def decode_attention(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, lora=None, softcap: float = 0.0,
                     window: int = 0, sinks: torch.Tensor | None = None, chunked: bool = False) -> torch.Tensor:
    """Semantics: a decode step's attention from its unrotated q [T, Hq*D], k, v [T, Hk*D], every sequence
    querying one token, its last (position seq_lens[b] - 1, written at slot_mapping[t]):
    paged_attention(rotary_store_kv(...) as [T, Hq, D], ..., max_query_len=1), returned as [T, Hq, D]. With `lora`
    (the qkv layer's lora_reference.LoRADelta of this batch, by token), q|k|v are first a copy with the delta added
    (`add_delta`): the layer's output as its `apply` would have left it. `window`, `sinks`, `chunked`:
    paged_attention's."""
    t = q.shape[0]
    if lora is not None:
        from .lora_reference import add_delta
        qkv = torch.cat([q, k, v], dim=-1)
        add_delta(lora, qkv)
        q, k, v = qkv.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
    q = rotary_store_kv(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache, slot_mapping)
    return paged_attention(q.reshape(t, -1, head_dim), k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           scale, max_query_len=1, softcap=softcap, window=window, sinks=sinks, chunked=chunked)


# ----------------------------------------------------------------------------------------------- paged KV
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Semantics: for every token t with slot_mapping[t] >= 0, write k[t], v[t] ([Hk, D]) into the flat slot
    slot_mapping[t] of k_cache / v_cache ([num_blocks, block_size, Hk, D]; slot = block * block_size + offset),
    as `to_cache` rounds them to the cache's dtype. Tokens with slot -1 (padding) are skipped."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k, v = to_cache(k, kc.dtype), to_cache(v, vc.dtype)
    if kc.element_size() == 1:  # float8: torch has no index_copy_ for it; the bytes are copied
        kc, vc, k, v = kc.view(torch.uint8), vc.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    kc.index_copy_(0, slot_mapping, k)
    vc.index_copy_(0, slot_mapping, v)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Semantics: x as a KV cache of `dtype` stores it: cast to dtype; for float8 (--kv-cache-dtype fp8, scale 1.0
    as vLLM's default) first saturated to the format's finite range (+-448 e4m3, +-57344 e5m2), then rounded to
    nearest even. Reads upcast the stored values exactly to the query's dtype."""
    if is_fp8(dtype):
        most = torch.finfo(dtype).max
        return x.clamp(-most, most).to(dtype)
    return x.to(dtype)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `length` tokens of one sequence's paged cache, as [length, Hk, D] of `dtype` (a float8 cache's
    values upcast exactly)."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    return cache.index_select(0, block_table[:nblocks].long()).flatten(0, 1)[:length].to(dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, max_query_len: int | None = None, softcap: float = 0.0,
                    window: int = 0, sinks: torch.Tensor | None = None, chunked: bool = False) -> torch.Tensor:
    """Semantics: for each sequence b, its queries q[query_start_loc[b]:query_start_loc[b+1]] ([n_b, Hq, D]) are the
    last n_b tokens of a sequence of seq_lens[b] tokens whose keys/values sit in the paged cache at the blocks
    block_tables[b] ([num_blocks, block_size, Hk, D]). Query i (position p = seq_lens[b] - n_b + i) attends to the
    keys at positions 0..p: out = softmax(scale * q K^T) V, head h reading KV head h // (Hq / Hk) (GQA); a float8
    cache's K and V upcast to q's dtype (exactly) first. Returns [T, Hq, D] in q's dtype; the softmax is computed
    in float32. `softcap` > 0 (Gemma 2's attn_logit_softcapping): each score s = scale * q.k is capped to
    softcap * tanh(s / softcap) before the softmax (the scores then in float32). `window` > 0 (a sliding-window
    layer: transformers' sliding_window): query at p attends to the keys at positions max(0, p - window + 1)..p
    only, the last `window` keys including its own (masking_utils' kv_idx > q_idx - sliding_window). `sinks`
    (float32 [Hq]: gpt-oss's attention sinks): head h's softmax denominator adds exp(sinks[h]), a logit no value
    goes with (transformers' eager_attention_forward: the sink column concatenated to the scores, dropped after the
    softmax). `chunked` (Llama 4's chunked attention: attention_chunk_size, `window` its chunk): query at p attends
    to the keys of its own chunk only, positions p - p % window..p (masking_utils' chunked_overlay: kv_idx //
    chunk_size == q_idx // chunk_size); every key it reads is among the last `window` (a sliding window's blocks
    freed behind it are never read)."""
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(num_seqs) if qsl[b + 1] - qsl[b] == 1]
    # a few queries after a context (a speculative decoding step's verify rows): each query a decode row of its own
    # (its position + 1 keys of its sequence's blocks) in the decode batch, when that batch is small enough to be
    # attended at once: no gather and masked SDPA per sequence and layer
    short = [b for b in range(num_seqs) if 1 < qsl[b + 1] - qsl[b] <= SHORT_QUERIES and lens[b] > qsl[b + 1] - qsl[b]]
    if short:
        count, longest, heads = len(decode) + sum(qsl[b + 1] - qsl[b] for b in short), max(lens), k_cache.shape[2]
        if _per_sequence(count, longest, heads, False) or count * longest * heads >= PER_SEQUENCE_POSITIONS:
            short = []  # (the bound also keeps the batch's gathered K and V within the memory plan's decode term)
    if decode or short:
        seqs, queries, row_lens = list(decode), [qsl[b] for b in decode], [lens[b] for b in decode]
        for b in short:
            n = qsl[b + 1] - qsl[b]
            seqs += [b] * n
            queries += range(qsl[b], qsl[b + 1])
            row_lens += range(lens[b] - n + 1, lens[b] + 1)
        _rows_attention(q, k_cache, v_cache, block_tables, seqs, queries, row_lens, scale, out,
                        batched=bool(short), softcap=softcap, window=window, sinks=sinks, chunked=chunked)
    done = set(short)
    if not softcap and sinks is None:  # whole prompts of one length (no context before them): attended at once
        whole = {}
        for b in range(num_seqs):
            n = qsl[b + 1] - qsl[b]
            if 1 < n == lens[b] and b not in done and (not window or n <= window):
                whole.setdefault(n, []).append(b)
        for n, seqs in whole.items():
            if len(seqs) > 1 and _whole_prompts(q, k_cache, v_cache, block_tables, seqs, [qsl[b] for b in seqs], n,
                                                scale, out):
                done.update(seqs)
    for b in range(num_seqs):
        n = qsl[b + 1] - qsl[b]
        if n <= 1 or b in done:
            continue
        k = _gather_kv(k_cache, block_tables[b], lens[b], q.dtype)
        v = _gather_kv(v_cache, block_tables[b], lens[b], q.dtype)
        out[qsl[b]:qsl[b + 1]] = _attend(q[qsl[b]:qsl[b + 1]], k, v, scale, lens[b] - n, softcap, window, sinks,
                                         chunked)
    return out


def _whole_prompts(q, k_cache, v_cache, block_tables, seqs: list[int], starts: list[int], n: int, scale: float,
                   out: torch.Tensor) -> bool:
    """Causal attention of the sequences `seqs`, each a whole prompt of n tokens (its queries q[start:start + n] at
    positions 0..n-1, no context before them): one gather of their keys and values and one SDPA over the batch
    (per sequence, a prefill step of 8 prompts made 8 gathers, finiteness checks and SDPA calls a layer, each a
    sync of torch's CPU threads). Returns False, having written nothing, when a key or value is not finite: the
    per-sequence path then splits the queries around it (_attend)."""
    count, bs = len(seqs), k_cache.shape[1]
    blocks = (n + bs - 1) // bs
    ids = block_tables[seqs, :blocks].long().flatten()
    k = k_cache.index_select(0, ids).unflatten(0, (count, blocks)).flatten(1, 2)[:, :n].to(q.dtype)  # [B, n, Hk, D]
    v = v_cache.index_select(0, ids).unflatten(0, (count, blocks)).flatten(1, 2)[:, :n].to(q.dtype)
    if not bool(torch.isfinite(k.sum() + v.sum())):  # (finite values that overflow the sum: the exact path too)
        return False
    together = all(b == a + n for a, b in zip(starts, starts[1:]))  # (a step's prompts: one after another)
    rows = q[starts[0]:starts[0] + count * n].unflatten(0, (count, n)) if together else \
        torch.stack([q[i:i + n] for i in starts])
    o = _sdpa(rows.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
              enable_gqa=q.shape[1] != k.shape[2]).transpose(1, 2)  # [B, n, Hq, D]
    if together:
        out[starts[0]:starts[0] + count * n] = o.flatten(0, 1)
    else:
        for i, start in enumerate(starts):
            out[start:start + n] = o[i]
    return True


MASK_ELEMENTS = 1 << 17  # the most (query x key) mask entries one masked SDPA call builds (a bool mask, and the
# float copy torch's CPU SDPA makes of it): a chunked prefill's queries after a context go in row chunks this bounds


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, softcap: float = 0.0,
          sinks: torch.Tensor | None = None):
    """F.scaled_dot_product_attention, or with `softcap` > 0 the same attention with each score capped to
    softcap * tanh(score / softcap) (which SDPA cannot do), in float32 and rounded to q's dtype: the queries in
    row chunks of at most MASK_ELEMENTS scores a head (a prefill's n x L scores whole would outgrow the memory
    plan's per-token activations), a KV head's group of query heads as rows of one matmul over its keys (no
    repeated K and V). `sinks` (float32 [Hq]) the same way: each head's softmax denominator adds exp(sinks[h])."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    n, keys, hk = q.shape[-2], k.shape[-2], k.shape[-3]
    group = q.shape[-3] // hk
    qg = q.unflatten(-3, (hk, group))  # [..., Hk, group, n, D]: head h reads KV head h // group
    # each KV head's group of query heads as rows of one matmul over its keys: a matmul broadcasting K and V over
    # the group ([..., Hk, 1, L, D]) expands them into a copy per query head, past the plan's gathered K and V
    kf, vf = k.float(), v.float()  # [..., Hk, L, D]
    if attn_mask is not None:
        attn_mask = attn_mask.unsqueeze(-3)
    rows = max(1, MASK_ELEMENTS // max(keys, 1))  # (no keys: the padding rows of a captured graph's warm-up)
    out = []
    for start in range(0, n, rows):
        end = min(n, start + rows)
        qc = qg[..., start:end, :].float().flatten(-3, -2)  # [..., Hk, group * r, D]
        s = torch.matmul(qc, kf.transpose(-1, -2)).unflatten(-2, (group, end - start))  # [..., Hk, group, r, L]
        if softcap:
            torch.tanh(s.mul_(scale).div_(softcap), out=s).mul_(softcap)  # (in place: one copy of the scores, not 4)
        else:
            s.mul_(scale)
        if is_causal:  # query i of n sees the keys up to keys - n + i
            pos = torch.arange(start, end, device=q.device).unsqueeze(1) + (keys - n)
            s.masked_fill_(torch.arange(keys, device=q.device).unsqueeze(0) > pos, float("-inf"))
        if attn_mask is not None:
            mask = attn_mask if attn_mask.shape[-2] == 1 else attn_mask[..., start:end, :]
            s.masked_fill_(~mask, float("-inf"))
        o = torch.matmul(_softmax(s, sinks, hk, group).flatten(-3, -2), vf)  # [..., Hk, group * r, D]
        out.append(o.unflatten(-2, (group, end - start)).to(q.dtype))
    return (out[0] if len(out) == 1 else torch.cat(out, -2)).flatten(-4, -3)


def _softmax(s: torch.Tensor, sinks: torch.Tensor | None, hk: int, group: int) -> torch.Tensor:
    """The softmax over the last dim of the scores s [..., Hk, group, r, L] (float32); with `sinks` ([Hk * group]),
    head h's denominator adds exp(sinks[h]) (the maximum taken over the sink too, as transformers')."""
    if sinks is None:
        return torch.softmax(s, dim=-1)
    sink = sinks.float().view(hk, group, 1, 1)
    top = torch.maximum(s.amax(-1, keepdim=True), sink)
    p = s.sub_(top).exp_()  # (in place: one copy of the scores, as the soft-capped path's)
    return p.div_(p.sum(-1, keepdim=True).add_(torch.exp(sink - top)))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int,
            softcap: float = 0.0, window: int = 0, sinks: torch.Tensor | None = None,
            chunked: bool = False) -> torch.Tensor:
    """Causal attention of n queries at positions offset..offset+n-1 over L = offset + n keys; `window` > 0: query
    at p over the keys p - window + 1..p only (paged_attention's); `chunked` too: over the keys of its chunk of
    `window`, p - p % window..p, each chunk's queries attended causally over their chunk's keys alone (no key of
    another chunk reaches them, not even as 0 x NaN).
    (4-D inputs: with 3-D ones torch's CPU SDPA falls back to a path that materialises the n x L scores.)"""
    n = q.shape[0]
    if chunked and window:
        parts = []
        for first in range(offset - offset % window, offset + n, window):  # each chunk the queries reach
            lo, hi = max(first, offset), min(first + window, offset + n)  # (its queries' positions)
            parts.append(_attend(q[lo - offset:hi - offset], k[first:hi], v[first:hi], scale, lo - first, softcap,
                                 0, sinks))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    if n > 1:  # a key or value that is not finite (a prompt token the model overflowed on) past a query's position
        # reaches that query through SDPA's masked weights (0 x NaN): the keys before it, and the prefix cache's
        # blocks of them, went NaN with it (a later request of the same prefix ended "not finite"). The queries
        # before the first such key are attended without it, the rest after it (exact: neither sees a key past it)
        own = slice(offset + 1, offset + n)  # query i's own key offset + i, past every query before it
        bad = ~(torch.isfinite(k[own]).flatten(1).all(1) & torch.isfinite(v[own]).flatten(1).all(1))
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0]) + 1  # the first query whose own key is not finite
            return torch.cat([_attend(q[:j], k[:offset + j], v[:offset + j], scale, offset, softcap, window, sinks),
                              _attend(q[j:], k, v, scale, offset + j, softcap, window, sinks)])
    if window and n > 1 and offset + n > window:  # a key or value that is not finite before a later query's window
        # (a token the model overflowed on, out of the window since) reaches that query through its masked weight
        # (0 x NaN) too (one query alone is attended over its window's keys only, below): the queries past the
        # last such key's window are attended over the keys after it, those before it with it (they attend to it)
        lo = max(0, offset - window + 1)  # (no query reads the keys before)
        seen = slice(lo, offset + 1)  # (those after: the queries' own keys, split above)
        bad = ~(torch.isfinite(k[seen]).flatten(1).all(1) & torch.isfinite(v[seen]).flatten(1).all(1))
        if bool(bad.any()):
            cut = lo + int(bad.nonzero()[-1, 0]) + 1  # the keys after the last such key
            i = cut - 1 + window - offset  # the first query whose window starts past it
            if i < n:
                i = max(i, 0)
                rest = _attend(q[i:], k[cut:], v[cut:], scale, offset + i - cut, softcap, window, sinks)
                if not i:
                    return rest
                return torch.cat([_attend(q[:i], k[:offset + i], v[:offset + i], scale, offset, softcap, window,
                                          sinks), rest])
    if window and offset + n <= window:
        window = 0  # every query sees all its keys: plain causal attention
    if window and n == 1:  # one query at the last position: the last `window` keys, unmasked
        k, v, offset = k[offset + 1 - window:], v[offset + 1 - window:], window - 1
        window = 0
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = qh.shape[1] != kh.shape[1]
    if not window and (offset == 0 or n == 1):  # one query at the last position sees every key: no mask
        o = _sdpa(qh, kh, vh, is_causal=offset == 0, scale=scale, enable_gqa=gqa, softcap=softcap, sinks=sinks)
        return o[0].transpose(0, 1)
    # after a context (a chunked prefill's later chunk): masked, in row chunks, each over the keys up to its last
    # query, so that the mask (rows x keys, and its float copy) never outgrows MASK_ELEMENTS (the n x L mask of a
    # 2,000-token chunk after 2,000 tokens took 19 MB, where the memory plan counts per-token activations)
    # (a window: each row chunk over the keys from its first query's window on, masked before each row's window)
    rows = max(1, MASK_ELEMENTS // k.shape[0])
    out = []
    for start in range(0, n, rows):
        end = min(n, start + rows)
        keys = offset + end
        lo = max(0, offset + start - window + 1) if window else 0
        pos_q = torch.arange(offset + start, offset + end, device=q.device).unsqueeze(1)
        kpos = torch.arange(lo, keys, device=q.device).unsqueeze(0)
        mask = kpos <= pos_q
        if window:
            mask = mask & (kpos > pos_q - window)
        out.append(_sdpa(qh[:, :, start:end], kh[:, :, lo:keys], vh[:, :, lo:keys], attn_mask=mask, scale=scale,
                         enable_gqa=gqa, softcap=softcap, sinks=sinks)[0])
    return (out[0] if len(out) == 1 else torch.cat(out, 1)).transpose(0, 1)


# Decode attention on CPU, two ways: one unmasked SDPA per sequence, or one SDPA over the batch, its sequences
# padded to the longest and masked (unmasked when all have the same length). The batch's call has no per-sequence
# overhead (tens of microseconds of Python per sequence and layer), but it computes the padding, torch's CPU SDPA
# is several times slower per position with a mask, and its cost per position climbs steeply once the gathered keys
# outgrow the caches (64 sequences of 600 tokens: 3-9x the per-sequence way). `_per_sequence` picks the first way
# for long contexts and large batches; the thresholds are measured on the 2-core CI machine over 4-64 sequences of
# 40-600 tokens, 4 and 12 KV heads, equal and uneven lengths (docs/perf.md, tenth session).
PER_SEQUENCE_LEN = 512  # uneven lengths: at least this long
PER_SEQUENCE_MIN_LEN = 128  # otherwise at least this long, and at least this many (sequence x length x KV head):
PER_SEQUENCE_POSITIONS = 24000  # uneven lengths
PER_SEQUENCE_POSITIONS_EQUAL = 48000  # equal lengths (no padding, no mask)
SHORT_QUERIES = 8  # paged_attention: a sequence of at most this many queries may join the decode batch


def _per_sequence(num_seqs: int, max_len: int, kv_heads: int, equal: bool) -> bool:
    positions = num_seqs * max_len * kv_heads
    if equal:
        return max_len >= PER_SEQUENCE_MIN_LEN and positions >= PER_SEQUENCE_POSITIONS_EQUAL
    return max_len >= PER_SEQUENCE_LEN or (max_len >= PER_SEQUENCE_MIN_LEN and positions >= PER_SEQUENCE_POSITIONS)


def longest_batched_decode(num_seqs: int, max_len: int, kv_heads: int) -> int:
    """The longest length (at most `max_len`) at which `num_seqs` sequences of equal length still decode as one
    batch: the batch whose gathered K and V are the largest `_decode_attention` holds at once (uneven and smaller
    batches gather no more, up to the rounding: one token per sequence). The profile run measures it
    (engine.profile.worst_case_batches)."""
    fits = max(PER_SEQUENCE_MIN_LEN - 1, (PER_SEQUENCE_POSITIONS_EQUAL - 1) // (kv_heads * max(num_seqs, 1)))
    return min(max_len, fits)


def decode_gather_tokens(num_seqs: int, max_len: int, kv_heads: int) -> int:
    """The most (sequence x token) positions `_decode_attention` gathers at once for any batch of up to `num_seqs`
    sequences of up to `max_len` tokens: one sequence when it goes one at a time, else the padded batch (the memory
    plan's decode term, memory.sizes.activation_bytes)."""
    return max(max_len, num_seqs * longest_batched_decode(num_seqs, max_len, kv_heads))


def _decode_attention(q, k_cache, v_cache, block_tables, lens, qsl, rows, scale, out) -> None:
    """One query per sequence: each sequence on its own (no padding, no mask) when `_per_sequence` says so, else
    every sequence's blocks gathered into one batch and attended at once (masked past each one's length when the
    lengths differ)."""
    _rows_attention(q, k_cache, v_cache, block_tables, rows, [qsl[b] for b in rows], [lens[b] for b in rows], scale,
                    out)


def _rows_attention(q, k_cache, v_cache, block_tables, seqs, queries, row_lens, scale, out, batched=False,
                    softcap: float = 0.0, window: int = 0, sinks: torch.Tensor | None = None,
                    chunked: bool = False) -> None:
    """`_decode_attention` of rows: query q[queries[r]] over the first row_lens[r] keys of sequence seqs[r]'s
    blocks (`batched`: as one batch, whatever `_per_sequence` says); `window` > 0: over the last `window` of them
    only (`chunked`: over those of its chunk, `_first_key`)."""
    max_len = max(row_lens)
    equal = min(row_lens) == max_len
    if not batched and _per_sequence(len(seqs), max_len, k_cache.shape[2], equal):
        tables = block_tables.long()
        for b, i, n in zip(seqs, queries, row_lens):
            k = _gather_kv(k_cache, tables[b], n, q.dtype)
            v = _gather_kv(v_cache, tables[b], n, q.dtype)
            out[i:i + 1] = _attend(q[i:i + 1], k, v, scale, n - 1, softcap, window, sinks, chunked)
        return
    idx = torch.tensor(seqs, device=q.device)
    bs = k_cache.shape[1]
    nblocks = (max_len + bs - 1) // bs
    # a window: the blocks before the shortest row's window hold no key any row sees (not gathered)
    first = min(_first_key(n, window, chunked) for n in row_lens) // bs if window else 0
    tables = block_tables.index_select(0, idx)[:, first:nblocks].long()
    r, flat, keys = tables.shape[0], tables.flatten(), max_len - first * bs
    k = k_cache.index_select(0, flat).view(r, -1, *k_cache.shape[2:])[:, :keys].transpose(1, 2).to(q.dtype)
    v = v_cache.index_select(0, flat).view(r, -1, *v_cache.shape[2:])[:, :keys].transpose(1, 2).to(q.dtype)
    qstart = torch.tensor(queries, device=q.device)
    qr = q.index_select(0, qstart).unsqueeze(2)  # [R, Hq, 1, D]
    mask = None
    if not equal or (window and (keys > window or chunked)):  # (a window: the keys before each row's last `window`
        # masked; a chunk: those before each row's chunk)
        lens_t = torch.tensor(row_lens, device=q.device)
        kpos = torch.arange(first * bs, max_len, device=q.device)[None]
        mask = kpos < lens_t[:, None]
        if window:
            mask = mask & (kpos >= _first_key(lens_t[:, None], window, chunked))
        mask = mask[:, None, None, :]
        # the masked keys' and values' slots may hold what is not finite, and 0 x NaN would reach the row: a shorter
        # row's padding (its table padded with block 0) and its own last block's slots past its length (what their last
        # owner left: a request that went non-finite), verify rows' later drafts (a draft the model overflowed on,
        # rejected later), a window's keys before it (a token overflowed on, out of the window since); k and v are this
        # call's copies: zeroed in place
        pad = ~mask[:, :, 0, :, None]
        k.masked_fill_(pad, 0)
        v.masked_fill_(pad, 0)
    o = _sdpa(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=qr.shape[1] != k.shape[1], softcap=softcap,
              sinks=sinks)
    out.index_copy_(0, qstart, o[:, :, 0].to(out.dtype))


def _first_key(length, window: int, chunked: bool):
    """The first key a query at position length - 1 reads (an int, or a tensor of lengths): that of the last
    `window` keys, or of its chunk (`chunked`: Llama 4's attention_chunk_size); 0 at least."""
    if chunked:
        return (length - 1) - (length - 1) % window
    return (length - window).clamp(min=0) if isinstance(length, torch.Tensor) else max(0, length - window)


class MoELoRA(NamedTuple):
    """Every adapter slot's LoRA of a mixture of experts' stacked experts (lora.experts), and the step's slot of each
    token: a13 [S, E, r, H], b13 [S, E, 2I, r] (the gate_up projection's), a2 [S, E, r, I], b2 [S, E, H, r] (the
    down projection's), each B with its module's scaling folded in (zero where an adapter does not adapt it);
    token_slots [T] int64 (-1: no adapter)."""
    a13: torch.Tensor
    b13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    token_slots: torch.Tensor


def moe_lora_delta(rows: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor | int, a: torch.Tensor,
                   b: torch.Tensor) -> torch.Tensor:
    """Semantics: delta[p] = b[s, e] @ (a[s, e] @ rows[p]) for each row p, s = slots[p], e = experts[p] (or one
    expert for every row), rounded to rows' dtype; 0 where s = -1. On CUDA without a host sync, shapes fixed by the
    rows (a CUDA graph records it): each row's A and B gathered from the slots; on the CPU, for one expert, the rows
    of each slot as two matmuls."""
    if rows.is_cuda or not isinstance(experts, int):
        valid = slots >= 0
        s = slots.clamp(min=0)
        u = torch.einsum("pri,pi->pr", a[s, experts], rows)
        d = torch.einsum("por,pr->po", b[s, experts], u)
        return d * valid[:, None].to(d.dtype)
    d = rows.new_zeros(rows.shape[0], b.shape[2])
    for s in torch.unique(slots).tolist():
        if s >= 0:
            pick = torch.where(slots == s)[0]
            d[pick] = F.linear(F.linear(rows[pick], a[s, experts]), b[s, experts])
    return d


class OaiExperts(NamedTuple):
    """gpt-oss's experts beyond the SwiGLU ones (transformers' GptOssExperts): w13's rows in transformers' order,
    gate and up interleaved (2j: unit j's gate, 2j + 1: its up); biases b13 [E, 2I] (in that order) added to the
    gate_up product and b2 [E, H] to the down one, and the clamped activation `oai_swiglu`."""
    b13: torch.Tensor
    b2: torch.Tensor
    alpha: float
    limit: float


def oai_swiglu(h: torch.Tensor, inter: int, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of gate_up rows h [n, 2I] (gate and up columns interleaved, as transformers stores
    them: GPTQModel's per-expert gate_proj and up_proj are the first and second halves of that order): gate
    clamped above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate), in h's dtype
    (GptOssExperts._apply_gate); returns [n, I]."""
    gate, up = h[:, 0::2].clamp(max=limit), h[:, 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _expert_act(h: torch.Tensor, inter: int, oai: OaiExperts | None) -> torch.Tensor:
    """The experts' activation of gate_up rows h [n, 2I]: SwiGLU (gpt-oss's oai_swiglu); of up rows h [n, I] (w13 of
    I rows: Nemotron 3's experts without gate, models.nemotron_h) relu(h)², as transformers' NemotronHExperts."""
    if h.shape[1] == inter:
        return torch.square(torch.relu(h))
    return F.silu(h[:, :inter]) * h[:, inter:] if oai is None else oai_swiglu(h, inter, oai.alpha, oai.limit)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, lora: MoELoRA | None = None, oai: OaiExperts | None = None) -> torch.Tensor:
    """Semantics: a mixture of experts' SwiGLU MLPs. x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up
    rows; [E, I, H] up rows alone: experts without gate, relu(up)² for silu(gate) * up, Nemotron 3's); w2 [E, H, I];
    ids [T, k] the experts of each token, weights [T, k] their routing weights (float32, or x's
    dtype). out[t] = sum over j of (weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))) rounded to x's dtype,
    e = ids[t, j], summed in the experts' order (as transformers' experts loop): only the experts some token chose
    run, each over its tokens. With `lora` (MoELoRA), gate_up_e and down_e of a token whose slot s >= 0 each add
    their moe_lora_delta with slot s's A and B of expert e (peft's target_parameters: W_e + scaling B_e A_e). With
    `oai` (OaiExperts: gpt-oss), each product adds its expert's bias (after the matmul, as transformers' x @ W + b)
    and the activation is oai_swiglu."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    inter = w2.shape[2]
    for e in torch.unique(ids).tolist():
        tok, pos = torch.where(ids == e)
        h = F.linear(x[tok], w13[e])
        if oai is not None:
            h = h + oai.b13[e]
        if lora is not None:
            slots = lora.token_slots[tok]
            h = h + moe_lora_delta(x[tok], slots, e, lora.a13, lora.b13)
        act = _expert_act(h, inter, oai)
        y = F.linear(act, w2[e])
        if oai is not None:
            y = y + oai.b2[e]
        if lora is not None:
            y = y + moe_lora_delta(act, slots, e, lora.a2, lora.b2)
        out.index_add_(0, tok, (y * weights[tok, pos, None]).to(x.dtype))
    return out


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, oai: OaiExperts | None = None) -> torch.Tensor:
    """fused_moe without adapters, bit for bit, in a number of torch ops that does not grow with the experts chosen:
    the token-expert pairs sorted by expert (stably), each expert's rows multiplied by its weights in one torch
    grouped_mm per projection (each group's product F.linear's), each pair's product weighted and rounded to x's
    dtype, and each token's k of them added in its experts' order, rounding after each add as fused_moe's loop
    does (k vector adds). Not fused_moe's calls per chosen expert: on a CPU their Python and small ops cost more
    than the products of small experts. Its temporaries at most (memory.sizes.moe_token_bytes): a pair's gathered
    input and gate|up rows, or those rows (the activation in place in them) and its down rows, with the int64 order
    of the pairs; and its k products beside each token's sum and one addend."""
    t, k = ids.shape
    out = torch.zeros_like(x)
    if t == 0:
        return out
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0).to(torch.int32)
    h = F.grouped_mm(x.index_select(0, order // k), w13.transpose(1, 2), offs=offs)
    inter = w2.shape[2]
    if oai is not None:
        experts = flat.index_select(0, order)
        h.add_(oai.b13.index_select(0, experts))
        act = oai_swiglu(h, inter, oai.alpha, oai.limit)
    elif h.shape[1] == inter:  # (relu(h)², in place: Nemotron 3's experts without gate)
        act = h.relu_().square_()
    else:  # (silu(gate) * up, in place in the gate's columns: the same roundings as _expert_act's)
        act = F.silu(h[:, :inter], inplace=True).mul_(h[:, inter:])
    y = F.grouped_mm(act, w2.transpose(1, 2), offs=offs)
    del h, act
    if oai is not None:
        y.add_(oai.b2.index_select(0, experts))
    y.mul_(weights.reshape(-1).index_select(0, order)[:, None])  # (in the promoted dtype, rounded to y's, as
    # fused_moe's (y * w).to(x.dtype))
    # (the row of y holding each token's j-th product in the order of its experts' ids)
    rows = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    rows = rows.view(t, k).gather(1, ids.argsort(dim=1, stable=True))
    for j in range(k):
        out.add_(y.index_select(0, rows[:, j]))
    return out


def grouped_moe(x: torch.Tensor, w13, w2, lora: MoELoRA | None) -> bool:
    """Whether fused_moe_grouped computes x's fused MoE: on a CPU, more than one token (one token's k experts: the
    loop's k calls cost no more than the sort), experts stacked in tensors (not MXFP4's expert-by-expert
    dequantization) whose rows of H and of I values are multiples of 16 bytes (grouped_mm's strides), no adapters,
    a torch with grouped_mm."""
    return (x.device.type == "cpu" and x.shape[0] > 1 and lora is None and isinstance(w13, torch.Tensor)
            and isinstance(w2, torch.Tensor) and hasattr(F, "grouped_mm")
            and all(n * x.element_size() % 16 == 0 for n in (x.shape[1], w2.shape[2])))


def fused_moe_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, lora: MoELoRA | None = None, oai: OaiExperts | None = None) -> torch.Tensor:
    """fused_moe's semantics with no data-dependent shape (a CUDA graph can record it): every expert runs over every
    token, its output weighted by the token's routing weight for it (0 where the token did not choose it)."""
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        h = F.linear(x, w13[e])
        if oai is not None:
            h = h + oai.b13[e]
        if lora is not None:
            h = h + moe_lora_delta(x, lora.token_slots, e, lora.a13, lora.b13)
        act = _expert_act(h, inter, oai)
        y = F.linear(act, w2[e])
        if oai is not None:
            y = y + oai.b2[e]
        if lora is not None:
            y = y + moe_lora_delta(act, lora.token_slots, e, lora.a2, lora.b2)
        out += (y * dense[:, e, None]).to(x.dtype)
    return out


class Int4Experts(NamedTuple):
    """A mixture of experts' int4 GPTQ projections stacked by expert, in the checkpoint's order: qweight int32
    [E, K / 8, N] (8 consecutive input rows a word, lowest nibble first), qzeros int32 [E, G, N / 8] (each field
    zero - 1 where zeros_v1, packing.v1_words_to_fields), scales float16 [E, G, N], g_idx int32 [E, K] (each input
    row's group). group_size > 0: every expert's g_idx is row // group_size (the kernel computes it); 0: read
    (act-order). perm (int32 [E, K], or None): act-order experts sorted by group (`sorted_by_group`, at load): row
    r of expert e's qweight (and of its plain g_idx) is x's column perm[e, r], which the kernel gathers."""
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    group_size: int
    zeros_v1: bool
    perm: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[2]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weights [E, N, K] in x's (the checkpoint's) order of inputs (packing.dequantize of each expert:
        the float16 product, then `dtype`; sorted experts' columns put back where perm says)."""
        from .packing import dequantize
        w = torch.stack([dequantize(self.qweight[e], self.qzeros[e], self.scales[e], self.g_idx[e], 4,
                                    self.zeros_v1, dtype) for e in range(self.qweight.shape[0])])
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out.scatter_(2, self.perm.long().unsqueeze(1).expand_as(w), w)
        return out

    def sorted_by_group(self, group_size: int) -> Int4Experts:
        """These experts with each one's input rows sorted by group (a stable argsort of its g_idx: the row order of
        quant.gptq_linear's act-order layers), g_idx then plain (row // group_size) and `perm` the sorted rows'
        columns of x: every K step of the int4 kernel inside one group. Unchanged where g_idx is already plain
        everywhere, or where some expert's is no permutation of plain groups of `group_size` (read per row)."""
        from .packing import pack_rows, unpack_rows
        e, k = self.g_idx.shape
        plain = (torch.arange(k, device=self.g_idx.device) // group_size).to(self.g_idx.dtype).expand(e, k)
        perm = torch.argsort(self.g_idx, dim=1, stable=True)
        if self.perm is not None or torch.equal(self.g_idx, plain) or not torch.equal(self.g_idx.gather(1, perm),
                                                                                       plain):
            return self
        words = torch.stack([pack_rows(unpack_rows(self.qweight[i], 4).index_select(0, perm[i]), 4)
                             for i in range(e)])
        return self._replace(qweight=words, g_idx=plain.contiguous(), group_size=group_size,
                             perm=perm.to(torch.int32))


def fused_moe_int4(x: torch.Tensor, w13: Int4Experts, w2: Int4Experts, weights: torch.Tensor,
                   ids: torch.Tensor, lora: MoELoRA | None = None, oai: OaiExperts | None = None) -> torch.Tensor:
    """fused_moe over int4 experts: their float weights in x's dtype, then fused_moe (on CUDA fused_moe_dense,
    whose shapes a CUDA graph can record)."""
    f13, f2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)
    return (fused_moe_dense if x.is_cuda else fused_moe)(x, f13, f2, weights, ids, lora, oai)


# MXFP4's 16 values (e2m1: the hub's gpt-oss checkpoints, transformers' integrations.mxfp4.FP4_VALUES), by 4-bit code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


MXFP4_ROWS = 128  # the rows of an expert mxfp4_dequantize converts at once
MXFP4_ROW_BYTES = 16  # the bytes a value of those rows' temporaries take at most (measured: 12.2; int32 codes)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Semantics: an MXFP4 tensor as the hub's gpt-oss checkpoints store the experts: blocks uint8 [E, N, G, 16] (two
    4-bit e2m1 codes a byte, low nibble first: the 32 values of a group), scales uint8 [E, N, G] (each group's power
    of two, biased by 127: e8m0), as the float [E, N, G * 32] (the [E, out, in] of F.linear) that transformers
    dequantizes to on a machine without its MXFP4 kernels (integrations.mxfp4.convert_moe_packed_tensors, before
    its transpose): FP4_VALUES[code] * 2^(scale - 127) in float32 (torch.ldexp of an int exponent, as
    transformers: scale 255 (OCP's NaN) 0 for code 0, +-2^127 for +-0.5, inf beyond), then `dtype` (each value exact
    in bfloat16).
    MXFP4_ROWS rows at a time (their int32 codes and float32 values: at most MXFP4_ROW_BYTES a value of a row
    alive beside the output, memory.sizes.mxfp4_cpu_bytes)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    e, n, g, b = blocks.shape
    out = torch.empty(e, n, g * b * 2, dtype=dtype, device=blocks.device)
    for i in range(e):
        for r in range(0, n, MXFP4_ROWS):
            q = blocks[i, r:r + MXFP4_ROWS]  # (int32 codes, two bytes a value: index_select takes them)
            vals = torch.stack([lut.index_select(0, (q & 0x0F).flatten().int()),
                                lut.index_select(0, (q >> 4).flatten().int())], dim=-1).reshape(-1, g, b * 2)
            exp = scales[i, r:r + MXFP4_ROWS].to(torch.int32) - 127
            # (an int exponent: torch's ldexp of the value, transformers' too: scale 255 (OCP's NaN) gives 0 for code
            # 0, 2^127 for 0.5, inf beyond; a float one multiplies by 2^128 = inf: nan and inf)
            out[i, r:r + MXFP4_ROWS] = torch.ldexp(vals, exp.unsqueeze(-1)).reshape(-1, g * b * 2).to(dtype)
    return out


class Mxfp4Experts(NamedTuple):
    """A mixture of experts' MXFP4 projections stacked by expert, as the hub's gpt-oss checkpoints store them
    (`mxfp4_dequantize`): blocks uint8 [E, N, K / 32, 16], scales uint8 [E, N, K / 32]; N outputs (w13: 2I, gate
    and up rows interleaved, OaiExperts), K inputs. Kept packed (a quarter of bfloat16's bytes, plus a byte a 32
    values): the Triton kernel (kernels.moe.fused_moe_mxfp4) dequantizes them in registers, the reference
    (`fused_moe_mxfp4`) one expert at a time, as a call uses it."""
    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.blocks.shape[2] * 32

    @property
    def out_features(self) -> int:
        return self.blocks.shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """The float stack's [E, N, K] (what fused_moe and kernels.moe_tune read of a float w13 and w2)."""
        return self.blocks.shape[0], self.out_features, self.in_features

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weights [E, N, K] in `dtype` (every expert: the tests' and the tuner's oracle)."""
        return mxfp4_dequantize(self.blocks, self.scales, dtype)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's float weight [N, K] in `dtype`."""
        return mxfp4_dequantize(self.blocks[e:e + 1], self.scales[e:e + 1], dtype)[0]


class _ExpertByExpert(NamedTuple):
    """Mxfp4Experts as fused_moe and fused_moe_dense read a float stack (its shape, w[e]): each expert dequantized
    when the loop reaches it, then dropped (one expert's float weights alive at a time, never the whole stack)."""
    w: Mxfp4Experts
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.w.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.w.expert(e, self.dtype)


def fused_moe_mxfp4(x: torch.Tensor, w13: Mxfp4Experts, w2: Mxfp4Experts, weights: torch.Tensor,
                    ids: torch.Tensor, lora: MoELoRA | None = None, oai: OaiExperts | None = None) -> torch.Tensor:
    """Semantics: fused_moe over the MXFP4 experts' float weights in x's dtype (`mxfp4_dequantize`), each expert
    dequantized as the loop reaches it: on the CPU only the experts some token chose (fused_moe), on CUDA every
    expert (fused_moe_dense, whose shapes a CUDA graph can record)."""
    f13, f2 = _ExpertByExpert(w13, x.dtype), _ExpertByExpert(w2, x.dtype)
    return (fused_moe_dense if x.is_cuda else fused_moe)(x, f13, f2, weights, ids, lora, oai)


def ungated_act(x: torch.Tensor, act: str, scalars=None) -> torch.Tensor:
    """Semantics: an MLP without gate's activation of its up projection's output x (relu2 in place; x may be
    overwritten, use the result), in x's dtype with
    torch's roundings (models.llama.UngatedMLP): "gelu_tanh" gelu's tanh approximation (StarCoder2), "relu2"
    relu(x)² (Arcee, Nemotron), "xielu" (Apertus) of scalars = (softplus(alpha_p), beta + softplus(alpha_n), beta,
    eps), Python floats each already rounded to x's dtype (models.llama.XIELU.scalars): x > 0: a_p x x + beta x, else
    (expm1(min(x, eps)) - x) a_n + beta x, op by op in XIELU's order."""
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "relu2":
        return torch.relu_(x).square_()
    if act != "xielu":
        raise ValueError(f"ungated_act: {act!r} is no activation of an MLP without gate: use 'gelu_tanh', 'relu2' or "
                         f"'xielu'")
    a_p, a_n, beta, eps = (torch.tensor(v, dtype=x.dtype, device=x.device) for v in scalars)
    bx = beta * x
    pos = (a_p * x).mul_(x).add_(bx)
    neg = torch.minimum(x, eps).expm1_().sub_(x).mul_(a_n).add_(bx)
    return torch.where(x > 0, pos, neg, out=neg)
