"""What each part of a step weighs, from the model's config and the step's shapes: KV per token, peak activations,
the dequantization scratch of a long prefill, and the weights of a loaded model."""

from __future__ import annotations

import torch

from ..kernels.intmath import lora_split_most
from ..kernels.mamba2 import SCAN_GROUP_CHUNKS, varlen_scan_bytes
from ..kernels.reference import (MASK_ELEMENTS, MXFP4_ROW_BYTES, MXFP4_ROWS, decode_gather_tokens,
                                 longest_batched_decode)
from ..models.limits import context_limit, layer_groups, uniform_window
from ..models.registry import LFM2
from ..models.shapes import ModelShapes
from ..quant.config import mxfp4_model


def element_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """K and V of every layer that attends (a hybrid model's linear-attention layers keep a state instead:
    state_bytes); MLA's one latent row a layer (ModelShapes.kv_copies)."""
    layers = model_config.num_hidden_layers - len(_linear_layers(model_config))
    if getattr(model_config, "model_type", None) == "nemotron_h":  # (its MLP layers keep no KV either)
        layers = model_config.layers_block_type.count("full_attention")
    if getattr(model_config, "model_type", None) == "falcon_h1":  # (every layer attends beside its Mamba-2 mixer)
        layers = model_config.num_hidden_layers
    shapes = ModelShapes.from_config(model_config)
    return shapes.kv_copies * layers * shapes.kv_size * element_bytes(dtype)


def _linear_layers(model_config) -> list[int]:
    """A hybrid model's linear-attention layers (layer_types "linear_attention": Qwen3.5's; LFM2's "conv"), else
    none."""
    from ..models.registry import is_hybrid
    if not is_hybrid(model_config):
        return []
    if model_config.model_type == "falcon_h1":  # (a Mamba-2 mixer on every layer: models.falcon_h1)
        return list(range(model_config.num_hidden_layers))
    kind = "conv" if model_config.model_type in LFM2 else "linear_attention"
    return [i for i, t in enumerate(model_config.layer_types) if t == kind]


def state_bytes(model_config, dtype: torch.dtype, num_seqs: int) -> int:
    """A hybrid model's state cache (engine.state_cache, models.qwen3_5.StateCacheMixin.allocate_states): per
    linear-attention layer, num_seqs slots and a padding slot of a conv state [conv_dim, K - 1] in the model's dtype
    and a float32 recurrent state (Qwen3.5's [Hv, Dk, Dv], Mamba-2's [H, P, N]); 0 for other models."""
    return (num_seqs + 1) * state_slot_bytes(model_config, dtype)


