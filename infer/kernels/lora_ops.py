"""Triton LoRA shrink and expand over a batch whose tokens use different adapters (S-LoRA / punica style).

Tokens are grouped by adapter slot with `reference.lora_groups` (a stable sort by slot plus per-slot segment
bounds, computed on the device without a host sync). The grid's last axis is the slot: program (m, n, s) handles
rows m*BLOCK_M.. of slot s's segment and exits when the segment is shorter, so one launch covers every adapter.
Products accumulate in float32. Same signatures and semantics as `reference.lora_shrink` / `reference.lora_expand`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import LoRAGroups, lora_groups

BLOCK_M = 16


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, N, K,
                   sx_t, sx_k, sa_s, sa_n, sa_k, so_t, so_n, scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    begin = tl.load(starts_ptr + slot + 1)
    end = tl.load(starts_ptr + slot + 2)
    row0 = begin + pid_m * BLOCK_M
    if row0 < end:
        rows = row0 + tl.arange(0, BLOCK_M)
        mask_m = rows < end
        tok = tl.load(order_ptr + rows, mask=mask_m, other=0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xa = tl.load(x_ptr + tok[:, None] * sx_t + offs_k[None, :] * sx_k,
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            aa = tl.load(a_ptr + slot * sa_s + offs_n[None, :] * sa_n + offs_k[:, None] * sa_k,
                         mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(xa, aa, input_precision="ieee")
            else:
                acc += tl.dot(xa, aa)
        acc = acc * scale
        tl.store(out_ptr + tok[:, None] * so_t + offs_n[None, :] * so_n, acc,
                 mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, scal_ptr, N, K, offset,
                   sh_t, sh_k, sb_s, sb_n, sb_k, sy_t, sy_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    begin = tl.load(starts_ptr + slot + 1)
    end = tl.load(starts_ptr + slot + 2)
    row0 = begin + pid_m * BLOCK_M
    if row0 < end:
        rows = row0 + tl.arange(0, BLOCK_M)
        mask_m = rows < end
        tok = tl.load(order_ptr + rows, mask=mask_m, other=0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            ha = tl.load(h_ptr + tok[:, None] * sh_t + offs_k[None, :] * sh_k,
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            bb = tl.load(b_ptr + slot * sb_s + offs_n[None, :] * sb_n + offs_k[:, None] * sb_k,
                         mask=mask_n[None, :] & mask_k[:, None], other=0.0).to(tl.float32)
            if IEEE:
                acc += tl.dot(ha, bb, input_precision="ieee")
            else:
                acc += tl.dot(ha, bb)
        acc = acc * tl.load(scal_ptr + slot)
        mask = mask_m[:, None] & mask_n[None, :]
        y_ptrs = y_ptr + tok[:, None] * sy_t + (offset + offs_n[None, :]) * sy_n
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, scale: float = 1.0,
                groups: LoRAGroups | None = None) -> torch.Tensor:
    """Triton version of reference.lora_shrink: [T, R] float32 = scale * x @ lora_a[slot]^T (0 for slot -1)."""
    num_slots, rank, k = lora_a.shape
    groups = groups if groups is not None else lora_groups(token_slots, num_slots)
    t = x.shape[0]
    out = torch.zeros(t, rank, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    if lora_a.dtype != x.dtype:
        lora_a = lora_a.to(x.dtype)
    block_n, block_k = _block(rank, 16, 64), _block(k, 16, 64)
    grid = (triton.cdiv(t, BLOCK_M), triton.cdiv(rank, block_n), num_slots)
    _shrink_kernel[grid](x, lora_a, out, groups.order, groups.starts, rank, k,
                         x.stride(0), x.stride(1), *lora_a.stride(), out.stride(0), out.stride(1), float(scale),
                         BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32)
    return out


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, scalings: torch.Tensor,
                y: torch.Tensor, offset: int = 0, groups: LoRAGroups | None = None) -> None:
    """Triton version of reference.lora_expand: y[:, offset:offset+out] += scalings[s] * h @ lora_b[s]^T."""
    num_slots, n, rank = lora_b.shape
    groups = groups if groups is not None else lora_groups(token_slots, num_slots)
    t = y.shape[0]
    if t == 0:
        return
    h = h.float()
    scalings = scalings.to(device=y.device, dtype=torch.float32)
    block_n, block_k = _block(n, 16, 64), _block(rank, 16, 64)
    grid = (triton.cdiv(t, BLOCK_M), triton.cdiv(n, block_n), num_slots)
    _expand_kernel[grid](h, lora_b, y, groups.order, groups.starts, scalings, n, rank, offset,
                         h.stride(0), h.stride(1), *lora_b.stride(), y.stride(0), y.stride(1),
                         BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=y.dtype == torch.float32)


def lora_apply(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_bs: list[torch.Tensor],
               scalings: torch.Tensor, offsets: list[int], token_slots: torch.Tensor,
               groups: LoRAGroups | None = None) -> None:
    """Triton version of reference.lora_apply: one shrink over the stacked A, one expand per shard."""
    groups = groups if groups is not None else lora_groups(token_slots, lora_a.shape[0])
    rank = lora_a.shape[1] // len(lora_bs)
    h = lora_shrink(x, lora_a, token_slots, 1.0, groups)
    for i, b in enumerate(lora_bs):
        lora_expand(h[:, i * rank:(i + 1) * rank], b, token_slots, scalings[i], y, offsets[i], groups)
