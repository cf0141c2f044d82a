"""Mixture-of-experts members of the Llama family: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), Mixtral (8x7B,
8x22B), Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), OpenAI's gpt-oss (gpt-oss-20b, 120b), GLM-4.5 / 4.6
(GLM-4.5-Air), OLMoE (OLMoE-1B-7B), Granite MoE (granite-3.x-1b-a400m, 3b-a800m), GraniteMoeShared, ERNIE 4.5 MoE
(ERNIE-4.5-21B-A3B), Hunyuan MoE (Hunyuan-A13B-Instruct), through models.qwen3_5's hybrid layers, Qwen3-Next and
Qwen3.5 MoE (Qwen3.5-35B-A3B), and through models.nemotron_h's, Nemotron 3 (NVIDIA-Nemotron-3-Nano-30B-A3B:
GLM-4.5's router, `GROUPED`; relu² experts without gate, `Experts.gated` False: w13 [E, I, H] their up rows alone,
which the fused MoE runs as relu(up)²; a relu² shared expert, llama.UngatedMLP; its experts' adapters are their
up_proj and down_proj, lora.experts, its shared experts', `shared_adapted`).

GLM-4.5: a float32 router of sigmoid scores whose e_score_correction_bias steers the choice only, group-limited
top k (n_group groups scored by their two best, topk_group kept), renormalised where norm_topk_prob says, scaled by
routed_scaling_factor (`SparseMoeBlock._glm_route`: float32 weights); shared experts (mlp.shared_experts, a dense
MLP added unscaled); the first first_k_dense_replace layers dense; the checkpoints' multi-token-prediction layers
skipped (`mtp_tensor`). OLMoE: OLMo 2's attention (q and k normed over their whole projections) in Llama's layer.
Granite MoE: Granite's scalars (GraniteForCausalLM), the hub's block_sparse_moe.input_linear / output_linear /
router.layer (`_GRANITE_NAMES`), the softmax over the top k logits in float32; GraniteMoeShared adds the layer's
dense shared_mlp (input_linear: gate|up fused; output_linear) unscaled (`_load_shared_mlp`). ERNIE 4.5 MoE: a float32
router whose moe_statics e_score_correction_bias ([1, E] stored) steers the top k of the softmax, the chosen weights
over their sum clamped to moe_norm_min; shared experts (GLM-4.5's shared_experts); experts on the layers
moe_layer_start_index..moe_layer_end_index every moe_layer_interval. Qwen3.5 MoE: Qwen3-Next's experts (always
renormalised) and gated shared expert. dots.llm1 (Dots1ForCausalLM): Qwen3's attention (BASE) with DeepSeek-V3's
router and layout of the experts (GLM-4.5's: `GROUPED`, `GLM_LAYOUT`; n_shared_experts always built). MiniMax-M2
(MiniMaxM2ForCausalLM: M2, M2.1): Mixtral's layer of experts on every layer (block_sparse_moe.experts.N.w1, w3, w2)
with a sigmoid router in the model's dtype whose e_score_correction_bias (the block's, block_sparse_moe.
e_score_correction_bias: `_MINIMAX_BIAS`) steers the choice only, the top k always renormalised, float32 weights
(`SparseMoeBlock.route`); its attention's q and k normed over their whole projections (OLMoE's), a partial rotary
(rotary_dim) of NeoX pairs (models.llama.Attention, rope.partial_rotary). Hunyuan MoE: the dense Hunyuan's attention
(q and k normed after the rotary, the rope's NTK alpha: llama.HunYuanDenseV1ForCausalLM) and on every layer a
float32 router (mlp.gate.wg, of the hidden state in float32) whose softmax's top k (moe_topk: one k, or the same k a
layer) are renormalised, float32 weights, experts of intermediate_size and the block's shared_mlp (a SwiGLU MLP of
intermediate_size, added unscaled, with a shared expert's adapter slots: `shared_name`); the remote code's fields
transformers ignores refused where they ask another layer (registry.check_hunyuan), its capacity fields
(capacity_factor, moe_drop_tokens) ignored as transformers and vLLM ignore them (every token routed to its k experts).

gpt-oss: Llama's attention with q/k/v/o biases and attention sinks (a learned logit per query head in each softmax's
denominator: Attention.sinks, every attention kernel), sliding windows on the layers layer_types names, yarn rope;
its sparse layer a router with a bias whose softmax is over the top k logits (`SparseMoeBlock.route`), experts with
biases and a clamped SwiGLU (kernels.reference.OaiExperts) whose w13 rows keep transformers' interleaved gate/up
order. Its checkpoints: transformers' stacked bf16 layout, the hub's MXFP4 experts (config.json's
quantization_config quant_method "mxfp4": kept packed as stored, on every device, `Mxfp4Stack`: uint8 blocks of two
e2m1 codes a byte and an e8m0 scale a group of 32, a quarter of bf16's bytes; kernels.fused_moe_mxfp4 dequantizes
them in registers on the GPU path, its CPU reference one expert at a time as a call reaches it: the values of
`mxfp4_dequantize`, transformers' Mxfp4Config(dequantize=True)), GPTQModel's per-expert GPTQ layers (with their
biases). Adapters of its experts are refused (lora.adapter); float experts of an MXFP4 checkpoint are `infer convert
SRC -o FLOAT`'s (transformers dequantizes them; quantization_config dropped), which loads as a float gpt-oss.

Attention, norms and rope are their dense family's (`BASE`: Qwen3's q/k norms, Mistral's, Qwen2's q/k/v biases);
the MLP of a sparse layer is a `SparseMoeBlock`: a router (a linear [E, H] of the hidden state, softmax in float32
over the experts, the top k, renormalised to sum 1 where norm_topk_prob is set, Mixtral always) and E SwiGLU
experts, each token's output the routing-weighted sum of its k experts' outputs (kernels.fused_moe). Qwen2-MoE adds
a shared expert (a dense SwiGLU MLP every token runs) scaled by sigmoid(shared_expert_gate(x)). Qwen's
decoder_sparse_step and mlp_only_layers leave some layers dense (their MLP is Llama's, of intermediate_size).

The experts are stored stacked, as transformers 5 keeps them in memory: `experts.w13` [E, 2I, H] (each expert's
gate rows then its up rows) and `experts.w2` [E, H, I]. Checkpoints store them per expert (mlp.experts.N.gate_proj,
up_proj, down_proj; Mixtral's block_sparse_moe.experts.N.w1, w3, w2), which is what save_pretrained writes and
what GPTQModel quantizes, or fused as transformers names its parameters (mlp.experts.gate_up_proj, down_proj): the
loader (`MoeForCausalLM.load_expert_tensor`) reads either.

GPTQ experts (GPTQModel's qwen3_moe / mixtral / nemotron_h checkpoints), and AWQ ones (repacked into GPTQ's layout as
they are read, quant.awq): each expert's projection is read into a one-shard GPTQ layer of its own; on the CPU it is
dequantized once at load into w13 / w2 (as the CPU path does every GPTQ layer); on the GPU path (`int4_path`) its
int4 tensors are stacked by expert (Int4Stack: an expert's gate and up share their g_idx; Nemotron 3's up alone) and
kernels.fused_moe_int4 dequantizes them in registers. Not supported, refused up front
(UnsupportedModelError): on a GPU, GPTQ experts not all 4-bit and quantized alike; other quantizations of the
experts; adapters on the router or Qwen2-MoE's shared_expert_gate (lora.adapter); a hidden_act other than silu.
Adapters (peft's) may adapt the attention, a dense layer's MLP, the shared expert (lora.layer, as any MergedLinear)
and the stacked experts (target_parameters: lora.experts sets `SparseMoeBlock.lora`, the fused MoE adds each
token's adapter's delta per token-expert pair).
"""

from __future__ import annotations

import contextlib
import json
import re

import torch
from torch import nn

from .. import kernels
from ..errors import ModelLoadError, UnsupportedModelError
from ..kernels import cpu_gemm
from ..kernels.reference import Int4Experts, MoELoRA, Mxfp4Experts, OaiExperts, mxfp4_dequantize  # noqa: F401
from ..quant.config import mxfp4_model
from .layers import UnquantizedLinearMethod

# model_type -> the dense family whose attention (and checkpoint names outside the MLP) it has
# (GLM-4.5's attention is its own: q/k/v biases where attention_bias says, q/k norms per head where use_qk_norm says,
# half of each head rotated as NeoX pairs: models.llama.Attention)
# OLMoE's is OLMo 2's (q and k normed over their whole projections, biases where attention_bias says) in Llama's
# layer of two norms (its RMSNorms Llama's: the normed row rounded first)
BASE = {"qwen3_moe": "qwen3", "mixtral": "mistral", "qwen2_moe": "qwen2", "gpt_oss": "llama", "glm4_moe": "glm4_moe",
        "olmoe": "olmo2", "granitemoe": "granite", "granitemoeshared": "granite", "granitemoehybrid": "granite",
        "qwen3_next": "qwen3_next",  # (Qwen3-Next: Qwen3.5's hybrid layers, models.qwen3_5)
        "qwen3_5_moe_text": "qwen3_5_moe_text",  # (Qwen3.5 MoE: Qwen3.5's hybrid layers, models.qwen3_5)
        "ernie4_5_moe": "ernie4_5",  # (ERNIE 4.5 MoE: ERNIE 4.5's attention, interleaved rotary pairs, use_bias)
        "nemotron_h": "nemotron_h",  # (Nemotron 3: Nemotron-H's "moe" layers, models.nemotron_h)
        # (DeepSeek-V3 and V2: multi-head latent attention, models.deepseek; GLM-4.5's layout of the experts)
        "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v2",
        "glm4_moe_lite": "glm4_moe_lite",  # (GLM-4.7-Flash: DeepSeek-V3's attention, GLM-4.5's experts)
        "dots1": "qwen3",  # (dots.llm1: Qwen3's attention, q and k normed per head; DeepSeek-V3's experts)
        # (MiniMax-M2: its own attention, q and k normed over their whole projections as OLMoE's, no biases, a partial
        # rotary of NeoX pairs; Mixtral's layer of experts with a sigmoid router)
        "minimax_m2": "minimax_m2",
        "hunyuan_v1_moe": "hunyuan_v1_dense",  # (Hunyuan MoE: the dense Hunyuan's q/k norms after the rotary)
        "lfm2_moe": "lfm2",  # (LFM2-MoE: LFM2's layers, models.lfm2; experts after num_dense_layers)
        "llama4_text": "llama4_text",  # (Llama 4: its own attention and layers, models.llama4; experts on moe_layers)
        # (Phi-3.5-MoE: Llama's attention with q/k/v/o biases where attention_bias says, StarCoder2's LayerNorms with
        # biases, Mixtral's layer of experts with the sparsemixer router: `SparseMoeBlock._sparsemixer_route`)
        "phimoe": "phimoe",
        "flex_olmo": "olmo2"}  # (FlexOlmo: OLMo 2's attention and layer of norms after, OLMoE's experts)
# Granite MoE's and GraniteMoeShared's (Granite MoE with a dense shared MLP beside the experts: layers.N.shared_mlp)
GRANITE_MOE = ("granitemoe", "granitemoeshared")
# the families whose every decoder layer is sparse, its experts intermediate_size wide (Granite MoE's too)
_ALL_SPARSE = ("mixtral", "gpt_oss", "olmoe", *GRANITE_MOE, "granitemoehybrid", "minimax_m2", "hunyuan_v1_moe",
               "phimoe", "flex_olmo")
