"""The Llama family on a flat batch over a paged KV cache: Llama 2/3, Mistral, Qwen2 (= Qwen1.5), Qwen3, Phi-3,
Gemma, Gemma 2 and Gemma 3's text model (GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM below), Granite,
OLMo 2 and OLMo 3 (GraniteForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM below), SmolLM3 (SmolLM3ForCausalLM below),
Seed-OSS and ERNIE 4.5 (Llama's class: biases and an interleaved rotary are config switches of Attention and MLP),
Cohere's Command R/R+ and R7B/A, EXAONE 4 and StarCoder2 (CohereForCausalLM, Exaone4ForCausalLM,
Starcoder2ForCausalLM below).

Differences between the members are config switches: qkv bias (Qwen2), q/k RMSNorm per head (Qwen3), rope scaling
(Llama 3), tied embeddings, and where the checkpoint stores the projections: Phi-3 (Phi-3.5, Phi-4) stores q|k|v as
one qkv_proj and gate|up as one gate_up_proj (`fused_names`), which infer computes exactly as Llama's merged layers.
Every op goes through infer.kernels.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from .. import kernels
from ..kernels import cpu_gemm
from .context import ForwardContext
from .layers import LinearMethod, MergedLinear
from .limits import layer_chunked, layer_window
from .moe import GRANITE_MOE, SparseMoeBlock, base_type, is_sparse
from .registry import (COHERE, FLOAT_NORMS, GEMMA, GEMMA_FOUR_NORMS, GLM, GRANITE, LFM2, OLMO, POST_NORMS,
                       POST_ONLY, UNGATED, activation)
from .rope import build_cos_sin_cache, identity_cos_sin, nope_layers, query_scaling, rope_layer_types
from .shapes import ModelShapes, is_mla

# rows of one GPTQ output-head matmul: no more than memory.sizes.DEQUANT_MIN_TOKENS, so the head always runs in the
# fused int4 kernels and never dequantizes whole into the scratch (which the memory plan does not size for it)
HEAD_ROWS = 256


def fused_names(cfg, prefix: str, fused: str, projections: tuple[str, ...]) -> list[str]:
    """The checkpoint module of each shard of a merged layer (MergedLinear.names): Llama's own projections, or for
    Phi-3 (and GLM-4's gate_up_proj) the one fused module that stores them all, stacked along the output (its name
    once per shard)."""
    if cfg.model_type == "phi3" or (cfg.model_type in GLM and fused == "gate_up_proj"):
        return [f"{prefix}.{fused}"] * len(projections)
    if cfg.model_type == "granitemoeshared" and fused == "gate_up_proj":  # (its shared_mlp's gate|up: input_linear)
        return [f"{prefix}.input_linear"] * len(projections)
    if cfg.model_type in LFM2 and fused == "gate_up_proj":  # (LFM2's feed_forward: w1 the gate, w3 the up)
        return [f"{prefix}.w1", f"{prefix}.w3"]
    return [f"{prefix}.{p}" for p in projections]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, unit_offset: bool = False,
                 float_weight: bool = False):
        """unit_offset: Gemma's RMSNorm, which weights by 1 + weight (in float32, rounded once); float_weight: OLMo
        2's and 3's, which weights by weight in float32 (rounded once; the others round the normed row first)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset
        self.float_weight = float_weight

    def forward(self, x, residual=None, lora=None):
        """lora: the LoRADelta that the layer whose output x is left to this norm (MergedLinear.forward_deferred)."""
        if self.unit_offset or self.float_weight:
            return kernels.rms_norm(x, self.weight, self.eps, residual, lora, unit_offset=self.unit_offset,
                                    float_weight=self.float_weight)
        return kernels.rms_norm(x, self.weight, self.eps, residual, lora)


class LayerNorm(nn.Module):
    """Cohere's LayerNorm (transformers' CohereLayerNorm: the mean subtracted, no bias, in float32, rounded once):
    `size` an int, or (heads, head_dim) for Cohere's q and k norms, each head by its own weights; with `bias`,
    StarCoder2's (nn.LayerNorm); with `unit_offset` too, Nemotron's (transformers' NemotronLayerNorm1P: weighted by
    1 + weight, that sum in the model's dtype)."""

    def __init__(self, size, eps: float, dtype: torch.dtype, bias: bool = False, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False) if bias else None
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x):
        return kernels.layer_norm(x, self.weight + 1.0 if self.unit_offset else self.weight, self.eps, self.bias)


def norm_for(cfg):
    """The norm class of the family: Gemma's RMSNorm weights by 1 + weight, OLMo's by weight in float32 (transformers'
    Olmo2RMSNorm and Olmo3RMSNorm: (weight * normed).to(dtype), where Llama's rounds the normed row first; gpt-oss's
    GptOssRMSNorm too); Cohere's is a LayerNorm."""
    if cfg.model_type in COHERE:
        return LayerNorm
    if cfg.model_type in ("starcoder2", "nemotron", "phimoe"):  # (Nemotron's LayerNorm1P: by 1 + weight; Phi-3.5-MoE's
        return functools.partial(LayerNorm, bias=True, unit_offset=cfg.model_type == "nemotron")  # nn.LayerNorm)
    return functools.partial(RMSNorm, unit_offset=cfg.model_type in GEMMA, float_weight=cfg.model_type in FLOAT_NORMS)


