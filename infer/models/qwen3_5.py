"""Qwen3.5's text model (transformers' Qwen3_5ForCausalLM, model_type qwen3_5_text): a hybrid of Gated DeltaNet
(linear attention) layers and gated full-attention layers (layer_types "linear_attention" / "full_attention", 3 of
every 4 linear), each followed by Llama's MLP; RMSNorms by 1 + weight (Gemma's).

A linear-attention layer keeps, per running sequence, a conv state [conv_dim, K - 1] and a recurrent state [Hv, Dk,
Dv] (float32) of fixed size: the per-sequence state cache beside the paged KV (vLLM's mamba cache). The engine gives
every running sequence a slot of the pool (`allocate_states`: max_num_seqs slots and one for the padding rows of a
CUDA graph's decode step) and the forward context its step's slots (ctx.state_slots, one per sequence); a sequence
whose step starts at position 0 (a new prefill, or a preempted one recomputed) starts from zero state. A prefill
step's conv runs over all its sequences at once (each from its slot's conv state), then the chunked delta rule
over all of them in one call (each from its slot's state; on CUDA the state recurrence and the output in Triton:
kernels.gated_delta_prefill), a decode the recurrent one, batched over the step's
sequences with the slots indexed by a tensor (graph-safe): on CUDA two Triton launches (kernels.delta_triton: the
conv update and the fused recurrent rule, each reading and writing the states in place at the slots)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .context import ForwardContext
from .layers import MergedLinear, UnquantizedLinearMethod
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm, _NormConsumer
from .moe import MoeForCausalLM, SparseMoeBlock, is_sparse


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNormGated: the row normed in float32, weighted in the model's dtype, times
    silu(gate) in float32, rounded once."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x, gate):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class _Conv(nn.Module):
    """The depthwise conv1d's weight [C, 1, K] (no bias), under the checkpoint's name."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """transformers' Qwen3_5GatedDeltaNet on a flat batch: in_proj_qkv and in_proj_z merged (in_proj_qkvz), in_proj_b
    and in_proj_a merged (in_proj_ba), the causal conv1d over q|k|v, the gated delta rule, the gated RMSNorm, out_proj.
    Its states (conv_state, rec_state: [slots, ...]) are set by allocate_states."""

    def __init__(self, cfg, prefix: str, method_for, dtype):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim, self.kernel = 2 * self.key_dim + self.value_dim, cfg.linear_conv_kernel_dim
        # Qwen3-Next stores q|k|v|z as one in_proj_qkvz and b|a as one in_proj_ba, each by key head (_qkvz, _ba)
        self.fused = cfg.model_type == "qwen3_next"
        names = [f"{prefix}.in_proj_qkvz"] if self.fused else [f"{prefix}.in_proj_qkv", f"{prefix}.in_proj_z"]
        widths = [self.conv_dim + self.value_dim] if self.fused else [self.conv_dim, self.value_dim]
        self.in_proj_qkvz = MergedLinear(cfg.hidden_size, widths, names, False, method_for(names), dtype)
        names = [f"{prefix}.in_proj_ba"] if self.fused else [f"{prefix}.in_proj_b", f"{prefix}.in_proj_a"]
        widths = [2 * self.hv] if self.fused else [self.hv, self.hv]
        # (float in a GPTQ checkpoint too: GPTQModel's qwen3_5 definitions never quantize them, one output a head)
        method = method_for(names) and UnquantizedLinearMethod("GPTQModel leaves in_proj_b and in_proj_a in float")
        self.in_proj_ba = MergedLinear(cfg.hidden_size, widths, names, False, method, dtype)
        self.out_proj = MergedLinear(self.value_dim, [cfg.hidden_size], [f"{prefix}.out_proj"], False,
                                     method_for([f"{prefix}.out_proj"]), dtype)
        self.out_proj.lora_consumer = _NormConsumer(dtype, unit_offset=True)
        self.conv1d = _Conv(self.conv_dim, self.kernel, dtype)
        self.dt_bias = nn.Parameter(torch.ones(self.hv, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, float(cfg.rms_norm_eps), dtype)
        self.conv_state = self.rec_state = None  # [slots, conv_dim, K - 1], [slots, Hv, Dk, Dv] (allocate_states)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A slot's (conv state, recurrent state) shapes."""
        return (self.conv_dim, self.kernel - 1), (self.hv, self.dk, self.dv)

    def forward(self, x, ctx: ForwardContext, kept):
        """(the layer's output, out_proj's LoRA delta for the norm after it). kept [B] bool: whether each sequence's
        slot holds its state (False: the step starts at position 0, from zero state)."""
        t = x.shape[0]
        mixed, z = self._qkvz(self.in_proj_qkvz(x, ctx))
        b, a = self._ba(self.in_proj_ba(x, ctx))
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if ctx.max_query_len == 1:
            o = self._decode(mixed, g, beta, ctx.state_slots, kept)
        else:
            conv = kernels.causal_conv1d_varlen(mixed, self.conv1d.weight, self.conv_state, ctx.query_start_loc,
                                                ctx.state_slots, kept, ctx.max_query_len)
            o = self._prefill(conv, g, beta, ctx, kept)
        o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(t, self.value_dim)
        return self.out_proj.forward_deferred(o, ctx)

    def _qkvz(self, out):
        """(q|k|v [T, conv_dim], z [T, value_dim]) of in_proj_qkvz's output: Qwen3-Next's by key head (each head's
        q, k, then its value heads' v and z: transformers' fix_query_key_value_ordering)."""
        if not self.fused:
            return out.split([self.conv_dim, self.value_dim], dim=-1)
        t, r = out.shape[0], self.hv // self.hk
        q, k, v, z = out.view(t, self.hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1), z.reshape(t, -1)

    def _ba(self, out):
        """(b, a) [T, Hv] of in_proj_ba's output (Qwen3-Next's by key head)."""
        if not self.fused:
            return out.split([self.hv, self.hv], dim=-1)
        t, r = out.shape[0], self.hv // self.hk
        b, a = out.view(t, self.hk, 2 * r).split([r, r], dim=-1)
        return b.reshape(t, self.hv), a.reshape(t, self.hv)

    def _split(self, conv_out):
        """q, k [T, Hk, Dk], v [T, Hv, Dv] of the conv's output [T, conv_dim]."""
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        t = conv_out.shape[0]
        return q.reshape(t, self.hk, self.dk), k.reshape(t, self.hk, self.dk), v.reshape(t, self.hv, self.dv)

    def _decode(self, mixed, g, beta, slots, kept):
        """One token of each sequence, its states read and written at `slots` (tensor indexing: no host sync)."""
        out = kernels.causal_conv1d_update(mixed, self.conv1d.weight, self.conv_state, slots, kept)
        q, k, v = self._split(out)
        return kernels.gated_delta_decode(q, k, v, g, beta, self.rec_state, slots, kept)

    def _prefill(self, conv, g, beta, ctx: ForwardContext, kept):
        """The delta rule over a prefill step's sequences (`conv`: the step's conv output) from their slots'
        recurrent states (zero where not `kept`), the slots updated: the chunked rule over them all in one call
        (kernels.gated_delta_prefill); a decode in a mixed step (one token, its state kept) the recurrent form, as
        transformers decodes."""
        q, k, v = self._split(conv)
        starts = ctx.query_start_loc
        decode = ((starts[1:] - starts[:-1]) == 1) & kept
        if not bool(decode.any()):
            return kernels.gated_delta_prefill(q, k, v, g, beta, self.rec_state, starts, ctx.state_slots, kept)
        o = torch.empty_like(v)
        rows = starts[:-1][decode]
        o[rows] = kernels.gated_delta_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], self.rec_state,
                                             ctx.state_slots[decode], kept[decode])
        prefill = ~decode
        if bool(prefill.any()):
            lens = (starts[1:] - starts[:-1])[prefill]
            seq = torch.repeat_interleave(prefill, starts[1:] - starts[:-1])  # each token's sequence is a prefill
            rows = seq.nonzero().squeeze(1)
            o[rows] = kernels.gated_delta_prefill(q[rows], k[rows], v[rows], g[rows], beta[rows], self.rec_state,
                                                  F.pad(lens.cumsum(0), (1, 0)), ctx.state_slots[prefill],
                                                  kept[prefill])
        return o


