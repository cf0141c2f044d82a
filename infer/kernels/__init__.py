"""Kernel dispatch: the Triton op on CUDA tensors (when triton is importable), the torch reference otherwise.

Every op here has the same signature as its reference in `reference.py` (or `lora_reference.py` for the LoRA ops,
whose module docstring states what their `groups` argument must hold), which states its semantics. A Triton module
is imported on its first use, once: a machine without CUDA never imports one.
"""

from __future__ import annotations

import functools
import importlib

import torch

from . import delta_rule, lora_reference, mamba2, reference


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


@functools.cache
def _triton(module: str):
    """This package's Triton module `module` (fused, attention, lora_ops, gptq_gemm), imported on first use. The
    module object is kept, not its functions: a test that reloads it under TRITON_INTERPRET is seen by every op."""
    return importlib.import_module(f".{module}", __name__)


def rms_norm(x, weight, eps, residual=None, lora=None, unit_offset=False, float_weight=False):
    if use_triton(x):
        return _triton("fused").rms_norm(x, weight, eps, residual, lora, **_unit(unit_offset, float_weight))
    return reference.rms_norm(x, weight, eps, residual, lora, **_unit(unit_offset, float_weight))


def layer_norm(x, weight, eps, bias=None):
    if use_triton(x):
        return _triton("fused").layer_norm(x, weight, eps, bias)
    return reference.layer_norm(x, weight, eps, bias)


def _unit(unit_offset: bool, float_weight: bool = False) -> dict:
    """rms_norm's Gemma and OLMo switches, passed only where set (the other families' calls as they were)."""
    return {**({"unit_offset": True} if unit_offset else {}), **({"float_weight": True} if float_weight else {})}


def _cap(softcap: float) -> dict:
    """The attention's Gemma 2 logit soft-capping, passed only where set (the other families' calls as they
    were)."""
    return {"softcap": float(softcap)} if softcap else {}


def _sinks(sinks) -> dict:
    """gpt-oss's attention sinks (float32 [Hq]), passed only where set (the other families' calls as they were)."""
    return {"sinks": sinks} if sinks is not None else {}


def _win(window: int, chunked: bool = False) -> dict:
    """A sliding-window layer's window (`chunked`: Llama 4's chunk), passed only where set (full layers' and other
    families' calls as they were)."""
    return ({"window": int(window), "chunked": True} if chunked else {"window": int(window)}) if window else {}


def embed_rms_norm(ids, table, weight, eps):
    if use_triton(table):
        return _triton("fused").embed_rms_norm(ids, table, weight, eps)
    return reference.embed_rms_norm(ids, table, weight, eps)


def apply_bitmask(logits, rows, bitmask):
    if use_triton(logits):
        return _triton("bitmask").apply_bitmask(logits, rows, bitmask)
    return reference.apply_bitmask(logits, rows, bitmask)


def rotary_embedding(positions, q, k, cos_sin_cache, head_dim):
    if use_triton(q):
        return _triton("fused").rotary_embedding(positions, q, k, cos_sin_cache, head_dim)
    return reference.rotary_embedding(positions, q, k, cos_sin_cache, head_dim)


def silu_and_mul(x, lora=None):
    if use_triton(x):
        return _triton("fused").silu_and_mul(x, lora)
    return reference.silu_and_mul(x, lora)


def gelu_tanh_and_mul(x, lora=None):
    if use_triton(x):
        return _triton("fused").gelu_tanh_and_mul(x, lora)
    return reference.gelu_tanh_and_mul(x, lora)


def ungated_act(x, act, scalars=None):
    """An MLP without gate's activation, in place (reference.ungated_act). On the GPU one Triton launch for relu2
    (torch: relu_, square_) and xIELU (torch: a dozen); gelu_tanh stays torch's one F.gelu launch."""
    if use_triton(x) and act != "gelu_tanh":
        return _triton("fused").ungated_act(x, act, scalars)
    return reference.ungated_act(x, act, scalars)


def rotary_store_kv(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache, slot_mapping):
    if use_triton(q):
        return _triton("fused").rotary_store_kv(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache,
                                                slot_mapping)
    return reference.rotary_store_kv(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache, slot_mapping)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    if use_triton(k_cache):
        return _triton("fused").store_kv(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len=None,
                    softcap=0.0, window=0, sinks=None, chunked=False):
    if use_triton(q):  # the module is `attention`: a submodule named paged_attention would shadow this function
        return _triton("attention").paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                    scale, max_query_len, **_cap(softcap), **_win(window, chunked),
                                                    **_sinks(sinks))
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     max_query_len, **_cap(softcap), **_win(window, chunked), **_sinks(sinks))