# Granite MoE's router and the hub's names of its experts (Granite 4.0's too: models.granite4)
_GRANITE_ROUTER = (*GRANITE_MOE, "granitemoehybrid")
# the families of GLM-4.5's router (sigmoid scores, e_score_correction_bias, group-limited top k, routed scaling:
# `SparseMoeBlock._glm_route`): GLM-4.5's and Nemotron 3's (transformers' NemotronHTopkRouter, the same ops), and
# DeepSeek-V3's, GLM-4.7-Flash's and dots.llm1's (transformers' DeepseekV3TopkRouter, Glm4MoeLiteTopkRouter,
# Dots1TopkRouter)
GROUPED = ("glm4_moe", "nemotron_h", "deepseek_v3", "glm4_moe_lite", "dots1")
# the families of GLM-4.5's layout of a sparse layer: the first first_k_dense_replace layers dense, n_shared_experts
# shared experts (mlp.shared_experts, added unscaled), n_routed_experts experts, multi-token-prediction layers after
# num_hidden_layers (skipped: `mtp_tensor`)
GLM_LAYOUT = ("glm4_moe", "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "dots1")
# the families whose sparse layers add a gated shared expert (Qwen2-MoE's)
SHARED_EXPERT = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
# the checkpoint's names of an expert's projections: (gate, up, down)
# (Nemotron 3's experts have no gate: up_proj alone, w13's I rows; "" names no tensor)
_PROJ = {"mixtral": ("w1", "w3", "w2"), "nemotron_h": ("", "up_proj", "down_proj"), "minimax_m2": ("w1", "w3", "w2"),
         "lfm2_moe": ("w1", "w3", "w2"), "phimoe": ("w1", "w3", "w2")}
_QWEN_PROJ = ("gate_proj", "up_proj", "down_proj")
# the linear methods of quantized experts: GPTQ's, and AWQ's (quant.awq: each tensor repacked into GPTQ's layout as
# it is read, so the same stacking, dequantization and kernels)
_INT4_METHODS = ("GPTQLinearMethod", "AWQLinearMethod")


def base_type(cfg) -> str:
    """The dense family whose attention a model has: its own model_type, or for an MoE model `BASE`'s."""
    model_type = getattr(cfg, "model_type", None)
    return BASE.get(model_type, model_type)


def is_moe(cfg) -> bool:
    model_type = getattr(cfg, "model_type", None)  # (Granite 4.0 without experts: granite-4.0-micro, dense)
    if model_type == "nemotron_h":  # (Nemotron-H without "moe" layers: dense)
        return "moe" in (getattr(cfg, "layers_block_type", None) or ())
    return model_type in BASE and (model_type != "granitemoehybrid" or num_experts(cfg) > 0)


def experts_field(cfg) -> str:
    """config.json's name of E: Qwen's num_experts, Mixtral's and gpt-oss's num_local_experts, GLM-4.5's
    n_routed_experts, ERNIE 4.5 MoE's moe_num_experts."""
    return {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "granitemoe": "num_local_experts",
            "granitemoeshared": "num_local_experts", "granitemoehybrid": "num_local_experts",
            "glm4_moe": "n_routed_experts", "ernie4_5_moe": "moe_num_experts",
            "nemotron_h": "n_routed_experts", "deepseek_v3": "n_routed_experts",
            "deepseek_v2": "n_routed_experts", "glm4_moe_lite": "n_routed_experts",
            "dots1": "n_routed_experts", "minimax_m2": "num_local_experts",
            "llama4_text": "num_local_experts", "phimoe": "num_local_experts"}.get(cfg.model_type, "num_experts")


def top_k_field(cfg) -> str:
    """config.json's name of k (the experts a token is routed to): ERNIE 4.5 MoE's moe_k and Hunyuan MoE's moe_topk
    (transformers maps num_experts_per_tok to them), the others' num_experts_per_tok."""
    return {"ernie4_5_moe": "moe_k", "hunyuan_v1_moe": "moe_topk"}.get(cfg.model_type, "num_experts_per_tok")


def top_k(cfg) -> int:
    """k (`top_k_field`); Hunyuan MoE's moe_topk may be a list, one a layer, which registry.check_hunyuan refuses
    unless every entry is the same: that one k."""
    k = getattr(cfg, "num_experts_per_tok", 0)
    if isinstance(k, (list, tuple)):
        k = k[0] if k else 0
    return int(k or 0)


def num_experts(cfg) -> int:
    """E (`experts_field`)."""
    return int(getattr(cfg, experts_field(cfg), 0) or 0)


def is_sparse(cfg, layer: int) -> bool:
    """Whether decoder layer `layer` has the experts (as transformers builds each): every Mixtral layer; a Qwen layer
    not in mlp_only_layers whose index + 1 is a multiple of decoder_sparse_step (with num_experts > 0); a GLM-4.5
    layer from first_k_dense_replace on (the first k dense)."""
    if not is_moe(cfg):
        return False
    # (Qwen3.5 MoE: transformers' Qwen3_5MoeDecoderLayer has the experts on every layer, whatever mlp_only_layers or
    # decoder_sparse_step a config.json copied from Qwen3-Next's says; its config has no dense intermediate_size)
    if cfg.model_type in _ALL_SPARSE or cfg.model_type == "qwen3_5_moe_text":
        return True
    if cfg.model_type == "glm4_moe_lite":  # (GLM-4.7-Flash: its mlp_layer_types, "dense" or "sparse" a layer)
        return cfg.mlp_layer_types[layer] == "sparse"
    if cfg.model_type in GLM_LAYOUT:
        return layer >= int(getattr(cfg, "first_k_dense_replace", 1) or 0)
    if cfg.model_type == "nemotron_h":  # (its layers_block_type's "moe" layers: hybrid_override_pattern's "E")
        return cfg.layers_block_type[layer] == "moe"
    if cfg.model_type == "llama4_text":  # (transformers' Llama4TextDecoderLayer: the layers moe_layers lists)
        return layer in (cfg.moe_layers or ()) and num_experts(cfg) > 0
    if cfg.model_type == "lfm2_moe":  # (transformers' Lfm2MoeDecoderLayer: the first num_dense_layers dense)
        return layer >= int(getattr(cfg, "num_dense_layers", 0) or 0) and num_experts(cfg) > 0
    if cfg.model_type == "ernie4_5_moe":  # (transformers' Ernie4_5_MoeDecoderLayer; its config resolves an end of -1)
        interval = int(getattr(cfg, "moe_layer_interval", 1) or 1)
        start, end = int(getattr(cfg, "moe_layer_start_index", 1)), int(getattr(cfg, "moe_layer_end_index", -1))
        end = cfg.num_hidden_layers - 1 if end == -1 else end
        return (layer + 1) % interval == 0 and start <= layer <= end and num_experts(cfg) > 0
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return (layer not in (getattr(cfg, "mlp_only_layers", None) or []) and num_experts(cfg) > 0
            and (layer + 1) % step == 0)


def expert_size(cfg) -> int:
    """I: an expert's intermediate width (Qwen's and GLM-4.5's moe_intermediate_size; Mixtral's, gpt-oss's and
    OLMoE's intermediate_size)."""
    return int(cfg.intermediate_size if cfg.model_type in (*_ALL_SPARSE, "llama4_text") else cfg.moe_intermediate_size)


def shared_width(cfg) -> int:
    """The width of a sparse layer's shared expert (0: none): Qwen2-MoE's shared_expert_intermediate_size, GLM-4.5's
    n_shared_experts experts' (n_shared_experts * moe_intermediate_size)."""
    if cfg.model_type in SHARED_EXPERT:  # (Qwen3-Next's too)
        return int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    if cfg.model_type in GLM_LAYOUT:
        return int(getattr(cfg, "n_shared_experts", 0) or 0) * expert_size(cfg)
    if cfg.model_type == "ernie4_5_moe":  # (moe_num_shared_experts experts of moe_intermediate_size as one MLP)
        return int(getattr(cfg, "moe_num_shared_experts", 0) or 0) * expert_size(cfg)
    if cfg.model_type == "granitemoeshared":  # (its shared_mlp, beside the block: not adapted, shared_name None)
        return int(getattr(cfg, "shared_intermediate_size", 0) or 0)
    if cfg.model_type == "nemotron_h":  # (Nemotron 3's shared experts: one relu² MLP without gate, not adapted)
        return int(getattr(cfg, "moe_shared_expert_intermediate_size", 0) or 0)
    if cfg.model_type in ("hunyuan_v1_moe", "llama4_text"):  # (Hunyuan's shared_mlp, Llama 4's shared_expert, of
        return int(cfg.intermediate_size)  # intermediate_size as the experts)
    return 0


def shared_name(cfg) -> str | None:
    """The module name of a sparse layer's shared expert: Qwen2-MoE's shared_expert, GLM-4.5's shared_experts, Hunyuan
    MoE's shared_mlp."""
    return {"qwen2_moe": "shared_expert", "qwen3_next": "shared_expert", "qwen3_5_moe_text": "shared_expert",
            "glm4_moe": "shared_experts", "ernie4_5_moe": "shared_experts", "deepseek_v3": "shared_experts",
            "deepseek_v2": "shared_experts", "glm4_moe_lite": "shared_experts", "dots1": "shared_experts",
            "llama4_text": "shared_expert", "hunyuan_v1_moe": "shared_mlp"}.get(cfg.model_type)


def experts_adapted(cfg) -> bool:
    """Whether a sparse layer's routed experts get adapter slots (lora.experts; Nemotron 3's relu² experts without
    gate too, their up_proj and down_proj): not Llama 4's (their input scaled by the router: lora.adapter refuses
    adapters of them; its feed_forward.shared_expert keeps its slots), nor LFM2-MoE's (lora.adapter refuses adapters
    of its experts and router)."""
    return getattr(cfg, "model_type", None) not in ("llama4_text", "lfm2_moe")


def shared_adapted(cfg, module: str) -> bool:
    """Whether the merged layer whose first checkpoint module is `module` gets adapter slots, as far as the shared
    experts go: not Nemotron 3 Super's latent projections (lora.adapter refuses adapters of them); Nemotron 3's shared
    experts do (peft's up_proj and down_proj reach them), and Hunyuan MoE's shared_mlp (peft >= 0.22 adapts it
    beside the experts for target_modules gate_proj, up_proj, down_proj)."""
    return not module.endswith(_LATENT)


# Nemotron 3 Super's latent projections around its experts (transformers' NemotronHMoE: the experts' input projected
# from hidden_size to moe_latent_size, their sum projected back)
_LATENT = (".fc1_latent_proj", ".fc2_latent_proj")


def check_moe(cfg) -> None:
    """What an MoE config may ask that infer cannot run, refused up front."""
    if not is_moe(cfg):
        return
    e, k = num_experts(cfg), top_k(cfg)
    field = experts_field(cfg)
    if not any(is_sparse(cfg, i) for i in range(cfg.num_hidden_layers)):
        return
    if not 0 < k <= e:
        raise UnsupportedModelError(f"config.json has {top_k_field(cfg)} {k} with {field} {e}",
                                    f"each token is routed to between 1 and {field} experts")
    if cfg.model_type in GROUPED:
        check_groups(cfg, e, k)
    if cfg.model_type == "deepseek_v2":
        check_v2_router(cfg, e, k)
    if cfg.model_type == "dots1" and getattr(cfg, "n_shared_experts", None) is None:
        raise UnsupportedModelError("config.json has no n_shared_experts (null): transformers' Dots1MoE builds "
                                    "n_shared_experts shared experts in every sparse layer and cannot build none",
                                    "set n_shared_experts as the weights have them (dots.llm1's config.json: 2; 0 "
                                    "for none)")
    latent = getattr(cfg, "moe_latent_size", None) if cfg.model_type == "nemotron_h" else None
    if latent is not None and (type(latent) is not int or latent < 1):
        raise UnsupportedModelError(f"config.json has moe_latent_size {json.dumps(latent)}: Nemotron 3's experts "
                                    "run in a latent of that many dims (fc1_latent_proj, fc2_latent_proj)",
                                    "use the config.json that came with the weights (Nemotron 3 Super's: 1024; none "
                                    "for Nano)")
    if cfg.model_type == "phimoe":
        check_sparsemixer(cfg, k)
    if cfg.model_type == "olmoe" and getattr(cfg, "clip_qkv", None) is not None:
        raise UnsupportedModelError(f"config.json has clip_qkv {cfg.clip_qkv}: infer does not clip OLMoE's queries, "
                                    "keys and values", "serve an OLMoE checkpoint without clip_qkv (OLMoE-1B-7B's "
                                    "config.json has none)")


def check_sparsemixer(cfg, k: int) -> None:
    """Phi-3.5-MoE's sparsemixer router (`SparseMoeBlock._sparsemixer_route`) routes every token to two experts
    whatever num_experts_per_tok says (transformers' sparsemixer takes top_k and never reads it), its masks by
    router_jitter_noise: another k (which transformers would not honour) and a jitter that is not a number of at least
    0 refused naming the field."""
    if k != 2:
        raise UnsupportedModelError(f"phimoe with num_experts_per_tok {k} is not supported: Phi-3.5-MoE's sparsemixer "
                                    "router (transformers') routes every token to 2 experts whatever it says",
                                    "set num_experts_per_tok to 2 (Phi-3.5-MoE's config.json has 2)")
    jitter = getattr(cfg, "router_jitter_noise", 0.0)
    if type(jitter) not in (int, float) or not 0 <= jitter < float("inf"):
        raise UnsupportedModelError(f"phimoe with router_jitter_noise {jitter!r} is not supported (a number of at "
                                    "least 0: the sparsemixer's mask keeps the logits within 2 * router_jitter_noise "
                                    "of the top one)", "use the config.json that came with the weights (Phi-3.5-MoE's "
                                    "router_jitter_noise: 0.01)")


def check_groups(cfg, e: int, k: int) -> None:
    """GLM-4.5's group-limited routing (`SparseMoeBlock.route`): n_group groups of E / n_group experts, each scored by
    its two best, the topk_group best groups kept, the top k of their experts; what transformers' router cannot
    compute refused (its view, topk(2) of a group, topk of the groups and of the experts left)."""
    groups, keep = int(getattr(cfg, "n_group", 1) or 0), int(getattr(cfg, "topk_group", 1) or 0)
    who = {"glm4_moe": "GLM-4.5's router", "deepseek_v3": "DeepSeek-V3's router (GLM-4.5's)",
           "glm4_moe_lite": "GLM-4.7-Flash's router (GLM-4.5's)", "dots1": "dots.llm1's router (GLM-4.5's)"}.get(
        cfg.model_type, "Nemotron 3's router (GLM-4.5's)")
    hint = (f"{who} splits n_routed_experts into n_group equal groups of at least 2 experts, keeps "
            "topk_group of them (1 to n_group) and routes each token to num_experts_per_tok experts of those")
    _check_group_counts(e, k, groups, keep, 2, hint)


def _check_group_counts(e: int, k: int, groups: int, keep: int, least: int, hint: str) -> None:
    """n_group groups of at least `least` of the E experts, topk_group of them kept (1 to n_group), k experts of
    those: what a group-limited router computes; anything else refused naming the fields, with `hint`."""
    if groups < 1 or e % groups or e // groups < least:
        raise UnsupportedModelError(f"config.json has n_group {groups} with n_routed_experts {e}", hint)
    if not 0 < keep <= groups:
        raise UnsupportedModelError(f"config.json has topk_group {keep} with n_group {groups}", hint)
    if k > keep * (e // groups):
        raise UnsupportedModelError(f"config.json has num_experts_per_tok {k}, more than the {keep * (e // groups)} "
                                    f"experts of its topk_group {keep} groups of {e // groups}", hint)


def check_v2_router(cfg, e: int, k: int) -> None:
    """DeepSeek-V2's router (`SparseMoeBlock._v2_route`): topk_method greedy (the top k of the softmax) or
    group_limited_greedy (n_group groups scored by their best, topk_group kept); anything else refused naming it."""
    method = getattr(cfg, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(f"deepseek_v2 with topk_method {method!r} is not supported",
                                    "DeepSeek-V2's router (transformers' DeepseekV2TopkRouter) takes topk_method "
                                    "\"greedy\" or \"group_limited_greedy\"")
    if method == "greedy":
        return
    groups, keep = int(getattr(cfg, "n_group", 0) or 0), int(getattr(cfg, "topk_group", 0) or 0)
    hint = ("DeepSeek-V2's group_limited_greedy router splits n_routed_experts into n_group equal groups, keeps "
            "topk_group of them (1 to n_group) and routes each token to num_experts_per_tok experts of those")
    _check_group_counts(e, k, groups, keep, 1, hint)


def on_gpu(t: torch.Tensor) -> bool:
    """Whether the model is built on a GPU."""
    return t.device.type == "cuda"


# loader.check_weights of a checkpoint a GPU will load (`warmup --estimate --device cuda`): the model on the meta
# device built as a GPU builds it (int4 experts, and a GPU's refusals of them)
_META_AS_GPU: list[bool] = [False]


@contextlib.contextmanager
def meta_as_gpu(enabled: bool = True):
    """Within: a model built on the meta device keeps GPTQ experts int4, as it would on a GPU (`int4_path`)."""
    before = _META_AS_GPU[0]
    _META_AS_GPU[0] = enabled
    try:
        yield
    finally:
        _META_AS_GPU[0] = before


def int4_path(t: torch.Tensor) -> bool:
    """Whether a model built where `t` lies keeps GPTQ experts int4 (the GPU path: kernels.fused_moe_int4; also the
    Triton kernels' path that tests force on the CPU), rather than dequantizing them at load; on the meta device
    within `meta_as_gpu` too."""
    return on_gpu(t) or kernels.use_triton(t) or (t.is_meta and _META_AS_GPU[0])


class _Gate(nn.Module):
    """A linear kept as a plain weight (the router [E, H]; Qwen2-MoE's shared_expert_gate [1, H]); `bias`: with one
    (gpt-oss's router)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x):
        return cpu_gemm.linear(x, self.weight, self.bias, None)


class Int4Stack(nn.Module):
    """One stacked projection of int4 experts (w13: K = H inputs, N = 2I outputs; w2: I, H), in the checkpoint's
    order (kernels.reference.Int4Experts): words int32 [E, K / 8, N], zeros int32 [E, G, N / 8] (fields, v1
    borrows undone), scales float16 [E, G, N] (a GPU load checks them for inf / NaN as every GPTQ layer's),
    g_idx int32 [E, K]; group_size: g_idx's where every expert's is plain (row // group_size), else 0 (computed
    from g_idx at load: reload_weights takes it with the tensors, ADOPTED_ATTRS, and the GPTQ `config` whose zeros
    the stack holds: v1's zero - 1 or gptq_v2's, the kernel's ZEROS_V1). Act-order experts (g_idx a
    permutation of plain groups) are sorted by group at load (reference.Int4Experts.sorted_by_group, as
    quant.gptq_linear sorts a dense layer's rows): words' rows sorted, g_idx plain, and `perm` int32 [E, K] (else
    None) the column of x of each sorted row, which the kernel gathers."""

    ADOPTED_ATTRS = ("group_size", "config")

    def __init__(self, e: int, k: int, n: int, config):
        super().__init__()
        self.config = config
        self.group_size = 0
        groups = config.num_groups(k)
        self.register_buffer("words", torch.zeros(e, k // 8, n, dtype=torch.int32))
        self.register_buffer("zeros", torch.zeros(e, groups, n // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(e, groups, n, dtype=torch.float16))
        self.register_buffer("g_idx", torch.zeros(e, k, dtype=torch.int32))
        self.register_buffer("perm", None)  # (a buffer: reload_weights takes it, or its absence, with the tensors)

    def experts(self) -> Int4Experts:
        return Int4Experts(self.words, self.zeros, self.scales, self.g_idx, self.group_size, self.config.zeros_v1,
                           self.perm)

    def sort_by_group(self, group_size: int) -> None:
        """group_size (`group_size` where every g_idx is plain, else 0), act-order experts sorted by group first
        (their `perm` set) where each g_idx is a permutation of plain groups; one sync, at load."""
        done = self.experts().sorted_by_group(group_size)
        if done.perm is not None:
            self.words.copy_(done.qweight)
            self.g_idx.copy_(done.g_idx)
            self.perm = done.perm
        plain = (torch.arange(self.g_idx.shape[1], device=self.g_idx.device) // group_size).to(self.g_idx.dtype)
        self.group_size = group_size if bool((self.g_idx == plain).all()) else 0


class Mxfp4Stack(nn.Module):
    """One stacked projection of MXFP4 experts (the hub's gpt-oss checkpoints: w13 K = H inputs, N = 2I outputs,
    gate and up rows interleaved; w2: I, H) as the checkpoint stores it, kept packed: blocks uint8 [E, N, K / 32, 16]
    (two e2m1 codes a byte), scales uint8 [E, N, K / 32] (e8m0): kernels.fused_moe_mxfp4 dequantizes them."""

    def __init__(self, e: int, k: int, n: int):
        super().__init__()
        self.register_buffer("blocks", torch.empty(e, n, k // 32, 16, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(e, n, k // 32, dtype=torch.uint8))

    def experts(self) -> Mxfp4Experts:
        return Mxfp4Experts(self.blocks, self.scales)


class Experts(nn.Module):
    """E SwiGLU experts stacked: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]. int4 (the GPU path's GPTQ
    configs of gate/up and of down): no float weights (w13, w2 [E, 0, 0]) but their int4 stacks (Int4Stack
    w13_int4, w2_int4); mxfp4 (the hub's gpt-oss checkpoints, on every device): no float weights but their MXFP4
    stacks as stored (Mxfp4Stack w13_mxfp4, w2_mxfp4). `biases` (gpt-oss): b13 [E, 2I] (gate's, then up's) and
    b2 [E, H]. Not `gated` (Nemotron 3's relu² experts): w13 [E, I, H] their up rows alone (the fused MoE's
    relu(up)², reference.fused_moe), w13_int4 their I columns."""

    def __init__(self, e: int, hidden: int, inter: int, dtype: torch.dtype, int4=None, biases: bool = False,
                 mxfp4: bool = False, gated: bool = True):
        super().__init__()
        self.num_experts, self.hidden, self.inter = e, hidden, inter
        self.int4 = int4
        self.mxfp4 = mxfp4
        self.gated = gated
        rows = (0, 0) if int4 or mxfp4 else None
        self.w13 = nn.Parameter(torch.empty(e, *(rows or ((2 if gated else 1) * inter, hidden)), dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, *(rows or (hidden, inter)), dtype=dtype), requires_grad=False)
        if int4:
            self.w13_int4 = Int4Stack(e, hidden, (2 if gated else 1) * inter, int4[0])
            self.w2_int4 = Int4Stack(e, inter, hidden, int4[1])
        if mxfp4:
            self.w13_mxfp4 = Mxfp4Stack(e, hidden, 2 * inter)
            self.w2_mxfp4 = Mxfp4Stack(e, inter, hidden)
        self.b13 = self.b2 = None
        if biases:
            self.b13 = nn.Parameter(torch.empty(e, 2 * inter, dtype=dtype), requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(e, hidden, dtype=dtype), requires_grad=False)
        self.loaded: set[tuple[int, int]] = set()  # (expert, part): 0 gate, 1 up, 2 down

    def rows(self, part: int) -> slice:
        """w13's rows of part 0 (gate) or 1 (up): up's are the first I where there is no gate (not `gated`)."""
        first = part if self.gated else part - 1
        return slice(first * self.inter, (first + 1) * self.inter)

    def parts(self) -> tuple[int, ...]:
        """The parts (0 gate, 1 up, 2 down) an expert has: no gate where not `gated`."""
        return (0, 1, 2) if self.gated else (1, 2)


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: the router, the experts (and Qwen2-MoE's shared expert and its gate)."""

    def __init__(self, cfg, prefix: str, method_for, dtype: torch.dtype):
        super().__init__()
        from .llama import MLP
        self.prefix = prefix  # the checkpoint's module (model.layers.N.mlp; Mixtral's model.layers.N.block_sparse_moe)
        e, h, inter = num_experts(cfg), cfg.hidden_size, expert_size(cfg)
        self.top_k = top_k(cfg)
        # (Qwen3.5 MoE's and Hunyuan MoE's routers renormalise always: transformers' Qwen3_5MoeTopKRouter and
        # HunYuanMoEV1Gate, no norm_topk_prob)
        self.renormalize = cfg.model_type in ("mixtral", "qwen3_5_moe_text", "hunyuan_v1_moe") \
            or bool(getattr(cfg, "norm_topk_prob", False))
        # Hunyuan MoE (transformers' HunYuanMoEV1Gate): a float32 router (wg, float32 in any dtype) of the hidden state
        # in float32, the softmax's top k renormalised; float32 weights
        self.hunyuan = cfg.model_type == "hunyuan_v1_moe"
        # transformers' Mixtral keeps the routing weights in float32 (its products with the experts' outputs too);
        # Qwen's round them to the model's dtype first
        self.float_weights = cfg.model_type == "mixtral" or self.hunyuan
        # gpt-oss: a router with a bias, the softmax over the top k logits (in the model's dtype), experts with
        # biases and a clamped SwiGLU (reference.OaiExperts)
        self.oai = cfg.model_type == "gpt_oss"
        self.alpha, self.limit = float(getattr(cfg, "swiglu_alpha", 1.702)), float(getattr(cfg, "swiglu_limit", 7.0))
        # GLM-4.5 (transformers' Glm4MoeTopkRouter): a float32 router (its weight and e_score_correction_bias kept
        # float32 in any dtype), sigmoid scores, the bias added for the choice only, group-limited top k (n_group,
        # topk_group), renormalised where norm_topk_prob says, scaled by routed_scaling_factor; float32 weights
        # Nemotron 3's (transformers' NemotronHTopkRouter) is GLM-4.5's (`GROUPED`)
        self.glm = cfg.model_type in GROUPED
        # Granite MoE (transformers' GraniteMoeTopKRouter): the top k of the logits (in float32), their softmax
        # rounded to the model's dtype
        self.granite = cfg.model_type in _GRANITE_ROUTER
        # ERNIE 4.5 MoE (transformers' Ernie4_5_MoeTopKRouter): a float32 router (its weight and moe_statics'
        # e_score_correction_bias), the softmax's top k chosen with the bias added, their weights (without it)
        # divided by their sum clamped to moe_norm_min, rounded to the model's dtype
        self.ernie = cfg.model_type == "ernie4_5_moe"
        self.norm_min = float(getattr(cfg, "moe_norm_min", 1e-12) or 0.0)
        # DeepSeek-V2 (transformers' DeepseekV2TopkRouter): a float32 router, the softmax's top k (greedy) or that of
        # the topk_group groups of the best experts (group_limited_greedy), times routed_scaling_factor, never
        # renormalised (norm_topk_prob unread); float32 weights
        self.v2 = cfg.model_type == "deepseek_v2"
        if self.v2:
            self.groups, self.topk_group = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
            self.limited = getattr(cfg, "topk_method", "greedy") == "group_limited_greedy"
            self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0))
            self.float_weights = True
        # MiniMax-M2 (transformers' MiniMaxM2TopKRouter): a router in the model's dtype, sigmoid scores in float32,
        # the block's e_score_correction_bias (in the model's dtype, as transformers holds it) added for the choice
        # only, the top k always renormalised, never scaled; float32 weights
        self.minimax = cfg.model_type == "minimax_m2"
        # Llama 4 (transformers' Llama4TextMoe): a router in the model's dtype (feed_forward.router), the top k logits'
        # sigmoid (in float32, rounded to the model's dtype) scaling each token's INPUT to its experts, whose outputs
        # are summed unweighted (`forward`), and a shared expert (feed_forward.shared_expert) added unscaled
        self.llama4 = cfg.model_type == "llama4_text"
        # Phi-3.5-MoE (transformers' PhimoeTopKRouter in eval mode): the sparsemixer's two experts, each the max of
        # the logits (the first's left out for the second) with the softmax of those within router_jitter_noise of it
        # (relatively) as its weight, in the model's dtype (`_sparsemixer_route`); input_jitter_noise is training's
        self.phimoe = cfg.model_type == "phimoe"
        self.jitter = float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) if self.phimoe else 0.0
        self.gate = _Gate(e, h, torch.float32 if self.glm or self.ernie or self.v2 or self.hunyuan else dtype,
                          bias=self.oai)
        if self.minimax:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=dtype), requires_grad=False)
            self.float_weights = True
        # LFM2-MoE (transformers' Lfm2MoeTopKRouter): sigmoid scores in the model's dtype, expert_bias (float32, where
        # use_expert_bias) added for the choice only, renormalised over their sum + 1e-6 where norm_topk_prob says,
        # scaled by routed_scaling_factor
        self.lfm2 = cfg.model_type == "lfm2_moe"
        if self.lfm2:
            self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0))
            if getattr(cfg, "use_expert_bias", True):
                self.gate.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32),
                                                                 requires_grad=False)
        if self.glm or self.ernie:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32),
                                                             requires_grad=False)
            self.groups, self.topk_group = int(getattr(cfg, "n_group", 1)), int(getattr(cfg, "topk_group", 1))
            self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0))
            self.float_weights = True
        self.lora = None  # the experts' adapter slots (lora.experts.ExpertLoRA), set by a LoRA manager
        # GPTQ experts (GPTQModel's qwen3_moe, mixtral): on the CPU each dequantized once at load into the stacked
        # float weights (as the CPU path does every GPTQ layer); on the GPU path (`int4_path`) kept int4, stacked,
        # and run by the int4 fused MoE (kernels.fused_moe_int4)
        self.method_for = None
        self.int4 = None  # the GPU path's GPTQ config of the experts (else None: float experts)
        names = _PROJ.get(cfg.model_type, _QWEN_PROJ)
        for name in filter(None, names):
            method = method_for([f"{prefix}.experts.0.{name}"])
            if method is None or isinstance(method, UnquantizedLinearMethod):
                continue
            if type(method).__name__ not in _INT4_METHODS:
                raise UnsupportedModelError(
                    f"{cfg.model_type}'s experts are quantized ({prefix}.experts.0.{name}, "
                    f"{type(method).__name__}): infer runs quantized experts only as GPTQ or AWQ",
                    "serve the float checkpoint, or a GPTQ one")
            self.method_for = method_for
        if self.method_for is not None and int4_path(torch.empty(0)):
            # every expert's gate and up alike (one stacked matmul), every down alike (method_for refuses others)
            # (Nemotron 3's experts: no gate, up alone)
            gate_up = method_for([f"{prefix}.experts.{i}.{n}" for n in names[:2] if n for i in range(e)])
            down = method_for([f"{prefix}.experts.{i}.{names[2]}" for i in range(e)])
            for method, what in ((gate_up, "gate/up"), (down, "down")):
                if type(method).__name__ not in _INT4_METHODS or method.config.bits != 4:
                    bits = getattr(getattr(method, "config", None), "bits", None)
                    raise UnsupportedModelError(
                        f"{cfg.model_type}'s experts' {what} projections ({prefix}.experts.N) are "
                        + (f"{bits}-bit GPTQ" if bits else "float beside GPTQ experts") + ": on a GPU infer runs "
                        "GPTQ experts only as 4-bit, every expert's projections quantized", "run it on the CPU "
                        "(--device cpu: dequantized at load), or serve a checkpoint of 4-bit GPTQ experts")
            self.int4 = (gate_up.config, down.config)
        # the hub's gpt-oss checkpoints (MXFP4 experts): kept packed as stored (Experts' Mxfp4Stack), on every device
        self.mxfp4 = self.oai and mxfp4_model(cfg)
        if self.mxfp4 and (h % 32 or inter % 32):
            raise UnsupportedModelError(f"config.json quantizes the experts as MXFP4 with hidden_size {h} and "
                                        f"intermediate_size {inter}: MXFP4 packs groups of 32 values",
                                        "both must be multiples of 32 (gpt-oss-20b's and 120b's are 2880)")
        # Nemotron 3 Super (moe_latent_size): the experts run in a latent of L dims, fc1_latent_proj [L, H] before
        # them and fc2_latent_proj [H, L] after (biases where mlp_bias says), the router and the shared experts on the
        # hidden state itself
        self.latent = getattr(cfg, "moe_latent_size", None) if cfg.model_type == "nemotron_h" else None
        if self.latent is not None:
            from .layers import MergedLinear
            bias = bool(getattr(cfg, "mlp_bias", False))
            for name, (a, b) in zip(_LATENT, ((h, self.latent), (self.latent, h))):
                names = [prefix + name]
                self.add_module(name[1:], MergedLinear(a, [b], names, bias, method_for(names), dtype))
        self.experts = Experts(e, self.latent or h, inter, dtype, self.int4, biases=self.oai, mxfp4=self.mxfp4,
                               gated=cfg.model_type != "nemotron_h")
        # the layer's module the block is (the loader's names of its parameters): Nemotron-H's mixer, LFM2-MoE's
        # feed_forward, else mlp
        self.module = {"nemotron_h": "mixer", "lfm2_moe": "feed_forward", "llama4_text": "feed_forward"}.get(
            cfg.model_type, "mlp")
        self.shared_expert = None
        if cfg.model_type in SHARED_EXPERT:
            shared = int(cfg.shared_expert_intermediate_size)
            # 0 wide (no shared expert: transformers builds it empty, its output 0): loaded, never run (its kernels
            # take no 0-wide rows)
            self.shared_width = shared
            self.shared_expert = MLP(cfg, f"{prefix}.shared_expert", method_for, dtype, inter=shared)
            self.shared_expert.down_proj.lora_consumer = None  # its output is gated: no delta left to the next norm
            self.shared_expert_gate = _Gate(1, h, dtype)
        # GLM-4.5's: a SwiGLU MLP of n_shared_experts * I every token runs, added unscaled; 0 wide where
        # n_shared_experts is 0 (transformers builds it empty, its output 0: loaded, never run)
        self.shared_experts = None
        if cfg.model_type in GLM_LAYOUT or (self.ernie and shared_width(cfg)):  # (ERNIE's: biases where use_bias says)
            self.shared_width = shared_width(cfg)
            self.shared_experts = MLP(cfg, f"{prefix}.shared_experts", method_for, dtype, inter=self.shared_width)
            self.shared_experts.down_proj.lora_consumer = None  # (its output is added to the experts': no delta left)
        if cfg.model_type == "nemotron_h":  # Nemotron 3's: a relu² MLP without gate (NemotronHMLP), added unscaled
            from .llama import UngatedMLP
            self.shared_width = shared_width(cfg)
            self.shared_experts = UngatedMLP(cfg, f"{prefix}.shared_experts", method_for, dtype,
                                             inter=self.shared_width)
            self.shared_experts.down.lora_consumer = None
        # GraniteMoeShared's shared_mlp (the layer's, beside block_sparse_moe: layers.N.shared_mlp.input_linear, gate
        # rows then up rows, and output_linear), added unscaled; none where shared_intermediate_size is 0
        if cfg.model_type == "granitemoeshared" and shared_width(cfg):
            self.shared_width = shared_width(cfg)
            self.shared_experts = MLP(cfg, f"{prefix.rpartition('.')[0]}.shared_mlp", method_for, dtype,
                                      inter=self.shared_width)
            self.shared_experts.down_proj.lora_consumer = None
        # Hunyuan MoE's shared_mlp (the block's: mlp.shared_mlp.gate_proj, up_proj, down_proj), a SwiGLU MLP of
        # intermediate_size every token runs, added unscaled: registered as shared_mlp (the checkpoint's name, by which
        # the loader routes its tensors), shared_experts its alias
        if self.hunyuan:
            self.shared_width = shared_width(cfg)
            self.shared_mlp = MLP(cfg, f"{prefix}.shared_mlp", method_for, dtype, inter=self.shared_width)
            self.shared_mlp.down_proj.lora_consumer = None
            object.__setattr__(self, "shared_experts", self.shared_mlp)
        if self.llama4:  # (registered as shared_expert, the checkpoint's name; not Qwen2-MoE's gated one)
            self.shared_width = shared_width(cfg)
            self.shared_expert = MLP(cfg, f"{prefix}.shared_expert", method_for, dtype, inter=self.shared_width)
            self.shared_expert.down_proj.lora_consumer = None
            object.__setattr__(self, "shared_experts", self.shared_expert)

    def gptq_layer(self, index: int, part: int, proj: str):
        """Expert `index`'s GPTQ projection `part` (0 gate, 1 up, 2 down), a one-shard MergedLinear of its own
        that holds the checkpoint's int4 tensors until dequantize_experts."""
        from .layers import MergedLinear
        if not hasattr(self, "_gptq"):
            self._gptq = {}
        key = (index, part)
        if key not in self._gptq:
            ex = self.experts
            name = f"{self.prefix}.experts.{index}.{proj}"
            shape = (ex.hidden, ex.inter) if part < 2 else (ex.inter, ex.hidden)
            with torch.device(ex.w13.device):  # (the meta device when --estimate checks the checkpoint's weights)
                self._gptq[key] = MergedLinear(shape[0], [shape[1]], [name], False, self.method_for([name]),
                                               ex.w13.dtype)
        return self._gptq[key]

    def _gptq_layers(self):
        """(index, part), layer of each GPTQ expert projection gptq_layer built, in order; those whose tensors
        MoeForCausalLM.check_expert_headers took from the headers (no layer built, nothing to dequantize) checked
        complete in that order as check_complete checks a layer (GPTQLinearMethod.check_loaded) and marked loaded."""
        layers = getattr(self, "_gptq", {})
        headers = self.__dict__.pop("_headers", {})
        if not headers:
            yield from sorted(layers.items())
            return
        for key in sorted({*layers, *headers}):
            if key in layers:
                yield key, layers[key]
                continue
            index, part = key
            names = headers[key]
            if len(names) < len(_GPTQ_NAMES):  # (all four: complete)
                method, proj, groups = self._header_methods[part]
                method.check_loaded([f"{self.prefix}.experts.{index}.{proj}"], {(0, n) for n in names}, groups)
            self.experts.loaded.add(key)

    def dequantize_experts(self) -> None:
        """Each GPTQ expert projection loaded into its float place in w13 / w2 (GPTQLinearMethod's dequantized
        weight, in the scales' precision as GPTQ runtimes compute it), then dropped; on the int4 path
        (`stack_experts`) into its int4 place instead."""
        if self.int4 is not None:
            self.stack_experts()
            return
        ex = self.experts
        for (index, part), layer in self._gptq_layers():
            layer.method.use_kernel = False
            layer.finish_loading()  # (a ModelLoadError for a missing qweight, qzeros or scales)
            w = layer.method.dequantized_weight(layer)
            if part < 2:
                ex.w13.data[index, ex.rows(part)].copy_(w)
            else:
                ex.w2.data[index].copy_(w)
            ex.loaded.add((index, part))
        self._gptq = {}

    def stack_experts(self) -> None:
        """The int4 path: each GPTQ expert projection's checkpoint tensors (qzeros as fields, v1 borrows undone)
        copied into its Int4Stack (gate's columns, then up's; up's alone where there is no gate), then dropped; an
        expert's gate and up must share their g_idx (one matmul); each stack's act-order experts sorted by group, and
        its group size kept where every g_idx is then plain (Int4Stack.sort_by_group)."""
        ex = self.experts
        for (index, part), layer in self._gptq_layers():
            layer.method.check_complete(layer)  # (a ModelLoadError for a missing qweight, qzeros or scales)
            stack = ex.w13_int4 if part < 2 else ex.w2_int4
            cols = ex.rows(part) if part < 2 else slice(None)  # (w13's rows are the stack's columns)
            zcols = slice(cols.start // 8, cols.stop // 8) if part < 2 else slice(None)
            stack.words[index, :, cols].copy_(layer.qweight)
            stack.zeros[index, :, zcols].copy_(layer.qzeros)
            stack.scales[index, :, cols].copy_(layer.scales)
            other = self._gptq.get((index, 0)) if part == 1 else None
            if other is not None and not layer.g_idx.is_meta and not torch.equal(other.g_idx.cpu(), layer.g_idx.cpu()):
                raise ModelLoadError(f"{layer.names[0]}.g_idx differs from {other.names[0]}.g_idx",
                                     "an expert's gate and up projections, which infer multiplies as one matmul, "
                                     "must share their act-order")
            stack.g_idx[index].copy_(layer.g_idx)
            ex.loaded.add((index, part))
        self._gptq = {}
        for stack in (ex.w13_int4, ex.w2_int4):
            if stack.g_idx.is_meta:  # (--estimate's check of the checkpoint: no values to read)
                continue
            stack.sort_by_group(stack.g_idx.shape[1] if stack.config.group_size == -1 else stack.config.group_size)

    def route(self, x: torch.Tensor):
        """(the top k routing weights [T, k] (float32 for Mixtral, else the model's dtype), their experts [T, k])."""
        if self.glm:
            return self._glm_route(x)
        if self.v2:
            return self._v2_route(x)
        if self.minimax:
            scores = torch.sigmoid(self.gate(x).float())
            ids = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            return weights / weights.sum(dim=-1, keepdim=True), ids
        if self.lfm2:
            return self._lfm2_route(x)
        if self.phimoe:
            return self._sparsemixer_route(x)
        if self.llama4:  # (transformers' Llama4Router: the top k logits, their sigmoid in float32)
            top, ids = torch.topk(self.gate(x), self.top_k, dim=1)
            return torch.sigmoid(top.float()).to(x.dtype), ids
        if self.ernie:
            probs = torch.softmax(self.gate(x.float()), dim=-1, dtype=torch.float32)
            ids = torch.topk(probs + self.gate.e_score_correction_bias, self.top_k, dim=-1)[1]
            weights = probs.gather(1, ids)
            return (weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)).to(x.dtype), ids
        # in the model's dtype, as transformers' F.linear (Hunyuan's float32 router: of x in float32)
        logits = self.gate(x.float() if self.hunyuan else x)
        if self.granite:
            top, ids = torch.topk(logits.float(), self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), ids
        if self.oai:  # gpt-oss's GptOssTopKRouter: the top k logits, then their softmax (in the logits' dtype)
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(x.dtype)), ids

    def _glm_route(self, x: torch.Tensor):
        """GLM-4.5's routing, transformers' Glm4MoeTopkRouter's ops: (float32 weights [T, k], experts [T, k])."""
        scores = torch.sigmoid(self.gate(x.float()))
        choice = scores + self.gate.e_score_correction_bias
        t, e = choice.shape
        per = e // self.groups
        group_scores = choice.view(t, self.groups, per).topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        choice = choice.masked_fill(~kept.unsqueeze(-1).expand(t, self.groups, per).reshape(t, e), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def _sparsemixer_route(self, x: torch.Tensor):
        """Phi-3.5-MoE's routing, transformers' sparsemixer in eval mode (deterministic: no Gumbel sampling, its
        multiplier the softmax's value itself): (weights [T, 2] in the model's dtype, experts [T, 2]). Expert 1 is the
        top logit; its weight the softmax over the logits whose gap below it, relative to max(|logit|, top), is at
        most 2 * router_jitter_noise (the others masked to -inf). Expert 2 is the top of the logits with expert 1's
        masked, weighted so against that second top (the gaps still of the unmasked logits)."""
        scores = self.gate(x)
        weights, ids = [], []
        masked = scores
        for _ in range(2):
            top, best = masked.max(dim=-1, keepdim=True)
            factor = scores.abs().clamp(min=top)
            gates = masked.masked_fill((top - scores) / factor > 2 * self.jitter, float("-inf"))
            weights.append(torch.softmax(gates, dim=-1).gather(-1, best))
            ids.append(best)
            masked = torch.scatter(scores, -1, best, float("-inf"))
        return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)

    def _lfm2_route(self, x: torch.Tensor):
        """LFM2-MoE's routing, transformers' Lfm2MoeTopKRouter's ops: (weights [T, k] in the model's dtype, experts
        [T, k])."""
        scores = torch.sigmoid(self.gate(x))
        bias = getattr(self.gate, "e_score_correction_bias", None)
        if bias is None:
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
        else:
            ids = torch.topk(scores + bias, self.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return weights * self.scaling, ids

    def _v2_route(self, x: torch.Tensor):
        """DeepSeek-V2's routing, transformers' DeepseekV2TopkRouter's ops: (float32 weights [T, k], experts [T, k])."""
        scores = torch.softmax(self.gate(x.float()), dim=-1, dtype=torch.float32)
        if self.limited:
            t, e = scores.shape
            per = e // self.groups
            best = torch.topk(scores.view(t, self.groups, per).max(dim=-1).values, k=self.topk_group, dim=-1,
                              sorted=False)[1]
            kept = torch.zeros(t, self.groups, dtype=torch.bool, device=x.device).scatter_(1, best, True)
            scores = scores.masked_fill(~kept.unsqueeze(-1).expand(t, self.groups, per).reshape(t, e), 0.0)
        weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, ids

    def moe_experts(self):
        """(w13, w2, top_k, x's dtype, the routing weights' dtype) as the fused MoE takes them (the float stacks, or
        the int4 ones' reference.Int4Experts): what kernels.moe_tune tunes at an engine start."""
        ex = self.experts
        dtype = ex.w13.dtype  # (the model's: GLM-4.5's router is float32)
        w13, w2 = (ex.w13_int4.experts(), ex.w2_int4.experts()) if self.int4 is not None else (ex.w13, ex.w2)
        if ex.mxfp4:
            w13, w2 = ex.w13_mxfp4.experts(), ex.w2_mxfp4.experts()
        return w13, w2, self.top_k, dtype, torch.float32 if self.float_weights else dtype

    def warm_block_sizes(self, max_tokens: int, decode: bool = False) -> list[int]:
        """The fused MoE run once on zeros at the fewest tokens of each launch config (BLOCK_M, and the tuned
        table's tiles, warps and stages) a step of up to max_tokens tokens chooses beyond decode's
        (kernels.fused_moe_config_steps), every expert routed to: its variants compiled
        before a long prefill needs them (LLMEngine.warm_kernels; its short prompts reach decode's alone). With the
        experts' adapter slots (`lora`) each such step runs again with every token in slot 0, at decode too: the
        warm-up's requests have no adapter, a step with one launches the unweighted down matmul and the adapters'
        pairs, which choose their BLOCK_M over the slots' virtual experts (kernels.moe._LoRAPairs). `decode`:
        decode's BLOCK_M too (reload_weights: new experts' layout, no requests to reach it). Returns the token
        counts run; none without Triton."""
        ex = self.experts
        probe = ex.w13  # (the model's dtype and device; [E, 0, 0] on the int4 path)
        w13, w2 = self.moe_experts()[:2]
        counts = {t for t in kernels.fused_moe_config_steps(probe, max_tokens, w13, w2, self.top_k).values()
                  if t > 1 or decode}
        slots = self.lora
        if slots is not None:
            virtual = slots.a13.shape[0] * ex.num_experts
            counts |= set(kernels.fused_moe_block_steps(probe, max_tokens, self.top_k, virtual).values())
        for t in sorted(counts):
            x = probe.new_zeros(t, ex.hidden)
            ids = torch.arange(t * self.top_k, device=probe.device).view(t, self.top_k) % ex.num_experts
            weights = torch.full((t, self.top_k), 1 / self.top_k, device=probe.device,
                                 dtype=torch.float32 if self.float_weights else probe.dtype)
            in_slot0 = torch.zeros(t, dtype=torch.int64, device=probe.device)
            for lora in ((None,) if slots is None else (None, MoELoRA(slots.a13, slots.b13, slots.a2, slots.b2,
                                                                         in_slot0))):
                self.run_experts(x, weights, ids, lora)
        return sorted(counts)

    def run_experts(self, x, weights, ids, lora):
        """The fused MoE of the experts as the block holds them: float, int4 (kernels.fused_moe_int4) or MXFP4
        (kernels.fused_moe_mxfp4)."""
        ex = self.experts
        if self.int4 is not None:
            return kernels.fused_moe_int4(x, ex.w13_int4.experts(), ex.w2_int4.experts(), weights, ids, lora,
                                          self.oai_experts())
        if ex.mxfp4:
            return kernels.fused_moe_mxfp4(x, ex.w13_mxfp4.experts(), ex.w2_mxfp4.experts(), weights, ids, lora,
                                           self.oai_experts())
        return kernels.fused_moe(x, ex.w13, ex.w2, weights, ids, lora, self.oai_experts())

    def _scaled_inputs_experts(self, x, weights, ids, lora):
        """Llama 4's experts (transformers' Llama4TextMoe): expert e_j of token t runs on x[t] * weights[t, j] (the
        input scaled, in the model's dtype) and the k outputs are summed, weighed 1: the fused MoE over the k scaled
        copies of each token, one expert each."""
        t, k = ids.shape
        if k == 1:  # (Scout's and Maverick's top 1: the token's one copy)
            return self.run_experts(x * weights, torch.ones_like(weights), ids, lora)
        copies = (x[:, None, :] * weights[:, :, None]).reshape(t * k, -1)
        ones = torch.ones(t * k, 1, dtype=weights.dtype, device=x.device)
        if lora is not None:  # (each copy in its token's adapter slot)
            lora = lora._replace(token_slots=lora.token_slots.repeat_interleave(k))
        return self.run_experts(copies, ones, ids.reshape(t * k, 1), lora).view(t, k, -1).sum(1)

    def oai_experts(self) -> OaiExperts | None:
        """gpt-oss's expert biases and activation as the fused MoE takes them (None for the other families)."""
        ex = self.experts
        return OaiExperts(ex.b13, ex.b2, self.alpha, self.limit) if self.oai else None

    def forward(self, x, ctx=None):
        """(the block's output [T, H], None: no LoRA delta left to the next norm)."""
        weights, ids = self.route(x)
        # the experts' adapters (lora.experts sets `lora`: its `moe_lora(batch)`, a kernels.reference.MoELoRA, or
        # None where no token's adapter adapts them)
        batch = getattr(ctx, "lora", None) if self.lora is not None else None
        lora = self.lora.moe_lora(batch) if batch is not None else None
        if self.llama4:
            out = self._scaled_inputs_experts(x, weights, ids, lora)
        elif self.latent is not None:
            out = self.fc2_latent_proj(self.run_experts(self.fc1_latent_proj(x, ctx), weights, ids, lora), ctx)
        else:
            out = self.run_experts(x, weights, ids, lora)
        if self.shared_expert is not None and self.shared_width and not self.llama4:
            shared, _ = self.shared_expert(x, ctx)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        if self.shared_experts is not None and self.shared_width:
            out = out + self.shared_experts(x, ctx)[0]
        return out, None


# a sparse layer's tensors as checkpoints name them (after the loader drops "model."): the router, an expert's
# projection, or the stacked experts of transformers' own parameter names
# (GLM-4.5's router has an e_score_correction_bias too)
# (Nemotron 3's: under the layer's mixer, its experts' up_proj without gate, stacked [E, I, H] or apart)
# (LFM2-MoE's: under its feed_forward, its router's bias beside the router as expert_bias)
_TENSOR = re.compile(r"^layers\.(\d+)\.(mlp|block_sparse_moe|mixer|feed_forward)\.(?:gate\.(?:weight|"
                     r"e_score_correction_bias)|expert_bias|"
                     r"experts\.(\d+)\.(\w+)\.(weight|qweight|qzeros|scales|g_idx|bias)|"
                     r"experts\.(gate_up_proj|up_proj|down_proj))$")


# gpt-oss's sparse layer as transformers names it: the router (with a bias) and the stacked experts with biases
# (gate_up_proj [E, H, 2I]: x @ W, its gate and up columns interleaved; down_proj [E, I, H])
_OAI_TENSOR = re.compile(r"^layers\.(\d+)\.mlp\.(?:router\.(weight|bias)|experts\.(gate_up_proj|down_proj)"
                         r"(_bias|_blocks|_scales)?)$")
# Granite MoE's sparse layer as its checkpoints name it (transformers 5 renames them at load: its conversion_mapping),
# by the name infer's loader reads
_GRANITE_NAMES = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
                  "router.layer.weight": "gate.weight", "router.weight": "gate.weight"}