class GatedAttention(Attention):
    """transformers' Qwen3_5Attention: q_proj's output is each head's query and its output gate (interleaved by
    head), q and k normed per head (by 1 + weight), a partial rotary, the attention's output times sigmoid(gate)
    before o_proj."""

    def __init__(self, cfg, prefix: str, method_for, dtype, layer: int = 0):
        super().__init__(cfg, prefix, method_for, dtype, layer)
        bias = bool(getattr(cfg, "attention_bias", False))
        names = [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"]
        self.qkv_proj = MergedLinear(cfg.hidden_size, [2 * self.q_size, self.kv_size, self.kv_size], names, bias,
                                     method_for(names), dtype)
        self.o_proj = MergedLinear(self.q_size, [cfg.hidden_size], [f"{prefix}.o_proj"], bias,
                                   method_for([f"{prefix}.o_proj"]), dtype)
        self.o_proj.lora_consumer = _NormConsumer(dtype, unit_offset=True)
        self.qk_norm = True
        eps = float(cfg.rms_norm_eps)
        self.q_norm = RMSNorm(self.head_dim, eps, dtype, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps, dtype, unit_offset=True)

    def forward(self, positions, x, ctx: ForwardContext, cos_sin):
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qg, k, v = self.qkv_proj(x, ctx).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(t, h, 2 * d)
        gate = qg[..., d:].reshape(t, self.q_size)
        q, k = self._normed(qg[..., :d].reshape(t, self.q_size), k, self.q_norm, self.k_norm)
        tables, slots = self._kv(ctx)
        if ctx.max_query_len == 1:  # decodes only: rotary, KV write and attention in one launch on the GPU
            o = kernels.decode_attention(positions, q, k, v, cos_sin, d, self.k_cache, self.v_cache, slots, tables,
                                         ctx.seq_lens, ctx.query_start_loc, self.scale, None, self.softcap,
                                         self.window, self.sinks).reshape(t, self.q_size)
        else:
            q = kernels.rotary_store_kv(positions, q, k, v, cos_sin, d, self.k_cache, self.v_cache, slots)
            o = self.attend(q.reshape(t, self.q_size), ctx)
        o = o * torch.sigmoid(gate)
        return self.o_proj.forward_deferred(o, ctx)



class HybridLayer(nn.Module):
    """A decoder layer of Qwen3.5: a Gated DeltaNet (linear_attn) or a gated attention (self_attn), Llama's MLP, two
    norms by 1 + weight."""

    def __init__(self, cfg, i: int, method_for, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.linear = cfg.layer_types[i] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, f"{p}.linear_attn", method_for, dtype)
        else:
            self.self_attn = GatedAttention(cfg, f"{p}.self_attn", method_for, dtype, i)
        if is_sparse(cfg, i):  # Qwen3-Next's experts and gated shared expert (models.moe)
            self.mlp = SparseMoeBlock(cfg, f"{p}.mlp", method_for, dtype)
        else:
            self.mlp = MLP(cfg, f"{p}.mlp", method_for, dtype)
            self.mlp.down_proj.lora_consumer = _NormConsumer(dtype, unit_offset=True)
        eps = float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, unit_offset=True)


