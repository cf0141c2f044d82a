"""GPTQ int packing (re-exported from kernels/packing.py, where the torch reference of gptq_matmul needs it) and a
round-to-nearest quantizer that writes the same format, for tests and benchmarks.

qweight int32 [in / pack, out], qzeros int32 [groups, out / pack] (v1: zero - 1), scales fp16 [groups, out],
g_idx int32 [in]; W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o]. See kernels/packing.py.
"""

from __future__ import annotations

import torch

from ..kernels.packing import (deinterleave_rows, dequantize, field_rows, interleave_rows, mask, pack_cols, pack_rows,
                               unpack_cols, unpack_rows, v1_words, v1_words_to_fields, zeros_v1_to_v2,
                               zeros_v2_to_v1)

__all__ = ["deinterleave_rows", "dequantize", "field_rows", "interleave_rows", "pack_cols", "pack_rows",
           "quantize_rtn", "unpack_cols", "unpack_rows", "v1_words", "v1_words_to_fields", "zeros_v1_to_v2",
           "zeros_v2_to_v1"]


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool = True, perm: torch.Tensor | None = None):
    """Round-to-nearest GPTQ-format tensors for a float weight [out, in] (tests and benchmarks only; the GPTQ
    solver is GPTQModel's). With `perm` (act-order), input rows are grouped in that order, as desc_act does.
    Returns (qweight, qzeros v1, scales fp16, g_idx)."""
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    order = perm if perm is not None else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_f) // gs).to(torch.int32)
    groups = -(-in_f // gs)
    maxq = mask(bits)
    wt = w.t().float()  # [in, out]
    scales = torch.empty(groups, out_f)
    zeros = torch.empty(groups, out_f, dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        if sym:
            amax = torch.maximum(lo.abs(), hi).clamp(min=1e-8)
            s, z = 2 * amax / maxq, torch.full((out_f,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            s = ((hi - lo) / maxq).clamp(min=1e-8)
            z = torch.round(-lo / s).to(torch.int64)
        scales[g], zeros[g] = s, z
    s16 = scales.half()
    q = torch.clamp(torch.round(wt / s16.float()[g_idx.long()]) + zeros[g_idx.long()], 0, maxq).to(torch.int64)
    qzeros = v1_words(pack_cols(zeros, bits), bits)  # as GPTQModel writes v1 (a zero of 0 borrows)
    return pack_rows(q, bits), qzeros, s16, g_idx
