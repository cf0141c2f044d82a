"""IBM Granite 4.0 (transformers' GraniteMoeHybridForCausalLM, model_type granitemoehybrid): Granite's four scalars
(models.llama.GraniteForCausalLM), decoder layers that are either attention (layer_types "full_attention"; rope only
where position_embedding_type is "rope", else none: NoPE) or Mamba-2 mixers ("linear_attention"), each followed by a
shared MLP (shared_mlp: gate|up stored as one input_linear, down as output_linear) and, where num_local_experts > 0,
Granite MoE's experts beside it (block_sparse_moe: models.moe). granite-4.0-micro has attention layers alone and no
experts; granite-4.0-h-* are Mamba-2 hybrids with experts.

A Mamba-2 layer keeps, per running sequence, a conv state [conv_dim, K - 1] (model dtype) and an SSM state [H, P, N]
(float32) in the engine's state cache (engine.state_cache, as Qwen3.5's Gated DeltaNet layers: models.qwen3_5). A
prefill chunk runs the SSD chunked scan from its slot's state, a decode the one-step recurrence
(kernels.mamba2; on CUDA the Triton kernels of kernels.mamba2_triton, each over all the step's sequences)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .context import ForwardContext
from .layers import MergedLinear
from .llama import MLP, Attention, GraniteForCausalLM, RMSNorm, _NoPE
from .moe import MoeForCausalLM, SparseMoeBlock, is_sparse
from .qwen3_5 import StateCacheMixin


class GroupGatedRMSNorm(nn.Module):
    """transformers' GraniteMoeHybridRMSNormGated (Bamba's; norm_before_gate False): x times silu(gate) in float32,
    normed over each of n_groups groups, rounded to x's dtype, times the weight (a float32 x, the scan's output of a
    prefill: in float32)."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.groups, self.eps = groups, eps

    def forward(self, x, gate):
        h = x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        return self.weight * h.to(x.dtype)


