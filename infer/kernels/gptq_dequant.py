"""Dequantize a GPTQ weight on the GPU into a scratch buffer that cuBLAS then reads (gptq_gemm's `dequant`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .gptq_kernels import _fields
from .intmath import cdiv


@triton.jit
def _dequant_kernel(qw_ptr, qz_ptr, s_ptr, g_ptr, w_ptr, N, K, sq_k, sz_g, ss_g, sw_k,
                    BITS: tl.constexpr, ZEROS_V1: tl.constexpr, WP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
    """w[k, n] = (q - z) * s rounded to fp16, in w's dtype, k in input (not storage) order; groups read from g_idx
    row by row. PDL: launched with programmatic dependent launch (`pdl.start`: the scratch it writes may still be
    read by the cuBLAS matmul of the layer before until the wait returns)."""
    pdl.start(PDL)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_w = offs_w < K // PACK
    words = tl.load(qw_ptr + offs_w[:, None] * sq_k + offs_n[None, :], mask=mask_w[:, None] & mask_n[None, :],
                    other=0)
    q = _fields(words, BITS)  # [PACK, BLOCK_W, BLOCK_N]
    j = tl.arange(0, PACK)[:, None]
    rows = (offs_w[None, :] // WP) * (WP * PACK) + j * WP + offs_w[None, :] % WP  # [PACK, BLOCK_W]
    mask = mask_w[None, :, None] & mask_n[None, None, :]
    g = tl.load(g_ptr + rows, mask=mask_w[None, :], other=0)[:, :, None]
    zw = tl.load(qz_ptr + g * sz_g + (offs_n // PACK)[None, None, :], mask=mask, other=0)
    z = (zw >> ((offs_n % PACK) * BITS)[None, None, :]) & MASK
    if ZEROS_V1:
        z = (z + 1) & MASK
    s = tl.load(s_ptr + g * ss_g + offs_n[None, None, :], mask=mask, other=0.0)
    w = (q - z).to(tl.float16) * s
    tl.store(w_ptr + rows[:, :, None] * sw_k + offs_n[None, None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


_SCRATCH: dict = {}


def dequantize_into_scratch(qweight, qzeros, scales, g_idx, bits: int, zeros_v1: bool, dtype,
                            interleave: int = 1, compile_only: bool = False) -> torch.Tensor:
    """The dequantized weight [K, N] in a per-device scratch buffer reused by every layer (valid until the next
    call): prefill reads it once through cuBLAS. compile_only: compile the kernel (Triton's `warmup`), write
    nothing."""
    pack = 32 // bits
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    key = (qweight.device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < k * n:
        _SCRATCH.pop(key, None)
        buf = torch.empty(k * n, dtype=dtype, device=qweight.device)
        _SCRATCH[key] = buf
    w = buf[:k * n].view(k, n)
    block_n, block_w = 128, max(1, 32 // pack)
    grid = (cdiv(k // pack, block_w), cdiv(n, block_n))
    run = _dequant_kernel.warmup if compile_only else _dequant_kernel[grid]
    run(qweight, qzeros, scales, g_idx, w, n, k, qweight.stride(0), qzeros.stride(0), scales.stride(0), w.stride(0),
        BITS=bits, ZEROS_V1=bool(zeros_v1), WP=interleave, BLOCK_N=block_n, BLOCK_W=block_w, num_warps=4,
        PDL=pdl.on(qweight.device), **pdl.launch(qweight.device), **({"grid": grid} if compile_only else {}))
    return w


def reserve_scratch(device: torch.device, dtype, numel: int) -> None:
    """Make the scratch of (device, dtype) hold at least `numel` elements now. A CUDA graph that dequantizes
    records the scratch's address: were it reallocated larger afterwards (a longer eager step reaching a bigger
    layer), the graph would write into freed memory. So the engine reserves the largest layer's size before it
    records any graph."""
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop((device, dtype), None)
        _SCRATCH[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)


def release_scratch(device: torch.device) -> None:
    for key in [k for k in _SCRATCH if k[0] == device]:
        del _SCRATCH[key]


def scratch_bytes(k: int, n: int, dtype: torch.dtype) -> int:
    """What `dequantize_into_scratch` holds for a K x N layer."""
    return k * n * torch.empty((), dtype=dtype).element_size()
