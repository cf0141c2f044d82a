"""Session 46 probes: the host cost of n-gram speculative decoding on CPU (verify steps' attention, the proposer)."""

from __future__ import annotations

import random
import sys
from array import array

import pytest
import torch

from infer.engine.speculative import propose_ngram
from infer.kernels import reference


def _naive_attention(q, k_cache, v_cache, tables, lens, qsl, scale):
    """Each query on its own, in float64: query i of sequence b (position lens[b] - n_b + i) over keys 0..p."""
    out = torch.empty_like(q)
    bs, hq, hk = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    for b in range(len(lens)):
        n = qsl[b + 1] - qsl[b]
        for i in range(n):
            p = lens[b] - n + i
            slots = [tables[b][t // bs] * bs + t % bs for t in range(p + 1)]
            k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(hq // hk, 1)  # [p + 1, Hq, D]
            v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(hq // hk, 1)
            row = q[qsl[b] + i].double()  # [Hq, D]
            w = torch.softmax(scale * torch.einsum("hd,thd->ht", row, k), -1)
            out[qsl[b] + i] = torch.einsum("ht,thd->hd", w, v).to(q.dtype)
    return out


def _case(counts, lens, hq=4, hk=2, d=8, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // bs) for n in lens) + 1
    k_cache = torch.randn(blocks, bs, hk, d, generator=g)
    v_cache = torch.randn(blocks, bs, hk, d, generator=g)
    perm = torch.randperm(blocks, generator=g).tolist()  # scattered blocks
    width = max(-(-n // bs) for n in lens)
    tables, at = [], 0
    for n in lens:
        row = perm[at:at + -(-n // bs)]
        at += len(row)
        tables.append(row + [0] * (width - len(row)))
    qsl = [0]
    for c in counts:
        qsl.append(qsl[-1] + c)
    q = torch.randn(qsl[-1], hq, d, generator=g)
    return q, k_cache, v_cache, tables, qsl


CASES = [([4, 1, 3], [21, 9, 14]), ([2, 2], [7, 7]), ([4], [30]), ([1, 4, 1], [5, 12, 33])]


def _paged_attention_counting(monkeypatch, q, k_cache, v_cache, tables, lens, qsl, counts):
    """reference.paged_attention of a case (scale 0.3), and the rows of each per-sequence _attend call it made."""
    calls = []
    attend = reference._attend
    monkeypatch.setattr(reference, "_attend", lambda *a, **kw: calls.append(a[0].shape[0]) or attend(*a, **kw))
    got = reference.paged_attention(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                                    torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                                    0.3, max(counts))
    return got, calls


@pytest.mark.parametrize("counts,lens", CASES)
def test_verify_rows_attend_in_the_decode_batch(monkeypatch, counts, lens):
    """A speculative step's sequences (a few queries after their context) were attended one by one (a K/V gather and
    a masked SDPA per sequence and layer: twice the decode batch's cost at 4 sequences); each query is now a row of
    the decode batch, with the same result."""
    q, k_cache, v_cache, tables, qsl = _case(counts, lens)
    got, calls = _paged_attention_counting(monkeypatch, q, k_cache, v_cache, tables, lens, qsl, counts)
    want = _naive_attention(q, k_cache, v_cache, tables, lens, qsl, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == []


def test_long_chunks_and_fresh_prompts_still_attend_per_sequence(monkeypatch):
    """A prefill chunk longer than SHORT_QUERIES, and a short prompt without context, keep the causal path."""
    counts, lens = [reference.SHORT_QUERIES + 1, 3, 1], [reference.SHORT_QUERIES + 5, 3, 10]
    q, k_cache, v_cache, tables, qsl = _case(counts, lens, seed=1)
    got, calls = _paged_attention_counting(monkeypatch, q, k_cache, v_cache, tables, lens, qsl, counts)
    torch.testing.assert_close(got, _naive_attention(q, k_cache, v_cache, tables, lens, qsl, 0.3),
                               rtol=1e-5, atol=1e-5)
    assert sorted(calls) == [3, reference.SHORT_QUERIES + 1]


def _naive_ngram(tokens, k, n_min, n_max):
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[len(tokens) - n:]
        for s in range(len(tokens) - 1 - n, -1, -1):  # the most recent earlier occurrence
            if tokens[s:s + n] == tail:
                return tokens[s + n:s + n + k]
    return []


def test_propose_ngram_matches_its_definition():
    """The proposer (now a bytes search) against its definition, with ids whose bytes match across token
    boundaries (256 and 1 share bytes with 65536 and 257 at other offsets) and ids past 32 bits."""
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([[0, 1, 256, 257, 65536], list(range(3)), list(range(300)), [2 ** 40, 2 ** 40 + 1, 7]])
        tokens = [rng.choice(vocab) for _ in range(rng.randint(0, 40))]
        k, lo = rng.randint(0, 4), rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        want = _naive_ngram(tokens, k, lo, hi) if k > 0 and len(tokens) > lo else []
        assert propose_ngram(tokens, k, lo, hi) == want, (tokens, k, lo, hi)


def test_propose_for_keeps_the_packed_ids_in_step_with_the_sequence():
    """The engine's proposer packs only the tokens a sequence added since its last call (not its whole token list
    every step), and proposes what propose_ngram does over the sequence's tokens as they grow, and after one is
    dropped."""
    from infer.engine.sampling_params import SamplingParams
    from infer.engine.sequence import Sequence
    from infer.engine.speculative import propose_for

    rng = random.Random(1)
    seq = Sequence("r", [rng.randrange(4) for _ in range(6)], SamplingParams(max_tokens=100))
    for step in range(60):
        want = propose_ngram(seq.all_token_ids, 3, 1, 3)
        assert propose_for(seq, 3, 1, 3) == want
        assert seq.ngram_ids[1] == len(seq.all_token_ids)
        assert bytes(seq.ngram_ids[0]) == array("q", seq.all_token_ids).tobytes()
        if step == 30:
            seq.output_token_ids.pop()
        seq.output_token_ids.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))
    held = seq.ngram_ids[0]
    propose_for(seq, 3, 1, 3)
    assert seq.ngram_ids[0] is held  # extended in place, not rebuilt


def test_a_verify_step_copies_its_inputs_once_and_reads_back_once(monkeypatch):
    """A speculative step queued a second host-to-device copy (its drafts, beside the step's Pack) and read two
    device tensors back (the sampled tokens, then whether each row accepted its draft: two waits for the GPU);
    the drafts now travel in the Pack and the acceptances come back with the tokens, in one copy."""
    from infer import LLM, SamplingParams
    from infer.engine import transfer
    from infer.models.tiny import ensure_builtin

    llm = LLM(str(ensure_builtin("tiny-llama")), block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    eng = llm.engine
    for i in range(2):
        eng.add_request(str(i), [5, 6, 7] * 4, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=i or None,
                                                               allowed_token_ids=[5, 6, 7]))
    eng.step()  # the prefill
    host, reads, copies, sent = set(), [], [], []
    cpu, tolist, copy_to = torch.Tensor.cpu, torch.Tensor.tolist, transfer.copy_to

    def counted_copy_to(*a, **kw):  # every host-to-device copy (Pack.to and to_device call it)
        sent.append(sys._getframe(1).f_code.co_name)
        return copy_to(*a, **kw)

    def counted_cpu(t, *a, **kw):
        out = cpu(t, *a, **kw)
        host.add(out.untyped_storage().data_ptr())
        copies.append(sys._getframe(1).f_code.co_name)
        return out

    def counted_tolist(t):
        caller = sys._getframe(1).f_code.co_name
        if caller in ("verify", "decode"):
            reads.append(t.untyped_storage().data_ptr() in host)
        return tolist(t)
    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(transfer, "copy_to", counted_copy_to)
    while eng.has_unfinished_requests():
        host.clear()
        eng.step()
        assert sent == ["to"]  # the step's Pack (no to_device of the drafts)
        assert copies == ["verify"]
        assert reads and all(reads), "a device tensor read back on its own"
        reads.clear()
        copies.clear()
        sent.clear()
    assert eng.stats()["spec_decode_num_drafts"] > 0 and eng.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_finished_requests_sequence_holds_no_packed_ids():
    """A finished output keeps its Sequence (read lazily), so what the Sequence holds lives as long as the caller keeps
    the outputs: the proposer's packed ids (8 bytes a token) are dropped when the request is forgotten, as its
    grammar and draft bitmask are."""
    from infer import LLM, SamplingParams
    from infer.models.tiny import ensure_builtin
    spec = LLM(str(ensure_builtin("tiny-llama")), block_size=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4})
    seqs = []
    real = spec.engine._propose

    def propose():
        real()
        seqs.extend(s for s in spec.engine.scheduler.running if s.ngram_ids is not None)
    spec.engine._propose = propose
    outs = spec.generate([[5, 6, 7, 8] * 4, [9, 10, 11] * 5],
                         SamplingParams(max_new_tokens=12, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8]))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs) and seqs  # the proposer packed ids for them
    assert all(s.ngram_ids is None for s in seqs)
    spec.close()