class StateCacheMixin:
    """A hybrid model's state cache (engine.state_cache): `linear_layers()` (each with conv_state, rec_state,
    state_shapes() and conv1d.weight) get their slots from `allocate_states`; `kept_states(ctx)`: whether each
    sequence's slot holds its state. (Qwen3.5's Gated DeltaNet layers, Granite 4's Mamba-2 layers: models.granite4;
    LFM2's short convs, a conv state alone: their state_shapes' recurrent shape None, rec_state None: models.lfm2.)
    Put before the model class it extends."""

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        self.state_pad_slot = None  # the padding rows' slot (allocate_states)

    def allocate_states(self, num_seqs: int, device) -> int:
        """Give each linear-attention layer its states for num_seqs sequences and one padding slot (the last: a CUDA
        graph's padding rows write there); their bytes."""
        total = 0
        for layer in self.linear_layers():
            conv, rec = layer.state_shapes()
            layer.conv_state = torch.zeros(num_seqs + 1, *conv, dtype=layer.conv1d.weight.dtype, device=device)
            layer.rec_state = None if rec is None else torch.zeros(num_seqs + 1, *rec, dtype=torch.float32,
                                                                   device=device)
            total += sum(t.nbytes for t in self._states(layer))
        self.state_pad_slot = num_seqs
        return total

    @staticmethod
    def _states(layer) -> list[torch.Tensor]:
        """A linear layer's running states: its conv state and its recurrent one (none for LFM2's short convs)."""
        return [t for t in (layer.conv_state, layer.rec_state) if t is not None]

    def allocate_snapshots(self, num_slots: int, device) -> int:
        """Give each linear-attention layer `num_slots` snapshot slots (conv_snap, rec_snap: engine.state_cache
        .StateSnapshots, a hybrid model's prefix cache of states) beside its running ones; their bytes."""
        total = 0
        for layer in self.linear_layers():
            layer.conv_snap, layer.rec_snap = (None if t is None else torch.zeros(num_slots, *t.shape[1:],
                                                                                   dtype=t.dtype, device=device)
                                               for t in (layer.conv_state, layer.rec_state))
            total += sum(t.nbytes for t in (layer.conv_snap, layer.rec_snap) if t is not None)
        return total

    def copy_states(self, pairs: list[tuple[int, int]], save: bool) -> None:
        """Copy the states of each (running slot, snapshot slot) pair into the snapshot (`save`), or of each
        (snapshot slot, running slot) pair into the running slot: queued on the device, no sync."""
        layers = self.linear_layers()
        if not pairs or not layers:
            return
        dev = layers[0].conv_state.device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long).to(dev, non_blocking=True)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long).to(dev, non_blocking=True)
        for layer in layers:
            for state, snap in ((layer.conv_state, layer.conv_snap), (layer.rec_state, layer.rec_snap)):
                if state is None:  # (LFM2's short convs: no recurrent state)
                    continue
                a, b = (state, snap) if save else (snap, state)
                b.index_copy_(0, dst, a.index_select(0, src))

    @staticmethod
    def kept_states(ctx: ForwardContext) -> torch.Tensor:
        """[B] bool: each sequence's state carried from its last step (False: its step starts at position 0)."""
        starts = ctx.query_start_loc
        return (ctx.seq_lens - (starts[1:] - starts[:-1])) > 0


