"""Triton GPTQ matmul (W4A16 / W8A16): y = x @ W^T from the GPTQ tensors, three ways chosen by the shape.

- `gemv` (one activation row per program row, CUDA cores): for M = 1. Each program owns BLOCK_N columns and a
  K range; it loads BLOCK_K / pack int32 words per column (coalesced along N, read once, `evict_first`), splits
  them into their `pack` fields with shifts, turns each field into a float without a conversion instruction
  (OR-ing the 4-bit value into the mantissa of 2^23 gives the float 2^23 + q), and accumulates x * (q - z) in
  a [BLOCK_K / pack, BLOCK_N] float32 tile that is reduced once, at the end; the group's scale multiplies the
  step's partial sum, not every weight.
- `mma` (tensor cores, tl.dot): for M >= 2. The same loads; a field becomes the fp16 1024 + q the same way
  (0x6400 | q), the fp16 difference with 1024 + z is the exact small integer q - z, and the scale multiplies the
  dot product of the step. Two ways to build the operand: the whole [BLOCK_K, BLOCK_N] tile by a reshape of the
  unpacked fields (x loaded in the same permuted K order, which leaves the sum unchanged), or, with FIELD, one
  dot per packed field whose tile keeps the loaded words' register layout; the second avoids a round trip of
  every weight through shared memory (the fastest for M = 2-16 on an H100). `mmat` computes y^T = W^T x^T so the
  weight is the first (register) operand of Hopper's wgmma, for M = 32-256.
- `dequant`: the weight is dequantized into a scratch buffer and multiplied by cuBLAS (torch.matmul). For large
  M (prefill), where cuBLAS at tensor-core speed beats any fused kernel, and for an irregular g_idx.

Split-K: when the N tiles alone cannot fill the GPU, SPLIT_K programs share a tile's K range. Each writes its
float32 partial tile to a workspace and bumps a per-tile counter; the program that arrives last sums the partial
tiles in a fixed order, writes y in x's dtype and resets the counter to 0. One launch, no memset, no extra
reduction kernel, deterministic, and safe to replay inside a CUDA graph (the counters are zero between calls;
kernels of one engine run on one stream, so two matmuls never share a counter at the same time).

With float32 activations (the tests' and the CPU oracle's precision) every weight is rounded to fp16 after its
scale, exactly as the reference and GPTQ runtimes compute it, and the dot product runs in IEEE float32.
`group_size` promises g_idx[i] == i // group_size (act-order checkpoints are sorted at load by the linear
method); a K step then lies inside one group and reads one row of scales and zeros. Same signature and semantics
as `reference.gptq_matmul`; the configuration comes from `gptq_configs` (tuned per GPU, or a heuristic).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import gptq_configs


@triton.jit
def _zeros_scales(qz_ptr, s_ptr, g, offs_n, mask_n, sz_g, ss_g, BITS: tl.constexpr, ZEROS_V1: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    zw = tl.load(qz_ptr + g * sz_g + offs_n // PACK, mask=mask_n, other=0)
    z = (zw >> ((offs_n % PACK) * BITS)) & MASK
    if ZEROS_V1:
        z = (z + 1) & MASK
    s = tl.load(s_ptr + g * ss_g + offs_n, mask=mask_n, other=0.0)
    return z, s


@triton.jit
def _fields(words, BITS: tl.constexpr):
    """int32 words [W, N] -> their fields [PACK, W, N]: row (j, i) is field j of word i (input row i * PACK + j).
    An arithmetic shift of a negative word followed by the mask is still the right field."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    shifts = (tl.arange(0, PACK) * BITS)[:, None, None]
    return (words[None, :, :] >> shifts) & MASK