# GraniteMoeShared's shared MLP, beside the layer's block_sparse_moe (models.moe.SparseMoeBlock keeps it)
_SHARED_MLP = re.compile(r"^layers\.(\d+)\.shared_mlp\.(input_linear|output_linear)\.(\w+)$")
_LAYER_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
# an expert's GPTQ tensor apart (GPTQModel's layout), as MoeForCausalLM.check_expert_headers takes them in bulk
_GPTQ_NAMES = ("qweight", "qzeros", "scales", "g_idx")
_GPTQ_EXPERT = re.compile(r"^layers\.(\d+)\.(mlp|block_sparse_moe|mixer|feed_forward)\.experts\.(\d+)\.(\w+)\."
                          r"(qweight|qzeros|scales|g_idx)$")
_ROUTER32 = re.compile(r"\.(?:mlp\.(?:gate\.)?(?:moe_statics\.)?|mixer\.gate\.)(weight|e_score_correction_bias)$")
# ERNIE 4.5 MoE's router bias as the hub stores it ([1, E]: mlp.moe_statics) and as transformers 5 names it
_ERNIE_BIAS = re.compile(r"\.mlp\.(?:gate\.)?moe_statics\.e_score_correction_bias$")
# MiniMax-M2's router bias as its checkpoints store it, beside the router (block_sparse_moe.e_score_correction_bias;
# transformers 5 names it mlp.e_score_correction_bias): the loader's name of it under the router
_MINIMAX_BIAS = re.compile(r"\.(block_sparse_moe|mlp)\.e_score_correction_bias$")
# ERNIE 4.5 MoE's multi-token-prediction layer as the hub stores it (ERNIE-4.5-21B-A3B-PT: model.mtp_block.0...)
_ERNIE_MTP = re.compile(r"^(?:model\.)?mtp_(?:block|emb_norm|hidden_norm|linear_proj)\.\d+\.")


