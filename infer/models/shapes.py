"""Attention shapes derived from a Hugging Face config once: heads, KV heads, head_dim, q and kv projection widths.

`head_dim` is the config's own when it has one (Qwen3 sets it apart from hidden_size / heads), else
hidden_size // num_attention_heads; `num_key_value_heads` defaults to the head count (no GQA).

Multi-head latent attention (DeepSeek-V2/V3's MLA: `MLA`, models.deepseek) is served as multi-query attention over
the compressed latent: one "KV head" of kv_lora_rank + qk_rope_head_dim dims a token, whose row is both its key and
its value (`latent`: the cache holds one copy, not K and V), queried by num_attention_heads latent queries as wide.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError, UnsupportedModelError
from ..quant.convert import CONFIG_HINT

# config.json's sizes every model has (transformers divides by the head count as it reads the config: a 0 there was
# "integer modulo by zero", a negative one a traceback building the layers) or leaves out (the context: transformers'
# default) but never sets to 0 (no transformers config reads a max_position_embeddings of 0 as unset: infer read it
# as absent, a context of 2048), and sizes it may leave out, null or 0 (unset: the head count for the KV heads,
# hidden_size / heads for head_dim, as transformers' `or` reads them)
_COUNTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
           "max_position_embeddings")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "sliding_window")


# the families of multi-head latent attention (models.deepseek.MLAttention)
MLA = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")


def is_mla(cfg) -> bool:
    """Whether the model's attention is multi-head latent attention (`MLA`: a latent KV cache of one copy)."""
    return getattr(cfg, "model_type", None) in MLA


@dataclass(frozen=True)
class ModelShapes:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    latent: bool = False  # MLA's latent cache: each row both key and value (one copy a token and layer, not two)

    @classmethod
    def from_config(cls, cfg) -> "ModelShapes":
        heads = cfg.num_attention_heads
        if is_mla(cfg):  # (the attention as the kernels see it: Hk 1, rows of the latent and the roped key)
            return cls(hidden_size=cfg.hidden_size, num_heads=heads, num_kv_heads=1,
                       head_dim=int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim), latent=True)
        return cls(hidden_size=cfg.hidden_size, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)

    @property
    def q_size(self) -> int:
        """Width of the query projection's output: num_heads * head_dim (not always hidden_size)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_copies(self) -> int:
        """The cache's tensors a layer keeps per token row: K and V (2), or MLA's latent row alone (1)."""
        return 1 if self.latent else 2


def check_shapes(cfg) -> None:
    """Refuse head counts no attention can compute (an UnsupportedModelError naming the config fields): query heads
    shared by groups of KV heads need num_attention_heads to be a multiple of num_key_value_heads (transformers'
    repeat_kv fails at the first forward; infer's kernels would read the wrong KV head)."""
    shapes = ModelShapes.from_config(cfg)
    if shapes.num_heads % shapes.num_kv_heads:
        raise UnsupportedModelError(f"config.json has num_attention_heads {shapes.num_heads}, not a multiple of "
                                    f"num_key_value_heads {shapes.num_kv_heads}",
                                    "each KV head serves the same number of query heads: use the config.json that "
                                    "came with the weights")


# Granite's scales (GraniteForCausalLM): each a finite number, the attention's scale above 0 (0 or below: NaN
# attention, in transformers' sdpa too) and the logits' divisor not 0 (every logit inf): every request failed with
# "the model overflowed (run it in bfloat16 or float32)" otherwise, a hint that could not help
_GRANITE_SCALES = {"embedding_multiplier": None, "residual_multiplier": None, "attention_multiplier": "above 0",
                   "logits_scaling": "not 0"}


def _check_granite_multipliers(raw: dict) -> None:
    if raw.get("model_type") not in ("granite", "granite_swa", "granitemoe", "granitemoeshared", "granitemoehybrid"):
        return
    for field, rule in _GRANITE_SCALES.items():
        value = raw.get(field)
        if type(value) not in (int, float):  # (absent: transformers' default; a string: transformers refuses it)
            continue
        if not math.isfinite(value) or (rule == "above 0" and value <= 0) or (rule == "not 0" and value == 0):
            raise ModelLoadError(f"config.json has {field} {value!r}: Granite's {field} must be a finite number"
                                 f"{' ' + rule if rule else ''}", CONFIG_HINT)


def _check_internlm3_biases(raw: dict) -> None:
    """InternLM3's qkv_bias (q, k and v's biases) and bias (o's and the MLP's in its remote code) unequal: transformers
    runs it as Llama (attention_bias on q, k, v and o; mlp_bias on the MLP) and refuses them apart, and so does infer
    (an UnsupportedModelError naming both)."""
    if raw.get("model_type") != "internlm3":
        return
    qkv, rest = raw.get("qkv_bias", raw.get("attention_bias", False)), raw.get("bias", raw.get("mlp_bias", False))
    if bool(qkv) != bool(rest):
        raise UnsupportedModelError(
            f"InternLM3's config.json has qkv_bias {json.dumps(qkv)} and bias {json.dumps(rest)}: infer (as "
            "transformers) runs InternLM3 as Llama, whose q, k, v and o biases and MLP biases are set together",
            "InternLM3 checkpoints (internlm3-8b-instruct) have both false: use the config.json that came with the "
            "weights")


def check_config_values(raw: dict) -> None:
    """Refuse, before transformers reads config.json (`raw`, its JSON object), the values no model has: a size that
    is not a whole number (a count below 1, an optional size below 0), an rms_norm_eps below 0 (every norm NaN), a
    quantization_config that is not an object and architectures that are not a list of names (a ModelLoadError
    naming the field)."""
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        # transformers keeps a string as it is and iterates its characters where it looks for a class by name
        example = json.dumps([archs] if isinstance(archs, str) else ["LlamaForCausalLM"])
        raise ModelLoadError(f"config.json's architectures must be a list of class names, got {json.dumps(archs)}",
                             f"{CONFIG_HINT} (write it as a list: \"architectures\": {example})")
    for field in _COUNTS + _OPTIONAL_SIZES:
        value, least = raw.get(field), 1 if field in _COUNTS else 0
        if value is not None and not (type(value) in (int, float) and math.isfinite(value) and value == int(value)
                                      and value >= least):  # (a 4096.0: left to transformers, which may take it)
            raise ModelLoadError(f"config.json has {field} {value!r}: it must be a whole number of at least {least}",
                                 CONFIG_HINT)
    for field in ("dtype", "torch_dtype"):  # transformers reads a name with getattr(torch, name): "float99",
        # "torch.float16" or "auto" were its AttributeError "module 'torch' has no attribute ..."
        value = raw.get(field)
        if value is not None and not (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)):
            raise ModelLoadError(f"config.json has {field} {json.dumps(value)}, which is not a torch dtype",
                                 f"{CONFIG_HINT} (write the weights' dtype as transformers saves it, e.g. "
                                 f"\"{field}\": \"bfloat16\", or leave it out)")
    eps = raw.get("rms_norm_eps")
    if eps is not None and type(eps) in (int, float) and not eps >= 0:
        raise ModelLoadError(f"config.json has rms_norm_eps {eps!r}: it must be a number of at least 0", CONFIG_HINT)
    _check_granite_multipliers(raw)
    _check_internlm3_biases(raw)
    quant = raw.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ModelLoadError(f"config.json's quantization_config must be an object, got {type(quant).__name__}",
                             f"{CONFIG_HINT} (it is an object such as {{\"quant_method\": \"gptq\", \"bits\": 4, "
                             '"group_size": 128}, or absent for a float model)')