class _Conv(nn.Module):
    """The depthwise conv1d's weight [C, 1, K] and its bias [C] (mamba_conv_bias), under the checkpoint's names."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False) if bias else None


def mamba2_fields(cfg):
    """A config's Mamba-2 fields under Granite 4.0's names, which Mamba2Mixer reads: Nemotron-H's and Falcon-H1's
    through their models' mamba_fields; another model's config (Granite 4.0's, Bamba's) as it is."""
    if cfg.model_type == "nemotron_h":
        from .nemotron_h import mamba_fields
        return mamba_fields(cfg)
    if cfg.model_type == "falcon_h1":
        from .falcon_h1 import mamba_fields
        return mamba_fields(cfg)
    return cfg


class Mamba2Mixer(nn.Module):
    """transformers' GraniteMoeHybridMambaLayer (Bamba's mixer) on a flat batch: in_proj's output split into the
    gate z [I], x|B|C [conv_dim] and dt [H]; the causal conv1d (with bias) and silu over x|B|C; the SSD scan (dt
    + dt_bias through softplus, A = -exp(A_log), the D skip); the grouped gated RMSNorm by z; out_proj. Its states
    (conv_state [slots, conv_dim, K - 1], rec_state [slots, H, P, N]) are set by allocate_states."""

    def __init__(self, cfg, prefix: str, method_for, dtype):
        super().__init__()
        self.heads, self.groups, self.d_state = int(cfg.mamba_n_heads), int(cfg.mamba_n_groups), int(cfg.mamba_d_state)
        self.inter = int(cfg.mamba_expand * cfg.hidden_size)
        self.head_dim = int(cfg.mamba_d_head)
        self.kernel, self.chunk = int(cfg.mamba_d_conv), int(cfg.mamba_chunk_size)
        self.conv_dim = self.inter + 2 * self.groups * self.d_state
        self.limit = tuple(float(v) for v in (cfg.time_step_limit or (0.0, float("inf"))))
        # a limit that can clamp (softplus is never negative): transformers clamps a prompt's dt and not a decode
        # step's, so the tokens of a prompt infer computes one at a time (the last of a chunked or prefix-cached
        # prompt) are scanned, clamped, where the model runner marks them (ForwardContext.dt_clamp)
        self.clamps = self.limit[0] > 0 or self.limit[1] < float("inf")
        bias = bool(cfg.mamba_proj_bias)
        self.in_proj = MergedLinear(cfg.hidden_size, [self.inter + self.conv_dim + self.heads], [f"{prefix}.in_proj"],
                                    bias, method_for([f"{prefix}.in_proj"]), dtype)
        out_bias = bool(getattr(cfg, "mamba_out_proj_bias", bias))  # (Falcon-H1's projectors_bias: models.falcon_h1)
        self.out_proj = MergedLinear(self.inter, [cfg.hidden_size], [f"{prefix}.out_proj"], out_bias,
                                     method_for([f"{prefix}.out_proj"]), dtype)
        self.conv1d = _Conv(self.conv_dim, self.kernel, bool(cfg.mamba_conv_bias), dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.heads, dtype=dtype), requires_grad=False)
        self.norm = GroupGatedRMSNorm(self.inter, self.groups, float(cfg.rms_norm_eps), dtype)
        self.conv_state = self.rec_state = None  # (allocate_states)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A slot's (conv state, SSM state) shapes."""
        return (self.conv_dim, self.kernel - 1), (self.heads, self.head_dim, self.d_state)

    def forward(self, x, ctx: ForwardContext, kept):
        """(the layer's output, None: no LoRA delta left to a norm). kept [B] bool: whether each sequence's slot holds
        its state (False: its step starts at position 0, from zero state)."""
        z, xbc, dt = self.projected(x, ctx).split([self.inter, self.conv_dim, self.heads], dim=-1)
        if ctx.max_query_len == 1 and (ctx.dt_clamp is None or not self.clamps):
            y = self.norm(self._decode(xbc, dt, ctx.state_slots, kept).reshape(-1, self.inter), z)
        else:
            y = self._prefill(xbc, dt, z, ctx, kept)
        return self.out_proj(y, ctx), None

    def projected(self, x, ctx: ForwardContext):
        """in_proj's output (Falcon-H1 scales its input and output: models.falcon_h1.FalconMixer)."""
        return self.in_proj(x, ctx)

    def _split(self, out):
        """x [T, H, P], B and C [T, G, N] of the conv's output [T, conv_dim]."""
        n = self.groups * self.d_state
        x, b, c = out.split([self.inter, n, n], dim=-1)
        t = out.shape[0]
        return (x.reshape(t, self.heads, self.head_dim), b.reshape(t, self.groups, self.d_state),
                c.reshape(t, self.groups, self.d_state))

    def _decode(self, xbc, dt, slots, kept):
        """One token of each sequence, its states read and written at `slots` (tensor indexing: no host sync): the
        conv update and the selective state update (on CUDA a Triton launch each: kernels.causal_conv1d_update,
        kernels.mamba2_decode). Returns y [B, H, P] in the model's dtype."""
        out = kernels.causal_conv1d_update(xbc, self.conv1d.weight, self.conv_state, slots, kept, self.conv1d.bias)
        x, b, c = self._split(out)
        return kernels.mamba2_decode(x, dt, self._a(), b, c, self.D, self.dt_bias, self.rec_state, slots, kept)

    def _a(self):
        return -torch.exp(self.A_log.float())

    def _prefill(self, xbc, dt, z, ctx: ForwardContext, kept):
        """A step with a prefill: the conv over every sequence's tokens from its slot's conv state (zero where not
        `kept`), then the SSD scan over every prefill (kernels.mamba2_prefill: one call) and, for a decode in the
        mixed step (one generated token, its state kept), the recurrence as transformers decodes; each normed by z (a
        prefill's scan output float32, a decode's in the model's dtype). A time_step_limit that clamps applies to the
        prompt's tokens: those of every prefill, or those ctx.dt_clamp marks (a prompt's last token alone is scanned
        then). Returns [T, I] in the model's dtype."""
        starts, slots = ctx.query_start_loc, ctx.state_slots
        conv = kernels.causal_conv1d_varlen(xbc, self.conv1d.weight, self.conv_state, starts, slots, kept,
                                            ctx.max_query_len, self.conv1d.bias)
        x, b, c = self._split(conv)
        lens = starts[1:] - starts[:-1]
        decode = (lens == 1) & kept
        clamp = ctx.dt_clamp if self.clamps else None
        if clamp is not None:
            decode &= ~clamp[starts[:-1]]
        if not bool(decode.any()):
            y = self._scan(x, dt, b, c, starts, slots, kept, clamp)
            return self.norm(y.reshape(-1, self.inter), z).to(z.dtype)
        out = torch.empty_like(z)
        rows = starts[:-1][decode]
        y = kernels.mamba2_decode(x[rows], dt[rows], self._a(), b[rows], c[rows], self.D, self.dt_bias,
                                  self.rec_state, slots[decode], kept[decode])
        out[rows] = self.norm(y.reshape(-1, self.inter), z[rows])
        prefill = ~decode
        if bool(prefill.any()):
            rows = torch.repeat_interleave(prefill, lens).nonzero().squeeze(1)  # the prefills' tokens
            y = self._scan(x[rows], dt[rows], b[rows], c[rows], F.pad(lens[prefill].cumsum(0), (1, 0)),
                           slots[prefill], kept[prefill], None if clamp is None else clamp[rows])
            out[rows] = self.norm(y.reshape(-1, self.inter), z[rows]).to(z.dtype)
        return out

    def _scan(self, x, dt, b, c, starts, slots, kept, clamp=None):
        """The SSD scan of the prefills (tokens starts[i]:starts[i + 1] each) from their slots' SSM states; `clamp`
        [T] bool: the tokens whose dt time_step_limit clamps (None: all)."""
        return kernels.mamba2_prefill(x, dt, self._a(), b, c, self.D, self.dt_bias, self.chunk, self.rec_state,
                                      starts, slots, kept, self.limit, clamp)