def norm_eps(cfg) -> float:
    """The norms' epsilon: rms_norm_eps, Cohere's layer_norm_eps, StarCoder2's norm_epsilon or Nemotron's norm_eps."""
    if cfg.model_type == "starcoder2":
        return float(cfg.norm_epsilon)
    if cfg.model_type in ("nemotron", *LFM2):
        return float(cfg.norm_eps)
    if cfg.model_type == "nemotron_h":  # (models.nemotron_h)
        return float(cfg.layer_norm_epsilon)
    return float(cfg.layer_norm_eps if cfg.model_type in COHERE else cfg.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg, prefix: str, method_for, dtype, layer: int = 0):
        """layer: the decoder layer's index (which layers slide: models.limits.layer_window)."""
        super().__init__()
        shapes = ModelShapes.from_config(cfg)
        self.num_heads, self.num_kv_heads, self.head_dim = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
        self.q_size, self.kv_size = shapes.q_size, shapes.kv_size
        self.scale = self.head_dim ** -0.5
        self.softcap = 0.0  # the scores' tanh soft-capping (Gemma 2's attn_logit_softcapping; 0: none)
        if cfg.model_type in GEMMA_FOUR_NORMS:  # Gemma 2 and 3
            self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        if cfg.model_type in GRANITE:  # Granite's attention_multiplier: the scale
            self.scale = float(cfg.attention_multiplier)
        if cfg.model_type == "falcon_h1":  # Falcon-H1's k times key_multiplier: the scale times it (models.falcon_h1)
            self.scale *= float(cfg.key_multiplier)
        if cfg.model_type == "gemma2":  # transformers' Gemma 3 attention never reads attn_logit_softcapping: none
            self.softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0)
        self.window = layer_window(cfg, layer)  # a sliding-window layer's window (0: full attention), every kernel's
        # Llama 4's chunked attention (attention_chunk_size, its rope layers): `window` is the chunk, each query
        # attends to the keys of its own chunk alone (every kernel's `chunked`); the KV blocks behind it are freed as
        # a sliding window's of that size would be (a chunk's keys are among a window's: engine.block_manager)
        self.chunked = layer_chunked(cfg, layer)
        # gpt-oss's attention sinks: a learned logit per query head in each softmax's denominator (None: none)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False) \
            if cfg.model_type in ("gpt_oss", "granite_swa") else None  # (Granite SWA's too)
        self.kv_group = 0  # its KV layer group (the model runner sets it: engine.hybrid_blocks; 0: ctx's own tables)
        # as transformers builds each family: Qwen2 has q/k/v biases and no o bias, Llama, Qwen3, Gemma and Gemma 2
        # follow attention_bias (q, k, v and o), and so do Granite, OLMo 2, SmolLM3, InternLM3 and Hunyuan (Helium's
        # q, k and v alone); Mistral has none whatever its config says; Seed-OSS's attention_bias is q, k and v's,
        # attention_out_bias o's; ERNIE 4.5's use_bias all four
        kind = base_type(cfg)  # an MoE model's attention is its dense family's (models.moe.BASE)
        declared = bool(getattr(cfg, "attention_bias", False)) and kind in ("llama", "qwen3", *GEMMA, "granite",
                                                                             "granite_swa",
                                                                             *COHERE, *OLMO, "smollm3", "seed_oss",
                                                                             "internlm3", "helium", "hunyuan_v1_dense",
                                                                             "arcee", "nemotron", "apertus",
                                                                             "llama4_text", "falcon_h1", "phimoe",
                                                                             "bamba") \
            or (kind == "ernie4_5" and bool(getattr(cfg, "use_bias", False)))
        if kind == "starcoder2":  # StarCoder2's use_bias: every projection's
            declared = bool(getattr(cfg, "use_bias", True))
        qkv_bias = (bool(getattr(cfg, "qkv_bias", True)) if cfg.model_type == "qwen2_moe" else kind == "qwen2") \
            or declared or (kind in GLM and bool(getattr(cfg, "attention_bias", True))) \
            or (kind == "glm4_moe" and bool(getattr(cfg, "attention_bias", False)))  # (GLM-4, GLM-4.5: no o bias)
        names = fused_names(cfg, prefix, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        self.qkv_proj = MergedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], names, qkv_bias,
                                     method_for(names), dtype)
        o_bias = bool(getattr(cfg, "attention_out_bias", False)) if kind == "seed_oss" else \
            declared and kind != "helium"  # (Helium: q, k and v's attention_bias, never o's)
        o_name = f"{prefix}.out_proj" if kind == "lfm2" else f"{prefix}.o_proj"  # (LFM2's: models.lfm2)
        self.o_proj = MergedLinear(self.q_size, [cfg.hidden_size], [o_name], o_bias, method_for([o_name]), dtype)
        # (Gemma 3's by 1 + w; Hunyuan's after the rotary: norm_after_rope; LFM2's q_layernorm and k_layernorm)
        self.qk_norm = kind in ("qwen3", "gemma3_text", *OLMO, "exaone4", "apertus", "hunyuan_v1_dense", "minimax_m2",
                                "lfm2") \
            or (kind == "glm4_moe" and bool(getattr(cfg, "use_qk_norm", False)))  # (GLM-4.5's: per head)
        # OLMo 2 and 3 (and MiniMax-M2) norm q and k each over its whole projection (every head at once), the others
        # per head
        self.qk_norm_whole = kind in (*OLMO, "minimax_m2")
        # Hunyuan norms q and k after the rotary (transformers' HunYuanDenseV1Attention), the others before it: its
        # layers rotate them first (`_rotated_first`) and hand the fused kernels an identity table
        self.norm_after_rope = kind == "hunyuan_v1_dense"
        # Llama 4 (transformers' Llama4TextAttention): on its rope layers (no_rope_layers 1) q and k L2-normed per head
        # after the rotary where use_qk_norm says (Llama4TextL2Norm: an RMSNorm without weight, `l2_normed`), Hunyuan's
        # order; on its NoPE layers the query scaled by position where attn_temperature_tuning says (`temperature`)
        self.l2_eps = None  # (Llama 4's L2 norm's eps; None: no such norm)
        self.temperature = None  # (Llama 4's (attn_scale, floor_scale) of a NoPE layer; None: none)
        self.pairs = None  # the dims whose interleaved pairs `_deinterleaved` reorders (None: rot_dim's)
        if kind == "llama4_text":
            rope = bool(cfg.no_rope_layers[layer])
            if rope and cfg.use_qk_norm:
                self.norm_after_rope, self.l2_eps = True, float(cfg.rms_norm_eps)
            if not rope and cfg.attn_temperature_tuning:
                self.temperature = (float(cfg.attn_scale), float(cfg.floor_scale))
            self.pairs = self.head_dim  # (its rotary is the whole head's; a normed layer's rot_dim the identity's)
        if kind == "cohere" and getattr(cfg, "use_qk_norm", False):  # Command R+: a LayerNorm per head, each its own
            self.qk_norm = self.qk_norm_whole = True  # weights (over the whole projection, a row of weights a head)
            self.q_norm = LayerNorm((self.num_heads, self.head_dim), norm_eps(cfg), dtype)
            self.k_norm = LayerNorm((self.num_kv_heads, self.head_dim), norm_eps(cfg), dtype)
        elif self.qk_norm:
            widths = (self.q_size, self.kv_size) if self.qk_norm_whole else (self.head_dim, self.head_dim)
            # (Hunyuan's checkpoint names them query_layernorm and key_layernorm)
            names = ("query_layernorm", "key_layernorm") if self.norm_after_rope else ("q_norm", "k_norm")
            for name, width in zip(names, widths):
                setattr(self, name, norm_for(cfg)(width, norm_eps(cfg), dtype))
        self.k_cache = self.v_cache = None  # set by the model runner: [num_blocks, block_size, Hk, D]
        self.rot_dim = self.head_dim  # the rope table's width (set by the model)
        # GLM-4, ERNIE 4.5, Cohere and Helium rotate interleaved pairs (dims 2i, 2i + 1: transformers' glm4, ernie4_5,
        # cohere and helium apply_rotary_pos_emb): each head's rotary dims are reordered evens first, odds after
        # (`_deinterleaved`), and every rotary kernel rotates those halves as its NeoX pairs (q and k alike: their
        # products, the attention, unchanged); ERNIE 4.5's and Cohere's over the whole head
        self.rope_interleaved = cfg.model_type in (*GLM, "ernie4_5", "ernie4_5_moe", "helium", *COHERE, "llama4_text")
        # Ministral 3's query scaled by position (rope.query_scaling: (beta, original) or None; its rope_parameters'
        # llama_4_scaling_beta, not Llama 4's attention temperature, which is `temperature`), in torch before the
        # rotary kernels (a scale commutes with the rotation): every path, the Triton kernels' too
        self.q_scaling = query_scaling(cfg)
        if not self.qk_norm and not self.rope_interleaved and self.q_scaling is None:  # a decode step's qkv LoRA
            # expand may be left to decode_attention (forward; the query scaling needs q's delta added first)
            self.qkv_proj.lora_consumer = _DecodeConsumer(self)
        # o's, to the post-attention rms_norm (forward; Gemma 2's and 3's and OLMo 2's has no residual); none for
        # Granite, whose o output is scaled by residual_multiplier before that norm (GraniteForCausalLM)
        self.o_proj.lora_consumer = _norm_consumer(cfg, dtype)

    def forward(self, positions, x, ctx: ForwardContext, cos_sin):
        """(the attention's output, the o projection's LoRA delta that the post-attention norm adds, or None)."""
        if ctx.max_query_len == 1:  # decodes only: rotary, KV write and attention in one launch on the GPU (with
            q, k, v, delta = self._qkv(x, ctx, deferred=True)  # the adapters' qkv delta, where the layer left it)
            q, k, cos_sin = self._rotated_first(positions, q, k, cos_sin)
            q = self._scaled_query(positions, q)
            tables, slots = self._kv(ctx)
            o = kernels.decode_attention(positions, q, k, v, cos_sin, self.head_dim, self.k_cache, self.v_cache,
                                         slots, tables, ctx.seq_lens, ctx.query_start_loc,
                                         self.scale, delta, self.softcap, self.window, self.sinks, self.chunked)
            return self.o_proj.forward_deferred(o.reshape(x.shape[0], self.q_size), ctx)
        return self.o_proj.forward_deferred(self.attend(self.query(positions, x, ctx, cos_sin), ctx), ctx)

    def _kv(self, ctx: ForwardContext):
        """(block tables, slot mapping) of the layer's KV group."""
        g, groups = self.kv_group, ctx.kv_groups
        if g and groups is not None:  # (a piecewise graph's pieces have the slots only)
            return None if groups[0] is None else groups[0][g - 1], groups[1][g - 1]
        return ctx.block_tables, ctx.slot_mapping

    def _qkv(self, x, ctx: ForwardContext, deferred: bool = False):
        """q [t, q_size], k and v [t, kv_size] (views of the qkv projection's output), q and k normed per head
        where the family does (Qwen3); with `deferred`, and the adapters' delta that the layer left to the caller
        (MergedLinear.forward_deferred; None: none left)."""
        qkv, delta = self.qkv_proj.forward_deferred(x, ctx) if deferred else (self.qkv_proj(x, ctx), None)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm and not self.norm_after_rope:
            q, k = self._normed(q, k, self.q_norm, self.k_norm)
        if self.rope_interleaved:  # (after the norms: Cohere's weights are by dim, in the checkpoint's order)
            q, k = self._deinterleaved(q, self.num_heads), self._deinterleaved(k, self.num_kv_heads)
        return (q, k, v, delta) if deferred else (q, k, v)

    def _normed(self, q, k, q_norm, k_norm):
        """q and k normed by q_norm and k_norm: each over its whole projection (qk_norm_whole), else per head."""
        if self.qk_norm_whole:
            return q_norm(q), k_norm(k)
        t = q.shape[0]
        return (q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size),
                k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size))

    def _rotated_first(self, positions, q, k, cos_sin):
        """(q, k, the table the fused kernels rotate them by): as they are and `cos_sin` but for Hunyuan's layers
        (norm_after_rope), whose `cos_sin` is (the rope table, the identity table: HunYuanDenseV1ForCausalLM._rope):
        q and k rotated by the rope's table, then normed per head, and the identity table, by which the fused
        rotary/KV-store and decode kernels rotate nothing (bit for bit), returned."""
        if not self.norm_after_rope:
            return q, k, cos_sin
        table, identity = cos_sin
        q, k = kernels.rotary_embedding(positions, q, k, table, self.head_dim)
        if self.l2_eps is not None:  # (Llama 4's: no weights)
            norm = functools.partial(l2_normed, eps=self.l2_eps)
            return (*self._normed(q, k, norm, norm), identity)
        return (*self._normed(q, k, self.query_layernorm, self.key_layernorm), identity)

    def _scaled_query(self, positions, q):
        """q [t, q_size] times a scale of each token's position, as transformers computes it; q itself for every
        other family. Two families' scales, from different fields:
        - Llama 4's (model_type llama4_text) attention temperature on its NoPE layers (`temperature`: the config's
          attn_temperature_tuning, attn_scale, floor_scale): 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)),
          in float32 rounded to q's dtype once;
        - Ministral 3's (ministral3: rope.query_scaling, `q_scaling`), a scaling Mistral named after Llama 4's but
          read from rope_parameters' llama_4_scaling_beta and original_max_position_embeddings:
          1 + beta * log(1 + floor(p / original)), cast to q's dtype. Llama 4's own config has no such field."""
        if self.temperature is not None:  # Llama 4's NoPE layers: q times 1 + attn_scale * log(1 + floor((p + 1) /
            attn_scale, floor_scale = self.temperature  # floor_scale)) in float32, rounded to q's dtype (transformers')
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            return (q * scale[:, None]).to(q.dtype)
        if self.q_scaling is None:
            return q
        beta, original = self.q_scaling
        scale = 1 + beta * torch.log(1 + torch.floor(positions / original))
        return q * scale.to(q.dtype)[:, None]

    def _deinterleaved(self, x, heads: int):
        """x [t, heads * head_dim] with each head's rotary dims (the first rot_dim) reordered from interleaved pairs
        (0, 1), (2, 3), ... to halves (0, 2, 4, ... | 1, 3, 5, ...): the pairs every rotary kernel rotates."""
        t, rot = x.shape[0], self.pairs or self.rot_dim
        x = x.reshape(t, heads, self.head_dim)
        halves = x[..., :rot].reshape(t, heads, rot // 2, 2).transpose(2, 3).reshape(t, heads, rot)
        return torch.cat([halves, x[..., rot:]], dim=-1).reshape(t, heads * self.head_dim)

    def compile_decode(self, delta=None) -> None:
        """Compile (launch nothing) the decode_attention variants that add `delta` (the qkv layer's LoRADelta of a
        step of its tokens; None: without adapters): with a sequence's keys in one partition and in several."""
        from ..kernels import attention
        t, dev = (1 if delta is None else delta.hp.shape[1]), self.k_cache.device
        qkv = torch.empty(t, self.q_size + 2 * self.kv_size, dtype=self.qkv_proj.dtype, device=dev)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        ints = [torch.zeros(t, dtype=torch.int64, device=dev) for _ in range(2)]  # positions, slot mapping
        tables = torch.zeros(t, 1, dtype=torch.int32, device=dev)
        lens = torch.ones(t, dtype=torch.int32, device=dev)
        starts = torch.arange(t + 1, dtype=torch.int32, device=dev)
        for parts in (1, 2):
            attention.decode_attention(ints[0], q, k, v, torch.empty(1, self.rot_dim, device=dev), self.head_dim,
                                       self.k_cache, self.v_cache, ints[1], tables, lens, starts, self.scale, delta,
                                       compile_only=True, parts=parts, softcap=self.softcap,
                                       **({"window": self.window, "chunked": self.chunked} if self.window else {}),
                                       **({"sinks": self.sinks} if self.sinks is not None else {}))

    def query(self, positions, x, ctx: ForwardContext, cos_sin):
        """The rotated query [t, q_size] (by `cos_sin`, the layer's table: Gemma3ForCausalLM's differ by layer type);
        this step's K and V are in the cache (the part of the layer before the attention that a piecewise CUDA graph
        records: engine.cuda_graphs.PiecewiseGraphs)."""
        q, k, v = self._qkv(x, ctx)
        q, k, cos_sin = self._rotated_first(positions, q, k, cos_sin)
        q = kernels.rotary_store_kv(positions, self._scaled_query(positions, q), k, v, cos_sin, self.head_dim,
                                    self.k_cache, self.v_cache,
                                    self._kv(ctx)[1])  # one launch on the GPU: q rotated, k rotated and v cached
        return q.reshape(x.shape[0], self.q_size)

    def attend(self, q, ctx: ForwardContext):
        """The attention's output [t, q_size] for the rotated query q [t, q_size] over the paged cache."""
        t = q.shape[0]
        o = kernels.paged_attention(q.reshape(t, self.num_heads, self.head_dim), self.k_cache, self.v_cache,
                                    self._kv(ctx)[0], ctx.seq_lens, ctx.query_start_loc, self.scale,
                                    ctx.max_query_len, self.softcap, self.window, self.sinks, self.chunked)
        return o.reshape(t, self.q_size)


def l2_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's L2 norm of q and k per head (transformers' Llama4TextL2Norm): x * rsqrt(mean(x²) + eps) in
    float32, rounded to x's dtype; no weights."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg, prefix: str, method_for, dtype, inter: int | None = None,
                 stored: tuple[str, str] | None = None):
        """inter: the intermediate width, where not cfg.intermediate_size (Qwen2-MoE's shared expert); stored: the
        checkpoint's (gate|up, down) modules where it stores gate and up as one module under other names (Granite
        4's shared_mlp: input_linear, output_linear), registered under those names (gate_up_proj and down_proj
        their aliases)."""
        super().__init__()
        self.act = activation(cfg)  # silu, or Gemma's gelu_tanh
        # only Llama's, Granite's, SmolLM3's, Seed-OSS's, InternLM3's, Helium's and DeepSeek-V2's MLPs have biases
        # (mlp_bias), and ERNIE 4.5's (use_bias)
        bias = bool(getattr(cfg, "mlp_bias", False)) and cfg.model_type in ("llama", "granite", "granite_swa",
                                                                            "smollm3", "seed_oss",
                                                                            "internlm3", "helium", "deepseek_v2",
                                                                            "falcon_h1", "bamba") \
            or (cfg.model_type in ("ernie4_5", "ernie4_5_moe") and bool(getattr(cfg, "use_bias", False)))
        names = [f"{prefix}.{stored[0]}"] * 2 if stored else fused_names(cfg, prefix, "gate_up_proj",
                                                                          ("gate_proj", "up_proj"))
        # (GraniteMoeShared's shared_mlp stores its down_proj as output_linear, LFM2's feed_forward as w2; its
        # gate|up: fused_names)
        down = f"{prefix}.{stored[1]}" if stored else f"{prefix}.output_linear" \
            if cfg.model_type == "granitemoeshared" else f"{prefix}.w2" if cfg.model_type in LFM2 \
            else f"{prefix}.down_proj"
        inter = cfg.intermediate_size if inter is None else inter  # (0: a Qwen2-MoE without a shared expert)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [inter, inter], names, bias, method_for(names), dtype)
        self.down_proj = MergedLinear(inter, [cfg.hidden_size], [down], bias, method_for([down]), dtype)
        if stored:
            for name, attr in zip(stored, ("gate_up_proj", "down_proj")):
                layer = self._modules.pop(attr)
                setattr(self, name, layer)
                object.__setattr__(self, attr, layer)
        # the expands may be left to silu_and_mul (gate_up's) and to the rms_norm after the MLP (down's: forward)
        self.gate_up_proj.lora_consumer = functools.partial(_compile_silu_and_mul, dtype, self.act == "gelu_tanh")
        self.down_proj.lora_consumer = _norm_consumer(cfg, dtype)
        # set by an engine (EngineConfig.silu_in_gate_up) where gate_up is an int4 kernel layer (`fuses_act`): in a
        # step without adapters (or where the layer has no LoRA hook) its kernel applies silu_and_mul (Gemma's
        # gelu_tanh_and_mul) in its epilogue
        self.act_in_gate_up = False

    def fuses_act(self) -> bool:
        """Whether gate_up's matmul can apply the activation-and-multiply (silu, or Gemma's GeGLU) itself: an int4
        kernel layer."""
        layer = self.gate_up_proj
        if self.act not in ("silu", "gelu_tanh"):  # (the epilogue's activations: gptq_gemm.GATE_ACTS)
            return False
        return getattr(layer.method, "fuses_act", lambda _: False)(layer)

    def forward(self, x, ctx):
        """(the MLP's output, the down projection's LoRA delta that the next rms_norm adds, or None)."""
        if self.act_in_gate_up and (self.gate_up_proj.lora is None or getattr(ctx, "lora", None) is None):
            # one launch: the int4 gate_up kernel's epilogue does silu_and_mul / gelu_tanh_and_mul (no adapter delta
            # to add before it)
            return self.down_proj.forward_deferred(self.gate_up_proj.method.apply(self.gate_up_proj, x,
                                                                                  gated=self.act), ctx)
        gate_up, delta = self.gate_up_proj.forward_deferred(x, ctx)  # delta: the adapters', for silu_and_mul to add
        act = kernels.silu_and_mul(gate_up, delta) if self.act == "silu" else kernels.gelu_tanh_and_mul(gate_up, delta)
        del gate_up, delta  # freed before the down projection, whose peak holds its input and output, not these too
        return self.down_proj.forward_deferred(act, ctx)