def _llama4_tensor(key: str, t: torch.Tensor, raw: torch.Tensor | None):
    """A Llama 4 sparse layer's tensor as the loader reads it: its router (feed_forward.router) as gate.weight, its
    stacked experts (transformers' Llama4TextExperts: gate_up_proj [E, H, 2I], the gate's I columns then the up's;
    down_proj [E, I, H], both x @ W) transposed into infer's [E, 2I, H] and [E, H, I]."""
    if key.endswith(".feed_forward.router.weight"):
        return key.removesuffix(".router.weight") + ".gate.weight", t, raw
    if key.endswith((".feed_forward.experts.gate_up_proj", ".feed_forward.experts.down_proj")) and t.dim() == 3:
        return key, t.transpose(1, 2), None if raw is None else raw.transpose(1, 2)
    return key, t, raw


def mtp_tensor(cfg, name: str) -> bool:
    """Whether checkpoint tensor `name` is in one of GLM-4.5's multi-token-prediction layers (the
    num_nextn_predict_layers layers after num_hidden_layers, which transformers drops too) or ERNIE 4.5 MoE's
    (mtp_block.K, mtp_emb_norm.K, mtp_hidden_norm.K, mtp_linear_proj.K: transformers ignores its "mtp" keys): the
    loader skips them; and Qwen3-Next's, Qwen3.5's and Qwen3.5 MoE's (mtp.*, which transformers ignores too)."""
    return mtp_filter(cfg)(name)


