"""Block-scaled FP8 checkpoints: transformers' FineGrainedFP8Config (config.json's quantization_config quant_method
"fp8"), the format of DeepSeek-V3/R1, Qwen3's -FP8 releases, MiniMax-M2 and GLM-4.5-FP8 on the hub.

Each quantized linear weight is stored float8_e4m3fn beside `weight_scale_inv`, a float32 scale per block of
`weight_block_size` (rows, columns) of it (partial blocks at the edges, as vLLM reads them; one scale for the whole
tensor where the config gives no block size); the weight is fp8 x its block's scale. The other tensors (embeddings,
norms, routers, often the output head) are stored in the model's dtype. infer has no FP8 matmul: the loader
dequantizes each weight once, in float32, and rounds it to the model's dtype (as transformers' dequantize=True does),
so the engine runs the float model, on a CPU and a GPU. Activation scales (`activation_scale`, `input_scale`: the
"static" activation scheme) are read by nothing, as in transformers' dequantized model.
"""

from __future__ import annotations

import json
from typing import Iterator

import torch

from ..errors import ModelLoadError, UnsupportedModelError

SCALE = ".weight_scale_inv"
ACTIVATION_SCALES = (".activation_scale", ".input_scale")
_FP8_CODES = ("F8_E4M3",)  # safetensors' name of float8_e4m3fn


def fp8_config(config: dict) -> dict | None:
    """config.json's (a dict's) quantization_config where it is an FP8 one (quant_method "fp8"), else None."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "fp8":
        return qc
    return None


def fp8_model(model_config) -> dict | None:
    """fp8_config of a loaded config (transformers' config object: its quantization_config a dict, an object or
    none)."""
    qc = getattr(model_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return fp8_config({"quantization_config": qc})


def block_size(qc: dict, source: str) -> tuple[int, int] | None:
    """The (rows, columns) of a scale's block (None: one scale per tensor); UnsupportedModelError for an FP8 format
    other than e4m3 or a block size that is not two positive integers, naming the field."""
    fmt = str(qc.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        raise UnsupportedModelError(f"{source}: FP8 fmt {json.dumps(qc.get('fmt'))} is not supported",
                                    "infer reads FP8 checkpoints of float8_e4m3fn weights (fmt \"e4m3\"), as "
                                    "transformers' FineGrainedFP8Config writes them")
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                                and b > 0 for b in block)):
        raise UnsupportedModelError(f"{source}: FP8 weight_block_size {json.dumps(block)} is not two positive "
                                    "integers", "the quantization config is damaged; FP8 checkpoints give e.g. "
                                    "\"weight_block_size\": [128, 128]")
    return block[0], block[1]


def scale_grid(shape, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The shape of a weight's scales: its leading dimensions, then a scale per block of its last two (one where
    `block` is None)."""
    *lead, rows, cols = shape
    if block is None:
        return tuple(lead) + (1, 1) if lead else ()
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """weight (float8_e4m3fn, [..., rows, cols]) x its blocks' scales, in float32. Scales stored as E8M0 exponents
    (uint8 bytes, as transformers reads them, or float8_e8m0fnu) are 2 ** (byte - 127)."""
    w = weight.to(torch.float32)
    s = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
    if block is None or s.numel() == 1:
        return w * s.reshape(-1)[0] if s.numel() == 1 else w * s
    rows, cols = w.shape[-2:]
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return w * s


def dequantized(entries: Iterator, block: tuple[int, int] | None, source: str,
                done: set[str] | None = None) -> Iterator:
    """The loader's (name, tensor) entries, or check_weights' (name, (safetensors dtype, shape)) header entries,
    with each FP8 weight and its scale replaced by the dequantized weight (a float32 tensor; a ("F32", shape)
    entry) and activation scales dropped. A weight waits for its scale (and a scale for its weight) wherever the
    files put them. ModelLoadError for an FP8 weight without its scale, a scale without its weight, or a scale of
    the wrong shape, naming the tensor. `done`: where given, the names of the weights dequantized are added."""
    weights: dict[str, object] = {}  # module -> its FP8 weight, waiting for its scale
    scales: dict[str, object] = {}  # module -> its scale, waiting for its weight
    for name, t in entries:
        if name.endswith(ACTIVATION_SCALES):
            continue
        if name.endswith(SCALE):
            module = name[: -len(SCALE)]
            if module in weights:
                if done is not None:
                    done.add(f"{module}.weight")
                yield f"{module}.weight", _pair(module, weights.pop(module), t, block, source)
            else:
                scales[module] = t
            continue
        if name.endswith(".weight") and _is_fp8(t):
            module = name[: -len(".weight")]
            if module in scales:
                if done is not None:
                    done.add(name)
                yield name, _pair(module, t, scales.pop(module), block, source)
            else:
                weights[module] = t
            continue
        yield name, t
    if weights:
        first = next(iter(weights))
        raise ModelLoadError(f"{source}: {first}.weight is FP8 but the checkpoint has no {first}{SCALE}"
                             + (f" (and {len(weights) - 1} more weights)" if len(weights) > 1 else ""),
                             "the checkpoint is incomplete; copy or download it again")
    if scales:
        first = next(iter(scales))
        raise ModelLoadError(f"{source}: {first}{SCALE} scales no FP8 weight (the checkpoint has no {first}.weight "
                             "in float8_e4m3fn)", "the checkpoint is damaged; copy or download it again")


def _is_fp8(t) -> bool:
    if isinstance(t, torch.Tensor):
        return t.dtype == torch.float8_e4m3fn
    return isinstance(t, tuple) and t[0] in _FP8_CODES


def _pair(module: str, weight, scale, block: tuple[int, int] | None, source: str):
    """The dequantized weight of one (weight, scale) pair: a float32 tensor, or ("F32", shape) from headers."""
    wshape = list(weight.shape) if isinstance(weight, torch.Tensor) else list(weight[1])
    sshape = list(scale.shape) if isinstance(scale, torch.Tensor) else list(scale[1])
    want = list(scale_grid(wshape, block))
    numel = 1
    for d in sshape:
        numel *= d
    if sshape != want and not (block is None and numel == 1):
        raise ModelLoadError(f"{source}: {module}{SCALE} has shape {tuple(sshape)}, but {module}.weight "
                             f"{tuple(wshape)} in blocks of {list(block) if block else 'the whole tensor'} "
                             f"(weight_block_size) takes {tuple(want)}",
                             "the scales do not match the weights or config.json's weight_block_size")
    if not isinstance(weight, torch.Tensor):
        return "F32", wshape
    if weight.device.type == "meta":
        return torch.empty(wshape, dtype=torch.float32, device="meta")
    return dequantize(weight, scale, block)
