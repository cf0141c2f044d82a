"""Session 61: fewer launches per decode step through Triton epilogues. The int4 gate|up kernel applies Gemma's GeGLU
(gelu_tanh_and_mul) in its epilogue as it applies silu_and_mul (the kernels' GATED constexpr: 1 silu, 2 gelu_tanh);
the fused MoE adds gpt-oss's expert biases in its matmuls' epilogue (float and int4 experts) and computes its clamped
SwiGLU in the gate_up matmul's epilogue (gate and up interleaved: a tile holds both halves of its units). Kernels under
TRITON_INTERPRET=1 against the torch reference (outputs NaN-filled first), the engines' greedy tokens against the CPU
path, the benches' side-by-side timings on a GPU."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import gptq_configs
from infer.kernels import reference as ref
from infer.quant import packing

from helpers import interpreted_module, nan_filled_empty
from test_gptq_kernel import DECODE, GEMV, MMAT_SCALED, ROWS, make_weights

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
interpreted = pytest.mark.skipif(CUDA, reason="a GPU runs the real kernels (pytest -m gpu)")


@pytest.fixture(scope="module")
def fused():
    yield from interpreted_module("infer.kernels.fused")


@pytest.fixture(scope="module")
def gemm(fused):
    yield from interpreted_module("infer.kernels.gptq_gemm")


def _gated_launches(gemm, monkeypatch) -> list:
    """The `gated` constexpr of every fused int4 launch (gptq_gemm._launch) from now on."""
    seen = []
    launch = gemm._launch
    monkeypatch.setattr(gemm, "_launch", lambda *a, **kw: (seen.append(a[-1] if len(a) > 16 else kw.get("gated", 0)),
                                                           launch(*a, **kw))[1])
    return seen


# ------------------------------------------------------------------------------------- GeGLU in the int4 gate_up
@pytest.mark.parametrize("cfg", [DECODE, GEMV, ROWS, MMAT_SCALED], ids=["mma-split3", "gemv", "gemv-rows", "mmat"])
def test_gelu_tanh_epilogue_equals_the_gelu_launch_after_the_matmul(gemm, fused, monkeypatch, cfg):
    """gated="gelu_tanh": the kernel's epilogue applies gelu_tanh(gate) * up (GATED 2) to the rounded tile (after
    the bias, after split-K's partials are summed), bit for bit what fused.gelu_tanh_and_mul computes from the
    plain matmul's output (and not silu's), close to the torch reference; no activation launch after it."""
    g = torch.Generator().manual_seed(61)
    half = 64
    qw, qz, s, gi = make_weights(g, 4, 32, 128, 2 * half, True, False)
    wp = gptq_configs.interleave_for(32, 128, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    launches = _gated_launches(gemm, monkeypatch)
    after = []
    real_act = fused.silu_and_mul
    monkeypatch.setattr(fused, "silu_and_mul", lambda *a, **kw: (after.append(kw.get("gelu")), real_act(*a, **kw))[1])
    for dtype in (torch.float32, torch.float16):
        m = 3 if cfg["kernel"] == "gemv" and "BLOCK_M" not in cfg else 19
        x = (torch.randn(m, 128, generator=g) * 0.3).to(dtype).to(DEV)
        bias = (torch.randn(2 * half, generator=g) * 0.5).to(dtype).to(DEV)
        plain = gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias)
        launches.clear()
        with nan_filled_empty(gemm):
            y = gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias, gated="gelu_tanh")
        assert launches == [2] and after == [], (launches, after)
        assert y.shape == (m, half) and y.dtype == dtype
        act_after = fused.gelu_tanh_and_mul(plain)
        if dtype == torch.float16:  # (the tile rounded to float16 first: the same bits)
            assert torch.equal(y, act_after)
        else:  # (float32 tiles: the interpreter's dots of other column sets round their last bit apart)
            torch.testing.assert_close(y, act_after, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(y, fused.silu_and_mul(plain), atol=1e-3)  # (the activation matters here)
        after.clear()
        want = ref.gelu_tanh_and_mul(ref.gptq_matmul(x.cpu().float(), qw, qz, s, gi, 4, True, 32,
                                                     bias=bias.cpu().float()))
        tol = (2e-3 if dtype == torch.float16 else 1e-5) * want.abs().max().item()  # (max error / max |reference|)
        torch.testing.assert_close(y.cpu().float(), want, atol=tol, rtol=0)


def test_gelu_tanh_where_the_tiles_cannot_hold_the_halves_is_launched_after(gemm, fused, monkeypatch):
    """Halves of 40 columns (no whole 16-column tiles): the plain kernel, then gelu_tanh_and_mul's launch (not
    silu_and_mul's): the reference's values."""
    g = torch.Generator().manual_seed(62)
    qw, qz, s, gi = make_weights(g, 4, 32, 128, 80, True, False)
    launches = _gated_launches(gemm, monkeypatch)
    x = torch.randn(5, 128, generator=g)
    y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, config=DECODE, gated="gelu_tanh")
    assert launches == [0]
    want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, gated="gelu_tanh")
    torch.testing.assert_close(want, ref.gelu_tanh_and_mul(ref.gptq_matmul(x, qw, qz, s, gi, 4, True, 32)))
    torch.testing.assert_close(y, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_an_unknown_gate_activation_is_refused(gemm):
    g = torch.Generator().manual_seed(63)
    qw, qz, s, gi = make_weights(g, 4, 32, 128, 64, True, False)
    with pytest.raises(ValueError, match=r"gated='relu' is no activation of a gate\|up layer: use True, 'silu' or "):
        gemm.gptq_matmul(torch.randn(2, 128), qw, qz, s, gi, 4, True, 32, gated="relu")
