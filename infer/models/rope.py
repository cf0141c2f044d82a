"""Rotary position tables, computed with transformers' own rope functions so every scaling type matches HF."""

from __future__ import annotations

import copy
import math

import torch

from ..errors import OutOfMemoryError, UnsupportedModelError
from .registry import HUNYUAN
from .shapes import ModelShapes, is_mla


def rope_layer_types(cfg) -> list[str | None]:
    """The layer types that have a rope table of their own: Gemma 3's and OLMo 3's sliding and full layers (their
    rope_parameters given per layer type: Gemma 3's sliding layers' local base, its full layers' global base and
    scaling; OLMo 3's full layers' yarn), [None] for a model whose every layer shares one rope."""
    params = getattr(cfg, "rope_parameters", None)
    if getattr(cfg, "model_type", None) in ("gemma3_text", "olmo3") and isinstance(params, dict):
        types = sorted({t for t in (getattr(cfg, "layer_types", None) or []) if isinstance(params.get(t), dict)})
        return types or [None]
    return [None]


def nope_layers(cfg) -> list[bool]:
    """Which decoder layers rotate q and k by no rope (NoPE): SmolLM3's, where its no_rope_layers has a 0 (1: rope;
    transformers' SmolLM3Config fills it, every no_rope_layer_interval-th layer 0, when config.json has none);
    Cohere 2's full_attention layers (every layer layer_types does not name "sliding_attention"), and EXAONE 4's where
    sliding_window is set (transformers' Exaone4Attention rotates every layer when it is not); every other family
    rotates every layer. A SmolLM3 list shorter than the layers, or of values other than 0 and 1, is an
    UnsupportedModelError (transformers fails building the model, or reads any true value as rope)."""
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    model_type = getattr(cfg, "model_type", None)
    if model_type == "granite_swa":  # (layer_rope_theta 0: NoPE; transformers fills it with rope_theta when unset)
        thetas = list(getattr(cfg, "layer_rope_theta", None) or [])
        if len(thetas) < layers or not all(type(t) in (int, float) for t in thetas):
            raise UnsupportedModelError(f"config.json's layer_rope_theta {thetas!r} is not a number for each of the "
                                        f"{layers} layers", "Granite SWA's layer_rope_theta gives each layer its "
                                        "rope base (0: no rotary): use the config.json that came with the weights")
        return [thetas[i] == 0 for i in range(layers)]
    if model_type == "nemotron_h":  # (Nemotron-H's attention layers rotate by none: models.nemotron_h)
        return [t == "full_attention" for t in cfg.layers_block_type]
    if model_type == "granitemoehybrid":  # (Granite 4.0: rope where position_embedding_type is "rope", else none)
        rope = getattr(cfg, "position_embedding_type", None) == "rope"
        return [not rope and t != "linear_attention" for t in cfg.layer_types]
    if model_type == "cohere2" or (model_type == "exaone4" and getattr(cfg, "sliding_window", None)):
        types = list(getattr(cfg, "layer_types", None) or [])
        return [i < len(types) and types[i] != "sliding_attention" for i in range(layers)]
    if model_type not in ("smollm3", "llama4_text"):  # (Llama 4's no_rope_layers: SmolLM3's, registry.check_llama4)
        return [False] * layers
    flags = getattr(cfg, "no_rope_layers", None)
    if not isinstance(flags, (list, tuple)) or len(flags) < layers or any(f not in (0, 1) for f in flags):
        raise UnsupportedModelError(
            f"config.json's no_rope_layers {flags!r} is not a list of 0 and 1 for each of the {layers} layers",
            "SmolLM3's no_rope_layers has one entry a layer (1: the layer uses rope, 0: it does not): use the "
            "config.json that came with the weights, or leave it out (every no_rope_layer_interval-th layer NoPE)")
    return [not flags[i] for i in range(layers)]


def identity_cos_sin(max_positions: int) -> torch.Tensor:
    """[max_positions, 2] float32 table of cos 1 | sin 0 on the default device: a rotary table of one pair of dims
    that rotates nothing (a NoPE layer's: `nope_layers`), the head's other dims passed as a partial rotary's are."""
    return torch.tensor([1.0, 0.0]).expand(max_positions, 2).contiguous()


