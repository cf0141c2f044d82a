"""The memory plan: budget = weights + peak activations + KV cache, and what that means for max_length.

On CUDA the budget is --gpu-memory-utilization of the device's memory; on CPU it is --memory-limit, or by default
half of the available memory (cgroup limit or free RAM) plus what the weights already use. Activations are
estimated by `sizes.activation_bytes` (a formula over the step's shapes, which `infer warmup` checks against a
measurement); KV takes every whole block that is left.

Two configs meet here and are named apart: `engine_config`, the engine's options (any `PlanOptions`, in practice
`infer.engine.config.EngineConfig`), and `model_config`, the checkpoint's Hugging Face config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from ..errors import ConfigError, OutOfMemoryError
from ..kernels.intmath import PROGRAMS_PER_SM, cdiv, decode_parts, next_power_of_2
from ..models.limits import context_limit
from ..lora.targets import slot_scope
from ..models.registry import is_hybrid
from ..models.shapes import ModelShapes
from .graph_buckets import batch_buckets, largest_per_stream, token_buckets
from .sizes import (activation_bytes, dequant_scratch_bytes, element_bytes, gib, group_kv_bytes_per_token,
                    kv_bytes_per_token, kv_groups, kv_window, lora_slot_bytes, pools, sampler_row_bytes, snapshot_count,
                    state_bytes, state_slot_bytes, step_tokens, weights_bytes, window_blocks)


class PlanOptions(Protocol):
    """The engine options a plan reads. `infer.engine.config.EngineConfig` is one; the plan takes it by these
    attributes rather than by import, because the engine (a layer above) is what calls the plan."""
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    num_kv_blocks: int | None
    memory_limit: int | None
    gpu_memory_utilization: float
    loras: dict[str, str]
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    lora_target_modules: list[str] | None
    kv_cache_dtype: str
    graph_priority: bool | None
    lora_expand_beside: bool

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype: ...

    def use_cuda_graphs(self) -> bool: ...

    def piecewise_tokens(self) -> int: ...

    def torch_device(self) -> torch.device: ...


def available_cpu_memory() -> int:
    """Free RAM, or the cgroup limit minus usage when that is smaller."""
    import psutil
    avail = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(usage_file) as f:
                    avail = min(avail, int(limit) - int(f.read()))
            break
        except (OSError, ValueError):
            continue
    return max(0, avail)


def device_total(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    import psutil
    return psutil.virtual_memory().total


def budget_bytes(engine_config: PlanOptions, device: torch.device, weights: int, loaded: bool = True) -> int:
    """What the engine may use in all: weights + activations + KV cache."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        others = total - free - (torch.cuda.memory_reserved(device) if loaded else 0)  # other processes
        return int(total * engine_config.gpu_memory_utilization) - max(0, others)
    if engine_config.memory_limit:
        total = device_total(device)
        if engine_config.memory_limit > total:  # a plan inside it would prove nothing: this machine cannot hold it
            raise ConfigError(f"--memory-limit {gib(engine_config.memory_limit)} is more than this machine's memory "
                              f"({gib(total)})", f"give at most {gib(total)}, or leave it unset (half the free RAM)")
        return engine_config.memory_limit
    return int(available_cpu_memory() * 0.5) + (weights if loaded else 0)


def check_rope_table(engine_config: PlanOptions, model_config, device: torch.device, max_len: int,
                     weights=lambda: 0) -> None:
    """Before the model is built: its rope table (max_len rows, float32) fits the budget while it is computed
    (about twice the table: the angles and the table). A config.json whose max_position_embeddings is in the
    billions (no --max-model-len) otherwise took minutes and all the RAM, or failed inside torch's allocator.
    `weights()`: the checkpoint's bytes as loaded, asked only when the table does not fit; a budget the weights
    alone exceed is left to the plan, whose "the weights alone take" names what to change (a shorter context
    would not help)."""
    from ..models.rope import rope_table_bytes
    table = rope_table_bytes(model_config, max_len)
    budget = budget_bytes(engine_config, device, 0, loaded=False)
    if 2 * table <= budget or weights() >= budget:
        return
    per_row = max(1, rope_table_bytes(model_config, 1))
    fit = budget // (2 * per_row)
    given = (f"--max-model-len {max_len:,}" if engine_config.max_model_len else
             f"config.json's max_position_embeddings, {max_len:,}, as no --max-model-len is given")
    more = "--gpu-memory-utilization" if device.type == "cuda" else "--memory-limit"
    raise OutOfMemoryError(
        f"the model's context ({given}) needs a rotary (rope) table of {gib(table)}, about twice that while it is "
        f"built, more than the memory budget of {gib(budget)}",
        f"pass --max-model-len with the context you need (at most {fit:,}; the KV cache needs room too), or raise "
        f"{more}")


def lora_rank(engine_config: PlanOptions) -> int:
    """The rank a step's LoRA path is sized for: --max-lora-rank when the engine has adapter slots (--lora, or
    --enable-lora for adapters added while it runs), else 0."""
    return engine_config.max_lora_rank if engine_config.loras or engine_config.enable_lora else 0