class XIELU(nn.Module):
    """Apertus's activation (transformers' XIELUActivation, its Python path): with learned scalars alpha_p, alpha_n
    (stored before softplus) and the constants beta and eps of the checkpoint, x > 0: softplus(alpha_p) x² + beta x,
    else (expm1(min(x, eps)) - x)(beta + softplus(alpha_n)) + beta x, in the model's dtype; torch's ops on the CPU and
    the GPU alike."""

    def __init__(self, dtype):
        super().__init__()
        for name in ("alpha_p", "alpha_n"):
            setattr(self, name, nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False))
        for name in ("beta", "eps"):
            setattr(self, name, nn.Parameter(torch.zeros((), dtype=dtype), requires_grad=False))

    def forward(self, x):
        """transformers' ops in its order (the same values, bit for bit), in place where they can be: beside x, no
        more than three more tensors of its size (the MLP's peak of the memory plan's 4 * intermediate_size)."""
        alpha_p = torch.nn.functional.softplus(self.alpha_p)
        alpha_n = self.beta + torch.nn.functional.softplus(self.alpha_n)
        pos = alpha_p * x
        pos.mul_(x).add_(self.beta * x)
        neg = torch.minimum(x, self.eps)
        neg.expm1_().sub_(x).mul_(alpha_n).add_(self.beta * x)
        return torch.where(x > 0, pos, neg, out=neg)

    def scalars(self) -> tuple[float, float, float, float] | None:
        """(softplus(alpha_p), beta + softplus(alpha_n), beta, eps), each rounded to the model's dtype as forward's
        ops round them: the arguments of the kernels' xIELU (kernels.reference.ungated_act), as Python floats,
        computed once per value of the parameters (a host sync); None while a CUDA graph is being captured and
        they are not known yet (the caller then runs forward's ops)."""
        key = tuple(p._version for p in (self.alpha_p, self.alpha_n, self.beta, self.eps)) + (self.beta.device,)
        if getattr(self, "_scalars", (None,))[0] != key:
            if self.beta.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            a_p = torch.nn.functional.softplus(self.alpha_p)
            a_n = self.beta + torch.nn.functional.softplus(self.alpha_n)
            self._scalars = key, tuple(float(t.item()) for t in (a_p, a_n, self.beta, self.eps))
        return self._scalars[1]


