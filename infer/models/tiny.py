"""Built-in tiny models: generated deterministically from a seed, with a locally trained tokenizer and a chat
template, cached on disk. Nothing is downloaded. (models/resolve.py turns a MODEL argument into a folder.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..errors import ModelLoadError

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FORMAT_VERSION = 2  # bump when the generated files change, so stale caches are rebuilt


@dataclass(frozen=True)
class TinySpec:
    arch: str  # transformers model_type
    seed: int
    vocab_size: int = 512
    config: dict = field(default_factory=dict)
    # large enough that greedy outputs depend on the prompt and rarely repeat one token (at 0.02-0.08 they often do)
    init_range: float = 0.15


_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)
# Qwen3.5's language model: 3 Gated DeltaNet layers and a gated attention layer (full_attention_interval 4), a partial
# rotary (a quarter of each head of 32), linear heads of 16 (2 key heads, 4 value heads), conv kernel 4
_QWEN3_5 = dict(_TINY, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 2], "mrope_interleaved": True})
# Llama 4's text model (tiny-llama4, tiny-llama4-mm)
_LLAMA4 = dict(_TINY, num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
               num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=32,
               floor_scale=16, attn_scale=0.1, tie_word_embeddings=False,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
BUILTIN_MODELS: dict[str, TinySpec] = {
    "tiny-llama": TinySpec("llama", 1, config=dict(_TINY)),
    "tiny-qwen2": TinySpec("qwen2", 2, config=dict(_TINY)),
    "tiny-mistral": TinySpec("mistral", 3, config=dict(_TINY, sliding_window=4096)),
    "tiny-qwen3": TinySpec("qwen3", 4, config=dict(_TINY, head_dim=32)),
    "tiny-llama3": TinySpec("llama", 5, config=dict(
        _TINY, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})),
    # Phi-3's checkpoint layout: q|k|v stored as one qkv_proj, gate|up as one gate_up_proj
    "tiny-phi3": TinySpec("phi3", 7, config=dict(_TINY)),
    # Phi-4-mini's shape of rope: a partial rotary (the first 3/4 of each head rotated, the rest passed; head_dim 16:
    # 12 dims) with longrope's short factors (rotary_dim / 2 of them; its original context the whole context here),
    # and a tied head
    "tiny-phi4": TinySpec("phi3", 10, config=dict(
        _TINY, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "original_max_position_embeddings": 4096, "factor": 1.0,
                         "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
                         "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]})),
    # Gemma: head_dim apart from hidden_size / heads (as Gemma's 256), GeGLU, norms by 1 + w. Untied head: random
    # weights with Gemma's tied head (and its embeddings scaled by sqrt(hidden_size)) repeat the prompt's last token
    "tiny-gemma": TinySpec("gemma", 8, config=dict(_TINY, head_dim=32, tie_word_embeddings=False)),
    # Gemma 2: soft-capped attention and logits, sliding window on alternate layers (here as long as the context)
    "tiny-gemma2": TinySpec("gemma2", 9, config=dict(_TINY, head_dim=32, query_pre_attn_scalar=32,
                                                     sliding_window=4096, tie_word_embeddings=False)),
    # Gemma 3 (text): q/k norms, a rope per layer type, 5 sliding layers of 6 (a window of 64: prompts pass it)
    "tiny-gemma3": TinySpec("gemma3_text", 10, config=dict(_TINY, num_hidden_layers=6, head_dim=32,
                                                           query_pre_attn_scalar=32, sliding_window=64,
                                                           tie_word_embeddings=False)),
    # mixtures of experts (models.moe): 8 experts of width 32, top-2, renormalised (as Qwen3-30B-A3B's
    # norm_topk_prob); Mixtral's experts of intermediate_size
    "tiny-qwen3-moe": TinySpec("qwen3_moe", 11, config=dict(_TINY, head_dim=32, moe_intermediate_size=32, num_experts=8,
                                                            num_experts_per_tok=2, norm_topk_prob=True)),
    "tiny-mixtral": TinySpec("mixtral", 12, config=dict(_TINY, intermediate_size=32, num_local_experts=8,
                                                        num_experts_per_tok=2)),
    # GLM-4.5 (Air's shape): the first layer dense, then 8 experts of width 32 in 4 groups of 2 (the best 2 groups
    # kept, top-2 of theirs, renormalised, scaled by 2.5) beside a shared expert; q/k/v biases, q/k norms, half of
    # each head rotated (head_dim set: its config defaults to hidden_size / heads)
    "tiny-glm4-moe": TinySpec("glm4_moe", 27, config=dict(
        _TINY, num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=True, tie_word_embeddings=False)),
    # OLMoE (1B-7B's shape): 8 experts of width 32 on every layer (top-2, not renormalised), q and k normed over their
    # whole projections
    "tiny-olmoe": TinySpec("olmoe", 28, config=dict(_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                                    tie_word_embeddings=False)),
    # Granite MoE (3.x-1b-a400m's shape): Granite's four scalars, 8 experts of width 32 on every layer (top-2, the
    # softmax over the top 2 logits)
    "tiny-granitemoe": TinySpec("granitemoe", 29, config=dict(
        _TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0, tie_word_embeddings=False)),
    # GraniteMoeShared: tiny-granitemoe's layers with a dense shared MLP of width 48 beside the experts
    "tiny-granitemoeshared": TinySpec("granitemoeshared", 29, config=dict(
        _TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0,
        tie_word_embeddings=False)),
    # ERNIE 4.5 MoE (21B-A3B's shape): ERNIE 4.5's layers, the first dense, 8 experts of width 32 (top 2) and 2
    # shared experts on the others, the router's moe_statics bias (zeros as built)
    "tiny-ernie4_5-moe": TinySpec("ernie4_5_moe", 32, config=dict(
        _TINY, num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
        moe_num_shared_experts=2, moe_layer_start_index=1, tie_word_embeddings=False)),
    # Granite 3.x: Llama's layers with its four scalars (Granite-3's embedding and residual multipliers; the attention
    # scale 1 / head_dim, as Granite-3's 1/128 of its heads of 128; the logits divided by 4)
    "tiny-granite": TinySpec("granite", 13, config=dict(_TINY, embedding_multiplier=12.0, residual_multiplier=0.22,
                                                        attention_multiplier=0.0625, logits_scaling=4.0)),
    # OLMo 2: norms after the attention and the MLP (none before), q and k normed over their whole projections
    "tiny-olmo2": TinySpec("olmo2", 14, config=dict(_TINY)),
    # OLMo 3: OLMo 2's layers, 3 sliding layers of 4 (a window of 64: prompts pass it)
    "tiny-olmo3": TinySpec("olmo3", 15, config=dict(_TINY, num_hidden_layers=4, sliding_window=64)),
    # GLM-4 (0414): four norms a layer, gate|up stored fused, half of each head rotated in interleaved pairs (head_dim
    # set: GLM-4's config defaults to 128)
    "tiny-glm4": TinySpec("glm4", 17, config=dict(_TINY, head_dim=16)),
    # SmolLM3: Llama's layers, the last of each 4 without rope (NoPE), a tied head (as SmolLM3-3B's)
    "tiny-smollm3": TinySpec("smollm3", 18, config=dict(_TINY, num_hidden_layers=4)),
    # Seed-OSS: Llama's layers with q/k/v biases and none on o, head_dim set apart (its config defaults to 128)
    "tiny-seed-oss": TinySpec("seed_oss", 19, config=dict(_TINY, head_dim=32)),
    # ERNIE 4.5 (0.3B): Llama's layers, the whole head rotated in interleaved pairs, a tied head, head_dim set (its
    # config defaults to 128)
    "tiny-ernie4_5": TinySpec("ernie4_5", 20, config=dict(_TINY, head_dim=16)),
    # gpt-oss: attention sinks, q/k/v/o biases, alternate sliding layers (a window of 64: prompts pass it), yarn rope,
    # 8 experts of width 32 (top-2) with biases and the clamped SwiGLU (limit 1: the clamp reached), a biased router
    "tiny-gpt-oss": TinySpec("gpt_oss", 19, config=dict(
        _TINY, num_hidden_layers=4, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=64, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 1024})),
    # Cohere's Command R+: one LayerNorm a layer read by the attention and the MLP, q and k LayerNorms per head, the
    # logits scaled by logit_scale (0.0625), a rotary of interleaved pairs. Untied head (as Gemma's above)
    "tiny-cohere": TinySpec("cohere", 18, config=dict(_TINY, use_qk_norm=True, tie_word_embeddings=False)),
    # Cohere 2 (Command R7B): 3 sliding layers of 4 (a window of 64: prompts pass it), no rotary on the full layer
    "tiny-cohere2": TinySpec("cohere2", 19, config=dict(_TINY, num_hidden_layers=4, sliding_window=64,
                                                        tie_word_embeddings=False)),
    # EXAONE 4 (32B's shape): OLMo 2's post-norms, q and k normed per head, 3 sliding layers of 4 (a window of 64:
    # prompts pass it) and no rotary on the full layer
    "tiny-exaone4": TinySpec("exaone4", 20, config=dict(_TINY, num_hidden_layers=4, sliding_window=64)),
    # StarCoder2: LayerNorms with biases, biases everywhere, a gelu MLP without gate (c_fc, c_proj), a sliding window
    # on every layer (as long as the context here). Untied head (as Gemma's above)
    "tiny-starcoder2": TinySpec("starcoder2", 21, config=dict(_TINY, sliding_window=4096, tie_word_embeddings=False)),
    # Arcee's AFM: Llama's layers with an MLP without gate (up_proj, relu², down_proj). Untied head (as Gemma's above)
    "tiny-arcee": TinySpec("arcee", 22, config=dict(_TINY, tie_word_embeddings=False)),
    # Nemotron (Minitron's shape): LayerNorm1P with biases (by 1 + w), the relu² MLP without gate, half of each head
    # rotated (head_dim 16: 8 dims)
    "tiny-nemotron": TinySpec("nemotron", 23, config=dict(_TINY, partial_rotary_factor=0.5)),
    # Apertus: the xIELU MLP without gate (its learned parameters per layer), q and k RMSNorms per head, its llama3 rope
    "tiny-apertus": TinySpec("apertus", 24, config=dict(_TINY)),
    # InternLM3 (8B's shape): Llama's layers, head_dim set apart (its config defaults to 128), a dynamic (NTK) rope
    # (transformers rescales only past max_position_embeddings)
    "tiny-internlm3": TinySpec("internlm3", 22, config=dict(
        _TINY, head_dim=32, rope_parameters={"rope_type": "dynamic", "rope_theta": 50000000.0, "factor": 6.0})),
    # Helium: Llama's layers with a rotary of interleaved pairs, float32-weighted RMSNorms, no o bias
    "tiny-helium": TinySpec("helium", 23, config=dict(_TINY, head_dim=16)),
    # Hunyuan dense (7B's shape): q and k normed per head after the rotary, the rope's NTK alpha, a tied head
    "tiny-hunyuan": TinySpec("hunyuan_v1_dense", 25, config=dict(
        _TINY, head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})),
    # Hunyuan MoE (A13B's shape, shrunk): tiny-hunyuan's attention and rope, on every layer 8 experts of 32 (top 2,
    # renormalised, a float32 router) beside a shared MLP of 32, a tied head
    "tiny-hunyuan-moe": TinySpec("hunyuan_v1_moe", 37, config=dict(
        _TINY, head_dim=32, intermediate_size=32, num_experts=8, moe_topk=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})),
    # Granite SWA: Granite's scalars, 3 sliding layers of 4 (a window of 64: prompts pass it), attention sinks, no
    # rotary on the full layer (layer_rope_theta 0). Untied head (its config's default ties it: as Gemma's above)
    "tiny-granite-swa": TinySpec("granite_swa", 26, config=dict(
        _TINY, num_hidden_layers=4, sliding_window=64, tie_word_embeddings=False, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0,
        layer_rope_theta=[0, 10000.0, 10000.0, 10000.0])),
    # Qwen3.5's text model (_QWEN3_5). Untied head (as Gemma's above)
    "tiny-qwen3_5": TinySpec("qwen3_5_text", 27, config=dict(_QWEN3_5, tie_word_embeddings=False)),
    # multimodal checkpoints (models.multimodal: infer serves their text model): a tiny vision tower (skipped) and
    # the language model of text_config, saved in the hub's layout (language_model.model.*). Gemma 3's (4B and
    # larger): Gemma 3's text layers as tiny-gemma3's; untied head (as Gemma's above)
    "tiny-gemma3-mm": TinySpec("gemma3", 22, config=dict(
        text_config=dict(_TINY, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                         tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4, tie_word_embeddings=False)),
    # Qwen3-Next: Qwen3.5's layers (_QWEN3_5, in_proj_qkvz and in_proj_ba stored fused), 8 experts of width 32 (top 2,
    # renormalised) and a gated shared expert of 32 on every layer
    "tiny-qwen3-next": TinySpec("qwen3_next", 29, config=dict(
        _QWEN3_5, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    # Qwen3.5 MoE's text model: Qwen3.5's layers (_QWEN3_5), 8 experts of width 32 (top 2, renormalised) and a gated
    # shared expert of 48 on every layer
    "tiny-qwen3_5-moe": TinySpec("qwen3_5_moe_text", 30, config=dict(
        _QWEN3_5, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
    # Qwen3.5's (Qwen3.5-*: natively multimodal): tiny-qwen3_5's language model, a tiny vision tower
    "tiny-qwen3_5-mm": TinySpec("qwen3_5", 28, config=dict(
        text_config=dict(_QWEN3_5),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, num_position_embeddings=16), tie_word_embeddings=False)),
    # Qwen3.5 MoE's (Qwen3.5-35B-A3B: natively multimodal): tiny-qwen3_5-moe's language model, a tiny vision tower
    "tiny-qwen3_5-moe-mm": TinySpec("qwen3_5_moe", 31, config=dict(
        text_config=dict(_QWEN3_5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, num_position_embeddings=16), tie_word_embeddings=False)),
    # Mistral 3's (Mistral Small 3.1/3.2): a Mistral language model (no sliding window), a Pixtral vision tower
    "tiny-mistral3": TinySpec("mistral3", 23, config=dict(
        text_config=dict(_TINY, model_type="mistral", head_dim=16, tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=16, image_size=28, patch_size=14), image_token_index=511,
        tie_word_embeddings=False)),
    # Ministral 3's (Ministral-3-3B/8B/14B): Mistral 3 with a ministral3 language model, yarn and Llama 4's query
    # scaling by position (its original context 16, Ministral 3's 16384: prompts pass it)
    "tiny-ministral3": TinySpec("mistral3", 24, config=dict(
        text_config=dict(_TINY, model_type="ministral3", head_dim=16, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 256.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=16, image_size=28, patch_size=14), image_token_index=511,
        tie_word_embeddings=False)),
    # Granite 4.0 (granite-4.0-h-*'s shape): 3 Mamba-2 layers and an attention layer without rope, 8 experts of
    # width 32 (top-2) beside a shared MLP of 64 on every layer, Granite's scalars; Mamba-2 heads of 16 (8 of them),
    # 2 groups of 16 state dims, chunks of 16 (prompts span several)
    "tiny-granite4": TinySpec("granitemoehybrid", 30, config=dict(
        _TINY, num_hidden_layers=4, intermediate_size=32, shared_intermediate_size=64, num_local_experts=8,
        num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
        logits_scaling=4.0, tie_word_embeddings=False, position_embedding_type="nope",
        layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)),
    # Granite 4.0 micro's shape: attention layers alone with rope, the shared MLP, no experts
    "tiny-granite4-dense": TinySpec("granitemoehybrid", 31, config=dict(
        _TINY, shared_intermediate_size=64, num_local_experts=0, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0625, logits_scaling=4.0, tie_word_embeddings=False, position_embedding_type="rope",
        layer_types=["attention", "attention"])),
    # Nemotron-H (Nemotron-H-8B's pattern, shortened): Mamba-2 (M), MLP (-), attention without rope (*), Mamba-2,
    # MLP; Mamba-2 heads of 16 (8 of them), 2 groups of 16 state dims, chunks of 16 (prompts span several)
    "tiny-nemotron-h": TinySpec("nemotron_h", 33, config=dict(
        _TINY, hybrid_override_pattern="M-*M-", num_hidden_layers=5, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, tie_word_embeddings=False)),
    # Nemotron 3 (NVIDIA-Nemotron-3-Nano-30B-A3B's pattern, shortened): Mamba-2, experts (E), attention, Mamba-2, MLP,
    # experts; 8 relu² experts of 32 without gate, 2 a token, in 4 groups (2 kept), scaled by 2.5, a shared expert of
    # 48; tiny-nemotron-h's Mamba-2 shapes
    "tiny-nemotron-h-moe": TinySpec("nemotron_h", 34, config=dict(
        _TINY, hybrid_override_pattern="ME*M-E", num_hidden_layers=6, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, tie_word_embeddings=False,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # DeepSeek-V3 (V3/R1's shape, shrunk): multi-head latent attention (a latent of 32 and a roped key of 16: cache
    # rows of 48, a width no power of two), q through q_lora_rank 48, heads of 16 + 16 (values 16), yarn rope whose
    # mscale_all_dim scales the softmax; the first layer dense, then 8 experts of 32 in 4 groups of 2 (2 kept, top 2,
    # renormalised, scaled by 2.5) beside a shared expert
    "tiny-deepseek-v3": TinySpec("deepseek_v3", 35, config=dict(
        _TINY, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 1024})),
    # DeepSeek-V2-Lite's shape, shrunk: the same attention with q_proj (no q_lora_rank), the first layer dense, then
    # 8 experts of 32 (the softmax's greedy top 2, not renormalised) beside 2 shared experts
    "tiny-deepseek-v2": TinySpec("deepseek_v2", 36, config=dict(
        _TINY, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", tie_word_embeddings=False)),
    # dots.llm1 (142B-A14B's shape, shrunk): Qwen3's attention (q and k normed per head), the first layer dense, then
    # 8 experts of 32 (one group: top 2, renormalised, scaled by 2.5) beside 2 shared experts
    "tiny-dots1": TinySpec("dots1", 37, config=dict(
        _TINY, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        tie_word_embeddings=False)),
    # MiniMax-M2 (230B-A10B's shape, shrunk): 8 experts of 32 on every layer (top 2 by sigmoid scores, renormalised),
    # q and k normed over their whole projections, half of each head of 32 rotated (rotary_dim 16)
    "tiny-minimax-m2": TinySpec("minimax_m2", 38, config=dict(
        _TINY, head_dim=32, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rotary_dim=16,
        tie_word_embeddings=False)),
    # LFM2 (LFM2-1.2B's shape, shortened): short-conv layers of 3 taps and an attention layer (q and k normed per
    # head), a tied head; the MLP's width adjusted as transformers does (block_auto_adjust_ff_dim: 2/3 of 200, 133,
    # rounded up to a multiple of 32: 160)
    "tiny-lfm2": TinySpec("lfm2", 39, config=dict(
        _TINY, num_hidden_layers=4, intermediate_size=200, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True, conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
        layer_types=["conv", "conv", "full_attention", "conv"], tie_word_embeddings=True)),
    # LFM2-MoE (LFM2-8B-A1B's shape, shortened): tiny-lfm2's layers, the first MLP dense (96 wide), then 8 experts
    # of 32, 2 a token, routed by sigmoid scores with expert_bias, renormalised and scaled by 1.5
    "tiny-lfm2-moe": TinySpec("lfm2_moe", 40, config=dict(
        _TINY, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True,
        routed_scaling_factor=1.5, conv_L_cache=3, norm_eps=1e-5, tie_word_embeddings=True,
        layer_types=["conv", "full_attention", "conv", "conv"])),
    # Llama 4 (Scout's layout, shrunk): 4 layers, the 4th NoPE (its attention temperature, floor_scale 16), the
    # others rotating interleaved pairs (llama3 rope) with q and k L2-normed and chunks of 32 (prompts pass them);
    # the odd layers 8 experts of 32 (top 1, the sigmoid scaling their input) beside a shared expert, the even ones
    # a dense MLP of 128 (intermediate_size_mlp)
    "tiny-llama4": TinySpec("llama4_text", 41, config=dict(_LLAMA4)),
    # Llama 4's multimodal checkpoint (Llama4ForConditionalGeneration: Scout's and Maverick's): tiny-llama4's
    # language model and a tiny vision tower (skipped)
    "tiny-llama4-mm": TinySpec("llama4", 42, config=dict(
        text_config=dict(_LLAMA4),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=32, pixel_shuffle_ratio=0.5), tie_word_embeddings=False)),
    # Falcon-H1 (Falcon-H1-0.5B's muP multipliers, shortened): 3 layers, each attention (heads of 16, rope) beside a
    # Mamba-2 mixer of 128 channels (mamba_d_ssm; 8 heads of 16, 2 groups of 16 state dims, chunks of 16: prompts
    # span several), no gated norm (the hub's mamba_rms_norm false)
    "tiny-falcon-h1": TinySpec("falcon_h1", 43, config=dict(
        _TINY, num_hidden_layers=3, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=False, tie_word_embeddings=False,
        embedding_multiplier=5.656, lm_head_multiplier=0.0390625, key_multiplier=0.390625,
        attention_in_multiplier=1.0, attention_out_multiplier=0.9375, ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.2357, ssm_multipliers=[0.3535, 0.25, 0.3535, 0.5, 0.3535],
        mlp_multipliers=[0.8838, 0.5859])),
    # Phi-3.5-MoE (Phi-3.5-MoE-instruct's shape, shrunk): LayerNorms with biases, q/k/v/o and head biases, longrope
    # (factors for heads of 16, its mscales equal as the hub's), 8 experts of 32 on every layer (the sparsemixer's 2)
    "tiny-phimoe": TinySpec("phimoe", 43, config=dict(
        _TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, attention_bias=True,
        lm_head_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [1.5 + 0.5 * i for i in range(8)], "short_mscale": 1.243163121016122,
                         "long_mscale": 1.243163121016122, "original_max_position_embeddings": 1024})),
    # FlexOlmo (FlexOlmo-7x7B-1T's shape, shrunk): OLMo 2's layers (norms after the attention and the MLP, q and k
    # normed whole) with 7 experts of 32 on every layer (top 3 of a float32 softmax, not renormalised)
    "tiny-flex-olmo": TinySpec("flex_olmo", 44, config=dict(
        _TINY, intermediate_size=32, num_experts=7, num_experts_per_tok=3, tie_word_embeddings=False)),
    # Bamba (Bamba-9B's layout, shortened): Mamba-2 layers and an attention layer (attn_layer_indices [2]) rotating
    # half of each head of 16 (attn_rotary_emb 8), the SwiGLU feed_forward on every layer; Mamba-2 heads of 16 (8 of
    # them), 2 groups of 16 state dims, chunks of 16 (prompts span several)
    "tiny-bamba": TinySpec("bamba", 43, config=dict(
        _TINY, num_hidden_layers=4, attn_layer_indices=[2], attn_rotary_emb=8, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        tie_word_embeddings=False)),
    "llama-100m": TinySpec("llama", 6, vocab_size=32000, init_range=0.08, config=dict(  # 134M parameters
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, max_position_embeddings=4096)),
}


def builtin_names() -> list[str]:
    """The names `ensure_builtin` (and `resolve.resolve_model`) accept, in a stable order."""
    return list(BUILTIN_MODELS)


def cache_root() -> Path:
    """Where built-in models are kept: $INFER_CACHE/models, or ~/.cache/infer/models."""
    return Path(os.environ.get("INFER_CACHE") or Path.home() / ".cache" / "infer") / "models"


def ensure_builtin(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of built-in model `name` under `cache_dir` (default `cache_root()`), generated on first use.

    The build goes to a hidden temporary folder that is renamed into place, so a killed build leaves no
    half-written model folder; leftovers of killed builds are removed by the next build."""
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(f"unknown built-in model {name!r}", f"built-in models: {', '.join(BUILTIN_MODELS)}")
    root = Path(cache_dir) if cache_dir else cache_root()
    target = root / f"{name}-v{FORMAT_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_builds(root, name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    except OSError as e:
        raise ModelLoadError(f"cannot write the built-in model {name!r} into {root}: {e.strerror or e}",
                             "set INFER_CACHE to a folder you can write to (built-in models are generated there)") \
            from None
    try:
        _build(BUILTIN_MODELS[name], tmp)
        try:
            tmp.rename(target)  # atomic: a killed build never leaves a half folder
        except OSError:  # another process finished first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_builds(root: Path, name: str, max_age_s: float = 3600.0) -> None:
    """Temporary folders of builds that were killed (older than any real build takes)."""
    now = time.time()
    for old in root.glob(f".{name}-*"):
        try:
            if old.is_dir() and now - old.stat().st_mtime > max_age_s:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:  # removed by another process meanwhile
            pass


@lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE trained on the built-in corpus; deterministic, shared by models of one vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = (Path(__file__).parent / "data" / "corpus.txt").read_text().splitlines()
    tok.train_from_iterator(text, trainer)
    return tok.to_str()


def _save_tokenizer(spec: TinySpec, out: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(spec.vocab_size)),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)


def _build(spec: TinySpec, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from .multimodal import WRAPPERS
    from .registry import SUPPORTED
    eos = SPECIAL_TOKENS.index("<|im_end|>")
    common = dict(vocab_size=spec.vocab_size, eos_token_id=eos, bos_token_id=None, pad_token_id=0,
                  initializer_range=spec.init_range)
    wrapper = next((a for a, t in WRAPPERS.items() if t == spec.arch), None)
    if wrapper is not None:  # a multimodal model: the text model's settings are its text_config's
        cfg = AutoConfig.for_model(spec.arch, initializer_range=spec.init_range,
                                   **{**spec.config, "text_config": {**spec.config["text_config"], **common}})
    else:
        cfg = AutoConfig.for_model(spec.arch, **common, **spec.config)
    # the architecture a checkpoint of the family names (registry.SUPPORTED's, by model_type; a multimodal one's)
    arch = [{**{t: a for a, t in SUPPORTED.items()}, **{t: a for a, t in WRAPPERS.items()}}[spec.arch]]
    cfg.architectures = arch
    with torch.random.fork_rng(devices=[]):  # the caller's random state is the same whether the cache existed
        torch.manual_seed(spec.seed)
        model = (AutoModelForImageTextToText if wrapper else AutoModelForCausalLM).from_config(cfg,
                                                                                              dtype=torch.float32)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    from transformers.utils import logging as hf_logging
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if shown:  # as it was: enabling it under HF_HUB_DISABLE_PROGRESS_BARS=1 prints a warning
            hf_logging.enable_progress_bar()
    config = json.loads((out / "config.json").read_text())
    if config["architectures"] != arch:  # transformers saves InternLM3 as the LlamaForCausalLM it runs it as: the
        (out / "config.json").write_text(json.dumps({**config, "architectures": arch}, indent=2))  # checkpoints' name
    _save_tokenizer(spec, out)
    (out / "infer_builtin.json").write_text(json.dumps({"seed": spec.seed, "format": FORMAT_VERSION}))
