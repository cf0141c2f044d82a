"""Kernel dispatch: the Triton op on CUDA tensors (when triton is importable), the torch reference otherwise.

Every op here has the same signature as its reference in `reference.py`, which states its semantics.
"""

from __future__ import annotations

import functools

import torch

from . import reference


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def rms_norm(x, weight, eps, residual=None):
    if use_triton(x):
        from .fused import rms_norm as triton_rms_norm
        return triton_rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(positions, q, k, cos_sin_cache, head_dim):
    if use_triton(q):
        from .fused import rotary_embedding as triton_rotary
        return triton_rotary(positions, q, k, cos_sin_cache, head_dim)
    return reference.rotary_embedding(positions, q, k, cos_sin_cache, head_dim)


def silu_and_mul(x):
    if use_triton(x):
        from .fused import silu_and_mul as triton_silu_and_mul
        return triton_silu_and_mul(x)
    return reference.silu_and_mul(x)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    if use_triton(k_cache):
        from .fused import store_kv as triton_store_kv
        return triton_store_kv(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len=None):
    if use_triton(q):  # the module is `attention`: a submodule named paged_attention would shadow this function
        from .attention import paged_attention as triton_attention
        return triton_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len)
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     max_query_len)


def lora_groups(token_slots, num_slots, in_order=False):
    return reference.lora_groups(token_slots, num_slots, in_order)


def lora_shrink(x, lora_a, token_slots, scale=1.0, groups=None):
    """The torch op on every device: a Triton kernel pair computes whole layers (lora_apply); this single-shard
    product is the CPU path's tool for layers where the batch's adapters use only some shards or a small rank."""
    return reference.lora_shrink(x, lora_a, token_slots, scale, groups)


def lora_expand(h, lora_b, token_slots, scalings, y, offset=0, groups=None):
    """The torch op on every device (see lora_shrink)."""
    return reference.lora_expand(h, lora_b, token_slots, scalings, y, offset, groups)


def lora_apply(x, y, lora_a, lora_b, scalings, bounds, token_slots, groups=None, ranks=None):
    if use_triton(y):
        from .lora_ops import lora_apply as triton_apply
        return triton_apply(x, y, lora_a, lora_b, scalings, bounds, token_slots, groups, ranks)
    return reference.lora_apply(x, y, lora_a, lora_b, scalings, bounds, token_slots, groups, ranks)


def gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, zeros_v1=True, group_size=None, interleave=1):
    if use_triton(x):
        from .gptq_gemm import gptq_matmul as triton_gptq_matmul
        return triton_gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, zeros_v1, group_size, interleave)
    return reference.gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, zeros_v1, group_size, interleave)
