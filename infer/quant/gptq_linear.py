"""The GPTQ linear method for MergedLinear: loads qweight/qzeros/scales/g_idx shards, computes y = x W^T.

Merged shards (q,k,v or gate,up) are stacked along the output dimension, which is the last dimension of every
GPTQ tensor, so they concatenate as stored; g_idx must be the same for all shards of one layer. On CPU the weight is
dequantized once at load time (the float path, prepacked for oneDNN); on CUDA every matmul goes through
`kernels.gptq_matmul`, which dequantizes in registers. Nothing is ever repacked on disk.
"""

from __future__ import annotations

import torch

from ..errors import ModelLoadError
from ..kernels import cpu_gemm
from . import packing
from .config import GPTQConfig

_REQUIRED = ("qweight", "qzeros", "scales")


class GPTQLinearMethod:
    def __init__(self, config: GPTQConfig):
        self.config = config

    def create_weights(self, layer) -> None:
        c, k, n = self.config, layer.in_features, layer.out_features
        if k % c.pack or any(size % c.pack for size in layer.out_sizes):
            raise ModelLoadError(f"{layer.names[0]}: sizes {k} x {layer.out_sizes} do not pack into {c.bits}-bit "
                                 f"int32 words", "this layer cannot be a GPTQ layer")
        groups = c.num_groups(k)
        layer.register_buffer("qweight", torch.zeros(k // c.pack, n, dtype=torch.int32))
        layer.register_buffer("qzeros", torch.zeros(groups, n // c.pack, dtype=torch.int32))
        layer.register_buffer("scales", torch.zeros(groups, n, dtype=torch.float16))
        layer.register_buffer("g_idx", (torch.arange(k) // (k if c.group_size == -1 else c.group_size)).int())
        layer.register_buffer("weight", None)  # the dequantized float weight, CPU only
        layer.register_buffer("packed_weight", None)

    def _expected(self, layer, name: str, shard: int) -> tuple[int, ...]:
        c, k, n = self.config, layer.in_features, layer.out_sizes[shard]
        groups = c.num_groups(k)
        return {"qweight": (k // c.pack, n), "qzeros": (groups, n // c.pack), "scales": (groups, n),
                "g_idx": (k,)}[name]

    def load_shard(self, layer, name: str, shard: int, tensor: torch.Tensor) -> None:
        full = f"{layer.prefix_of(shard)}.{name}"
        if name not in ("qweight", "qzeros", "scales", "g_idx"):
            raise ModelLoadError(f"unexpected tensor {full} in a GPTQ layer",
                                 "the checkpoint does not match its quantization_config")
        expect = self._expected(layer, name, shard)
        if tuple(tensor.shape) != expect:
            raise ModelLoadError(f"{full} has shape {tuple(tensor.shape)} but config.json implies {expect}",
                                 "the checkpoint does not match config.json / quantization_config (bits, "
                                 "group_size)")
        if name == "g_idx":
            if shard > 0 and (shard - 1, "g_idx") in layer.loaded_names() \
                    and not torch.equal(layer.g_idx, tensor.to(layer.g_idx.dtype)):
                raise ModelLoadError(f"{full} differs from {layer.prefix_of(0)}.g_idx",
                                     "shards that infer merges into one matmul must share their act-order")
            layer.g_idx.copy_(tensor)
            return
        start = layer.shard_offset(shard)
        if name == "qzeros":
            start //= self.config.pack
        buf = getattr(layer, name)
        buf[:, start:start + tensor.shape[1]].copy_(tensor)

    def finish_loading(self, layer) -> None:
        loaded = layer.loaded_names()
        for shard, hf_name in enumerate(layer.names):
            for name in _REQUIRED:
                if (shard, name) not in loaded:
                    raise ModelLoadError(f"the checkpoint has no tensor {hf_name}.{name}",
                                         "the GPTQ checkpoint is incomplete")
        if int(layer.g_idx.min()) < 0 or int(layer.g_idx.max()) >= layer.scales.shape[0]:
            raise ModelLoadError(f"{layer.names[0]}.g_idx points outside its {layer.scales.shape[0]} groups")
        if layer.qweight.device.type == "cpu":
            layer.weight = self.dequantized_weight(layer)
            layer.packed_weight = cpu_gemm.prepack(layer.weight)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.weight is not None:
            return cpu_gemm.linear(x, layer.weight, layer.bias, layer.packed_weight)
        from .. import kernels
        y = kernels.gptq_matmul(x, layer.qweight, layer.qzeros, layer.scales, layer.g_idx, self.config.bits,
                                self.config.zeros_v1)
        return y if layer.bias is None else y + layer.bias

    def dequantized_weight(self, layer) -> torch.Tensor:
        if layer.weight is not None:
            return layer.weight
        return packing.dequantize(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, self.config.bits,
                                  self.config.zeros_v1, layer.dtype)
