"""Run the model once on a flat batch: build token ids, positions, block tables and slot mapping, run, sample.

`launch` returns as soon as the work is queued on the device (a StepHandle); `StepHandle.result` waits for the one
device-to-host copy of the step's sampled tokens. `run` does both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.context import ForwardContext
from .config import EngineConfig
from .sampler import SampledBatch, Sampler
from .scheduler import ScheduledBatch
from .transfer import to_device


class ModelRunner:
    def __init__(self, config: EngineConfig, model, *, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 lora_manager=None):
        """`model` is the loaded decoder; `num_blocks` KV blocks of config.block_size tokens are allocated."""
        self.config = config
        self.model, self.dtype, self.device = model, dtype, device
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler(config.seed)
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
            self.kv_cache[:, :, to_device(block_ids, torch.long, self.device)] = 0

    def order(self, batch: ScheduledBatch) -> list[int]:
        """The order the batch's sequences run in: by adapter slot when adapters are loaded (the base model's first),
        so that every adapter's tokens are contiguous and the LoRA decode path works on views."""
        if self.lora_manager is None:
            return list(range(len(batch.seqs)))
        slot = self.lora_manager.slot_of
        return sorted(range(len(batch.seqs)), key=lambda i: slot(batch.seqs[i].lora))

    def prepare(self, batch: ScheduledBatch, order: list[int] | None = None, prev: StepHandle | None = None):
        """(input_ids, positions, ctx, last) of the batch in `order`; `last[j]` is the flat index of the j-th
        sequence's last token. Token ids still pending on the host (PENDING) are taken from `prev`'s sampled
        tokens on the device. All integer inputs travel to the device as one tensor, without a sync."""
        host = HostInputs(self.block_size)
        for i in order if order is not None else range(len(batch.seqs)):
            seq = batch.seqs[i]
            host.add(seq, batch.num_new_tokens[i], prev)
            if self.lora_manager is not None:
                host.lora_slots.extend([self.lora_manager.slot_of(seq.lora)] * batch.num_new_tokens[i])
        t, b, width = len(host.ids), len(host.tables), max(map(len, host.tables))
        data = to_device(host.flat(width), torch.long, self.device)
        tp = t + t % 2  # every piece starts 16-byte aligned (see HostInputs.flat)
        input_ids, positions = data[:t], data[tp:tp + t]
        if host.fill:
            where, rows = to_device(host.fill, torch.long, self.device).unbind(1)
            input_ids = input_ids.index_copy(0, where, prev.sampled.tokens.index_select(0, rows))
        o = (4 if host.lora_slots else 3) * tp  # where query_start_loc starts
        ctx = ForwardContext(
            query_start_loc=data[o:o + b + 1].int(), seq_lens=data[o + b + 1:o + 2 * b + 1].int(),
            block_tables=data[o + 2 * b + 1:].view(b, width).int(), slot_mapping=data[2 * tp:2 * tp + t],
            max_query_len=max(batch.num_new_tokens))
        if self.lora_manager is not None:  # the slots on the host decide the plan; their copy came with the rest
            ctx.lora = self.lora_manager.make_batch(host.lora_slots, data[3 * tp:3 * tp + t])
        return input_ids, positions, ctx, host.last

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                num_new_tokens: list[int]) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(num_new_tokens, ctx):
            return self.graphs.run(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: StepHandle | None = None) -> StepHandle:
        """Run the model and sample on the device, start copying the sampled tokens to the host, and return without
        waiting for the device. `prev`: the step before, whose tokens may still be pending on the host."""
        order = self.order(batch)
        input_ids, positions, ctx, last = self.prepare(batch, order, prev)
        hidden = self.forward(input_ids, positions, ctx, batch.num_new_tokens)
        rows, flat = [], []
        for j, i in enumerate(order):  # j: position in the run, i: index in the batch
            seq = batch.seqs[i]
            if seq.num_computed_tokens + batch.num_new_tokens[i] == len(seq):
                rows.append(i)
                flat.append(last[j])
        if not rows:
            return StepHandle([], {}, None, None, None)
        idx = to_device(flat, torch.long, hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        sampled = self.sampler.sample(logits, [batch.seqs[i] for i in rows])
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
        self.fill: list[tuple[int, int]] = []  # (flat index, row of the previous step's sampled tokens)

    def add(self, seq, n: int, prev: StepHandle | None) -> None:
        start, table, bs = seq.num_computed_tokens, seq.block_table, self.bs
        if seq.num_pending and start + n > len(seq) - seq.num_pending:
            assert prev is not None and seq.num_pending == 1, "a pending token without the step that made it"
            self.fill.append((len(self.ids) + n - 1, prev.row_of[seq.request_id]))
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

    def flat(self, width: int) -> list[int]:
        """ids, positions, slots [T each, each padded to an even length], the tokens' adapter slots [T, padded; only
        with adapters], query_start_loc [B+1], seq_lens [B], block tables [B * width]. The padding keeps every int64
        piece 16-byte aligned whatever T is: Triton specializes a kernel on whether a pointer is, so an odd T would
        give the rotary kernel (which reads the positions) a variant of its own, compiled on a user's first prompt
        of the other parity."""
        pad = [0] * (len(self.ids) % 2)
        flat = self.ids + pad + self.pos + pad + self.slots + pad
        if self.lora_slots:
            flat += self.lora_slots + pad
        flat += [0] + [j + 1 for j in self.last] + self.lens
        for row in self.tables:
            flat.extend(row)
            flat.extend([0] * (width - len(row)))
        return flat


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