class Qwen3_5ForCausalLM(StateCacheMixin, LlamaForCausalLM):
    """Qwen3.5's text model: Llama's loop over HybridLayers; the final norm by 1 + weight; the state cache of its
    linear-attention layers (StateCacheMixin)."""

    layer_class = HybridLayer
    piecewise = False  # no piecewise CUDA graphs (its `piece` is Llama's): prefills and mixed steps run eagerly
    packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping,
                              "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]}

    def __init__(self, cfg, dtype: torch.dtype, method_for=None, max_positions: int | None = None):
        super().__init__(cfg, dtype, method_for, max_positions)
        self.norm = RMSNorm(cfg.hidden_size, float(cfg.rms_norm_eps), dtype, unit_offset=True)

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if layer.linear]

    def embed_and_norm(self, input_ids: torch.Tensor):
        return self._scaled_embed_and_norm(input_ids, 1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_and_norm(input_ids)
        kept = self.kept_states(ctx)
        delta = None
        for i, layer in enumerate(self.layers):
            if i:
                x, residual = layer.input_layernorm(x, residual, delta)
            if layer.linear:
                x, delta = layer.linear_attn(x, ctx, kept)
            else:
                x, delta = layer.self_attn(positions, x, ctx, self.cos_sin)
            x, residual = layer.post_attention_layernorm(x, residual, delta)
            x, delta = layer.mlp(x, ctx)
        x, _ = self.norm(x, residual, delta)
        return x


_NEXT: list = []


def qwen3_next_class() -> type:
    """Qwen3-Next (transformers' Qwen3NextForCausalLM) and Qwen3.5 MoE (Qwen3_5MoeForCausalLM): Qwen3_5ForCausalLM
    with the loader's routing of a mixture of experts' tensors (models.moe.MoeForCausalLM)."""
    if not _NEXT:
        _NEXT.append(type("Qwen3NextForCausalLM", (MoeForCausalLM, Qwen3_5ForCausalLM), {
            "__doc__": "Qwen3-Next: Qwen3.5's hybrid layers, its MLPs a mixture of experts with a gated shared "
                       "expert (models.moe)."}))
    return _NEXT[0]
