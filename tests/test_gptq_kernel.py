"""The Triton GPTQ matmul against the torch reference: under TRITON_INTERPRET=1 on CPU at small sizes, at real
sizes on a GPU. Inputs are random (a fresh seed every run, printed on failure) and every output torch allocates
starts as NaN (fill_uninitialized_memory), so a tile the kernel forgets to write fails the comparison. Both
regimes are forced with explicit configs (decode: small BLOCK_M and split-K with an uneven split; prefill: grouped
tile order with several M tiles), and the default heuristic is exercised too."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from infer import kernels
from infer.kernels import reference as ref
from infer.quant import packing

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # max error / max |reference|
DECODE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, GROUP_M=1, num_warps=4, num_stages=2)
PREFILL = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, GROUP_M=2, num_warps=4, num_stages=2)


@pytest.fixture(scope="module")
def gemm():
    """The kernel module, interpreted on CPU when there is no GPU (TRITON_INTERPRET is read when the kernel is
    decorated and when it is launched, so it stays set while this module's tests run)."""
    if CUDA:
        yield importlib.import_module("infer.kernels.gptq_gemm")
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield importlib.reload(importlib.import_module("infer.kernels.gptq_gemm"))
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """torch.empty returns NaN-filled tensors while deterministic mode is on."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def make_weights(g, bits, group, in_f, out_f, sym, desc_act, v2=False):
    w = torch.randn(out_f, in_f, generator=g)
    perm = torch.randperm(in_f, generator=g) if desc_act else None
    qw, qz, s, gi = packing.quantize_rtn(w, bits, group, sym, perm)
    if v2:
        qz = packing.zeros_v1_to_v2(qz, bits)
    return [t.to(DEV) for t in (qw, qz, s, gi)]


def assert_close(got, want, dtype, g, what=""):
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite output (seed {g.initial_seed()})"
    err = (got - want).abs().max() / want.abs().max().clamp_min(1e-6)
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} (seed {g.initial_seed()})"


# (bits, group_size, desc_act, hint): hint = pass group_size to the kernel (plain g_idx), else it reads g_idx
LAYOUTS = [(4, 32, False, True), (4, 128, False, True), (4, -1, False, True), (4, 64, True, False),
           (8, 32, False, True), (8, 64, False, False), (8, -1, True, False), (8, 128, True, False)]


@pytest.mark.parametrize("regime", ["decode", "prefill"])
@pytest.mark.parametrize("bits, group, desc_act, hint", LAYOUTS)
def test_matches_reference(gemm, gen, regime, bits, group, desc_act, hint):
    g = gen
    gs = group if group != -1 else 32 * int(torch.randint(2, 6, (1,), generator=g))
    in_f = gs * int(torch.randint(1, 4, (1,), generator=g)) if group != -1 else gs
    in_f = max(in_f, 64)
    out_f = 8 * int(torch.randint(5, 13, (1,), generator=g))  # not a multiple of BLOCK_N: masked columns
    sym, v2 = bool(torch.randint(0, 2, (1,), generator=g)), bool(torch.randint(0, 2, (1,), generator=g))
    qw, qz, s, gi = make_weights(g, bits, group, in_f, out_f, sym, desc_act, v2)
    m = int(torch.randint(1, 20, (1,), generator=g)) if regime == "decode" else int(torch.randint(33, 90, (1,),
                                                                                                    generator=g))
    cfg = DECODE if regime == "decode" else PREFILL
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(m, in_f, generator=g).to(dtype).to(DEV)
        y = gemm.gptq_matmul(x, qw, qz, s, gi, bits, not v2, group if hint else None, config=cfg)
        assert y.dtype == dtype
        want = ref.gptq_matmul(x, qw, qz, s, gi, bits, not v2)
        assert_close(y, want, dtype, g, f"{regime} {bits}-bit g{group} desc_act={desc_act} M={m} {dtype}")


@pytest.mark.parametrize("m", [1, 7, 80])
def test_default_config_bf16_and_leading_dims(gemm, gen, m):
    """pick_config's choice, bf16 activations, a 3-D non-contiguous x."""
    g = gen
    qw, qz, s, gi = make_weights(g, 4, 64, 128, 48, False, False)
    x = torch.randn(2, m, 256, generator=g).to(torch.bfloat16).to(DEV)[..., ::2]
    y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 64)
    assert y.shape == (2, m, 48)
    assert_close(y, ref.gptq_matmul(x, qw, qz, s, gi, 4, True), torch.bfloat16, g)


