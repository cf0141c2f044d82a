"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's scheme; off with --eager).

A decode step of a small model on a GPU is dominated by launch overhead: hundreds of small kernels whose launches
cost more than their work. A CUDA graph records the whole forward once and replays it as one launch. A graph reads
and writes fixed addresses, so every input lives in a static buffer that each step overwrites:

    input_ids, positions, slot_mapping [B]     block_tables [B, max_blocks]     seq_lens [B]
    query_start_loc [B + 1] = 0..B (one token per sequence)
    LoRA: token_slots [B], the token order by slot [B] and segment starts [S + 2] (see lora.batch.LoRAGroups)

A step of n sequences replays the graph of the smallest bucket b >= n; rows n..b-1 are padding: slot -1 (no KV
write), length 0 (attention skips them), adapter slot -1 (no LoRA). Only the hidden states come out of the graph;
logits and sampling run eagerly on the first n rows. Prefill and mixed steps always run eagerly.

LoRA under a graph: the adapter weights are stacked tensors that swaps overwrite in place, so a captured graph sees
every adapter loaded later; every LoRA layer runs its shrink/expand over all slots at the full rank (a step cannot
change which kernels a graph launches).

`emulate=True` runs the same buffers, padding and replays on any device by calling the model again instead of
replaying a recorded graph: the tests use it on CPU to check everything except the recording itself.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from ..models.context import ForwardContext

log = logging.getLogger("infer")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to and including max_num_seqs."""
    sizes = [b for b in [1, 2, 4] + list(range(8, max_num_seqs, 8)) if b < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_blocks: int, device: torch.device, lora_manager=None,
                 emulate: bool = False):
        self.model, self.device, self.emulate = model, device, emulate
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch, self.max_blocks = self.buckets[-1], max_blocks
        b, dev = self.max_batch, device
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.lora_manager = lora_manager
        if lora_manager is not None:
            s = lora_manager.max_loras
            self.num_slots = s
            self.token_slots = torch.full((b,), -1, dtype=torch.long, device=dev)
            self.lora_order = torch.arange(b, dtype=torch.long, device=dev)
            self.lora_starts = torch.full((s + 2,), b, dtype=torch.long, device=dev)
            self.lora_starts[:1].zero_()  # not `[0] = 0`: a 0-dim copy from the host syncs
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.batches: dict[int, object] = {}
        self.pool = None
        self.replays: Counter[int] = Counter()  # bucket -> replays

    # ------------------------------------------------------------------ capture
    def _context(self, b: int) -> ForwardContext:
        ctx = ForwardContext(query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
                             block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b], max_query_len=1)
        if self.lora_manager is not None:
            from ..lora.batch import LoRABatch, LoRAGroups
            groups = LoRAGroups(self.lora_order[:b], self.lora_starts)
            ctx.lora = self.batches[b] = LoRABatch(self.token_slots[:b], tuple(range(self.num_slots)), groups,
                                                   static=True)
        return ctx

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first (the smaller ones then reuse its memory pool)."""
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            self._pad(0, b)
            if self.lora_manager is not None:
                self._no_adapter(b)
            ctx = self._context(b)
            args = (self.input_ids[:b], self.positions[:b], ctx)
            hidden = self.model(*args)  # eager first: Triton compiles and autotunes outside the recording
            if self.emulate:
                self.outputs[b] = hidden.clone()
                self.graphs[b] = args
                continue
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self.model(*args)
            self.pool = graph.pool()
            self.graphs[b] = graph
        if not self.emulate:
            torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0)

    # ------------------------------------------------------------------ replay
    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def fits(self, num_new_tokens: list[int], ctx: ForwardContext) -> bool:
        """Whether this step can replay a graph: decodes only, at most max_num_seqs, block tables within width."""
        return (ctx.max_query_len == 1 and len(num_new_tokens) <= self.max_batch
                and ctx.block_tables.shape[1] <= self.max_blocks and bool(self.graphs))

    def _pad(self, n: int, b: int) -> None:
        """Rows n..b-1 become padding: no KV write, no attention, no adapter."""
        if b > n:
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(0)
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

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The hidden states [n, hidden] of a decode step of n sequences (ctx as the model runner built it)."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.seq_lens[:n].copy_(ctx.seq_lens)
        self.block_tables[:n, :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        self._pad(n, b)
        if self.lora_manager is not None:
            self._set_lora(ctx.lora, n, b)
        self.replays[b] += 1
        if self.emulate:
            batch = self.batches.get(b)
            if batch is not None:  # a fresh step for the CPU reference's per-step caches
                batch.groups.cache.clear()
            self.outputs[b].copy_(self.model(*self.graphs[b]))
        else:
            self.graphs[b].replay()
        return self.outputs[b][:n]

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