def has_adapters(engine_config: PlanOptions) -> bool:
    """Whether the engine has adapter slots (--lora, or --enable-lora): its graphs then carry the LoRA path, and with
    graph_priority None (auto) the larger ones are recorded on a stream of their own (memory.graph_buckets)."""
    return bool(engine_config.loras or engine_config.enable_lora)


def expands_beside(engine_config: PlanOptions) -> bool:
    """Whether the graphs' adapter layers expand beside the matmul into a float32 delta
    (EngineConfig.lora_expand_beside, which takes the second stream: not with lora_streams False; options without
    them: no)."""
    return bool(getattr(engine_config, "lora_expand_beside", False)) \
        and getattr(engine_config, "lora_streams", None) is not False


def cuda_graph_bytes(engine_config: PlanOptions, model_config, dtype: torch.dtype) -> int:
    """The CUDA graphs' private memory pool (engine.cuda_graphs): the temporaries of one decode step of the
    largest bucket, which the graphs keep for themselves, the attention partials of every sequence and the hidden
    states each smaller decode graph keeps (_decode_outputs_bytes); then the piecewise graphs' temporaries of a
    step of their most tokens (the same pool: counted on top, as an upper bound) and their static buffers (query,
    attention output, residual, hidden states), with both kinds' static inputs (graph_inputs_bytes: the decode
    graphs' block tables are the most of them). Where the graphs are recorded on two streams (graph_priority None
    with adapters: memory.graph_buckets.records_high), each kind's largest bucket on each stream counts: the
    allocator keys the pool's free blocks by stream, so a stream's graphs never reuse the temporaries the other's
    freed."""
    if not engine_config.use_cuda_graphs():
        return 0
    rank = lora_rank(engine_config)
    priority, adapters = engine_config.graph_priority, has_adapters(engine_config)
    buckets = batch_buckets(engine_config.max_num_seqs)
    decode = sum(_decode_graph_bytes(engine_config, model_config, dtype, rank, b)
                 for b in largest_per_stream(buckets, priority, adapters)) \
        + _decode_outputs_bytes(model_config, dtype, buckets) \
        + graph_inputs_bytes(engine_config, model_config, adapters)
    shapes = ModelShapes.from_config(model_config)
    tokens = engine_config.piecewise_tokens()
    aux = aux_graph_bytes(engine_config, model_config, dtype)
    if not tokens:
        return decode + aux
    beside = expands_beside(engine_config)
    pieces = sum(activation_bytes(model_config, dtype, t, 1, 1, rank, penalties=False, lora_expand_beside=beside,
                                  lora_targets=engine_config.lora_target_modules, triton=True)
                 for t in largest_per_stream(token_buckets(tokens), priority, adapters))
    buffers = tokens * (2 * shapes.q_size + 2 * model_config.hidden_size) * element_bytes(dtype) \
        + graph_inputs_bytes(engine_config, model_config, adapters, tokens)
    return decode + pieces + buffers + aux


def _spec_method(engine_config: PlanOptions) -> str | None:
    """The speculative method of the options (--speculative-config's "method"), None without speculation."""
    return (getattr(engine_config, "speculative_config", None) or {}).get("method")


def aux_graph_bytes(engine_config: PlanOptions, model_config, dtype: torch.dtype) -> int:
    """With an EAGLE-3 head (engine.eagle), the target's aux hidden states its graphs keep (engine.cuda_graphs):
    AUX_STATES [bucket, hidden] outputs of each decode graph in the pool (the largest's too: its step's temporaries
    hold no such copies) and, with piecewise graphs, AUX_STATES [tokens, hidden] static buffers; 0 otherwise
    (graphs without a head keep none)."""
    if _spec_method(engine_config) != "eagle3" or not engine_config.use_cuda_graphs():
        return 0
    from ..models.eagle import AUX_STATES  # (here: the head's module loads the decoders, which a plan needs not)
    rows = sum(batch_buckets(engine_config.max_num_seqs)) + engine_config.piecewise_tokens()
    return AUX_STATES * rows * model_config.hidden_size * element_bytes(dtype)


def graph_inputs_bytes(engine_config: PlanOptions, model_config, adapters: bool, tokens: int | None = None) -> int:
    """The static inputs a set of graphs reads (engine.cuda_graphs, allocated beside the pool), each rounded to the
    allocator's 512 bytes: input_ids, positions and slot_mapping (int64) for every row, with adapters the token
    slots, the order by slot (int64) and the segment starts; the decode graphs' (`tokens` None: max_num_seqs rows)
    also seq_lens, query_start_loc and the block tables [rows, blocks of max_model_len] (int32): 8 MiB at 256
    sequences of 128k tokens in blocks of 16. `tokens`: the piecewise graphs' rows instead."""
    rows = tokens or engine_config.max_num_seqs
    sizes = [rows * 8] * 3
    if adapters:
        sizes += [rows * 8, rows * 8, (engine_config.max_loras + 2) * 8]
    if tokens is None:
        blocks = cdiv(engine_config.max_model_len or model_config.max_position_embeddings, engine_config.block_size)
        sizes += [rows * 4, (rows + 1) * 4, rows * blocks * 4]
    return sum(cdiv(n, 512) * 512 for n in sizes)


