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


pytestmark = pytest.mark.usefixtures("poisoned_outputs")  # (tests/conftest.py)


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


@pytest.fixture(scope="module")
def lora_ops():
    yield from interpreted_module("infer.kernels.lora_ops")


def test_lora_shrink_expand_bf16(lora_ops):
    """A bf16 model's adapters (ranks 1, 8 and 64, base rows, one token for an adapter): the shrink's bf16 x @ A^T
    under the interpreter took its bf16 tl.dot (wrong there: deltas ~1e11); it takes the float32 IEEE dot of the same
    bf16 values there now (a GPU's compiled shrink is unchanged)."""
    from infer.lora.batch import lora_groups
    g = torch.Generator().manual_seed(51)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2, 0])
    ranks = torch.tensor([[1, 8, 64], [8, 64, 1]], dtype=torch.int32)
    outs, k, max_rank, num_slots = (24, 16), 64, 64, 3
    bounds = [0, 24, 40]
    a = torch.randn(num_slots, 2 * max_rank, k, generator=g) * 0.3
    b = [torch.randn(num_slots, max_rank, o, generator=g) * 0.3 for o in outs]
    for i in range(2):
        for s in range(num_slots):
            r = int(ranks[i, s])
            a[s, i * max_rank + r:(i + 1) * max_rank] = 0
            b[i][s, r:] = 0
    a, bf = a.to(torch.bfloat16), torch.cat([t.flatten() for t in b]).to(torch.bfloat16)
    scal = torch.rand(2, num_slots, generator=g) + 0.5
    x = torch.randn(len(slots), k, generator=g).to(torch.bfloat16)
    y = torch.randn(len(slots), bounds[-1], generator=g).to(torch.bfloat16)
    want = y.float().clone()
    ref_groups = lora_groups(slots, num_slots)
    from infer.kernels import lora_reference
    lora_reference.lora_apply(x.float(), want, a.float(), bf.float(), scal, bounds, ref_groups)
    got = y.clone().to(DEV)
    lora_ops.lora_apply(x.to(DEV), got, a.to(DEV), bf.to(DEV), scal.to(DEV), bounds,
                        lora_groups(slots.to(DEV), num_slots), ranks.to(DEV))
    got = got.cpu().float()
    assert torch.equal(got[slots < 0], y[slots < 0].float())
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.fixture(scope="module")
def gemm(lora_ops):
    yield from interpreted_module("infer.kernels.gptq_gemm")


def _bf16_case(m, outs=(24, 16, 8)):
    from test_gptq_epilogue import _case
    return _case(torch.Generator().manual_seed(51), outs, m, torch.bfloat16)


@pytest.mark.parametrize("regime", ["decode", "prefill", "rows"])
def test_gptq_bf16_bias_and_gated_epilogue(gemm, regime):
    """A bf16 int4 layer's bias (and a gate|up layer's silu * up) in the fused kernels' epilogue: added (multiplied)
    in bf16 there, which TRITON_INTERPRET computes on the raw bits (NaN, 1e37); in float32 and rounded once now,
    the same bits a GPU's bf16 add gives."""
    from test_gptq_kernel import CONFIGS
    x, (qw, qz, s, gi), qwi, wp, *_, bias = _bf16_case(20)
    cfg = CONFIGS[regime]
    want = ref.gptq_matmul(x.float().cpu(), qw.cpu(), qz.cpu(), s.cpu(), gi.cpu(), 4, True) + bias.float().cpu()
    got = gemm.gptq_matmul(x, qwi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias).cpu().float()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    gated = gemm.gptq_matmul(x, qwi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias, gated=True).cpu().float()
    want_g = ref.silu_and_mul(want)
    assert torch.isfinite(gated).all()
    assert (gated - want_g).abs().max() <= 0.02 * want_g.abs().max()


@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_gptq_bf16_lora_epilogue(gemm, lora_ops, regime):
    """The adapters' delta in the mma kernels' epilogue of a bf16 layer (tiles of 16+ rows: a tl.dot of h and B):
    the interpreter's bf16 tl.dot gave ~1e8; it takes the float32 IEEE dot of the same bf16 values there now."""
    from infer.kernels import lora_reference as lref
    from infer.lora.batch import lora_groups
    from test_gptq_kernel import CONFIGS
    x, (qw, qz, s, gi), qwi, wp, a, b, scal, ranks, bounds, slots, bias = _bf16_case(20)
    groups = lora_groups(slots, scal.shape[1])
    want = ref.gptq_matmul(x.float(), qw, qz, s, gi, 4, True)
    lref.lora_apply(x.float(), want, a.float(), b.float(), scal, bounds, groups, ranks)
    delta = lora_ops.delta(x, a, b, scal, bounds, groups, ranks, slots)
    assert gemm.lora_in_epilogue(20, bounds[-1], 128, 4, 32, wp, delta, x.device) or CUDA
    got = gemm.gptq_matmul(x, qwi, qz, s, gi, 4, True, 32, wp, config=CONFIGS[regime], lora=delta).cpu().float()
    assert torch.isfinite(got).all()
    assert (got - want.cpu()).abs().max() <= 0.02 * want.abs().max()


@pytest.fixture(scope="module")
def fused():
    yield from interpreted_module("infer.kernels.fused")


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_bf16(fused, with_residual):
    """A bf16 model's rms_norm (+ residual): the residual add and the weight multiply were in bf16, which
    TRITON_INTERPRET computes on the raw bits (NaN); in float32 and rounded once now (a GPU's same bits)."""
    g = torch.Generator().manual_seed(51)
    x, w, r = (torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((5, 96), (96,), (5, 96)))
    want = ref.rms_norm(x, w, 1e-6, r if with_residual else None)
    got = fused.rms_norm(x.to(DEV), w.to(DEV), 1e-6, r.to(DEV) if with_residual else None)
    for a, b in zip(got if with_residual else [got], want if with_residual else [want]):
        a, b = a.cpu().float(), b.float()
        assert torch.isfinite(a).all()
        assert (a - b).abs().max() <= 0.02 * b.abs().max()