def rope_parameters(cfg, layer_type: str | None = None) -> dict:
    """The rope parameters of the config (of its layers of `layer_type`, where it gives them per layer type)."""
    params = getattr(cfg, "rope_parameters", None)
    if layer_type is not None:
        params = params[layer_type]
    if params is None:  # transformers < 5 style
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:  # transformers' Llama, Mistral and Qwen rotary embeddings read one dict (they fail with a KeyError)
        raise UnsupportedModelError(f"rope_parameters given per layer type ({', '.join(nested)}) is not supported",
                                    "Llama, Mistral and Qwen use one rope for every layer: write rope_parameters as "
                                    "one dict (rope_type, rope_theta, ...)")
    return params


def rope_max_positions(cfg) -> int | None:
    """The positions up to which infer's one rope table equals transformers' rope, where that is below
    max_position_embeddings (None: no such limit). longrope rotates with its short factors up to
    original_max_position_embeddings; once a sequence passes it, transformers rotates every position of the sequence
    with the long factors, keys already in a KV cache included, which a paged cache cannot redo: the context is
    capped there (engine/setup.model_max_len). Phi-3.5-MoE's transformers rotates by the short factors at every
    length and scales cos and sin by short_mscale, by long_mscale once a forward's positions pass the original
    context (`phimoe_mscale`): no cap where the two are equal (Phi-3.5-MoE-instruct's), that cap where not."""
    limits = []
    for layer_type in rope_layer_types(cfg):
        params = rope_parameters(cfg, layer_type)
        if phimoe_mscale(cfg, params) is not None and params.get("short_mscale") == params.get("long_mscale"):
            continue  # (Phi-3.5-MoE's: its short factors at every length, the same scale past the original context)
        if params.get("rope_type") == "longrope" and params.get("original_max_position_embeddings"):
            limits.append(int(params["original_max_position_embeddings"]))
    return min(limits) if limits else None


def rope_table_bytes(cfg, max_positions: int, dtype: torch.dtype | None = None, device=None) -> int:
    """The bytes of build_cos_sin_cache(cfg, max_positions, dtype=dtype) on `device` (of each layer type's table:
    rope_layer_types): loaded with the weights, not in the checkpoint. A row is the rotary dims (2 * the frequencies:
    Phi-3's partial rotary narrower than the head); float32, but bfloat16 where a bfloat16 model's table on a CPU is
    (_as_transformers_rounds; dtype or device None: float32, an EAGLE head's)."""
    width = sum(2 * _inv_freq(cfg, layer_type)[0].numel() for layer_type in rope_layer_types(cfg))
    kind = getattr(cfg, "model_type", None)
    bf16 = (dtype == torch.bfloat16 and device is not None and torch.device(device).type == "cpu"
            and kind not in ROPE_IN_FLOAT32 + ROPE_CAST_ROTATED_IN_FLOAT32)
    # (the NoPE layers' identity_cos_sin, float32; Hunyuan's layers hand it the fused kernels: models.llama)
    nope = 2 if any(nope_layers(cfg)) or kind in HUNYUAN or (kind == "llama4_text" and cfg.use_qk_norm) else 0
    return max_positions * (width * (2 if bf16 else 4) + nope * 4)


def partial_rotary(cfg) -> bool:
    """Whether the family's attention rotates only the first rotary dims of each head (the rope table's width) and
    passes the rest: transformers' Phi-3 and GLM-4 (apply_rotary_pos_emb slices q and k at the width of cos), whose
    partial_rotary_factor (Phi-4-mini: 0.75, GLM-4: 0.5, Nemotron and GLM-4.5: 0.5 by default) sets that width.
    Llama, Mistral, Qwen and Gemma rotate whole heads (Qwen3.5's, Qwen3.5 MoE's and Qwen3-Next's: a quarter;
    MiniMax-M2's: its config.json's rotary_dim of head_dim, which transformers reads as partial_rotary_factor)."""
    return getattr(cfg, "model_type", None) in ("phi3", "glm", "glm4", "nemotron", "glm4_moe", "qwen3_5_text",
                                                "qwen3_next", "qwen3_5_moe_text", "minimax_m2", "bamba")