class UngatedMLP(nn.Module):
    """An MLP without gate: down(act(up(x))). StarCoder2's (transformers' Starcoder2MLP: c_fc, gelu's tanh
    approximation, c_proj, biases where use_bias says), Arcee's and Nemotron's (up_proj, relu(x)², down_proj, biases
    where mlp_bias says) and Apertus's (up_proj, xIELU of the layer's learned act_fn parameters, down_proj). The
    layers are registered under the checkpoint's names (`proj_names`); the activation is torch's on the CPU, on the GPU
    one Triton launch (kernels.ungated_act: relu2 and xIELU, torch's ops a launch each) or, on the int4 kernel path,
    the up kernel's epilogue (act_in_up); down's LoRA delta may be left to the rms_norm after it (Arcee's, Apertus's:
    _norm_consumer). `inter`: its width where not intermediate_size (Nemotron 3's shared experts)."""

    def __init__(self, cfg, prefix: str, method_for, dtype, inter: int | None = None):
        super().__init__()
        self.act = activation(cfg)
        if cfg.model_type == "starcoder2":
            bias, self.proj_names = bool(getattr(cfg, "use_bias", True)), ("c_fc", "c_proj")
        else:  # (Apertus's have none, whatever its config says)
            bias = bool(getattr(cfg, "mlp_bias", False)) and cfg.model_type != "apertus"
            self.proj_names = ("up_proj", "down_proj")
        widths = (cfg.hidden_size, inter or cfg.intermediate_size, cfg.hidden_size)
        for i, proj in enumerate(self.proj_names):
            names = [f"{prefix}.{proj}"]
            self.add_module(proj, MergedLinear(widths[i], [widths[i + 1]], names, bias, method_for(names), dtype))
        self.down.lora_consumer = _norm_consumer(cfg, dtype)
        if self.act == "xielu":
            self.act_fn = XIELU(dtype)
        # set by an engine (EngineConfig.silu_in_gate_up) where up is an int4 kernel layer (`fuses_act`): in a step
        # without adapters (or where the layer has no LoRA hook) its kernel applies the activation in its epilogue
        self.act_in_up = False

    def fuses_act(self) -> bool:
        """Whether up's matmul can apply the activation itself: an int4 kernel layer (gptq_gemm's act)."""
        layer = self.up
        return getattr(layer.method, "fuses_act", lambda _: False)(layer)

    def act_scalars(self):
        """xIELU's four scalars (XIELU.scalars; None while unknown under CUDA-graph capture), else None."""
        return self.act_fn.scalars() if self.act == "xielu" else None

    @property
    def up(self) -> MergedLinear:
        return getattr(self, self.proj_names[0])

    @property
    def down(self) -> MergedLinear:
        return getattr(self, self.proj_names[1])

    def forward(self, x, ctx):
        """(the MLP's output, the down projection's LoRA delta that the next rms_norm adds, or None)."""
        scalars = self.act_scalars()
        if self.act_in_up and (self.up.lora is None or getattr(ctx, "lora", None) is None) \
                and (scalars is not None or self.act != "xielu"):
            # one launch: the int4 up kernel's epilogue applies the activation (no adapter delta to add before it)
            return self.down.forward_deferred(self.up.method.apply(self.up, x, act=self.act, act_scalars=scalars),
                                              ctx)
        h = self.up(x, ctx)
        if self.act == "xielu" and (scalars is None or not kernels.use_triton(h)):  # torch's ops (the CPU; on the
            h = self.act_fn(h)  # GPU where the scalars are not known yet under a graph capture)
        else:  # in place (up's output is this MLP's own): on the GPU one launch (kernels.ungated_act)
            h = kernels.ungated_act(h, self.act, scalars)
        return self.down.forward_deferred(h, ctx)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i: int, method_for, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        if is_mla(cfg):  # DeepSeek's multi-head latent attention (models.deepseek)
            from .deepseek import MLAttention
            self.self_attn = MLAttention(cfg, f"{p}.self_attn", method_for, dtype, i)
        else:
            self.self_attn = Attention(cfg, f"{p}.self_attn", method_for, dtype, i)
        if cfg.model_type in UNGATED:
            self.mlp = UngatedMLP(cfg, f"{p}.mlp", method_for, dtype)
        elif is_sparse(cfg, i):  # a mixture of experts' sparse layer (models.moe)
            moe = "block_sparse_moe" if cfg.model_type in ("mixtral", *GRANITE_MOE, "minimax_m2", "phimoe") else "mlp"
            self.mlp = SparseMoeBlock(cfg, f"{p}.{moe}", method_for, dtype)
        else:
            self.mlp = MLP(cfg, f"{p}.mlp", method_for, dtype)
        norm = norm_for(cfg)
        if cfg.model_type in COHERE:  # one norm, whose output the attention and the MLP both read
            self.input_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)
            return
        if cfg.model_type == "apertus":  # Llama's two norms, under Apertus's names (input_layernorm and
            self.attention_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)  # post_attention_layernorm
            self.feedforward_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)  # for the model's loop: not
            object.__setattr__(self, "input_layernorm", self.attention_layernorm)  # registered twice)
            object.__setattr__(self, "post_attention_layernorm", self.feedforward_layernorm)
            return
        if cfg.model_type not in POST_ONLY:  # (OLMo's and EXAONE 4's norm the attention's and MLP's outputs only)
            self.input_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)
        self.post_attention_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)
        if cfg.model_type in GEMMA_FOUR_NORMS:  # four norms: the attention's output and the MLP's in and out as well
            self.pre_feedforward_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)
        if cfg.model_type in POST_NORMS and cfg.model_type != "glm4":  # (OLMo: the MLP's output normed, none before)
            self.post_feedforward_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)
        if cfg.model_type == "glm4":  # GLM-4's names: post_attention_layernorm is the MLP's input norm
            self.post_self_attn_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)
            self.post_mlp_layernorm = norm(cfg.hidden_size, norm_eps(cfg), dtype)
        # No forward: the model's loop runs the four parts itself. A call layer(x, residual) would keep the
        # caller's x and residual alive until it returns, two hidden-sized tensors per token on top of the MLP's.


