"""Liquid AI's LFM2 (transformers' Lfm2ForCausalLM, model_type lfm2: LFM2-350M/700M/1.2B/2.6B): Llama's layer of two
norms (operator_norm, ffn_norm) and a SwiGLU MLP (feed_forward: w1 the gate, w3 the up, w2 the down projection, its
width `ffn_width`), each layer's operator either attention (layer_types "full_attention": q, k, v and out_proj
without biases, q and k RMSNormed per head by q_layernorm / k_layernorm, rope) or a short convolution ("conv"); no
norm after the embeddings, the final norm embedding_norm; the output head tied to the embeddings by default.

The short conv (transformers' Lfm2ShortConv): in_proj's output [3 H] split into B, C and x; B * x through a causal
depthwise conv1d of conv_L_cache taps (conv.weight [H, 1, L], a bias where conv_bias says; no activation); C times
its output; out_proj. Its state per running sequence is the conv's last L - 1 inputs [H, L - 1] (model dtype), kept
in the engine's state cache as a Mamba-2 layer's conv state (qwen3_5.StateCacheMixin, engine.state_cache: state
slots, prefix-cache snapshots, zero state at position 0) with no recurrent state; the conv is the Gated DeltaNet's
and Mamba-2's (kernels.causal_conv1d_varlen / causal_conv1d_update, without their silu: one Triton launch each on
CUDA).

LFM2-MoE (transformers' Lfm2MoeForCausalLM, model_type lfm2_moe: LFM2-8B-A1B) has the same layers, its first
num_dense_layers MLPs dense (intermediate_size wide, not adjusted), the others a mixture of experts (models.moe:
num_experts SwiGLU experts of moe_intermediate_size, num_experts_per_tok a token, a sigmoid router whose expert_bias
steers the choice)."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..quant.config import ffn_width
from .context import ForwardContext
from .granite4 import _Conv
from .layers import MergedLinear
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from .moe import MoeForCausalLM, SparseMoeBlock, is_sparse
from .qwen3_5 import StateCacheMixin


class ShortConv(nn.Module):
    """transformers' Lfm2ShortConv on a flat batch: in_proj to B | C | x, B * x through the causal depthwise conv
    (from each sequence's conv state in its slot), C times the conv's output, out_proj. Its conv_state [slots, H,
    L - 1] is set by allocate_states (rec_state None: it keeps no other state)."""

    def __init__(self, cfg, prefix: str, method_for, dtype):
        super().__init__()
        self.hidden, self.kernel = int(cfg.hidden_size), int(cfg.conv_L_cache)
        bias = bool(getattr(cfg, "conv_bias", False))
        names = [f"{prefix}.in_proj"]
        self.in_proj = MergedLinear(self.hidden, [3 * self.hidden], names, bias, method_for(names), dtype)
        names = [f"{prefix}.out_proj"]
        self.out_proj = MergedLinear(self.hidden, [self.hidden], names, bias, method_for(names), dtype)
        self.conv = _Conv(self.hidden, self.kernel, bias, dtype)
        object.__setattr__(self, "conv1d", self.conv)  # (StateCacheMixin reads the state's dtype from conv1d)
        self.conv_state = self.rec_state = None  # (allocate_states)

    def state_shapes(self) -> tuple[tuple[int, ...], None]:
        """A slot's (conv state shape, no recurrent state)."""
        return (self.hidden, self.kernel - 1), None

    def forward(self, x, ctx: ForwardContext, kept):
        """(the layer's output, None: no LoRA delta left to a norm). kept [B] bool: whether each sequence's slot holds
        its state (False: its step starts at position 0, from zero state)."""
        b, c, h = self.in_proj(x, ctx).chunk(3, dim=-1)
        bx = b * h
        if ctx.max_query_len == 1:
            y = kernels.causal_conv1d_update(bx, self.conv.weight, self.conv_state, ctx.state_slots, kept,
                                             self.conv.bias, silu=False)
        else:
            y = kernels.causal_conv1d_varlen(bx, self.conv.weight, self.conv_state, ctx.query_start_loc,
                                             ctx.state_slots, kept, ctx.max_query_len, self.conv.bias, silu=False)
        return self.out_proj(c * y, ctx), None


class Lfm2Layer(nn.Module):
    """A decoder layer of LFM2: its operator (self_attn, or conv: a ShortConv), the MLP (feed_forward), its two norms
    (operator_norm, ffn_norm; Llama's loop reads them as input_layernorm and post_attention_layernorm)."""

    def __init__(self, cfg, i: int, method_for, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.linear = cfg.layer_types[i] == "conv"
        if self.linear:
            self.conv = ShortConv(cfg, f"{p}.conv", method_for, dtype)
        else:
            self.self_attn = Attention(cfg, f"{p}.self_attn", method_for, dtype, i)
            _rename(self.self_attn, o_proj="out_proj", q_norm="q_layernorm", k_norm="k_layernorm")
        if is_sparse(cfg, i):  # (LFM2-MoE's experts: models.moe; the loader finds them as the layer's mlp)
            self.feed_forward = SparseMoeBlock(cfg, f"{p}.feed_forward", method_for, dtype)
            object.__setattr__(self, "mlp", self.feed_forward)
        else:
            self.feed_forward = MLP(cfg, f"{p}.feed_forward", method_for, dtype, ffn_width(cfg))
            _rename(self.feed_forward, down_proj="w2")
        eps = float(cfg.norm_eps)
        self.operator_norm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps, dtype)
        object.__setattr__(self, "input_layernorm", self.operator_norm)  # (LlamaForCausalLM.embed_and_norm's)
        object.__setattr__(self, "post_attention_layernorm", self.ffn_norm)


def _rename(module: nn.Module, **names: str) -> None:
    """Register each submodule of `module` under the checkpoint's name (the loader routes tensors by module path),
    its infer name kept as an alias that the shared code reads (not registered twice)."""
    for ours, theirs in names.items():
        layer = module._modules.pop(ours)
        setattr(module, theirs, layer)
        object.__setattr__(module, ours, layer)


class Lfm2ForCausalLM(LlamaForCausalLM):
    """LFM2: Llama's loop over Lfm2Layers, the first layer's operator_norm applied to the embeddings as Llama's input
    norm, the final norm under the checkpoint's embedding_norm. Its short convs' states: Lfm2HybridForCausalLM
    (lfm2_class)."""

    layer_class = Lfm2Layer
    piecewise = False  # (no piecewise CUDA graphs: `piece` is Llama's)
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["w1", "w3"]}

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        _rename(self, norm="embedding_norm")

    def linear_layers(self) -> list[ShortConv]:
        return [layer.conv for layer in self.layers if layer.linear]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return hybrid_forward(self, input_ids, positions, ctx, "operator_norm", "conv", "ffn_norm")