def _decode_graph_bytes(engine_config: PlanOptions, model_config, dtype: torch.dtype, rank: int,
                        seqs: int | None = None) -> int:
    """The decode graphs' share of the pool: one decode step's temporaries at the largest bucket (`seqs`, default
    max_num_seqs) and the attention partials of every sequence up to it."""
    seqs = seqs or engine_config.max_num_seqs
    step = activation_bytes(model_config, dtype, seqs, 1, 1, rank, penalties=False,
                            lora_targets=engine_config.lora_target_modules,
                            lora_expand_beside=bool(rank) and expands_beside(engine_config), triton=True)
    shapes = ModelShapes.from_config(model_config)
    # the keys the block tables hold: whole blocks (the kernel partitions by the table's width, not the length)
    size = engine_config.block_size
    context = cdiv(engine_config.max_model_len or model_config.max_position_embeddings, size) * size
    # the decode attention's partial results at the most partitions any batch size takes (kernels.attention: key
    # blocks of 32 or 64, rows of the head padded to a power of two), on a GPU of up to 256 SMs
    programs = PROGRAMS_PER_SM * 256
    rows = max(b * decode_parts(b, shapes.num_kv_heads, context, 32, programs) for b in range(1, seqs + 1))
    return step + rows * shapes.num_heads * (max(16, next_power_of_2(shapes.head_dim)) + 2) * 4


def _decode_outputs_bytes(model_config, dtype: torch.dtype, buckets: list[int]) -> int:
    """The hidden states every decode graph but the largest leaves in the pool ([bucket, hidden], kept for its
    replays: DecodeGraphs.outputs), which the later, smaller recordings cannot reuse: on top of the largest step's
    temporaries (which hold its own). At 256 sequences that is 3,975 rows, 31 MiB for a 7B model (hidden 4,096,
    fp16): more than its step's temporaries at 256 (about 26 MiB by activation_bytes)."""
    return sum(buckets[:-1]) * model_config.hidden_size * element_bytes(dtype)


def draft_len(draft_config, max_len: int | None) -> int:
    """The positions a draft model sees (engine.draft.draft_context): its context limit, at most the engine's
    max_model_len (`max_len`; None: its own). A sequence past them drafts no more and feeds the draft nothing: its
    steps, graphs and block tables are of this length, not the target's."""
    limit = context_limit(draft_config)[0]
    return limit if max_len is None else min(limit, max_len)


class _DraftOptions:
    """An engine's options (PlanOptions) as a draft model's share reads them: max_model_len its draft_len."""

    def __init__(self, options: PlanOptions, max_model_len: int):
        self._options, self.max_model_len = options, max_model_len

    def __getattr__(self, name: str):
        return getattr(self._options, name)


def draft_graph_bytes(engine_config: PlanOptions, draft_config, dtype: torch.dtype) -> int:
    """A draft model's decode graphs (engine.draft: its one-token forwards of drafts 2..k, recorded beside the
    target's, no adapters): the decode share of cuda_graph_bytes for the draft (its kept outputs too), counted on
    top of the target's as an upper bound (they share the target's pool); 0 without a draft or without graphs."""
    if draft_config is None or not engine_config.use_cuda_graphs():
        return 0
    engine_config = _DraftOptions(engine_config, draft_len(draft_config, engine_config.max_model_len))
    # no adapters: its graphs share one stream whatever graph_priority says (one bucket here, max_num_seqs)
    buckets = batch_buckets(engine_config.max_num_seqs)
    return sum(_decode_graph_bytes(engine_config, draft_config, dtype, 0, b) for b in
               largest_per_stream(buckets, engine_config.graph_priority, False)) \
        + _decode_outputs_bytes(draft_config, dtype, buckets) + graph_inputs_bytes(engine_config, draft_config, False) \
        + head_graph_bytes(engine_config, draft_config, dtype)


def head_graph_bytes(engine_config: PlanOptions, head_config, dtype: torch.dtype) -> int:
    """What an EAGLE head's decode graphs (engine.cuda_graphs.HeadGraphs) hold beyond a draft model's: the hidden
    state they are fed [max_num_seqs, hidden] (a static input) and, for an EAGLE-3 head, the pre-norm output each
    graph but the largest keeps beside its normed one (an EAGLE-1 head's two outputs are one tensor); 0 for a draft
    model."""
    method = _spec_method(engine_config)
    if method not in ("eagle3", "eagle"):
        return 0
    buckets = batch_buckets(engine_config.max_num_seqs)
    rows = engine_config.max_num_seqs + (sum(buckets[:-1]) if method == "eagle3" else 0)
    return rows * head_config.hidden_size * element_bytes(dtype)