def _compile_silu_and_mul(dtype: torch.dtype, gelu: bool, delta) -> None:
    """MergedLinear.lora_consumer of the MLP's gate_up: compiles silu_and_mul's (gelu: gelu_tanh_and_mul's)
    variant that adds `delta`."""
    from ..kernels import fused
    t, width = delta.hp.shape[1], delta.bounds[-1]
    x = torch.empty(t, width, dtype=dtype, device=delta.hp.device)
    if gelu:
        fused.gelu_tanh_and_mul(x, delta, compile_only=True)
    else:
        fused.silu_and_mul(x, delta, compile_only=True)


def _norm_consumer(cfg, dtype: torch.dtype):
    """The lora_consumer of o_proj and down_proj: the rms_norm after them (by 1 + w for Gemma; without the residual
    where the family norms those outputs before the residual adds them: POST_NORMS), or None for Granite, whose
    outputs are scaled by residual_multiplier before that norm: the expand stays in the layer."""
    # (Cohere, StarCoder2, Nemotron: the outputs go to the residual, no norm with a residual after them)
    # (Falcon-H1: both outputs scaled by its multipliers before the norm, models.falcon_h1; Nemotron-H: its blocks'
    # mixers hand no delta to the next block's norm, models.nemotron_h, whose o_proj and down deltas a GPU step lost)
    if cfg.model_type in (*GRANITE, *COHERE, "starcoder2", "nemotron", "falcon_h1", "phimoe", "nemotron_h"):
        return None
    return _NormConsumer(dtype, cfg.model_type in GEMMA, cfg.model_type not in POST_NORMS,
                         cfg.model_type in FLOAT_NORMS)


class _NormConsumer:
    """MergedLinear.lora_consumer of o_proj and down_proj: the rms_norm after the layer, with the residual (the
    post-attention norm; the next layer's input norm, or the final norm), adds the delta. Compiles that variant."""

    into_norm = True  # (LoRALayer.fused_norm can keep these expands apart: EngineConfig.lora_expand_in_norm)

    def __init__(self, dtype: torch.dtype, unit_offset: bool = False, residual: bool = True,
                 float_weight: bool = False):
        """unit_offset: Gemma's norm; residual: whether the norm adds the residual (Gemma 2's post-attention and
        post-feedforward norms do not); float_weight: OLMo's norm."""
        self.dtype = dtype
        self.unit = {**({"unit_offset": True} if unit_offset else {}),
                     **({"float_weight": True} if float_weight else {})}
        self.residual = residual

    def __call__(self, delta) -> None:
        from ..kernels import fused
        t, width, dev = delta.hp.shape[1], delta.bounds[-1], delta.hp.device
        x = torch.empty(t, width, dtype=self.dtype, device=dev)
        fused.rms_norm(x, torch.empty(width, dtype=self.dtype, device=dev), 1e-6, x if self.residual else None, delta,
                       compile_only=True, **self.unit)


class _DecodeConsumer:
    """MergedLinear.lora_consumer of a decode step's qkv: Attention.compile_decode, through a weak reference (the
    layer belongs to the attention: no reference cycle keeps the model alive)."""

    def __init__(self, attention: "Attention"):
        self.attention = weakref.ref(attention)

    def __call__(self, delta) -> None:
        self.attention().compile_decode(delta)

    @property
    def window(self) -> int:
        """The attention's sliding window (0: none): a variant of its own (LoRALayer.compile_key)."""
        return self.attention().window


def _moved(held: list) -> tuple:
    """The tensors of `held`, which is emptied: a model's loop passes a layer's stream and attention output so, having
    dropped its own names for them, and the callee frees each as soon as it rebinds the name (a Python caller's
    locals live until the call returns: two more hidden-sized tensors a token while the MLP runs, past the memory
    estimate's count)."""
    items = tuple(held)
    held.clear()
    return items