def mtp_filter(cfg):
    """mtp_tensor of `cfg` as a function of the name, cfg's fields read once: a pass over a checkpoint's names
    (DeepSeek-V3's 180,000 GPTQ tensors) would spend seconds in transformers' config attribute lookups."""
    kind = getattr(cfg, "model_type", None)
    if kind == "ernie4_5_moe":
        return lambda name: _ERNIE_MTP.match(name) is not None
    if kind in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "nemotron_h"):
        return lambda name: name.startswith("mtp.")
    if kind not in ("glm4_moe", "deepseek_v3", "glm4_moe_lite"):
        return lambda name: False
    n = int(cfg.num_hidden_layers)
    mtp = int(getattr(cfg, "num_nextn_predict_layers", getattr(cfg, "num_mtp_layers", 0)) or 0)

    def in_mtp_layer(name: str) -> bool:
        m = _LAYER_KEY.match(name)
        return m is not None and n <= int(m.group(1)) < n + mtp
    return in_mtp_layer


def float32_tensor(cfg, name: str) -> bool:
    """Whether checkpoint tensor `name` is loaded as float32 in any dtype: GLM-4.5's router (its weight and
    e_score_correction_bias, as transformers keeps them: SparseMoeBlock), Hunyuan MoE's (mlp.gate.wg.weight)."""
    return float32_filter(cfg)(name)


