"""Session 39 probes of the Triton kernels (interpreted on CPU without a GPU, as tests/test_gptq_kernel.py does):
inputs for which a kernel computed something else than its torch reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from infer.kernels import lora_reference as lref
from infer.kernels import reference as ref
from infer.lora.batch import lora_groups

from test_gptq_epilogue import _case, gemm, ops  # noqa: F401 (the interpreted kernel modules, per module)
from test_gptq_kernel import CONFIGS, assert_close


@pytest.mark.parametrize("regime,m", [("gemv", 1), ("decode", 5)])
def test_epilogue_lora_delta_with_strided_ranks_and_scalings(gemm, ops, regime, m):
    """A LoRADelta whose ranks and scalings [n, S] are strided views (a transposed [S, n] table): the standalone
    expand reads them by their strides; the int4 matmul's epilogue indexed them as dense and added other slots'
    ranks and scales (an error of the size of y itself)."""
    g = torch.Generator().manual_seed(39)
    x, (qw, qz, s, gi), qwi, wp, a, b, scal, ranks, bounds, slots, _ = _case(g, (24, 16, 8), m, torch.float32)
    slots[0] = 2  # at least one row with an adapter
    groups = lora_groups(slots, scal.shape[1])
    want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True)
    lref.lora_apply(x, want, a, b, scal, bounds, groups, ranks)
    delta = ops.delta(x, a, b, scal, bounds, groups, ranks, slots)
    strided = replace(delta, ranks=ranks.t().contiguous().t(), scalings=scal.t().contiguous().t())
    assert not strided.ranks.is_contiguous() and not strided.scalings.is_contiguous()
    assert gemm.fuses_lora(CONFIGS[regime]["kernel"], CONFIGS[regime], strided)
    got = gemm.gptq_matmul(x, qwi, qz, s, gi, 4, True, 32, wp, config=CONFIGS[regime], lora=strided)
    assert_close(got, want, torch.float32, g, f"{regime} M={m} slots {slots.tolist()}")
