"""The int4 matmul's epilogue: the layer's bias and its adapters' delta (a `LoRADelta`, the shrink already done)
added by the fused kernels before they store y, so that neither costs a launch of its own. Against the torch
reference (matmul, bias add, `lora_apply`) under TRITON_INTERPRET=1 on CPU, on every kernel family and on the
dequantize + cuBLAS path (which adds them after), with tokens in any order, rows without adapter, ranks below the
slot's padding, untargeted shards and shard bounds that cut through a column tile."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import gptq_configs
from infer.kernels import lora_reference as lref
from infer.kernels import reference as ref
from infer.lora.batch import lora_groups
from infer.quant import packing

from helpers import interpreted_module
from test_gptq_kernel import CONFIGS, DEV, assert_close, make_weights
from test_lora_kernel import layer

REGIMES = {"gemv": (1, 2), "gemv_inplace": (1, 2), "rows": (2, 9), "decode": (2, 17), "fields": (5, 17),
           "pairs": (5, 17), "mmat": (2, 17), "mmat_pairs": (5, 17), "prefill": (33, 50), "scaled": (17, 40),
           "dequant": (1, 40), "dequant_chunks": (1, 40)}
SHARDS = [(24, 16, 8), (40,), (40, 24), (8, 8, 8, 8)]  # widths: tiles of 32 columns straddle shard bounds


@pytest.fixture(scope="module")
def ops():
    yield from interpreted_module("infer.kernels.lora_ops")


@pytest.fixture(scope="module")
def gemm(ops):
    yield from interpreted_module("infer.kernels.gptq_gemm")


def _case(g, outs, m, dtype, num_slots=5, max_rank=16):
    in_f = 128
    qw, qz, s, gi = make_weights(g, 4, 32, in_f, sum(outs), True, False)
    wp = gptq_configs.interleave_for(32, in_f, 8)
    seed = int(torch.randint(0, 2 ** 31, (1,), generator=g))
    ranks = torch.randint(4, max_rank + 1, (len(outs), num_slots), generator=g)
    ranks[0, 1] = 0  # slot 1 does not target shard 0
    a, b, scal, ranks, bounds = layer(outs, num_slots, max_rank, in_f, seed, dtype, ranks)
    slots = torch.randint(-1, num_slots, (m,), generator=g)  # any order, some rows without adapter
    x = torch.randn(m, in_f, generator=g).to(dtype)
    bias = torch.randn(sum(outs), generator=g).to(dtype)
    dev = lambda t: t.to(DEV)  # noqa: E731
    return (dev(x), [dev(qw), dev(qz), dev(s), dev(gi)], packing.interleave_rows(dev(qw), 4, wp), wp,
            dev(a), dev(b), dev(scal), dev(ranks), bounds, dev(slots), dev(bias))


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("outs", SHARDS, ids=lambda o: "x".join(map(str, o)))
def test_bias_and_lora_delta_in_the_epilogue(gemm, ops, gen, regime, outs, monkeypatch):
    g = gen
    lo, hi = REGIMES[regime]
    m = int(torch.randint(lo, hi, (1,), generator=g))
    for dtype, k_per_program in ((torch.float32, ops.K_PER_PROGRAM), (torch.float16, 32)):
        monkeypatch.setattr(ops, "K_PER_PROGRAM", k_per_program)  # fp16: the shrink in several partial sums
        x, (qw, qz, s, gi), qwi, wp, a, b, scal, ranks, bounds, slots, bias = _case(g, outs, m, dtype)
        groups = lora_groups(slots, scal.shape[1])
        want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True).add_(bias)
        lref.lora_apply(x, want, a, b, scal, bounds, groups, ranks)
        delta = ops.delta(x, a, b, scal, bounds, groups, ranks, slots)
        assert (delta.hp.shape[0] > 1) == (dtype == torch.float16)
        cfg = CONFIGS[regime]
        base = gemm.gptq_matmul(x, qwi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias)
        got = gemm.gptq_matmul(x, qwi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias, lora=delta)
        what = f"{regime} shards {outs} M={m} {dtype} slots {slots.tolist()}"
        assert_close(got, want, dtype, g, what)
        assert_close(base, ref.gptq_matmul(x, qw, qz, s, gi, 4, True).add_(bias), dtype, g, what + " (bias only)")
        plain = slots < 0
        assert torch.equal(got[plain], base[plain]), f"{what}: rows without adapter changed"
        # the same delta through the reference matmul (the CPU path's contract of gptq_matmul(..., lora=))
        cpu = ref.gptq_matmul(x, qw, qz, s, gi, 4, True, bias=bias, lora=lref.lora_delta(
            x, a, b, scal, bounds, groups, ranks, slots))
        assert_close(cpu, want, dtype, g, what + " (reference)")


def test_which_kernels_add_the_expand_in_their_epilogue(gemm):
    """True: every kernel that compiles it well (gemv, mma up to 32 rows); None (the default): only where the
    epilogue's walk over the tile's adapters is short (one row, or at most two chunks of 16 slot-rank rows)."""
    def delta(fuse, slots, rank, shards=3):
        return lref.LoRADelta(torch.zeros(1, 1, shards * rank), None, None, torch.zeros(shards, slots), None,
                              list(range(shards + 1)), None, fuse)
    gemv, rows4, mma16 = dict(BLOCK_M=1), dict(BLOCK_M=4), dict(BLOCK_M=16)
    mma32, mma64 = dict(BLOCK_M=32), dict(BLOCK_M=64)
    cases = [("gemv", gemv, True, 16, 16, True), ("mma", mma16, True, 16, 16, True),
             ("mma", mma32, True, 16, 16, True), ("mma", mma64, True, 16, 16, False),
             ("mmat", mma16, True, 1, 16, False), ("gemv", gemv, None, 16, 64, True),
             ("gemv", rows4, None, 16, 16, False), ("mma", mma16, None, 16, 16, False),
             ("mma", mma16, None, 1, 32, True), ("mma", mma16, None, 2, 16, True), ("mma", mma16, None, 1, 48, False),
             ("mma", mma16, True, 1, 16, True)]
    for kind, cfg, fuse, slots, rank, want in cases:
        assert gemm.fuses_lora(kind, cfg, delta(fuse, slots, rank)) is want, (kind, cfg, fuse, slots, rank)
    assert not gemm.fuses_lora("mma", mma16, delta(True, 1, 16, shards=4))  # more shards than the epilogue takes
    assert not gemm.fuses_lora("gemv", gemv, None)


def test_a_delta_for_other_rows_is_refused(gemm, ops, gen):
    x, (qw, qz, s, gi), qwi, wp, a, b, scal, ranks, bounds, slots, bias = _case(gen, (24, 16, 8), 4, torch.float32)
    delta = ops.delta(x[:3], a, b, scal, bounds, lora_groups(slots[:3], scal.shape[1]), ranks, slots[:3])
    with pytest.raises(ValueError, match="3 tokens for 4 rows"):
        gemm.gptq_matmul(x, qwi, qz, s, gi, 4, True, 32, wp, config=CONFIGS["decode"], lora=delta)