@dataclass
class MemoryPlan:
    device: str
    total_bytes: int
    budget_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    lora_bytes: int
    reserve_bytes: int  # allocator fragmentation and per-step bookkeeping that no single step shows
    kv_bytes_per_token: int
    kv_block_bytes: int
    block_size: int
    kv_blocks: int
    max_length: int
    concurrency: int
    measured: bool = False

    @property
    def num_blocks(self) -> int:
        return self.kv_blocks

    def blocks_for(self, length: int) -> int:
        """The KV blocks a sequence of `length` tokens holds at once: all of them, or under a sliding window
        (window_blocks) no more than those of the window and a step."""
        need = -(-length // self.block_size)
        if self.window and length != self.max_length:  # (a step of another length: min(batched, length) + ahead)
            held = min(need, window_blocks(self.window, min(self.window_batched, length) + self.window_ahead,
                                           self.block_size))
        else:
            held = min(need, self.window_blocks) if self.window_blocks else need
        if self.kv_groups:  # layer groups: the full groups hold every block, the sliding ones their window's
            return self.full_groups * need + (self.kv_groups - self.full_groups) * held
        return held

    @property
    def usable_blocks(self) -> int:
        """The blocks sequences get: under a window one is the placeholder (engine.block_manager)."""
        return max(0, self.kv_blocks - (1 if self.window_blocks else 0))

    @property
    def max_concurrency_at_max_length(self) -> int:
        most = self.usable_blocks // self.blocks_for(self.max_length)
        return most if self.room_concurrency is None else min(most, self.room_concurrency)

    @property
    def max_length_at_concurrency(self) -> int:
        each = self.usable_blocks // max(self.concurrency, 1)
        most = min(self.max_length_limit, each * self.block_size)
        if self.kv_groups:  # (blocks of the groups: no length in tokens of its own)
            lo, hi = 0, self.max_length_limit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.blocks_for(mid) <= each else (lo, mid - 1)
            most = lo
        elif self.window_blocks and each >= self.window_blocks:  # longer than its blocks: a sequence holds those of
            # its window and a step, whose chunk grows with the length up to max_num_batched_tokens (blocks_for)
            lo, hi = max(most, self.max_length), self.max_length_limit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.blocks_for(mid) <= each else (lo, mid - 1)
            most = lo
        return most if self.room_length is None else min(most, self.room_length)

    max_length_limit: int = 0  # the model's context limit
    # the room figures above the plan's own size as plans of that size have it (bound_room); None: not bounded
    room_concurrency: int | None = None
    room_length: int | None = None
    kv_cache_dtype: str = ""  # the KV cache's element type (torch's name: float16, float8_e4m3fn, ...)
    # a model whose every layer slides over one window: the most blocks a sequence holds (memory.sizes.kv_window,
    # window_blocks: the blocks behind the window are freed); 0: every block of a sequence is held
    window_blocks: int = 0
    # the window, and what a step of a longer max_length computes for a sequence (memory.sizes.kv_window: its
    # min(max_num_batched_tokens, length) + the speculative lookahead): blocks_for of another length; 0: unknown
    # (window_blocks then stands for every length)
    window: int = 0
    window_batched: int = 0
    window_ahead: int = 0
    # a model of mixed layers (memory.sizes.kv_groups): its KV groups (0: none) and how many of them attend fully;
    # a block (kv_block_bytes) is one group's layers', a sequence holds a table per group (blocks_for)
    kv_groups: int = 0
    full_groups: int = 0
    # a hybrid model's state cache (memory.sizes.state_bytes: max_num_seqs slots of its linear-attention layers'
    # states), beside the KV blocks; 0: none
    state_bytes: int = 0
    # its prefix cache of states (memory.sizes.snapshot_count: --state-snapshots slots of the same size); 0: none
    snapshot_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.max_concurrency_at_max_length >= self.concurrency

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["room_concurrency"], d["room_length"]  # in the two figures below
        d.update(fits=self.fits, max_concurrency_at_max_length=self.max_concurrency_at_max_length,
                 max_length_at_concurrency=self.max_length_at_concurrency, kv_block_bytes=self.kv_block_bytes)
        return d

    @property
    def weights_exceed_budget(self) -> bool:
        """The weights with the runtime reserve leave nothing: no batch size or length can make room."""
        return self.weights_bytes + self.reserve_bytes >= self.budget_bytes and not self.kv_blocks

    def advice(self) -> str:
        """What to change when it does not fit (vLLM-style 'estimated maximum model length')."""
        more = "raise --gpu-memory-utilization" if self.device == "cuda" else "raise --memory-limit"
        if self.weights_exceed_budget:  # nothing else matters until the weights fit (as at an engine start)
            return weights_advice(self.weights_bytes, self.reserve_bytes, self.budget_bytes, more)
        tips = []
        if self.lora_bytes > self.budget_bytes // 2:  # no length or concurrency makes room the slots take
            tips.append(f"lower --max-loras or --max-lora-rank, whose adapter slots take {gib(self.lora_bytes)} of "
                        f"the budget of {gib(self.budget_bytes)}")
        if self.state_bytes > self.budget_bytes // 2:  # a hybrid model's state slots: no length makes room
            tips.append(f"lower --concurrency, whose linear-attention states (a slot per sequence) take "
                        f"{gib(self.state_bytes)} of the budget of {gib(self.budget_bytes)}")
        if self.snapshot_bytes > self.budget_bytes // 2:  # the prefix cache of states: no length makes room
            tips.append(f"lower --state-snapshots, whose snapshots of linear-attention states take "
                        f"{gib(self.snapshot_bytes)} of the budget of {gib(self.budget_bytes)}")
        if self.max_length_at_concurrency > 0:
            tips.append(f"lower --max-length to {self.max_length_at_concurrency}")
        if self.max_concurrency_at_max_length > 0:
            tips.append(f"lower --concurrency to {self.max_concurrency_at_max_length}")
        kv_size = self.kv_cache_dtype and torch.finfo(getattr(torch, self.kv_cache_dtype)).bits // 8
        kv_bound = self.max_length_at_concurrency > 0 or self.max_concurrency_at_max_length > 0
        tips.append(more)
        if kv_size and kv_size > 1 and kv_bound:
            # the KV cache, not the activations, is what does not fit: an 8-bit one holds more tokens in as much
            tips.append(f"use --kv-cache-dtype fp8 (1 byte a value instead of {kv_size}: {kv_size}x the tokens)")
        return ", or ".join(tips)


def weights_advice(weights: int, reserve: int, budget: int, more: str) -> str:
    """The weights (with the runtime reserve) leave nothing of the budget: what to change."""
    if weights >= budget:
        return f"the weights alone take {gib(weights)} of the budget of {gib(budget)}: {more}, or run a smaller or " \
            "quantized model"
    return (f"the weights ({gib(weights)}) and the runtime reserve ({gib(reserve)}: 1% of the budget, at least "
            f"4 MiB) take the whole budget of {gib(budget)}: {more} well above {gib(weights + reserve)}")


def _largest(ok, lo: int, hi: int) -> int:
    """The largest x in lo..hi with ok(x), ok(lo) being known true and ok monotone (true, then false)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def bound_room(plan: MemoryPlan, blocks_at) -> MemoryPlan:
    """Bound the room figures above the plan's own size (more sequences than its concurrency, longer ones than its
    max_length) by the KV blocks a plan of that size leaves: its steps hold more tokens, so its activations take
    more of the budget than this plan's. `blocks_at(concurrency, length)`: those blocks. The figures below the
    plan's size (what to lower to when it does not fit) are this plan's own, which smaller steps only leave room."""
    length, c, size = plan.max_length, plan.concurrency, plan.block_size
    most = plan.max_concurrency_at_max_length
    if most > c:
        plan.room_concurrency = _largest(lambda n: blocks_at(n, length) >= n * plan.blocks_for(length), c, most)
    longest = plan.max_length_at_concurrency
    if longest > length:
        def tokens(k: int) -> int:  # whole blocks, up to the model's limit
            return min(plan.max_length_limit, k * size)
        k = _largest(lambda k: tokens(k) <= length or blocks_at(c, tokens(k)) >= c * plan.blocks_for(tokens(k)),
                     length // size, -(-longest // size))
        plan.room_length = max(length, tokens(k))
    return plan


def kv_dtype(engine_config: PlanOptions, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for a model computing in `dtype` (--kv-cache-dtype; options without it: dtype)."""
    pick = getattr(engine_config, "kv_dtype", None)
    return pick(dtype) if pick is not None else dtype


