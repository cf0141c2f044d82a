"""KV blocks of a model of mixed layers (Gemma 2, Gemma 3, a Qwen2/Qwen3 with max_window_layers): vLLM's
KVCacheGroups and HybridKVCacheCoordinator.

The layers are split into groups of the same number of layers, by kind (models.limits.layer_groups): full attention,
and sliding-window ones. One pool of blocks serves them all, a block holding one group's layers (layer j of a group
in the block's storage slot j: engine.model_runner); a sequence holds a block table per group: the first full
group's is Sequence.block_table, the others' a `GroupSeq` each (Sequence.kv_views). Each group is a BlockManager over
the shared pool (its blocks, free list, prefix map with keys ending in the group's number, fresh and scheduled
lists): a full group keeps every block, a sliding one frees those behind its window (BlockManager.free_behind, the
pool's last block the placeholder). A prefix hit holds for every group: the full groups' longest contiguous hit,
then each sliding group's longest window hit (BlockManager._window_hit) at most that long, the least of them, until
no group shortens it. Admission, growth and preemption count the blocks of every group.
A draft model's or an EAGLE head's KV (engine.draft: a slot in every pool block) is read and written through the
first full group's table, which keeps every block: its catch-up and drafts never read a sliding group's block, so
the sliding groups free behind the target's own next query (their draft_reads off), and the prefix hit, its draft
KV's first stale slot (draft_upto) and the EAGLE head's dropped last block (eagle_reads_next) are the first
group's, which caps the others'. memory.sizes.kv_groups runs such a model with groups where they hold less.
"""

from __future__ import annotations

import copy

from .block_manager import BlockManager
from .sequence import Sequence

_OWN = ("block_table", "num_freed_blocks", "num_hashed_blocks", "last_block_hash")
_SHARED = ("blocks", "free", "hash_to_block", "fresh", "scheduled")


class GroupSeq:
    """A sequence as one more group's manager sees it: a block table and its counts of its own, the rest (tokens,
    computed tokens, parameters) the sequence's."""

    def __init__(self, seq: Sequence):
        object.__setattr__(self, "seq", seq)
        self.block_table: list[int] = []
        self.num_freed_blocks = self.num_hashed_blocks = 0
        self.last_block_hash: bytes | None = None

    def __getattr__(self, name):
        return getattr(self.seq, name)

    def __setattr__(self, name, value):
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.seq, name, value)

    def __len__(self) -> int:
        return len(self.seq)


