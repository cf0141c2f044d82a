"""Session 57: the int4 fused MoE kernel reading each packed word of its experts once (one [BLOCK_K / 8, BLOCK_N]
word tile a K step, split into its 8 fields in registers, in x's order) with tiles fixed by the layer's shape
(kernels.moe.tiles, shared with the float kernel): interpreted, equal to the experts dequantized then the float
reference at shapes whose K steps are 128 rows wide (K from 256), end in a partial step or a partial word tile, with
N not a multiple of the tile, group sizes 32 / 64 / 128 / per channel / act-order, sym and asym, v1 and v2 zeros;
and in float16 bit for bit equal to the float kernel over the dequantized weights where both take the same tiles."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import reference
from test_probes_session56_moeq import int4_experts, routing

CASES = [  # tokens, experts, top-k, hidden, expert width, group size (-1: per channel), act-order, sym, v1 zeros
    (3, 4, 2, 264, 40, -1, False, False, True),  # K 264: two steps of 128 and one of a single word; N 80, 264
    (6, 3, 2, 256, 56, 32, False, False, False),  # groups of 32: steps of 32; N 112 (a partial tile)
    (5, 5, 3, 320, 24, 64, False, True, True),  # groups of 64: steps of 64; down K 24 (one partial step)
    (4, 3, 2, 384, 40, 128, False, False, False),  # groups of 128: whole steps of one group each
    (7, 4, 2, 264, 24, 24, True, False, True),  # act-order (g_idx read), K 264 in steps of 128
    (2, 3, 1, 392, 56, 56, False, True, False),  # groups of 56 (several in a step, read per row), K 392
]


@pytest.mark.parametrize("case", CASES)
def test_int4_fused_moe_reads_whole_word_tiles_right(case):
    """The interpreted int4 fused MoE equals the reference over the dequantized experts at these shapes (a wrong
    field order, word row, K mask or group of a step changes the outputs), and in float16 equals the float kernel
    bit for bit where moe.tiles gives both kernels the same K steps."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.kernels import moe
    t, e, k, h, i, gs, act, sym, v1 = case
    w13 = int4_experts(e, h, 2 * i, gs, act, sym, v1, seed=t)
    w2 = int4_experts(e, i, h, -1 if gs == -1 or i % gs else gs, act, sym, v1, seed=t + 1)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 2))
    w, ids = routing(t, e, k, seed=t + 3, empty=None)
    want = reference.fused_moe(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), w, ids)
    got = moe.fused_moe_int4(x, w13, w2, w, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    xh, wh = x.half(), w.half()
    got = moe.fused_moe_int4(xh, w13, w2, wh, ids)
    f13, f2 = w13.dequantize(torch.float16), w2.dequantize(torch.float16)
    assert torch.allclose(got.float(), reference.fused_moe(xh, f13, f2, wh, ids).float(), atol=2e-3, rtol=1e-2)
    if all(moe.int4_tiles(q.out_features, q.in_features, q.group_size, k)[:2] ==
           moe.tiles(q.out_features, q.in_features, k) for q in (w13, w2)):  # the same K steps as the float kernel
        assert torch.equal(got, moe.fused_moe(xh, f13, f2, wh, ids))


def test_tiles_are_fixed_by_the_layer_and_shared_by_both_kernels():
    """The tiles of a layer do not depend on the step (no argument for it), K steps of 128 rows from K = 256, and a
    decode step's programs (top_k blocks of rows) at least two per SM where a narrower tile can give them."""
    from infer.kernels import moe
    from infer.kernels.intmath import cdiv
    for n, k, top_k in ((1536, 2048, 8), (2048, 768, 8), (28672, 4096, 2), (4096, 14336, 2), (64, 128, 2)):
        bn, bk = moe.tiles(n, k, top_k)
        assert bk == (128 if k >= 256 else 64)
        assert top_k * cdiv(n, bn) >= 2 * moe.SMS or bn == 32
        assert bn == 64 or top_k * cdiv(n, 64) < 2 * moe.SMS


def test_the_kernel_compiled_for_an_h100_loads_each_word_once():
    """Compiled for sm_90 (bfloat16, groups of 128): the int4 kernel's only 2-D loads of int32 are a K step's word
    tile [BLOCK_K / 8, BLOCK_N] (each packed word once, not once per field as a [BLOCK_K, BLOCK_N] load of words
    would read it) and the step's group of zeros [1, BLOCK_N]."""
    import inspect
    import re
    import textwrap

    from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only
    pytest.importorskip("triton")
    script = COMPILE_ONLY_LAUNCHES + "from infer.kernels import packing, reference\n" + inspect.getsource(
        int4_experts) + textwrap.dedent('''
        from infer.kernels import moe
        irs = []
        def keep(self, *args, grid, warmup, **kwargs):
            kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
            if self.fn.__name__ == "_moe_gemm_int4":
                irs.append(kernel.asm["ttir"])
            return kernel
        jit.JITFunction.run = keep
        w13 = int4_experts(4, 256, 256, 128, False, False, False, 0)
        w2 = int4_experts(4, 128, 256, 128, False, False, False, 1)
        x = torch.randn(3, 256, dtype=torch.bfloat16)
        w, ids = torch.topk(torch.randn(3, 4).softmax(-1), 2, -1)
        moe.fused_moe_int4(x, w13, w2, w.to(torch.bfloat16), ids)
        print(json.dumps({"irs": irs}))
    ''')
    irs = run_compile_only(script, 600)["irs"]
    from infer.kernels import moe
    assert len(irs) == 2
    for ir, (n, k) in zip(irs, ((256, 256), (256, 128))):
        bn, bk, one_group = moe.int4_tiles(n, k, 128, 2)
        assert one_group
        loads = {m for line in ir.splitlines() if "tt.load" in line
                 for m in re.findall(r"tensor<(\d+x\d+)x!tt\.ptr<i32>>", line)}
        assert loads == {f"{bk // 8}x{bn}", f"1x{bn}"}, loads