class Granite4Layer(nn.Module):
    """A decoder layer of Granite 4.0: a Mamba-2 mixer (mamba) or Granite's attention (self_attn), the experts (mlp:
    the checkpoint's block_sparse_moe, where num_local_experts > 0) beside the shared MLP (shared_mlp), two norms."""

    def __init__(self, cfg, i: int, method_for, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.linear = cfg.layer_types[i] == "linear_attention"
        if self.linear:
            self.mamba = Mamba2Mixer(cfg, f"{p}.mamba", method_for, dtype)
        else:
            self.self_attn = Attention(cfg, f"{p}.self_attn", method_for, dtype, i)
        if is_sparse(cfg, i):
            self.mlp = SparseMoeBlock(cfg, f"{p}.block_sparse_moe", method_for, dtype)
        self.shared_mlp = MLP(cfg, f"{p}.shared_mlp", method_for, dtype, int(cfg.shared_intermediate_size),
                              stored=("input_linear", "output_linear"))
        eps = float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)


class Granite4ForCausalLM(MoeForCausalLM, _NoPE, GraniteForCausalLM):
    """Granite 4.0: Granite's scalars over Granite4Layers; attention layers without rope where
    position_embedding_type is not "rope" (_NoPE); the experts' tensors routed by models.moe. Its Mamba-2 layers'
    states: Granite4HybridForCausalLM (granite4_class)."""

    layer_class = Granite4Layer
    piecewise = False  # (no piecewise CUDA graphs: `piece` is Llama's)

    def linear_layers(self) -> list[Mamba2Mixer]:
        return [layer.mamba for layer in self.layers if layer.linear]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_and_norm(input_ids)
        kept = self.kept_states(ctx) if getattr(self, "state_pad_slot", None) is not None else None
        m = self.residual_multiplier
        for i, layer in enumerate(self.layers):
            if i:
                x, residual = layer.input_layernorm(x, residual)
            if layer.linear:
                x, _ = layer.mamba(x, ctx, kept)
            else:
                x, _ = layer.self_attn(positions, x, ctx, self._rope(i))
            x, residual = layer.post_attention_layernorm(x * m, residual)
            h, _ = layer.shared_mlp(x, ctx)
            if hasattr(layer, "mlp"):
                h = layer.mlp(x, ctx)[0] + h
            x = h * m
        x, _ = self.norm(x, residual)
        return x


_CLASSES: list[type] = []


def granite4_class(hybrid: bool) -> type:
    """Granite4ForCausalLM, or with Mamba-2 layers (`hybrid`: registry.is_hybrid) its subclass with the state cache
    (qwen3_5.StateCacheMixin)."""
    if not _CLASSES:
        _CLASSES.append(Granite4ForCausalLM)
        _CLASSES.append(type("Granite4HybridForCausalLM", (StateCacheMixin, Granite4ForCausalLM), {
            "__doc__": "Granite 4.0 with Mamba-2 layers: their conv and SSM states in the state cache."}))
    return _CLASSES[1 if hybrid else 0]