class HybridBlockManager:
    """The BlockManager interface the scheduler and the engine use, over the groups of `windows` (each group's
    window, 0: full attention; the first is a full one)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, windows: list[int],
                 step_tokens: int = 0):
        assert windows and windows[0] == 0 and any(windows), "groups: a full one first, and a sliding one"
        first = BlockManager(num_blocks, block_size, enable_prefix_caching, window=max(windows),
                             step_tokens=step_tokens)  # (the placeholder: the pool's last block)
        self.groups = []
        for g, window in enumerate(windows):
            m = first if g == 0 else copy.copy(first)
            m.window, m.key_suffix = window, bytes([g]) if g else b""
            m.prefix_queries = m.prefix_hits = m.window_freed = 0
            self.groups.append(m)
        self.windows = list(windows)
        self.block_size, self.step_tokens = block_size, step_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.placeholder = first.placeholder
        self.num_blocks = first.num_blocks
        self.window = max(windows)  # (the sliding groups')
        self.draft_reads = False  # (the sliding groups' stay off: the draft reads the first group's blocks only)

    # (no state snapshots: a model of state slots and layer groups caches no prefix: engine.state_cache)
    snapshots = None

    @staticmethod
    def snapshot_chunk(seq: Sequence, n: int) -> int:
        return n

    @staticmethod
    def snapshot_points(batch) -> tuple[list, list]:
        return [], []

    @staticmethod
    def plan_snapshot(seq: Sequence, n: int) -> None:
        pass

    @staticmethod
    def awaits_snapshot(seq: Sequence) -> bool:
        return False

    @staticmethod
    def name_snapshots() -> None:
        pass

    @property
    def eagle_reads_next(self) -> bool:
        return self.groups[0].eagle_reads_next

    @eagle_reads_next.setter
    def eagle_reads_next(self, value: bool) -> None:  # (the first group's hit caps every group's: _hits)
        self.groups[0].eagle_reads_next = value

    # ------------------------------------------------------------------ shared state
    def _share(self) -> None:
        first = self.groups[0]
        for m in self.groups[1:]:
            for name in _SHARED:
                setattr(m, name, getattr(first, name))

    @property
    def fresh(self) -> list[int]:
        return self.groups[0].fresh

    @fresh.setter
    def fresh(self, value: list[int]) -> None:
        self.groups[0].fresh = value
        self._share()

    @property
    def scheduled(self) -> list[int]:
        return self.groups[0].scheduled

    @scheduled.setter
    def scheduled(self, value: list[int]) -> None:
        self.groups[0].scheduled = value
        self._share()

    @property
    def blocks(self):
        return self.groups[0].blocks

    @property
    def free(self):
        return self.groups[0].free

    @property
    def hash_to_block(self):
        return self.groups[0].hash_to_block

    @property
    def prefix_queries(self) -> int:
        return self.groups[0].prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.groups[0].prefix_hits

    @property
    def window_freed(self) -> int:
        return sum(m.window_freed for m in self.groups)

    def prefix_cache_hit_rate(self) -> float:
        return self.groups[0].prefix_cache_hit_rate()

    # ------------------------------------------------------------------ per sequence
    def views(self, seq: Sequence) -> list:
        """seq as each group sees it (the first group: seq itself)."""
        views = seq.__dict__.get("kv_views")
        if views is None:
            views = seq.kv_views = [GroupSeq(seq) for _ in self.groups[1:]]
        return [seq, *views]

    def _pairs(self, seq: Sequence, first_last: bool = True):
        """(group, view) of every group, the first group last (it sets the sequence's own counts last)."""
        pairs = list(zip(self.groups, self.views(seq)))
        return pairs[1:] + pairs[:1] if first_last else pairs

    # ------------------------------------------------------------------ accounting
    @property
    def num_free_blocks(self) -> int:
        return len(self.groups[0].free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return self.groups[0].blocks_needed(num_tokens)

    def window_cap(self, num_tokens: int) -> int:
        """The most blocks of the pool a sequence of up to num_tokens tokens holds at once: every group's."""
        return sum(m.window_cap(num_tokens) for m in self.groups)

    def free_behind(self, seq: Sequence) -> None:
        for m, view in self._pairs(seq):
            if m.window:
                m.free_behind(view)

    # ------------------------------------------------------------------ admission
    def _hits(self, seq: Sequence) -> list[list[int | None]] | None:
        """Each group's prefix hit, all of the same length (None: the sequence does not read the cache)."""
        first = self.groups[0]
        if not first._reads_cache(seq):
            return None
        views = self.views(seq)
        contiguous = first._cached_prefix(seq)
        k = len(contiguous)
        while True:
            hits = [contiguous[:k]]
            for m, view in zip(self.groups[1:], views[1:]):
                hits.append(self._group_hit(m, view, k))
            shortest = min(len(h) for h in hits)
            if shortest == k:
                return hits
            k = shortest

    def _group_hit(self, m: BlockManager, view, cap: int) -> list[int | None]:
        """Group m's longest prefix hit of at most `cap` blocks."""
        found = []
        for i in range(min(cap, (len(view) - 1) // self.block_size)):
            bid = m._cached_block(view, i)
            if bid is None:
                break
            found.append(bid)
        if m.window and len(found) < cap:
            hit = m._window_hit(view, len(found), cap)
            if hit is not None:
                return hit
        return found

    def _force(self, seq: Sequence) -> None:
        hits = self._hits(seq)
        for i, m in enumerate(self.groups):
            m.forced = [] if hits is None else hits[i]

    def _unforce(self) -> None:
        for m in self.groups:
            m.forced = None

    def can_allocate(self, seq: Sequence, reserve: int = 0, budget: int | None = None) -> bool:
        self._force(seq)
        try:
            need = sum(m.blocks_to_take(view, budget) for m, view in self._pairs(seq))
        finally:
            self._unforce()
        return need <= self.num_free_blocks - reserve

    def allocate(self, seq: Sequence, budget: int | None = None) -> None:
        self._force(seq)
        try:  # every group's hits off the free list before any group takes a free block (which may be one)
            tokens = [(m, view, m.claim(view, budget)) for m, view in self._pairs(seq)]
        finally:
            self._unforce()
        for m, view, n in tokens:
            for _ in range(m.blocks_needed(n) - len(view.block_table)):
                view.block_table.append(m._take_free())

    # ------------------------------------------------------------------ growth
    def slots_needed(self, seq: Sequence, num_tokens: int) -> int:
        return sum(m.slots_needed(view, num_tokens) for m, view in self._pairs(seq))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for m, view in self._pairs(seq):
            m.grow(view, num_tokens)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        for m, view in self._pairs(seq):
            m.shrink(view, num_tokens)

    def register_scheduled(self, seq: Sequence, num_new_tokens: int, batched: bool = False) -> None:
        for m, view in self._pairs(seq):
            m.register_scheduled(view, num_new_tokens, batched)

    def forget_scheduled(self, seqs) -> None:
        if not self.scheduled:
            return
        seqs = list(seqs)
        gone = self.scheduled
        for g, m in enumerate(self.groups):
            m.scheduled = gone  # (each group takes back its own sequences' blocks)
            m.forget_scheduled([self.views(s)[g] for s in seqs])
        self._share()
        for seq in seqs:  # (the least of the groups' computed tokens holds for every group)
            for view in self.views(seq):
                view.num_hashed_blocks = min(view.num_hashed_blocks, seq.num_computed_tokens // self.block_size)

    def register_computed(self, seq: Sequence) -> None:
        for m, view in self._pairs(seq):
            m.register_computed(view)

    def drafts_written(self, seqs) -> None:
        self.groups[0].drafts_written(seqs)

    # ------------------------------------------------------------------ release
    def free_seq(self, seq: Sequence) -> None:
        for m, view in self._pairs(seq):
            m.free_seq(view)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for m, pv, cv in zip(self.groups[1:], self.views(parent)[1:], self.views(child)[1:]):
            m.fork(pv, cv)
        self.groups[0].fork(parent, child)

    def reset_prefix_cache(self, counters: bool = True, in_use: bool = False) -> None:
        self.groups[0].reset_prefix_cache(counters, in_use)
        self._share()
        if counters:
            for m in self.groups:
                m.prefix_queries = m.prefix_hits = 0
