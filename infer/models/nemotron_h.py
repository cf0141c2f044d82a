"""NVIDIA Nemotron-H (transformers' NemotronHForCausalLM, model_type nemotron_h: Nemotron-H-8B/47B,
NVIDIA-Nemotron-Nano-9B-v2): "norm then mixer" blocks, each an RMSNorm (norm) and one mixer whose output the residual
adds, the mixer by layers_block_type (config.json's hybrid_override_pattern: "M" Mamba-2, "*" attention, "-" MLP):
Granite 4.0's Mamba-2 mixer (models.granite4.Mamba2Mixer: in_proj, conv1d, the SSD scan, the grouped gated RMSNorm,
out_proj; intermediate mamba_num_heads * mamba_head_dim), attention without rope (q, k, v, o without biases; KV on
those layers alone: engine.model_runner counts the modules with a k_cache), or the MLP without gate
(up_proj, relu(x)², down_proj: llama.UngatedMLP). The checkpoint's backbone.embeddings, backbone.layers.N.{norm,mixer}
and backbone.norm_f are read as model.embed_tokens, model.layers.N.{norm,mixer} and model.norm (checkpoint_name;
model.embeddings and model.norm_f too).
Nemotron 3 (NVIDIA-Nemotron-3-Nano-30B-A3B) adds experts ("E", moe): the mixer a models.moe.SparseMoeBlock,
transformers' NemotronHMoE: GLM-4.5's float32 router (sigmoid scores, e_score_correction_bias steering the choice,
n_group / topk_group, norm_topk_prob, routed_scaling_factor), n_routed_experts relu² experts without gate (up_proj,
down_proj: w13 their up rows alone, the fused MoE's relu(up)²) and the shared experts (a relu² MLP of
moe_shared_expert_intermediate_size, added unscaled); Nemotron 3 Super's experts run in a latent of moe_latent_size
dims between fc1_latent_proj and fc2_latent_proj (models.moe.SparseMoeBlock); checkpoint names
mixer.gate.{weight,e_score_correction_bias}, mixer.experts.N.{up,down}_proj (or transformers 5's stacked
mixer.experts.{up,down}_proj), mixer.shared_experts.{up,down}_proj."""

from __future__ import annotations

import re
from fractions import Fraction
from types import SimpleNamespace

import torch
from torch import nn

from .context import ForwardContext
from .granite4 import Mamba2Mixer
from .llama import Attention, LlamaForCausalLM, RMSNorm, UngatedMLP, _NoPE, _Ungated
from .moe import MoeForCausalLM, SparseMoeBlock
from .qwen3_5 import StateCacheMixin

# (the hub's backbone.*; model.* where saved under transformers 5's names: its NemotronHModel's embeddings, norm_f)
_NAMES = ((re.compile(r"^(backbone|model)\.embeddings\."), "model.embed_tokens."),
          (re.compile(r"^(backbone|model)\.norm_f\."), "model.norm."), (re.compile(r"^backbone\."), "model."))


def checkpoint_name(name: str) -> str:
    """A Nemotron-H checkpoint tensor's name as infer's model holds it (the backbone's as Llama's model.*)."""
    for pattern, repl in _NAMES:
        if pattern.match(name):
            return pattern.sub(repl, name, count=1)
    return name


def mamba_fields(cfg) -> SimpleNamespace:
    """Nemotron-H's Mamba-2 fields under the names Granite 4.0's mixer reads (models.granite4.Mamba2Mixer)."""
    inter = int(cfg.mamba_num_heads) * int(cfg.mamba_head_dim)
    return SimpleNamespace(
        hidden_size=cfg.hidden_size, mamba_n_heads=cfg.mamba_num_heads, mamba_n_groups=cfg.n_groups,
        mamba_d_state=cfg.ssm_state_size, mamba_expand=Fraction(inter, int(cfg.hidden_size)),
        mamba_d_head=cfg.mamba_head_dim, mamba_d_conv=cfg.conv_kernel, mamba_chunk_size=cfg.chunk_size,
        time_step_limit=getattr(cfg, "time_step_limit", None), mamba_proj_bias=bool(getattr(cfg, "use_bias", False)),
        mamba_conv_bias=bool(getattr(cfg, "use_conv_bias", True)), rms_norm_eps=float(cfg.layer_norm_epsilon))


