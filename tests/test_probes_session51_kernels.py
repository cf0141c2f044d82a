"""Session 51 kernel probes: Triton kernels under TRITON_INTERPRET=1 (on a GPU, compiled) against the torch
references the engine uses on CPU, at shapes real models have that the other kernel tests miss."""

from __future__ import annotations

import itertools

import pytest
import torch

from infer.kernels import reference as ref

from helpers import interpreted_module

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def attention():
    yield from interpreted_module("infer.kernels.attention")


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """torch.empty returns NaN-filled tensors while deterministic mode is on."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)


def _paged(g, head_dim, hq, hk, bs, lens, nq, dtype, cache_dtype):
    nb = sum(-(-n // bs) for n in lens) + 2
    kc = torch.randn(nb, bs, hk, head_dim, generator=g).to(cache_dtype)
    vc = torch.randn(nb, bs, hk, head_dim, generator=g).to(cache_dtype)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lens), max(-(-n // bs) for n in lens), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        tables[b, :-(-n // bs)] = perm[used:used - (-n // bs)]
        used += -(-n // bs)
    qsl = torch.tensor([0, *itertools.accumulate(nq)], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), qsl


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("nq", [[1, 1], [1, 16]])  # decode only (flash-decoding kernel); a prefill chunk (unified)
def test_paged_attention_bf16_queries(attention, cache_dtype, nq):
    """A bf16 model's attention (its fp8 KV cache too): the interpreter's bf16 tl.dot is wrong (scores ~1e9), so
    the kernels take the float32 IEEE dot of the same bf16 values there (on a GPU: the bf16 dot, unchanged)."""
    g = torch.Generator().manual_seed(51)
    args = _paged(g, 64, 4, 1, 16, [32, 16], nq, torch.bfloat16, cache_dtype)
    want = ref.paged_attention(*args, 0.125)
    got = attention.paged_attention(*(t.to(DEV) for t in args), 0.125).cpu()
    assert torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max() <= 0.03 * want.float().abs().max()