def _rotary_dims(cfg, params: dict, head_dim: int) -> int:
    """The dims the default rope's frequencies span: Phi-3's and GLM-4's int(head_dim * partial_rotary_factor) (their
    own compute_default_rope_parameters); the whole head elsewhere (Llama's ignores the field)."""
    if not partial_rotary(cfg):
        return head_dim
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    return head_dim if factor is None else int(head_dim * factor)


def ntk_alpha(cfg, params: dict) -> bool:
    """Whether the rope is Hunyuan's NTK alpha: its checkpoints' rope_scaling "dynamic" with an alpha, which
    transformers' HunYuanDenseV1 and HunYuanMoEV1 run as a static base (rope_type "ntk_alpha"), never rescaled by
    the length."""
    return getattr(cfg, "model_type", None) in HUNYUAN and params.get("rope_type") == "dynamic" \
        and bool(params.get("alpha"))


def check_rope(cfg) -> None:
    """Refuse a rope infer cannot compute (an UnsupportedModelError): what build_cos_sin_cache refuses, checked when
    the config is read (models.loader.load_config), so that commands that never build the model refuse it too;
    SmolLM3's no_rope_layers (`nope_layers`); Ministral 3's query scaling (`query_scaling`)."""
    for layer_type in rope_layer_types(cfg):
        _inv_freq(cfg, layer_type)
    nope_layers(cfg)
    query_scaling(cfg)


def query_scaling(cfg) -> tuple[float, int] | None:
    """Ministral 3's (model_type ministral3) query scaling by position, which Mistral named after Llama 4's (its
    field llama_4_scaling_beta) but which is not Llama 4's attention temperature (llama4_text's attn_temperature_tuning,
    attn_scale, floor_scale: models.llama.Attention.temperature): after the rotary, the query at position p times
    1 + beta * log(1 + floor(p / original_max_position_embeddings)), both from rope_parameters
    (llama_4_scaling_beta and original_max_position_embeddings): (beta, original); None for every other family
    (Llama 4's included).
    Either missing or not a number is refused (transformers' Ministral 3 attention fails on it)."""
    if getattr(cfg, "model_type", None) != "ministral3":
        return None
    params = rope_parameters(cfg)
    beta, original = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if type(beta) not in (int, float) or not math.isfinite(beta) or type(original) is not int or original < 1:
        raise UnsupportedModelError(
            f"ministral3's rope_parameters need llama_4_scaling_beta (a number) and original_max_position_embeddings "
            f"(a whole number of at least 1) for its query scaling, got {beta!r} and {original!r}",
            "use the config.json that came with the weights (Ministral 3's: llama_4_scaling_beta 0.1, "
            "original_max_position_embeddings 16384)")
    return float(beta), original


def phimoe_mscale(cfg, params: dict) -> float | None:
    """Phi-3.5-MoE's scale of cos and sin (transformers' PhimoeRotaryEmbedding: a rope other than the default's
    frequencies, computed without the length: longrope's short factors, times short_mscale up to
    original_max_position_embeddings, long_mscale past it, never the rope's own attention factor); None for the
    default rope and every other family. Either mscale missing or not a number is refused naming it (transformers'
    PhimoeConfig refuses it too)."""
    if getattr(cfg, "model_type", None) != "phimoe" or params.get("rope_type", "default") == "default":
        return None
    for name in ("short_mscale", "long_mscale"):
        value = params.get(name)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise UnsupportedModelError(f"phimoe's {params.get('rope_type')} rope_parameters need {name} (a number "
                                        f"scaling cos and sin), got {value!r}",
                                        "use the config.json that came with the weights (Phi-3.5-MoE's rope_scaling "
                                        "has short_mscale and long_mscale 1.243163121016122)")
    return float(params["short_mscale"])


