"""Triton GPTQ matmul (W4A16 / W8A16): y = x @ W^T with W dequantized in registers, never in memory.

Each program owns a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps: it loads BLOCK_K / pack int32 words
of qweight per column, splits them into `bits`-wide values with shifts (an arithmetic shift of a negative int32
word followed by the mask is still the right field), subtracts the zero points, multiplies by the scales in the
scales' dtype (fp16, as GPTQ runtimes round), and feeds the tile to tl.dot with float32 accumulation.

Groups: when the caller knows that g_idx[i] == i // group_size (no act-order, or act-order rows already sorted
by the linear method) it passes `group_size`, and every BLOCK_K slice lies inside one group: one row of scales
and zeros per step (GROUPED). Otherwise g_idx is read per input row and scales / zeros are gathered per element.

Two regimes (`pick_config`): decode (M <= 64) uses the smallest BLOCK_M and splits K across programs (SPLIT_K)
so that a few N tiles still fill the GPU; the partial sums land in a float32 [SPLIT_K, M, N] buffer summed by
torch. Prefill uses large square-ish tiles, no split, and a grouped tile order (GROUP_M) for L2 reuse of the
weight. Same signature and semantics as `reference.gptq_matmul`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _gptq_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, y_ptr, M, N, K, K_SPLIT, group_size,
                      sx_m, sx_k, sq_k, sq_n, sz_g, sz_n, ss_g, ss_n, sy_s, sy_m, sy_n,
                      BITS: tl.constexpr, ZEROS_V1: tl.constexpr, GROUPED: tl.constexpr, F32_DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    # grouped tile order: GROUP_M row tiles walk the same column tiles (the weight stays in L2)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_in_group
    pid_n = (pid % width) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    shifts_k = (tl.arange(0, PACK) * BITS)[None, :, None]  # the field of each of the PACK rows in one word
    shift_n = (offs_n % PACK) * BITS  # the field of each column in its qzeros word
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        xt = tl.load(x_ptr + offs_m[:, None] * sx_m + offs_k[None, :] * sx_k,
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
        words = tl.load(qw_ptr + offs_w[:, None] * sq_k + offs_n[None, :] * sq_n,
                        mask=(offs_w[:, None] < tl.cdiv(k_end, PACK)) & mask_n[None, :], other=0)
        q = tl.reshape((words[:, None, :] >> shifts_k) & MASK, (BLOCK_K, BLOCK_N))
        if GROUPED:
            g = k0 // group_size
            zw = tl.load(qz_ptr + g * sz_g + (offs_n // PACK) * sz_n, mask=mask_n, other=0)
            s = tl.load(s_ptr + g * ss_g + offs_n * ss_n, mask=mask_n, other=0.0)[None, :]
            z = ((zw >> shift_n) & MASK)[None, :]
        else:
            g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
            mask_kn = mask_k[:, None] & mask_n[None, :]
            zw = tl.load(qz_ptr + g[:, None] * sz_g + (offs_n // PACK)[None, :] * sz_n, mask=mask_kn, other=0)
            s = tl.load(s_ptr + g[:, None] * ss_g + offs_n[None, :] * ss_n, mask=mask_kn, other=0.0)
            z = (zw >> shift_n[None, :]) & MASK
        if ZEROS_V1:
            z = (z + 1) & MASK
        w = (q - z).to(s.dtype) * s
        if F32_DOT:
            acc += tl.dot(xt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, w.to(xt.dtype))
    y_ptrs = y_ptr + pid_k * sy_s + offs_m[:, None] * sy_m + offs_n[None, :] * sy_n
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.lru_cache(maxsize=4)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_config(m: int, n: int, k: int, step: int, sms: int) -> dict:
    """Tile sizes for one shape on a GPU with `sms` multiprocessors. `step` is the largest BLOCK_K the grouping
    allows (a power of two)."""
    if m <= 64:  # decode: weight-bandwidth bound; split K until the GPU is full
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, block_k = (64, 128) if n <= 4096 else (128, 128)
        block_k = min(block_k, step)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split = max(1, min(triton.cdiv(2 * sms, tiles), k // (4 * block_k), 16))
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, GROUP_M=1,
                    num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=min(64, step), SPLIT_K=1, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=min(64, step), SPLIT_K=1, GROUP_M=8, num_warps=8, num_stages=3)


def _block_k_limit(group_size: int | None, k: int, pack: int) -> tuple[bool, int]:
    """(GROUPED, the largest power-of-two BLOCK_K that keeps a K step inside one group)."""
    if group_size is None:
        return False, 128
    if group_size == -1 or group_size >= k:
        return True, 128
    step = group_size & -group_size  # the largest power of two dividing group_size
    if step < max(16, pack):
        return False, 128
    return True, min(step, 128)


def _plan(m: int, n: int, k: int, pack: int, group_size: int | None, config: dict | None, device) -> tuple:
    """(GROUPED, launch config without SPLIT_K, number of K splits, K range per split)."""
    grouped, step = _block_k_limit(group_size, k, pack)
    if config is None:
        config = pick_config(m, n, k, step, _num_sms(device.index or 0) if device.type == "cuda" else 8)
    cfg = dict(config)
    split = cfg.pop("SPLIT_K")
    if grouped and group_size not in (None, -1) and group_size < k and group_size % cfg["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} does not divide group_size {group_size}")
    k_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    return grouped, cfg, triton.cdiv(k, k_split), k_split


def _f32_dot(dtype: torch.dtype) -> bool:
    """float32 inputs multiply in IEEE float32; so do bf16 ones in the interpreter, whose bf16 tl.dot is wrong."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def gptq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int, zeros_v1: bool = True, group_size: int | None = None,
                config: dict | None = None) -> torch.Tensor:
    """Same as `reference.gptq_matmul` (see there). `config` overrides `pick_config` (tests, tuning)."""
    pack = 32 // bits
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, qweight holds {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    grouped, cfg, split, k_split = _plan(m, n, k, pack, group_size, config, x.device)
    out = torch.empty((split, m, n), device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    gs = k if group_size in (None, -1) else group_size
    _gptq_gemm_kernel[grid](
        x2, qweight, qzeros, scales, g_idx, out, m, n, k, k_split, gs,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), qzeros.stride(0), qzeros.stride(1),
        scales.stride(0), scales.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BITS=bits, ZEROS_V1=bool(zeros_v1), GROUPED=grouped, F32_DOT=_f32_dot(x.dtype), **cfg)
    y = out[0] if split == 1 else out.sum(0).to(x.dtype)
    return y.reshape(*lead, n)
