"""GPTQ settings of a checkpoint: `quantization_config` in config.json or quantize_config.json."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ModelLoadError, UnsupportedModelError

SUPPORTED_BITS = (4, 8)
_BITS_HINT = ("only 4-bit and 8-bit GPTQ are supported: use the model's 4-bit (or 8-bit) GPTQ release, or its float "
              "weights (`infer quantize FLOAT_MODEL -o OUT --bits 4` makes a 4-bit checkpoint of them)")


def ffn_width(cfg) -> int:
    """LFM2's MLP width as transformers' Lfm2MLP computes it (models.lfm2's MLP; here, below models, because
    quantize checks the widths of a checkpoint's projections by it too): intermediate_size, or where
    block_auto_adjust_ff_dim two thirds of it (int), times block_ffn_dim_multiplier and rounded up to a multiple of
    block_multiple_of where that multiplier is set (not rounded where it is null). `cfg`: a config, or config.json's
    fields (a namespace: Lfm2Config's defaults where one is missing). LFM2-MoE's dense MLPs: intermediate_size
    itself."""
    width = int(cfg.intermediate_size)
    if getattr(cfg, "model_type", "lfm2") == "lfm2" and getattr(cfg, "block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = getattr(cfg, "block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            width = int(multiplier * width)
            step = int(getattr(cfg, "block_multiple_of", 256))
            width = step * ((width + step - 1) // step)
    return width


def mxfp4_gpt_oss(config: dict) -> bool:
    """Whether config.json (a dict) is a gpt-oss with MXFP4 experts (the hub's gpt-oss-20b / 120b): infer keeps
    them packed as stored (models.moe's Mxfp4Experts: the fused MoE dequantizes them in registers, the CPU's
    reference one expert at a time), every other layer float (its GPTQ configs none)."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return config.get("model_type") == "gpt_oss" and isinstance(qc, dict) and \
        str(qc.get("quant_method", "")).lower() == "mxfp4"


def mxfp4_model(model_config) -> bool:
    """`mxfp4_gpt_oss` of a loaded config (transformers' config object, its quantization_config a dict, an object
    or none)."""
    qc = getattr(model_config, "quantization_config", None)
    return mxfp4_gpt_oss({"model_type": getattr(model_config, "model_type", None),
                          "quantization_config": qc if isinstance(qc, dict) or qc is None else vars(qc)})


def _fp8(config: dict) -> bool:
    from .fp8 import fp8_config
    return fp8_config(config) is not None


def hf_load_options(model_dir) -> dict:
    """transformers' from_pretrained options that load the model in `model_dir` as infer computes it: the hub's
    gpt-oss MXFP4 experts dequantized (Mxfp4Config(dequantize=True): the same values infer's packed experts
    compute with; transformers otherwise fetches its MXFP4 kernels from the hub, and fails without them), a
    block-scaled FP8 checkpoint's weights dequantized (FineGrainedFP8Config(dequantize=True), as infer's loader
    does, quant.fp8; on a GPU transformers would otherwise run its FP8 kernels); {} for any other model (or an
    unreadable config.json: transformers says)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if _fp8(config):  # (a block-scaled FP8 checkpoint: dequantized at load, as infer's loader does, quant.fp8)
        from transformers import FineGrainedFP8Config
        qc = config["quantization_config"]
        return {"quantization_config": FineGrainedFP8Config(
            weight_block_size=tuple(qc["weight_block_size"]) if qc.get("weight_block_size") else None,
            dequantize=True)}
    if not mxfp4_gpt_oss(config):
        return {}
    from transformers import Mxfp4Config
    return {"quantization_config": Mxfp4Config(dequantize=True)}


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
    # GPTQModel's per-module overrides, in order: (regex as written, left in float, its (key, value) overrides); the
    # first regex that matches the start of a module's name decides, as GPTQModel and vLLM read `dynamic`
    dynamic: tuple[tuple[str, bool, tuple[tuple[str, object], ...]], ...] = ()
    # (prefix, prefix the checkpoint may store in its place): the names `dynamic` rules are matched against besides
    # the module's own (a multimodal checkpoint's language model, models.multimodal.quant_config)
    aliases: tuple[tuple[str, str], ...] = field(default=(), compare=False)
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
        of its name, and GPTQModel by its `dynamic` rules (`-:` leaves a module in float)."""
        return self.for_module(module) is not None

    def for_module(self, module: str) -> "GPTQConfig | None":
        """The settings of the decoder-layer linear `module` (its HF path, e.g. model.layers.0.mlp.down_proj) with
        its `dynamic` overrides applied; None where it is left in float."""
        if self.modules_in_block_to_quantize is not None and not module.endswith(self.modules_in_block_to_quantize):
            return None
        rule = self.rule_for(module)
        if rule is None:
            return self
        _, negative, overrides = rule
        return None if negative else replace(self, **dict(overrides))

    def rule_for(self, module: str) -> "tuple[str, bool, tuple] | None":
        """The `dynamic` rule (pattern as written, negative, overrides) that decides `module`: the first whose regex
        matches the start of its name; None where none does."""
        names = [module] + [alias + module[len(prefix):] for prefix, alias in self.aliases if module.startswith(prefix)]
        return next((rule for rule in self.dynamic
                     if any(re.match(rule[0].removeprefix("-:").removeprefix("+:"), n) for n in names)), None)

    def why(self, module: str) -> str:
        """What in this config decides `module`'s settings, for messages: the modules_in_block_to_quantize that
        leaves it out, its `dynamic` rule, or the config's own settings."""
        if self.modules_in_block_to_quantize is not None and not module.endswith(self.modules_in_block_to_quantize):
            return f"{self.source}'s modules_in_block_to_quantize leaves it out"
        rule = self.rule_for(module)
        if rule is None:
            return f"{self.source}'s settings, no dynamic rule matches it"
        pattern, negative, overrides = rule
        return f"{self.source}'s dynamic rule {pattern!r}" + (" leaves it in float" if negative else
                                                               f" sets {json.dumps(dict(overrides))}")

    def for_head(self) -> "GPTQConfig | None":
        """The output head's settings: None unless `lm_head` (GPTQModel's lm_head=True) quantizes it, with the
        `dynamic` rule that matches "lm_head" applied (GPTQModel 7 writes {"lm_head": {"bits": 8, ...}} by
        default). modules_in_block_to_quantize names decoder-layer modules only: it does not apply."""
        if not self.lm_head:
            return None
        rule = self.rule_for("lm_head")
        if rule is None:
            return self
        _, negative, overrides = rule
        return None if negative else replace(self, **dict(overrides))

    def settings(self) -> tuple:
        """What a layer's tensors are read with (shards merged into one matmul must agree on it)."""
        return self.bits, self.group_size, self.desc_act, self.sym

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "GPTQConfig":
        bnb = d.get("load_in_4bit") or d.get("load_in_8bit")  # bitsandbytes configs older than quant_method
        # GPTQModel reads `method` (quant_method is its deprecated alias), transformers quant_method: neither may
        # name another method
        named = [(k, str(d[k]).lower()) for k in ("quant_method", "method") if d.get(k)] or \
            [("quant_method", "bitsandbytes" if bnb else "gptq")]
        key, method = next(((k, m) for k, m in named if m != "gptq"), named[0])
        if method == "awq" and all(m == "awq" for _, m in named):
            return _from_awq(d, source)
        if method != "gptq":
            raise UnsupportedModelError(f"{source}: {key} {method!r} is not supported",
                                        "infer runs GPTQ checkpoints (quant_method 'gptq'), AWQ 'gemm' checkpoints "
                                        "and float models: use the model's GPTQ or AWQ release, or its float weights "
                                        "(`infer quantize` makes a GPTQ checkpoint of them)")
        bits = _int(d, "bits", 4, source)
        if bits not in SUPPORTED_BITS:
            raise UnsupportedModelError(f"{source}: {bits}-bit GPTQ is not supported",
                                        _BITS_HINT)
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
        return cls(bits, group, bool(d.get("desc_act", False)), bool(d.get("sym", True)), fmt, bool(d.get("lm_head")),
                   modules_in_block_to_quantize=_module_suffixes(d.get("modules_in_block_to_quantize"), source),
                   dynamic=_dynamic(d.get("dynamic"), d, bits, source), source=Path(source).name)

    @classmethod
    def from_model_dir(cls, path: Path) -> "GPTQConfig | None":
        """The folder's GPTQ config; None for a float model. config.json's quantization_config wins."""
        for name, key in (("config.json", "quantization_config"), ("quantize_config.json", None),
                          ("quant_config.json", None)):  # (AutoAWQ's older file, which vLLM reads too)
            f = Path(path) / name
            if not f.is_file():
                continue
            try:
                d = json.loads(f.read_text())
            except ValueError as e:
                raise ModelLoadError(f"{f} is not valid JSON: {e}") from e
            if key and (mxfp4_gpt_oss(d) or _fp8(d)):
                # (the experts float once loaded; an FP8 checkpoint's weights too, dequantized at load: quant.fp8;
                # the other files' GPTQ configs as for a float model)
                continue
            d = d.get(key) if key else d
            if d and name == "quant_config.json" and isinstance(d, dict) and not (d.get("quant_method") or
                                                                                  d.get("method")):
                d = {"quant_method": "awq", **d}  # AutoAWQ wrote its AwqConfig there without naming the method
            if d:
                return cls.from_dict(d, str(f))
        return None

    def to_dict(self) -> dict:
        """The GPTQ quantization_config of these settings (an AWQ checkpoint's: that of its GPTQ conversion)."""
        d = {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
             "sym": self.sym, "checkpoint_format": self.checkpoint_format, "lm_head": self.lm_head,
             "pack_dtype": "int32"}
        if self.modules_in_block_to_quantize is not None:
            d["modules_in_block_to_quantize"] = [list(self.modules_in_block_to_quantize)]
        if self.dynamic:
            d["dynamic"] = {pattern: dict(overrides) for pattern, _, overrides in self.dynamic}
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


# the `dynamic` override keys that change how a module's tensors are read; the others (damp_percent, mse, ...) only
# steered the solver
_DYNAMIC_KEYS = {"bits": int, "group_size": int, "desc_act": bool, "sym": bool}


def _dynamic(value, base: dict, bits: int, source: str) -> tuple:
    """GPTQModel's `dynamic` ({"-:regex": {}} leaves the matching modules in float, {"+:regex": {key: value}}
    overrides their settings) as GPTQConfig.dynamic; bits per module may differ (4 or 8: GPTQModel quantizes a
    quantized lm_head to 8 by default), another packing or format than `base`'s (the whole quantization config) is
    refused."""
    if not value:
        return ()
    hint = 'e.g. {"-:.*down_proj.*": {}, "+:.*o_proj.*": {"group_size": 64}}'
    if not isinstance(value, dict):
        raise ModelLoadError(f"{source}: dynamic {json.dumps(value)[:120]} is not a mapping of module patterns", hint)
    rules = []
    for pattern, overrides in value.items():
        try:
            re.compile(pattern.removeprefix("-:").removeprefix("+:"))
        except re.error as e:
            raise ModelLoadError(f"{source}: dynamic pattern {pattern!r} is not a valid regex: {e}", hint) from None
        if not isinstance(overrides, dict):
            raise ModelLoadError(f"{source}: dynamic {pattern!r}: {json.dumps(overrides)[:80]} is not a mapping", hint)
        negative = pattern.startswith("-:")
        kept = {}
        for key, kind in ({} if negative else _DYNAMIC_KEYS).items():
            if key in overrides:
                kept[key] = _int(overrides, key, 0, source) if kind is int else bool(overrides[key])
        for key in ("pack_dtype", "format", "checkpoint_format", "quant_method", "method"):
            same = base.get(key, "int32" if key == "pack_dtype" else None)
            if not negative and key in overrides and overrides[key] != same:
                raise UnsupportedModelError(f"{source}: dynamic {pattern!r} sets {key} {json.dumps(overrides[key])}",
                                            "infer reads one GPTQ format per model")
        if kept.get("bits", bits) not in SUPPORTED_BITS:  # each layer reads its own width (vLLM's dynamic too)
            raise UnsupportedModelError(f"{source}: dynamic {pattern!r} quantizes its modules to {kept['bits']} bits",
                                        _BITS_HINT)
        group = kept.get("group_size", -1)
        if group != -1 and group < 1:
            raise UnsupportedModelError(f"{source}: dynamic {pattern!r}: group_size {group} is not valid",
                                        "use -1 (one group per column) or a positive size such as 32, 64 or 128")
        rules.append((pattern, negative, tuple(sorted(kept.items()))))
    return tuple(rules)


_OTHERWISE = ("use the model's GPTQ release or its AWQ 'gemm' one, or quantize its float weights with "
              "`infer quantize`")
AWQ_VERSIONS = ("gemm",)  # the packing infer reads (AutoAWQ's default; vLLM's "awq" method reads it too)


def _from_awq(d: dict, source: str) -> GPTQConfig:
    """An AWQ quantization config (AutoAWQ's, transformers' AwqConfig, GPTQModel's) as the GPTQ settings of the same
    weights: asymmetric 4-bit, groups in input order (no act-order), checkpoint_format "gptq" (the v1 zero points
    quant/awq.py repacks AWQ's zeros into, as `infer convert --to gptq` writes them); quant_method "awq" says that
    the tensors are in AWQ's layout. Keys as vLLM reads them: bits or w_bit, group_size or q_group_size (-1: one
    group per column, as GPTQ's); modules_to_not_convert (module names: a linear whose name contains one stays
    float) become `dynamic` rules that leave them in float."""
    name = Path(source).name
    bits = _int(d, "w_bit" if "w_bit" in d else "bits", 4, source)
    if bits != 4:
        raise UnsupportedModelError(f"{source}: {bits}-bit AWQ is not supported (bits {bits})",
                                    f"infer reads 4-bit AWQ checkpoints (vLLM's awq method too); {_OTHERWISE}")
    group = _int(d, "q_group_size" if "q_group_size" in d else "group_size", 128, source)
    if group < 1 and group != -1:  # -1: one group per output column (AutoAWQ's WQLinear, vLLM's awq_marlin)
        raise UnsupportedModelError(f"{source}: AWQ group_size {group} is not supported",
                                    "infer reads AWQ checkpoints quantized in groups (e.g. group_size 128) or "
                                    f"per column (group_size -1); {_OTHERWISE}")
    version = str(d.get("version") or d.get("format") or "gemm").lower()
    if version not in AWQ_VERSIONS:
        key = "version" if d.get("version") else "format"
        raise UnsupportedModelError(f"{source}: AWQ {key} {version!r} is not supported",
                                    f"infer reads AWQ 'gemm' checkpoints (AutoAWQ's default packing); {_OTHERWISE}")
    backend = str(d.get("backend") or "autoawq").lower()
    if backend != "autoawq":  # llm-awq packs its weights otherwise
        raise UnsupportedModelError(f"{source}: AWQ backend {backend!r} is not supported",
                                    "infer reads AWQ checkpoints packed as AutoAWQ packs them (backend 'autoawq'); "
                                    f"{_OTHERWISE}")
    if d.get("zero_point", True) is not True:
        raise UnsupportedModelError(f"{source}: AWQ zero_point {json.dumps(d.get('zero_point'))} is not supported",
                                    "infer reads AWQ checkpoints with zero points (zero_point true, AutoAWQ's "
                                    f"default; vLLM refuses the others too); {_OTHERWISE}")
    pack_dtype = str(d.get("pack_dtype") or "int32").lower().removeprefix("torch.")
    if pack_dtype != "int32":
        raise UnsupportedModelError(f"{source}: AWQ pack_dtype {pack_dtype!r} is not supported",
                                    f"infer reads AWQ weights packed into int32 words; {_OTHERWISE}")
    skipped = d.get("modules_to_not_convert") or []
    if not (isinstance(skipped, list) and all(isinstance(n, str) and n for n in skipped)):
        raise ModelLoadError(f"{source}: modules_to_not_convert {json.dumps(skipped)[:120]} is not a list of module "
                             "names", 'e.g. ["mlp.gate"] (a linear whose name contains one is left in float)')
    dynamic = tuple((f"-:.*{re.escape(n)}", True, ()) for n in skipped)
    return GPTQConfig(4, group, False, False, "gptq", False, quant_method="awq", dynamic=dynamic, source=name)
