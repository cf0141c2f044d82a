"""AWQ "gemm" checkpoints (AutoAWQ's default packing, which vLLM's awq method reads) as GPTQ tensors.

AWQ stores, for a linear of `in` inputs and `out` outputs quantized in groups of g input rows:
qweight int32 [in, out / 8]: 8 4-bit values of one input row per word, along the OUTPUT dimension, nibble k
    (bits 4k..4k+3) of word j holding output column 8j + AWQ_ORDER[k] (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7);
qzeros  int32 [in / g, out / 8]: the zero points, packed the same way, the zero itself (no "minus one");
scales  fp16  [in / g, out];
W[o, i] = (q[i, o] - zero[i // g, o]) * scales[i // g, o], the product in fp16: GPTQ's formula with plain groups
(no act-order), so the same weights are a GPTQ checkpoint once repacked: qweight along the input dimension
([in / 8, out]), qzeros in natural order stored as v1 words (zero - 1, as GPTQModel writes the "gptq" format),
g_idx = i // g. `to_gptq` does that, exactly (every integer kept, the scales untouched); the loader runs it on
every AWQ layer as it is read (the int4 kernels then see a GPTQ layer) and `infer convert --to gptq` writes it.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from ..errors import ModelLoadError
from . import packing
from .config import GPTQConfig
from .gptq_linear import GPTQLinearMethod

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column (within 8) that nibble k of a word holds
BITS = 4
PACK = 32 // BITS


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AWQ's nibble order -> int32 [rows, cols] values 0..15 in natural column order."""
    rows, words = packed.shape
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(2) >> shifts) & packing.mask(BITS)  # [rows, words, k]: nibble k of each word
    out = torch.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles  # nibble k is column AWQ_ORDER[k] of its word's 8
    return out.reshape(rows, words * PACK)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_awq: int [rows, cols] values 0..15 -> int32 [rows, cols / 8] in AWQ's order."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows, cols // PACK, PACK)[:, :, list(AWQ_ORDER)]
    return packing.pack_cols(grouped.reshape(rows, cols), BITS)


