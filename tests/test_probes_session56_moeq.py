"""Session 56: int4 (GPTQ) experts of a mixture of experts on the GPU path: the Triton fused MoE reading stacked
int4 experts (kernels.moe.fused_moe_int4, dequantized in registers) equal to its reference (the experts dequantized,
then the float op) over random routings, sym / asym zeros, group sizes and act-order; the model keeping GPTQ experts
int4 on the GPU path, equal to the CPU path (dequantized at load) token for token."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import packing, reference


def int4_experts(e: int, k: int, n: int, group_size: int, act_order: bool, sym: bool, zeros_v1: bool, seed: int):
    """Random int4 experts (reference.Int4Experts) of K inputs and N outputs: act_order shuffles each expert's g_idx
    (read by the kernel, group_size 0); group_size -1 is one group (per channel)."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = k // gs
    q = torch.randint(0, 16, (e, k, n), generator=g)
    z = torch.full((e, groups, n), 8) if sym else torch.randint(0, 16, (e, groups, n), generator=g)
    stored = (z - 1) & 15 if zeros_v1 else z
    scales = (torch.rand(e, groups, n, generator=g) * 0.02 + 0.005).half()
    plain = torch.arange(k) // gs
    g_idx = torch.stack([plain[torch.randperm(k, generator=g)] if act_order else plain for _ in range(e)]).int()
    return reference.Int4Experts(torch.stack([packing.pack_rows(q[i], 4) for i in range(e)]),
                                 torch.stack([packing.pack_cols(stored[i], 4) for i in range(e)]), scales, g_idx,
                                 0 if act_order else gs, zeros_v1)


def routing(t: int, e: int, k: int, seed: int, empty: int | None = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if empty is not None:
        logits[:, empty] -= 100  # an expert no token chose
    return torch.topk(logits.softmax(-1), k, -1)


KERNEL_CASES = [  # tokens, experts, top-k, hidden, expert width, group size, act-order, sym, v1 zeros
    (5, 8, 2, 64, 32, 32, False, True, True),
    (1, 3, 1, 64, 40, -1, False, False, True),
    (19, 5, 3, 128, 24, 64, True, False, True),
    (7, 4, 2, 128, 64, 128, False, False, False),
    (12, 7, 2, 96, 48, 32, True, True, False),
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_int4_fused_moe_equals_the_reference(case):
    """The int4 fused MoE (interpreted) equals the experts dequantized then the float reference: random routings with
    an expert no token chose, one token, k = 1, odd E, N and K not multiples of the tiles, group sizes 32 / 64 / 128
    and per channel, act-order on and off, sym and asym, v1 and v2 zeros; the outputs poisoned first."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.kernels import moe
    t, e, k, h, i, gs, act, sym, v1 = case
    w13 = int4_experts(e, h, 2 * i, gs, act, sym, v1, seed=t)
    w2 = int4_experts(e, i, h, gs if gs == -1 or i % gs == 0 else 8, act, sym, v1, seed=t + 1)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 2))
    w, ids = routing(t, e, k, seed=t + 3)
    want = reference.fused_moe(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), w, ids)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe.torch, "empty", poisoned)
        got = moe.fused_moe_int4(x, w13, w2, w, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.allclose(reference.fused_moe_int4(x, w13, w2, w, ids), want, atol=1e-6)
    other = reference.Int4Experts(w13.qweight ^ 1, *w13[1:])  # one bit of every word: other outputs
    assert (moe.fused_moe_int4(x, other, w2, w, ids) - want).abs().max() > 1e-3


def test_int4_fused_moe_compiles_for_an_h100_once_whatever_the_step():
    """The int4 fused MoE compiled for sm_90 (the compile side of a driver, no GPU) in bfloat16 and float16, plain
    groups and act-order: its kernels compile on the first step, and no later step's count of tokens compiles a
    variant of its own (one compiled variant for every step: CUDA graphs and warm_kernels rely on it)."""
    import inspect
    import textwrap

    from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only
    pytest.importorskip("triton")
    script = COMPILE_ONLY_LAUNCHES + "from infer.kernels import packing, reference\n" + inspect.getsource(
        int4_experts) + textwrap.dedent('''
        from infer.kernels import moe
        out = {}
        for dtype in (torch.bfloat16, torch.float16):
            for act in (False, True):
                w13 = int4_experts(8, 64, 64, 32, act, False, True, 0)
                w2 = int4_experts(8, 32, 64, 32, act, False, True, 1)
                steps = []
                for t in (9, 1, 16, 41):
                    x = torch.randn(t, 64, dtype=dtype)
                    w, ids = torch.topk(torch.randn(t, 8).softmax(-1), 2, -1)
                    before = len(compiled)
                    moe.fused_moe_int4(x, w13, w2, w.to(dtype), ids)
                    steps.append(compiled[before:])
                out[f"{dtype}-{act}"] = steps
        print(json.dumps(out))
    ''')
    out = run_compile_only(script, 600)
    for name, steps in out.items():
        assert sorted(steps[0]) == ["_moe_gemm_int4", "_moe_gemm_int4", "_silu_and_mul_kernel"] or (
            name.endswith("True") and sorted(steps[0]) == ["_moe_gemm_int4", "_moe_gemm_int4"]), (name, steps)
        assert steps[1:] == [[]] * 3, (name, steps)
