"""GPTQ settings of a checkpoint: `quantization_config` in config.json or quantize_config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
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

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def zeros_v1(self) -> bool:
        return self.checkpoint_format != "gptq_v2"

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "GPTQConfig":
        method = str(d.get("quant_method", "gptq")).lower()
        if method != "gptq":
            raise UnsupportedModelError(f"{source}: quant_method {method!r} is not supported",
                                        "infer runs GPTQ checkpoints (quant_method 'gptq') and float models")
        bits = int(d.get("bits", 4))
        if bits not in SUPPORTED_BITS:
            raise UnsupportedModelError(f"{source}: {bits}-bit GPTQ is not supported",
                                        "only 4-bit and 8-bit GPTQ are supported")
        group = int(d.get("group_size", 128))
        if group != -1 and group < 1:
            raise UnsupportedModelError(f"{source}: group_size {group} is not valid",
                                        "use -1 (one group per column) or a positive size such as 32, 64 or 128")
        fmt = str(d.get("checkpoint_format") or d.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"{source}: checkpoint format {fmt!r} is not supported",
                                        "supported: gptq (v1 zero points) and gptq_v2")
        if d.get("lm_head"):
            raise UnsupportedModelError(f"{source}: a quantized lm_head is not supported",
                                        "quantize with lm_head=False")
        if d.get("dynamic"):  # GPTQModel's per-module overrides: other bits or group sizes, or modules left in float
            raise UnsupportedModelError(f"{source}: per-module quantization settings (dynamic: "
                                        f"{json.dumps(d['dynamic'])[:120]}) are not supported",
                                        "quantize every module with the same settings (no dynamic in QuantizeConfig)")
        return cls(bits, group, bool(d.get("desc_act", False)), bool(d.get("sym", True)), fmt)

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
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": self.checkpoint_format, "lm_head": self.lm_head,
                "pack_dtype": "int32"}
