"""GPTQ settings of a checkpoint: `quantization_config` in config.json or quantize_config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelLoadError, UnsupportedModelError

SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class GPTQConfig:
    bits: int = 4
    group_size: int = 128  # -1: one group over the whole input
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"  # "gptq" = v1 zero points (stored zero - 1), "gptq_v2" = zero as is
    lm_head: bool = False
    quant_method: str = "gptq"
    # transformers/optimum's list of module-name suffixes inside each decoder layer that are quantized (the others
    # stay float); None: every linear of a decoder layer is
    modules_in_block_to_quantize: tuple[str, ...] | None = None
    source: str = field(default="config.json", compare=False)  # the file it was read from, for messages

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def zeros_v1(self) -> bool:
        return self.checkpoint_format != "gptq_v2"

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def quantizes(self, module: str) -> bool:
        """Whether the decoder-layer linear `module` (its HF path) is a GPTQ layer; as optimum matches it, by the end
        of its name."""
        return self.modules_in_block_to_quantize is None or module.endswith(self.modules_in_block_to_quantize)

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "GPTQConfig":
        bnb = d.get("load_in_4bit") or d.get("load_in_8bit")  # bitsandbytes configs older than quant_method
        method = str(d.get("quant_method") or ("bitsandbytes" if bnb else "gptq")).lower()
        if method != "gptq":
            raise UnsupportedModelError(f"{source}: quant_method {method!r} is not supported",
                                        "infer runs GPTQ checkpoints (quant_method 'gptq') and float models")
        bits = _int(d, "bits", 4, source)
        if bits not in SUPPORTED_BITS:
            raise UnsupportedModelError(f"{source}: {bits}-bit GPTQ is not supported",
                                        "only 4-bit and 8-bit GPTQ are supported")
        group = _int(d, "group_size", 128, source)
        if group != -1 and group < 1:
            raise UnsupportedModelError(f"{source}: group_size {group} is not valid",
                                        "use -1 (one group per column) or a positive size such as 32, 64 or 128")
        fmt = str(d.get("checkpoint_format") or d.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"{source}: checkpoint format {fmt!r} is not supported",
                                        "supported: gptq (v1 zero points) and gptq_v2")
        if d.get("is_marlin_format"):  # AutoGPTQ's flag for weights repacked for the Marlin kernel
            raise UnsupportedModelError(f"{source}: is_marlin_format is true (weights in the Marlin kernel's layout)",
                                        "use the checkpoint in the plain GPTQ format (checkpoint_format gptq)")
        pack_dtype = str(d.get("pack_dtype") or "int32").lower().removeprefix("torch.")
        if pack_dtype != "int32":  # GPTQModel can pack into int8/int16/int64 words
            raise UnsupportedModelError(f"{source}: pack_dtype {pack_dtype!r} is not supported",
                                        "infer reads GPTQ weights packed into int32 words (pack_dtype int32)")
        if d.get("lm_head"):
            raise UnsupportedModelError(f"{source}: a quantized lm_head is not supported",
                                        "quantize with lm_head=False")
        if d.get("dynamic"):  # GPTQModel's per-module overrides: other bits or group sizes, or modules left in float
            raise UnsupportedModelError(f"{source}: per-module quantization settings (dynamic: "
                                        f"{json.dumps(d['dynamic'])[:120]}) are not supported",
                                        "quantize every module with the same settings (no dynamic in QuantizeConfig)")
        return cls(bits, group, bool(d.get("desc_act", False)), bool(d.get("sym", True)), fmt,
                   modules_in_block_to_quantize=_module_suffixes(d.get("modules_in_block_to_quantize"), source),
                   source=Path(source).name)

    @classmethod
    def from_model_dir(cls, path: Path) -> "GPTQConfig | None":
        """The folder's GPTQ config; None for a float model. config.json's quantization_config wins."""
        for name, key in (("config.json", "quantization_config"), ("quantize_config.json", None)):
            f = Path(path) / name
            if not f.is_file():
                continue
            try:
                d = json.loads(f.read_text())
            except ValueError as e:
                raise ModelLoadError(f"{f} is not valid JSON: {e}") from e
            d = d.get(key) if key else d
            if d:
                return cls.from_dict(d, str(f))
        return None

    def to_dict(self) -> dict:
        d = {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
             "sym": self.sym, "checkpoint_format": self.checkpoint_format, "lm_head": self.lm_head,
             "pack_dtype": "int32"}
        if self.modules_in_block_to_quantize is not None:
            d["modules_in_block_to_quantize"] = [list(self.modules_in_block_to_quantize)]
        return d


def _int(d: dict, key: str, default: int, source: str) -> int:
    value = d.get(key, default)
    try:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{source}: {key} {json.dumps(value)} is not an integer",
                             "the quantization config is damaged; GPTQ checkpoints give e.g. bits 4, group_size 128") \
            from None


def _module_suffixes(value, source: str) -> tuple[str, ...] | None:
    """modules_in_block_to_quantize (a list of lists of names, as transformers' GPTQConfig takes it) as one tuple."""
    if value is None:
        return None
    if not (isinstance(value, list) and all(isinstance(g, list) and all(isinstance(n, str) and n for n in g)
                                            for g in value)):
        raise ModelLoadError(f"{source}: modules_in_block_to_quantize {json.dumps(value)[:120]} is not a list of lists "
                             f"of module names", 'e.g. [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]]')
    return tuple(n for g in value for n in g)