def check_shapes(name: str, qweight: torch.Tensor | None, qzeros: torch.Tensor | None, scales: torch.Tensor | None,
                 group_size: int, source: str) -> None:
    """A ModelLoadError naming the tensor whose shape is not AWQ's for the others (the qweight decides in and out;
    group_size -1: one group of all its inputs)."""
    if qweight is None:
        return
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    group_size = k if group_size == -1 else group_size
    if k % group_size:
        raise ModelLoadError(f"{name}.qweight has {k} input rows, which AWQ group_size {group_size} does not divide",
                             f"the checkpoint does not match its quantization config ({source})")
    for what, t, want in (("qzeros", qzeros, (k // group_size, n // PACK)), ("scales", scales, (k // group_size, n))):
        if t is not None and tuple(t.shape) != want:
            raise ModelLoadError(f"{name}.{what} has shape {tuple(t.shape)}, but an AWQ qweight of shape "
                                 f"{tuple(qweight.shape)} (group_size {group_size}) implies {want}",
                                 f"the checkpoint does not match its quantization config ({source})")


def qweight_to_gptq(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ qweight [in, out / 8] -> GPTQ qweight [in / 8, out] (the same 4-bit values)."""
    if qweight.shape[0] % PACK:
        raise ModelLoadError(f"an AWQ qweight of {qweight.shape[0]} input rows does not pack into GPTQ words of "
                             f"{PACK}", "this layer cannot be a GPTQ layer")
    return packing.pack_rows(unpack_awq(qweight), BITS)


def qzeros_to_gptq(qzeros: torch.Tensor) -> torch.Tensor:
    """AWQ qzeros (the zeros themselves, AWQ order) -> GPTQ v1 words (zero - 1, natural order, borrows included)."""
    return packing.v1_words(packing.pack_cols(unpack_awq(qzeros), BITS), BITS)


def g_idx(in_features: int, group_size: int) -> torch.Tensor:
    return (torch.arange(in_features) // group_size).to(torch.int32)


def to_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int):
    """One AWQ layer's tensors -> (qweight, qzeros, scales, g_idx) of the GPTQ "gptq" (v1) layer with the same
    dequantized weight (group_size -1: one group)."""
    k = qweight.shape[0]
    return qweight_to_gptq(qweight), qzeros_to_gptq(qzeros), scales, g_idx(k, k if group_size == -1 else group_size)


class AWQLinearMethod(GPTQLinearMethod):
    """A linear of an AWQ checkpoint: each tensor is repacked into GPTQ's layout as it is read, then loaded as a
    GPTQ layer's (same buffers, kernels and dequantized CPU weight)."""

    _AWQ_NAMES = ("qweight", "qzeros", "scales")

    def create_weights(self, layer) -> None:
        if layer.in_features % self.config.group_size:
            raise ModelLoadError(f"{layer.names[0]}: AWQ group_size {self.config.group_size} does not divide its "
                                 f"{layer.in_features} inputs", "this layer cannot be an AWQ layer (vLLM refuses it "
                                 "too)")
        super().create_weights(layer)

    def output_packing(self, name: str) -> int:
        """Output columns per stored column of tensor `name`: AWQ packs qweight and qzeros 8 output columns a word
        (a fused module, Phi-3's qkv_proj, is cut at word boundaries: MergedLinear.load_fused)."""
        return PACK if name in ("qweight", "qzeros") else 1

    def load_shard(self, layer, name: str, shard: int, tensor: torch.Tensor) -> None:
        full = f"{layer.prefix_of(shard)}.{name}"
        if name not in self._AWQ_NAMES:  # g_idx included: AWQ has none
            raise ModelLoadError(f"unexpected tensor {full} in an AWQ layer",
                                 f"the checkpoint does not match its quantization config ({self.config.source}: "
                                 "AWQ layers hold qweight, qzeros and scales)")
        k, n, g = layer.in_features, layer.out_sizes[shard], self._group_size(layer.in_features)
        want = {"qweight": (k, n // PACK), "qzeros": (k // g, n // PACK), "scales": (k // g, n)}[name]
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"{full} has shape {tuple(tensor.shape)} but {self.config.source} implies {want} "
                                 f"(AWQ 'gemm' layout)", f"the checkpoint does not match its quantization config "
                                 f"({self.config.source}: bits 4, group_size {self.config.group_size})")
        if name == "qweight":
            tensor = qweight_to_gptq(tensor)
        elif name == "qzeros":
            tensor = qzeros_to_gptq(tensor)
        super().load_shard(layer, name, shard, tensor)


def state_to_gptq(state: dict, config: GPTQConfig) -> dict:
    """An AWQ checkpoint's tensors (name -> tensor) with every AWQ layer (a .qweight with its .qzeros and .scales)
    rewritten as the GPTQ "gptq" (v1) layer of the same weights, with a g_idx; every other tensor as it is."""
    out: dict = {}
    for name, t in state.items():
        prefix, _, kind = name.rpartition(".")
        if kind in ("qzeros", "scales") and f"{prefix}.qweight" in state:
            continue  # written with their qweight
        if kind == "g_idx":
            raise ModelLoadError(f"{name}: an AWQ checkpoint holds no g_idx",
                                 f"the checkpoint does not match its quantization config ({config.source})")
        if kind != "qweight":
            if kind in ("qzeros", "scales"):
                raise ModelLoadError(f"the checkpoint has {name} but no {prefix}.qweight",
                                     "the AWQ checkpoint is incomplete")
            out[name] = t
            continue
        parts = [state.get(f"{prefix}.{k}") for k in ("qzeros", "scales")]
        missing = [k for k, p in zip(("qzeros", "scales"), parts) if p is None]
        if missing:
            raise ModelLoadError(f"the checkpoint has no tensor {prefix}.{missing[0]}",
                                 "the AWQ checkpoint is incomplete")
        if t.dtype != torch.int32 or parts[0].dtype != torch.int32:
            raise ModelLoadError(f"{prefix}: AWQ qweight and qzeros are int32, the checkpoint has "
                                 f"{t.dtype} and {parts[0].dtype}", "the AWQ checkpoint is damaged")
        check_shapes(prefix, t, parts[0], parts[1], config.group_size, config.source)
        qweight, qzeros, scales, gi = to_gptq(t, parts[0], parts[1], config.group_size)
        out.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales,
                    f"{prefix}.g_idx": gi})
    return out


_IN_LAYER = re.compile(r"\.layers\.(\d+)\.(.+)\.qweight$")


def converted_config(config: GPTQConfig, names) -> GPTQConfig:
    """The GPTQ settings `infer convert --to gptq` writes for an AWQ checkpoint whose converted tensors are `names`.
    modules_to_not_convert (read as `dynamic` rules that leave modules in float) becomes modules_in_block_to_quantize,
    the list of decoder-layer modules that are quantized, which transformers (optimum) reads as well as GPTQModel,
    vLLM and infer; where the layers differ in what they quantize (a name of one layer in modules_to_not_convert) it
    stays `dynamic`, which optimum does not read."""
    if not config.dynamic:
        return config
    per_layer: dict[str, set[str]] = {}
    for name in names:
        m = _IN_LAYER.search(name)
        if m:
            per_layer.setdefault(m.group(1), set()).add(m.group(2))
    kinds = {frozenset(v) for v in per_layer.values()}
    if len(kinds) != 1:
        return config
    return replace(config, dynamic=(), modules_in_block_to_quantize=tuple(sorted(next(iter(kinds)))))
