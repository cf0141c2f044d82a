"""Dense matmul on CPU through oneDNN with the weight prepacked once into its blocked layout.

For the small-M matmuls of decoding (M = number of running sequences) this is 2-4x faster than F.linear on the
same weights (measured on the CI machine: 4096x768 at M=16, 0.95 ms -> 0.25 ms). It computes the same function as
F.linear up to float rounding. Used only on CPU, only when torch exposes the oneDNN ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and _packs(weight.dtype))


@functools.lru_cache(maxsize=None)
def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU: its bfloat16 path needs avx512bw/avx512vl or
    avx_ne_convert, which some CPUs (AMD EPYC without AVX-512) lack; then no copy is made, and the memory estimate
    (memory.checkpoint) must not count one."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 16)
    except RuntimeError:
        return False
    return True


def prepack(weight: torch.Tensor, batch_hint: int = 16) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's layout, or None where that path is not available."""
    if not available(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
    except RuntimeError:
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """Semantics: y = x @ weight^T + bias, as F.linear."""
    if packed is None or x.dtype != packed.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
