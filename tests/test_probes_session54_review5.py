"""Session 54, review 5 of the merged sliding-window, non-finite K/V and decode-padding changes: a key or value that
is not finite (a token the model overflowed on) before a later query's window is masked for that query, yet its
masked weight (0) times NaN reached it, in the CPU prefill (`_attend`), the Triton unified kernel (a window of at
least BLOCK_N keys: its FUTURE check skipped the key tiles before the first row's position) and the CPU decode
batch (a longer row's keys before its window)."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import reference

from helpers import interpreted_module


@pytest.fixture(scope="module")
def attention():
    """infer.kernels.attention, its kernels interpreted on CPU when there is no GPU."""
    yield from interpreted_module("infer.kernels.attention")


def _oracle(q, k_cache, v_cache, table, n_keys, scale, window):
    """Brute force over one sequence: query t (position n_keys - n + t) over the keys p - window < k <= p."""
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    group, n = q.shape[1] // hk, q.shape[0]
    slots = [int(table[i // bs]) * bs + i % bs for i in range(n_keys)]
    k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
    v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
    out = torch.empty_like(q, dtype=torch.float32)
    for t in range(n):
        p = n_keys - n + t
        s = torch.einsum("hd,lhd->hl", q[t].float(), k) * scale
        pos = torch.arange(n_keys)
        s = s.masked_fill(~((pos <= p) & (pos > p - window))[None], float("-inf"))
        out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
    return out


def _prefill(context, n, bad, d=16, hq=4, hk=2, bs=4):
    g = torch.Generator().manual_seed(0)
    total = context + n
    blocks = -(-total // bs)
    k_cache = torch.randn(blocks + 2, bs, hk, d, generator=g)
    v_cache = torch.randn(blocks + 2, bs, hk, d, generator=g)
    table = torch.arange(blocks, 0, -1, dtype=torch.int32)[None]
    clean = v_cache.clone()
    v_cache[table[0, bad // bs], bad % bs, 1, 3] = float("nan")
    clean[table[0, bad // bs], bad % bs] = 0.0
    q = torch.randn(n, hq, d, generator=g)
    return q, k_cache, v_cache, clean, table, total


def _check(out, q, clean, k_cache, table, total, context, bad, window, scale):
    seen = [bad <= context + t < bad + window for t in range(q.shape[0])]
    assert [bool(out[t].isnan().any()) for t in range(q.shape[0])] == seen
    want = _oracle(q, k_cache, clean, table[0], total, scale, window)
    keep = torch.tensor([not s for s in seen])
    torch.testing.assert_close(out[keep].float(), want[keep], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("context,bad,softcap", [(0, 3, 0.0), (5, 7, 0.0), (20, 14, 0.0), (20, 14, 2.0)])
def test_reference_prefill_keeps_a_nan_value_from_the_queries_past_its_window(context, bad, softcap, monkeypatch):
    """A prefill (or a chunk after `context` keys) of 30 queries, window 8, a NaN value at position `bad`: the
    queries whose window holds it get NaN, the later ones (masked for it) the oracle's attention without it
    (they were all NaN); in several row chunks too (MASK_ELEMENTS small)."""
    window, scale = 8, 0.25
    q, kc, vc, clean, table, total = _prefill(context, 30, bad)
    args = (torch.tensor([total], dtype=torch.int32), torch.tensor([0, 30], dtype=torch.int32), scale)
    out = reference.paged_attention(q, kc, vc, table, *args, max_query_len=30, window=window, softcap=softcap)
    if not softcap:
        _check(out, q, clean, kc, table, total, context, bad, window, scale)
    else:
        assert [bool(out[t].isnan().any()) for t in range(30)] == [bad <= context + t < bad + window
                                                                   for t in range(30)]
    monkeypatch.setattr(reference, "MASK_ELEMENTS", 64)
    again = reference.paged_attention(q, kc, vc, table, *args, max_query_len=30, window=window, softcap=softcap)
    torch.testing.assert_close(again, out, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [37, 40])
def test_triton_prefill_keeps_a_nan_value_from_the_queries_past_its_window(attention, bad):
    """The unified kernel, a window of 64 keys (BLOCK_N 64 at head_dim 16: the tile's first key tile wholly before
    its first query's position), 20 queries after 100 keys, a NaN value at `bad`: only the queries whose window
    holds it get NaN (every query of the tile did)."""
    window, scale, context = 64, 0.25, 100
    q, kc, vc, clean, table, total = _prefill(context, 20, bad)
    out = attention.paged_attention(q, kc, vc, table, torch.tensor([total], dtype=torch.int32),
                                    torch.tensor([0, 20], dtype=torch.int32), scale, max_query_len=20, window=window)
    _check(out, q, clean, kc, table, total, context, bad, window, scale)


@pytest.mark.parametrize("lens,bad", [([40, 30, 30], 25), ([38, 38], 29)])
def test_reference_decode_batch_keeps_a_nan_value_before_a_rows_window(lens, bad):
    """The CPU decode batch (window 8): the first row's key `bad` holds a NaN value, out of its window but among
    the keys the batch gathers (from the shortest row's window on, or the window's first block): no row gets NaN
    (the first did, through its masked weight), every row the oracle's attention."""
    window, scale, bs, hq, hk, d = 8, 0.25, 4, 4, 2, 16
    g = torch.Generator().manual_seed(1)
    nb = sum(-(-n // bs) for n in lens) + 2
    kc = torch.randn(nb, bs, hk, d, generator=g)
    vc = torch.randn(nb, bs, hk, d, generator=g)
    tables = torch.zeros(len(lens), 10, dtype=torch.int32)
    nxt = 1
    for b, n in enumerate(lens):
        for i in range(-(-n // bs)):
            tables[b, i] = nxt
            nxt += 1
    clean = vc.clone()
    vc[tables[0, bad // bs], bad % bs, 1, 3] = float("nan")
    clean[tables[0, bad // bs], bad % bs] = 0.0
    q = torch.randn(len(lens), hq, d, generator=g)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    out = reference.paged_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), qsl, scale,
                                    max_query_len=1, window=window)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b:b + 1], _oracle(q[b:b + 1], kc, clean, tables[b], n, scale, window),
                                   atol=1e-4, rtol=1e-4)
