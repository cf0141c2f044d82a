"""Run the model once on a flat batch: build token ids, positions, block tables and slot mapping, run, sample.

`launch` returns as soon as the work is queued on the device (a StepHandle); `StepHandle.result` waits for the one
device-to-host copy of the step's sampled tokens. `run` does both."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..lora.batch import LoRAGroups, host_groups
from ..memory.sizes import prompt_logprob_rows
from ..models.context import ForwardContext
from .config import EngineConfig
from .classify import score_rows
from .pooling import Pooler, pool_rows
from .sampler import PenaltyTable, SampledBatch, Sampler, SamplingInputs, token_ranks
from .scheduler import ScheduledBatch
from .transfer import Pack, to_device

log = logging.getLogger("infer")
PIECES_TOLERANCE = 0.05  # the pieces' hidden states may differ from the whole forward's by rounding, not more


class ModelRunner:
    def __init__(self, config: EngineConfig, model, *, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 lora_manager=None, groups=None):
        """`model` is the loaded decoder; `num_blocks` KV blocks of config.block_size tokens are allocated. `groups`:
        a model of mixed layers' KV groups (models.limits.layer_groups: layers per group, [(window, layers)]), its
        blocks one pool of a group's layers (engine.hybrid_blocks); None: a block holds every layer."""
        self.config = config
        self.model, self.dtype, self.device = model, dtype, device
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler(config.seed)
        self.vocab_size = model.config.vocab_size  # the logits' width
        self.penalties = PenaltyTable(self.vocab_size, device, config.max_num_seqs)  # rows: LLMEngine releases them
        self.lora_manager = lora_manager
        self.groups = groups
        self.kv_cache = self._allocate_kv(num_blocks)
        # a hybrid model's linear-attention states: a slot per running sequence (engine.state_cache; 0: none)
        self.hybrid = hasattr(model, "allocate_states")
        self.state_bytes = model.allocate_states(config.max_num_seqs, device) if self.hybrid else 0
        # Mamba-2 layers whose time_step_limit clamps a prompt's dt: each step says which tokens are the prompt's
        # where a prefill's are not all or a decode's not none (ForwardContext.dt_clamp)
        self.clamps_dt = self.hybrid and any(getattr(m, "clamps", False) for m in model.linear_layers())
        self.snapshot_bytes = 0  # and its prefix cache's state snapshots (LLMEngine: allocate_snapshots)
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs once captured
        self.pieces = None  # engine.cuda_graphs.PiecewiseGraphs once captured (and checked)
        self.pieces_check: float | None = None  # the check's relative difference (check_pieces)
        self.draft = None  # engine.draft.DraftRunner (draft-model speculation): its KV blocks are zeroed with these

    def capture_graphs(self, max_model_len: int, emulate: bool = False) -> None:
        """Record the decode steps of up to config.max_num_seqs sequences of up to max_model_len tokens as CUDA
        graphs (a draft model's one-token forwards too: DraftRunner.capture_graphs), and the other steps of up to
        config.piecewise_tokens() tokens as piecewise graphs (see engine.cuda_graphs); `emulate` replays by
        re-running the model. Called at the engine's start, before any request: the pieces' check (check_pieces)
        writes the KV of the first blocks. With an EAGLE-3 head the graphs keep the target's aux states too, and an
        EAGLE head's one-token forwards are recorded as a draft model's are (cuda_graphs.HeadGraphs)."""
        from .cuda_graphs import DecodeGraphs, PiecewiseGraphs
        if not emulate:
            self._reserve_dequant_scratch()
        max_blocks = -(-max_model_len // self.block_size)
        priority = self.config.graph_priority
        graphs = DecodeGraphs(self.model, self.config.max_num_seqs, max_blocks, self.device, self.lora_manager, emulate,
                              high_priority=priority)
        graphs.capture()
        self.graphs = graphs
        if self.draft is not None:  # the draft's one-token forwards (engine.draft), in the same pool
            self.draft.capture_graphs(self.config.max_num_seqs, max_blocks, emulate, pool=graphs.pool,
                                      high_priority=priority)
        tokens = self.config.piecewise_tokens() if getattr(self.model, "piecewise", True) else 0
        if tokens:
            pieces = PiecewiseGraphs(self.model, tokens, self.device, self.lora_manager, emulate, pool=graphs.pool,
                                     high_priority=priority)
            pieces.capture()
            self.pieces_check = self.check_pieces(pieces)
            ok = self.pieces_check <= PIECES_TOLERANCE  # (a NaN fails too)
            self.pieces = pieces if ok else None
            if not ok:
                log.warning("the piecewise CUDA graphs' hidden states differ from the whole forward's by %.3g of "
                            "their largest value on a test prefill: prefills and mixed steps run eagerly instead "
                            "(please report this; --cuda-graph-max-tokens 0 skips the capture)", self.pieces_check)

    @torch.inference_mode()
    def check_pieces(self, pieces, n: int = 9) -> float:
        """The largest difference between the hidden states of an n-token prefill through `pieces` and through the
        whole forward, relative to the largest value (NaN if either is not finite). It writes the KV of the first
        blocks, which no sequence holds at start (a block is zeroed when a sequence gets it)."""
        n = max(1, min(n, pieces.max_batch, self.num_blocks * self.block_size))
        dev, blocks = self.device, -(-n // self.block_size)
        ids = torch.randint(1, self.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).to(dev)
        pos = torch.arange(n, device=dev)
        ctx = ForwardContext(query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                             seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                             block_tables=torch.arange(blocks, dtype=torch.int32, device=dev).view(1, blocks),
                             slot_mapping=torch.arange(n, device=dev), max_query_len=n)
        want = self.model(ids, pos, ctx).float()
        got = pieces.run(ids, pos, ctx).float()
        pieces.replays.clear()
        if not (bool(want.isfinite().all()) and bool(got.isfinite().all())):
            return float("nan")
        return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))

    def _reserve_dequant_scratch(self) -> None:
        """The int4 dequantize scratch at its final size (the largest GPTQ layer's K x N, which the memory plan
        counts when steps can be long enough to use it) before a graph records its address (see
        kernels.gptq_dequant.reserve_scratch)."""
        from ..memory.sizes import dequant_scratch_bytes
        models = [self.model] + ([self.draft.model] if self.draft is not None else [])  # (a draft model's share it)
        size = max(dequant_scratch_bytes(m, self.dtype, self.config.max_num_batched_tokens) for m in models)
        if size:
            from ..kernels.gptq_dequant import reserve_scratch
            device = next(m.qweight.device for model in models for m in model.modules()
                          if getattr(m, "qweight", None) is not None)
            reserve_scratch(device, self.dtype, size // torch.empty((), dtype=self.dtype).element_size())

    def _allocate_kv(self, num_blocks: int) -> torch.Tensor:
        layers = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        a = layers[0]
        # Uninitialised: on CPU, pages become resident only as blocks are used; each block is zeroed when it is
        # handed to a sequence (zero_blocks), so masked attention never reads garbage.
        # --kv-cache-dtype: fp8 stores K and V in 1 byte (the kernels saturate and round on write, upcast on read)
        # a latent layout (MLA's kv_copies 1: models.deepseek) keeps one row a token, its v_cache the k_cache itself
        copies = getattr(a, "kv_copies", 2)
        if self.groups is not None:  # layer groups: layer j of a group in slot j of the pool's blocks
            size, groups = self.groups
            cache = torch.empty(size, copies, num_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                                dtype=self.config.kv_dtype(self.dtype), device=self.device)
            for g, (window, members) in enumerate(groups):
                for j, i in enumerate(members):
                    assert layers[i].window == window, "a layer of another window in the group"
                    layers[i].k_cache, layers[i].v_cache, layers[i].kv_group = cache[j, 0], cache[j, -1], g
            return cache
        cache = torch.empty(len(layers), copies, num_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                            dtype=self.config.kv_dtype(self.dtype), device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = cache[i, 0], cache[i, -1]
        return cache

    @property
    def _fill_view(self) -> torch.Tensor:
        """The cache as zero_blocks fills it: torch has no index_fill_ for float8 (whose zero byte is 0.0)."""
        cache = self.kv_cache
        return cache.view(torch.uint8) if cache.element_size() == 1 else cache

    def zero_blocks(self, block_ids: list[int]) -> None:
        if block_ids:
            self._fill_view.index_fill_(2, to_device(block_ids, torch.long, self.device), 0)
            if self.draft is not None:
                self.draft.zero(block_ids)

    def order(self, batch: ScheduledBatch) -> list[int]:
        """The order the batch's sequences run in: by adapter slot when adapters are loaded (the base model's first),
        so that every adapter's tokens are contiguous and the LoRA decode path works on views."""
        if self.lora_manager is None:
            return list(range(len(batch.seqs)))
        slot = self.lora_manager.slot_of
        return sorted(range(len(batch.seqs)), key=lambda i: slot(batch.seqs[i].lora))

    def prepare(self, batch: ScheduledBatch, order: list[int] | None = None, prev: StepHandle | None = None):
        """(input_ids, positions, ctx, rows, idx, sampling, prompt) of the batch in `order`: `rows` are the indices in
        the batch of the sequences that sample this step (their prompt is complete), in run order, `idx` the flat
        indices of their last tokens (None when that is every token in order, as in a decode step), `sampling`
        their SamplingInputs (None without rows) and `prompt` what the prompt_logprobs of the step's prefill
        chunks need (None without). Token ids still pending on the
        host (PENDING) are taken from `prev`'s sampled tokens on the device; the KV blocks `batch.zero` are zeroed
        first. Every integer input travels to the device in one copy (a Pack), without a sync; the sampling
        parameters' floats, when a row draws or has penalties, in a second."""
        host = HostInputs(self.block_size, len(self.groups[1]) - 1 if self.groups is not None else 0)
        host.states = [] if self.hybrid else None
        host.dt_clamp = [] if self.clamps_dt else None
        rows, row_seqs = [], []
        for i in order if order is not None else range(len(batch.seqs)):
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            if seq.prompt_logprobs is not None:
                host.add_prompt_logprobs(seq, n)
            host.add(seq, n, prev)
            if seq.num_computed_tokens + n == len(seq):
                rows.append(i)
                host.sample.append(len(host.ids) - 1)
                row_seqs.append(seq)
            elif seq.draft_token_ids:  # speculative decoding: a row at its last token and at every draft
                k = len(seq.draft_token_ids)
                rows.append(i)
                host.sample.extend(range(len(host.ids) - k - 1, len(host.ids)))
                row_seqs.extend([seq] * (k + 1))
            if self.lora_manager is not None:
                host.lora_slots.extend([self.lora_manager.slot_of(seq.lora)] * n)
        b, width = len(host.tables), max(map(len, host.tables))
        if host.group_tables:  # (every group's tables one width)
            width = max(width, max(len(t) for tables in host.group_tables for t in tables))
        pack = Pack()
        ids, pos, slots, lora = pack.add(host.ids), pack.add(host.pos), pack.add(host.slots), pack.add(host.lora_slots)
        starts, lens = pack.add([0] + [j + 1 for j in host.last]), pack.add(host.lens)
        tables = pack.add_rows(host.tables, width)
        groups_at = [(pack.add_rows(t, width), pack.add(s)) for t, s in zip(host.group_tables, host.group_slots)]
        last, fill, zero = pack.add(host.sample), pack.add(host.fill), pack.add(batch.zero)
        states = pack.add(host.states) if self.hybrid else None
        prompt = (pack.add(host.plp_rows), pack.add(host.plp_tokens)) if host.plp_rows else None
        dt_clamp = pack.add(host.dt_clamp) if host.dt_clamp_needed else None
        groups = None  # the tokens grouped by adapter slot (LoRAGroups), made on the host, copied with the rest
        if self.lora_manager is not None and max(host.lora_slots, default=-1) >= 0:
            by_slot, bounds, in_order = host_groups(host.lora_slots, self.lora_manager.max_loras)
            groups = (pack.add(by_slot), pack.add(bounds), in_order)
        sampling = SamplingInputs(row_seqs, self.vocab_size, pack, self.penalties, prev=prev) if rows else None
        data = pack.to(self.device)
        if batch.zero:  # as zero_blocks does, without a copy of its own (index_fill_ takes the 0 as a scalar;
            self._fill_view.index_fill_(2, data[zero], 0)  # `[:, :, ids] = 0` copies a 0-dim tensor over: a sync)
        input_ids = data[ids]
        if host.fill:
            where, src = data[fill].view(-1, 2).unbind(1)
            input_ids = input_ids.index_copy(0, where, prev.sampled.tokens.index_select(0, src))
        ctx = ForwardContext(query_start_loc=data[starts].int(), seq_lens=data[lens].int(),
                             block_tables=data[tables].view(b, width).int(), slot_mapping=data[slots],
                             max_query_len=max(batch.num_new_tokens))
        if states is not None:
            ctx.state_slots = data[states]
        if dt_clamp is not None:
            ctx.dt_clamp = data[dt_clamp].bool()
        if groups_at:
            ctx.kv_groups = (torch.stack([data[t].view(b, width) for t, _ in groups_at]).int(),
                             torch.stack([data[s] for _, s in groups_at]))
        if self.lora_manager is not None:  # the slots on the host decide the plan; their copy came with the rest
            ctx.lora = self.lora_manager.make_batch(host.lora_slots, data[lora], groups and LoRAGroups(
                data[groups[0]], data[groups[1]], groups[2]))
        if sampling is not None:
            sampling.load(data, self.device)
        if prompt is not None:  # (flat indices of the hidden rows, the prompt tokens they predict, whose they are)
            prompt = (data[prompt[0]], data[prompt[1]], host.plp_segments)
        every = host.sample == list(range(len(host.ids)))  # a decode step samples its rows as they are: no gather
        return input_ids, data[pos], ctx, rows, None if every else data[last], sampling, prompt

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                num_new_tokens: list[int]) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(num_new_tokens, ctx):
            return self.graphs.run(input_ids, positions, ctx)
        if self.pieces is not None and self.pieces.fits(input_ids.shape[0]):
            return self.pieces.run(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: StepHandle | None = None, settle=None) -> StepHandle:
        """Run the model and sample on the device, start copying the sampled tokens to the host, and return without
        waiting for the device. `prev`: the step before, whose tokens may still be pending on the host. `settle`:
        completes `prev` on the host (LLMEngine.step); called, once the forward is queued, when a row's mask reads
        the token `prev` sampled (a grammar, a bad word of several tokens), so that the host waits for `prev` and
        fills that mask while the device runs this step's forward."""
        input_ids, positions, ctx, rows, idx, sampling, prompt = self.prepare(batch, self.order(batch), prev)
        hidden = self.forward(input_ids, positions, ctx, batch.num_new_tokens)
        # (the prompt logprobs go to the host chunk by chunk: `event` marks the last copy)
        host_lp, event = self._prompt_logprobs(hidden, prompt) if prompt is not None else (None, None)
        if not rows and host_lp is None:
            return StepHandle([], {}, None, None, None)
        sampled = None
        if rows:
            logits = self.model.compute_logits(hidden if idx is None else hidden.index_select(0, idx))
            if sampling.late:
                settle()
                sampling.settle(self.vocab_size, self.device)
            sampled = self.sampler.sample(logits, [batch.seqs[i] for i in rows], sampling)
        (host,), sampled_event = _copy_to_host(sampled.packed if sampled else None)
        event = sampled_event or event  # (recorded after the prompt logprobs' copies, on the same stream)
        return StepHandle(rows, {batch.seqs[i].request_id: r for r, i in enumerate(rows)}, sampled, host, event,
                          (prompt[2], host_lp) if prompt is not None else None)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt):
        """([m, 3 + 2k] float64 on the host, the event that marks its last copy or None) for the m prompt positions
        of `prompt` (from prepare): the token, its logprob under the model's raw distribution, its rank (vLLM's: the
        tokens at least as likely, itself included), then the k most likely ids and their logprobs (k: the largest
        prompt_logprobs among the rows). memory.sizes.prompt_logprob_rows positions at a time, each chunk's rows
        copied to the host before the next is computed: the device never holds more than the sampler rows of
        max_num_seqs sequences (what the memory plan holds room for), whatever the prompt's length and k. With
        vLLM's whole vocabulary (prompt_logprobs -1) the results of a 8,192-token chunk were [8192, 2 x vocab]
        float64 on the device, twice (concatenated), past any plan."""
        where, targets, segments = prompt
        k = max(seq.params.prompt_logprobs for seq, _ in segments)
        step = prompt_logprob_rows(self.vocab_size, k, self.config.max_num_seqs)
        m, cuda = where.shape[0], self.device.type == "cuda"
        host = torch.empty((m, 3 + 2 * k), dtype=torch.float64, pin_memory=cuda)
        for s in range(0, m, step):
            logits = self.model.compute_logits(hidden.index_select(0, where[s:s + step]))
            logp = logits.float().log_softmax(-1)
            del logits
            t = targets[s:s + step].unsqueeze(1)
            lp = logp.gather(1, t)
            rows = torch.empty((t.shape[0], 3 + 2 * k), dtype=torch.float64, device=logp.device)
            rows[:, 0:1], rows[:, 1:2], rows[:, 2:3] = t, lp, token_ranks(logp, lp)
            if k:
                vals, ids = logp.topk(k, -1)
            del logp
            if k:
                rows[:, 3:3 + k], rows[:, 3 + k:] = ids, vals
                del vals, ids
            host[s:s + t.shape[0]].copy_(rows, non_blocking=cuda)  # (its memory is reused after the copy: the
            # allocator hands it out again in stream order)
            del rows, lp, t  # (before the next chunk's logits: held, its results (16 bytes a top entry) and, with
            # no top entries, its log-softmax were beside the next chunk's peak, past prompt_logprob_row_bytes)
        if not cuda:
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event

    @torch.inference_mode()
    def verify(self, batch: ScheduledBatch) -> dict[int, tuple[list[int], list, int]]:
        """A speculative decoding step, run to the end: {index in batch: (tokens, logprob records, drafts accepted)}
        for the sequences that sample. A sequence with drafts (Sequence.draft_token_ids) gets its accepted drafts
        and one token of the target's own (Sampler.sample_speculative); the others one token, as `run` gives."""
        order = self.order(batch)
        input_ids, positions, ctx, rows, idx, sampling, prompt = self.prepare(batch, order)
        hidden = self.forward(input_ids, positions, ctx, batch.num_new_tokens)
        if getattr(self.draft, "collect", None) is not None:  # EAGLE: the head keeps the target's states (engine.eagle)
            if getattr(self.model, "aux_layers", ()):  # EAGLE-3's aux states
                aux, self.model.aux_hidden = self.model.aux_hidden, None
            else:  # EAGLE-1's: the last hidden state (after the final norm)
                aux = [hidden]
            self.draft.collect(batch, order, aux)
        if prompt is not None:
            host_lp, event = self._prompt_logprobs(hidden, prompt)
            if event is not None:
                event.synchronize()
            _append_prompt_logprobs(prompt[2], host_lp.tolist())
        if not rows:
            return {}
        seqs = []
        for i in rows:
            seq = batch.seqs[i]
            seqs.extend([seq] * (len(seq.draft_token_ids) + 1))
        logits = self.model.compute_logits(hidden if idx is None else hidden.index_select(0, idx))
        drafts = sampling.drafts  # (copied with the step's inputs)
        if drafts is None:
            drafts = torch.full((len(seqs),), -1, dtype=torch.long, device=logits.device)
        sampled, accepted = self.sampler.sample_speculative(logits, seqs, sampling, drafts)
        packed = sampled.packed  # the tokens (and logprobs) and whether each row accepted its draft: one copy back
        host = torch.cat([packed.reshape(len(seqs), -1), accepted.view(-1, 1).to(packed.dtype)], 1).cpu()
        tokens, records = sampled.decode(host[:, :-1] if packed.dim() == 2 else host[:, 0])
        accepted, out, at = host[:, -1].tolist(), {}, 0
        for i in rows:
            k = len(batch.seqs[i].draft_token_ids)
            m = next((j for j in range(k) if not accepted[at + j]), k)  # the drafts accepted
            out[i] = (tokens[at:at + m + 1], records[at:at + m + 1], m)
            at += k + 1
        return out

    @torch.inference_mode()
    def pool(self, batch: ScheduledBatch, pooler: Pooler) -> dict[int, torch.Tensor]:
        """A pooling step (--runner pooling), run to the end: {index in batch: pooled float32 vector} for the
        sequences whose prompt it completes (pooling.pool_rows; a classifier's: its logits, classify.score_rows);
        nothing is sampled."""
        order = self.order(batch)
        input_ids, positions, ctx, *_ = self.prepare(batch, order)
        hidden = self.forward(input_ids, positions, ctx, batch.num_new_tokens)
        return score_rows(self.model, pool_rows(hidden, batch.seqs, batch.num_new_tokens, order, pooler), pooler)

    def run(self, batch: ScheduledBatch) -> dict[int, tuple[int, dict | None]]:
        """Returns {index in batch: (token, logprob record)} for the sequences whose prompt is now complete."""
        return self.launch(batch).result()


