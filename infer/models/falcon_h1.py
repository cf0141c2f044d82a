"""TII's Falcon-H1 (transformers' FalconH1ForCausalLM, model_type falcon_h1: Falcon-H1-0.5B/1.5B/3B/7B/34B, base and
instruct): every layer runs Llama's attention (rope) and a Mamba-2 mixer IN PARALLEL on the same normed input, their
outputs summed into the residual, then a SwiGLU MLP (feed_forward, after pre_ff_layernorm); the final norm is
final_layernorm. Its muP scalars, each where transformers applies it:
- embedding_multiplier on the embeddings, lm_head_multiplier on the logits;
- attention_in_multiplier on the attention's input (its adapters see it too), key_multiplier on k (the attention's
  scale times it: q.(k m) = m (q.k), the cache holding k unscaled), attention_out_multiplier on its output;
- ssm_in_multiplier on the mixer's input, the mup vector (ssm_multipliers over z, x, B, C and dt) on in_proj's output
  (its adapters' delta included), ssm_out_multiplier on the mixer's output;
- mlp_multipliers: the gate's output (before silu) and down's output.
The mixer is Granite 4.0's (models.granite4.Mamba2Mixer: its conv and SSM states per sequence in the state cache), of
mamba_d_ssm channels where given (else mamba_expand * hidden_size), in_proj's bias mamba_proj_bias, out_proj's
projectors_bias, and its norm transformers' FalconH1RMSNormGated where mamba_rms_norm (grouped; the gate before or
after the norm: mamba_norm_before_gate), else y * silu(z). KV on every layer, a Mamba-2 state on every layer."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .context import ForwardContext
from .granite4 import Mamba2Mixer
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from .qwen3_5 import StateCacheMixin


def mamba_width(cfg) -> int:
    """The mixer's channels (transformers' FalconH1Mixer.intermediate_size): mamba_d_ssm, else mamba_expand times
    hidden_size."""
    d_ssm = getattr(cfg, "mamba_d_ssm", None)
    return int(cfg.mamba_expand * cfg.hidden_size) if d_ssm is None else int(d_ssm)


def mamba_fields(cfg) -> SimpleNamespace:
    """Falcon-H1's Mamba-2 fields under the names Granite 4.0's mixer reads (models.granite4.Mamba2Mixer):
    mamba_d_ssm as an expand of hidden_size, out_proj's bias projectors_bias."""
    return SimpleNamespace(
        hidden_size=cfg.hidden_size, mamba_n_heads=cfg.mamba_n_heads, mamba_n_groups=cfg.mamba_n_groups,
        mamba_d_state=cfg.mamba_d_state, mamba_expand=Fraction(mamba_width(cfg), int(cfg.hidden_size)),
        mamba_d_head=cfg.mamba_d_head, mamba_d_conv=cfg.mamba_d_conv, mamba_chunk_size=cfg.mamba_chunk_size,
        time_step_limit=getattr(cfg, "time_step_limit", None), mamba_proj_bias=bool(cfg.mamba_proj_bias),
        mamba_out_proj_bias=bool(getattr(cfg, "projectors_bias", False)),
        mamba_conv_bias=bool(getattr(cfg, "mamba_conv_bias", True)), rms_norm_eps=float(cfg.rms_norm_eps))


def mup_vector(cfg) -> torch.Tensor:
    """transformers' compute_mup_vector: in_proj's output columns z, x, B, C and dt scaled by ssm_multipliers[0..4]
    (float32, [2 I + 2 G N + H])."""
    inter, gn, heads = mamba_width(cfg), int(cfg.mamba_n_groups) * int(cfg.mamba_d_state), int(cfg.mamba_n_heads)
    widths = (inter, inter, gn, gn, heads)
    return torch.cat([torch.full((w,), float(m)) for w, m in zip(widths, cfg.ssm_multipliers)])


def buffer_elements(cfg) -> int:
    """The elements of the buffers a Falcon-H1 model holds beside its checkpoint's tensors (memory.checkpoint): each
    layer's mup vector (FalconMixer.mup) and, where mlp_multipliers' gate is not 1, its gate scale
    (FalconMLP.gate_scale)."""
    gate = 2 * int(cfg.intermediate_size) if float(cfg.mlp_multipliers[0]) != 1.0 else 0
    return int(cfg.num_hidden_layers) * (len(mup_vector(cfg)) + gate)


