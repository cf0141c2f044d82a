"""The GPTQ linear method for MergedLinear: loads qweight/qzeros/scales/g_idx shards, computes y = x W^T.

Merged shards (q,k,v or gate,up) are stacked along the output dimension, which is the last dimension of every
GPTQ tensor, so they concatenate as stored; g_idx must be the same for all shards of one layer.

Two ways to compute, chosen at `finish_loading` (by the weights' device unless `use_kernel` says otherwise):
- dequantized (CPU): the weight is dequantized once into a float cache, prepacked for oneDNN, and used by a plain
  float matmul;
- kernel (CUDA): every matmul goes through `kernels.gptq_matmul`, which dequantizes in registers (or, for a long
  prefill, into a scratch buffer read by cuBLAS; see kernels.gptq_gemm). The layout is
  prepared once: if g_idx is the plain i // group_size the kernel is told so (it skips g_idx); with act-order
  (desc_act) the input rows of qweight are sorted by group, g_idx becomes plain, and x's columns are permuted
  by the same order at run time (`act_perm`); with plain groups the rows are then interleaved inside blocks of
  one K step (`gptq_interleave`, see kernels.packing.field_rows) so that the kernels read x contiguously field
  by field. Nothing is ever repacked on disk.
"""

from __future__ import annotations

import logging
import math

import torch

from ..errors import ModelLoadError
from .. import kernels
from ..kernels import cpu_gemm, gptq_configs
from . import packing
from .config import GPTQConfig

log = logging.getLogger("infer")

_REQUIRED = ("qweight", "qzeros", "scales")
_NAMES = ("qweight", "qzeros", "scales", "g_idx")


_FP16 = torch.finfo(torch.float16)


def _check_scales(full: str, t: torch.Tensor) -> None:
    """Scales of another float type than the float16 a GPTQ layer holds them in (an AWQ or GPTQ checkpoint saved
    from a bfloat16 model has bfloat16 scales): beyond float16's range they would be inf (every output of the layer
    inf or NaN), so they are refused naming the tensor; scales below float16's normal range (6.1e-05) keep fewer bits
    there, or none (a float32 scale below 3e-08 becomes 0), which a warning says, counting them. Other bfloat16
    scales convert exactly; float32 ones round to float16's 11 bits, as GPTQModel's and vLLM's float16 layers round
    them."""
    if t.is_meta or t.dtype == torch.float16 or not t.is_floating_point() or t.numel() == 0:
        return
    largest = t.detach().abs().max().float().item()
    if not math.isfinite(largest):  # (a CPU load refuses it before, as every tensor: loader._check_finite)
        raise ModelLoadError(f"{full} has non-finite values (inf or NaN)",
                             "the checkpoint is broken: download or convert it again")
    if largest > _FP16.max:
        raise ModelLoadError(f"{full} holds scales up to {largest:.3g}, beyond float16's range ({_FP16.max:.5g}), "
                             f"which infer's int4 layers hold scales in ({str(t.dtype).removeprefix('torch.')} in the "
                             "checkpoint)", "infer cannot run this layer's scales exactly; use a checkpoint quantized "
                             "with float16 scales")
    half = t.detach().to(torch.float16)
    if t.dtype == torch.bfloat16:  # (its normal values convert exactly: those that change are below the range)
        inexact = int((half.to(t.dtype) != t).sum())
    else:  # float32 (or float64): its normal values round as any cast rounds them; count those below the range
        inexact = int(((t != 0) & (t.detach().abs() < _FP16.tiny)).sum())
    if inexact:
        zeroed = int(((half == 0) & (t != 0)).sum())
        kind = str(t.dtype).removeprefix("torch.")
        log.warning(f"{full}: {inexact} {kind} scale{'s' if inexact > 1 else ''} below float16's normal range "
                    f"({_FP16.tiny:.3g}) lose bits in the float16 scales infer's int4 layers hold"
                    + (f", {zeroed} of them becoming 0 (their groups' weights 0)" if zeroed else "")
                    + ": whatever --dtype, as in GPTQModel's and vLLM's float16 layers (their weights move by at "
                    "most 3e-08 per quantization step; where that matters, run the float checkpoint)")