def snapshot_count(engine_config, model_config, num_seqs: int | None = None) -> int:
    """The snapshot slots of a hybrid model's prefix cache of states (engine.state_cache.StateSnapshots):
    --state-snapshots, by default half of --max-num-seqs (`num_seqs`: another concurrency's; at least 1); 0 without
    prefix caching or for a model without linear-attention layers."""
    if not _linear_layers(model_config) or not getattr(engine_config, "enable_prefix_caching", False):
        return 0
    n = getattr(engine_config, "state_snapshots", None)
    return max(1, (num_seqs or engine_config.max_num_seqs) // 2) if n is None else n


def state_slot_bytes(model_config, dtype: torch.dtype) -> int:
    """The bytes of one state slot of a hybrid model (every linear-attention layer's conv and recurrent state, as
    state_bytes counts them); 0 for other models."""
    layers = len(_linear_layers(model_config))
    if not layers:
        return 0
    c = model_config
    if c.model_type in LFM2:  # (its short convs: a conv state [hidden_size, conv_L_cache - 1] alone, models.lfm2)
        return layers * c.hidden_size * (c.conv_L_cache - 1) * element_bytes(dtype)
    from ..models.granite4 import mamba2_fields
    c = mamba2_fields(c)
    if hasattr(c, "mamba_expand"):  # Mamba-2 (Granite 4.0, Nemotron-H: models.granite4.Mamba2Mixer.state_shapes)
        inter = int(c.mamba_expand * c.hidden_size)
        conv_dim, kernel = inter + 2 * c.mamba_n_groups * c.mamba_d_state, c.mamba_d_conv
        rec = inter * c.mamba_d_state * 4
    else:
        conv_dim = (2 * c.linear_num_key_heads * c.linear_key_head_dim
                    + c.linear_num_value_heads * c.linear_value_head_dim)
        kernel = c.linear_conv_kernel_dim
        rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = conv_dim * (kernel - 1) * element_bytes(dtype)
    return layers * (conv + rec)


def kv_window(engine_config, model_config, max_length: int, draft_config=None) -> tuple[int, int]:
    """(the window behind which a sequence's KV blocks are freed, the most tokens one step computes for a sequence:
    its chunk and speculative lookahead), or (0, 0) where every block is kept: a model whose layers do not all
    slide over one window, or a draft model's that do not or whose context is shorter (its KV, in the same blocks,
    is read over its window: the larger of the two is kept, and its catch-up token)."""
    window = uniform_window(model_config)
    if window and draft_config is not None:  # (a draft whose context ends before max_length stops reading its KV
        # there, its draft_computed no longer moving: kept whole, so that no sequence holds more than counted)
        other = uniform_window(draft_config)
        window = max(window, other) if other and context_limit(draft_config)[0] >= max_length else 0
    if not window:
        return 0, 0
    spec = getattr(engine_config, "speculative_config", None) or {}
    ahead = int(spec.get("num_speculative_tokens", 0) or 0) + (1 if draft_config is not None else 0)
    return window, min(engine_config.max_num_batched_tokens, max_length) + ahead


def kv_groups(engine_config, model_config, max_length: int, draft_config=None):
    """A model of mixed layers (models.limits.layer_groups): (layers per group, [each group's window], the most tokens
    one step computes for a sequence), its KV in one pool of blocks of that many layers, a block table per group,
    the sliding groups' blocks behind their window freed (engine.hybrid_blocks); None where it is not one. A draft
    model's or EAGLE head's KV (`draft_config`) has a slot in every pool block and is read through the first full
    group's table (engine.draft), never freed: groups only where a sequence of max_length holds fewer bytes so
    (`_groups_gain`), else every block is kept as before."""
    groups = layer_groups(model_config)
    if groups is None:
        return None
    spec = getattr(engine_config, "speculative_config", None) or {}
    ahead = int(spec.get("num_speculative_tokens", 0) or 0)
    found = groups[0], [w for w, _ in groups[1]], min(engine_config.max_num_batched_tokens, max_length) + ahead
    if draft_config is not None and not _groups_gain(found, model_config, draft_config, max_length,
                                                     engine_config.block_size):
        return None
    return found


def _groups_gain(groups, model_config, draft_config, max_length: int, block_size: int) -> bool:
    """Whether a sequence of max_length tokens holds fewer KV bytes under layer groups (`kv_groups`: a pool block
    of a group's layers and the draft's every layer) than with every block kept (a block of every layer of both):
    not so where the window holds most of a sequence, the draft's KV then paid once per group."""
    size, windows, step = groups
    need = -(-max_length // block_size)
    held = min(need, window_blocks(max(windows), step, block_size))
    full = windows.count(0)
    layer = ModelShapes.from_config(model_config).kv_size
    draft = kv_bytes_per_token(draft_config, torch.float32) // (2 * 4)  # (its layers' kv_size, as `layer`)
    grouped = (full * need + (len(windows) - full) * held) * (size * layer + draft)
    kept = need * (int(model_config.num_hidden_layers) * layer + draft)
    return grouped < kept


def group_kv_bytes_per_token(model_config, dtype: torch.dtype, layers: int) -> int:
    """A pool block's KV per token under layer groups (`kv_groups`): `layers` layers' worth."""
    shapes = ModelShapes.from_config(model_config)
    return shapes.kv_copies * layers * shapes.kv_size * element_bytes(dtype)


def window_blocks(window: int, step: int, block_size: int) -> int:
    """The most KV blocks a sequence holds at once under a window (`kv_window`): those of the window and a step's
    tokens, and one more (the window's first block, partly before it)."""
    return -(-(window + max(step, 1)) // block_size) + 1


def lora_slot_bytes(model_config, max_loras: int, max_rank: int, dtype: torch.dtype,
                    target_modules: list[str] | None = None) -> int:
    """The device slots of LoRA adapters (lora.layer.LoRALayer on every merged linear layer, targeted or not): per
    slot, A holds max_rank rows of the input width for each shard and B max_rank columns of every output, for qkv,
    o_proj, gate_up and down_proj of each layer. A mixture of experts' sparse layer has, in place of the MLP's,
    its shared expert's (Qwen2-MoE, of its own width) and every expert's A and B of gate_up and down
    (lora.experts.ExpertLoRA). The gated attention's q_proj (GATED_Q) is twice the query's width; a hybrid's
    linear-attention layers have their Gated DeltaNet's or Mamba-2's slots in place of qkv's and o_proj's, and
    Granite 4.0's and GraniteMoeShared's shared_mlp its own (input_linear, output_linear); a Nemotron-H block
    is one mixer (Mamba-2, attention or MLP). `target_modules` (--lora-target-modules, lora.targets): only the layers
    it selects."""
    from ..lora.adapter import GATED_Q
    from ..lora.experts import expert_slot_elements
    from ..lora.targets import check_target_modules, selects, selects_as
    from ..models.moe import expert_size, experts_adapted, is_sparse, num_experts, shared_name, shared_width
    h, inter = model_config.hidden_size, mlp_width(model_config)
    shapes = ModelShapes.from_config(model_config)
    q, kv = shapes.q_size, shapes.kv_size
    chosen = check_target_modules(target_modules, model_config)
    lfm2 = model_config.model_type in LFM2  # (its short convs' in_proj and out_proj; its attention's out_proj)
    o_name = "out_proj" if lfm2 else "o_proj"

    from ..models.registry import UNGATED
    gates = 1 if model_config.model_type in UNGATED else 2  # (an MLP without gate: up_proj's one shard)

    def mlp(width: int, prefix: str = "") -> int:  # gate_up's and down_proj's A widths + B heights
        return gates * (h + width) * selects_as(chosen, prefix + "gate_up_proj") + \
            (width + h) * selects_as(chosen, prefix + ("w2" if lfm2 else "down_proj"))
    wide = 2 if model_config.model_type in GATED_Q else 1  # (gated attention: q_proj's query and gate)
    # the linear-attention layers: the gated-attention families' Gated DeltaNet, Granite 4.0's and Nemotron-H's
    # Mamba-2 (in_proj, out_proj), in place of the attention's qkv and o
    mamba = model_config.model_type in ("granitemoehybrid", "nemotron_h", "bamba")
    linear = set(_linear_layers(model_config)) if model_config.model_type in GATED_Q or mamba else set()
    # (Nemotron-H's blocks: a Mamba-2 mixer, an attention or an MLP (or experts) alone)
    blocks = model_config.layers_block_type if model_config.model_type == "nemotron_h" else None
    per_rank = 0
    convs = set(_linear_layers(model_config)) if lfm2 else set()
    for layer in range(model_config.num_hidden_layers):
        if layer in convs:  # LFM2's short conv: in_proj (B | C | x) and out_proj
            per_rank += (h + 3 * h) * selects(chosen, "in_proj") + 2 * h * selects(chosen, "out_proj")
        elif layer in linear and model_config.model_type in ("bamba", "granitemoehybrid", "nemotron_h"):  # (their
            # mixers' in_proj and out_proj, which --lora-target-modules names)
            per_rank += _mamba_slot_elements(model_config, selects(chosen, "in_proj"), selects(chosen, "out_proj"))
        elif layer in linear:  # their projections: slots only on every layer's (targets never name them)
            if chosen is None:
                per_rank += _mamba_slot_elements(model_config) if mamba else _delta_net_slot_elements(model_config)
        elif blocks is None or blocks[layer] == "full_attention":
            per_rank += (3 * h + wide * q + 2 * kv) * selects(chosen, "qkv_proj") + \
                (q + h) * selects(chosen, o_name)
        if model_config.model_type == "falcon_h1":  # (its Mamba-2 mixer beside the attention: in_proj's slots
            # where named, out_proj's only on every layer's)
            per_rank += _mamba_slot_elements(model_config, selects(chosen, "in_proj"), chosen is None)
        if blocks is not None and blocks[layer] in ("linear_attention", "full_attention"):
            continue
        if model_config.model_type in ("granitemoehybrid", "granitemoeshared"):  # its shared_mlp's input_linear
            # (gate | up: two shards) and output_linear on every layer (where it has one)
            width = int(getattr(model_config, "shared_intermediate_size", 0) or 0)
            per_rank += ((2 * h + 2 * width) * selects(chosen, "input_linear") +
                         (width + h) * selects(chosen, "output_linear")) * bool(width)
        if model_config.model_type != "granitemoehybrid" and not is_sparse(model_config, layer):  # (its MLP: the
            per_rank += mlp(inter)  # shared one, where it has no experts)
        if not is_sparse(model_config, layer):
            continue
        if shared_name(model_config) is not None or model_config.model_type == "nemotron_h":  # (Qwen2-MoE's shared
            # expert, GLM-4.5's shared experts, Nemotron 3's: up and down alone)
            per_rank += mlp(shared_width(model_config), "shared_expert.")
        if selects(chosen, "experts.gate_up_proj") and experts_adapted(model_config):  # (Nemotron 3's: up alone,
            # on Super's latent)
            nemotron = model_config.model_type == "nemotron_h"
            width = int(getattr(model_config, "moe_latent_size", None) or h) if nemotron else h
            per_rank += expert_slot_elements(num_experts(model_config), width, expert_size(model_config), 1,
                                             1 if nemotron else 2)
    return max_loras * max_rank * per_rank * element_bytes(dtype)


def _mamba_slot_elements(model_config, in_proj: bool = True, out_proj: bool = True) -> int:
    """A Mamba-2 layer's adapter slot elements per rank (models.granite4.Mamba2Mixer: A's input widths + B's
    heights): in_proj (z, x B C, dt) and out_proj (each where asked: Bamba's --lora-target-modules)."""
    c = model_config
    from ..models.granite4 import mamba2_fields
    c = mamba2_fields(c)
    inter = int(c.mamba_expand * c.hidden_size)
    in_out = 2 * inter + 2 * c.mamba_n_groups * c.mamba_d_state + c.mamba_n_heads
    return (c.hidden_size + in_out) * in_proj + (inter + c.hidden_size) * out_proj


def _delta_net_slot_elements(model_config) -> int:
    """A Gated DeltaNet layer's adapter slot elements per rank (models.qwen3_5: A's input widths + B's heights):
    in_proj_qkvz (Qwen3.5's in_proj_qkv and in_proj_z shards, Qwen3-Next's one), in_proj_ba (likewise) and
    out_proj."""
    c = model_config
    h, shards = c.hidden_size, 1 if c.model_type == "qwen3_next" else 2
    key, value, hv = c.linear_num_key_heads * c.linear_key_head_dim, \
        c.linear_num_value_heads * c.linear_value_head_dim, c.linear_num_value_heads
    return shards * h + 2 * key + 2 * value + shards * h + 2 * hv + value + h


def penalty_table_bytes(model_config, num_seqs: int) -> int:
    """The sampler's penalty table at its usual largest (engine.sampler.PenaltyTable): an int32 row of the vocabulary
    per request that samples with penalties, num_seqs of them, and the zero row."""
    return (num_seqs + 1) * model_config.vocab_size * 4


# bytes a sampled row holds per vocabulary entry at the sampler's peak (engine.sampler: a row with penalties,
# temperature, top-k and top-p, in filter_top_k_top_p's last line): its float32 logits (4), its penalty counts (int32
# copies of its table entries, 4), the penalised scores (4), their tempered copy (4), the sorted values (4) and their
# int64 indices (8), the top-k-masked values (4), the scattered result (4) and the top-p drop mask (1); more than the
# log-softmax and top logprobs of a row's records (engine.sampler._pack); a prompt's are computed in chunks that hold
# no more than max_num_seqs such rows (prompt_logprob_rows)
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 4 + 4 + 4 + 8 + 4 + 4 + 1


STEP_INPUT_BYTES = 128  # a token's share of a step's inputs (ids, positions, KV slots, adapter slots: int64 each)


def sampler_row_bytes(model_config) -> int:
    """The bytes one sampled row holds at the sampler's peak (SAMPLER_BYTES_PER_LOGIT per vocabulary entry)."""
    return model_config.vocab_size * SAMPLER_BYTES_PER_LOGIT


# bytes a prompt position holds per vocabulary entry while its prompt logprobs are computed
# (engine.model_runner.ModelRunner._prompt_logprobs): its logits (float32 at most, 4), their float32 copy (4) and
# log-softmax (4), the rank's comparison mask (1); with k top logprobs, per top entry the topk's values (4) and int64
# ids (8) and the sort's own copies of both (12), and the row of results (3 + 2k float64)
PROMPT_BYTES_PER_LOGIT = 4 + 4 + 4 + 1
PROMPT_BYTES_PER_TOP = 4 + 8 + 12 + 2 * 8
PROMPT_LOGPROB_MOST_ROWS = 256  # a chunk of prompt positions never holds more rows than this


def prompt_logprob_row_bytes(vocab_size: int, k: int) -> int:
    """The bytes one prompt position holds at the peak of its prompt logprobs with k top logprobs (k at most the
    vocabulary: -1, vLLM's whole vocabulary, is the vocabulary's size by then)."""
    return vocab_size * PROMPT_BYTES_PER_LOGIT + 3 * 8 + min(k, vocab_size) * PROMPT_BYTES_PER_TOP


def prompt_logprob_rows(vocab_size: int, k: int, max_num_seqs: int) -> int:
    """How many prompt positions' logprobs are computed at once (ModelRunner._prompt_logprobs): max_num_seqs (at
    most PROMPT_LOGPROB_MOST_ROWS), or fewer where that many would hold more than the sampler's rows of a step of
    max_num_seqs sequences (sampler_row_bytes each, what the memory plan holds room for: activation_bytes); at
    least one. With the whole vocabulary (prompt_logprobs -1) a position holds more than a sampled row, so fewer of
    them: a long prompt's logprobs never need more device memory than the plan's sampler rows, whatever its length
    (the results go to the host chunk by chunk)."""
    rows = min(PROMPT_LOGPROB_MOST_ROWS, max(1, max_num_seqs))
    return max(1, min(rows, rows * vocab_size * SAMPLER_BYTES_PER_LOGIT // prompt_logprob_row_bytes(vocab_size, k)))


def step_tokens(max_num_batched_tokens: int, num_seqs: int, max_length: int) -> int:
    """The most tokens one step can hold: the token budget, but no more than `num_seqs` sequences of `max_length`
    tokens each (a prefill, a recomputed one included, never holds more of a sequence than its length)."""
    return max(1, min(max_num_batched_tokens, num_seqs * max_length))


def lora_beside_token_bytes(model_config, dtype: torch.dtype, lora_rank: int,
                            chosen: frozenset[str] | None = None) -> int:
    """Bytes a token holds at the peak of a step recorded into a CUDA graph with the LoRA expand beside the matmul
    (EngineConfig.lora_expand_beside: lora.layer.LoRALayer.apply_beside): while a layer's base matmul runs, its
    output y, the float32 delta [T, out] the side stream expands into and the shrink's float32 partials
    [split, T, shards * rank] (kernels.lora_ops.partials) are alive together, beside the layer's input and the
    residual. The largest of the four layers: qkv; o_proj with q, k, v (views of qkv) and the attention output;
    gate_up; down_proj with silu_and_mul's output (MLP.forward frees gate_up's before it). `chosen` (lora.targets:
    --lora-target-modules' selection; None: every layer): only the layers with slots (0 when none of the four has:
    a layer without slots holds no more than activation_bytes' own term)."""
    b, f = element_bytes(dtype), 4
    h, inter = model_config.hidden_size, lora_mlp_width(model_config)
    shapes = ModelShapes.from_config(model_config)
    q, kv = shapes.q_size, shapes.kv_size

    def partials(k: int, shards: int) -> int:
        return lora_split_most(k) * shards * lora_rank * f
    qkv = (q + 2 * kv) * (b + f) + partials(h, 3)
    o = (q + 2 * kv + q) * b + h * (b + f) + partials(q, 1)
    gate_up = 2 * inter * (b + f) + partials(h, 2)
    down = (h + inter) * b + h * f + partials(inter, 1)
    return _slotted_peak(model_config, chosen, 2 * h * b, qkv, o, gate_up, down)


def lora_mlp_width(model_config) -> int:
    """The widest MLP whose gate_up and down layers take adapters, for their temporaries: intermediate_size, or a
    shared expert's width where wider (Nemotron 3's; Granite 4.0's and GraniteMoeShared's shared MLP, their
    intermediate_size the experts')."""
    from ..models.moe import shared_width
    width = max(int(model_config.intermediate_size), shared_width(model_config))
    if getattr(model_config, "model_type", None) == "granitemoehybrid":
        return max(width, int(getattr(model_config, "shared_intermediate_size", 0) or 0))
    return width


def _slotted_peak(model_config, chosen: frozenset[str] | None, base: int, qkv: int, o: int, gate_up: int,
                  down: int) -> int:
    """`base` plus the largest of the four layers' terms among those `chosen` gives adapter slots (lora.targets;
    gate_up and down_proj: a dense MLP's, or Qwen2-MoE's shared expert's, which the terms' width bounds); 0 when
    none is chosen."""
    from ..lora.targets import selects_as
    from ..models.moe import shared_name
    terms = {"qkv_proj": qkv, "o_proj": o, "gate_up_proj": gate_up, "down_proj": down}
    shared = shared_name(model_config) is not None  # (Qwen2-MoE's, Qwen3.5 MoE's, GLM-4.5's, ERNIE 4.5 MoE's)
    picked = [t for proj, t in terms.items()
              if selects_as(chosen, proj) or (shared and proj in _MLP and selects_as(chosen, "shared_expert." + proj))]
    return base + max(picked) if picked else 0


_MLP = ("gate_up_proj", "down_proj")


def lora_cpu_token_bytes(model_config, dtype: torch.dtype, lora_rank: int,
                         chosen: frozenset[str] | None = None) -> int:
    """Bytes a token holds at the peak of a step through the adapters' torch path (kernels.lora_reference, the CPU's):
    a layer's shrink reads a float32 copy of its input and leaves [T, shards * rank] float32, and each shard's
    expand computes its delta [T, out] in float32 and casts a copy to the model's dtype before adding it; in half
    precision those copies are more than the formula's MLP term holds (gate_up's output, the delta of one of its
    shards and that delta's cast: 2 * inter * 2 + inter * 6 bytes in bf16, against 4 * inter * 2). The largest of
    the four layers, beside the layer's input and the residual: qkv; o_proj with q, k, v (views of qkv) and the
    attention output; gate_up; down_proj with silu_and_mul's output. `chosen`: as lora_beside_token_bytes'."""
    b, f = element_bytes(dtype), 4
    h, inter = model_config.hidden_size, lora_mlp_width(model_config)
    shapes = ModelShapes.from_config(model_config)
    q, kv = shapes.q_size, shapes.kv_size
    half = b < f  # (in float32 neither copy is made)

    def lora(k: int, shards: int, widest: int) -> int:  # the shrink's output, then its input copy or an expand's
        return shards * lora_rank * f + max(k * f if half else 0, widest * (f + (b if half else 0)))
    qkv = (q + 2 * kv) * b + lora(h, 3, q)
    o = (q + 2 * kv + q + h) * b + lora(q, 1, h)
    gate_up = 2 * inter * b + lora(h, 2, inter)
    down = (inter + h) * b + lora(inter, 1, h)
    return _slotted_peak(model_config, chosen, 2 * h * b, qkv, o, gate_up, down)


def rotary_cpu_token_bytes(model_config, dtype: torch.dtype) -> int:
    """Bytes a token holds while the torch rotary (kernels.reference.rotary_embedding, the CPU's) rotates its query:
    beside the layer's input and the residual, the qkv output, q and k normed per head (Qwen3; counted for every
    family), the rotary table's row (float32), a float32 copy of q (in half precision) and four float32 halves of q
    (x1 * cos - x2 * sin done, x2 * cos, x1 * sin and their sum): past the formula's attention term where q is wide
    beside the MLP (Qwen3's head_dim) and in half precision."""
    b, f = element_bytes(dtype), 4
    shapes = ModelShapes.from_config(model_config)
    q, kv = shapes.q_size, shapes.kv_size
    return (2 * model_config.hidden_size + q + 2 * kv + q + kv) * b + shapes.head_dim * f \
        + (q * f if b < f else 0) + 2 * q * f


def softcap_cpu_position_bytes(model_config, dtype: torch.dtype, batched: bool) -> int:
    """Bytes a gathered (sequence x key) position of a decode holds past the plain SDPA's when the scores are soft-
    capped (Gemma 2's attn_logit_softcapping: kernels.reference._sdpa's own attention, in float32): the scores twice
    more (the capped ones and their softmax, beside the plain term's), K and V as float32 copies in half precision,
    and for a batch of sequences (`batched`: its gathered K and V a strided view, [R, L, Hk, D] read as [R, Hk, L,
    D]) the contiguous copy of K, then of V, that its matmuls take. 0 without soft-capping. gpt-oss's attention
    sinks take the same path, their softmax in place: the scores once more (`_explicit_scores`)."""
    copies = _explicit_scores(model_config)
    if not copies:
        return 0
    b, f = element_bytes(dtype), 4
    shapes = ModelShapes.from_config(model_config)
    return copies * shapes.num_heads * f + (2 * shapes.kv_size * f if b < f else 0) + \
        (shapes.kv_size * f if batched else 0)


def _explicit_scores(model_config) -> int:
    """The float32 copies of the scores kernels.reference._sdpa's own attention holds (where the plain SDPA's
    holds none): 2 for Gemma 2's soft-capped scores (capped in place, then their softmax), 1 for gpt-oss's sinks
    (the softmax in place too), 0 for the other families."""
    if model_config.model_type in ("gpt_oss", "granite_swa"):  # (Granite SWA's sinks too)
        return 1
    return 2 if model_config.model_type == "gemma2" and getattr(model_config, "attn_logit_softcapping", None) else 0


def mxfp4_cpu_bytes(model_config, dtype: torch.dtype) -> int:
    """A step's fixed share of gpt-oss's MXFP4 experts on the CPU (kept packed; kernels.reference.fused_moe_mxfp4
    dequantizes each expert as its loop reaches it): one expert's gate_up [2I, H] in `dtype` while its matmul runs,
    and the dequantization's temporaries of reference.MXFP4_ROWS rows (MXFP4_ROW_BYTES a value of the widest
    input); 0 for any other model. (The GPU's kernel dequantizes in registers: a CPU term counted everywhere, as
    the others of activation_bytes.)"""
    from ..models.moe import expert_size
    if not mxfp4_model(model_config):
        return 0
    h, inter = model_config.hidden_size, expert_size(model_config)
    return 2 * inter * h * element_bytes(dtype) + MXFP4_ROWS * max(h, inter) * MXFP4_ROW_BYTES


def moe_token_bytes(model_config, dtype: torch.dtype, lora_rank: int = 0) -> int:
    """A token's peak in a mixture of experts' sparse layer (models.moe; 0 for a dense model): the residual and
    the normed input, the router's logits and float32 probabilities, and for each of its k experts the fused MoE's
    gate|up rows, their activation and the down rows (kernels.moe: [T * k, 2I], [T * k, I], [T * k, H]), with the
    alignment's int64 sort of the pairs; the shared expert's MLP (Qwen2-MoE) after them. With adapter slots
    (`lora_rank`), each pair's experts' LoRA (kernels.moe._LoRAPairs, kernels.reference.moe_lora_delta): its shrink
    [T * k, r] and the gate_up delta [T * k, 2I], with the int64 alignment of the pairs by slot and expert.
    Nemotron 3 Super's latent experts: their rows in the latent, with its projections' input and output."""
    from ..models.moe import expert_size, is_moe, num_experts, shared_width, top_k
    if not is_moe(model_config):
        return 0
    b, h = element_bytes(dtype), model_config.hidden_size
    e, k, inter = num_experts(model_config), top_k(model_config), expert_size(model_config)
    # (Nemotron 3 Super's experts in a latent of L dims: their down rows [T * k, L], beside the projections' [T, L]
    # input and [T, H] output)
    latent = getattr(model_config, "moe_latent_size", None) if model_config.model_type == "nemotron_h" else None
    experts = k * ((3 * inter + (latent or h)) * b + 4 * 8) + ((latent + h) * b if latent else 0)
    if lora_rank:
        experts += k * ((2 * inter + lora_rank) * b + 5 * 8)
    shared = 4 * shared_width(model_config) * b  # (Qwen2-MoE's shared expert, GLM-4.5's shared experts)
    return 2 * h * b + e * (b + 2 * 4) + max(experts, shared + h * b)


def mamba_scan_bytes(model_config, tokens: int, step_tokens: int = 0, seqs: int = 1) -> int:
    """The float32 temporaries of a Mamba-2 layer's SSD scan (Granite 4.0 and Nemotron-H; 0 for other models): the
    larger of the CPU path's scan of one sequence's `tokens` (kernels.mamba2.chunk_scan), padded to whole chunks of
    L = mamba_chunk_size: each token's x, x * dt, the skip, the state carried in and the output [H, P] and the
    repeated B and C [H, N], each chunk's own state and the states before each chunk [c + 1, H, P, N] (the carry
    from chunk to chunk in place, linear in the chunks), beside three [H, tokens, L] score and decay tensors (the
    masked cumulative sums, their exp, C.B scores and their product) of at most SCAN_GROUP_CHUNKS + 1 chunks at once,
    and the whole step's float32 output [T, H * P] it fills; and the GPU path's scan of a whole step's `step_tokens`
    over `seqs` sequences at once (kernels.mamba2.varlen_scan_bytes).
    Plus, on either, what the mixer holds over the whole step (models.granite4.Mamba2Mixer._prefill): the conv's
    output [T, conv_dim] and the gated norm's two float32 [T, H * P] temporaries (4 bytes an element: at most)."""
    if getattr(model_config, "model_type", None) not in ("granitemoehybrid", "nemotron_h", "falcon_h1", "bamba") \
            or not _linear_layers(model_config) or tokens <= 0:
        return 0
    c = model_config
    from ..models.granite4 import mamba2_fields
    c = mamba2_fields(c)
    chunk, heads = int(c.mamba_chunk_size), int(c.mamba_n_heads)
    chunks = -(-tokens // chunk)
    group = min(chunks, SCAN_GROUP_CHUNKS + 1) * chunk * chunk
    per_token = 5 * int(c.mamba_d_head) + 4 * int(c.mamba_d_state)
    inter = heads * int(c.mamba_d_head)
    conv_dim = inter + 2 * int(c.mamba_n_groups) * int(c.mamba_d_state)
    states = 2 * (chunks + 1) * int(c.mamba_d_head) * int(c.mamba_d_state)
    return max(heads * (chunks * chunk * per_token + states + 3 * group) * 4 + step_tokens * inter * 4,
               varlen_scan_bytes(step_tokens, seqs, heads, int(c.mamba_d_head), int(c.mamba_d_state), chunk)) \
        + step_tokens * (conv_dim + 2 * inter) * 4


DELTA_CHUNK = 64  # tokens of a chunk of the chunked gated delta rule (kernels.delta_rule's, kernels.delta_triton's)


def delta_rule_bytes(model_config, dtype: torch.dtype, tokens: int, seqs: int, triton: bool = False) -> int:
    """The temporaries of a Gated DeltaNet layer's chunked gated delta rule over a prefill step of `tokens` tokens
    of at most `seqs` sequences (Qwen3.5's and Qwen3-Next's linear attention; 0 for other models), in chunks of
    DELTA_CHUNK tokens, none spanning two sequences (kernels.delta_rule.chunk_layout: at most tokens / C + seqs - 1
    chunks), per value head of each chunk's C positions, float32: `triton` (CUDA:
    kernels.delta_triton.chunk_gated_delta_rule_varlen) the intra-chunk terms u, v_new [C, Dv], w, qd, kd [C, Dk],
    inner [C, C] and the state before the chunk h [Dk, Dv]; else (the torch path,
    kernels.delta_rule.chunk_gated_delta_rule_varlen) at the intra-chunk part's peak the gathered q, k, v, their
    beta-scaled k and v, the decays, the triangular system and q k^T, u, w and its right-hand side (6 Dk + 3 Dv +
    3 C, and g, beta and the decay's sums); beside the output [T, Hv, Dv] in the model's dtype and the chunks'
    layout."""
    if not hasattr(model_config, "linear_num_value_heads") or not _linear_layers(model_config) or tokens <= 0:
        return 0  # (no Gated DeltaNet layer: Granite 4.0's and Nemotron-H's Mamba-2 ones, mamba_scan_bytes)
    c, chunk = model_config, DELTA_CHUNK
    hv, dk, dv = int(c.linear_num_value_heads), int(c.linear_key_head_dim), int(c.linear_value_head_dim)
    chunks = min(tokens, -(-tokens // chunk) + max(min(seqs, tokens), 1) - 1)
    if triton:
        per_chunk = chunk * (3 * dk + 2 * dv + chunk) + dk * dv + 1
    else:
        per_chunk = chunk * (6 * dk + 3 * dv + 3 * chunk + 5)
    layout = chunks * (chunk + 8) * 8 + (0 if triton else chunk * chunk)  # (chunk_layout's rows; a causal mask)
    return hv * (chunks * per_chunk * 4 + tokens * dv * element_bytes(dtype)) + layout


def softcap_cpu_prefill_bytes(model_config, dtype: torch.dtype, num_tokens: int, max_length: int) -> int:
    """Bytes a prefill's soft-capped attention (Gemma 2's attn_logit_softcapping: kernels.reference._sdpa, in
    float32) holds past the step's per-token activations: a chunk of its query rows' scores and their softmax (at
    most MASK_ELEMENTS (query x key) scores a head, or one query's over more keys; a prefill of `num_tokens` at most
    `max_length` keys), the chunk's causal mask, and K and V as float32 copies in half precision. The plain SDPA's
    prefill holds no scores (its CPU kernel works in tiles); 0 without soft-capping."""
    copies = _explicit_scores(model_config)
    if not copies:
        return 0
    shapes = ModelShapes.from_config(model_config)
    rows = num_tokens if copies == 2 else min(num_tokens, max_length)  # (a sequence's queries: at most max_length)
    scores = min(rows * max_length, max(MASK_ELEMENTS, max_length))  # a head's (query x key) chunk
    kv_copies = 2 * max_length * shapes.kv_size * 4 if element_bytes(dtype) < 4 else 0
    return scores * (copies * shapes.num_heads * 4 + 1) + kv_copies


def mlp_width(model_config) -> int:
    """A dense MLP's width: intermediate_size, or LFM2's as transformers adjusts it (models.lfm2.ffn_width), or Llama
    4's intermediate_size_mlp where a layer is dense (models.llama4; its experts and shared expert intermediate_size
    wide)."""
    if getattr(model_config, "model_type", None) == "llama4_text":
        from ..models.moe import is_sparse
        dense = not all(is_sparse(model_config, i) for i in range(model_config.num_hidden_layers))
        return int(model_config.intermediate_size_mlp if dense else model_config.intermediate_size)
    if getattr(model_config, "model_type", None) in LFM2:
        from ..quant.config import ffn_width
        return ffn_width(model_config)
    return model_config.intermediate_size


def activation_bytes(model_config, dtype: torch.dtype, num_tokens: int, num_seqs: int, max_length: int,
                     lora_rank: int = 0, penalties: bool = True, kv_dtype: torch.dtype | None = None,
                     lora_expand_beside: bool = False, lora_targets: list[str] | None = None,
                     logits: bool = True, triton: bool = False) -> int:
    """Peak bytes of one step's temporaries, the larger of a prefill of `num_tokens` tokens and a decode of
    `num_seqs` sequences at context `max_length`, plus (`penalties`) the sampler's penalty table for `num_seqs`
    requests. `kv_dtype`: the KV cache's, when not `dtype` (fp8: the CPU decode gathers it, then upcasts a copy).
    `lora_expand_beside`: a step recorded into a CUDA graph with the adapters' expand beside the matmul (a token
    holds at least lora_beside_token_bytes). `lora_targets`: --lora-target-modules (lora.targets; None: every
    layer): the adapters' temporaries only of the layers with slots. `logits` False: a pooling engine's step (--runner
    pooling), which computes no logits and samples nothing (no penalty table): its rows are pooled float32 vectors.
    `triton`: a step on CUDA (the Triton kernels' temporaries where they differ from the torch path's:
    delta_rule_bytes)."""
    from ..lora.targets import check_target_modules, selects
    b = element_bytes(dtype)
    h, inter = model_config.hidden_size, mlp_width(model_config)
    shapes = ModelShapes.from_config(model_config)
    heads, q, kv = shapes.num_heads, shapes.q_size, shapes.kv_size
    # prefill: residual + normed input, then the MLP's gate_up, silu(gate) and its product live together (LFM2's
    # short conv: in_proj's B | C | x, B * x, the conv's input with its state, its output and the CPU conv1d's own
    # copy of it (measured: twice the input's bytes), the sequences' outputs joined, C times them, out_proj's output:
    # models.lfm2.ShortConv, kernels.delta_rule.causal_conv1d_varlen)
    conv = 12 * h if model_config.model_type in LFM2 else 0
    per_token = (2 * h + max(q + 2 * kv + 2 * (q + kv) + q, 4 * inter, conv) + 2 * lora_rank) * b
    chosen = check_target_modules(lora_targets, model_config) if lora_rank else None
    from ..models.moe import experts_adapted
    # (no expert slots: no expert LoRA)
    experts_rank = lora_rank if selects(chosen, "experts.gate_up_proj") and experts_adapted(model_config) else 0
    per_token = max(per_token, rotary_cpu_token_bytes(model_config, dtype),
                    moe_token_bytes(model_config, dtype, experts_rank))
    if lora_rank:
        per_token = max(per_token, lora_cpu_token_bytes(model_config, dtype, lora_rank, chosen))
    if lora_rank and lora_expand_beside:
        per_token = max(per_token, lora_beside_token_bytes(model_config, dtype, lora_rank, chosen))
    prefill = num_tokens * per_token + softcap_cpu_prefill_bytes(model_config, dtype, num_tokens, max_length) \
        + mamba_scan_bytes(model_config, min(num_tokens, max_length), num_tokens, num_seqs) \
        + delta_rule_bytes(model_config, dtype, num_tokens, num_seqs, triton)
    # decode: the K and V the CPU attention gathers at once (one sequence, or a small batch padded to its longest;
    # the GPU kernel reads the cache in place), plus float32 scores
    gathered = decode_gather_tokens(num_seqs, max_length, shapes.num_kv_heads)
    gather = 2 * kv * b + (kv * element_bytes(kv_dtype) if kv_dtype not in (None, dtype) else 0)
    # soft-capped scores: one sequence's keys at a time, or a padded batch's (more than one sequence)
    batched = num_seqs * longest_batched_decode(num_seqs, max_length, shapes.num_kv_heads) if num_seqs > 1 else 0
    capped = max(max_length * softcap_cpu_position_bytes(model_config, dtype, False),
                 batched * softcap_cpu_position_bytes(model_config, dtype, True))
    decode = gathered * (gather + heads * 4) + capped + num_seqs * per_token
    # the sampler's rows: during the forward (beside the step's inputs) only their penalty counts, loaded with the
    # inputs; after it, the step's hidden states and inputs, each row's hidden state and the sampler's peak
    # (SAMPLER_BYTES_PER_LOGIT)
    rows = min(num_tokens, max(num_seqs, 1))
    row = sampler_row_bytes(model_config) if logits else h * 4  # (a pooled row: its float32 vector)
    forward = max(prefill, decode) + num_tokens * STEP_INPUT_BYTES + (rows * model_config.vocab_size * 4 if logits
                                                                      else 0) \
        + mxfp4_cpu_bytes(model_config, dtype)
    sampling = num_tokens * (h * b + STEP_INPUT_BYTES) + rows * (h * b + row)
    return max(forward, sampling) + (penalty_table_bytes(model_config, num_seqs) if penalties and logits else 0)


def pools(engine_config) -> bool:
    """Whether the engine is a pooling one (--runner pooling): its steps compute no logits (activation_bytes)."""
    return getattr(engine_config, "runner", None) == "pooling"


DEQUANT_MIN_TOKENS = 256  # steps of more tokens may take the int4 matmul's dequantize + cuBLAS path


def int4_layer_bytes(model, dtype: torch.dtype) -> int:
    """The biggest GPTQ layer that computes through the int4 kernels (on CUDA), dequantized to `dtype`; 0 on CPU
    or without GPTQ layers."""
    sizes = [m.qweight.numel() * (32 // m.method.config.bits) for m in model.modules()
             if hasattr(m, "qweight") and getattr(m, "weight", None) is None and m.qweight.is_cuda
             and not getattr(m, "output_head", False)  # a GPTQ head takes its rows in fused slices (compute_logits)
             and not getattr(m, "absorbed", False)]  # MLA's kv_b_proj is never multiplied (models.deepseek)
    return max(sizes, default=0) * element_bytes(dtype)


def dequant_scratch_bytes(model, dtype: torch.dtype, num_tokens: int) -> int:
    """The buffer a large prefill dequantizes the biggest GPTQ layer into before cuBLAS (kernels.gptq_gemm),
    when steps can be long enough to take that path (more than DEQUANT_MIN_TOKENS tokens); 0 on CPU or without
    GPTQ layers."""
    return int4_layer_bytes(model, dtype) if num_tokens > DEQUANT_MIN_TOKENS else 0


def weights_bytes(model) -> int:
    """Parameters and buffers (including CPU-prepacked matmul weights and MLA's dequantized kv_b_proj copies)."""
    tensors = list(model.parameters()) + [t for t in model.buffers() if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"