def _inv_freq(cfg, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] on the CPU, the attention scale of cos and sin) of the config's rope (of its layers
    of `layer_type`: rope_layer_types)."""
    with torch.device("cpu"):  # whatever device the model is built on: transformers' rope functions compute on the
        return _cpu_inv_freq(cfg, layer_type)  # default device, then copy to "cpu" (which a meta tensor cannot)


def layer_rope_base(cfg) -> float | None:
    """Granite SWA's one rope base of its rotating layers (layer_rope_theta's non-zero value: transformers'
    GraniteSWAModel rotates them by it, rope_theta unread), or None: another family, or no one such base
    (registry.check_granite_swa refuses several)."""
    if getattr(cfg, "model_type", None) != "granite_swa":
        return None
    thetas = {t for t in (getattr(cfg, "layer_rope_theta", None) or []) if t}
    return next(iter(thetas)) if len(thetas) == 1 else None


def _cpu_inv_freq(cfg, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    base = layer_rope_base(cfg)
    if base is not None and base != rope_parameters(cfg).get("rope_theta"):  # (as transformers: a copy of the
        cfg = copy.deepcopy(cfg)  # config whose rope_parameters give that base)
        cfg.rope_parameters = {**rope_parameters(cfg), "rope_theta": base}
    params = rope_parameters(cfg, layer_type)
    rope_type = params.get("rope_type", "default")
    # (MLA's rope is over qk_rope_head_dim, transformers' config.head_dim; ModelShapes' head is the latent row)
    head_dim = int(cfg.qk_rope_head_dim) if is_mla(cfg) else ModelShapes.from_config(cfg).head_dim
    if rope_type not in ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "proportional"):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported",
                                    "supported rope types: default, linear, llama3, yarn, dynamic, longrope, "
                                    "proportional")
    try:
        if rope_type == "default":
            base, dim = params["rope_theta"], _rotary_dims(cfg, params, head_dim)
            inv_freq, scale = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        elif ntk_alpha(cfg, params):  # Hunyuan's: rope_theta * alpha ** (dim / (dim - 2)), static (transformers'
            dim = cfg.head_dim  # HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters: config.head_dim)
            if not dim:
                raise UnsupportedModelError("Hunyuan's rope with an alpha reads head_dim, which config.json does not "
                                            "set (transformers fails computing it)",
                                            "set head_dim (Hunyuan's configs have 128): use the config.json that "
                                            "came with the weights")
            base = params["rope_theta"] * params["alpha"] ** (dim / (dim - 2))
            inv_freq, scale = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            # dynamic (NTK): transformers rescales only once a sequence passes max_position_embeddings, which infer's
            # context never does (engine/setup.model_max_len caps it there): below it, its table is this one;
            # longrope: the short factors (and the attention factor) up to original_max_position_embeddings
            # (rope_max_positions); proportional (transformers 5): frequencies for the whole head, those past
            # partial_rotary_factor of them 0 (cos 1, sin 0: those dimensions pass unrotated), all divided by its
            # factor
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **(
                {"layer_type": layer_type} if layer_type else {}))
            mscale = phimoe_mscale(cfg, params)  # (Phi-3.5-MoE: its short_mscale, not the rope's attention factor)
            scale = scale if mscale is None else mscale
    except (TypeError, ValueError, KeyError, ZeroDivisionError, RuntimeError) as e:  # a factor or a rope_theta "2",
        # a null field, longrope factors of another length than head_dim / 2, ...
        raise UnsupportedModelError(f"config.json's {rope_type} rope parameters {_shown(params)} cannot be "
                                    f"computed ({type(e).__name__}: {e})",
                                    "rope_parameters (rope_scaling in older configs) needs the numbers its "
                                    "rope_type takes: use the config.json that came with the weights") from e
    if not (bool(torch.isfinite(inv_freq).all()) and math.isfinite(scale)):  # a rope_theta of 0, a linear factor of
        # 0, ...: every position past 0 rotated by NaN, which the first forward reported as the model overflowing
        raise UnsupportedModelError(f"config.json's {rope_type} rope parameters {_shown(params)} give rotary "
                                    "frequencies that are not finite (NaN or inf)",
                                    "rope_theta must be above 0 and a scaling factor must not be 0: use the "
                                    "config.json that came with the weights")
    width = 2 * inv_freq.numel()
    if head_dim % 2 and not partial_rotary(cfg):  # (the refusal below named partial_rotary_factor, which it lacks)
        field = "qk_rope_head_dim" if is_mla(cfg) else "head_dim"
        raise UnsupportedModelError(f"config.json's {field} {head_dim} is odd: a rotary turns pairs of dimensions",
                                    "use the config.json that came with the weights (an even "
                                    f"{field}{', 64 in DeepSeek-V2/V3' if is_mla(cfg) else ''})")
    if width != head_dim and not (partial_rotary(cfg) and width < head_dim):
        # transformers' Llama-family attention rotates whole heads (it fails here); Phi-3's rotates the first
        # `width` dims and passes the rest (every rotary kernel does: the table's width), never more than the head
        hint = ("partial_rotary_factor must be at most 1: Phi-3, GLM-4 and Nemotron rotate part of each head, never "
                "more than "
                "all of it"
                if partial_rotary(cfg) else "remove partial_rotary_factor from the rope parameters: Llama, Mistral, "
                "Qwen and Gemma rotate the whole head")
        raise UnsupportedModelError(f"a {rope_type} rope over {width} of {head_dim} head dimensions "
                                    f"(partial_rotary_factor {params.get('partial_rotary_factor')}) is not supported",
                                    hint)
    return inv_freq, scale


def _shown(params: dict) -> dict:
    """The rope parameters as an error message shows them: a list of factors as its length."""
    return {k: f"[{len(v)} values]" if isinstance(v, list) else v for k, v in params.items()}


# transformers' rotary in bfloat16 (measured on the tiny models against their ...ForCausalLM): most families cast
# cos and sin (computed in float32) to the model's dtype and rotate in it, each product and sum rounded to bfloat16;
# OLMo 2's, OLMo 3's and ERNIE 4.5's keep them in float32 and rotate in float32, rounding once; Cohere's cast them and
# rotate in float32 (q.float()), rounding once
ROPE_IN_FLOAT32 = ("olmo2", "olmo3", "ernie4_5", "ernie4_5_moe", "llama4_text",  # (Llama 4's complex rotary)
                   "flex_olmo")  # (FlexOlmo's: OLMo 2's)
ROPE_CAST_ROTATED_IN_FLOAT32 = ("cohere", "cohere2")


def _as_transformers_rounds(cfg, table: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A bfloat16 model's table on a CPU as transformers rounds it: in bfloat16 where the family rotates in bfloat16
    (the reference kernel then rounds each product and sum, kernels.reference.rotary_embedding), rounded to bfloat16
    but float32 where it rotates in float32 after the cast (Cohere's); else (float32 and float16 models, a GPU, the
    families of ROPE_IN_FLOAT32) the float32 table as computed."""
    kind = getattr(cfg, "model_type", None)
    if dtype != torch.bfloat16 or table.device.type != "cpu" or kind in ROPE_IN_FLOAT32:
        return table
    return table.to(torch.bfloat16).float() if kind in ROPE_CAST_ROTATED_IN_FLOAT32 else table.to(torch.bfloat16)


