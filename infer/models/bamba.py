"""IBM's Bamba (transformers' BambaForCausalLM, model_type bamba: Bamba-9B, Bamba-9B-v2), the research predecessor
of Granite 4.0: Llama's layer of two norms (input_layernorm, pre_ff_layernorm) and a SwiGLU MLP (feed_forward:
gate_proj, up_proj, down_proj, biases where mlp_bias says), each layer's mixer either attention (the layers
attn_layer_indices names: layers_block_type "full_attention"; q, k, v and o with attention_bias, half of each head
rotated: transformers' BambaConfig sets partial_rotary_factor 0.5, config.json's attn_rotary_emb its width) or Granite
4.0's Mamba-2 mixer (models.granite4.Mamba2Mixer: the same in_proj, conv1d, SSD scan, grouped gated RMSNorm and
out_proj, under the same mamba_* fields; its conv's activation hidden_act, silu alone: registry.activation); the final
norm final_layernorm; none of Granite's scalars. z_loss_coefficient and num_logits_to_keep are training and
generate() settings: nothing to compute. Its Mamba-2 layers keep their conv and SSM states in the engine's state cache
(qwen3_5.StateCacheMixin), as Granite 4.0's."""

from __future__ import annotations

import torch
from torch import nn

from .context import ForwardContext
from .granite4 import Mamba2Mixer
from .lfm2 import _rename, hybrid_forward
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from .qwen3_5 import StateCacheMixin


class BambaLayer(nn.Module):
    """A decoder layer of Bamba: its mixer (mamba: a Mamba2Mixer, or self_attn), the MLP (feed_forward), its two
    norms (input_layernorm; pre_ff_layernorm, which Llama's loop reads as post_attention_layernorm)."""

    def __init__(self, cfg, i: int, method_for, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.linear = cfg.layers_block_type[i] == "linear_attention"
        if self.linear:
            self.mamba = Mamba2Mixer(cfg, f"{p}.mamba", method_for, dtype)
        else:
            self.self_attn = Attention(cfg, f"{p}.self_attn", method_for, dtype, i)
        self.feed_forward = MLP(cfg, f"{p}.feed_forward", method_for, dtype)
        eps = float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        object.__setattr__(self, "post_attention_layernorm", self.pre_ff_layernorm)


class BambaForCausalLM(LlamaForCausalLM):
    """Bamba: Llama's loop over BambaLayers, the final norm under the checkpoint's final_layernorm. Its Mamba-2 layers'
    states: BambaHybridForCausalLM (bamba_class)."""

    layer_class = BambaLayer
    piecewise = False  # (no piecewise CUDA graphs: `piece` is Llama's)

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        _rename(self, norm="final_layernorm")

    def linear_layers(self) -> list[Mamba2Mixer]:
        return [layer.mamba for layer in self.layers if layer.linear]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return hybrid_forward(self, input_ids, positions, ctx, "input_layernorm", "mamba", "pre_ff_layernorm")


_CLASSES: list[type] = []


def bamba_class(hybrid: bool) -> type:
    """BambaForCausalLM, or with Mamba-2 layers (`hybrid`: registry.is_hybrid) its subclass with the state cache
    (qwen3_5.StateCacheMixin)."""
    if not _CLASSES:
        _CLASSES.append(BambaForCausalLM)
        _CLASSES.append(type("BambaHybridForCausalLM", (StateCacheMixin, BambaForCausalLM), {
            "__doc__": "Bamba with Mamba-2 layers: their conv and SSM states in the state cache."}))
    return _CLASSES[1 if hybrid else 0]