class FalconGatedNorm(nn.Module):
    """transformers' FalconH1RMSNormGated (mamba_rms_norm): over each of n_groups groups of y in float32, the weight
    applied in float32, times silu(z) after the norm (norm_before_gate) or before it, rounded to y's dtype; without
    mamba_rms_norm (no weight): y * silu(z), as FalconH1Mixer computes it then."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype, rms: bool, before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False) if rms else None
        self.groups, self.eps, self.before_gate = groups, eps, before_gate

    def forward(self, y, gate):
        if self.weight is None:
            return y * F.silu(gate)
        h = y.float()
        if not self.before_gate:
            h = h * F.silu(gate.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        h = self.weight * (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        if self.before_gate:
            h = h * F.silu(gate.float())
        return h.to(y.dtype)


class FalconMixer(Mamba2Mixer):
    """Granite 4.0's Mamba-2 mixer on Falcon-H1's fields (mamba_fields): its input times ssm_in_multiplier, in_proj's
    output times the mup vector (a buffer in the model's dtype, as transformers' is), FalconGatedNorm."""

    def __init__(self, cfg, prefix: str, method_for, dtype):
        super().__init__(mamba_fields(cfg), prefix, method_for, dtype)
        self.norm = FalconGatedNorm(self.inter, self.groups, float(cfg.rms_norm_eps), dtype,
                                    bool(getattr(cfg, "mamba_rms_norm", False)),
                                    bool(getattr(cfg, "mamba_norm_before_gate", True)))
        self.ssm_in = float(cfg.ssm_in_multiplier)
        self.register_buffer("mup", mup_vector(cfg).to(dtype), persistent=False)

    def projected(self, x, ctx: ForwardContext):
        if self.ssm_in != 1.0:
            x = x * self.ssm_in
        return self.in_proj(x, ctx) * self.mup


class FalconMLP(MLP):
    """Falcon-H1's feed_forward (transformers' FalconH1MLP): up * silu(gate * gate_multiplier), down's output times
    down_multiplier (mlp_multipliers); the adapters' deltas inside both products (gate_up and down applied whole,
    none left to silu_and_mul or a norm; no activation in an int4 kernel's epilogue: `fuses_act`)."""

    def __init__(self, cfg, prefix: str, method_for, dtype):
        super().__init__(cfg, prefix, method_for, dtype)
        gate, down = (float(m) for m in cfg.mlp_multipliers)
        inter = self.gate_up_proj.out_sizes[0]
        self.down_multiplier = down
        scale = torch.cat([torch.full((inter,), gate), torch.ones(inter)]).to(dtype) if gate != 1.0 else None
        self.register_buffer("gate_scale", scale, persistent=False)

    def fuses_act(self) -> bool:
        return False

    def forward(self, x, ctx):
        gate_up = self.gate_up_proj(x, ctx)
        if self.gate_scale is not None:
            gate_up = gate_up * self.gate_scale
        y = self.down_proj(kernels.silu_and_mul(gate_up, None), ctx)
        return (y * self.down_multiplier if self.down_multiplier != 1.0 else y), None


class FalconH1Layer(nn.Module):
    """A Falcon-H1 decoder layer: input_layernorm, the Mamba-2 mixer (mamba) beside the attention (self_attn), the
    MLP (feed_forward) after pre_ff_layernorm."""

    def __init__(self, cfg, i: int, method_for, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.linear = True  # (every layer keeps a Mamba-2 state; each attends too)
        self.mamba = FalconMixer(cfg, f"{p}.mamba", method_for, dtype)
        self.self_attn = Attention(cfg, f"{p}.self_attn", method_for, dtype, i)
        self.feed_forward = FalconMLP(cfg, f"{p}.feed_forward", method_for, dtype)
        eps = float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)


class FalconH1ForCausalLM(LlamaForCausalLM):
    """Falcon-H1: Llama's embedding and head over FalconH1Layers, the final norm stored as final_layernorm, its muP
    scalars (the module's docstring). Its Mamba-2 states: FalconH1HybridForCausalLM (falcon_h1_class)."""

    layer_class = FalconH1Layer
    piecewise = False  # (no piecewise CUDA graphs: `piece` is Llama's)

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        norm = self._modules.pop("norm")  # (the checkpoint's model.final_layernorm; `norm` its alias)
        self.final_layernorm = norm
        object.__setattr__(self, "norm", norm)
        self.embedding_multiplier = float(cfg.embedding_multiplier)
        self.lm_head_multiplier = float(cfg.lm_head_multiplier)
        self.attention_in = float(cfg.attention_in_multiplier)
        self.attention_out = float(cfg.attention_out_multiplier)
        self.ssm_out = float(cfg.ssm_out_multiplier)

    def linear_layers(self) -> list[Mamba2Mixer]:
        return [layer.mamba for layer in self.layers]

    def embed_and_norm(self, input_ids: torch.Tensor):
        return self._scaled_embed_and_norm(input_ids, self.embedding_multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_and_norm(input_ids)
        kept = self.kept_states(ctx) if getattr(self, "state_pad_slot", None) is not None else None
        for i, layer in enumerate(self.layers):
            if i:
                x, residual = layer.input_layernorm(x, residual)
            m, _ = layer.mamba(x, ctx, kept)
            a, _ = layer.self_attn(positions, x * self.attention_in if self.attention_in != 1.0 else x, ctx,
                                   self._rope(i))
            x, residual = layer.pre_ff_layernorm(m * self.ssm_out + a * self.attention_out, residual)
            x, _ = layer.feed_forward(x, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.lm_head_multiplier


_CLASSES: list[type] = []


def falcon_h1_class() -> type:
    """FalconH1ForCausalLM with the state cache (qwen3_5.StateCacheMixin): every layer has a Mamba-2 mixer."""
    if not _CLASSES:
        _CLASSES.append(type("FalconH1HybridForCausalLM", (StateCacheMixin, FalconH1ForCausalLM), {
            "__doc__": "Falcon-H1: every layer's Mamba-2 conv and SSM states in the state cache."}))
    return _CLASSES[0]
