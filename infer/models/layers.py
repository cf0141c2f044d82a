"""Linear layers that several Hugging Face projections share (q,k,v -> qkv_proj; gate,up -> gate_up_proj).

A layer owns its parameters through a *linear method* (vLLM's pattern): `UnquantizedLinearMethod` keeps a float
`weight` [out, in]; the GPTQ method (infer.quant.gptq_linear) keeps `qweight`/`qzeros`/`scales`/`g_idx`. The
weight loader calls `layer.load_shard(param_name, shard, tensor)` for each checkpoint tensor, where `shard` is the
index of the HF projection inside the merged layer (0 for a plain layer). After all tensors are loaded the loader
calls `layer.finish_loading()`, where a method may repack weights to its kernel's preferred layout.

LoRA: the LoRA manager may set `layer.lora` to an object with `apply(x, y, ctx)` that adds the adapters'
contribution to `y` in place, for the per-token adapter slots described by the forward context. When the linear
method can add it in its own kernel (`method.fuses_lora(layer)`: the int4 kernels' epilogue) and the hook allows
it (`lora.takes_delta(layer)`: `lora.epilogue` not False), the hook's `delta(x, ctx)` (the shrink) goes to
`method.apply(layer, x, lora=delta)` instead, and the method's kernel adds the expand, in its epilogue or by a
launch of its own. While a CUDA graph is captured, the hook may instead run the whole layer (`lora.beside(layer,
x)`, then `lora.apply_beside(layer, x, ctx)`: the shrink on a second stream beside the base matmul). A layer whose
next op can add the delta itself (`lora_consumer`: the MLP's gate_up, whose silu_and_mul does, the qkv of a decode
step, whose decode_attention does, and o_proj and down_proj, whose following rms_norm does) is called through
`forward_deferred`, and the hook may leave the expand to that op (`lora.deferred`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..errors import ModelLoadError
from ..kernels import cpu_gemm


class LinearMethod(Protocol):
    def create_weights(self, layer: "MergedLinear") -> None: ...
    def load_shard(self, layer: "MergedLinear", name: str, shard: int, tensor: torch.Tensor) -> None: ...
    def finish_loading(self, layer: "MergedLinear") -> None: ...
    def apply(self, layer: "MergedLinear", x: torch.Tensor) -> torch.Tensor: ...
    def dequantized_weight(self, layer: "MergedLinear") -> torch.Tensor: ...


class UnquantizedLinearMethod:
    """A float weight [sum(out_sizes), in]; shards are stacked along the output dimension. `why`: in a quantized
    checkpoint, what leaves this layer in float (for the message when it holds quantized tensors after all)."""

    def __init__(self, why: str | None = None):
        self.why = why

    def create_weights(self, layer: "MergedLinear") -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=layer.dtype),
                                    requires_grad=False)

    def load_shard(self, layer: "MergedLinear", name: str, shard: int, tensor: torch.Tensor) -> None:
        if name != "weight":
            raise ModelLoadError(f"unexpected tensor {layer.prefix_of(shard)}.{name} for a float linear layer",
                                 f"the checkpoint has it quantized but {self.why}" if self.why else
                                 "the checkpoint looks quantized but config.json has no quantization_config")
        start, size = layer.shard_offset(shard), layer.out_sizes[shard]
        expect = (size, layer.in_features)
        if tuple(tensor.shape) != expect:
            raise ModelLoadError(f"{layer.prefix_of(shard)}.weight has shape {tuple(tensor.shape)}, "
                                 f"config.json implies {expect}", "the weights do not match config.json")
        layer.weight.data[start:start + size].copy_(tensor)

    def finish_loading(self, layer: "MergedLinear") -> None:
        if getattr(layer, "absorbed", False):  # (MLA's kv_b_proj: its weight read as W_UK / W_UV, never multiplied)
            return
        layer.register_buffer("packed_weight", cpu_gemm.prepack(layer.weight.data), persistent=False)

    def apply(self, layer: "MergedLinear", x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, layer.weight, layer.bias, getattr(layer, "packed_weight", None))

    def dequantized_weight(self, layer: "MergedLinear") -> torch.Tensor:
        return layer.weight.data


class MergedLinear(nn.Module):
    """y = x W^T (+ b) for one or more HF projections that read the same input, in one matmul.

    `names` are the HF module paths of the shards (e.g. model.layers.0.self_attn.q_proj); `out_sizes` their output
    widths, in the order they are concatenated in y.
    """

    # what a load computes from the checkpoint and holds as no tensor, which reload_weights takes with the tensors
    # (LLMEngine: a new checkpoint of another group size, act-order or sym): the method (its GPTQ config) and the
    # GPTQ kernel layout's group size and interleave (those a layer has)
    ADOPTED_ATTRS = ("method", "gptq_group_size", "gptq_interleave")

    def __init__(self, in_features: int, out_sizes: list[int], names: list[str], bias: bool,
                 method: LinearMethod | None, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.out_features = sum(out_sizes)
        self.names = list(names)
        # the modules a checkpoint stores a fused layer's shards under when it stores them apart (GPTQModel's Phi-3:
        # mlp.gate_proj and mlp.up_proj for gate_up_proj), set by the loader as it reads one: messages name them
        self.stored_names: list[str] | None = None
        self.dtype = dtype
        self.method = method or UnquantizedLinearMethod()
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        self.method.create_weights(self)
        self.lora = None
        # set by a model that calls forward_deferred and hands the delta to the next op: lora_consumer(delta) compiles
        # (launches nothing) that op's variant for a step of delta's tokens (an engine start runs it)
        self.lora_consumer = None
        self._loaded: set[tuple[int, str]] = set()

    def shard_offset(self, shard: int) -> int:
        return sum(self.out_sizes[:shard])

    def prefix_of(self, shard: int) -> str:
        """The checkpoint module of shard `shard`, as its tensors are named in the files (for messages)."""
        return (self.stored_names or self.names)[shard]

    @property
    def fused(self) -> bool:
        """Whether the checkpoint may store all the shards as one module (Phi-3's qkv_proj, gate_up_proj: every
        shard carries its name), stacked along the output (`load_fused`)."""
        return len(self.names) > 1 and len(set(self.names)) == 1

    def load_fused(self, name: str, tensor: torch.Tensor) -> None:
        """Load the tensor `name` (weight, bias, qweight, ...) of the fused module that stores every shard: cut along
        its output dimension into the shards' parts (rows of a float weight and of a bias, columns of GPTQ's qweight,
        scales and qzeros, packed by the method's `output_packing`); g_idx (the input's groups) is every shard's."""
        if name == "g_idx":
            parts = [tensor] * len(self.out_sizes)
        else:
            per = getattr(self.method, "output_packing", lambda _: 1)(name)
            widths = [size // per for size in self.out_sizes]
            dim = 0 if name in ("weight", "bias") else tensor.dim() - 1
            if tensor.dim() == 0 or tensor.shape[dim] != sum(widths):
                raise ModelLoadError(f"{self.names[0]}.{name} has shape {tuple(tensor.shape)}, config.json implies "
                                     f"{sum(widths)} along dimension {dim} ({' + '.join(map(str, widths))})",
                                     "the weights do not match config.json")
            parts = tensor.split(widths, dim=dim)
        for shard, part in enumerate(parts):
            self._load_part(name, shard, part)
        self._check_stored(name, 0, tensor)  # (its values once, as one tensor: not each shard's part apart)

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        """Load the checkpoint tensor `name` of shard `shard` (a module stored apart: q_proj, k_proj, ...)."""
        self._load_part(name, shard, tensor)
        self._check_stored(name, shard, tensor)

    def _check_stored(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        """The method's checks of a checkpoint tensor's values (GPTQ's scales beyond or below float16's range), once
        per tensor as the checkpoint stores it, named as it is."""
        check = getattr(self.method, "check_stored", None)
        if check is not None:
            check(f"{self.prefix_of(shard)}.{name}", name, tensor)

    def _load_part(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        if name == "bias":
            if self.bias is None:
                if not isinstance(self.method, UnquantizedLinearMethod) and (tensor.is_meta or not bool(tensor.any())):
                    # older AutoGPTQ versions wrote a zero bias for every layer they quantized, bias or not: it
                    # adds nothing, and transformers and vLLM skip it ("extra bias for GPTQ models")
                    return
                raise ModelLoadError(f"unexpected bias {self.prefix_of(shard)}.bias",
                                     "config.json says this layer has no bias")
            start, size = self.shard_offset(shard), self.out_sizes[shard]
            if tuple(tensor.shape) != (size,):
                raise ModelLoadError(f"{self.prefix_of(shard)}.bias has shape {tuple(tensor.shape)}, "
                                     f"expected ({size},)")
            self.bias.data[start:start + size].copy_(tensor)
        else:
            self.method.load_shard(self, name, shard, tensor)
        self._loaded.add((shard, name))

    def loaded_names(self) -> set[tuple[int, str]]:
        return self._loaded

    def finish_loading(self) -> None:
        self.method.finish_loading(self)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        batch = getattr(ctx, "lora", None) if self.lora is not None else None
        if batch is None:
            return self.method.apply(self, x)
        if self.lora.beside(self, x):  # CUDA graph capture: the shrink on a second stream beside the matmul
            return self.lora.apply_beside(self, x, batch)
        if self.lora.takes_delta(self):
            return self.method.apply(self, x, lora=self.lora.delta(x, batch))
        y = self.method.apply(self, x)
        self.lora.apply(x, y, batch)
        return y

    def forward_deferred(self, x: torch.Tensor, ctx=None):
        """(y, delta): y = forward(x, ctx) less the adapters' delta where the LoRA hook leaves that to y's consumer
        (`lora.defers`: on the GPU, the MLP's gate_up, whose silu_and_mul adds it, a decode step's qkv, whose
        decode_attention does, o_proj and down_proj, whose following rms_norm does), and that delta (a
        kernels.lora_reference.LoRADelta of the batch); otherwise (forward(x, ctx), None). Only a caller whose
        next op adds a LoRADelta may call this (`lora_consumer` says the model's code does)."""
        batch = getattr(ctx, "lora", None) if self.lora is not None else None
        if batch is None or not self.lora.defers(self, x):
            return self.forward(x, ctx), None
        return self.lora.deferred(self, x, batch)

    def dequantized_weight(self) -> torch.Tensor:
        """The float weight [out, in] this layer computes with (dequantized for GPTQ)."""
        return self.method.dequantized_weight(self)
