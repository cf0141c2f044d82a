"""Run the model once on a flat batch: build token ids, positions, block tables and slot mapping, run, sample.

`launch` returns as soon as the work is queued on the device (a StepHandle); `StepHandle.result` waits for the one
device-to-host copy of the step's sampled tokens. `run` does both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.context import ForwardContext
from .config import EngineConfig
from .sampler import PenaltyTable, SampledBatch, Sampler, SamplingInputs
from .scheduler import ScheduledBatch
from .transfer import Pack, to_device


class ModelRunner:
    def __init__(self, config: EngineConfig, model, *, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 lora_manager=None):
        """`model` is the loaded decoder; `num_blocks` KV blocks of config.block_size tokens are allocated."""
        self.config = config
        self.model, self.dtype, self.device = model, dtype, device
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler(config.seed)
        self.vocab_size = model.config.vocab_size  # the logits' width
        self.penalties = PenaltyTable(self.vocab_size, device, config.max_num_seqs)  # rows: LLMEngine releases them
        self.lora_manager = lora_manager
        self.kv_cache = self._allocate_kv(num_blocks)
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs once captured

    def capture_graphs(self, max_model_len: int, emulate: bool = False) -> None:
        """Record the decode steps of up to config.max_num_seqs sequences of up to max_model_len tokens as CUDA
        graphs (see engine.cuda_graphs); `emulate` replays by re-running the model."""
        from .cuda_graphs import DecodeGraphs
        max_blocks = -(-max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, self.config.max_num_seqs, max_blocks, self.device, self.lora_manager, emulate)
        graphs.capture()
        self.graphs = graphs

    def _allocate_kv(self, num_blocks: int) -> torch.Tensor:
        layers = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        a = layers[0]
        # Uninitialised: on CPU, pages become resident only as blocks are used; each block is zeroed when it is
        # handed to a sequence (zero_blocks), so masked attention never reads garbage.
        cache = torch.empty(len(layers), 2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                            dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]
        return cache

    def zero_blocks(self, block_ids: list[int]) -> None:
        if block_ids:
            self.kv_cache.index_fill_(2, to_device(block_ids, torch.long, self.device), 0)

    def order(self, batch: ScheduledBatch) -> list[int]:
        """The order the batch's sequences run in: by adapter slot when adapters are loaded (the base model's first),
        so that every adapter's tokens are contiguous and the LoRA decode path works on views."""
        if self.lora_manager is None:
            return list(range(len(batch.seqs)))
        slot = self.lora_manager.slot_of
        return sorted(range(len(batch.seqs)), key=lambda i: slot(batch.seqs[i].lora))

    def prepare(self, batch: ScheduledBatch, order: list[int] | None = None, prev: StepHandle | None = None):
        """(input_ids, positions, ctx, rows, idx, sampling) of the batch in `order`: `rows` are the indices in the
        batch of the sequences that sample this step (their prompt is complete), in run order, `idx` the flat indices
        of their last tokens and `sampling` their SamplingInputs (None without rows). Token ids still pending on the
        host (PENDING) are taken from `prev`'s sampled tokens on the device; the KV blocks `batch.zero` are zeroed
        first. Every integer input travels to the device in one copy (a Pack), without a sync; the sampling
        parameters' floats, when a row draws or has penalties, in a second."""
        host = HostInputs(self.block_size)
        rows = []
        for i in order if order is not None else range(len(batch.seqs)):
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            host.add(seq, n, prev)
            if seq.num_computed_tokens + n == len(seq):
                rows.append(i)
                host.sample.append(len(host.ids) - 1)
            if self.lora_manager is not None:
                host.lora_slots.extend([self.lora_manager.slot_of(seq.lora)] * n)
        b, width = len(host.tables), max(map(len, host.tables))
        pack = Pack()
        ids, pos, slots, lora = pack.add(host.ids), pack.add(host.pos), pack.add(host.slots), pack.add(host.lora_slots)
        starts, lens = pack.add([0] + [j + 1 for j in host.last]), pack.add(host.lens)
        tables = pack.add_rows(host.tables, width)
        last, fill, zero = pack.add(host.sample), pack.add(host.fill), pack.add(batch.zero)
        sampling = SamplingInputs([batch.seqs[i] for i in rows], self.vocab_size, pack, self.penalties,
                                  prev=prev) if rows else None
        data = pack.to(self.device)
        if batch.zero:  # as zero_blocks does, without a copy of its own (index_fill_ takes the 0 as a scalar;
            self.kv_cache.index_fill_(2, data[zero], 0)  # `[:, :, ids] = 0` copies a 0-dim tensor over: a sync)
        input_ids = data[ids]
        if host.fill:
            where, src = data[fill].view(-1, 2).unbind(1)
            input_ids = input_ids.index_copy(0, where, prev.sampled.tokens.index_select(0, src))
        ctx = ForwardContext(query_start_loc=data[starts].int(), seq_lens=data[lens].int(),
                             block_tables=data[tables].view(b, width).int(), slot_mapping=data[slots],
                             max_query_len=max(batch.num_new_tokens))
        if self.lora_manager is not None:  # the slots on the host decide the plan; their copy came with the rest
            ctx.lora = self.lora_manager.make_batch(host.lora_slots, data[lora])
        if sampling is not None:
            sampling.load(data, self.device)
        return input_ids, data[pos], ctx, rows, data[last], sampling

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                num_new_tokens: list[int]) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(num_new_tokens, ctx):
            return self.graphs.run(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: StepHandle | None = None) -> StepHandle:
        """Run the model and sample on the device, start copying the sampled tokens to the host, and return without
        waiting for the device. `prev`: the step before, whose tokens may still be pending on the host."""
        input_ids, positions, ctx, rows, idx, sampling = self.prepare(batch, self.order(batch), prev)
        hidden = self.forward(input_ids, positions, ctx, batch.num_new_tokens)
        if not rows:
            return StepHandle([], {}, None, None, None)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        sampled = self.sampler.sample(logits, [batch.seqs[i] for i in rows], sampling)
        host, event = _copy_to_host(sampled.packed)
        return StepHandle(rows, {batch.seqs[i].request_id: r for r, i in enumerate(rows)}, sampled, host, event)

    def run(self, batch: ScheduledBatch) -> dict[int, tuple[int, dict | None]]:
        """Returns {index in batch: (token, logprob record)} for the sequences whose prompt is now complete."""
        return self.launch(batch).result()