def decode_attention(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache, slot_mapping, block_tables,
                     seq_lens, query_start_loc, scale, lora=None, softcap=0.0, window=0, sinks=None, chunked=False):
    if use_triton(q):
        return _triton("attention").decode_attention(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache,
                                                     slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                                                     lora, **_cap(softcap), **_win(window, chunked), **_sinks(sinks))
    return reference.decode_attention(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache, slot_mapping,
                                      block_tables, seq_lens, query_start_loc, scale, lora, **_cap(softcap),
                                      **_win(window, chunked), **_sinks(sinks))


def causal_conv1d_update(x, weight, states, slots, kept, bias=None, silu=True):
    """A Gated DeltaNet or Mamba-2 (`bias`) decode step's conv (delta_rule.causal_conv1d_update), or LFM2's short
    conv (no silu): one Triton launch on CUDA."""
    b = [] if bias is None else [bias]  # (passed only where set: the Gated DeltaNet calls as they were)
    act = {} if silu else {"silu": False}
    if use_triton(x):
        return _triton("delta_triton").causal_conv1d_update(x, weight, states, slots, kept, *b, **act)
    return delta_rule.causal_conv1d_update(x, weight, states, slots, kept, *b, **act)


def causal_conv1d_varlen(x, weight, states, query_start_loc, slots, kept, max_len, bias=None, silu=True):
    """A Gated DeltaNet or Mamba-2 (`bias`) prefill step's conv over each sequence's tokens from its state
    (delta_rule.causal_conv1d_varlen), or LFM2's short conv (no silu): one Triton launch on CUDA."""
    b = [] if bias is None else [bias]
    act = {} if silu else {"silu": False}
    if use_triton(x):
        return _triton("delta_triton").causal_conv1d_varlen(x, weight, states, query_start_loc, slots, kept, max_len,
                                                            *b, **act)
    return delta_rule.causal_conv1d_varlen(x, weight, states, query_start_loc, slots, kept, max_len, *b, **act)


def gated_delta_decode(q, k, v, g, beta, states, slots, kept):
    """A Gated DeltaNet decode step's recurrent gated delta rule on the states at `slots`
    (delta_rule.recurrent_gated_delta_rule_slots): one Triton launch on CUDA."""
    if use_triton(v):
        return _triton("delta_triton").recurrent_gated_delta_rule_slots(q, k, v, g, beta, states, slots, kept)
    return delta_rule.recurrent_gated_delta_rule_slots(q, k, v, g, beta, states, slots, kept)


def gated_delta_prefill(q, k, v, g, beta, states, query_start_loc, slots, kept):
    """A Gated DeltaNet prefill step's chunked gated delta rule over each sequence's tokens from its state at its
    slot (delta_rule.chunk_gated_delta_rule_varlen): on CUDA all in Triton (delta_triton.chunk_gated_delta_rule_varlen:
    the intra-chunk terms, the inter-chunk state recurrence and the output)."""
    if use_triton(v):
        return _triton("delta_triton").chunk_gated_delta_rule_varlen(q, k, v, g, beta, states, query_start_loc,
                                                                      slots, kept)
    return delta_rule.chunk_gated_delta_rule_varlen(q, k, v, g, beta, states, query_start_loc, slots, kept)


def mamba2_decode(x, dt, A, B, C, D, dt_bias, states, slots, kept):
    """A Mamba-2 decode step's selective state update on the SSM states at `slots` (mamba2.state_update_slots): one
    Triton launch on CUDA."""
    if use_triton(x):
        return _triton("mamba2_triton").state_update_slots(x, dt, A, B, C, D, dt_bias, states, slots, kept)
    return mamba2.state_update_slots(x, dt, A, B, C, D, dt_bias, states, slots, kept)


def mamba2_prefill(x, dt, A, B, C, D, dt_bias, chunk, states, query_start_loc, slots, kept, limit, clamp=None):
    """A Mamba-2 prefill step's chunked SSD scan over each sequence's tokens from its SSM state at its slot
    (mamba2.chunk_scan_varlen; `limit` clamps the dt of the tokens `clamp` marks, None: of all): on CUDA in Triton
    over every chunk of the step at once (mamba2_triton)."""
    if use_triton(x):
        return _triton("mamba2_triton").chunk_scan_varlen(x, dt, A, B, C, D, dt_bias, chunk, states, query_start_loc,
                                                          slots, kept, limit, clamp)
    return mamba2.chunk_scan_varlen(x, dt, A, B, C, D, dt_bias, chunk, states, query_start_loc, slots, kept, limit,
                                    clamp)


def lora_shrink(x, lora_a, groups, scale=1.0):
    """The torch op on every device: a Triton kernel pair computes whole layers (lora_apply); this single-shard
    product is the CPU path's tool for layers where the batch's adapters use only some shards or a small rank."""
    return lora_reference.lora_shrink(x, lora_a, groups, scale)


def lora_expand(h, lora_b, groups, scalings, y, offset=0):
    """The torch op on every device (see lora_shrink)."""
    return lora_reference.lora_expand(h, lora_b, groups, scalings, y, offset)