def float32_filter(cfg):
    """float32_tensor of `cfg` as a function of the name, cfg's fields read once (as mtp_filter)."""
    kind = getattr(cfg, "model_type", None)
    if kind == "hunyuan_v1_moe":
        return lambda name: name.endswith(".mlp.gate.wg.weight")
    if kind not in ("glm4_moe", "ernie4_5_moe", "nemotron_h", "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "dots1"):
        return lambda name: False
    return lambda name: _ROUTER32.search(name) is not None and ".mlp.moe_statics.weight" not in name


def layer_index(key: str) -> int:
    return int(key.split(".")[1])


class MoeForCausalLM:
    """The mixin of an MoE model class (registry.model_class): the loader's routing of the experts' tensors."""

    def _moe_block(self, key: str):
        m = _TENSOR.match(key)
        if m is None:
            return None, m
        layer = int(m.group(1))
        if layer >= len(self.layers) or not isinstance(getattr(self.layers[layer], "mlp", None), SparseMoeBlock):
            return None, m
        block = self.layers[layer].mlp
        # Qwen's mlp; Mixtral's block_sparse_moe, or mlp as transformers 5 names its module (its save_pretrained
        # writes block_sparse_moe back, a state_dict saved as it is keeps mlp: transformers reads both)
        if m.group(2) not in (block.prefix.rpartition(".")[2], block.module):
            return None, m
        return block, m

    def load_expert_tensor(self, key: str, t: torch.Tensor, name: str, raw: torch.Tensor | None = None) -> str | None:
        """Load checkpoint tensor `name` (`key` without "model."; `raw`: as stored, before the loader's cast to the
        model's dtype) into a sparse layer; returns the model's parameter it went into, or None where it is no sparse
        layer's (the loader's usual routing then). GLM-4.5's multi-token-prediction layers (after num_hidden_layers:
        num_nextn_predict_layers of them, which transformers drops too) are skipped: "" (no parameter)."""
        if mtp_tensor(self.config, key):
            return ""
        if self.config.model_type in _GRANITE_ROUTER:  # (the hub's names of Granite MoE's router and stacked experts)
            head, sep, tail = key.partition(".block_sparse_moe.")
            if sep and tail in _GRANITE_NAMES:
                key = f"{head}{sep}{_GRANITE_NAMES[tail]}"
        if self.config.model_type == "hunyuan_v1_moe" and key.endswith(".mlp.gate.wg.weight"):  # (its router's name)
            key = key.removesuffix(".wg.weight") + ".weight"
        if self.config.model_type == "ernie4_5_moe" and _ERNIE_BIAS.search(key):  # (as GLM-4.5's, [E])
            key = _ERNIE_BIAS.sub(".mlp.gate.e_score_correction_bias", key)
            t = t.reshape(-1)
            raw = raw.reshape(-1) if raw is not None else None
        if self.config.model_type == "minimax_m2":
            key = _MINIMAX_BIAS.sub(r".\1.gate.e_score_correction_bias", key)
        if self.config.model_type == "phimoe" and key.endswith(".mlp.router.weight"):  # (transformers 5's name of its
            key = key.removesuffix(".router.weight") + ".gate.weight"  # router, block_sparse_moe.gate on the hub)
        if self.config.model_type == "llama4_text":  # (its router's name; its experts stored [E, H, 2I], [E, I, H])
            key, t, raw = _llama4_tensor(key, t, raw)
        shared = _SHARED_MLP.match(key) if self.config.model_type == "granitemoeshared" else None
        if shared is not None:
            return self._load_shared_mlp(shared, t)
        if self.config.model_type == "gpt_oss" and _OAI_TENSOR.match(key):
            return self._load_oai_tensor(key, t, name)
        block, m = self._moe_block(key)
        if block is None:
            return None
        layer = f'{key.split(".")[1]}.{block.module}'
        experts = block.experts
        e, h, inter = experts.num_experts, experts.hidden, experts.inter

        def check(shape, dest: torch.Tensor):
            if tuple(t.shape) != tuple(shape):
                raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}",
                                     "the weights do not match config.json")
            if dest.is_floating_point() and not t.is_floating_point():
                raise ModelLoadError(f"{name} is {str(t.dtype).removeprefix('torch.')}: infer runs a mixture of "
                                     "experts only with float weights", "use the float checkpoint")

        if m.group(3) is None and m.group(6) is None:  # the router (GLM-4.5's: float32, from the stored values)
            part = key.rpartition(".")[2]
            if part == "expert_bias":  # (LFM2-MoE's, beside its router: float32, as transformers keeps it)
                part, t = "e_score_correction_bias", raw if raw is not None else t
            dest = getattr(block.gate, part, None)
            if dest is None:
                return None  # (the loader names it as a tensor config.json has no place for)
            t = raw if (block.glm or block.ernie or block.v2 or block.hunyuan) and raw is not None else t
            check(dest.shape, dest)
            dest.data.copy_(t)
            return f"layers.{layer}.gate.{part}"
        if block.int4 is not None and (m.group(6) is not None or m.group(5) == "weight"):
            raise ModelLoadError(f"{name} is a float expert's weight in a checkpoint whose config.json quantizes the "
                                 "experts (GPTQ)", "the checkpoint does not match its quantization_config")
        if m.group(6) is not None:  # stacked: [E, 2I, H] or [E, H, I]
            dest = experts.w2 if m.group(6) == "down_proj" else experts.w13
            check(dest.shape, dest)
            dest.data.copy_(t)
            parts = (2,) if m.group(6) == "down_proj" else experts.parts()[:-1]
            experts.loaded.update((i, p) for i in range(e) for p in parts)
            return f"layers.{layer}.experts.{'w2' if parts == (2,) else 'w13'}"
        index, proj = int(m.group(3)), m.group(4)
        names = _PROJ.get(self.config.model_type, _QWEN_PROJ)
        if index >= e or proj not in names:
            return None  # the loader names it as a tensor config.json has no place for
        part = names.index(proj)
        if m.group(5) == "bias":  # gpt-oss's experts apart (GPTQModel's checkpoints): each projection's bias
            if experts.b13 is None:
                return None  # (the loader names it as a tensor config.json has no place for)
            dest = experts.b13[index, part * inter:(part + 1) * inter] if part < 2 else experts.b2[index]
            check(dest.shape, dest)
            dest.copy_(t)
            experts.loaded.add((index, part + 3))
            return f"layers.{layer}.experts.{'b13' if part < 2 else 'b2'}"
        if m.group(5) != "weight":  # a GPTQ expert's tensor: into its own GPTQ layer, dequantized by check_experts
            if block.method_for is None:
                raise ModelLoadError(f"{name} is a quantized expert's tensor in a checkpoint whose config.json has no "
                                     "quantization_config for it", "use the float checkpoint, or its config.json")
            layer = block.gptq_layer(index, part, proj)
            layer.load_shard(m.group(5), 0, t)
            return f"layers.{layer_index(key)}.{block.module}.experts.{'w13' if part < 2 else 'w2'}"
        if part < 2:
            dest = experts.w13
            check((inter, h), dest)
            dest.data[index, experts.rows(part)].copy_(t)
        else:
            dest = experts.w2
            check((h, inter), dest)
            dest.data[index].copy_(t)
        experts.loaded.add((index, part))
        return f"layers.{layer}.experts.{'w13' if part < 2 else 'w2'}"

    def check_expert_headers(self, entries, loaded: set[str]) -> list:
        """loader.check_weights' pass over the checkpoint's headers ((name, (safetensors dtype, shape)) in
        `entries`, a .bin file's (name, meta tensor)) before its usual one: each GPTQ expert's tensors (qweight,
        qzeros, scales, g_idx of layers.N.mlp.experts.I.PROJ) checked in bulk against the one shape per layer,
        projection and tensor name that load_expert_tensor would check them against, not fed one by one to a
        GPTQ layer built on the meta device per expert projection (a GPTQ Llama-4-Scout has 10,560 such tensors,
        DeepSeek-V3 178,000: half a minute, ten). Returns the entries it did not take, in their order (a tensor of
        another shape among them: the usual path refuses it naming it, where the files have it); adds to `loaded`
        the parameters the taken ones go into. What each expert projection had is kept for dequantize_experts or
        stack_experts, which refuse an incomplete one as check_complete would (_gptq_layers), and check_experts one
        with no tensor at all. Left to the usual path: a projection whose experts differ in their quantization
        (`dynamic` rules), whose widths do not pack (create_weights names it), AWQ's, gpt-oss's, an expert or a
        projection the model has no place for."""
        from ..quant.gptq_linear import GPTQLinearMethod
        from .loader import module_key
        rest = []
        if self.config.model_type == "gpt_oss":  # (its GPTQ experts' gate and up interleaved: _load_oai_tensor)
            return list(entries)
        specs: dict[tuple[str, str, str], tuple | None] = {}
        for entry in entries:
            name, header = entry
            m = None if isinstance(header, torch.Tensor) else _GPTQ_EXPERT.match(module_key(name))
            if m is None:
                rest.append(entry)
                continue
            at = m.group(1, 2, 4)
            spec = specs[at] if at in specs else specs.setdefault(at, self._expert_spec(m, GPTQLinearMethod))
            # spec: (the experts' count, the part, {tensor name: shape}, [the names each expert had], into)
            if spec is None or int(m.group(3)) >= spec[0] or tuple(header[1]) != spec[2][m.group(5)]:
                rest.append(entry)
                continue
            spec[3][int(m.group(3))].add(m.group(5))
            loaded.add(spec[4])
        for (layer, _, _), spec in specs.items():
            if spec is not None:
                block = self.layers[int(layer)].mlp
                headers = block.__dict__.setdefault("_headers", {})
                headers.update(((index, spec[1]), names) for index, names in enumerate(spec[3]) if names)
        return rest

    def _expert_spec(self, m: re.Match, gptq) -> tuple | None:
        """check_expert_headers' expectations of expert projection m (a match of _GPTQ_EXPERT) across a layer's
        experts: (their count, the part, {tensor name: shape}, a set for each expert's names, the parameter they go
        into); None where the usual path is to see them (see check_expert_headers)."""
        key = f"layers.{m.group(1)}.{m.group(2)}.experts.0.{m.group(4)}.qweight"
        block, _ = self._moe_block(key)
        names = _PROJ.get(self.config.model_type, _QWEN_PROJ)
        if block is None or block.method_for is None or block.oai or mtp_tensor(self.config, key) \
                or m.group(4) not in names:
            return None
        ex, proj = block.experts, m.group(4)
        part = names.index(proj)
        try:  # (every expert's config alike: its own method_for([name]) would be the same)
            method = block.method_for([f"{block.prefix}.experts.{i}.{proj}" for i in range(ex.num_experts)])
        except (ModelLoadError, UnsupportedModelError):
            return None
        k, n = (ex.hidden, ex.inter) if part < 2 else (ex.inter, ex.hidden)
        if type(method) is not gptq or not method.packs(k, n):
            return None
        block.__dict__.setdefault("_header_methods", {})[part] = method, proj, method.config.num_groups(k)
        into = f"layers.{m.group(1)}.{block.module}.experts.{'w13' if part < 2 else 'w2'}"
        return ex.num_experts, part, method.expected_shapes(k, n), [set() for _ in range(ex.num_experts)], into

    def _load_shared_mlp(self, m: re.Match, t: torch.Tensor) -> str | None:
        """GraniteMoeShared's layers.N.shared_mlp.input_linear (gate rows, then up rows: the shared MLP's gate_up_proj
        stored fused) or output_linear (its down_proj), into the sparse block's `shared_experts`."""
        layer = int(m.group(1))
        mlp = self.layers[layer].mlp.shared_experts if layer < len(self.layers) else None
        if mlp is None:
            return None  # (the loader names it as a tensor config.json has no place for)
        if m.group(2) == "input_linear":
            mlp.gate_up_proj.load_fused(m.group(3), t)
            return f"layers.{layer}.mlp.shared_experts.gate_up_proj.{m.group(3)}"
        mlp.down_proj.load_shard(m.group(3), 0, t)
        return f"layers.{layer}.mlp.shared_experts.down_proj.{m.group(3)}"

    def _load_oai_tensor(self, key: str, t: torch.Tensor, name: str) -> str | None:
        """load_expert_tensor of gpt-oss's stacked tensors: the router's weight and bias; gate_up_proj [E, H, 2I]
        transposed to w13 [E, 2I, H], its gate and up rows kept interleaved (2j, 2j + 1: reference.OaiExperts; its
        bias too), down_proj [E, I, H] transposed to w2 [E, H, I]. (GPTQModel's per-expert gate_proj and up_proj
        are the halves of that interleaved order: load_expert_tensor stacks them so.)"""
        m = _OAI_TENSOR.match(key)
        if int(m.group(1)) >= len(self.layers):
            return None
        if m.group(4) in ("_blocks", "_scales") and self.layers[int(m.group(1))].mlp.mxfp4:
            return self._load_mxfp4(m, t, name)
        if m.group(4) in ("_blocks", "_scales"):  # MXFP4 tensors without config.json's word: dequantized at load
            block = self.layers[int(m.group(1))].mlp
            held = block.__dict__.setdefault("_mxfp4", {}).setdefault(m.group(3), {})
            held[m.group(4)] = (t, name)
            into = f"layers.{m.group(1)}.mlp.experts.{'w13' if m.group(3) == 'gate_up_proj' else 'w2'}"
            if len(held) < 2:
                return into
            (blocks, bname), (scales, sname) = held.pop("_blocks"), held.pop("_scales")
            ex = block.experts
            rows, cols = ex.w13.shape[1:] if m.group(3) == "gate_up_proj" else ex.w2.shape[1:]
            want = (ex.num_experts, rows, cols // 32)
            if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (*want, 16) or tuple(scales.shape) != want:
                raise ModelLoadError(f"{bname} {tuple(blocks.shape)} and {sname} {tuple(scales.shape)} are no "
                                     f"MXFP4 tensors of shapes {(*want, 16)} and {want} (uint8)",
                                     "the weights do not match config.json")
            return self._load_oai_tensor(key.removesuffix(m.group(4)),
                                         mxfp4_dequantize(blocks, scales, ex.w13.dtype).transpose(1, 2), name)
        layer = int(m.group(1))
        block = self.layers[layer].mlp
        ex = block.experts
        e, h, inter = ex.num_experts, ex.hidden, ex.inter
        if m.group(2) is not None:  # the router
            dest, stored = (block.gate.weight, (e, h)) if m.group(2) == "weight" else (block.gate.bias, (e,))
            into = f"layers.{layer}.mlp.gate.{m.group(2)}"
        else:
            gate_up, bias = m.group(3) == "gate_up_proj", m.group(4) is not None
            dest = (ex.b13 if gate_up else ex.b2) if bias else (ex.w13 if gate_up else ex.w2)
            stored = ((e, 2 * inter) if gate_up else (e, h)) if bias else ((e, h, 2 * inter) if gate_up else
                                                                             (e, inter, h))
            into = f"layers.{layer}.mlp.experts.{('b' if bias else 'w') + ('13' if gate_up else '2')}"
        if tuple(t.shape) != stored:
            raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, config.json implies {stored}",
                                 "the weights do not match config.json")
        if m.group(3) is not None:
            if ex.mxfp4 and not bias:
                raise ModelLoadError(f"{name} is a float expert's weight in a checkpoint whose config.json quantizes "
                                     "the experts as MXFP4 (quantization_config)", "the checkpoint does not match "
                                     "its config.json: a float gpt-oss has no quantization_config")
            if m.group(4) is None:
                t = t.transpose(1, 2)  # x @ W: W [E, in, out] as the [E, out, in] of F.linear
            parts = (0, 1) if gate_up else (2,)
            ex.loaded.update((i, p + (3 if bias else 0)) for i in range(e) for p in parts)
        dest.data.copy_(t)
        return into

    def _load_mxfp4(self, m: re.Match, t: torch.Tensor, name: str) -> str:
        """gpt-oss's MXFP4 gate_up_proj / down_proj _blocks or _scales as stored, into the layer's Mxfp4Stack (no
        float copy; the stored [E, N, K / 32(, 16)] is already the [E, out, in] of F.linear, w13's rows in
        transformers' interleaved order): its shape and uint8 checked. Loaded: its parts (blocks 0-2, scales 6-8)."""
        ex = self.layers[int(m.group(1))].mlp.experts
        gate_up = m.group(3) == "gate_up_proj"
        stack = ex.w13_mxfp4 if gate_up else ex.w2_mxfp4
        dest = stack.blocks if m.group(4) == "_blocks" else stack.scales
        if t.dtype != torch.uint8 or tuple(t.shape) != tuple(dest.shape):
            raise ModelLoadError(f"{name} is {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}, config.json "
                                 f"implies MXFP4's uint8 {tuple(dest.shape)}", "the weights do not match config.json")
        dest.copy_(t)
        parts = ((0, 1) if gate_up else (2,)) if m.group(4) == "_blocks" else ((6, 7) if gate_up else (8,))
        ex.loaded.update((i, p) for i in range(ex.num_experts) for p in parts)
        return f"layers.{m.group(1)}.mlp.experts.{'w13' if gate_up else 'w2'}"  # (its [E, 0, 0] float place)

    def check_experts(self) -> None:
        """A ModelLoadError naming the first expert projection the checkpoint had no tensor for; GPTQ experts
        dequantized into the stacked weights."""
        names = _PROJ.get(self.config.model_type, _QWEN_PROJ)
        for block in self.modules():
            if isinstance(block, SparseMoeBlock):
                block.dequantize_experts()
                stacked = "gate_up_proj", "gate_up_proj", "down_proj"  # (gpt-oss's: transformers' own names)
                for index in range(block.experts.num_experts):
                    # gpt-oss's experts have biases too: parts 3, 4, 5 (loaded stacked, or apart by GPTQModel)
                    # MXFP4 experts: their blocks (parts 0-2) and scales (6-8)
                    for part in range(9 if block.mxfp4 else 6) if block.oai else block.experts.parts():
                        if (index, part) not in block.experts.loaded:
                            tensor = "qweight" if block.method_for is not None else "weight"  # (GPTQ / AWQ experts)
                            tensor = "bias" if part > 2 else tensor
                            what = f"{index}.{names[part % 3]}.{tensor}"
                            if block.oai and block.method_for is None:
                                what = stacked[part % 3] + ("_bias" if 3 <= part < 6 else "")
                                what += ("_blocks" if part < 3 else "_scales" if part > 5 else "") if block.mxfp4 \
                                    else ""
                            raise ModelLoadError(f"the checkpoint has no tensor {block.prefix}.experts.{what}",
                                                 "the model folder is incomplete")
                if block.mxfp4:
                    for name, stack in (("gate_up_proj", block.experts.w13_mxfp4),
                                        ("down_proj", block.experts.w2_mxfp4)):
                        _check_mxfp4_finite(f"{block.prefix}.experts.{name}", stack, block.experts.w13.dtype)


