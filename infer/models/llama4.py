"""Meta's Llama 4 text model (transformers' Llama4ForCausalLM, model_type llama4_text; the language model of
Llama4ForConditionalGeneration: Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E, served without the vision tower:
models.multimodal).

Its layers (transformers' Llama4TextDecoderLayer): Llama's two norms around the attention and the feed_forward. The
attention (models.llama.Attention's switches for llama4_text): a rotary of interleaved pairs (the complex form of
apply_rotary_emb: Attention.rope_interleaved) on the layers no_rope_layers marks 1, none on the others (NoPE: the
identity table, as _NoPE's); on the rope layers q and k L2-normed per head after the rotary where use_qk_norm says
(Attention.l2_eps, Hunyuan's order: the fused kernels get the identity table) and a chunked attention where
attention_chunk_size is set (each query over its own chunk's keys: Attention.chunked, every attention kernel); on the
NoPE layers the query scaled by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) where attn_temperature_tuning
says (Attention.temperature). Its feed_forward: on the layers moe_layers lists (interleave_moe_layer_step) the
experts (models.moe.SparseMoeBlock: a sigmoid of the top k router logits scaling each token's input to its experts,
the shared expert added), on the others a dense SwiGLU MLP of intermediate_size_mlp.
"""

from __future__ import annotations

import torch
from torch import nn

from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from .moe import MoeForCausalLM, SparseMoeBlock, is_sparse
from .rope import identity_cos_sin


class Llama4Layer(nn.Module):
    """A Llama 4 decoder layer: self_attn, feed_forward (experts or a dense MLP; Llama's loop reads it as mlp), the
    two norms."""

    def __init__(self, cfg, i: int, method_for, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.self_attn = Attention(cfg, f"{p}.self_attn", method_for, dtype, i)
        if is_sparse(cfg, i):
            self.feed_forward = SparseMoeBlock(cfg, f"{p}.feed_forward", method_for, dtype)
        else:
            self.feed_forward = MLP(cfg, f"{p}.feed_forward", method_for, dtype, inter=int(cfg.intermediate_size_mlp))
        object.__setattr__(self, "mlp", self.feed_forward)  # (Llama's loop; the loader finds the experts by it)
        self.input_layernorm = RMSNorm(cfg.hidden_size, float(cfg.rms_norm_eps), dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, float(cfg.rms_norm_eps), dtype)


class Llama4ForCausalLM(MoeForCausalLM, LlamaForCausalLM):
    """Llama 4's text model: Llama's loop over Llama4Layers. `_rope(i)`: a NoPE layer's the identity table
    (`nope_cos_sin`), a rope layer's the rope table, or where its q and k are L2-normed after the rotary (rope table,
    identity table): Attention._rotated_first rotates by the first and hands the fused kernels the second."""

    layer_class = Llama4Layer

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        self.rope = [bool(r) for r in cfg.no_rope_layers[:cfg.num_hidden_layers]]
        identity = any(not r or layer.self_attn.norm_after_rope for r, layer in zip(self.rope, self.layers))
        self.register_buffer("nope_cos_sin", identity_cos_sin(self.cos_sin.shape[0]) if identity else None,
                             persistent=False)  # (rope.rope_table_bytes counts it)
        for layer, rope in zip(self.layers, self.rope):
            attn = layer.self_attn
            if not rope or attn.norm_after_rope:  # (the fused kernels rotate by the identity table)
                attn.rot_dim = self.nope_cos_sin.shape[-1]

    def _rope(self, i: int):
        if not self.rope[i]:
            return self.nope_cos_sin
        return (self.cos_sin, self.nope_cos_sin) if self.layers[i].self_attn.norm_after_rope else self.cos_sin