def hybrid_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, first_norm: str,
                   mixer: str, second_norm: str) -> torch.Tensor:
    """The forward of a hybrid in Llama's layer of two norms (LFM2's, Bamba's: models.bamba): each layer's
    `first_norm` (the first layer's is embed_and_norm's), then its `mixer` (a recurrent layer: `linear`) or its
    attention, then `second_norm` and the feed_forward; the layers' attribute names are the checkpoint's."""
    x, residual = model.embed_and_norm(input_ids)
    kept = model.kept_states(ctx) if getattr(model, "state_pad_slot", None) is not None else None
    delta = None  # the LoRA delta the last o/down projection left to the norm after it
    for i, layer in enumerate(model.layers):
        if i:
            x, residual = getattr(layer, first_norm)(x, residual, delta)
        if layer.linear:
            x, delta = getattr(layer, mixer)(x, ctx, kept)
        else:
            x, delta = layer.self_attn(positions, x, ctx, model._rope(i))
        x, residual = getattr(layer, second_norm)(x, residual, delta)
        x, delta = layer.feed_forward(x, ctx)
    x, _ = model.norm(x, residual, delta)
    return x


_CLASSES: list[type] = []


def lfm2_class(hybrid: bool, moe: bool = False) -> type:
    """Lfm2ForCausalLM, with short-conv layers (`hybrid`: registry.is_hybrid) its subclass with the state cache
    (qwen3_5.StateCacheMixin), with experts (`moe`: LFM2-MoE) the loader's routing of their tensors
    (moe.MoeForCausalLM)."""
    if not _CLASSES:
        for state in (False, True):
            for experts in (False, True):
                if not state and not experts:
                    _CLASSES.append(Lfm2ForCausalLM)
                    continue
                bases = (StateCacheMixin,) * state + (MoeForCausalLM,) * experts + (Lfm2ForCausalLM,)
                name = "Lfm2" + "Moe" * experts + "Hybrid" * state + "ForCausalLM"
                _CLASSES.append(type(name, bases, {"__doc__": "LFM2" + "-MoE" * experts + (
                    " with short-conv layers: their conv states in the state cache." if state else ".")}))
    return _CLASSES[2 * hybrid + moe]