def lora_apply(x, y, lora_a, lora_b, scalings, bounds, groups, ranks=None):
    if use_triton(y):
        return _triton("lora_ops").lora_apply(x, y, lora_a, lora_b, scalings, bounds, groups, ranks)
    return lora_reference.lora_apply(x, y, lora_a, lora_b, scalings, bounds, groups, ranks)


def lora_delta(x, lora_a, lora_b, scalings, bounds, groups, ranks, token_slots, fuse=True):
    """The shrink half of lora_apply, kept for the int4 matmul to expand in its epilogue (gptq_matmul's lora)."""
    if use_triton(x):
        return _triton("lora_ops").delta(x, lora_a, lora_b, scalings, bounds, groups, ranks, token_slots, fuse)
    return lora_reference.lora_delta(x, lora_a, lora_b, scalings, bounds, groups, ranks, token_slots, fuse)


def gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, zeros_v1=True, group_size=None, interleave=1, bias=None,
                lora=None, gated=False, act=None, act_scalars=None):
    if use_triton(x):
        return _triton("gptq_gemm").gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, zeros_v1, group_size,
                                                interleave, bias=bias, lora=lora, gated=gated, act=act,
                                                act_scalars=act_scalars)
    return reference.gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, zeros_v1, group_size, interleave, bias,
                                 lora, gated, act, act_scalars)


def fused_moe(x, w13, w2, weights, ids, lora=None, oai=None):
    """A mixture of experts' SwiGLU MLPs (reference.fused_moe), with `lora` (reference.MoELoRA) each token's adapter
    on the experts: Triton's, in launches of fixed grids (a CUDA graph records them; the adapters' deltas batched
    torch ops over the token-expert pairs); CUDA without Triton every expert over every token, weighted by its
    routing weight (0 where not chosen: reference.fused_moe_dense), which a graph can record too; the CPU without
    adapters reference.fused_moe_grouped. `oai` (reference.OaiExperts): gpt-oss's expert biases and clamped
    activation."""
    if use_triton(x):
        return _triton("moe").fused_moe(x, w13, w2, weights, ids, lora, **_oai(oai))
    if x.is_cuda:
        return reference.fused_moe_dense(x, w13, w2, weights, ids, lora, oai)
    if reference.grouped_moe(x, w13, w2, lora):  # (the CPU: one grouped product per projection)
        return reference.fused_moe_grouped(x, w13, w2, weights, ids, oai)
    return reference.fused_moe(x, w13, w2, weights, ids, lora, oai)


def _oai(oai) -> dict:
    """gpt-oss's experts (reference.OaiExperts), passed only where set (the other families' calls as they were)."""
    return {"oai": oai} if oai is not None else {}


def fused_moe_block_steps(x, max_tokens: int, top_k: int, experts: int) -> dict[int, int]:
    """Where x's fused MoE is Triton's: {BLOCK_M: the fewest tokens of a step that choose it} up to max_tokens
    (kernels.moe.block_m_steps); else {} (the reference compiles nothing)."""
    return _triton("moe").block_m_steps(max_tokens, top_k, experts) if use_triton(x) else {}


def fused_moe_config_steps(x, max_tokens: int, w13, w2, top_k: int) -> dict:
    """Where x's fused MoE is Triton's: {launch config: the fewest tokens of a step that chooses it} up to
    max_tokens for these experts (kernels.moe.config_steps: this GPU's tuned table, else the heuristics); else {}."""
    if not use_triton(x):
        return {}
    moe = _triton("moe")
    e = w13.qweight.shape[0] if hasattr(w13, "qweight") else w13.shape[0]  # (reference.Mxfp4Experts: its shape)
    return moe.config_steps(max_tokens, top_k, e, moe.experts_key(w13, w2, top_k, x.dtype), x.device)


def fused_moe_mxfp4(x, w13, w2, weights, ids, lora=None, oai=None):
    """fused_moe over MXFP4 experts (reference.Mxfp4Experts: gpt-oss's, kept packed): Triton's, dequantized in
    registers, in the float kernel's launches; else the reference (each expert dequantized as the loop reaches it:
    on the CPU only the experts some token chose)."""
    if use_triton(x):
        return _triton("moe").fused_moe_mxfp4(x, w13, w2, weights, ids, lora, **_oai(oai))
    return reference.fused_moe_mxfp4(x, w13, w2, weights, ids, lora, oai)


def fused_moe_int4(x, w13, w2, weights, ids, lora=None, oai=None):
    """fused_moe over int4 GPTQ experts (reference.Int4Experts): Triton's, dequantized in registers, in the float
    kernel's launches; else the reference (the experts dequantized, then the float op)."""
    if use_triton(x):
        return _triton("moe").fused_moe_int4(x, w13, w2, weights, ids, lora, **_oai(oai))
    return reference.fused_moe_int4(x, w13, w2, weights, ids, lora, oai)