class NemotronHLayer(nn.Module):
    """A Nemotron-H block: norm, then the mixer (Mamba2Mixer, Attention, UngatedMLP or Nemotron 3's SparseMoeBlock)
    whose output the residual adds; `kind`: its layers_block_type entry."""

    def __init__(self, cfg, i: int, method_for, dtype):
        super().__init__()
        p = f"model.layers.{i}.mixer"
        self.kind = cfg.layers_block_type[i]
        self.linear = self.kind == "linear_attention"
        self.norm = RMSNorm(cfg.hidden_size, float(cfg.layer_norm_epsilon), dtype, float_weight=True)
        object.__setattr__(self, "input_layernorm", self.norm)  # (LlamaForCausalLM.embed_and_norm's first norm)
        if self.linear:
            self.mixer = Mamba2Mixer(mamba_fields(cfg), p, method_for, dtype)
        elif self.kind == "full_attention":
            self.mixer = Attention(cfg, p, method_for, dtype, i)
            object.__setattr__(self, "self_attn", self.mixer)  # (the rotary's width: LlamaForCausalLM, _NoPE)
        elif self.kind == "moe":
            self.mixer = SparseMoeBlock(cfg, p, method_for, dtype)
            object.__setattr__(self, "mlp", self.mixer)  # (where models.moe.MoeForCausalLM finds a sparse layer)
        else:
            self.mixer = UngatedMLP(cfg, p, method_for, dtype)


class NemotronHForCausalLM(MoeForCausalLM, _Ungated, _NoPE, LlamaForCausalLM):
    """Nemotron-H: Llama's embedding, final norm (norm_f) and head over NemotronHLayers, attention without rope
    (_NoPE: every attention layer), Nemotron 3's experts' tensors routed by models.moe. Its Mamba-2 layers' states:
    NemotronHHybridForCausalLM (nemotron_h_class)."""

    layer_class = NemotronHLayer
    piecewise = False  # (no piecewise CUDA graphs: `piece` is Llama's)

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)  # (norm_f: weighted in float32, rounded once)
        self.norm = RMSNorm(cfg.hidden_size, float(cfg.layer_norm_epsilon), dtype, float_weight=True)

    def linear_layers(self) -> list[Mamba2Mixer]:
        return [layer.mixer for layer in self.layers if layer.linear]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_and_norm(input_ids)
        kept = self.kept_states(ctx) if getattr(self, "state_pad_slot", None) is not None else None
        for i, layer in enumerate(self.layers):
            if i:
                x, residual = layer.norm(x, residual)
            if layer.linear:
                x, _ = layer.mixer(x, ctx, kept)
            elif layer.kind == "full_attention":
                x, _ = layer.mixer(positions, x, ctx, self._rope(i))
            else:
                x, _ = layer.mixer(x, ctx)
        x, _ = self.norm(x, residual)
        return x


_CLASSES: list[type] = []


def nemotron_h_class(hybrid: bool) -> type:
    """NemotronHForCausalLM, or with Mamba-2 layers (`hybrid`: registry.is_hybrid) its subclass with the state cache
    (qwen3_5.StateCacheMixin)."""
    if not _CLASSES:
        _CLASSES.append(NemotronHForCausalLM)
        _CLASSES.append(type("NemotronHHybridForCausalLM", (StateCacheMixin, NemotronHForCausalLM), {
            "__doc__": "Nemotron-H with Mamba-2 layers: their conv and SSM states in the state cache."}))
    return _CLASSES[1 if hybrid else 0]
