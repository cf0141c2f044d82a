"""GPTQ int packing as AutoGPTQ / GPTQModel / optimum store it, as small pure functions.

qweight int32 [in / pack, out]: `pack` = 32 / bits values of consecutive input rows, lowest bits first.
qzeros  int32 [groups, out / pack]: the same packing along the output dimension.
scales  fp16  [groups, out];  g_idx int32 [in]: the group of each input row.
v1 zero points ("gptq" format) store zero - 1; v2 ("gptq_v2") store the zero itself.
W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o], the product rounded to the scales' dtype (fp16).
"""

from __future__ import annotations

import torch


def _mask(bits: int) -> int:
    return (1 << bits) - 1


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] ints in 0..2^bits-1 -> int32 [rows / pack, cols], packing along rows."""
    pack = 32 // bits
    rows, cols = q.shape
    if rows % pack:
        raise ValueError(f"{rows} rows do not pack by {pack}")
    q = q.to(torch.int64).reshape(rows // pack, pack, cols)
    shifts = (torch.arange(pack, dtype=torch.int64, device=q.device) * bits).view(1, pack, 1)
    packed = (q << shifts).sum(dim=1)
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # wrap to signed int32


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows / pack, cols] -> int32 [rows, cols] values in 0..2^bits-1."""
    pack = 32 // bits
    shifts = (torch.arange(pack, dtype=torch.int32, device=packed.device) * bits).view(1, pack, 1)
    vals = (packed.unsqueeze(1) >> shifts) & _mask(bits)
    return vals.reshape(-1, packed.shape[1])


def pack_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] -> int32 [rows, cols / pack], packing along columns (qzeros)."""
    return pack_rows(q.t().contiguous(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_rows(packed.t().contiguous(), bits).t().contiguous()


def zeros_v1_to_v2(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_cols((unpack_cols(qzeros, bits) + 1) & _mask(bits), bits)


def zeros_v2_to_v1(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_cols((unpack_cols(qzeros, bits) - 1) & _mask(bits), bits)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
               zeros_v1: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [out, in] a GPTQ layer computes with."""
    q = unpack_rows(qweight, bits)  # [in, out]
    z = unpack_cols(qzeros, bits)  # [groups, out]
    if zeros_v1:
        z = (z + 1) & _mask(bits)
    g = g_idx.long()
    # The product is taken in the scales' dtype (fp16), as GPTQ runtimes (GPTQModel's torch kernel, exllama,
    # Marlin) do; a float32 product would round differently and change near-tied greedy tokens.
    w = scales[g] * (q - z[g]).to(scales.dtype)
    return w.t().contiguous().to(dtype)


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
    maxq = _mask(bits)
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
    qzeros = pack_cols((zeros - 1) & maxq, bits)
    return pack_rows(q, bits), qzeros, s16, g_idx