class GPTQLinearMethod:
    def __init__(self, config: GPTQConfig, use_kernel: bool | None = None):
        self.config = config
        self.use_kernel = use_kernel  # None: the kernel on CUDA, the dequantized float weight on CPU

    def _group_size(self, in_features: int) -> int:
        return in_features if self.config.group_size == -1 else self.config.group_size

    def create_weights(self, layer) -> None:
        c, k, n = self.config, layer.in_features, layer.out_features
        if not all(self.packs(k, size) for size in layer.out_sizes):  # name the projection(s) that do not
            bad = [f"{name} (input {k})" for name in layer.names[:1] if k % c.pack] + \
                [f"{name} (output {size})" for name, size in zip(layer.names, layer.out_sizes) if size % c.pack]
            raise ModelLoadError(f"{', '.join(bad)}: the width does not pack into int32 words of {c.pack} {c.bits}-bit "
                                 "values", "this layer cannot be a GPTQ layer (vLLM refuses it too)")
        groups = c.num_groups(k)
        layer.register_buffer("qweight", torch.zeros(k // c.pack, n, dtype=torch.int32))
        layer.register_buffer("qzeros", torch.zeros(groups, n // c.pack, dtype=torch.int32))
        layer.register_buffer("scales", torch.zeros(groups, n, dtype=torch.float16))
        # (trunc, not //: the same for these indices, and // on the meta device (loader.check_weights) goes through
        # torch's decompositions, milliseconds a layer and seconds to import)
        layer.register_buffer("g_idx", torch.div(torch.arange(k), self._group_size(k), rounding_mode="trunc").int())
        layer.register_buffer("weight", None)  # the dequantized float weight (dequantized mode)
        layer.register_buffer("packed_weight", None)
        layer.register_buffer("act_perm", None)  # kernel mode with act-order: x's columns in sorted-group order
        layer.gptq_group_size = None  # kernel mode: the group size promised to the kernel (g_idx is plain)
        layer.gptq_interleave = 1  # kernel mode: words per interleaved block of qweight (1: GPTQ order)
        layer.gptq_ready = False

    def output_packing(self, name: str) -> int:
        """Output columns per stored column of tensor `name` (qzeros packs `pack` zero points a word)."""
        return self.config.pack if name == "qzeros" else 1

    def _expected(self, layer, name: str, shard: int) -> tuple[int, ...]:
        return self.expected_shapes(layer.in_features, layer.out_sizes[shard])[name]

    def expected_shapes(self, k: int, n: int) -> dict[str, tuple[int, ...]]:
        """The shape of each checkpoint tensor (qweight, qzeros, scales, g_idx) of a layer of k inputs and n outputs
        (models.moe checks a mixture of experts' thousands of them against it in bulk)."""
        c = self.config
        groups = c.num_groups(k)
        return {"qweight": (k // c.pack, n), "qzeros": (groups, n // c.pack), "scales": (groups, n), "g_idx": (k,)}

    def packs(self, k: int, n: int) -> bool:
        """Whether a layer of k inputs and n outputs packs into int32 words (else create_weights refuses it)."""
        return k % self.config.pack == 0 and n % self.config.pack == 0

    def load_shard(self, layer, name: str, shard: int, tensor: torch.Tensor) -> None:
        full = f"{layer.prefix_of(shard)}.{name}"
        if name not in _NAMES:
            raise ModelLoadError(f"unexpected tensor {full} in a GPTQ layer",
                                 f"the checkpoint does not match its quantization config ({self.config.source})")
        if layer.gptq_ready:
            raise ModelLoadError(f"{full} arrived after the layer was finished", "load every tensor first")
        expect = self._expected(layer, name, shard)
        if tuple(tensor.shape) != expect:
            raise ModelLoadError(f"{full} has shape {tuple(tensor.shape)} but {self.config.source} implies {expect}",
                                 f"the checkpoint does not match its quantization config ({self.config.source}: "
                                 f"bits {self.config.bits}, group_size {self.config.group_size})")
        if name == "g_idx":
            self._load_g_idx(layer, shard, tensor, full)
            return
        start = layer.shard_offset(shard)
        if name == "qzeros":
            start //= self.config.pack
            if self.config.zeros_v1 and not tensor.is_meta:  # a zero of 0 borrowed from its neighbour in the
                # file's word (values only: loader.check_weights' meta tensors have none, and torch's meta kernels
                # of the conversion's ops cost milliseconds a tensor)
                tensor = packing.v1_words_to_fields(tensor, self.config.bits)
        buf = getattr(layer, name)
        buf[:, start:start + tensor.shape[1]].copy_(tensor)

    def check_stored(self, full: str, name: str, tensor: torch.Tensor) -> None:
        """A checkpoint tensor's values, once as the checkpoint stores it (MergedLinear: a fused module's scales as
        one tensor, not each shard's part): scales of another float type than float16 (_check_scales)."""
        if name == "scales":
            _check_scales(full, tensor)

    def _load_g_idx(self, layer, shard: int, tensor: torch.Tensor, full: str) -> None:
        others = sorted(s for s, n in layer.loaded_names() if n == "g_idx" and s != shard)
        if tensor.is_meta or layer.g_idx.is_meta:  # (loader.check_weights: shapes only, no values to compare)
            return
        if others and not torch.equal(layer.g_idx, tensor.to(layer.g_idx.device, layer.g_idx.dtype)):
            raise ModelLoadError(f"{full} differs from {layer.prefix_of(others[0])}.g_idx",
                                 "shards that infer merges into one matmul must share their act-order")
        layer.g_idx.copy_(tensor)

    def finish_loading(self, layer) -> None:
        if layer.gptq_ready:
            return
        self.check_complete(layer)
        use_kernel = self.use_kernel if self.use_kernel is not None else layer.qweight.device.type == "cuda"
        if use_kernel:
            self._prepare_kernel_layout(layer)
        else:
            layer.weight = self.dequantized_weight(layer)
            if not getattr(layer, "absorbed", False):  # (MLA's kv_b_proj: its weight read, never multiplied)
                layer.packed_weight = cpu_gemm.prepack(layer.weight)
        layer.gptq_ready = True

    def check_complete(self, layer) -> None:
        """Every shard's qweight, qzeros and scales in (and g_idx in all or none, and where desc_act needs it);
        g_idx's groups checked where its values are read (not on the meta device: loader.check_weights)."""
        groups = layer.scales.shape[0]
        self.check_loaded([layer.prefix_of(s) for s in range(len(layer.names))], layer.loaded_names(), groups)
        if not layer.g_idx.is_meta and (int(layer.g_idx.min()) < 0 or int(layer.g_idx.max()) >= groups):
            raise ModelLoadError(f"{layer.prefix_of(0)}.g_idx points outside its {groups} groups",
                                 "the checkpoint does not match its quantization_config (group_size)")

    def check_loaded(self, prefixes: list[str], loaded: set[tuple[int, str]], groups: int) -> None:
        """check_complete of a layer whose shards' checkpoint modules are `prefixes`, of `groups` groups, that had
        the tensors `loaded` ((shard, name)): also models.moe's bulk check of a GPTQ expert's tensors, no layer
        built."""
        for shard, prefix in enumerate(prefixes):
            for name in _REQUIRED:
                if (shard, name) not in loaded:
                    raise ModelLoadError(f"the checkpoint has no tensor {prefix}.{name}",
                                         "the GPTQ checkpoint is incomplete")
        with_g = [s for s in range(len(prefixes)) if (s, "g_idx") in loaded]
        if with_g and len(with_g) < len(prefixes):
            missing = next(s for s in range(len(prefixes)) if s not in with_g)
            raise ModelLoadError(f"the checkpoint has no tensor {prefixes[missing]}.g_idx but has "
                                 f"{prefixes[with_g[0]]}.g_idx", "the GPTQ checkpoint is incomplete")
        if not with_g and self.config.desc_act and groups > 1:  # act-order groups are known only from g_idx
            raise ModelLoadError(f"the checkpoint has no tensor {prefixes[0]}.g_idx but {self.config.source} "
                                 "sets desc_act (act-order groups)", "the GPTQ checkpoint is incomplete: without "
                                 "g_idx the groups of an act-order layer cannot be known")

    def _prepare_kernel_layout(self, layer) -> None:
        """Make g_idx plain (i // group_size) when it is a permutation of a plain grouping, then interleave the
        rows for the kernels; one sync, at load."""
        k, gs = layer.in_features, self._group_size(layer.in_features)
        plain = (torch.arange(k, device=layer.g_idx.device) // gs).to(layer.g_idx.dtype)
        if not torch.equal(layer.g_idx, plain):
            perm = torch.argsort(layer.g_idx, stable=True)
            if not torch.equal(layer.g_idx[perm], plain):
                return  # an irregular grouping: the kernel reads g_idx row by row
            q = packing.unpack_rows(layer.qweight, self.config.bits).index_select(0, perm)
            layer.qweight = packing.pack_rows(q, self.config.bits)
            layer.g_idx = plain
            layer.act_perm = perm
        layer.gptq_group_size = gs
        layer.gptq_interleave = gptq_configs.interleave_for(gs, k, self.config.pack)
        layer.qweight = packing.interleave_rows(layer.qweight, self.config.bits, layer.gptq_interleave)

    def fuses_lora(self, layer) -> bool:
        """The int4 kernels add a LoRADelta in their epilogue (`apply(..., lora=)`); the dequantized CPU path does
        not."""
        return layer.weight is None

    def fuses_act(self, layer) -> bool:
        """`apply(..., gated=True / "gelu_tanh")` can leave the activation-and-multiply of a gate|up layer (SiLU, or
        Gemma's GeGLU) to the int4 kernel's epilogue (the kernel path); the dequantized CPU path applies it after
        its matmul."""
        return layer.weight is None

    def kernel_key(self, layer) -> tuple:
        """What the int4 kernel choice for a row count depends on: layers with equal keys choose alike."""
        return tuple(layer.qweight.shape), self.config.bits, layer.gptq_group_size, layer.gptq_interleave

    def lora_in_epilogue(self, layer, m: int, lora) -> bool:
        """Whether `apply(layer, x of m rows, lora=lora)` adds the LoRADelta in its int4 kernel's epilogue (else it
        launches the expand itself)."""
        from ..kernels import gptq_gemm
        k, n = layer.qweight.shape[0] * (32 // self.config.bits), layer.qweight.shape[1]
        return gptq_gemm.lora_in_epilogue(m, n, k, self.config.bits, layer.gptq_group_size, layer.gptq_interleave,
                                          lora, layer.qweight.device)

    def apply(self, layer, x: torch.Tensor, lora=None, gated: bool | str = False, act: str | None = None,
              act_scalars=None) -> torch.Tensor:
        """y = x W^T + b; with `lora` (a kernels.lora_reference.LoRADelta of x, kernel path only) plus the
        adapters' delta, which the int4 kernel adds in its epilogue with the bias. gated (a gate|up layer: True or
        "silu", or "gelu_tanh"): silu_and_mul(y) (gelu_tanh_and_mul(y)), which the int4 kernel applies in its
        epilogue where it can (`gptq_gemm.gated_fits`). act (an MLP without gate's up projection: "gelu_tanh",
        "relu2", "xielu" of act_scalars): kernels.ungated_act(y), which the int4 kernel applies in its epilogue."""
        if layer.weight is not None:
            y = cpu_gemm.linear(x, layer.weight, layer.bias, layer.packed_weight)
            if act:
                return kernels.ungated_act(y, act, act_scalars)
            if not gated:
                return y
            return kernels.gelu_tanh_and_mul(y) if gated == "gelu_tanh" else kernels.silu_and_mul(y)
        if layer.act_perm is not None:
            x = x.index_select(-1, layer.act_perm)
        return kernels.gptq_matmul(x, layer.qweight, layer.qzeros, layer.scales, layer.g_idx, self.config.bits,
                                   self.config.zeros_v1, layer.gptq_group_size, layer.gptq_interleave,
                                   bias=layer.bias, lora=lora, gated=gated, act=act, act_scalars=act_scalars)

    def dequantized_weight(self, layer) -> torch.Tensor:
        """The float weight [out, in] in the checkpoint's input order (whatever layout the kernel uses)."""
        if layer.weight is not None:
            return layer.weight
        qweight = packing.deinterleave_rows(layer.qweight, self.config.bits, layer.gptq_interleave)
        w = packing.dequantize(qweight, layer.qzeros, layer.scales, layer.g_idx, self.config.bits,
                               self.config.zeros_v1, layer.dtype)
        if layer.act_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, layer.act_perm] = w
        return out
