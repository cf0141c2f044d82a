"""Triton paged attention and fused small ops against their torch references: under TRITON_INTERPRET=1 on CPU at
small sizes, at real sizes on a GPU. Inputs are random (a fresh seed every run, printed on failure); every output
torch allocates starts as NaN (fill_uninitialized_memory) and unused KV slots hold NaN, so a row the kernel forgets
to write, or a masked key it reads, fails the comparison."""

from __future__ import annotations

import pytest
import torch

from infer import kernels
from infer.kernels import reference as ref

from helpers import interpreted_module

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}  # max error relative to the largest reference value


@pytest.fixture(scope="module")
def ops():
    """(fused, attention) modules, their kernels interpreted on CPU when there is no GPU (TRITON_INTERPRET is read
    when the kernels are decorated and when they are launched, so it stays set while this module's tests run)."""
    for fused in interpreted_module("infer.kernels.fused"):
        for attention in interpreted_module("infer.kernels.attention"):
            yield fused, attention


pytestmark = pytest.mark.usefixtures("poisoned_outputs")  # (tests/conftest.py)


def assert_close(got, want, dtype, g, what=""):
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite output (seed {g.initial_seed()})"
    err = (got - want).abs().max() / want.abs().max().clamp_min(1e-6)
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} (seed {g.initial_seed()})"


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


