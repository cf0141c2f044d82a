"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's scheme; off with --eager).

A decode step of a small model on a GPU is dominated by launch overhead: hundreds of small kernels whose launches
cost more than their work. A CUDA graph records the whole forward once and replays it as one launch. A graph reads
and writes fixed addresses, so every input lives in a static buffer that each step overwrites:

    input_ids, positions, slot_mapping [B]     block_tables [B, max_blocks]     seq_lens [B]
    query_start_loc [B + 1] = 0..B (one token per sequence)
    LoRA: token_slots [B], the token order by slot [B] and segment starts [S + 2] (see lora.batch.LoRAGroups)

A step of n sequences replays the graph of the smallest bucket b >= n; rows n..b-1 are padding: slot -1 (no KV
write), length 0 (attention skips them), adapter slot -1 (no LoRA). Only the hidden states come out of the graph;
logits and sampling run eagerly on the first n rows. Prefill and mixed steps take the piecewise graphs below.

EAGLE-3 speculation (engine.eagle): the target's aux hidden states (LlamaForCausalLM.aux_layers) come out of every
graph too, each a [bucket, hidden] output in the pool beside the hidden states (the piecewise graphs: a static
[tokens, hidden] buffer each, written by the piece that computes it); a replay leaves their first n rows in
model.aux_hidden, as an eager forward does. Without a head no graph keeps any. An EAGLE head's own one-token
forwards (drafts 2..k) replay `HeadGraphs`: a decode graph with the hidden state it is fed as one more input.

LoRA under a graph: the adapter weights are stacked tensors that swaps overwrite in place, so a captured graph sees
every adapter loaded later; every LoRA layer runs its shrink/expand over all slots at the full rank (a step cannot
change which kernels a graph launches).

