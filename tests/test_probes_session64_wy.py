"""Session 64: the chunked gated delta rule's intra-chunk part in Triton (kernels.delta_triton.chunk_terms, one
program per chunk and value head: the cumulative gate, the decayed beta k k^T system, its unit triangular inverse,
w, u, the decayed q k^T and the decayed q and k), so that the whole chunked rule (chunk_gated_delta_rule_varlen) runs
in Triton on CUDA. Interpreted on CPU against the torch code (delta_rule.chunk_terms, chunk_gated_delta_rule_varlen:
float32, tight) over several sequences with partial last chunks, one shorter than a chunk, and GQA heads; compiled
for sm_90 / sm_89 at Qwen3-Next's shapes; its token rows past 2^31 elements; tiny-qwen3_5 through it gives
transformers' tokens."""

from __future__ import annotations

import textwrap

import pytest
import torch

from infer.kernels import delta_rule
from infer.kernels.moe import SM90_SMEM
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, interpreted_module, random_prompts, run_compile_only
from test_probes_session63_rdelta import COMPILED, SM89_SMEM

# sequences of 70 tokens (a whole chunk of 64, then 6), 5 (shorter than a chunk), 64 (exactly one) and 130 (two
# whole chunks of 64, then 2)
LENS = [70, 5, 64, 130]
TOL = 1e-5  # (float32: the kernel's sums in another order than torch's)


@pytest.fixture(scope="module")
def delta():
    yield from interpreted_module("infer.kernels.delta_triton")


def _inputs(gen, lens, hk, hv, dk, dv, dtype=torch.float32):
    """A prefill step's q, k [T, Hk, Dk] and v [T, Hv, Dv] (views of one row of q|k|v per token, as the model splits
    its conv output: strided), g [T, Hv] (negative), beta [T, Hv] in (0, 1), and query_start_loc."""
    t = sum(lens)
    x = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv), -torch.rand(t, hv, generator=gen) * 2,
            torch.rand(t, hv, generator=gen).to(dtype), starts)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("hk, hv, dk, dv, dtype", [
    (1, 2, 16, 48, torch.float32),  # (2 value heads on one key head; 48 value columns: a whole tile and half one)
    (2, 4, 24, 16, torch.float32),  # (GQA 2 value heads a key head; Dk 24 in a tile of 32)
    (2, 2, 16, 16, torch.bfloat16),
])
def test_chunk_terms_kernel_equals_torch(delta, monkeypatch, chunk, hk, hv, dk, dv, dtype):
    """Every term of every chunk of the step (u, w, inner, qd, kd, last: zero past a sequence's end) equals
    delta_rule.chunk_terms' at chunks of 16 and of 64 tokens."""
    monkeypatch.setattr(delta, "CHUNK", chunk)
    q, k, v, g, beta, starts = _inputs(torch.Generator().manual_seed(hk + dk), LENS, hk, hv, dk, dv, dtype)
    lay = delta_rule.chunk_layout(starts, chunk)
    want = delta_rule.chunk_terms(q, k, v, g, beta, lay["rows"])
    got = delta.chunk_terms(q, k, v, g, beta, lay)
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].shape == x.shape and got[name].dtype == torch.float32, name
        assert torch.allclose(got[name], x, atol=TOL, rtol=TOL), (name, float((got[name] - x).abs().max()))


@pytest.mark.parametrize("chunk", [16, 64])
def test_whole_chunked_rule_equals_torch(delta, monkeypatch, chunk):
    """delta_triton.chunk_gated_delta_rule_varlen (all three parts in Triton) against delta_rule's, two steps in a
    row (the states carried): outputs and states equal, a sequence from zero state over a slot that holds NaN, GQA
    heads; its intra-chunk part the Triton one (delta_rule.chunk_terms not called)."""
    monkeypatch.setattr(delta, "CHUNK", chunk)
    calls, real = [], delta_rule.chunk_terms
    monkeypatch.setattr(delta_rule, "chunk_terms", lambda *a: (calls.append(1), real(*a))[1])
    gen = torch.Generator().manual_seed(3)
    hk, hv, dk, dv = 2, 4, 16, 32
    slots, kept = torch.tensor([2, 0, 4, 1]), torch.tensor([True, True, False, True])
    mine = torch.randn(5, hv, dk, dv, generator=gen) * 0.1
    mine[4] = float("nan")
    ref = mine.clone()
    for step in range(2):
        q, k, v, g, beta, starts = _inputs(gen, LENS, hk, hv, dk, dv)
        got = delta.chunk_gated_delta_rule_varlen(q, k, v, g, beta, mine, starts, slots, kept)
        assert not calls  # (the intra-chunk part in Triton, not delta_rule.chunk_terms)
        want = delta_rule.chunk_gated_delta_rule_varlen(q, k, v, g, beta, ref, starts, slots, kept, chunk)
        calls.clear()
        assert torch.isfinite(got).all()
        assert torch.allclose(got, want, atol=TOL, rtol=TOL), (step, float((got - want).abs().max()))
        assert torch.allclose(mine[:4], ref[:4], atol=TOL, rtol=TOL), step
        kept = torch.ones_like(kept)