def _check_mxfp4_finite(name: str, stack: Mxfp4Stack, dtype: torch.dtype) -> None:
    """An MXFP4 stack whose values are inf in float32 (scale 255, OCP's NaN, or 253-254 with large codes) or in the
    model's dtype (a float16 beyond 65504) refused as loader._check_finite refuses float weights (the packed bytes
    are never a float tensor it sees): only the groups whose scale could overflow dequantized."""
    if stack.scales.is_meta:
        return
    big = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32)
    # the smallest scale whose largest code (6) may overflow dtype: 2^(s - 127) * 6 beyond its max
    first = 127 + int(torch.floor(torch.log2(big / 6)).item())
    risky = stack.scales >= first
    if not bool(risky.any()):
        return
    blocks, scales = stack.blocks[risky], stack.scales[risky]
    for wide in (torch.float32, dtype):
        values = mxfp4_dequantize(blocks.view(1, -1, 1, 16), scales.view(1, -1, 1), wide)[0]
        bad = (~values.isfinite()).any(-1).nonzero()
        if len(bad):
            where = risky.nonzero()[bad[0, 0]].tolist()
            at = f"expert {where[0]}, row {where[1]}, group {where[2]} (scale {scales[bad[0, 0]].item()})"
            if wide == torch.float32:
                raise ModelLoadError(f"{name}_blocks/_scales dequantize to non-finite values (inf) at {at}",
                                     "the checkpoint is broken: download or convert it again")
            raise ModelLoadError(f"{name}_blocks/_scales dequantize to values beyond {str(dtype)[6:]}'s range "
                                 f"(inf) at {at}", "use a wider --dtype (bfloat16 or float32)")