Steps that are not all decodes (a prefill, or prefill chunks beside decodes) of up to --cuda-graph-max-tokens
tokens replay per-layer graphs instead (`PiecewiseGraphs`, vLLM's piecewise graphs): the attention, whose launch
depends on every sequence's query and context length, runs eagerly between graphs that record the rest of the
forward (piece i: layer i-1 after its attention, then layer i up to its query; LlamaForCausalLM.piece). A 7B step
is then 33 graph replays and 32 attentions (a launch and a copy of its output each) instead of about 450
launches. Buckets count tokens (token_buckets); padding rows as above. Longer steps run eagerly.

`emulate=True` runs the same buffers, padding and replays on any device by calling the model again instead of
replaying a recorded graph: the tests use it on CPU to check everything except the recording itself.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

# (the buckets and the priority rule live below both this and the memory plan, which sizes the pool from them)
from ..memory.graph_buckets import PRIORITY_AUTO_TOKENS, batch_buckets, records_high, token_buckets  # noqa: F401
from ..models.context import ForwardContext

log = logging.getLogger("infer")


_HIGH: dict = {}  # device -> the high-priority stream graphs are recorded on (EngineConfig.graph_priority)


class _StaticTokens:
    """The per-token inputs a recorded graph reads at fixed addresses, for steps of up to buckets[-1] tokens:
    input_ids, positions, slot_mapping and the LoRA map (token_slots, the token order by slot, segment starts)."""

    def __init__(self, model, buckets: list[int], device: torch.device, lora_manager=None, emulate: bool = False,
                 high_priority: bool | None = False):
        self.model, self.device, self.emulate = model, device, emulate
        self.high_priority = high_priority  # EngineConfig.graph_priority: record on a high-priority stream
        self.buckets = buckets
        self.max_batch = b = buckets[-1]
        dev = device
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.long, device=dev)
        # KV layer groups past the first (engine.hybrid_blocks: the layers' kv_group): their slots, and tables
        self.extra_groups = max((getattr(m, "kv_group", 0) for m in model.modules()), default=0)
        self.group_slots = torch.full((self.extra_groups, b), -1, dtype=torch.long, device=dev) \
            if self.extra_groups else None
        self.lora_manager = lora_manager
        if lora_manager is not None:
            s = lora_manager.max_loras
            self.num_slots = s
            self.token_slots = torch.full((b,), -1, dtype=torch.long, device=dev)
            self.lora_order = torch.arange(b, dtype=torch.long, device=dev)
            self.lora_starts = torch.full((s + 2,), b, dtype=torch.long, device=dev)
            self.lora_starts[:1].zero_()  # not `[0] = 0`: a 0-dim copy from the host syncs
        self.batches: dict[int, object] = {}
        self.pool = None
        self.replays: Counter[int] = Counter()  # bucket -> replays

    def capture_stream(self, b: int):
        """The stream the graph of bucket b is recorded on: None (torch's own capture stream, default priority), or
        a stream of high priority, one per device (`_HIGH`), with high_priority True, or with None (auto) where there
        are adapters and b >= PRIORITY_AUTO_TOKENS (memory.graph_buckets.records_high, which the memory plan reads
        too). torch instantiates a graph with each kernel's priority, so its main branch then outranks what the
        layers launch on their side stream."""
        if not records_high(self.high_priority, self.lora_manager is not None, b):
            return None
        if self.device not in _HIGH:
            _HIGH[self.device] = torch.cuda.Stream(self.device, priority=-1)  # lower is higher; clamped to the range
        return _HIGH[self.device]

    def _lora_batch(self, b: int):
        """The static adapter map of bucket b (None without adapters), kept for the emulation's cache resets."""
        if self.lora_manager is None:
            return None
        from ..lora.batch import LoRABatch, LoRAGroups
        groups = LoRAGroups(self.lora_order[:b], self.lora_starts)
        self.batches[b] = LoRABatch(self.token_slots[:b], tuple(range(self.num_slots)), groups, static=True)
        return self.batches[b]

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> tuple[int, int]:
        """Copy a step's per-token inputs in, pad to its bucket; (n tokens, bucket b)."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        if self.extra_groups:  # (a context of one table: a test prefill, whose every group takes it)
            self.group_slots[:, :n].copy_(ctx.slot_mapping if ctx.kv_groups is None else ctx.kv_groups[1])
        self._pad(n, b)
        if self.lora_manager is not None:
            self._set_lora(ctx.lora, n, b)
        self.replays[b] += 1
        if self.emulate:
            batch = self.batches.get(b)
            if batch is not None:  # a fresh step for the CPU reference's per-step caches
                batch.groups.cache.clear()
        return n, b

    def _pad(self, n: int, b: int) -> None:
        """Rows n..b-1 become padding: no KV write, no adapter."""
        if b > n:
            self.slot_mapping[n:b].fill_(-1)
            if self.extra_groups:
                self.group_slots[:, n:b].fill_(-1)
            self.input_ids[n:b].fill_(0)
            self.positions[n:b].fill_(0)
            if self.lora_manager is not None:
                self.token_slots[n:b].fill_(-1)

    def _no_adapter(self, b: int) -> None:
        """A step where no row uses an adapter: every token in the base group, every slot segment empty."""
        self.token_slots[:b].fill_(-1)
        self.lora_order[:b].copy_(torch.arange(b, device=self.device))
        self.lora_starts.fill_(b)
        self.lora_starts[:1].zero_()  # not `[0] = 0`: a 0-dim copy from the host syncs

    def _set_lora(self, lora, n: int, b: int) -> None:
        """The padded step's adapter map: padding rows are slot -1, so they join the (never computed) base group at
        the front of the order, and every segment start after it moves by the b - n padding rows."""
        if lora is None:
            self._no_adapter(b)
            return
        self.token_slots[:n].copy_(lora.token_slots)
        self.lora_order[:b - n].copy_(torch.arange(n, b, device=self.device))
        self.lora_order[b - n:b].copy_(lora.groups.order)
        self.lora_starts[:1].zero_()  # not `[0] = 0`: a 0-dim copy from the host syncs
        self.lora_starts[1:].copy_(lora.groups.starts[1:] + (b - n))


class DecodeGraphs(_StaticTokens):
    def __init__(self, model, max_num_seqs: int, max_blocks: int, device: torch.device, lora_manager=None,
                 emulate: bool = False, high_priority: bool | None = False):
        super().__init__(model, batch_buckets(max_num_seqs), device, lora_manager, emulate, high_priority)
        b, dev = self.max_batch, device
        self.max_blocks = max_blocks
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.group_tables = torch.zeros(self.extra_groups, b, max_blocks, dtype=torch.int32, device=dev) \
            if self.extra_groups else None
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the hidden states its graph writes
        self.extra: dict[int, tuple[torch.Tensor, ...]] = {}  # bucket -> its other outputs (_call; none: ())
        self.aux = len(getattr(model, "aux_layers", ()))  # EAGLE-3: the target's aux states kept (none: no cost)
        # a hybrid model's state slot of each row (models.qwen3_5), padding rows the model's padding slot
        self.state_pad = getattr(model, "state_pad_slot", None)
        self.state_slots = torch.full((b,), self.state_pad, dtype=torch.long, device=dev) \
            if self.state_pad is not None else None

    # ------------------------------------------------------------------ capture
    def _args(self, b: int) -> tuple:
        """The model's arguments for bucket b: views of the static buffers."""
        return self.input_ids[:b], self.positions[:b], self._context(b)

    def _call(self, args: tuple) -> tuple[torch.Tensor, ...]:
        """One forward over a bucket's buffers: the tensors its graph keeps as outputs, the hidden states and (EAGLE-3)
        the target's aux states after them (taken from the model, which an eager forward leaves them in)."""
        hidden = self.model(*args)
        if not self.aux:
            return (hidden,)
        aux, self.model.aux_hidden = self.model.aux_hidden, None
        return (hidden, *aux)

    def _result(self, b: int, n: int):
        """A step's result from bucket b's outputs: the first n rows of the hidden states; the aux states' rows
        left in model.aux_hidden, as an eager forward leaves them."""
        if self.aux:
            self.model.aux_hidden = [a[:n] for a in self.extra[b]]
        return self.outputs[b][:n]

    def _context(self, b: int) -> ForwardContext:
        ctx = ForwardContext(query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
                             block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b], max_query_len=1)
        if self.extra_groups:
            ctx.kv_groups = (self.group_tables[:, :b], self.group_slots[:, :b])
        if self.state_slots is not None:
            ctx.state_slots = self.state_slots[:b]
        ctx.lora = self._lora_batch(b)
        return ctx

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first (the smaller ones then reuse its memory pool). Emulated, only
        the largest bucket's forward runs (all rows padding, as a real capture's do): a smaller bucket's outputs are
        the first rows of copies of its outputs, which every emulated replay overwrites."""
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            self._pad(0, b)
            if self.lora_manager is not None:
                self._no_adapter(b)
            args = self._args(b)
            if self.emulate and self.outputs:  # (the largest bucket's outputs: kept, not run again)
                top = self.max_batch
                self.outputs[b], self.extra[b] = self.outputs[top][:b].clone(), tuple(t[:b].clone()
                                                                                      for t in self.extra[top])
                self.graphs[b] = args
                continue
            out, *extra = self._call(args)  # eager first: Triton compiles and autotunes outside the recording
            if self.emulate:
                self.outputs[b], self.extra[b] = out.clone(), tuple(t.clone() for t in extra)
                self.graphs[b] = args
                continue
            del out, extra
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream(b)):
                self.outputs[b], *extra = self._call(args)  # (allocated in the pool: the graph's outputs)
            self.extra[b] = tuple(extra)
            self.pool = graph.pool()
            self.graphs[b] = graph
        if not self.emulate:
            torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0)

    # ------------------------------------------------------------------ replay
    def fits(self, num_new_tokens: list[int], ctx: ForwardContext) -> bool:
        """Whether this step can replay a graph: decodes only (of generated tokens where a clamping time_step_limit
        tells them apart: ctx.dt_clamp), at most max_num_seqs, block tables within width."""
        return (ctx.max_query_len == 1 and ctx.dt_clamp is None and len(num_new_tokens) <= self.max_batch
                and ctx.block_tables.shape[1] <= self.max_blocks and bool(self.graphs))

    def _pad(self, n: int, b: int) -> None:
        """Rows n..b-1 become padding: no KV write, no attention (length 0), no adapter."""
        super()._pad(n, b)
        if b > n:
            self.seq_lens[n:b].fill_(0)
            if self.state_slots is not None:  # (zero state, written to the padding slot)
                self.state_slots[n:b].fill_(self.state_pad)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The hidden states [n, hidden] of a decode step of n sequences (ctx as the model runner built it)."""
        self.seq_lens[:input_ids.shape[0]].copy_(ctx.seq_lens)
        self.block_tables[:input_ids.shape[0], :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        if self.state_slots is not None:
            self.state_slots[:input_ids.shape[0]].copy_(ctx.state_slots)
        if self.extra_groups:
            self.group_tables[:, :input_ids.shape[0], :ctx.block_tables.shape[1]].copy_(
                ctx.block_tables if ctx.kv_groups is None else ctx.kv_groups[0])
        n, b = self._load(input_ids, positions, ctx)
        if self.emulate:
            out, *extra = self._call(self.graphs[b])
            self.outputs[b].copy_(out)
            for kept, got in zip(self.extra[b], extra):
                kept.copy_(got)
        else:
            self.graphs[b].replay()
        return self._result(b, n)


class HeadGraphs(DecodeGraphs):
    """An EAGLE head's one-token forwards (engine.eagle: drafts 2..k) as decode graphs: one more static input, the
    hidden state fed with each token [B, hidden] (the head's own output for the draft before), and two outputs, the
    normed states (for the draft's logits) and the pre-norm ones (fed to the next draft). Padding rows get a zero
    hidden state."""

    def __init__(self, model, max_num_seqs: int, max_blocks: int, device: torch.device, lora_manager=None,
                 emulate: bool = False, high_priority: bool | None = False):
        assert lora_manager is None, "a head has no adapters"
        super().__init__(model, max_num_seqs, max_blocks, device, None, emulate, high_priority)
        self.aux = 0  # (a head's aux_layers are the target's layers it reads: none it keeps)
        self.hidden_in = torch.zeros(self.max_batch, model.config.hidden_size, dtype=model.fc.weight.dtype,
                                     device=device)

    def _args(self, b: int) -> tuple:
        return (*super()._args(b), self.hidden_in[:b])

    def _call(self, args: tuple) -> tuple[torch.Tensor, ...]:
        return tuple(self.model(*args))

    def _result(self, b: int, n: int):
        return self.outputs[b][:n], self.extra[b][0][:n]

    def _pad(self, n: int, b: int) -> None:
        super()._pad(n, b)
        if b > n:
            self.hidden_in[n:b].zero_()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, hidden: torch.Tensor):
        """(normed, pre-norm) [n, hidden] of the head's one-token forward of n sequences fed `hidden`."""
        self.hidden_in[:hidden.shape[0]].copy_(hidden)
        return super().run(input_ids, positions, ctx)