def build_cos_sin_cache(cfg, max_positions: int | None = None, layer_type: str | None = None,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """[max_positions, rot_dim] float32 table: cos | sin of position * inv_freq, times the rope's attention scale;
    on the default device (the one the model is built on). rot_dim is head_dim but for a partial rotary (Phi-3's
    partial_rotary_factor < 1): every rotary kernel rotates the first rot_dim dims of each head, passes the rest.
    `layer_type`: the table of those layers (Gemma 3's "sliding_attention" or "full_attention": rope_layer_types).
    `dtype`: the model's: a bfloat16 model's table on a CPU as transformers rounds it (_as_transformers_rounds)."""
    inv_freq, scale = _inv_freq(cfg, layer_type)
    n = max_positions or cfg.max_position_embeddings
    try:
        freqs = torch.outer(torch.arange(n, dtype=torch.float), inv_freq.float().to(torch.get_default_device()))
        return _as_transformers_rounds(cfg, torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1), dtype)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError; a CPU's allocator raises
        # RuntimeError ("can't allocate memory") for a config.json max_position_embeddings of 10**12
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "allocate" not in str(e):
            raise
        raise OutOfMemoryError(
            f"the rotary (rope) table for {n:,} positions (the model's context: --max-model-len, or config.json's "
            f"max_position_embeddings) takes {n * 2 * inv_freq.numel() * 4 / 2**30:,.1f} GiB, which this device "
            "cannot allocate", "pass --max-model-len with the context you need (max_model_len=N in the Python API)"
        ) from e
