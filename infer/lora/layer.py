"""LoRA on one MergedLinear for a batch whose tokens use different adapters (the step's map: lora.batch).

A `LoRALayer` holds, for every device slot, the stacked and zero-padded weights of the layer's shards:
`lora_a` [max_loras, n_shards * max_rank, in] (shard i's A in rows i*max_rank..) and `lora_bt`, one flat buffer
holding every shard's B^T [max_loras, max_rank, out_i] shard after shard (so that one expand launch reaches every
shard from one pointer, and each slot's B^T is a contiguous row-major block); `lora_b[i]` [max_loras, out_i,
max_rank] is shard i's B as a view of it. `scalings` [n_shards, max_loras] float32 (per module, since rank_pattern /
alpha_pattern may differ between modules) and `rank_t` [n_shards, max_loras] int32 (0 = not targeted) live on the
device, so that the kernels skip the zero padding of smaller ranks. On the GPU (and in every CUDA graph) `apply`
is one `kernels.lora_apply`: one shrink launch for every shard and slot, one expand launch into y. While a CUDA
graph is captured (decode steps), `apply_beside` puts the shrink on a second stream beside the base matmul: the
graph gets two branches that the GPU runs at once, so the shrink's few latency-bound programs take SMs the matmul
leaves waiting on memory instead of a slot of their own between two matmuls (`EngineConfig.lora_streams`). The
CPU path skips the shards and rank columns no adapter of the batch uses.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels.lora_reference import LoRADelta
from .adapter import LoRAModule
from .batch import LoRABatch, lora_groups


_SIDE: dict[torch.device, "torch.cuda.Stream"] = {}
DEFER_MAX_TOKENS = 64  # `defers`: the most tokens of a step whose expand the layer's consumer adds


def _streams(device: torch.device):
    """(the current stream, the side stream) of `device` (a test on CPU stands in for both)."""
    return torch.cuda.current_stream(device), side_stream(device)


def _on(stream):
    """The context that makes `stream` current (a test on CPU stands in for it)."""
    return torch.cuda.stream(stream)


def _capturing(x: torch.Tensor) -> bool:
    """Whether x's step is being recorded into a CUDA graph (a test on CPU stands in for it)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The second stream of `device` that every layer's shrink shares (created before any capture: see __init__)."""
    device = torch.device(device)
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


class LoRALayer:
    """The `layer.lora` hook of one MergedLinear: adds every token's adapter delta to the layer's output."""

    def __init__(self, base, max_loras: int, max_rank: int, device, dtype: torch.dtype):
        self.names = list(base.names)
        self.out_sizes = list(base.out_sizes)
        self.offsets = [base.shard_offset(i) for i in range(len(self.out_sizes))]
        self.bounds = self.offsets + [self.offsets[-1] + self.out_sizes[-1]]
        self.in_features, self.max_rank = base.in_features, max_rank
        n = len(self.out_sizes)
        self.lora_a = torch.zeros(max_loras, n * max_rank, base.in_features, dtype=dtype, device=device)
        self.lora_bt = torch.zeros(max_loras * max_rank * self.bounds[-1], dtype=dtype, device=device)
        block = max_loras * max_rank
        self.lora_b = [self.lora_bt[block * off:block * (off + out)].view(max_loras, max_rank, out).transpose(1, 2)
                       for off, out in zip(self.offsets, self.out_sizes)]
        self.scalings = torch.zeros(n, max_loras, dtype=torch.float32, device=device)
        self.rank_t = torch.zeros(n, max_loras, dtype=torch.int32, device=device)
        self.ranks = [[0] * max_loras for _ in range(n)]  # ranks[shard][slot] on the host, 0 = not targeted
        self.host_scalings = [[0.0] * max_loras for _ in range(n)]  # scalings[shard][slot] on the host
        self._plans: dict[tuple[int, ...], tuple[list[int], int]] = {}  # active slots -> (shards, rank)
        # on the int4 kernel path the expand may be added in the matmul's epilogue (`delta`): None where the kernel
        # finds it cheap (gptq_gemm.fuses_lora), True wherever it can, False never (EngineConfig.lora_epilogue)
        self.epilogue: bool | None = None
        # in CUDA graphs, the shrink on a second stream beside the base matmul (`apply_beside`); None: on, False off
        self.streams: bool | None = None
        # with streams: the expand on the second stream too, into a float32 delta that y takes after the matmul
        # (EngineConfig.lora_expand_beside)
        self.expand_beside = False
        # where the base layer's consumer can add the delta (MergedLinear.lora_consumer: the MLP's gate_up and its
        # silu_and_mul, a decode step's qkv and its decode_attention, o_proj and down_proj and the rms_norm after
        # them), leave the expand to it on the GPU in steps of up to DEFER_MAX_TOKENS tokens (`deferred`): to an
        # rms_norm with fused_norm (EngineConfig.lora_expand_in_norm), to the others with fused
        # (EngineConfig.lora_expand_fused)
        self.fused = False
        self.fused_norm = True
        self._probe_hp = torch.empty(1, 1, n * max_rank, device=device)  # a LoRADelta's shape, for `beside`
        if torch.device(device).type == "cuda":
            side_stream(device)

    def shard_modules(self, modules: dict[str, LoRAModule]) -> list[LoRAModule | None]:
        """An adapter's module for each shard (None: not adapted), from its modules by base module path. A fused
        module (Phi-3's qkv_proj, whose shards all carry its name) gives each shard its A and the rows of its B
        that are the shard's outputs: the same delta, shard by shard."""
        out: list[LoRAModule | None] = []
        for i, name in enumerate(self.names):
            m = modules.get(name)
            if m is not None and self.names.count(name) > 1:
                start = self.offsets[i] - self.offsets[self.names.index(name)]
                m = LoRAModule(m.name, m.layer, m.proj, m.lora_a, m.lora_b[start:start + self.out_sizes[i]],
                               m.scaling)
            out.append(m)
        return out

    def set_slot(self, slot: int, modules: list[LoRAModule | None]) -> None:
        """Load one adapter's modules for this layer's shards (None = the adapter does not target that shard).

        Each piece is assembled zero-padded on the host and copied whole: on a GPU from pinned memory without
        waiting (a copy from pageable memory would synchronise the stream, draining the step in flight whenever an
        adapter is swapped in). The copies are queued behind that step, which never reads this slot: only slots of
        adapters no request pins are overwritten."""
        mr, dev = self.max_rank, self.lora_a.device
        changed = [i for i, m in enumerate(modules) if m is not None or self.ranks[i][slot]]
        if not changed:
            return
        self._plans.clear()
        pin = dev.type == "cuda"
        a = torch.zeros(len(modules) * mr, self.in_features, dtype=self.lora_a.dtype, pin_memory=pin)
        for i, m in enumerate(modules):
            if m is not None:
                a[i * mr:i * mr + m.rank].copy_(m.lora_a)
        self.lora_a[slot].copy_(a, non_blocking=pin)
        for i in changed:
            m = modules[i]
            bt = torch.zeros(mr, self.out_sizes[i], dtype=self.lora_bt.dtype, pin_memory=pin)
            if m is not None:
                bt[:m.rank].copy_(m.lora_b.t())
            self.lora_b[i][slot].t().copy_(bt, non_blocking=pin)  # slot's B^T of shard i: a contiguous block
            self.ranks[i][slot] = 0 if m is None else m.rank
            self.host_scalings[i][slot] = 0.0 if m is None else m.scaling
        # the small per-(shard, slot) tables are copied whole from their host copies (contiguous destinations)
        self.scalings.copy_(torch.tensor(self.host_scalings, dtype=torch.float32, pin_memory=pin), non_blocking=pin)
        self.rank_t.copy_(torch.tensor(self.ranks, dtype=torch.int32, pin_memory=pin), non_blocking=pin)

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, [None] * len(self.out_sizes))

    def targets(self, slot: int) -> bool:
        return any(r[slot] for r in self.ranks)

    def delta(self, x: torch.Tensor, batch: LoRABatch):
        """The shrink of every shard and slot (one launch), kept for the layer's int4 matmul to expand in its
        epilogue (a kernels.lora_reference.LoRADelta); None when no active adapter targets this layer."""
        if not batch.static and not self._plan(batch)[0]:
            return None
        return kernels.lora_delta(x, self.lora_a, self.lora_bt, self.scalings, self.bounds, batch.groups,
                                  self.rank_t, batch.token_slots, self.epilogue)

    def _plan(self, batch: LoRABatch) -> tuple[list[int], int]:
        """(the shards some active adapter targets, the largest rank among them), cached per set of slots."""
        plan = self._plans.get(batch.active_slots)
        if plan is None:
            shards = [i for i, ranks in enumerate(self.ranks) if any(ranks[s] for s in batch.active_slots)]
            rank = max((self.ranks[i][s] for i in shards for s in batch.active_slots), default=0)
            plan = self._plans[batch.active_slots] = (shards, rank)
        return plan

    def apply(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """y[t] += sum over shards i of scaling_i * x[t] @ A_i[slot_t]^T @ B_i[slot_t]^T, in place."""
        if batch.static:
            self._apply_all(x, y, batch)
            return
        shards, rank = self._plan(batch)
        if not shards:
            return
        if kernels.use_triton(y) or (len(shards) == len(self.out_sizes) and rank == self.max_rank):
            self._apply_all(x, y, batch)  # (the Triton kernels skip unused shards and rank rows by themselves)
            return
        # CPU, only some shards or a smaller rank in use: shrink just those columns
        mr, groups = self.max_rank, batch.groups
        parts = [kernels.lora_shrink(x, self.lora_a[:, i * mr:i * mr + rank], groups) for i in shards]
        for i, h_i in zip(shards, parts):
            b = self.lora_b[i] if rank == mr else self.lora_b[i][:, :, :rank]
            kernels.lora_expand(h_i, b, groups, self.scalings[i], y, self.offsets[i])

    def _apply_all(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        kernels.lora_apply(x, y, self.lora_a, self.lora_bt, self.scalings, self.bounds, batch.groups, self.rank_t)

    def beside(self, base, x: torch.Tensor) -> bool:
        """Whether `base`'s forward of x runs `apply_beside`: on the GPU while a CUDA graph is captured, unless
        switched off or the int4 kernel adds the expand in its epilogue (it then needs the shrink first)."""
        if self.streams is False or not _capturing(x):
            return False
        if not self.takes_delta(base):
            return True
        probe = LoRADelta(self._probe_hp, self.lora_bt, None, self.scalings, self.rank_t, list(self.bounds), None,
                          self.epilogue)
        return not base.method.lora_in_epilogue(base, x.reshape(-1, x.shape[-1]).shape[0], probe)

    def apply_beside(self, base, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """base's y = x W^T (+ b) plus every token's adapter delta, with the shrink on the side stream beside the
        base matmul (two branches of the graph being captured), joined before the expand adds the delta into y.
        With `expand_beside` the side stream also runs the expand, into a zeroed float32 delta [T, N], and the main
        stream adds it to y after the join (one elementwise add instead of the expand on the main stream; the same
        result bit for bit: y + the float32 sum, rounded once). hp and delta are allocated on the main stream, which
        frees them only after the join, so no block is reused early."""
        from ..kernels import lora_ops
        main, side = _streams(x.device)
        hp = lora_ops.partials_for(x, self.lora_a)
        delta = torch.empty(x.shape[0], self.bounds[-1], dtype=torch.float32, device=x.device) \
            if self.expand_beside else None
        gather = lora_ops.gathers(x.shape[0])  # the expand as a gather: the partials by token
        side.wait_stream(main)  # fork: x and this step's adapter map are ready
        with _on(side):
            lora_ops.shrink(x, self.lora_a, len(self.out_sizes), batch.groups, self.rank_t, by_token=gather, out=hp)
            if delta is not None:
                delta.zero_()
                self._expand(hp, delta, batch.token_slots, batch.groups, gather)
        y = base.method.apply(base, x)
        main.wait_stream(side)  # join
        if delta is None:
            self._expand(hp, y, batch.token_slots, batch.groups, gather)
        else:
            y.add_(delta)
        return y

    def _expand(self, hp, y, token_slots, groups, gather: bool, compile_only: bool = False) -> None:
        """The expand of this layer's partials into y: as a gather (partials by token, `lora_ops.expand_gather`) or
        by segments (partials at sorted positions, `lora_ops.expand`)."""
        from ..kernels import lora_ops
        if gather:
            lora_ops.expand_gather(hp, y, self.lora_bt, self.scalings, self.bounds, token_slots, self.rank_t,
                                   compile_only=compile_only)
        else:
            lora_ops.expand(hp, y, self.lora_bt, self.scalings, self.bounds, groups, self.rank_t,
                            compile_only=compile_only)

    def defers(self, base, x: torch.Tensor) -> bool:
        """Whether base's `forward_deferred` of x leaves the expand to y's consumer (`deferred`): on the Triton path,
        for a step of at most DEFER_MAX_TOKENS tokens. The consumer reads B once per row, where the expand reads it
        once per tile of a slot's rows: for longer steps (prefills, whose rows share adapters) the expand stays."""
        return self._defers_some(base) and kernels.use_triton(x) \
            and x.reshape(-1, x.shape[-1]).shape[0] <= DEFER_MAX_TOKENS

    def deferred(self, base, x: torch.Tensor, batch: LoRABatch):
        """(base's y = x W^T (+ b) without the adapters, their delta as a LoRADelta by token) for y's consumer to add
        (silu_and_mul, decode_attention, rms_norm): the layer's shrink, and no expand launch. While a CUDA graph is
        captured (streams on), the shrink runs on the side stream beside the base matmul, joined before y is
        returned. (base's y, None) when no active adapter targets the layer."""
        from ..kernels import lora_ops
        if not batch.static and not self._plan(batch)[0]:
            return base.method.apply(base, x), None
        n = len(self.out_sizes)
        if self.streams is not False and _capturing(x):
            main, side = _streams(x.device)
            hp = lora_ops.partials_for(x, self.lora_a)  # allocated on the main stream, which reads it last
            side.wait_stream(main)  # fork: x and this step's adapter map are ready
            with _on(side):
                lora_ops.shrink(x, self.lora_a, n, batch.groups, self.rank_t, by_token=True, out=hp)
            y = base.method.apply(base, x)
            main.wait_stream(side)  # join
        else:
            hp = lora_ops.shrink(x, self.lora_a, n, batch.groups, self.rank_t, by_token=True)
            y = base.method.apply(base, x)
        return y, LoRADelta(hp, self.lora_bt, batch.token_slots, self.scalings, self.rank_t, list(self.bounds),
                            batch.groups, False)

    def takes_delta(self, base) -> bool:
        """Whether `base` (this hook's MergedLinear, whose forward asks) hands the shrink to its linear method's
        kernel (`delta`: the expand in the int4 matmul's epilogue, or launched by it) instead of calling `apply`."""
        return self.epilogue is not False and bool(getattr(base.method, "fuses_lora", None)) \
            and base.method.fuses_lora(base)

    # ------------------------------------------------------------------------------------------ engine start

    def compile_key(self, base) -> tuple:
        """Layers with equal keys launch the same shrink and expand variants (`compile_calls` of one serves all)."""
        by_token = self.takes_delta(base)
        shape = base.method.kernel_key(base) if by_token else None
        return (tuple(self.lora_a.shape), self.lora_a.dtype, tuple(self.bounds), by_token, self.epilogue, shape,
                self.streams is not False, self.expand_beside, self._defers_some(base),
                getattr(base.lora_consumer, "window", 0))  # (a sliding-window layer's decode attention)

    def _defers_some(self, base) -> bool:
        """Whether some steps leave base's expand to its consumer: where the model has one (lora_consumer) and it is
        switched on (fused_norm for an rms_norm consumer, fused for the others), unless every expand goes to the int4
        epilogue (lora_epilogue)."""
        every_epilogue = self.epilogue is True and self.takes_delta(base)
        consumer = base.lora_consumer
        return consumer is not None and not every_epilogue \
            and (self.fused_norm if getattr(consumer, "into_norm", False) else self.fused)

    def compile_calls(self, base, max_tokens: int) -> list:
        """Callables that each compile (Triton's `warmup`: nothing is launched) shrink and expand variants this
        layer can launch for a step of 1..max_tokens tokens, so that none compiles on a user's request: an engine
        start runs them in parallel (`gptq_tune.compile_parallel`). The variants depend on the token count only
        through `lora_ops.plan_key` (and the gather expand's through `lora_ops.gather_tiles`); the expand is compiled
        where it is a launch of its own, i.e. everywhere on the `apply` path, and on the `delta` path only for the
        token counts whose int4 kernel does not add it in its epilogue (`method.lora_in_epilogue`)."""
        from ..kernels import lora_ops
        num_slots, nr, k = self.lora_a.shape
        by_token = self.takes_delta(base)
        if by_token:
            probe = LoRADelta(torch.empty(1, 1, nr, device=self.lora_a.device), self.lora_bt, None, self.scalings,
                              self.rank_t, list(self.bounds), None, self.epilogue)
            expands = lambda t: not base.method.lora_in_epilogue(base, t, probe)  # noqa: E731
        else:
            expands = lambda t: True  # noqa: E731
        longer = (lambda t: t > DEFER_MAX_TOKENS) if self._defers_some(base) else (lambda t: True)
        shrinks = lora_ops.plan_tokens(max_tokens, num_slots, k, longer)
        with_expand = set(lora_ops.plan_tokens(max_tokens, num_slots, k, lambda t: longer(t) and expands(t)))
        # and one token count per shape of the gather expand (INFER_LORA_EXPAND=gather): `plan_key` ignores them
        gathered = set(lora_ops.gather_tokens(max_tokens, nr // len(self.out_sizes)))
        with_expand |= {t for t in gathered if longer(t) and expands(t)}
        calls = [lambda t=t: self._compile(t, by_token, t in with_expand)
                 for t in sorted(set(shrinks) | with_expand | gathered)]
        if self._defers_some(base):  # steps of up to DEFER_MAX_TOKENS: the shrink by token, silu_and_mul's variant
            calls += [lambda t=t: self._compile_deferred(base, t)
                      for t in lora_ops.plan_tokens(min(max_tokens, DEFER_MAX_TOKENS), num_slots, k)]
        return calls

    def _compile_deferred(self, base, t: int) -> None:
        from ..kernels import lora_ops
        dev, dtype = self.lora_a.device, self.lora_a.dtype
        x = torch.empty(t, self.in_features, dtype=dtype, device=dev)
        slots = torch.zeros(t, dtype=torch.long, device=dev)
        groups = lora_groups(slots, self.lora_a.shape[0], in_order=True)
        hp = lora_ops.shrink(x, self.lora_a, len(self.out_sizes), groups, self.rank_t, by_token=True,
                             compile_only=True)
        base.lora_consumer(LoRADelta(hp, self.lora_bt, slots, self.scalings, self.rank_t, list(self.bounds), groups,
                                     False))

    def _compile(self, t: int, by_token: bool, expand: bool) -> None:
        from ..kernels import lora_ops
        dev, dtype = self.lora_a.device, self.lora_a.dtype
        x = torch.empty(t, self.in_features, dtype=dtype, device=dev)  # stand-ins with a step's strides
        slots = torch.zeros(t, dtype=torch.long, device=dev)
        groups = lora_groups(slots, self.lora_a.shape[0], in_order=True)
        hp = lora_ops.shrink(x, self.lora_a, len(self.out_sizes), groups, self.rank_t, by_token, compile_only=True)
        gather = lora_ops.gathers(t)
        if expand:
            y = torch.empty(t, self.bounds[-1], dtype=dtype, device=dev)
            if by_token and gather:  # add_delta's gather
                lora_ops.expand_gather(hp, y, self.lora_bt, self.scalings, self.bounds, slots, self.rank_t,
                                       compile_only=True)
            else:
                lora_ops.expand(hp, y, self.lora_bt, self.scalings, self.bounds, groups, self.rank_t,
                                by_token=by_token, compile_only=True)
        if self.streams is not False and (by_token or self.expand_beside or gather):
            # apply_beside's variants (by sorted position, or by token for the gather; the expand into y, or into a
            # float32 delta), first launched while a decode graph is captured: compiled here with the rest
            hs = lora_ops.shrink(x, self.lora_a, len(self.out_sizes), groups, self.rank_t, by_token=gather,
                                 compile_only=True)
            d = torch.empty(t, self.bounds[-1], dtype=torch.float32 if self.expand_beside else dtype, device=dev)
            self._expand(hs, d, slots, groups, gather, compile_only=True)
