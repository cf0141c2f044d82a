"""Session 54: sliding-window attention (Mistral, Phi-3, Qwen2/Qwen3's layers from max_window_layers on, Gemma 2's
even layers): the query at position p attends to the keys p - window + 1..p only (transformers' masking_utils:
kv_idx > q_idx - sliding_window). Every attention path against a brute-force oracle: the CPU reference (a chunked
prefill's masked rows, the padded decode batch, the per-sequence decodes, verify rows, soft-capped scores), the
Triton kernels interpreted (the unified prefill/mixed kernel, the decode kernel with one partition and several,
decode_attention's rotary + KV write); then tiny models whose prompts and generations run well past a window of 16
to their max_position_embeddings, greedy tokens equal transformers', on the CPU path and the GPU path."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from infer.kernels import reference


@pytest.fixture(scope="module")
def attention():
    """infer.kernels.attention, its kernels interpreted on CPU when there is no GPU."""
    if torch.cuda.is_available():
        yield importlib.import_module("infer.kernels.attention")
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield importlib.reload(importlib.import_module("infer.kernels.attention"))
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def _oracle(q, k_cache, v_cache, tables, lens, qsl, scale, window, softcap=0.0):
    """Brute force: every query's scores over its sequence's keys, masked outside p - window < k <= p."""
    out = torch.empty_like(q, dtype=torch.float32)
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hk
    for b in range(len(lens)):
        n_keys, start, end = int(lens[b]), int(qsl[b]), int(qsl[b + 1])
        slots = [int(tables[b, i // bs]) * bs + i % bs for i in range(n_keys)]
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)  # [L, Hq, D]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
        for t in range(start, end):
            p = n_keys - (end - start) + (t - start)
            s = torch.einsum("hd,lhd->hl", q[t].float(), k) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            pos = torch.arange(n_keys)
            seen = (pos <= p) & ((pos > p - window) if window else True)
            s = s.masked_fill(~seen[None], float("-inf"))
            out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
    return out


def _batch(lens, queries, bs=4, hq=4, hk=2, d=16, seed=0):
    """Caches of random keys (unused blocks NaN, block 0 among them) and the tables, lens and query_start_loc of
    sequences of `lens` keys, the last `queries[b]` of them querying."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum((n + bs - 1) // bs for n in lens) + 2
    k_cache = torch.full((nblocks, bs, hk, d), float("nan"))
    v_cache = torch.full((nblocks, bs, hk, d), float("nan"))
    width = max((n + bs - 1) // bs for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    perm = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()  # block 0 unused (NaN)
    for b, n in enumerate(lens):
        for i in range((n + bs - 1) // bs):
            blk = perm.pop()
            tables[b, i] = blk
            k_cache[blk] = torch.randn(bs, hk, d, generator=g)  # (a last block's unused slots: finite, as a
            v_cache[blk] = torch.randn(bs, hk, d, generator=g)  # block's earlier owner left them)
    qsl = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl


CASES = {  # lens, queries: decodes only (equal and uneven lengths), a prefill, chunks after a context, verify rows
    "decodes-uneven": ([40, 9, 23, 16, 17], [1, 1, 1, 1, 1]),
    "decodes-equal": ([37, 37, 37], [1, 1, 1]),
    "prefill-and-chunks": ([50, 33, 7], [50, 20, 7]),
    "verify-rows-and-decodes": ([45, 30, 12], [4, 1, 3]),
}


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("case", CASES)
def test_reference_attends_to_the_window_only(case, softcap):
    lens, queries = CASES[case]
    q, kc, vc, tables, lens_t, qsl = _batch(lens, queries)
    want = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 16, softcap)
    got = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, max(queries), softcap=softcap, window=16)
    torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=2e-5)
    full = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 0, softcap)
    assert not torch.allclose(full, want, atol=1e-3)  # (the window changes these outputs)


def test_reference_decodes_one_sequence_at_a_time_within_the_window(monkeypatch):
    """The per-sequence decode path (long contexts, large batches: `_per_sequence`) and the row chunks of a chunked
    prefill's masked queries (MASK_ELEMENTS small: many chunks, each from its own first query's window)."""
    monkeypatch.setattr(reference, "PER_SEQUENCE_LEN", 8)
    monkeypatch.setattr(reference, "MASK_ELEMENTS", 64)
    for lens, queries in CASES.values():
        q, kc, vc, tables, lens_t, qsl = _batch(lens, queries, seed=1)
        want = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 16)
        got = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, max(queries), window=16)
        torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("case", CASES)
def test_triton_paged_attention_attends_to_the_window_only(attention, case, softcap):
    lens, queries = CASES[case]
    q, kc, vc, tables, lens_t, qsl = _batch(lens, queries, seed=2)
    want = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 16, softcap)
    got = attention.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, max(queries), softcap=softcap, window=16)
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_triton_decode_attention_within_the_window_in_partitions(attention, parts):
    """decode_attention (rotary, KV write, attention in one launch) over 1-3 partitions a sequence: equal to the
    reference's, with the window (the partitions share out the window's keys only)."""
    lens = [70, 9, 33, 16]
    q, kc, vc, tables, lens_t, qsl = _batch(lens, [1] * 4, seed=3)
    g = torch.Generator().manual_seed(4)
    t, hq, d = q.shape
    hk = kc.shape[2]
    qf, k, v = q.reshape(t, -1), torch.randn(t, hk * d, generator=g), torch.randn(t, hk * d, generator=g)
    positions = (lens_t - 1).long()
    bs = kc.shape[1]
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)])
    cos_sin = torch.randn(128, d, generator=g)
    kr, vr = kc.clone(), vc.clone()
    want = reference.decode_attention(positions, qf, k, v, cos_sin, d, kr, vr, slots, tables, lens_t, qsl, 0.3,
                                      window=16)
    oracle = _oracle(reference.rotary_embedding(positions, qf, k, cos_sin, d)[0].view(t, hq, d), kr, vr, tables,
                     lens_t, qsl, 0.3, 16)
    torch.testing.assert_close(want.float(), oracle, atol=2e-5, rtol=2e-5)
    kt, vt = kc.clone(), vc.clone()
    got = attention.decode_attention(positions, qf, k, v, cos_sin, d, kt, vt, slots, tables, lens_t, qsl, 0.3,
                                     parts=parts, window=16)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)