def _uninitialized(cls, *args, **kw) -> nn.Module:
    """A torch module on the current default device with its weights left unset (the checkpoint fills them): no
    time spent drawing random initial values, and the caller's random state left as it was. (An embedding is given
    its empty weight: its init's normal_ on the meta device would import torch's decompositions, seconds.)"""
    if cls is nn.Embedding:
        return cls(*args, _weight=torch.empty(*args, dtype=kw.pop("dtype", None)), **kw)
    return cls(*args, device="meta", **kw).to_empty(device=torch.get_default_device())


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the HF checkpoint (model.layers.N...), with q/k/v and gate/up merged."""

    # merged module -> the HF projections it stacks, in order (vLLM's name): the loader reads it to route tensors
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        """max_positions: the rope table's rows (the engine's context, --max-model-len; default
        max_position_embeddings, which for a long-context model is a table of hundreds of MB)."""
        super().__init__()
        method_for = method_for or (lambda names: None)
        self.config = cfg
        self.embed_tokens = _uninitialized(nn.Embedding, cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, method_for, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = norm_for(cfg)(cfg.hidden_size, norm_eps(cfg), dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        head = method_for(["lm_head"])  # a GPTQ head (GPTQModel's lm_head=True; stored on its own, tied or not)
        self.quantized_head = head is not None
        if self.quantized_head:
            self.tie_word_embeddings = False
            self.lm_head = MergedLinear(cfg.hidden_size, [cfg.vocab_size], ["lm_head"], False, head, dtype)
            self.lm_head.output_head = True  # no adapter slots (LoRAManager), no dequantize scratch (memory.sizes)
        elif not self.tie_word_embeddings:
            self.lm_head = _uninitialized(nn.Linear, cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
            self.lm_head.weight.requires_grad_(False)
        # ERNIE 4.5 MoE's use_bias, Phi-3.5-MoE's lm_head_bias: transformers' lm_head has a bias (lm_head.bias, its
        # own, tied weight or not)
        self.head_bias = nn.Parameter(torch.empty(cfg.vocab_size, dtype=dtype), requires_grad=False) \
            if (cfg.model_type == "ernie4_5_moe" and bool(getattr(cfg, "use_bias", False))) \
            or (cfg.model_type == "phimoe" and bool(getattr(cfg, "lm_head_bias", False))) else None
        self.register_buffer("packed_head", None, persistent=False)
        types = rope_layer_types(cfg)  # [None]; Gemma 3's layer types: the full layers' table here (Gemma3ForCausalLM)
        self.register_buffer("cos_sin", build_cos_sin_cache(
            cfg, max_positions, "full_attention" if "full_attention" in types else types[0], dtype), persistent=False)
        for layer in self.layers:
            if hasattr(layer, "self_attn"):  # (Qwen3.5's linear-attention layers have none: models.qwen3_5)
                layer.self_attn.rot_dim = self.cos_sin.shape[-1]

    layer_class = DecoderLayer  # (Qwen3.5's: models.qwen3_5.HybridLayer)
    # EAGLE-3 speculation (engine.eagle): the layers whose input (the residual stream) each forward keeps in
    # aux_hidden, in this order; empty: none kept (no cost)
    aux_layers: tuple[int, ...] = ()
    # Granite's residual_multiplier: the attention's and the MLP's outputs scaled by it before the residual adds them
    # (1.0: not scaled; their o and down projections then leave no LoRA delta to the norms: _norm_consumer)
    residual_multiplier = 1.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_and_norm(input_ids)
        delta = None  # the LoRA delta the last o/down projection left to the norm after it
        aux = self.aux_layers
        kept = {} if aux else None
        m = self.residual_multiplier
        for i, layer in enumerate(self.layers):  # each name rebound as soon as its next value exists (old one freed)
            if i:
                x, residual = layer.input_layernorm(x, residual, delta)
            if aux and i in aux:
                kept[i] = residual.clone()
            x, delta = layer.self_attn(positions, x, ctx, self._rope(i))
            if m != 1.0:
                x = x * m
            x, residual = layer.post_attention_layernorm(x, residual, delta)
            x, delta = layer.mlp(x, ctx)
            if m != 1.0:
                x = x * m
        x, _ = self.norm(x, residual, delta)
        if aux:
            self.aux_hidden = [kept[i] for i in aux]
        return x

    def embed_and_norm(self, input_ids: torch.Tensor):
        """(the first layer's input norm of the tokens' embeddings, the embeddings: the first residual), in one launch
        on the GPU (the gather took 10.8 us of an H100's decode step on its own)."""
        norm = self.layers[0].input_layernorm
        if norm.float_weight:  # (gpt-oss: its norm's weight in float32; the fused kernel's is Llama's)
            return self._scaled_embed_and_norm(input_ids, 1.0)
        return kernels.embed_rms_norm(input_ids, self.embed_tokens.weight, norm.weight, norm.eps)

    def _scaled_embed_and_norm(self, input_ids: torch.Tensor, factor: float):
        """embed_and_norm of the embeddings scaled by `factor` (Gemma's normalizer, Granite's embedding_multiplier), the
        first layer's norm its own module (not embed_rms_norm's RMSNorm: gpt-oss's, Cohere's and StarCoder2's)."""
        h = torch.nn.functional.embedding(input_ids, self.embed_tokens.weight)
        if factor != 1.0:
            h = h * factor
        return self.layers[0].input_layernorm(h), h

    def piece(self, i: int, input_ids, positions, o, residual, ctx: ForwardContext):
        """Piece i of the forward as a piecewise CUDA graph records it (engine.cuda_graphs.PiecewiseGraphs): the
        work between two attentions. Piece 0 embeds input_ids and runs layer 0 up to its query; piece i in
        1..L-1 finishes layer i-1 from its attention's output o (o_proj, norm, MLP) and runs layer i up to its
        query; piece L finishes the last layer and applies the final norm. Returns (the query [T, q_size], the
        residual), and from piece L (the hidden states, None). `forward` is the same computation."""
        if i == 0:
            x, residual = self.embed_and_norm(input_ids)
        else:
            done, m = self.layers[i - 1], self.residual_multiplier
            x, delta = done.self_attn.o_proj.forward_deferred(o, ctx)
            if m != 1.0:
                x = x * m
            x, residual = done.post_attention_layernorm(x, residual, delta)
            x, delta = done.mlp(x, ctx)
            if m != 1.0:
                x = x * m
            if i == len(self.layers):
                x, _ = self.norm(x, residual, delta)
                return x, None
            x, residual = self.layers[i].input_layernorm(x, residual, delta)
        return self.layers[i].self_attn.query(positions, x, ctx, self._rope(i)), residual

    def _rope(self, i: int) -> torch.Tensor:
        """Layer i's rotary table (Gemma 3's and OLMo 3's differ by layer type: _RopePerLayerType; the NoPE layers of
        SmolLM3, Cohere 2 and EXAONE 4 rotate by none: _NoPE)."""
        return self.cos_sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized_head:  # at most HEAD_ROWS rows a matmul: the fused int4 kernels, never the dequantize
            # scratch, which would hold the whole head in float (prompt_logprobs and long steps come in slices)
            if len(hidden) <= HEAD_ROWS:
                return self._head_biased(self.lm_head(hidden)).float()
            return torch.cat([self._head_biased(self.lm_head(hidden[i:i + HEAD_ROWS])).float()
                              for i in range(0, len(hidden), HEAD_ROWS)])
        return cpu_gemm.linear(hidden, self._head_weight(), self.head_bias, self.packed_head).float()

    def _head_biased(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.head_bias is None else logits + self.head_bias

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def untie_head(self, weight: torch.Tensor) -> None:
        """A config that ties the output head to the embeddings, in a checkpoint that stores a different lm_head:
        transformers (5) then leaves them untied and uses the stored head, and so does infer."""
        emb = self.embed_tokens.weight
        self.lm_head = nn.Linear(emb.shape[1], emb.shape[0], bias=False, device="meta", dtype=emb.dtype) \
            .to_empty(device=emb.device)
        self.lm_head.weight.requires_grad_(False)
        self.lm_head.weight.copy_(weight)
        self.tie_word_embeddings = False

    def finish_loading(self) -> None:
        """After the weights are in: the CPU matmul layout of a float output head (layers pack their own)."""
        if not self.quantized_head and getattr(self, "score", None) is None:  # (a classifier's score head instead
            self.packed_head = cpu_gemm.prepack(self._head_weight().data)  # of a vocabulary's: models.classifier)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (Phi-3-mini/medium, Phi-3.5-mini, Phi-4): Llama's computation, with the checkpoint's q|k|v stored as one
    self_attn.qkv_proj and gate|up as one mlp.gate_up_proj (as peft adapts them). The layers keep Llama's shards (q,
    k, v; gate, up), each named after the fused module (`fused_names`): the loader splits a fused tensor into them
    (MergedLinear.load_fused), an adapter's module is split the same way (LoRALayer.shard_modules). GPTQModel
    quantizes qkv_proj as one but writes gate_proj and up_proj apart (its Phi-3 MLP is unfused): those load as
    Llama's do (`packed_modules_mapping`, inherited), as vLLM loads either layout."""


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma (Gemma 2B/7B, CodeGemma; transformers' GemmaForCausalLM): Llama's layers and checkpoint names, with
    RMSNorm weighting by 1 + weight in float32 (RMSNorm's unit_offset), a GeGLU MLP (gelu's tanh approximation:
    MLP.act), the embeddings scaled by sqrt(hidden_size) (as a tensor of the model's dtype, as transformers
    rounds it), head_dim set apart from hidden_size / heads (256), and the output head tied to the embeddings."""

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        # sqrt(hidden_size) rounded to the model's dtype, as transformers' embed_scale.to(dtype) (a bf16 model's
        # 3072 ** 0.5 is 55.5): the product of the dtype's values, in float32, rounded once
        self.normalizer = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32, device="cpu").to(dtype))

    def embed_and_norm(self, input_ids: torch.Tensor):
        return self._scaled_embed_and_norm(input_ids, self.normalizer)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 (transformers' Gemma2ForCausalLM): Gemma, with four norms a layer (the attention's output and the
    MLP's output each normed before the residual adds it, the MLP's input after), the attention's scale
    query_pre_attn_scalar ** -0.5 and its scores soft-capped (attn_logit_softcapping: Attention.softcap, in every
    attention kernel), the logits soft-capped (final_logit_softcapping). Its sliding window on alternate layers
    (layer_types): Attention.window, in every attention kernel."""

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        self.final_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)

    def _mlp_block(self, layer, held: list, delta, ctx):
        """From the attention's output x (and the o projection's LoRA delta) to the MLP's output, normed: the
        residual stream then adds it (the next norm's residual). held: [x, the residual], emptied (`_moved`)."""
        x, residual = _moved(held)
        x = layer.post_attention_layernorm(x, None, delta)
        x, residual = layer.pre_feedforward_layernorm(x, residual)
        x, delta = layer.mlp(x, ctx)
        return layer.post_feedforward_layernorm(x, None, delta), residual

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_and_norm(input_ids)
        for i, layer in enumerate(self.layers):
            if i:
                x, residual = layer.input_layernorm(x, residual)
            x, delta = layer.self_attn(positions, x, ctx, self._rope(i))
            held, x, residual = [x, residual], None, None  # (_moved: freed inside as their next values come)
            x, residual = self._mlp_block(layer, held, delta, ctx)
        x, _ = self.norm(x, residual)
        return x

    def piece(self, i: int, input_ids, positions, o, residual, ctx: ForwardContext):
        """LlamaForCausalLM.piece of Gemma 2's layers."""
        if i == 0:
            x, residual = self.embed_and_norm(input_ids)
        else:
            done = self.layers[i - 1]
            x, delta = done.self_attn.o_proj.forward_deferred(o, ctx)
            held, x, residual = [x, residual], None, None
            x, residual = self._mlp_block(done, held, delta, ctx)
            if i == len(self.layers):
                x, _ = self.norm(x, residual)
                return x, None
            x, residual = self.layers[i].input_layernorm(x, residual)
        return self.layers[i].self_attn.query(positions, x, ctx, self._rope(i)), residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:  # final_logit_softcapping: cap * tanh(logits / cap), in float32
            logits = torch.tanh(logits / self.final_softcap).mul_(self.final_softcap)
        return logits


class _RopePerLayerType:
    """A model whose sliding layers rotate by a table of their own (rope_parameters per layer type: Gemma 3, OLMo 3):
    the sliding layers' `local_cos_sin` (rope_parameters["sliding_attention"]), the full layers' `cos_sin`
    (rope_parameters["full_attention"]); `_rope(i)`: layer i's. Put before the model class it extends."""

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        types = rope_layer_types(cfg)
        layer_types = list(getattr(cfg, "layer_types", None) or [])
        # the layers whose table is not cos_sin: the sliding ones, where the full layers' table is cos_sin
        self.local = [len(types) > 1 and i < len(layer_types) and layer_types[i] == "sliding_attention"
                      for i in range(len(self.layers))]
        self.register_buffer("local_cos_sin", build_cos_sin_cache(cfg, max_positions, "sliding_attention", dtype)
                             if any(self.local) else None, persistent=False)

    def _rope(self, i: int) -> torch.Tensor:
        return self.local_cos_sin if self.local[i] else self.cos_sin


class Gemma3ForCausalLM(_RopePerLayerType, Gemma2ForCausalLM):
    """Gemma 3's text model (transformers' Gemma3ForCausalLM, model_type gemma3_text: Gemma-3-1B, Gemma-3-270M):
    Gemma 2's layers (four norms, the scale query_pre_attn_scalar ** -0.5, sliding windows on the layers
    layer_types names, 5 of every 6), with q and k normed per head by 1 + w (Attention.qk_norm, before the rotary),
    no attention soft-capping (transformers' Gemma 3 attention ignores attn_logit_softcapping: the kernels' plain
    variants), the logits soft-capped only where final_logit_softcapping is set (the checkpoints' None), and a
    rope per layer type: the sliding layers rotate by rope_parameters["sliding_attention"] (local base 10000,
    `local_cos_sin`), the full layers by rope_parameters["full_attention"] (base 1e6, linear scaling in the larger
    models: `cos_sin`: _RopePerLayerType)."""


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite 3.x (transformers' GraniteForCausalLM): Llama's layers and checkpoint names, with four scalars of
    the config: the embeddings scaled by embedding_multiplier, the attention's and the MLP's outputs by
    residual_multiplier before the residual adds them, the attention's scale attention_multiplier (instead of
    head_dim ** -0.5: Attention.scale), and the logits divided by logits_scaling."""

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        self.embedding_multiplier = float(cfg.embedding_multiplier)
        self.residual_multiplier = float(cfg.residual_multiplier)
        self.logits_scaling = float(cfg.logits_scaling)

    def embed_and_norm(self, input_ids: torch.Tensor):
        return self._scaled_embed_and_norm(input_ids, self.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling


class Olmo2ForCausalLM(LlamaForCausalLM):
    """AllenAI's OLMo 2 (transformers' Olmo2ForCausalLM): Llama's projections, with no norm before the attention and
    the MLP but one after each (post_attention_layernorm of the attention's output, post_feedforward_layernorm of
    the MLP's, each before the residual adds it), and q and k each normed over its whole projection (every head at
    once: Attention.qk_norm_whole), before the rotary."""

    def _layer_rest(self, layer, held: list, delta, ctx):
        """The layer's output from the residual stream h and its attention's output x (with o's LoRA delta, which the
        post-attention norm adds). held: [h, x], emptied (`_moved`): the MLP runs beside the new stream only."""
        h, x = _moved(held)
        h = h + layer.post_attention_layernorm(x, None, delta)
        del x
        x, delta = layer.mlp(h, ctx)
        return h + layer.post_feedforward_layernorm(x, None, delta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = torch.nn.functional.embedding(input_ids, self.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            x, delta = layer.self_attn(positions, h, ctx, self._rope(i))
            held, h, x = [h, x], None, None
            h = self._layer_rest(layer, held, delta, ctx)
        return self.norm(h)

    def piece(self, i: int, input_ids, positions, o, residual, ctx: ForwardContext):
        """LlamaForCausalLM.piece of OLMo 2's layers (the residual: the stream, which is the next attention's input)."""
        if i == 0:
            h = torch.nn.functional.embedding(input_ids, self.embed_tokens.weight)
        else:
            done = self.layers[i - 1]
            x, delta = done.self_attn.o_proj.forward_deferred(o, ctx)
            held, residual, x = [residual, x], None, None
            h = self._layer_rest(done, held, delta, ctx)
            if i == len(self.layers):
                return self.norm(h), None
        return self.layers[i].self_attn.query(positions, h, ctx, self._rope(i)), h


class Olmo3ForCausalLM(_RopePerLayerType, Olmo2ForCausalLM):
    """AllenAI's OLMo 3 (transformers' Olmo3ForCausalLM): OLMo 2's layers, with a sliding window on the layers
    layer_types names "sliding_attention" (3 of every 4: Attention.window, KV layer groups as Gemma 2's and 3's) and
    a rope per layer type (the full layers' yarn scaling of the long-context checkpoints: _RopePerLayerType)."""


class Glm4ForCausalLM(Gemma2ForCausalLM):
    """GLM-4 (transformers' Glm4ForCausalLM: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Gemma 2's layer of four norms
    (the loop of Gemma2ForCausalLM, without its scaled embeddings, norms by 1 + w or soft-capping), under GLM-4's names:
    input_layernorm, post_self_attn_layernorm (the attention's output, before the residual adds it),
    post_attention_layernorm (the MLP's input), post_mlp_layernorm (the MLP's output, before the residual adds it);
    q, k and v biases (attention_bias) and none on o; gate|up stored as one mlp.gate_up_proj (`fused_names`); a
    partial rotary (partial_rotary_factor 0.5) of interleaved pairs (Attention.rope_interleaved)."""

    def embed_and_norm(self, input_ids: torch.Tensor):
        return LlamaForCausalLM.embed_and_norm(self, input_ids)

    def _mlp_block(self, layer, held: list, delta, ctx):
        x, residual = _moved(held)
        x = layer.post_self_attn_layernorm(x, None, delta)
        x, residual = layer.post_attention_layernorm(x, residual)
        x, delta = layer.mlp(x, ctx)
        return layer.post_mlp_layernorm(x, None, delta), residual


class _NoPE:
    """A model some of whose layers rotate q and k by no rope (NoPE, `rope.nope_layers`: SmolLM3's no_rope_layers,
    Cohere 2's full layers, EXAONE 4's full layers where sliding_window is set). Those layers rotate by `nope_cos_sin`
    (`rope.identity_cos_sin`), a table of one pair of dims whose cos is 1 and sin 0, their rot_dim set to its width:
    q and k pass every rotary kernel unchanged, bit for bit (the head's other dims passed as a partial rotary's are),
    and the fused decode and prefill kernels need no variant of their own; `_rope(i)`: layer i's table. Put before
    the model class it extends."""

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        self.nope = nope_layers(cfg)
        self.register_buffer("nope_cos_sin", identity_cos_sin(self.cos_sin.shape[0]) if any(self.nope) else None,
                             persistent=False)
        for layer, nope in zip(self.layers, self.nope):
            if nope:
                layer.self_attn.rot_dim = self.nope_cos_sin.shape[-1]

    def _rope(self, i: int) -> torch.Tensor:
        return self.nope_cos_sin if self.nope[i] else self.cos_sin


class SmolLM3ForCausalLM(_NoPE, LlamaForCausalLM):
    """Hugging Face's SmolLM3 (transformers' SmolLM3ForCausalLM: SmolLM3-3B): Llama's layers and checkpoint names,
    with no rotary on the layers no_rope_layers marks 0 (NoPE: _NoPE; every 4th layer in SmolLM3-3B). A sliding
    window (use_sliding_window: on the NoPE layers, as transformers lists them in layer_types) is Attention.window's."""


class CohereForCausalLM(_NoPE, LlamaForCausalLM):
    """Cohere's Command R, R+ (transformers' CohereForCausalLM) and Command R7B, A (Cohere2ForCausalLM): a layer of
    one LayerNorm (no bias: LayerNorm), whose output both the attention and the MLP read, their outputs added to the
    residual together; Llama's projections (biases where attention_bias says); a rotary of interleaved pairs
    (Attention.rope_interleaved); Command R+'s q and k LayerNorms per head (use_qk_norm); the logits scaled by
    logit_scale; a tied head by default. Cohere 2: a sliding window on the layers layer_types names
    "sliding_attention" (Attention.window, KV layer groups) and no rotary on the others (NoPE: _NoPE)."""

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        self.logit_scale = float(getattr(cfg, "logit_scale", 1.0))

    def embed_and_norm(self, input_ids: torch.Tensor):  # (a LayerNorm: not embed_rms_norm's)
        return self._scaled_embed_and_norm(input_ids, 1.0)

    def _with_mlp(self, i: int, x, h, ctx: ForwardContext):
        """The residual stream h plus layer i's MLP of its normed input x (the attention's output still to add)."""
        mlp, _ = self.layers[i].mlp(x, ctx)  # (no delta left to a norm: _norm_consumer)
        return h + mlp

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, h = self.embed_and_norm(input_ids)
        for i, layer in enumerate(self.layers):
            if i:
                x = layer.input_layernorm(h)
            o, _ = layer.self_attn(positions, x, ctx, self._rope(i))
            h = self._with_mlp(i, x, h, ctx)
            x = None
            h = h + o
            o = None
        return self.norm(h)

    def piece(self, i: int, input_ids, positions, o, residual, ctx: ForwardContext):
        """LlamaForCausalLM.piece of Cohere's layers: the residual carried between pieces is the stream plus the MLP's
        output of the layer whose attention runs between them."""
        if i == 0:
            x, h = self.embed_and_norm(input_ids)
        else:
            o, _ = self.layers[i - 1].self_attn.o_proj.forward_deferred(o, ctx)
            h = residual + o
            o = residual = None
            if i == len(self.layers):
                return self.norm(h), None
            x = self.layers[i].input_layernorm(h)
        q = self.layers[i].self_attn.query(positions, x, ctx, self._rope(i))
        return q, self._with_mlp(i, x, h, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale


class Exaone4ForCausalLM(_NoPE, Olmo2ForCausalLM):
    """LG's EXAONE 4.0 (transformers' Exaone4ForCausalLM): OLMo 2's layers (norms after the attention and the MLP,
    none before), with q and k normed per head (as Qwen3's) and Llama's RMSNorm; where sliding_window is set, a
    sliding window on the layers layer_types names "sliding_attention" (3 of every 4: Attention.window, KV layer
    groups) and no rotary on the others (NoPE: _NoPE)."""


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """BigCode's StarCoder2 (transformers' Starcoder2ForCausalLM): Llama's layer of two norms as LayerNorms with biases
    (nn.LayerNorm, norm_epsilon), biases on every projection (use_bias), an MLP without gate (UngatedMLP: c_fc, gelu's
    tanh approximation, c_proj), a sliding window on every layer where sliding_window is set (as Mistral's), a tied
    head by default. The norms add no residual (a LayerNorm kernel of its own): its loop adds the outputs itself."""

    def embed_and_norm(self, input_ids: torch.Tensor):  # (a LayerNorm: not embed_rms_norm's)
        return self._scaled_embed_and_norm(input_ids, 1.0)

    def _mlp_added(self, layer, h, ctx: ForwardContext):
        """The stream h plus the layer's MLP of its post-attention norm of h."""
        x, _ = layer.mlp(layer.post_attention_layernorm(h), ctx)
        return h + x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, h = self.embed_and_norm(input_ids)
        for i, layer in enumerate(self.layers):
            if i:
                x = layer.input_layernorm(h)
            x, _ = layer.self_attn(positions, x, ctx, self._rope(i))
            h = self._mlp_added(layer, h + x, ctx)
            x = None
        return self.norm(h)

    def piece(self, i: int, input_ids, positions, o, residual, ctx: ForwardContext):
        """LlamaForCausalLM.piece of StarCoder2's layers (the residual: the stream before the attention's output)."""
        if i == 0:
            x, h = self.embed_and_norm(input_ids)
        else:
            done = self.layers[i - 1]
            o, _ = done.self_attn.o_proj.forward_deferred(o, ctx)
            h = self._mlp_added(done, residual + o, ctx)
            o = residual = None
            if i == len(self.layers):
                return self.norm(h), None
            x = self.layers[i].input_layernorm(h)
        return self.layers[i].self_attn.query(positions, x, ctx, self._rope(i)), h


class _Ungated:
    """A model whose MLP has no gate (UngatedMLP) under Llama's names up_proj and down_proj: its checkpoint's up_proj
    is a layer of its own, not gate_up_proj's second shard (the loader routes a tensor by packed_modules_mapping). Put
    before the model class it extends."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


class ArceeForCausalLM(_Ungated, LlamaForCausalLM):
    """Arcee's AFM (transformers' ArceeForCausalLM: AFM-4.5B): Llama's layers and checkpoint names (biases where
    attention_bias and mlp_bias say, its yarn rope), with an MLP without gate: down_proj(relu(up_proj(x))²)
    (UngatedMLP)."""


class ApertusForCausalLM(_Ungated, LlamaForCausalLM):
    """Swiss AI's Apertus (transformers' ApertusForCausalLM: Apertus-8B, 70B): Llama's layer of two RMSNorms under the
    names attention_layernorm and feedforward_layernorm (DecoderLayer), q and k normed per head (as Qwen3's), an MLP
    without gate or biases: down_proj(xIELU(up_proj(x))), the xIELU of each layer's learned alpha_p and alpha_n
    (mlp.act_fn: XIELU), its llama3 rope."""


class NemotronForCausalLM(_Ungated, Starcoder2ForCausalLM):
    """NVIDIA's Nemotron-4 and Minitron (transformers' NemotronForCausalLM): StarCoder2's loop of two LayerNorms with
    biases a layer, each weighting by 1 + weight (LayerNorm1P: LayerNorm's unit_offset; norm_eps), biases where
    attention_bias and mlp_bias say, an MLP without gate: down_proj(relu(up_proj(x))²) (UngatedMLP), a partial rotary
    (partial_rotary_factor, 0.5 by default: rope.partial_rotary), no sliding window."""


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """Tencent's Hunyuan dense models (transformers' HunYuanDenseV1ForCausalLM: Hunyuan-0.5B/1.8B/4B/7B-Instruct):
    Llama's layers, q and k normed per head after the rotary (query_layernorm, key_layernorm:
    Attention.norm_after_rope), its rope's NTK alpha (rope.py). `_rope(i)` is (the rope table, `nope_cos_sin`): each
    layer rotates q and k by the first (kernels.rotary_embedding), norms them, and hands the fused rotary/KV-store and
    decode kernels the second, an identity table (_NoPE's) that rotates nothing."""

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        self.register_buffer("nope_cos_sin", identity_cos_sin(self.cos_sin.shape[0]), persistent=False)
        for layer in self.layers:
            layer.self_attn.rot_dim = self.nope_cos_sin.shape[-1]

    def _rope(self, i: int):
        return self.cos_sin, self.nope_cos_sin


class GraniteSWAForCausalLM(_NoPE, GraniteForCausalLM):
    """IBM's Granite SWA (transformers' GraniteSWAForCausalLM): Granite's layers and scalars, sliding windows on the
    layers layer_types names (Attention.window), a learned sink per head in each softmax's denominator (gpt-oss's:
    Attention.sinks; transformers' sigmoid(logsumexp - sink) scaling of the output is the same), no rotary on the
    layers layer_rope_theta gives 0 (NoPE: _NoPE)."""
