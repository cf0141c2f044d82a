"""DeepSeek's multi-head latent attention (MLA: DeepSeek-V2/V2.5/V2-Lite, DeepSeek-V3/V3.1/R1, Moonlight, Kimi-K2),
served as vLLM serves it: the paged KV cache holds, per token and layer, only the compressed latent: kv_a_layernorm
of c_kv (kv_lora_rank values) then the roped k_pe (qk_rope_head_dim values), one row of kv_lora_rank +
qk_rope_head_dim, one "KV head" that is both the key and the value (`kv_copies` 1: the model runner allocates one
copy, v_cache is k_cache). kv_b_proj is absorbed: its per-head W_UK turns each head's q_nope into a latent query
(q_nope @ W_UK, kv_lora_rank wide), concatenated with the roped q_pe; the attention over the cache is then
multi-query attention (Hk 1, head dim kv_lora_rank + rope dim) whose values are the cache rows (`mla_attention`);
each head's output's first kv_lora_rank dims times W_UV give its v_head_dim values, then o_proj. With
--kv-cache-dtype fp8 (fp8_e5m2) the row is stored in float8 (saturated, rounded to nearest even, scale 1.0, as the
other families' K and V: kernels.store_kv), half a bfloat16 row's bytes, and the MLA kernels read it as stored.

The softmax scale is qk_head_dim^-0.5 times yarn's mscale² where rope_parameters say so (transformers'
yarn_apply_mscale). The rotary is over qk_rope_head_dim (models.rope): DeepSeek-V3's rope_interleave (default) and
DeepSeek-V2's complex rotation rotate interleaved pairs, which q_pe and k_pe are reordered from (evens, then odds:
the NeoX pairs every rotary kernel rotates; q's and k's alike, their products unchanged). The layers around it, the
router and the experts are models.moe's (DeepSeek-V3's router is GLM-4.5's, `moe.GROUPED`; DeepSeek-V2's
softmax router of greedy or group-limited top k: `SparseMoeBlock._v2_route`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from .context import ForwardContext
from .layers import MergedLinear

# the eps of q_a_layernorm and kv_a_layernorm: transformers builds them with DeepseekV3RMSNorm's default, whatever
# rms_norm_eps says
LATENT_NORM_EPS = 1e-6


def mla_scale(cfg) -> float:
    """The softmax scale: qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim)² where the rope is not
    the default one (transformers' yarn_apply_mscale)."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    from .rope import rope_parameters
    return float(yarn_apply_mscale(rope_parameters(cfg), (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5))


def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float, max_query_len: int, rank: int) -> torch.Tensor:
    """MLA over the latent cache: the latent queries q [T, H, rank + rope] attend, as multi-query attention (one KV
    head), to the cache rows [num_blocks, block_size, 1, rank + rope], which are the keys and the values; returns
    each head's output's latent part [T, H, rank] (the rope dims of the values are not the model's). On a GPU the
    MLA kernels (kernels.mla: each cache row read once for a block of heads, the key's latent and rope parts two
    dots, the values the latent part already loaded; a float8 cache, --kv-cache-dtype fp8, read one byte an element
    and upcast in registers); elsewhere the paged attention's (kernels.paged_attention: torch on the CPU, a float8
    cache upcast as gathered), K and V the same tensor."""
    if kernels.use_triton(q):
        return kernels._triton("mla").mla_paged_attention(q, cache, block_tables, seq_lens, query_start_loc, scale,
                                                          rank, max_query_len)
    o = kernels.paged_attention(q, cache, cache, block_tables, seq_lens, query_start_loc, scale, max_query_len)
    return o[..., :rank]


def _deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """x [..., R] with its interleaved rotary pairs (0, 1), (2, 3), ... reordered to halves (0, 2, ... | 1, 3, ...)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention with kv_b_proj absorbed (the module docstring): the latent cache of one
    copy (`kv_copies`), the query of `query`, the attention of `attend` (`mla_attention`), o_proj."""

    kv_copies = 1  # the model runner's cache: one row a token (k_cache and v_cache the same tensor)

    def __init__(self, cfg, prefix: str, method_for, dtype, layer: int = 0):
        super().__init__()
        from .llama import RMSNorm, _norm_consumer
        h, hidden = int(cfg.num_attention_heads), cfg.hidden_size
        self.num_heads = h
        self.rank, self.rope_dim = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
        self.nope_dim, self.v_head_dim = int(cfg.qk_nope_head_dim), int(cfg.v_head_dim)
        self.num_kv_heads, self.head_dim = 1, self.rank + self.rope_dim  # (the cache's: models.shapes, latent)
        self.q_size = h * self.head_dim  # the latent query's width (a piecewise graph's buffer of it)
        self.out_size = h * self.v_head_dim  # o_proj's input (the attention's output after W_UV)
        self.scale = mla_scale(cfg)
        self.window, self.sinks, self.softcap, self.kv_group = 0, None, 0.0, 0  # (what the engine reads of a layer)
        bias = bool(getattr(cfg, "attention_bias", False))
        qk = self.nope_dim + self.rope_dim
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)

        def linear(name: str, rows: int, cols: int, with_bias: bool) -> MergedLinear:
            names = [f"{prefix}.{name}"]
            return MergedLinear(rows, [cols], names, with_bias, method_for(names), dtype)

        if self.q_lora_rank:
            self.q_a_proj = linear("q_a_proj", hidden, int(self.q_lora_rank), bias)
            self.q_a_layernorm = RMSNorm(int(self.q_lora_rank), LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear("q_b_proj", int(self.q_lora_rank), h * qk, False)
        else:
            self.q_proj = linear("q_proj", hidden, h * qk, False)
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, self.head_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = linear("kv_b_proj", self.rank, h * (self.nope_dim + self.v_head_dim), False)
        self.kv_b_proj.absorbed = True  # (its weight read as W_UK and W_UV, never run as a layer: no adapter slots)
        self.o_proj = linear("o_proj", self.out_size, hidden, bias)
        self.o_proj.lora_consumer = _norm_consumer(cfg, dtype)  # (the post-attention norm adds o's delta)
        # DeepSeek-V2 rotates interleaved pairs always (its complex rotation), DeepSeek-V3 where rope_interleave says
        self.rope_interleaved = cfg.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))
        self.k_cache = self.v_cache = None  # set by the model runner: [num_blocks, block_size, 1, rank + rope]
        self.rot_dim = self.rope_dim  # the rope table's width (set by the model)
        self.register_buffer("kv_b_float", None, persistent=False)  # a quantized kv_b_proj's float copy (`absorb`)

    def forward(self, positions, x, ctx: ForwardContext, cos_sin):
        """(the attention's output, the o projection's LoRA delta that the post-attention norm adds, or None)."""
        return self.o_proj.forward_deferred(self.attend(self.query(positions, x, ctx, cos_sin), ctx), ctx)

    def _kv(self, ctx: ForwardContext):
        """(block tables, slot mapping) of the layer's KV group (llama.Attention's)."""
        g, groups = self.kv_group, ctx.kv_groups
        if g and groups is not None:
            return None if groups[0] is None else groups[0][g - 1], groups[1][g - 1]
        return ctx.block_tables, ctx.slot_mapping

    def absorb(self) -> None:
        """Once the weights are in (the model's finish_loading): a quantized kv_b_proj that keeps no float weight (the
        int4 kernels' layout, a GPU's) dequantized once into the buffer `kv_b_float`, which W_UK and W_UV are views
        of: a buffer, so that the memory plan counts it with the weights (memory.sizes.weights_bytes; the checkpoint
        estimate too, memory.checkpoint), a sleep keeps it and reload_weights takes the fresh load's. A float
        kv_b_proj's own weight, or a quantized one's dequantized at load (the CPU's), is read as it is."""
        layer = self.kv_b_proj
        if getattr(layer, "weight", None) is None:
            self.kv_b_float = layer.dequantized_weight().to(layer.dtype)

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight as [H, nope + v, rank] (W_UK's rows of each head, then W_UV's): a view of the layer's
        float weight, or of its dequantized copy (`absorb`)."""
        w = getattr(self.kv_b_proj, "weight", None)
        if w is None:
            if self.kv_b_float is None:  # (a layer loaded without its model's finish_loading)
                self.absorb()
            w = self.kv_b_float
        return w.view(self.num_heads, self.nope_dim + self.v_head_dim, self.rank)

    def query(self, positions, x, ctx: ForwardContext, cos_sin):
        """The latent query [t, H * (rank + rope)] (each head's q_nope @ W_UK, then its roped q_pe); this step's
        latent rows (kv_a_layernorm of c_kv, then the roped k_pe) are in the cache (the part of the layer before the
        attention that a piecewise CUDA graph records)."""
        t, h, rope = x.shape[0], self.num_heads, self.rope_dim
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, ctx)), ctx)
        else:
            q = self.q_proj(x, ctx)
        q = q.view(t, h, self.nope_dim + rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x, ctx).split([self.rank, rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = q[..., self.nope_dim:], k_pe
        if self.rope_interleaved:
            q_pe, k_pe = _deinterleaved(q_pe), _deinterleaved(k_pe)
        q_pe, k_pe = kernels.rotary_embedding(positions, q_pe.reshape(t, h * rope), k_pe.contiguous(), cos_sin, rope)
        w_uk = self.kv_b_weight()[:, :self.nope_dim]  # [H, nope, rank]
        q_latent = torch.bmm(q[..., :self.nope_dim].transpose(0, 1), w_uk).transpose(0, 1)  # [t, H, rank]
        row = torch.cat([latent, k_pe], dim=-1).view(t, 1, self.head_dim)
        kernels.store_kv(row, row, self.k_cache, self.v_cache, self._kv(ctx)[1])
        return torch.cat([q_latent, q_pe.view(t, h, rope)], dim=-1).view(t, self.q_size)

    def attend(self, q, ctx: ForwardContext):
        """o_proj's input [t, H * v_head_dim]: `mla_attention` of the latent query q [t, H * (rank + rope)] over the
        cache, each head's latent output times its W_UV."""
        t = q.shape[0]
        o = mla_attention(q.view(t, self.num_heads, self.head_dim), self.k_cache, self._kv(ctx)[0], ctx.seq_lens,
                          ctx.query_start_loc, self.scale, ctx.max_query_len, self.rank)
        w_uv = self.kv_b_weight()[:, self.nope_dim:]  # [H, v, rank]
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(t, self.out_size)


_CLASS: list[type] = []


def deepseek_class() -> type:
    """models.moe's model class (Llama's loop, the sparse layers' routing of the experts' tensors) whose attention
    keeps its projections apart (q_proj is MLAttention's own, not a shard of a merged qkv_proj)."""
    if not _CLASS:
        from .moe import moe_model_class
        base = moe_model_class()

        def finish_loading(self) -> None:
            """The base's, then each latent attention's kv_b_proj absorbed (MLAttention.absorb)."""
            base.finish_loading(self)
            for layer in self.layers:
                layer.self_attn.absorb()
        _CLASS.append(type("DeepseekForCausalLM", (base,), {
            "__doc__": "DeepSeek-V3 / V2 (models.deepseek): MLA layers, a sparse layer's MLP a SparseMoeBlock.",
            "packed_modules_mapping": {"gate_up_proj": ["gate_proj", "up_proj"]}, "finish_loading": finish_loading}))
    return _CLASS[0]