_CLASS: dict[str, type] = {}


def moe_model_class(base: str = "llama") -> type:
    """LlamaForCausalLM with the loader's routing of the experts' tensors (DecoderLayer builds a sparse layer's
    SparseMoeBlock); `base` "granite": GraniteForCausalLM's (Granite MoE: its four scalars); "hunyuan":
    HunYuanDenseV1ForCausalLM's (Hunyuan MoE: q and k rotated, then normed, its identity table to the kernels);
    "phimoe": Starcoder2ForCausalLM's (Phi-3.5-MoE: LayerNorms with biases); "olmo2": Olmo2ForCausalLM's (FlexOlmo:
    the norms after the attention and the MLP)."""
    if not _CLASS:
        from .llama import GraniteForCausalLM, HunYuanDenseV1ForCausalLM, LlamaForCausalLM
        _CLASS["llama"] = type("MoeForCausalLM", (MoeForCausalLM, LlamaForCausalLM), {
            "__doc__": "A mixture-of-experts model (models.moe): Llama's loop over its layers, a sparse layer's MLP a "
                       "SparseMoeBlock."})
        _CLASS["granite"] = type("GraniteMoeForCausalLM", (MoeForCausalLM, GraniteForCausalLM), {
            "__doc__": "Granite MoE (models.moe): Granite's scalars, a sparse layer's MLP a SparseMoeBlock."})
        _CLASS["hunyuan"] = type("HunYuanMoEV1ForCausalLM", (MoeForCausalLM, HunYuanDenseV1ForCausalLM), {
            "__doc__": "Hunyuan MoE (models.moe): the dense Hunyuan's attention, every layer's MLP a SparseMoeBlock "
                       "with its shared MLP."})
        from .llama import Olmo2ForCausalLM, Starcoder2ForCausalLM
        _CLASS["olmo2"] = type("FlexOlmoForCausalLM", (MoeForCausalLM, Olmo2ForCausalLM), {
            "__doc__": "FlexOlmo (models.moe): OLMo 2's loop (the attention's and the MLP's outputs normed before the "
                       "residual adds them, no norm before), every layer's MLP a SparseMoeBlock (OLMoE's)."})
        _CLASS["phimoe"] = type("PhimoeForCausalLM", (MoeForCausalLM, Starcoder2ForCausalLM), {
            "__doc__": "Phi-3.5-MoE (models.moe): StarCoder2's loop of two LayerNorms with biases a layer (the norms "
                       "add no residual), every layer's MLP a SparseMoeBlock of the sparsemixer router, a head "
                       "bias where lm_head_bias says."})
    return _CLASS[base]
