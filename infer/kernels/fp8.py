"""Writing K and V into a float8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2) from a Triton kernel, as
`reference.to_cache` does: saturated to the format's finite range, rounded to nearest even (scale 1.0, as vLLM's
default). The value is rounded in float32 here and then cast (exactly) to the cache's type, so the kernels store
the same bytes on a GPU and under TRITON_INTERPRET (whose float8 cast rounds wrongly). Reads need no helper: a
loaded float8 value `.to(q.dtype)` is exact (every e4m3 and e5m2 value is a float16 and a bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# FP8 constexpr codes: 0 not float8, 1 e4m3 (fn: max 448), 2 e5m2 (max 57344)
_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def code(dtype: torch.dtype) -> int:
    """The FP8 constexpr of a cache of `dtype`."""
    return _CODES.get(dtype, 0)


@triton.jit
def _round(x, MANT: tl.constexpr, EMIN: tl.constexpr, MAX: tl.constexpr):
    """x (float32) saturated to +-MAX and rounded to nearest even on the grid of a float with MANT mantissa bits
    and smallest normal exponent EMIN (below it the subnormals' fixed step 2**(EMIN - MANT))."""
    neg = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 and negatives rounding to zero stay -0.0
    a = tl.minimum(tl.abs(x), MAX)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, EMIN)
    step = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)  # 2**(e - MANT): powers of two, exact products
    inv = ((MANT - e + 127) << 23).to(tl.float32, bitcast=True)
    y = a * inv
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = (f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)) * step
    return tl.where(neg, -r, r)


@triton.jit
def to_cache(x, dst_ptr, FP8: tl.constexpr):
    """x as the cache dst_ptr points into stores it (FP8: `code` of its dtype)."""
    if FP8 == 1 or FP8 == 2:
        x = x.to(tl.float32)
        if FP8 == 1:
            y = _round(x, 3, -6, 448.0).to(dst_ptr.dtype.element_ty)
        else:
            y = _round(x, 2, -14, 57344.0).to(dst_ptr.dtype.element_ty)
        # a NaN (a model that overflowed) stays NaN, as torch's cast keeps it, and is caught in the logits: the
        # saturation's minimum drops NaN (448), and the interpreter's cast has no NaN. 0x7F: NaN in e4m3fn and e5m2
        nan = tl.full(x.shape, 0x7F, tl.uint8).to(dst_ptr.dtype.element_ty, bitcast=True)
        return tl.where(x != x, nan, y)
    return x.to(dst_ptr.dtype.element_ty)