class HostInputs:
    """A step's integer inputs, gathered on the host sequence by sequence."""

    def __init__(self, block_size: int, groups: int = 0):
        """`groups`: the KV layer groups past the first (engine.hybrid_blocks), whose tables and slots are kept too."""
        self.bs = block_size
        self.group_tables: list[list[list[int]]] = [[] for _ in range(groups)]
        self.group_slots: list[list[int]] = [[] for _ in range(groups)]
        self.ids, self.pos, self.slots, self.lens, self.last, self.lora_slots = [], [], [], [], [], []
        self.tables: list[list[int]] = []
        self.states: list[int] | None = None  # a hybrid model's state slot of each sequence (ModelRunner.prepare)
        # a clamping time_step_limit (ModelRunner.clamps_dt): whether each token is the prompt's, and whether that
        # differs anywhere from "a prefill's tokens are, a decode's is not" (then the step sends it: ctx.dt_clamp)
        self.dt_clamp: list[bool] | None = None
        self.dt_clamp_needed = False
        self.sample: list[int] = []  # flat index of the last token of each sequence that samples
        self.fill: list[int] = []  # pairs: flat index, row of the previous step's sampled tokens
        # prompt_logprobs: the flat index of each hidden row that predicts a prompt token, that token, and per
        # sequence (seq, how many of them)
        self.plp_rows: list[int] = []
        self.plp_tokens: list[int] = []
        self.plp_segments: list[tuple] = []

    def add_prompt_logprobs(self, seq, n: int) -> None:
        """The prompt positions t whose logprob the chunk [start, start + n) of `seq` (added next) gives: the hidden
        row of position t - 1 predicts token t, for the prompt's tokens 1..P-1 not asked for before."""
        start, prompt = seq.num_computed_tokens, seq.prompt_token_ids
        lo, hi = max(start + 1, seq.prompt_lp_next), min(start + n, len(prompt) - 1) + 1
        if lo >= hi:
            return
        base = len(self.ids) - start - 1
        self.plp_rows.extend(range(base + lo, base + hi))
        self.plp_tokens.extend(prompt[lo:hi])
        self.plp_segments.append((seq, hi - lo))
        seq.prompt_lp_next = hi

    def add(self, seq, n: int, prev: StepHandle | None) -> None:
        start, table, bs = seq.num_computed_tokens, seq.block_table, self.bs
        if seq.num_pending and start + n > len(seq) - seq.num_pending:
            assert prev is not None and seq.num_pending == 1, "a pending token without the step that made it"
            self.fill += (len(self.ids) + n - 1, prev.row_of[seq.request_id])
        if seq.draft_token_ids:  # speculative decoding: the drafts follow the last token (they are no tokens of
            k = len(seq.draft_token_ids)  # the sequence until the step accepts them)
            self.ids.extend(seq.tokens(start, start + n - k) + seq.draft_token_ids)
        else:
            self.ids.extend(seq.tokens(start, start + n))
        if n == 1:  # a decode: no per-token loop
            self.pos.append(start)
            self.slots.append(table[start // bs] * bs + start % bs)
        else:
            self.pos.extend(range(start, start + n))
            self.slots.extend([table[p // bs] * bs + p % bs for p in range(start, start + n)])
        self.lens.append(start + n)
        self.last.append(len(self.ids) - 1)
        if self.states is not None:
            self.states.append(seq.state_slot)
        if self.dt_clamp is not None:
            prompt = len(seq.prompt_token_ids)
            self.dt_clamp.extend(start + j < prompt for j in range(n))
            # (a prompt's token alone, or a chunk past the prompt: a recomputation's, a speculative step's)
            self.dt_clamp_needed |= start < prompt if n == 1 else start + n > prompt
        self.tables.append(table)
        for view, tables, slots in zip(seq.kv_views if self.group_tables else (), self.group_tables,
                                       self.group_slots):
            tables.append(view.block_table)
            slots.extend([view.block_table[p // bs] * bs + p % bs for p in range(start, start + n)])


def _copy_to_host(*tensors):
    """((host tensors), event): a non-blocking copy of each (None: none) into pinned memory; the event marks the
    end of the last."""
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type == "cpu":
        return tensors, None
    hosts = []
    for t in tensors:
        if t is None:
            hosts.append(None)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    event = torch.cuda.Event()
    event.record()
    return tuple(hosts), event


@dataclass
class StepHandle:
    """A launched step: its sampled tokens on the device and their copy to the host, maybe still under way."""

    rows: list[int]  # index in the batch of each sampled row
    row_of: dict[str, int]  # request id -> row (where the next step finds a pending input token)
    sampled: SampledBatch | None
    host: torch.Tensor | None
    event: object = None
    prompt: tuple | None = None  # ([(seq, positions)], host [m, 3 + 2k]): the step's prompt logprobs

    def result(self) -> dict[int, tuple[int, dict | None]]:
        """Wait for the copy; {index in batch: (token, logprob record)}. The step's prompt logprobs are appended
        to their sequences' records (once)."""
        if not self.rows and self.prompt is None:
            return {}
        if self.event is not None:
            self.event.synchronize()
        if self.prompt is not None:
            (segments, host), self.prompt = self.prompt, None
            _append_prompt_logprobs(segments, host.tolist())
        if not self.rows:
            return {}
        tokens, records = self.sampled.decode(self.host)
        return {i: (t, r) for i, t, r in zip(self.rows, tokens, records)}


def _append_prompt_logprobs(segments: list[tuple], rows: list[list[float]]) -> None:
    """Each sequence's share of the step's prompt logprob rows (see ModelRunner._prompt_logprobs), as records like
    the generated tokens' (with the rank vLLM gives)."""
    k_all = (len(rows[0]) - 3) // 2 if rows else 0
    at = 0
    for seq, count in segments:
        k = seq.params.prompt_logprobs
        for row in rows[at:at + count]:
            rec = {"token_id": int(row[0]), "logprob": row[1], "rank": int(row[2])}
            if k:
                rec["top_logprobs"] = [{"token_id": int(row[3 + j]), "logprob": row[3 + k_all + j]} for j in range(k)]
            seq.prompt_logprobs.append(rec)
        at += count