def runtime_reserve(budget: int) -> int:
    """1% of the budget (at least 4 MiB) kept free for allocator fragmentation and the engine's own objects, which
    grow over a long run but never show in one warmup step."""
    return max(4 << 20, budget // 100)


def make_plan(engine_config: PlanOptions, model_config, dtype: torch.dtype, device: torch.device, weights: int,
              activation: int, max_length: int, concurrency: int, max_length_limit: int, lora: int = 0,
              measured: bool = False, budget: int | None = None, engine_activation: int = 0,
              draft_config=None, slots: int | None = None) -> MemoryPlan:
    """`slots`: the sequences a hybrid model's state cache holds (default --max-num-seqs; warmup's plan of another
    concurrency: that many). `engine_activation`: what an engine start reserves for activations (its formula); the
    KV blocks are what is
    left after the larger of it and `activation`, so that a measured peak below the formula never promises blocks
    the engine will not allocate. `draft_config`: a draft model's (speculative decoding), whose KV cache has a block
    for each of the target's: a block's bytes are both models' (under layer groups, a group's layers and the
    draft's every one)."""
    draft = kv_bytes_per_token(draft_config, kv_dtype(engine_config, dtype)) if draft_config is not None else 0
    per_token = kv_bytes_per_token(model_config, kv_dtype(engine_config, dtype)) + draft
    block = per_token * engine_config.block_size
    groups = kv_groups(engine_config, model_config, max_length, draft_config)
    if groups is not None:  # (one pool of blocks of a group's layers, and the draft's every layer: engine.draft)
        block = (group_kv_bytes_per_token(model_config, kv_dtype(engine_config, dtype), groups[0]) + draft) \
            * engine_config.block_size
    budget = budget_bytes(engine_config, device, weights) if budget is None else budget
    reserve = runtime_reserve(budget)
    # a hybrid model's state cache (engine.state_cache): a slot per sequence
    states = state_bytes(model_config, dtype, slots or engine_config.max_num_seqs) if is_hybrid(model_config) else 0
    # and its prefix cache of states: --state-snapshots slots (engine.state_cache.StateSnapshots)
    snapshots = snapshot_count(engine_config, model_config, slots) * state_slot_bytes(model_config, dtype)
    kv_blocks = max(0, budget - weights - max(activation, engine_activation) - lora - reserve - states
                    - snapshots) // block
    window, step = kv_window(engine_config, model_config, max_length, draft_config)
    if groups is not None:
        window, step = max(groups[1]), groups[2]
    return MemoryPlan(device.type, device_total(device), budget, weights, activation, lora, reserve, per_token, block,
                      engine_config.block_size, int(kv_blocks), max_length, concurrency, measured, max_length_limit,
                      kv_cache_dtype=str(kv_dtype(engine_config, dtype)).replace("torch.", ""),
                      window_blocks=window_blocks(window, step, engine_config.block_size) if window else 0,
                      window=window, window_batched=engine_config.max_num_batched_tokens if window else 0,
                      window_ahead=step - min(engine_config.max_num_batched_tokens, max_length) if window else 0,
                      kv_groups=len(groups[1]) if groups else 0,
                      full_groups=groups[1].count(0) if groups else 0, state_bytes=states,
                      snapshot_bytes=snapshots)


def start_activation_bytes(engine_config: PlanOptions, model_config, model, dtype, max_len: int,
                           draft_config=None, draft_model=None) -> int:
    """What an engine start reserves for activations: the formula's step of max_num_seqs sequences of max_len, the
    CUDA graphs' pool and the int4 dequantize scratch (the runner reserves it by the budget alone); with a draft
    model (`draft_config`), its step's too."""
    seqs = engine_config.max_num_seqs
    tokens = step_tokens(engine_config.max_num_batched_tokens, seqs, max_len)
    return activation_bytes(model_config, dtype, tokens, seqs, max_len, lora_rank(engine_config),
                            kv_dtype=kv_dtype(engine_config, dtype), lora_targets=engine_config.lora_target_modules,
                            logits=not pools(engine_config), triton=engine_config.torch_device().type == "cuda") \
        + speculative_logit_bytes(engine_config, model_config) \
        + draft_activation_bytes(engine_config, draft_config, dtype, max_len) \
        + cuda_graph_bytes(engine_config, model_config, dtype) + draft_graph_bytes(engine_config, draft_config, dtype) \
        + max(dequant_scratch_bytes(m, dtype, engine_config.max_num_batched_tokens)  # (one scratch: the draft's too)
              for m in (model, *([draft_model] if draft_model is not None else [])))


def draft_activation_bytes(engine_config: PlanOptions, draft_config, dtype, max_len: int,
                           seqs: int | None = None) -> int:
    """A draft model's step (draft-model speculative decoding: it feeds the step's tokens, then one a sequence per
    draft), counted beside the target's; 0 without one."""
    if draft_config is None:
        return 0
    seqs, max_len = seqs or engine_config.max_num_seqs, draft_len(draft_config, max_len)  # (past it: not fed)
    tokens = step_tokens(engine_config.max_num_batched_tokens, seqs, max_len)
    return activation_bytes(draft_config, dtype, tokens, seqs, max_len, penalties=False,
                            kv_dtype=kv_dtype(engine_config, dtype))


def speculative_logit_bytes(engine_config: PlanOptions, model_config, seqs: int | None = None) -> int:
    """With speculative decoding, the logits of the rows a verify step samples beyond one a sequence (each draft's
    position has its row), as activation_bytes counts a row's (memory.sizes.sampler_row_bytes). `seqs`: the
    sequences at once (default max_num_seqs)."""
    spec = getattr(engine_config, "speculative_config", None)
    if not spec:
        return 0
    seqs, tokens = seqs or engine_config.max_num_seqs, engine_config.max_num_batched_tokens
    rows = min(tokens, seqs * (spec["num_speculative_tokens"] + 1)) - min(tokens, seqs)
    return max(0, rows) * sampler_row_bytes(model_config)


def _rope_rows_over(model, positions: int) -> int:
    """The bytes of `model`'s rotary tables (its `cos_sin` buffer, and Gemma 3's `local_cos_sin`: a row a position,
    built for the max_model_len it was loaded with) past `positions` rows: what a model loaded for `positions` would
    not hold."""
    extra = 0
    for name, buf in model.named_buffers():
        if name.rpartition(".")[2].endswith("cos_sin") and buf is not None and buf.dim() and buf.shape[0] > positions:
            extra += (buf.shape[0] - positions) * (buf[0].numel() * buf.element_size())
    return extra


def _start_plan(engine_config: PlanOptions, model_config, model, dtype, device, max_len: int,
                lora_bytes: int, draft=None, positions: int | None = None) -> MemoryPlan:
    """`positions`: plan as an engine whose model was loaded for that max_model_len would (its rotary table that
    long), where `model` was loaded for a longer one (largest_fitting_len)."""
    seqs = engine_config.max_num_seqs
    draft_model, draft_config = draft if draft is not None else (None, None)
    act = start_activation_bytes(engine_config, model_config, model, dtype, max_len, draft_config, draft_model)
    weights = weights_bytes(model) + (weights_bytes(draft_model) if draft_model is not None else 0)
    if positions is not None:
        weights -= sum(_rope_rows_over(m, positions) for m in (model, draft_model) if m is not None)
    plan = make_plan(engine_config, model_config, dtype, device, weights, act, max_len, 1, max_len,
                     lora_bytes, draft_config=draft_config)
    if engine_config.num_kv_blocks:
        if engine_config.num_kv_blocks > plan.kv_blocks:  # the cache is allocated at start: refuse it before that
            more = "raise --gpu-memory-utilization" if device.type == "cuda" else "raise --memory-limit"
            raise OutOfMemoryError(
                f"num_kv_blocks={engine_config.num_kv_blocks:,} needs "
                f"{gib(engine_config.num_kv_blocks * plan.kv_block_bytes)} of KV cache, but after weights "
                f"{gib(plan.weights_bytes)} and activations {gib(plan.activation_peak_bytes)} the budget of "
                f"{gib(plan.budget_bytes)} leaves room for {plan.kv_blocks:,} blocks",
                f"use num_kv_blocks={plan.kv_blocks:,} or less, leave it unset (sized from the budget), or {more}")
        plan.kv_blocks = engine_config.num_kv_blocks
    else:  # never more than can be in use at once (CPU), or twice that (CUDA: room for the prefix cache)
        most = seqs * plan.blocks_for(max_len) + seqs  # (a window's placeholder among the seqs spare)
        plan.kv_blocks = min(plan.kv_blocks, most if device.type == "cpu" else 2 * most)
    return plan


def largest_fitting_len(engine_config: PlanOptions, model_config, model, dtype, device, max_len: int,
                        lora_bytes: int = 0, draft=None) -> int:
    """The largest max_model_len below `max_len` whose own plan holds one sequence (activations shrink with the
    length, so this is more than the KV left at `max_len`); 0 if none does. A binary search: fitting is monotone."""
    def fits(n: int) -> bool:  # (the model as loaded for n: its rotary table n rows, not max_len's)
        plan = _start_plan(engine_config, model_config, model, dtype, device, n, lora_bytes, draft, positions=n)
        return plan.usable_blocks >= plan.blocks_for(n)
    lo, hi = 0, max_len - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def check_lora_slots(engine_config: PlanOptions, model_config, model, dtype, device) -> None:
    """Before an engine allocates its adapter slots (--max-loras x --max-lora-rank on every merged layer): slots that
    with the weights pass the budget are refused naming those flags. Allocated first, they were the allocator's error,
    or on a CPU the machine's memory filling until the process was killed (plan_memory counts them only after)."""
    slots = lora_slot_bytes(model_config, engine_config.max_loras, engine_config.max_lora_rank, dtype,
                            engine_config.lora_target_modules)
    weights = weights_bytes(model)
    budget = budget_bytes(engine_config, device, weights)
    if weights + slots > budget:
        more = "raise --gpu-memory-utilization" if device.type == "cuda" else "raise --memory-limit"
        raise OutOfMemoryError(f"the adapter slots (--max-loras {engine_config.max_loras} x --max-lora-rank "
                               f"{engine_config.max_lora_rank} on {slot_scope(engine_config.lora_target_modules)}) "
                               f"take {gib(slots)}, which with the weights ({gib(weights)}) passes the budget of "
                               f"{gib(budget)}",
                               f"lower --max-loras ({engine_config.max_loras}) or --max-lora-rank "
                               f"({engine_config.max_lora_rank}), whose adapter slots take {gib(slots)}, or {more}")


def plan_memory(engine_config: PlanOptions, model_config, model, dtype, device, max_len: int,
                lora_bytes: int = 0, draft=None) -> MemoryPlan:
    """The engine's sizing at start: estimated activations, and KV for what can run at once: on CPU no more than
    max_num_seqs sequences of max_len (CPU pages are only used as blocks fill), on CUDA twice that (room for the
    prefix cache) within the budget; num_kv_blocks (API only) overrides both. `draft`: (model, config) of a draft
    model (speculative decoding), whose weights, KV blocks and step count too."""
    plan = _start_plan(engine_config, model_config, model, dtype, device, max_len, lora_bytes, draft)
    if plan.usable_blocks < plan.blocks_for(max_len) and engine_config.num_kv_blocks:
        raise _too_few_blocks(plan, engine_config.num_kv_blocks, max_len)
    if plan.usable_blocks < plan.blocks_for(max_len):
        fit = largest_fitting_len(engine_config, model_config, model, dtype, device, max_len, lora_bytes, draft)
        more = "raise --gpu-memory-utilization" if device.type == "cuda" else "raise --memory-limit"
        if plan.weights_bytes + plan.reserve_bytes >= plan.budget_bytes:  # nothing else matters until they fit
            more = weights_advice(plan.weights_bytes, plan.reserve_bytes, plan.budget_bytes, more)
        elif plan.lora_bytes > plan.budget_bytes // 2:  # the adapter slots, not the length, use the memory
            more = (f"lower --max-loras ({engine_config.max_loras}) or --max-lora-rank "
                    f"({engine_config.max_lora_rank}), whose adapter slots take {gib(plan.lora_bytes)}, or {more}")
        elif plan.state_bytes > plan.budget_bytes // 2:  # a hybrid model's state slots, one per --max-num-seqs
            more = (f"lower --max-num-seqs ({engine_config.max_num_seqs}), whose linear-attention states (a slot per "
                    f"sequence) take {gib(plan.state_bytes)}, or {more}")
        elif plan.snapshot_bytes > plan.budget_bytes // 2:  # the prefix cache of states
            more = (f"lower --state-snapshots ({snapshot_count(engine_config, model_config)}), whose snapshots of "
                    f"linear-attention states take {gib(plan.snapshot_bytes)}, or {more}")
        elif plan.activation_peak_bytes > plan.budget_bytes // 2:  # the batch sizes, not the length, use the memory
            more = (f"lower --max-num-seqs ({engine_config.max_num_seqs}) or --max-num-batched-tokens "
                    f"({engine_config.max_num_batched_tokens}), whose activations take most of the budget, or {more}")
        # (layer groups: a block holds one group's layers, a sequence a block of each group for its tokens)
        held = f"{plan.kv_blocks * engine_config.block_size} tokens" if not plan.kv_groups else \
            f"each of one of {plan.kv_groups} KV layer groups, {plan.blocks_for(max_len)} of them a sequence's"
        raise OutOfMemoryError(
            f"a single sequence of {max_len} tokens does not fit: the KV cache gets {plan.kv_blocks} blocks "
            f"({held}) after weights {gib(plan.weights_bytes)}, "
            f"activations {gib(plan.activation_peak_bytes)}"
            + (f", LoRA adapter slots {gib(plan.lora_bytes)}" if plan.lora_bytes else "")
            + (f", state snapshots {gib(plan.snapshot_bytes)}" if plan.snapshot_bytes else "")
            + (f", linear-attention states {gib(plan.state_bytes)}" if plan.state_bytes else "")
            + f" and a reserve of {gib(plan.reserve_bytes)} within a budget of {gib(plan.budget_bytes)}; "
            + (f"estimated maximum model length is {fit}" if fit >= SHORTEST else
               f"no sequence fits, not even one of {SHORTEST} tokens (a prompt token and one generated)"),
            f"use --max-model-len {fit} or less, or {more}" if fit >= SHORTEST else more)
    return plan


SHORTEST = 2  # the shortest context a request runs in: one prompt token and one generated


def _too_few_blocks(plan: MemoryPlan, num_kv_blocks: int, max_len: int) -> ConfigError:
    """num_kv_blocks (API only) too few for one sequence of max_len: the error, naming the blocks that hold one and
    the longest --max-model-len they hold; or, where they hold no sequence at all (0 usable blocks: a sliding
    window's placeholder takes the only one; fewer than the layer groups, a block each), that they hold none and
    the fewest that do (a --max-model-len of 0 or 1 was advised)."""
    spare = plan.kv_blocks - plan.usable_blocks  # (a sliding window's placeholder: no sequence's)
    lo, hi = 0, max_len - 1  # the longest sequence the usable blocks hold (by the layer groups' count, the window's)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if plan.blocks_for(mid) <= plan.usable_blocks else (lo, mid - 1)
    usable = f"{plan.usable_blocks} block{'s' if plan.usable_blocks != 1 else ''}"
    held = "its full layer groups' every block, its sliding ones' window and a step" if plan.kv_groups else \
        "its window and a step"
    need = f"use num_kv_blocks={plan.blocks_for(max_len) + spare} or more"
    if lo < SHORTEST:
        fewest = plan.blocks_for(SHORTEST)
        return ConfigError(
            f"num_kv_blocks={num_kv_blocks} leaves {usable} for sequences"
            + (" (one is the sliding window's placeholder)" if spare else "")
            + f": too few for any sequence, even one of {SHORTEST} tokens holds {fewest} block"
            + ("s" if fewest != 1 else "") + " at once"
            + (f" (a block of each of the {plan.kv_groups} KV layer groups)" if plan.kv_groups else ""),
            f"{need} (one sequence of {max_len} tokens, --max-model-len); num_kv_blocks={fewest + spare} is the "
            "fewest that hold any sequence")
    return ConfigError(
        f"num_kv_blocks={num_kv_blocks} leaves {usable} for sequences (one is the sliding window's placeholder), "
        f"fewer than the {plan.blocks_for(max_len)} one sequence of {max_len} tokens (--max-model-len) holds at "
        f"once ({held})" if spare else
        f"num_kv_blocks={num_kv_blocks} holds {plan.usable_blocks * plan.block_size} tokens, less than one "
        f"sequence of {max_len} tokens (the context, --max-model-len)",
        f"{need}, or lower --max-model-len to {lo} or less")