def test_negative_words_and_extreme_values(gemm, gen):
    """Every packed word has its sign bit set (value 15/255 in the top field) and zeros sit at both ends."""
    g = gen
    for bits in (4, 8):
        maxq, in_f, out_f = (1 << bits) - 1, 64, 32
        q = torch.randint(0, maxq + 1, (in_f, out_f), generator=g)
        q.view(in_f // (32 // bits), 32 // bits, out_f)[:, -1] = maxq
        z = torch.randint(0, maxq + 1, (2, out_f), generator=g)
        z[0], z[1, :4] = 0, maxq
        qw, qz = packing.pack_rows(q, bits), packing.pack_cols(z, bits)  # v2 zeros
        assert bool((qw < 0).all())
        s = (torch.rand(2, out_f, generator=g) * 0.1).half()
        gi = (torch.arange(in_f) // 32).int()
        x = torch.randn(5, in_f, generator=g)
        args = [t.to(DEV) for t in (qw, qz, s, gi)]
        y = gemm.gptq_matmul(x.to(DEV), *args, bits, False, 32, config=DECODE)
        w = ((q - z[gi.long()]).half() * s[gi.long()]).float()  # [in, out], built without the packing module
        assert_close(y, x @ w, torch.float32, g, f"{bits}-bit")


def test_pick_config_regimes(gemm):
    dec = gemm.pick_config(1, 4096, 4096, 128, sms=132)
    assert dec["BLOCK_M"] == 16 and dec["SPLIT_K"] > 1
    assert gemm.pick_config(64, 11008, 4096, 128, sms=132)["BLOCK_M"] == 64
    pre = gemm.pick_config(2048, 4096, 4096, 128, sms=132)
    assert pre["SPLIT_K"] == 1 and pre["BLOCK_M"] >= 64
    assert gemm.pick_config(2048, 4096, 4096, 32, sms=132)["BLOCK_K"] <= 32  # group 32: a K step stays in a group


def test_rejects_a_wrong_input_width(gemm):
    qw, qz, s, gi = make_weights(torch.Generator().manual_seed(0), 4, 32, 64, 16, True, False)
    with pytest.raises(ValueError, match="64"):
        gemm.gptq_matmul(torch.zeros(2, 65, device=DEV), qw, qz, s, gi, 4)


def test_dispatch_uses_the_reference_on_cpu(gen):
    qw, qz, s, gi = make_weights(gen, 8, 32, 64, 16, True, False)
    x = torch.randn(3, 64, generator=gen).to(DEV)
    y = kernels.gptq_matmul(x, qw, qz, s, gi, 8, True, 32)
    assert_close(y, ref.gptq_matmul(x, qw, qz, s, gi, 8), torch.float32, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 300, 2048])
@pytest.mark.parametrize("k, n, group, desc_act", [(4096, 4096, 128, False), (4096, 11008, 128, True),
                                                    (5120, 13696, 32, False), (13696, 5120, -1, False)])
def test_real_sizes_on_gpu(gemm, gen, m, k, n, group, desc_act):
    qw, qz, s, gi = make_weights(gen, 4, group, k, n, True, desc_act)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
        y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, None if desc_act else group)
        assert_close(y, ref.gptq_matmul(x, qw, qz, s, gi, 4), dtype, gen, f"M={m} {k}x{n} {dtype}")


@pytest.mark.skipif(CUDA, reason="checks the message shown without a GPU")
def test_benchmark_refuses_to_run_without_a_gpu(tmp_path, capsys):
    from infer.bench import kernels as bench
    assert bench.main(["--out", str(tmp_path / "k.csv")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "k.csv").exists()


def test_benchmark_tensors_are_valid_gptq():
    from infer.bench import kernels as bench
    qw, qz, s, gi = bench.random_gptq(256, 64, 4, 128, "cpu")
    assert (qw.shape, qz.shape, s.shape, gi.shape) == ((32, 64), (2, 8), (2, 64), (256,))
    assert torch.isfinite(ref.gptq_matmul(torch.randn(2, 256), qw, qz, s, gi, 4)).all()