# ----------------------------------------------------------------------------------------------- paged inputs
def paged_batch(g, ctx_lens, new_lens, block_size, hq, hk, head_dim, dtype=torch.float32, spare_blocks=3):
    """A batch whose sequence b has ctx_lens[b] tokens, the last new_lens[b] of them queried. Blocks are handed out
    in random order; unused slots hold NaN in the returned caches and 0 in the clean copies given to the reference."""
    assert all(c >= n for c, n in zip(ctx_lens, new_lens)), f"a row queries more than it holds: {ctx_lens} {new_lens}"
    need = [(n + block_size - 1) // block_size for n in ctx_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 1
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        flat = torch.arange(ctx_lens[b])
        used[tables[b, flat // block_size].long(), flat % block_size] = True
    caches = []
    for _ in range(2):
        c = torch.randn(num_blocks, block_size, hk, head_dim, generator=g).to(dtype)
        caches.append(c.masked_fill(~used[:, :, None, None], float("nan")))
    clean = [c.nan_to_num(0.0) for c in caches]
    qsl = torch.tensor([0] + new_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, head_dim, generator=g).to(dtype)
    meta = dict(block_tables=tables, seq_lens=torch.tensor(ctx_lens, dtype=torch.int32), query_start_loc=qsl)
    return q, caches, clean, meta


def check_attention(attn, g, ctx_lens, new_lens, block_size, hq, hk, head_dim, dtype=torch.float32,
                    pass_max_query_len=True):
    q, caches, clean, meta = paged_batch(g, ctx_lens, new_lens, block_size, hq, hk, head_dim, dtype)
    scale = head_dim ** -0.5
    mql = max(new_lens) if pass_max_query_len else None
    want = ref.paged_attention(q, *clean, scale=scale, max_query_len=mql, **meta)
    dev = {k: v.to(DEV) for k, v in meta.items()}
    got = attn.paged_attention(q.to(DEV), caches[0].to(DEV), caches[1].to(DEV), scale=scale, max_query_len=mql,
                               **dev)
    assert got.dtype == dtype
    assert_close(got, want, dtype, g, f"ctx {ctx_lens} new {new_lens} bs {block_size} heads {hq}/{hk}")


def _lens(g, n, lo, hi):
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("hq,hk", [(8, 2), (4, 4), (6, 2)])
def test_decode_matches_reference(ops, gen, block_size, hq, hk):
    ctx = _lens(gen, 5, 1, 90) + [1, block_size, block_size + 1]  # many blocks, a block exactly full, one token
    check_attention(ops[1], gen, ctx, [1] * len(ctx), block_size, hq, hk, 16)


def test_decode_parts_fill_the_gpu_and_no_more():
    """decode_parts: a large batch takes one partition a sequence (nothing to merge, no second wave of programs), a
    small one as many as keep the launch within what the GPU runs at once, never more than the widest context's
    key blocks, at least one."""
    from infer.kernels.intmath import decode_parts
    assert decode_parts(16, 32, 4096, 64, 528) == 1  # 7B at 16 concurrent on 132 SMs: 512 programs already
    assert decode_parts(4, 32, 4096, 64, 528) == 4
    assert decode_parts(16, 8, 4096, 64, 528) == 4  # GQA: fewer heads, more partitions
    assert decode_parts(1, 8, 300, 64, 528) == 5  # capped by the context's blocks (300 keys: 5 blocks of 64)
    assert decode_parts(1, 8, 64, 64, 528) == 1 and decode_parts(1, 1, 1, 64, 528) == 1
    assert decode_parts(3, 2, 10 ** 6, 32, 528) == 88
    assert decode_parts(600, 1, 10 ** 6, 32, 528) == 1


def _force_parts(monkeypatch, attn, programs: int) -> None:
    monkeypatch.setattr(attn, "_decode_programs", lambda device: programs)


def _counters_zero(attn) -> bool:
    return int(attn._locks(torch.device(DEV), 1, "attention").count_nonzero()) == 0


@pytest.mark.parametrize("chunk", [16, 2])
@pytest.mark.parametrize("programs", [10 ** 6, 12])
def test_decode_split_over_long_contexts(ops, gen, monkeypatch, chunk, programs):
    """A sequence's keys cut into partitions of whole key blocks by its own length, the partial results merged by
    the program that finishes last, CHUNK partitions at a time (2: the running max and sum carried across chunks, a
    last chunk partial). 10**6 programs: one key block a partition (5 for the longest sequence here, one for the
    shortest, which writes its output alone); 12 programs over 6 sequences x 2 KV heads: one partition each. The
    arrival counters are zero again after the launch (a CUDA graph's replay counts from zero), and a second
    launch gives the same result."""
    _force_parts(monkeypatch, ops[1], programs)
    monkeypatch.setattr(ops[1], "REDUCE_CHUNK", chunk)
    ctx = [4 * 64 + 37, 64, 65, 3] + _lens(gen, 2, 1, 300)
    check_attention(ops[1], gen, ctx, [1] * len(ctx), 16, 4, 2, 16)
    assert _counters_zero(ops[1])
    check_attention(ops[1], gen, ctx, [1] * len(ctx), 16, 4, 2, 16)
    assert _counters_zero(ops[1])


@pytest.mark.parametrize("parts", [3, 5])
def test_decode_uneven_partitions(ops, gen, monkeypatch, parts):
    """Key blocks that do not share out evenly: 3 or 5 partitions over sequences of 1-9 blocks (the last partitions
    of a short sequence hold no keys and do not count themselves in)."""
    ctx = [9 * 64, 7 * 64 + 1, 2 * 64 + 5, 64 + 1, 40]
    _force_parts(monkeypatch, ops[1], parts * len(ctx) * 2)
    q, caches, clean, meta = paged_batch(gen, ctx, [1] * len(ctx), 16, 2, 2, 16)
    meta = dict(meta, block_tables=meta["block_tables"][:, :36])  # 9 key blocks of 64 wide: parts = 3 or 5
    want = ref.paged_attention(q, *clean, scale=0.25, max_query_len=1, **meta)
    dev = {k: v.to(DEV) for k, v in meta.items()}
    got = ops[1].paged_attention(q.to(DEV), caches[0].to(DEV), caches[1].to(DEV), scale=0.25, max_query_len=1, **dev)
    assert_close(got, want, torch.float32, gen, f"{parts} partitions")
    assert _counters_zero(ops[1])


def test_decode_reduce_rescales_to_a_later_larger_max(ops, gen, monkeypatch):
    """The merge of partitions two at a time, where the keys of the last partition score far above the earlier
    ones (aligned with the query): the sums carried from the first chunk must be rescaled to the new running max.
    Random keys leave the max in the first chunk about half the time, so this does not depend on the seed."""
    monkeypatch.setattr(ops[1], "REDUCE_CHUNK", 2)
    bs, hq, hk, d = 16, 4, 2, 16
    _force_parts(monkeypatch, ops[1], 4 * hk)  # 5 key blocks of 64 in 4 partitions: 128 keys each, the last 5 alone
    ctx = [4 * 64 + 5]
    q, caches, clean, meta = paged_batch(gen, ctx, [1], bs, hq, hk, d)
    for pos in range(4 * 64, ctx[0]):  # partition 2: the second chunk
        block, off = int(meta["block_tables"][0, pos // bs]), pos % bs
        for h in range(hk):
            key = q[0, h * (hq // hk)] * 0.75
            caches[0][block, off, h] = clean[0][block, off, h] = key
    want = ref.paged_attention(q, *clean, scale=d ** -0.5, max_query_len=1, **meta)
    dev = {k: v.to(DEV) for k, v in meta.items()}
    got = ops[1].paged_attention(q.to(DEV), caches[0].to(DEV), caches[1].to(DEV), scale=d ** -0.5, max_query_len=1,
                                 **dev)
    assert_close(got, want, torch.float32, gen, "keys of the last partition aligned with the query")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("hq,hk,head_dim", [(8, 2, 16), (2, 2, 24), (4, 1, 32)])
def test_mixed_decode_and_prefill_with_cached_prefix(ops, gen, block_size, hq, hk, head_dim):
    new = [1, 23, 1, 7, 40, 1]
    prefix = [_lens(gen, 1, 1, 60)[0], 0, _lens(gen, 1, 1, 90)[0], 33, 70, block_size - 1]
    ctx = [p + n for p, n in zip(prefix, new)]
    check_attention(ops[1], gen, ctx, new, block_size, hq, hk, head_dim)


def test_prefill_only_and_max_query_len_unknown(ops, gen):
    check_attention(ops[1], gen, [17, 5], [17, 5], 4, 4, 2, 16, pass_max_query_len=False)
    check_attention(ops[1], gen, [12, 9], [1, 1], 4, 4, 2, 16, pass_max_query_len=False)


def test_attention_half_precision(ops, gen):
    new = [1, 9, 1]
    check_attention(ops[1], gen, [33, 20, 600], new, 16, 8, 2, 32, dtype=torch.float16)
    check_attention(ops[1], gen, [33, 20, 600], [1, 1, 1], 16, 8, 2, 32, dtype=torch.float16)


def qkv_delta(g, slots, widths, num_slots=3, rank=8, split=2):
    """A qkv layer's random LoRADelta by token (lora_reference's layout): ranks 1..rank per (shard, slot), one
    shard untargeted by one slot, B zero past each rank (as LoRALayer keeps it), the partial sums NaN on the rows
    of slot -1 (the shrink never writes them)."""
    from infer.kernels.lora_reference import LoRADelta
    ranks = torch.randint(1, rank + 1, (3, num_slots), generator=g, dtype=torch.int32)
    ranks[1, num_slots - 1] = 0
    bs = []
    for i, w in enumerate(widths):
        b = torch.randn(num_slots, rank, w, generator=g)
        for s in range(num_slots):
            b[s, int(ranks[i, s]):] = 0
        bs.append(b.flatten())
    slots = torch.tensor(slots)
    hp = torch.randn(split, len(slots), 3 * rank, generator=g)
    hp[:, slots < 0] = float("nan")
    bounds = [0, widths[0], widths[0] + widths[1], sum(widths)]
    return LoRADelta(hp, torch.cat(bs), slots, torch.rand(3, num_slots, generator=g) + 0.5, ranks, bounds, None,
                     False)


def _on(delta, dev, rows=None, dtype=torch.float32):
    from dataclasses import replace
    pick = slice(None) if rows is None else slice(0, rows)
    return replace(delta, hp=delta.hp[:, pick].to(dev), lora_b=delta.lora_b.to(dtype).to(dev),
                   token_slots=delta.token_slots[pick].to(dev), scalings=delta.scalings.to(dev),
                   ranks=delta.ranks.to(dev))


def check_decode_attention(ops, g, ctx_lens, block_size, hq, hk, head_dim, rot_dim, dtype=torch.float32,
                           padding=2, lora_slots=None):
    """decode_attention (rotary, KV write and attention in one launch) against the reference's rotary_store_kv then
    paged_attention: the real rows' output and both caches after the step. The new token's slot held NaN before
    (read before it is written: a NaN output), unused slots NaN throughout; `padding` rows of a CUDA graph's
    bucket (length 0, slot -1) beside the real ones. lora_slots: each real row's adapter slot, the qkv layer's
    delta (`qkv_delta`) added to q, k and v first."""
    n = len(ctx_lens)
    _, caches, clean, meta = paged_batch(g, ctx_lens, [1] * n, block_size, hq, hk, head_dim, dtype)
    tables = meta["block_tables"]
    slots = torch.tensor([int(tables[b, (c - 1) // block_size]) * block_size + (c - 1) % block_size
                          for b, c in enumerate(ctx_lens)])
    for c in caches:
        c.view(-1, hk, head_dim)[slots] = float("nan")
    qkv = rand(g, n + padding, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)  # strided views, as the model
    cos_sin = rand(g, max(ctx_lens) + 3, rot_dim)
    pos = torch.tensor([c - 1 for c in ctx_lens] + [0] * padding).to(DEV)
    delta = None if lora_slots is None else \
        qkv_delta(g, list(lora_slots) + [-1] * padding, [hq * head_dim, hk * head_dim, hk * head_dim])
    want_caches = [c.clone() for c in clean]
    want = ref.decode_attention(pos[:n].cpu(), q[:n].cpu(), k[:n].cpu(), v[:n].cpu(), cos_sin.cpu(), head_dim,
                                *want_caches, slots, scale=head_dim ** -0.5, **meta,
                                lora=None if delta is None else _on(delta, "cpu", n, dtype))
    pad = dict(block_tables=torch.cat([tables, torch.zeros(padding, tables.shape[1], dtype=torch.int32)]),
               seq_lens=torch.cat([meta["seq_lens"], torch.zeros(padding, dtype=torch.int32)]),
               query_start_loc=torch.arange(n + padding + 1, dtype=torch.int32))
    got_caches = [c.to(DEV) for c in caches]
    before = qkv.clone()
    got = ops[1].decode_attention(pos, q, k, v, cos_sin, head_dim, *got_caches,
                                  torch.cat([slots, torch.full((padding,), -1)]).to(DEV), scale=head_dim ** -0.5,
                                  **{key: t.to(DEV) for key, t in pad.items()},
                                  lora=None if delta is None else _on(delta, DEV, dtype=dtype))
    what = f"ctx {ctx_lens} bs {block_size} heads {hq}/{hk} d {head_dim} rot {rot_dim}"
    assert got.shape == (n + padding, hq, head_dim)
    assert_close(got[:n], want, dtype, g, what)
    used = ~caches[0].isnan()
    used.view(-1, hk, head_dim)[slots] = True
    for got_c, want_c, name in zip(got_caches, want_caches, "kv"):
        got_c = got_c.cpu()
        assert torch.equal(got_c.isnan(), ~used), f"{what}: {name} cache written outside the step's slots"
        assert_close(got_c[used], want_c[used], dtype, g, f"{what}: {name} cache")
    assert torch.equal(qkv, before), "inputs must not be modified"


@pytest.mark.parametrize("block_size,hq,hk,head_dim,rot_dim,dtype", [
    (4, 8, 2, 16, 16, torch.float32), (16, 4, 4, 16, 16, torch.float32), (16, 6, 2, 24, 12, torch.float16)])
def test_decode_attention_rotates_writes_and_attends_in_one_launch(ops, gen, block_size, hq, hk, head_dim, rot_dim,
                                                                   dtype):
    ctx = _lens(gen, 4, 2, 90) + [1, block_size, block_size + 1]  # many blocks, a full block, the first token
    check_decode_attention(ops, gen, ctx, block_size, hq, hk, head_dim, rot_dim, dtype)


@pytest.mark.parametrize("hq,hk,head_dim,rot_dim,dtype", [(8, 2, 16, 16, torch.float32), (4, 4, 24, 12, torch.float16)])
def test_decode_attention_adds_the_qkv_lora_delta_first(ops, gen, hq, hk, head_dim, rot_dim, dtype):
    """The qkv layer's adapter delta (a LoRADelta by token: split-K partials, ranks 1-8 per shard and slot, an
    untargeted shard, rows without adapter) added to q (every head of a GQA group), k and v before the rotation,
    the KV write and the attention: against the reference's add_delta, then the same."""
    ctx = _lens(gen, 5, 2, 60) + [1]
    check_decode_attention(ops, gen, ctx, 4, hq, hk, head_dim, rot_dim, dtype, lora_slots=[2, -1, 0, 1, 2, 0])


def test_decode_attention_over_partitions(ops, gen, monkeypatch):
    """One key block a partition: the new key in the last partition of a long context, alone in its partition
    (65 keys), the last key of a full one (128), a sequence in one partition (3) beside padding rows: only the
    partition holding the new key writes it and attends to it; with the qkv delta too (every partition adds it to
    its query)."""
    _force_parts(monkeypatch, ops[1], 10 ** 6)
    check_decode_attention(ops, gen, [4 * 64 + 37, 128, 65, 3], 16, 4, 2, 16, 16, padding=1)
    check_decode_attention(ops, gen, [2 * 64 + 9, 65, 3], 4, 4, 2, 16, 16, padding=1, lora_slots=[1, 0, -1])
    assert _counters_zero(ops[1])


def _attention_by_definition(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """paged_attention's Semantics line, token by token in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    hq, hk = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    for b in range(len(seq_lens)):
        lo, hi, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        pos = torch.arange(n)
        slots = block_tables[b, pos // bs].long(), pos % bs
        k, v = k_cache[slots].double(), v_cache[slots].double()  # [n, Hk, D]
        for i in range(lo, hi):
            p = n - (hi - i)  # the query's position: it sees keys 0..p
            for h in range(hq):
                kv = h // (hq // hk)
                w = (scale * k[:p + 1, kv] @ q[i, h].double()).softmax(0)
                out[i, h] = w @ v[:p + 1, kv]
    return out


@pytest.mark.parametrize("hq,hk", [(8, 2), (4, 4)])
@pytest.mark.parametrize("per_sequence", [True, False])
@pytest.mark.parametrize("equal", [False, True])
def test_reference_decode_both_ways_follow_the_definition(gen, monkeypatch, hq, hk, per_sequence, equal):
    """The CPU decode attention runs each sequence on its own (no padding, no mask) for long contexts and large
    batches and one batch otherwise, padded and masked when the decodes' lengths differ (reference._per_sequence;
    each way forced here), with prefill rows beside the decodes: each gives the formula's values, over each
    sequence's own keys only."""
    monkeypatch.setattr(ref, "_per_sequence", lambda *shape: per_sequence)
    new = [1, 1, 9, 1, 1, 4, 1]
    ctx = [1, 4, 20] + _lens(gen, 4, 4, 70)  # at least as many tokens as the row queries (4 for the prefill)
    if equal:  # every decode row as long as the first
        ctx = [37 if n == 1 else c for c, n in zip(ctx, new)]
    q, _, clean, meta = paged_batch(gen, ctx, new, 4, hq, hk, 16)
    got = ref.paged_attention(q, *clean, scale=0.25, **meta)
    want = _attention_by_definition(q, *clean, meta["block_tables"], meta["seq_lens"], meta["query_start_loc"], 0.25)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= 1e-5, f"relative error {err:.2e} (seed {gen.initial_seed()})"


# ----------------------------------------------------------------------------------------------- fused ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm(ops, gen, dtype):
    x, r, w = rand(gen, 7, 48, dtype=dtype), rand(gen, 7, 48, dtype=dtype), rand(gen, 48, dtype=dtype)
    assert_close(ops[0].rms_norm(x, w, 1e-6), ref.rms_norm(x.cpu(), w.cpu(), 1e-6), dtype, gen, "no residual")
    y, h = ops[0].rms_norm(x, w, 1e-5, r)
    y_ref, h_ref = ref.rms_norm(x.cpu(), w.cpu(), 1e-5, r.cpu())
    assert_close(y, y_ref, dtype, gen, "y")
    assert torch.equal(h.cpu(), h_ref)
    heads = rand(gen, 5, 3, 24, dtype=dtype)  # per-head norm (Qwen3 q/k norm) on a 3-D input
    assert_close(ops[0].rms_norm(heads, w[:24], 1e-6), ref.rms_norm(heads.cpu(), w[:24].cpu(), 1e-6), dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_embed_rms_norm_gathers_the_rows_and_norms_them(ops, gen, dtype, ids_dtype):
    """The embedding gather and the first layer's input norm in one kernel: the rows bit for bit the table's (the
    first residual), the norm as rms_norm's of those rows, for repeated ids and a width that is not a power of 2."""
    table, w = rand(gen, 30, 40, dtype=dtype), rand(gen, 40, dtype=dtype)
    ids = torch.tensor([3, 0, 29, 3, 17, 8, 3], dtype=ids_dtype)
    y, h = ops[0].embed_rms_norm(ids.to(DEV), table, w, 1e-6)
    y_ref, h_ref = ref.embed_rms_norm(ids, table.cpu(), w.cpu(), 1e-6)
    assert torch.equal(h.cpu(), h_ref) and torch.equal(h_ref, table.cpu()[ids])
    assert_close(y, y_ref, dtype, gen, "y")
    assert torch.equal(y.cpu(), ops[0].rms_norm(h, w, 1e-6).cpu()), "the norm of the gathered rows, as rms_norm's"
    empty = ops[0].embed_rms_norm(ids[:0].to(DEV), table, w, 1e-6)
    assert [tuple(t.shape) for t in empty] == [(0, 40), (0, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,rot_dim", [(16, 16), (24, 12)])
def test_rotary_on_qkv_slices(ops, gen, dtype, head_dim, rot_dim):
    t, hq, hk = 9, 6, 2
    qkv = rand(gen, t, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)  # strided views, as the model
    cache = rand(gen, 50, rot_dim)
    pos = torch.randint(0, 50, (t,), generator=gen).to(DEV)
    before = qkv.clone()
    got = ops[0].rotary_embedding(pos, q, k, cache, head_dim)
    want = ref.rotary_embedding(pos.cpu(), q.cpu(), k.cpu(), cache.cpu(), head_dim)
    for a, b, name in zip(got, want, "qk"):
        assert_close(a, b, dtype, gen, name)
    assert torch.equal(qkv, before), "inputs must not be modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,rot_dim,block_size", [(16, 16, 4), (24, 12, 16)])
def test_rotary_store_kv_writes_the_rotated_k_and_v_into_their_slots(ops, gen, dtype, head_dim, rot_dim, block_size):
    """One launch: q rotated (returned), k rotated and v written into the cache slots (padding slots -1 untouched,
    the cache NaN elsewhere); bit for bit the reference's rotary_embedding then store_kv."""
    t, hq, hk, num_blocks = 11, 6, 2, 5
    qkv = rand(gen, t, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)  # strided views, as the model
    cache = rand(gen, 50, rot_dim)
    pos = torch.randint(0, 50, (t,), generator=gen).to(DEV)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[torch.tensor([0, 4, 10])] = -1
    caches = [torch.full((num_blocks, block_size, hk, head_dim), float("nan"), dtype=dtype, device=DEV)
              for _ in range(2)]
    want = [c.cpu().clone() for c in caches]
    before = qkv.clone()
    got_q = ops[0].rotary_store_kv(pos, q, k, v, cache, head_dim, *caches, slots.to(DEV))
    want_q = ref.rotary_store_kv(pos.cpu(), q.cpu(), k.cpu(), v.cpu(), cache.cpu(), head_dim, *want, slots)
    assert_close(got_q, want_q, dtype, gen, "q")
    for got, exp, name in zip(caches, want, "kv"):
        assert torch.equal(got.cpu().isnan(), exp.isnan()), name
        assert_close(got.cpu().nan_to_num(), exp.nan_to_num(), dtype, gen, name)
    assert torch.equal(qkv, before), "inputs must not be modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(ops, gen, dtype):
    x = rand(gen, 6, 2 * 40, dtype=dtype) * 3
    assert_close(ops[0].silu_and_mul(x), ref.silu_and_mul(x.cpu()), dtype, gen)
    x3 = rand(gen, 2, 3, 2 * 1500, dtype=dtype)  # more than one column block, leading dims kept
    assert_close(ops[0].silu_and_mul(x3), ref.silu_and_mul(x3.cpu()), dtype, gen)


@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kv_skips_padding_slots(ops, gen, block_size):
    t, hk, d, num_blocks = 11, 2, 24, 5
    qkv = rand(gen, t, 3 * hk * d)
    k, v = (x.reshape(t, hk, d) for x in qkv[:, hk * d:].chunk(2, dim=-1))  # v is a strided view, as the model
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[torch.tensor([0, 4, 10])] = -1
    caches = [torch.full((num_blocks, block_size, hk, d), float("nan"), device=DEV) for _ in range(2)]
    want = [c.cpu().clone() for c in caches]
    ops[0].store_kv(k, v, *caches, slots.to(DEV))
    ref.store_kv(k.cpu(), v.cpu(), *want, slots)
    for got, exp in zip(caches, want):
        assert torch.equal(got.cpu().isnan(), exp.isnan())
        assert torch.equal(got.cpu().nan_to_num(), exp.nan_to_num())


def test_cpu_dispatch_stays_reference():
    x, w = torch.randn(3, 8), torch.randn(8)
    assert not kernels.use_triton(x)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))


# ----------------------------------------------------------------------------------------------- real sizes (GPU)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_real_sizes_gpu(ops, gen, dtype):
    decode_ctx = _lens(gen, 14, 1, 4096) + [4096, 1]
    check_attention(ops[1], gen, decode_ctx, [1] * 16, 16, 32, 8, 128, dtype)
    new = [1] * 12 + [512, 300, 1, 44]
    ctx = _lens(gen, 12, 1, 4096) + [512 + 1000, 3000, 4096, 44]
    check_attention(ops[1], gen, ctx, new, 16, 32, 8, 128, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("hk,dtype", [(32, torch.float16), (8, torch.float16), (8, torch.float32)])
def test_decode_attention_real_sizes_gpu(ops, gen, hk, dtype):
    """The fused decode at Llama-2-7B (32 KV heads) and Llama-3-8B (8) head shapes, contexts up to 4096 (eight
    partitions), with and without the qkv layer's adapter delta."""
    ctx = _lens(gen, 14, 2, 4096) + [4096, 1]
    check_decode_attention(ops, gen, ctx, 16, 32, hk, 128, 128, dtype)
    check_decode_attention(ops, gen, ctx, 16, 32, hk, 128, 128, dtype, lora_slots=[i % 4 - 1 for i in range(16)])


@pytest.mark.gpu
def test_fused_real_sizes_gpu(ops, gen):
    dtype, t = torch.float16, 256
    x, r, w = rand(gen, t, 4096, dtype=dtype), rand(gen, t, 4096, dtype=dtype), rand(gen, 4096, dtype=dtype)
    y, h = kernels.rms_norm(x, w, 1e-6, r)  # through the dispatch
    y_ref, h_ref = ref.rms_norm(x.cpu(), w.cpu(), 1e-6, r.cpu())
    assert_close(y, y_ref, dtype, gen, "rms_norm")
    assert torch.equal(h.cpu(), h_ref)
    qkv = rand(gen, t, (32 + 16) * 128, dtype=dtype)
    q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
    cache = rand(gen, 4096, 128)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(DEV)
    for a, b in zip(kernels.rotary_embedding(pos, q, k, cache, 128),
                    ref.rotary_embedding(pos.cpu(), q.cpu(), k.cpu(), cache.cpu(), 128)):
        assert_close(a, b, dtype, gen, "rotary")
    gu = rand(gen, t, 2 * 11008, dtype=dtype)
    assert_close(kernels.silu_and_mul(gu), ref.silu_and_mul(gu.cpu()), dtype, gen, "silu_and_mul")