class HostInputs:
    """A step's integer inputs, gathered on the host sequence by sequence."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.ids, self.pos, self.slots, self.lens, self.last, self.lora_slots = [], [], [], [], [], []
        self.tables: list[list[int]] = []
        self.sample: list[int] = []  # flat index of the last token of each sequence that samples
        self.fill: list[int] = []  # pairs: flat index, row of the previous step's sampled tokens

    def add(self, seq, n: int, prev: StepHandle | None) -> None:
        start, table, bs = seq.num_computed_tokens, seq.block_table, self.bs
        if seq.num_pending and start + n > len(seq) - seq.num_pending:
            assert prev is not None and seq.num_pending == 1, "a pending token without the step that made it"
            self.fill += (len(self.ids) + n - 1, prev.row_of[seq.request_id])
        self.ids.extend(seq.tokens(start, start + n))
        if n == 1:  # a decode: no per-token loop
            self.pos.append(start)
            self.slots.append(table[start // bs] * bs + start % bs)
        else:
            self.pos.extend(range(start, start + n))
            self.slots.extend([table[p // bs] * bs + p % bs for p in range(start, start + n)])
        self.lens.append(start + n)
        self.last.append(len(self.ids) - 1)
        self.tables.append(table)


def _copy_to_host(packed: torch.Tensor):
    """(host tensor, event): one non-blocking copy into pinned memory; the event marks its end."""
    if packed.device.type == "cpu":
        return packed, None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


@dataclass
class StepHandle:
    """A launched step: its sampled tokens on the device and their copy to the host, maybe still under way."""

    rows: list[int]  # index in the batch of each sampled row
    row_of: dict[str, int]  # request id -> row (where the next step finds a pending input token)
    sampled: SampledBatch | None
    host: torch.Tensor | None
    event: object = None

    def result(self) -> dict[int, tuple[int, dict | None]]:
        """Wait for the copy; {index in batch: (token, logprob record)}."""
        if not self.rows:
            return {}
        if self.event is not None:
            self.event.synchronize()
        tokens, records = self.sampled.decode(self.host)
        return {i: (t, r) for i, t, r in zip(self.rows, tokens, records)}
