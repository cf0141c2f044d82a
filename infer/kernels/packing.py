"""GPTQ int packing as AutoGPTQ / GPTQModel / optimum store it, as small pure functions, and dequantization.

They sit in kernels/ because the torch reference of gptq_matmul dequantizes with them; quant/packing.py re-exports
them beside the round-to-nearest quantizer.

qweight int32 [in / pack, out]: `pack` = 32 / bits values of consecutive input rows, lowest bits first.
qzeros  int32 [groups, out / pack]: the same packing along the output dimension.
scales  fp16  [groups, out];  g_idx int32 [in]: the group of each input row.
v1 zero points ("gptq" format) store zero - 1; v2 ("gptq_v2") store the zero itself. In a v1 file the words are
the v2 words minus a 1 in every field, taken as one int32 subtraction (GPTQModel writes them so, transformers reads
them so): a zero of 0 borrows from the next field. The loader turns them into fields that each hold zero - 1 mod
2^bits (`v1_words_to_fields`), the form `dequantize` and the kernels read.
W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o], the product rounded to the scales' dtype (fp16).
"""

from __future__ import annotations

import torch


def mask(bits: int) -> int:
    """The largest `bits`-wide value (all ones)."""
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
    vals = (packed.unsqueeze(1) >> shifts) & mask(bits)
    return vals.reshape(-1, packed.shape[1])


def pack_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] -> int32 [rows, cols / pack], packing along columns (qzeros)."""
    return pack_rows(q.t().contiguous(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, cols / pack] -> int32 [rows, cols]: the inverse of pack_cols."""
    return unpack_rows(packed.t().contiguous(), bits).t().contiguous()


def _ones(bits: int) -> int:
    """A word with 1 in every `bits`-wide field."""
    return sum(1 << (bits * j) for j in range(32 // bits))


def _wrap32(x: torch.Tensor) -> torch.Tensor:
    """int64 -> int32 modulo 2^32 (signed)."""
    x = x & 0xFFFFFFFF
    return (x - ((x >> 31) << 32)).to(torch.int32)


def v1_words_to_fields(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """v1 zero points as a checkpoint stores them -> every field its own zero - 1 (mod 2^bits). The file's words are
    the packed zeros minus a 1 in every field as one subtraction, so a zero of 0 borrowed from the next field, which
    a field-by-field decode then reads one too low; words without a borrow come back unchanged."""
    return zeros_v2_to_v1(_wrap32(qzeros.to(torch.int64) + _ones(bits)), bits)


def v1_words(zeros_v2: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed zeros (v2) -> v1 words as a checkpoint stores them (the inverse of v1_words_to_fields' reading)."""
    return _wrap32(zeros_v2.to(torch.int64) - _ones(bits))


def zeros_v1_to_v2(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed v1 zero points, field by field (zero - 1) -> packed v2 (the zero itself)."""
    return pack_cols((unpack_cols(qzeros, bits) + 1) & mask(bits), bits)


def zeros_v2_to_v1(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed v2 zero points -> packed v1 (zero - 1, wrapped to `bits`)."""
    return pack_cols((unpack_cols(qzeros, bits) - 1) & mask(bits), bits)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
               zeros_v1: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [out, in] a GPTQ layer computes with."""
    q = unpack_rows(qweight, bits)  # [in, out]
    z = unpack_cols(qzeros, bits)  # [groups, out]
    if zeros_v1:
        z = (z + 1) & mask(bits)
    g = g_idx.long()
    # The product is taken in the scales' dtype (fp16), as GPTQ runtimes (GPTQModel's torch kernel, exllama,
    # Marlin) do; a float32 product would round differently and change near-tied greedy tokens.
    w = scales[g] * (q - z[g]).to(scales.dtype)
    return w.t().contiguous().to(dtype)


def field_rows(k: int, bits: int, interleave: int, device=None) -> torch.Tensor:
    """The input row each unpacked position of an interleaved qweight holds (int64 [k]).

    GPTQ packs rows i*pack .. i*pack+pack-1 into word i (`interleave` = 1). Interleaved by W words, each block of
    W words (W * pack rows) holds in field j of its word i the row j*W + i of the block: field j of the block's words
    covers W consecutive rows, so a kernel that multiplies field by field reads x contiguously. Same bits, same
    bytes, a permutation of rows inside each block."""
    pack = 32 // bits
    s = torch.arange(k, device=device)
    word, field = s // pack, s % pack
    return (word // interleave) * (interleave * pack) + field * interleave + word % interleave


def interleave_rows(qweight: torch.Tensor, bits: int, interleave: int) -> torch.Tensor:
    """GPTQ-order qweight -> the interleaved layout of `field_rows` (identity for interleave 1). Column chunks keep
    the unpacked temporaries small (a load-time repack must not need several times the weight's memory)."""
    if interleave == 1:
        return qweight
    order = field_rows(qweight.shape[0] * (32 // bits), bits, interleave, qweight.device)
    return _by_columns(qweight, lambda q: q[order], bits)


def deinterleave_rows(qweight: torch.Tensor, bits: int, interleave: int) -> torch.Tensor:
    """The inverse of interleave_rows: back to GPTQ order."""
    if interleave == 1:
        return qweight
    order = field_rows(qweight.shape[0] * (32 // bits), bits, interleave, qweight.device)
    return _by_columns(qweight, lambda q: torch.empty_like(q).index_copy_(0, order, q), bits)


def _by_columns(qweight: torch.Tensor, permute, bits: int, chunk: int = 2048) -> torch.Tensor:
    out = torch.empty_like(qweight)
    for c in range(0, qweight.shape[1], chunk):
        out[:, c:c + chunk] = pack_rows(permute(unpack_rows(qweight[:, c:c + chunk].contiguous(), bits)), bits)
    return out
