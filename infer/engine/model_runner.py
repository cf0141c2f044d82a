"""Run the model once on a flat batch: build token ids, positions, block tables and slot mapping, run, sample."""

from __future__ import annotations

import torch

from ..models.context import ForwardContext
from .config import EngineConfig
from .sampler import Sampler
from .scheduler import ScheduledBatch


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
            self.kv_cache[:, :, torch.tensor(block_ids, device=self.device)] = 0

    def order(self, batch: ScheduledBatch) -> list[int]:
        """The order the batch's sequences run in: by adapter slot when adapters are loaded (the base model's first),
        so that every adapter's tokens are contiguous and the LoRA decode path works on views."""
        if self.lora_manager is None:
            return list(range(len(batch.seqs)))
        slot = self.lora_manager.slot_of
        return sorted(range(len(batch.seqs)), key=lambda i: slot(batch.seqs[i].lora))

    def prepare(self, batch: ScheduledBatch, order: list[int] | None = None):
        ids, pos, slots, qsl, lens, tables, lora_slots = [], [], [], [0], [], [], []
        bs = self.block_size
        order = order if order is not None else list(range(len(batch.seqs)))
        for seq, n in ((batch.seqs[i], batch.num_new_tokens[i]) for i in order):
            start = seq.num_computed_tokens
            ids.extend(seq.tokens(start, start + n))
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
            tables.append(table)
            if self.lora_manager is not None:
                lora_slots.extend([self.lora_manager.slot_of(seq.lora)] * n)
        width = max(len(t) for t in tables)
        dev = self.device
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        ctx = ForwardContext(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(batch.num_new_tokens),
        )
        if self.lora_manager is not None:
            ctx.lora = self.lora_manager.make_batch(lora_slots)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, ctx

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[int, tuple[int, dict | None]]:
        """Returns {index in batch: (token, logprob record)} for the sequences whose prompt is now complete."""
        order = self.order(batch)
        input_ids, positions, ctx = self.prepare(batch, order)
        if self.graphs is not None and self.graphs.fits(batch.num_new_tokens, ctx):
            hidden = self.graphs.run(input_ids, positions, ctx)
        else:
            hidden = self.model(input_ids, positions, ctx)
        rows, seqs, last = [], [], ctx.query_start_loc[1:].tolist()
        for j, i in enumerate(order):  # j: position in the run, i: index in the batch
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            if seq.num_computed_tokens + n == len(seq):
                rows.append((i, j))
                seqs.append(seq)
        if not rows:
            return {}
        idx = torch.tensor([last[j] - 1 for _, j in rows], device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        tokens, records = self.sampler(logits, seqs)
        return {i: (t, r) for (i, _), t, r in zip(rows, tokens, records)}