class PiecewiseGraphs(_StaticTokens):
    """Steps of up to max_tokens tokens that DecodeGraphs does not take (prefills, prefill chunks beside decodes):
    per bucket of tokens, one graph per piece of the forward between two attentions (LlamaForCausalLM.piece), and
    the attentions run eagerly between them on the step's real sequences. The pieces pass their results through
    static buffers: the query [T, q_size] to the attention, its output back, the residual to the next piece, the
    hidden states out of the last. Padding rows (slot -1: no KV write, no adapter) never reach an attention: it
    reads the step's query_start_loc, so it computes the n real rows only."""

    def __init__(self, model, max_tokens: int, device: torch.device, lora_manager=None, emulate: bool = False,
                 pool=None, high_priority: bool | None = False):
        super().__init__(model, token_buckets(max_tokens), device, lora_manager, emulate, high_priority)
        t, attn = self.max_batch, model.layers[0].self_attn
        dtype, hidden = model.embed_tokens.weight.dtype, model.config.hidden_size
        self.query = torch.zeros(t, attn.q_size, dtype=dtype, device=device)  # piece i -> attention i
        # attention i -> piece i + 1 (o_proj's input: q_size wide, but MLA's heads * v_head_dim: out_size)
        self.attn_out = torch.zeros(t, getattr(attn, "out_size", attn.q_size), dtype=dtype, device=device)
        self.residual = torch.zeros(t, hidden, dtype=dtype, device=device)  # piece i -> piece i + 1
        self.hidden = torch.zeros(t, hidden, dtype=dtype, device=device)  # the last piece -> the logits
        # EAGLE-3: the target's aux states, each written by the piece that computes that layer's input (none: none)
        self.aux_layers = tuple(getattr(model, "aux_layers", ()))
        self.aux = [torch.zeros(t, hidden, dtype=dtype, device=device) for _ in self.aux_layers]
        self.num_pieces = len(model.layers) + 1
        self.graphs: dict[int, list] = {}  # bucket -> one graph per piece (emulated: an empty list)
        self.contexts: dict[int, ForwardContext] = {}
        self.pool = pool  # the decode graphs' pool: the two kinds never run at once

    def _context(self, b: int) -> ForwardContext:
        """What the pieces read besides the token buffers: the KV slots and the adapter map (the attention's fields
        stay None: a piece that read them would fail here rather than record a stale step)."""
        ctx = ForwardContext(query_start_loc=None, seq_lens=None, block_tables=None,
                             slot_mapping=self.slot_mapping[:b], max_query_len=0)
        if self.extra_groups:
            ctx.kv_groups = (None, self.group_slots[:, :b])
        ctx.lora = self._lora_batch(b)
        return ctx

    def _piece(self, i: int, b: int) -> None:
        """Piece i of bucket b, from the static buffers into them."""
        out, residual = self.model.piece(i, self.input_ids[:b], self.positions[:b], self.attn_out[:b],
                                         self.residual[:b], self.contexts[b])
        if residual is None:
            self.hidden[:b].copy_(out)
        else:
            self.query[:b].copy_(out)
            self.residual[:b].copy_(residual)
            for layer, kept in zip(self.aux_layers, self.aux):  # (the residual entering layer i: its aux state)
                if layer == i:
                    kept[:b].copy_(residual)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every piece of every bucket, largest bucket first. Each bucket's pieces run eagerly before any of them is
        recorded: Triton compiles and tunes, and the int4 dequant scratch reaches its final size, outside the
        recordings (a scratch reallocated after a recording would leave the graph writing into freed memory)."""
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            self._pad(0, b)
            if self.lora_manager is not None:
                self._no_adapter(b)
            self.contexts[b] = self._context(b)
            for i in range(self.num_pieces):
                self._piece(i, b)
            if self.emulate:
                self.graphs[b] = []
                continue
            torch.cuda.synchronize(self.device)
            graphs = []
            for i in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream(b)):
                    self._piece(i, b)
                self.pool = graph.pool()
                graphs.append(graph)
            self.graphs[b] = graphs
        if not self.emulate:
            torch.cuda.synchronize(self.device)
        log.info("captured %d piecewise CUDA graphs (%d pieces x steps of %s tokens) in %.1f s",
                 self.num_pieces * len(self.buckets), self.num_pieces, ",".join(map(str, self.buckets)),
                 time.perf_counter() - t0)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_batch and bool(self.graphs)

    def _replay(self, i: int, b: int) -> None:
        if self.emulate:
            self._piece(i, b)
        else:
            self.graphs[b][i].replay()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The hidden states [n, hidden] of a step of n tokens (ctx as the model runner built it)."""
        n, b = self._load(input_ids, positions, ctx)
        for i, layer in enumerate(self.model.layers):
            self._replay(i, b)
            self.attn_out[:n].copy_(layer.self_attn.attend(self.query[:n], ctx))
        self._replay(self.num_pieces - 1, b)
        if self.aux:
            self.model.aux_hidden = [kept[:n] for kept in self.aux]
        return self.hidden[:n]