@triton.jit
def _epilogue(acc, y_ptr, ws_ptr, lock_ptr, tile, pid_k, offs_m, offs_n, M, N, sy_m, n_split,
              SPLIT: tl.constexpr):
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * sy_m + offs_n[None, :]
    if not SPLIT:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves (release below)
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == n_split - 1:
            total = tl.zeros_like(acc)
            for s in range(n_split):
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, n_split, group_size,
                 sx_m, sq_k, sz_g, ss_g, sy_m,
                 BITS: tl.constexpr, ZEROS_V1: tl.constexpr, F32: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, FIELD_LOOP: tl.constexpr = False):
    PACK: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PACK
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, BKW)
    xk = offs_w[None, :] * PACK + tl.arange(0, PACK)[:, None]  # [PACK, BKW]: field j of word i is row i*PACK + j
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        wrow = k0 // PACK + offs_w
        words = tl.load(qw_ptr + wrow[:, None] * sq_k + offs_n[None, :],
                        mask=(wrow < k_end // PACK)[:, None] & mask_n[None, :], other=0, eviction_policy="evict_first")
        z, s = _zeros_scales(qz_ptr, s_ptr, k0 // group_size, offs_n, mask_n, sz_g, ss_g, BITS, ZEROS_V1)
        if FIELD_LOOP:  # field by field: every tile keeps the loaded words' layout, x comes in per field
            part = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
            zf = (z + 0x800000).to(tl.float32)[None, :]
            for j in tl.static_range(PACK):
                xj = tl.load(x_ptr + pid_m * sx_m + k0 + offs_w * PACK + j,
                             mask=(k0 + offs_w * PACK + j) < k_end, other=0.0).to(tl.float32)
                qj = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x4B000000
                part += xj[:, None] * (qj.to(tl.float32, bitcast=True) - zf)
            acc += part * s.to(tl.float32)[None, :]
        else:
            xv = tl.load(x_ptr + pid_m * sx_m + k0 + xk, mask=(k0 + xk) < k_end, other=0.0).to(tl.float32)
            q = _fields(words, BITS)
            if F32:
                w = ((q - z[None, None, :]).to(tl.float16) * s[None, None, :]).to(tl.float32)
                acc += tl.sum(xv[:, :, None] * w, axis=0)
            else:
                v = (q | 0x4B000000).to(tl.float32, bitcast=True) - (z + 0x800000).to(tl.float32)[None, None, :]
                acc += tl.sum(xv[:, :, None] * v, axis=0) * s.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=0)[None, :]
    offs_m = pid_m + tl.zeros((1,), dtype=tl.int32)
    _epilogue(out, y_ptr, ws_ptr, lock_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, offs_m, offs_n, M, N, sy_m,
              n_split, SPLIT)


@triton.jit
def _gemv_rows_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, n_split, group_size,
                      sx_m, sq_k, sz_g, ss_g, sy_m,
                      BITS: tl.constexpr, ZEROS_V1: tl.constexpr, F32: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """`gemv` for BLOCK_M rows at once: each weight is loaded and unpacked once and used for every row."""
    PACK: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PACK
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    offs_w = tl.arange(0, BKW)
    xk = offs_w[None, :] * PACK + tl.arange(0, PACK)[:, None]  # [PACK, BKW]
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BKW, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        wrow = k0 // PACK + offs_w
        words = tl.load(qw_ptr + wrow[:, None] * sq_k + offs_n[None, :],
                        mask=(wrow < k_end // PACK)[:, None] & mask_n[None, :], other=0, eviction_policy="evict_first")
        xv = tl.load(x_ptr + offs_m[:, None, None] * sx_m + k0 + xk[None, :, :],
                     mask=mask_m[:, None, None] & ((k0 + xk) < k_end)[None, :, :], other=0.0).to(tl.float32)
        z, s = _zeros_scales(qz_ptr, s_ptr, k0 // group_size, offs_n, mask_n, sz_g, ss_g, BITS, ZEROS_V1)
        q = _fields(words, BITS)
        if F32:
            w = ((q - z[None, None, :]).to(tl.float16) * s[None, None, :]).to(tl.float32)
            acc += tl.sum(xv[:, :, :, None] * w[None, :, :, :], axis=1)
        else:
            v = (q | 0x4B000000).to(tl.float32, bitcast=True) - (z + 0x800000).to(tl.float32)[None, None, :]
            acc += tl.sum(xv[:, :, :, None] * v[None, :, :, :], axis=1) * s.to(tl.float32)[None, None, :]
    out = tl.sum(acc, axis=1)
    _epilogue(out, y_ptr, ws_ptr, lock_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, offs_m, offs_n, M, N, sy_m,
              n_split, SPLIT)


@triton.jit
def _mmat_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, n_split, group_size,
                 sx_m, sq_k, sz_g, ss_g, sy_m,
                 BITS: tl.constexpr, ZEROS_V1: tl.constexpr, F32: tl.constexpr, DOT_F32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 GROUP_M: tl.constexpr, FIELD_DOTS: tl.constexpr = False):
    """`mma` transposed: y^T = W^T x^T, so the dequantized weight is the first (register) operand of the tensor-core
    instruction and the few activation rows the second (as Machete does); BLOCK_N is the instruction's M side."""
    PACK: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PACK
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    r = tl.arange(0, BLOCK_K)
    kperm = (r % BKW) * PACK + r // BKW
    offs_w = tl.arange(0, BKW)
    shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + kperm
        xt = tl.load(x_ptr + offs_m[None, :] * sx_m + kk[:, None], mask=mask_m[None, :] & (kk < k_end)[:, None],
                     other=0.0)
        wrow = k0 // PACK + offs_w
        words = tl.load(qw_ptr + wrow[None, :] * sq_k + offs_n[:, None],
                        mask=(wrow < k_end // PACK)[None, :] & mask_n[:, None], other=0, eviction_policy="evict_first")
        z, s = _zeros_scales(qz_ptr, s_ptr, k0 // group_size, offs_n, mask_n, sz_g, ss_g, BITS, ZEROS_V1)
        if FIELD_DOTS:  # one dot per field, the field tile straight from the loaded words' registers
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            zf = (z + 1024).to(tl.float16)[:, None]
            for j in tl.static_range(PACK):
                kj = k0 + offs_w * PACK + j
                xj = tl.load(x_ptr + offs_m[None, :] * sx_m + kj[:, None], mask=mask_m[None, :] & (kj < k_end)[:, None],
                             other=0.0)
                qj = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x6400
                wj = qj.to(tl.int16).to(tl.float16, bitcast=True) - zf
                part += tl.dot(wj.to(xj.dtype), xj)
            acc += part * s.to(tl.float32)[:, None]
        else:
            q = (words[:, None, :] >> shifts) & ((1 << BITS) - 1)  # [BLOCK_N, PACK, BKW]
            if F32:
                w = ((q - z[:, None, None]).to(tl.float16) * s[:, None, None]).to(tl.float32)
                acc += tl.dot(tl.reshape(w, (BLOCK_N, BLOCK_K)), xt.to(tl.float32), input_precision="ieee")
            else:
                v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (z + 1024).to(tl.float16)[:, None, None]
                w = tl.reshape(v, (BLOCK_N, BLOCK_K))
                if DOT_F32:
                    part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(w.to(xt.dtype), xt)
                acc += part * s.to(tl.float32)[:, None]
    _epilogue(tl.trans(acc), y_ptr, ws_ptr, lock_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, offs_m, offs_n,
              M, N, sy_m, n_split, SPLIT)


@triton.jit
def _mma_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, n_split, group_size,
                sx_m, sq_k, sz_g, ss_g, sy_m,
                BITS: tl.constexpr, ZEROS_V1: tl.constexpr, F32: tl.constexpr, DOT_F32: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                GROUP_M: tl.constexpr, FIELD_DOTS: tl.constexpr = False):
    PACK: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PACK
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n  # grouped tile order: GROUP_M row tiles walk the same column tiles (L2 reuse)
    first_m = (pid // width) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_in_group
    pid_n = (pid % width) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    r = tl.arange(0, BLOCK_K)
    kperm = (r % BKW) * PACK + r // BKW  # row r of the unpacked tile is field r // BKW of word r % BKW
    offs_w = tl.arange(0, BKW)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + kperm
        xt = tl.load(x_ptr + offs_m[:, None] * sx_m + kk[None, :], mask=mask_m[:, None] & (kk < k_end)[None, :],
                     other=0.0)
        wrow = k0 // PACK + offs_w
        words = tl.load(qw_ptr + wrow[:, None] * sq_k + offs_n[None, :],
                        mask=(wrow < k_end // PACK)[:, None] & mask_n[None, :], other=0, eviction_policy="evict_first")
        z, s = _zeros_scales(qz_ptr, s_ptr, k0 // group_size, offs_n, mask_n, sz_g, ss_g, BITS, ZEROS_V1)
        if FIELD_DOTS:  # one dot per field: each field tile keeps the loaded words' layout (no 3-D reshape)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            zf = (z + 1024).to(tl.float16)[None, :]
            for j in tl.static_range(PACK):
                xj = tl.load(x_ptr + offs_m[:, None] * sx_m + (k0 + offs_w * PACK + j)[None, :],
                             mask=mask_m[:, None] & ((k0 + offs_w * PACK + j) < k_end)[None, :], other=0.0)
                qj = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x6400
                wj = qj.to(tl.int16).to(tl.float16, bitcast=True) - zf
                part += tl.dot(xj, wj.to(xj.dtype))
            acc += part * s.to(tl.float32)[None, :]
        else:
            q = _fields(words, BITS)
            if F32:
                w = ((q - z[None, None, :]).to(tl.float16) * s[None, None, :]).to(tl.float32)
                acc += tl.dot(xt.to(tl.float32), tl.reshape(w, (BLOCK_K, BLOCK_N)), input_precision="ieee")
            else:
                v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (z + 1024).to(tl.float16)[None, None, :]
                w = tl.reshape(v, (BLOCK_K, BLOCK_N))
                if DOT_F32:  # the interpreter's bf16 tl.dot is wrong: multiply the same bf16 values in float32
                    part = tl.dot(xt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(xt, w.to(xt.dtype))
                acc += part * s.to(tl.float32)[None, :]
    _epilogue(acc, y_ptr, ws_ptr, lock_ptr, pid, pid_k, offs_m, offs_n, M, N, sy_m, n_split, SPLIT)


@triton.jit
def _dequant_kernel(qw_ptr, qz_ptr, s_ptr, g_ptr, w_ptr, N, K, sq_k, sz_g, ss_g, sw_k,
                    BITS: tl.constexpr, ZEROS_V1: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """w[k, n] = (q - z) * s rounded to fp16, in w's dtype; groups read from g_idx row by row."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_w = offs_w < K // PACK
    words = tl.load(qw_ptr + offs_w[:, None] * sq_k + offs_n[None, :], mask=mask_w[:, None] & mask_n[None, :],
                    other=0)
    q = _fields(words, BITS)  # [PACK, BLOCK_W, BLOCK_N]
    rows = offs_w[None, :] * PACK + tl.arange(0, PACK)[:, None]  # [PACK, BLOCK_W]
    mask = mask_w[None, :, None] & mask_n[None, None, :]
    g = tl.load(g_ptr + rows, mask=mask_w[None, :], other=0)[:, :, None]
    zw = tl.load(qz_ptr + g * sz_g + (offs_n // PACK)[None, None, :], mask=mask, other=0)
    z = (zw >> ((offs_n % PACK) * BITS)[None, None, :]) & MASK
    if ZEROS_V1:
        z = (z + 1) & MASK
    s = tl.load(s_ptr + g * ss_g + offs_n[None, None, :], mask=mask, other=0.0)
    w = (q - z).to(tl.float16) * s
    tl.store(w_ptr + rows[:, :, None] * sw_k + offs_n[None, None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


_LOCKS: dict = {}
_SCRATCH: dict = {}


def _locks(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile arrival counters, zero between calls (the last program of a tile resets its counter)."""
    have = _LOCKS.get(device)
    if have is None or have.numel() < tiles:
        have = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
        _LOCKS[device] = have
    return have


def dequantize_into_scratch(qweight, qzeros, scales, g_idx, bits: int, zeros_v1: bool, dtype) -> torch.Tensor:
    """The dequantized weight [K, N] in a per-device scratch buffer reused by every layer (valid until the next
    call): prefill reads it once through cuBLAS."""
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
    grid = (triton.cdiv(k // pack, block_w), triton.cdiv(n, block_n))
    _dequant_kernel[grid](qweight, qzeros, scales, g_idx, w, n, k, qweight.stride(0), qzeros.stride(0),
                          scales.stride(0), w.stride(0), BITS=bits, ZEROS_V1=bool(zeros_v1), BLOCK_N=block_n,
                          BLOCK_W=block_w, num_warps=4)
    return w


def release_scratch(device: torch.device) -> None:
    for key in [k for k in _SCRATCH if k[0] == device]:
        del _SCRATCH[key]


def scratch_bytes(k: int, n: int, dtype: torch.dtype) -> int:
    """What `dequantize_into_scratch` holds for a K x N layer."""
    return k * n * torch.empty((), dtype=dtype).element_size()


def _launch(kind: str, cfg: dict, x2, qweight, qzeros, scales, bits, zeros_v1, gs, m, n, k) -> torch.Tensor:
    split = cfg["SPLIT_K"]
    k_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = triton.cdiv(k, k_split)
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    ws = torch.empty((split, m, n) if split > 1 else (1,), device=x2.device, dtype=torch.float32)
    f32 = x2.dtype == torch.float32
    common = dict(BITS=bits, ZEROS_V1=bool(zeros_v1), F32=f32, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  SPLIT=split > 1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    args = (m, n, k, k_split, split, gs, x2.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), y.stride(0))
    interp_bf16 = x2.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    if kind == "gemv" and cfg.get("BLOCK_M", 1) == 1:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split, m)
        _gemv_kernel[grid](x2, qweight, qzeros, scales, y, ws, _locks(x2.device, grid[0] * m), *args,
                           FIELD_LOOP=bool(cfg.get("FIELD", False)) and not f32, **common)
    elif kind == "gemv":
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split, triton.cdiv(m, cfg["BLOCK_M"]))
        _gemv_rows_kernel[grid](x2, qweight, qzeros, scales, y, ws, _locks(x2.device, grid[0] * grid[2]), *args,
                                BLOCK_M=cfg["BLOCK_M"], **common)
    elif kind == "mmat":
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split, triton.cdiv(m, cfg["BLOCK_M"]))
        _mmat_kernel[grid](x2, qweight, qzeros, scales, y, ws, _locks(x2.device, grid[0] * grid[2]), *args,
                           BLOCK_M=cfg["BLOCK_M"], GROUP_M=1, DOT_F32=interp_bf16,
                           FIELD_DOTS=bool(cfg.get("FIELD", False)) and not (f32 or interp_bf16)
                           and cfg["BLOCK_K"] // (32 // bits) >= 16, **common)
    else:
        tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        _mma_kernel[(tiles, split)](x2, qweight, qzeros, scales, y, ws, _locks(x2.device, tiles), *args,
                                    BLOCK_M=cfg["BLOCK_M"], GROUP_M=cfg.get("GROUP_M", 1), DOT_F32=interp_bf16,
                                    FIELD_DOTS=bool(cfg.get("FIELD", False)) and not (f32 or interp_bf16)
                                    and cfg["BLOCK_K"] // (32 // bits) >= 16, **common)
    return y


def gptq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int, zeros_v1: bool = True, group_size: int | None = None,
                config: dict | None = None) -> torch.Tensor:
    """Same as `reference.gptq_matmul` (see there). `config` overrides the tuned / heuristic choice (tests,
    tuning): {"kernel": "gemv" | "mma" | "dequant", BLOCK_*, SPLIT_K, GROUP_M, num_warps, num_stages}."""
    pack = 32 // bits
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, qweight holds {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    step = gptq_configs.block_k_limit(group_size, k, pack)
    cfg = config if config is not None else gptq_configs.choose(m, n, k, x.device)
    kind = cfg.get("kernel", "mma") if step else "dequant"
    if kind != "dequant":
        cfg = dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], step))
    if kind == "gemv" or (kind in ("mma", "mmat") and cfg["BLOCK_K"] >= 16):
        gs = k if group_size in (None, -1) else group_size
        y = _launch(kind, cfg, x2, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), bits, zeros_v1,
                    gs, m, n, k)
    else:
        w = dequantize_into_scratch(qweight, qzeros, scales, g_idx, bits, zeros_v1, x.dtype)
        y = torch.matmul(x2, w)
    return y.reshape(*lead, n)
