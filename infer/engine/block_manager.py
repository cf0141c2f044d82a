"""Paged KV blocks: a free list, reference counts, and automatic prefix caching.

A full block is identified by a chained hash of its token ids (SHA-256 of the previous block's hash and its own
ids), confirmed by comparing the ids. A block is registered in the cache when a step is scheduled to complete its K/V
(as vLLM's allocate_slots caches the full blocks of the tokens scheduled): a request admitted later in the same step
with the same prefix finds it and computes only its tail, reading K/V the same forward writes (each layer writes all
the step's keys and values before its attention reads them). Freed blocks keep their hash and sit in an LRU free
list, so a later request with the same prefix finds them until their space is needed; freed blocks without a hash
are reused first.

Sliding-window models (`window` > 0: every attention layer attends over the same last `window` keys, Mistral,
Phi-3, a Qwen2/Qwen3 whose layers all slide) keep only the blocks a future query can read (vLLM's sliding-window
KV cache manager): a running sequence's block whose last position is before its first future query's position
minus window - 1 (the kernels and the CPU reference read the keys kv > q - window only) goes back to the pool, as a
finished sequence's does (cached ones keep their hash, evictable), and its table entry points at the placeholder
block, a block of the cache no sequence is given (zeroed, never written), so that tables keep their shape. Admission
gives a windowed sequence blocks only for the tokens its first step can compute (`admit_tokens`), so a sequence
holds at most `window_cap` blocks at once whatever its length. A prefix-cache hit of such a model needs only the
blocks a query after it reads (vLLM's sliding-window find_longest_cache_hit): it runs past blocks evicted before its
window, their entries the placeholder (`_window_hit`).
"""

from __future__ import annotations

import gc
import hashlib
from array import array
from collections import OrderedDict

from ..memory.sizes import window_blocks
from .sequence import Sequence

ROOT = hashlib.sha256(b"infer prefix cache").digest()  # the chain's first link for requests without an adapter


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "draft_upto")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        # draft-model speculation: in a cached block whose draft KV the sequence that freed it had not fully written
        # (its last accepted draft, fed only the step after), the slots it had; None: all (a prefix hit feeds the
        # draft from the first slot it lacks)
        self.draft_upto: int | None = None


def new_blocks(n: int) -> list[Block]:
    """Blocks 0..n-1, made with the garbage collector paused: a cache of 10^5-10^6 blocks is as many new objects,
    whose allocation set off collections of every generation, each scanning the whole process (0.13-0.48 s for
    393,600 blocks in a process of 1.5M objects, 0.085 s paused). Blocks refer to no other object: nothing of theirs
    is garbage to collect."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        return [Block(i) for i in range(n)]
    finally:
        if was_on:
            gc.enable()


def chain_hash(prev: bytes | None, token_ids) -> bytes:
    """A full block's key: SHA-256 of the key before it (`ROOT` for the first block) and the block's token ids.
    Collision resistant, as vLLM's (sha256): Python's hash() of a tuple of token ids is a 64-bit function, the same in
    every process and invertible step by step, so a crafted prompt could give its first block the key of another
    prompt's, and its later blocks were then found by requests with that other prefix, with K/V computed after the
    crafted one (only a block's own ids are compared). vLLM's CVE-2025-25183 is this attack on its builtin hash."""
    return hashlib.sha256((ROOT if prev is None else prev) + array("q", token_ids).tobytes()).digest()


def root_hash(seq: Sequence) -> bytes | None:
    """The first link of a sequence's chain: K/V depend on the LoRA adapter, so the adapter (its name and which
    registration of that name, `Sequence.lora_key`) is part of the key; and so is the request's cache_salt (vLLM's:
    only requests of the same salt share blocks)."""
    salt = seq.params.cache_salt
    if seq.lora is None and salt is None:
        return None
    lora = None if seq.lora is None else (seq.lora if seq.lora_key is None else seq.lora_key)
    return hashlib.sha256(repr(("lora", lora) if salt is None else ("lora", lora, "salt", salt)).encode()).digest()


def block_key(seq: Sequence, i: int, block_size: int) -> bytes:
    """The key of the sequence's full block i, computed once per sequence (its full blocks never change: tokens are
    only appended), so that a request waiting for blocks is not hashed again at every step."""
    keys = seq.block_keys
    while len(keys) <= i:
        j = len(keys)
        keys.append(chain_hash(keys[-1] if j else root_hash(seq), seq.tokens(j * block_size, (j + 1) * block_size)))
    return keys[i]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0,
                 step_tokens: int = 0):
        """`window` > 0 (the model's every layer slides over that many keys; at least 2 blocks): the blocks behind
        the window are freed (`free_behind`), the cache's last block is the placeholder and the pool the others.
        `step_tokens`: the most tokens a step computes for one sequence (its chunk and speculative lookahead)."""
        self.block_size = block_size
        self.window = window if num_blocks >= 2 else 0
        self.placeholder = num_blocks - 1 if self.window else -1  # (never handed out, never written)
        num_blocks -= 1 if self.window else 0
        self.num_blocks = num_blocks
        self.step_tokens = step_tokens
        self.draft_reads = False  # draft-model speculation: its KV (in the same blocks) is read from draft_computed
        self.eagle_reads_next = False  # EAGLE: a block's head KV depends on the token after it (_cached_prefix)
        self.window_freed = 0  # blocks freed behind the window of running sequences (stats)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = new_blocks(num_blocks)
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU order
        self.hash_to_block: dict[bytes, int] = {}
        self.fresh: list[int] = [self.placeholder] if self.window else []  # blocks handed out since the runner
        # last zeroed them (the placeholder's once: its contents are never read, zeroed all the same)
        # blocks registered by register_scheduled since the scheduler's last step began: their K/V are this step's
        # (unwritten until its forward runs: a step that fails forgets them, forget_scheduled)
        self.scheduled: list[int] = []
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, found
        # a layer group's (engine.hybrid_blocks): what its keys end with (the groups share one map), and the prefix
        # hit its coordinator found for every group (None: look it up here)
        self.key_suffix = b""
        self.forced: list[int | None] | None = None
        self.states = None  # a hybrid model's state slots (engine.state_cache.StateSlots), taken with the blocks
        # its prefix cache of states (engine.state_cache.StateSnapshots): a hit is cut to a snapshot (None: no cut)
        self.snapshots = None
        self.planned: set[bytes] = set()  # the keys of the prompt states the step being scheduled snapshots

    def _key(self, seq: Sequence, i: int) -> bytes:
        key = block_key(seq, i, self.block_size)
        return key + self.key_suffix if self.key_suffix else key

    # ------------------------------------------------------------------ accounting
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def window_cap(self, num_tokens: int) -> int:
        """The most blocks a sequence of up to num_tokens tokens holds at once: all of them, or with a window the
        blocks of the window, a step's tokens and one more (the window's first block partly before it)."""
        need = self.blocks_needed(num_tokens)
        if not self.window:
            return need
        return min(need, window_blocks(self.window, self.step_tokens, self.block_size))

    # ------------------------------------------------------------------ sliding window
    def first_read(self, seq: Sequence) -> int:
        """The first key position any future query of seq reads: its next query's position (its computed tokens;
        a draft model's, from its draft KV's first stale slot) minus window - 1."""
        start = seq.num_computed_tokens
        if self.draft_reads:
            start = min(start, seq.draft_computed)
        return start - self.window + 1

    def free_behind(self, seq: Sequence) -> None:
        """Free seq's blocks wholly before its window (`first_read`), pointing their table entries at the
        placeholder: nothing reads them any more. Cached blocks keep their hash (a later prefix hit finds them until
        their space is needed), the others are reused first, as free_seq leaves them."""
        if not self.window:
            return
        end = min(max(0, self.first_read(seq)) // self.block_size, len(seq.block_table))
        table, bs = seq.block_table, self.block_size
        for i in range(seq.num_freed_blocks, end):
            bid = table[i]
            block = self.blocks[bid]
            if block.hash is not None:
                upto = seq.draft_computed - i * bs
                block.draft_upto = None if upto >= bs else max(upto, 0)
            table[i] = self.placeholder
            self._release(block)
            self.window_freed += 1
        seq.num_freed_blocks = max(seq.num_freed_blocks, end)

    def _release(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0, "block freed twice"
        if block.ref_count == 0:
            self.free[block.block_id] = None
            if block.hash is None:
                self.free.move_to_end(block.block_id, last=False)

    # ------------------------------------------------------------------ admission
    def _reads_cache(self, seq: Sequence) -> bool:
        """Whether admission looks the sequence up in the prefix cache. A request that wants its prompt's logprobs
        computes every prompt token (as vLLM: cached ones have no logits); so does a per-token pooling request (its
        rows: every token's state)."""
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None and not getattr(seq, "every_token",
                                                                                                 False)

    def _cached_prefix(self, seq: Sequence) -> list[int | None]:
        """`_longest_prefix`, less its last block under EAGLE (`eagle_reads_next`), as vLLM drops it: the head's KV
        at a block's last position pairs it with the next block's first token, which the block's hash does not
        cover. The sequence computes that block again in a block of its own, so the target's states for it feed the
        head with its own next token. A layer group's hit its coordinator found (`forced`) is taken as it is (it
        dropped that block before capping the other groups' hits: engine.hybrid_blocks)."""
        hits = self._longest_prefix(seq)
        if self.eagle_reads_next and hits and self.forced is None:
            hits = hits[:-1]
            while hits and hits[-1] is None:
                hits.pop()
        return hits

    def _longest_prefix(self, seq: Sequence) -> list[int | None]:
        """Block ids of the longest cached prefix; at least one token is always left to compute. With a window the
        prefix may run past an evicted block: only the blocks a query after the hit reads (`_window_hit`) must be
        cached, those before them are None (behind the window, never taken)."""
        if self.forced is not None:
            return self.forced
        if not self._reads_cache(seq):
            return []
        found = self._found(seq)
        if self.window and len(found) < (len(seq) - 1) // self.block_size:
            hit = self._window_hit(seq, len(found))
            if hit is not None:
                return hit
        return found[:self._snapshot_point(seq, len(found))]

    def _found(self, seq: Sequence) -> list[int]:
        """The cached blocks of seq's longest prefix (not its last token's block)."""
        found = []
        for i in range((len(seq) - 1) // self.block_size):
            bid = self._cached_block(seq, i)
            if bid is None:
                break
            found.append(bid)
        return found

    # ------------------------------------------------------------------ a hybrid model's states
    def _snapshot_point(self, seq: Sequence, blocks: int) -> int:
        """How many of seq's first `blocks` cached blocks a prefix hit may take: all without state snapshots; with
        them (a hybrid model) the most whose last block's state is kept (engine.state_cache.StateSnapshots), else 0
        (the linear layers' states start from zero at position 0 only)."""
        if self.snapshots is None:
            return blocks
        while blocks and self._key(seq, blocks - 1) not in self.snapshots:
            blocks -= 1
        return blocks

    def _restore_state(self, seq: Sequence) -> None:
        """Copy the state snapshot at seq's computed tokens (a prefix hit, cut to one) into its state slot."""
        if self.snapshots is not None and seq.num_computed_tokens and seq.state_slot is not None:
            self.snapshots.restore(self._key(seq, seq.num_computed_tokens // self.block_size - 1), seq.state_slot)

    def _snapshot_end(self, seq: Sequence) -> int:
        """The last block boundary of seq's prompt before its last token: its prefill's chunks end there
        (snapshot_chunk), so that a request of the same prompt, which computes its last token at least, finds a
        state (one at the prompt's end when that is block-aligned too, which its extensions find)."""
        return (len(seq.prompt_token_ids) - 1) // self.block_size * self.block_size

    def snapshot_chunk(self, seq: Sequence, n: int) -> int:
        """With state snapshots, the tokens of seq's step of at most n (>= 1) within its prompt cut so that it ends at
        a block boundary where one lies past its computed tokens (vLLM's mamba "align" mode): at the last one before
        the prompt's last token, and a chunk that leaves prompt tokens for later at the last boundary it reaches, so
        that the state after it is a prefix's, kept by `snapshot_points`."""
        if self.snapshots is None:
            return n
        start, bs, last = seq.num_computed_tokens, self.block_size, self._snapshot_end(seq)
        end = start + n
        if start < last < end:
            return last - start
        if end < last and end // bs * bs > start:
            return end // bs * bs - start
        return n

    def snapshot_points(self, batch) -> tuple[list[tuple[int, bytes]], list[tuple[int, Sequence, int]]]:
        """The states to snapshot once the step's forward is queued (`save_snapshots`), of each sequence of the batch
        whose step ends at a block boundary: (state slot, prefix-cache key) within its prompt, (state slot, sequence,
        block) past it (its tokens may still be on the device: keyed once known)."""
        if self.snapshots is None:
            return [], []
        prompt, past, bs = [], [], self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            end = seq.num_computed_tokens + n
            if end % bs or not end or seq.state_slot is None:
                continue
            if end <= len(seq.prompt_token_ids):
                prompt.append((seq.state_slot, self._key(seq, end // bs - 1)))
            else:
                past.append((seq.state_slot, seq, end // bs - 1))
        return prompt, past

    def save_snapshots(self, points) -> None:
        """Snapshot the states at `snapshot_points` (the step's forward is queued), naming those whose tokens the
        host knows."""
        prompt, past = points
        self.snapshots.save(prompt)
        if past:
            self.snapshots.hold(past)
            self.name_snapshots()

    def name_snapshots(self) -> None:
        """Key the snapshots taken past a prompt whose tokens the host knows now (a step's tokens appended)."""
        if self.snapshots is not None and self.snapshots.unnamed:
            self.snapshots.name(self._known_key)

    def _known_key(self, seq: Sequence, i: int) -> bytes | None:
        """The key of seq's full block i, None while one of its tokens is pending (on the device)."""
        return self._key(seq, i) if len(seq) - seq.num_pending >= (i + 1) * self.block_size else None

    def awaits_snapshot(self, seq: Sequence) -> bool:
        """Whether a waiting sequence's prefix hit would reach further from a state the step being scheduled
        snapshots (`planned`: the n samples of a prompt, identical prompts arriving together): it waits a step for
        it rather than computing those tokens again."""
        if not self.planned or not self._reads_cache(seq) or self.forced is not None:
            return False
        found = self._found(seq)
        return any(self._key(seq, j) in self.planned for j in range(self._snapshot_point(seq, len(found)),
                                                                       len(found)))

    def plan_snapshot(self, seq: Sequence, n: int) -> None:
        """The step being scheduled computes n tokens of seq: the prompt state it snapshots (snapshot_points), if
        any, is `planned`."""
        end = seq.num_computed_tokens + n
        if self.snapshots is not None and end and not end % self.block_size and end <= len(seq.prompt_token_ids):
            self.planned.add(self._key(seq, end // self.block_size - 1))

    def _cached_block(self, seq: Sequence, i: int) -> int | None:
        """The cached block holding the sequence's full block i, or None."""
        bid = self.hash_to_block.get(self._key(seq, i))
        if bid is None or self.blocks[bid].token_ids != tuple(seq.tokens(i * self.block_size,
                                                                          (i + 1) * self.block_size)):
            return None
        return bid

    def _window_hit(self, seq: Sequence, contiguous: int, cap: int | None = None) -> list[int | None] | None:
        """A sliding window's longest prefix hit (vLLM's SlidingWindowManager.find_longest_cache_hit): the hit of k
        blocks holds when the blocks from the first one a later query reads (its position k * block_size, or a
        draft model's first stale slot, minus window - 1) to the k-th are all cached, whatever came before them
        (evicted blocks included), of at most `cap` blocks. None where it is no longer than the `contiguous` blocks
        found from the start.
        Blocks registered by the step being scheduled count as misses here: a failed step takes them back
        (forget_scheduled) and the sequence then computes from one of them, reading blocks before it."""
        bs, window = self.block_size, self.window
        scheduled = set(self.scheduled)
        best, best_start, start, stale = 0, 0, None, None
        ids: list[int | None] = []
        most = (len(seq) - 1) // bs
        for i in range(most if cap is None else min(cap, most)):
            bid = self._cached_block(seq, i)
            if bid is not None and bid in scheduled:
                bid = None
            ids.append(bid)
            if bid is None:
                start = None
                continue
            if start is None:
                start, stale = i, None
            upto = self.blocks[bid].draft_upto
            if stale is None and upto is not None:
                stale = i * bs + upto  # (the run's draft KV: its first stale slot, as _admission reads it)
            computed = (i + 1) * bs
            first = min(computed, stale) if self.draft_reads and stale is not None else computed
            if start == 0 or max(0, first - window + 1) // bs >= start:
                best, best_start = i + 1, start
        if best <= contiguous:
            return None
        return [None] * best_start + ids[best_start:best]

    def _admission(self, seq: Sequence, budget: int | None) -> tuple[list[int | None], int, int, int]:
        """(cached prefix blocks, how many of them lie wholly before the window (or were not found there, None):
        never taken, tokens the sequence
        gets blocks for, its draft KV's first stale slot). Without a window every token gets its block; with one only
        those its first step computes (at most `budget`), the rest as its chunks are scheduled (Scheduler._reserve),
        and a cached prefix longer than the window is taken from its window on. Not so when one of the hits was
        registered by the step being scheduled: a failed step takes it back (forget_scheduled) and the sequence then
        computes from it, reading the blocks before it."""
        hits, bs = self._cached_prefix(seq), self.block_size
        computed = draft = len(hits) * bs
        lead = 0  # (leading blocks of a window's hit that were not found: behind its window)
        while lead < len(hits) and hits[lead] is None:
            lead += 1
        for i, bid in enumerate(hits[lead:], lead):
            if self.blocks[bid].draft_upto is not None:
                draft = i * bs + self.blocks[bid].draft_upto
                break
        if not self.window or budget is None:
            return hits, lead, len(seq), draft
        tokens = min(len(seq), computed + max(budget, 1))
        if self.scheduled and not set(hits).isdisjoint(self.scheduled):
            return hits, 0, tokens, draft
        first = min(computed, draft) if self.draft_reads else computed
        return hits, max(lead, min(len(hits), max(0, first - self.window + 1) // bs)), tokens, draft

    def can_allocate(self, seq: Sequence, reserve: int = 0, budget: int | None = None) -> bool:
        """Whether the free blocks hold what `allocate` gives seq (`budget`: the most tokens its first step may
        compute; it matters with a window only)."""
        return self.blocks_to_take(seq, budget) <= len(self.free) - reserve

    def blocks_to_take(self, seq: Sequence, budget: int | None = None) -> int:
        """The free blocks `allocate` takes for seq."""
        hits, drop, tokens, _ = self._admission(seq, budget)
        hits_in_use = sum(1 for b in hits[drop:] if self.blocks[b].ref_count > 0)
        return self.blocks_needed(tokens) - drop - hits_in_use

    def claim(self, seq: Sequence, budget: int | None = None) -> int:
        """`allocate`'s first part: take the sequence's cached prefix blocks (off the free list) and set its counts;
        the tokens it gets blocks for. (Layer groups claim every group's before any takes a free block, which
        could be another group's hit: engine.hybrid_blocks.)"""
        assert not seq.block_table
        hits, drop, tokens, draft = self._admission(seq, budget)
        if not seq.num_preemptions:  # as vLLM: a preempted request's recompute, which finds its own blocks, is
            # neither a query of the hit rate nor its cached tokens (they say what its first admission found)
            if self._reads_cache(seq):  # as vLLM, a request that skips the cache (or every one, with the cache
                self.prefix_queries += len(seq)  # off) is no query
                self.prefix_hits += len(hits) * self.block_size
            # vLLM's meaning: the prompt tokens whose K/V came from the cache (usage's cached_tokens, at most its
            # prompt_tokens): blocks found past the prompt hold the forced prefix_token_ids, which are no prompt
            seq.num_cached_tokens = min(len(hits) * self.block_size, len(seq.prompt_token_ids))
        seq.block_table = [self.placeholder] * drop  # (behind the window: never read)
        seq.num_freed_blocks = drop
        for bid in hits[drop:]:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.draft_computed = draft  # the draft model's KV is taken up to its first stale slot
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = self.blocks[hits[-1]].hash if hits else None
        return tokens

    def allocate(self, seq: Sequence, budget: int | None = None) -> None:
        """Give a waiting sequence blocks for all its current tokens (with a window, those its first step of at
        most `budget` tokens computes: `_admission`), reusing cached prefix blocks."""
        tokens = self.claim(seq, budget)
        for _ in range(self.blocks_needed(tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())
        if self.states is not None:
            self.states.take(seq)
            self._restore_state(seq)  # (a hybrid model's prefix hit: its state snapshot)

    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)  # least recently freed first
        block = self.blocks[bid]
        if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count, block.draft_upto = None, None, 1, None
        self.fresh.append(bid)
        return bid

    # ------------------------------------------------------------------ growth
    def slots_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks the sequence needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.slots_needed(seq, num_tokens)):
            seq.block_table.append(self._take_free())

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Free the sequence's trailing blocks past those `num_tokens` tokens need (speculative decoding: the blocks
        only rejected drafts were written to). They were never registered in the prefix cache: reused first."""
        keep = max(self.blocks_needed(num_tokens), seq.num_hashed_blocks)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, "a rejected draft's block was shared or cached"
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)

    def register_scheduled(self, seq: Sequence, num_new_tokens: int, batched: bool = False) -> None:
        """Put the full blocks that the step just scheduled for seq completes into the prefix cache now (vLLM's
        allocate_slots -> cache_blocks with num_computed_tokens + num_new_tokens), so that a request admitted later in
        the same step with the same prefix shares them instead of computing them again (the n samples of a request,
        a batch sharing a system prompt): it reads K/V that the same forward writes first. Only for a step of at
        least 2 tokens of seq: that step's attention then runs after every layer's KV write of the whole batch (a
        batch of single-token queries is attended in the fused decode kernel, one program per token writing its own
        key while the others read: a reader of the block would race the write), unless `batched`: the step holds
        another sequence's query of several tokens already, so it never takes that kernel (Scheduler: a decode's
        block is then shared at once, as vLLM shares every block it schedules). Tokens still pending on the host
        (overlapped steps) are never hashed. Their draft-model KV is not known yet: marked unwritten (draft_upto 0),
        register_computed sets it once the step ran."""
        if not self.enable_prefix_caching or (num_new_tokens < 2 and not batched):
            return
        end = min(seq.num_computed_tokens + num_new_tokens, len(seq) - seq.num_pending)
        for i in range(seq.num_hashed_blocks, min(end // self.block_size, len(seq.block_table))):
            if seq.block_table[i] == self.placeholder:  # (freed behind the window before it was registered)
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:  # (registered by an earlier step's schedule whose completion is pending)
                continue
            h = self._key(seq, i)
            block.hash, block.token_ids = h, tuple(seq.tokens(i * self.block_size, (i + 1) * self.block_size))
            block.draft_upto = 0
            self.hash_to_block.setdefault(h, block.block_id)
            self.scheduled.append(block.block_id)

    def forget_scheduled(self, seqs) -> None:
        """The step scheduled since `scheduled` was cleared never ran (its launch failed, or was interrupted): the
        blocks registered for it hold no K/V, so they leave the prefix cache, and each of `seqs` (the running ones)
        that took one of them as a cached prefix goes back to computing from it (nor are they hits it counted)."""
        if not self.scheduled:
            return
        gone = set(self.scheduled)
        for bid in self.scheduled:
            block = self.blocks[bid]
            if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
        self.scheduled = []
        bs = self.block_size
        for seq in seqs:
            for k, bid in enumerate(seq.block_table[:seq.num_hashed_blocks]):
                if bid in gone:
                    if self.snapshots is not None:  # (a hybrid model's state: from a snapshot no further, else zero)
                        k = self._snapshot_point(seq, k)
                    if not seq.num_preemptions:  # (allocate counted its hits: the blocks it took, all hashed then)
                        if self._reads_cache(seq):
                            self.prefix_hits -= (seq.num_hashed_blocks - k) * bs
                        seq.num_cached_tokens = min(seq.num_cached_tokens, k * bs)
                    seq.num_hashed_blocks = k
                    seq.num_computed_tokens = min(seq.num_computed_tokens, k * bs)
                    seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
                    seq.last_block_hash = self.blocks[seq.block_table[k - 1]].hash if k else None
                    self._restore_state(seq)
                    break

    def register_computed(self, seq: Sequence) -> None:
        """Put the sequence's newly computed full blocks into the prefix cache (those register_scheduled put there
        get their draft KV's mark)."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        # draft-model speculation: how far its draft KV is written (a sequence past the draft's context feeds it no
        # more): a request that hits the block while this one runs takes that much of it (allocate), not a draft KV
        # of zeros; drafts_written moves the mark on as this one feeds the draft, free_seq sets it at the end
        drafted = min(seq.draft_fed, seq.num_computed_tokens)
        for i in range(seq.num_hashed_blocks, min(full, len(seq.block_table))):
            if seq.block_table[i] == self.placeholder:  # (freed behind the window before it was registered: an
                continue  # overlapped step's chunk of a window or more, counted before its completion)
            block = self.blocks[seq.block_table[i]]
            upto = drafted - i * self.block_size
            block.draft_upto = None if upto >= self.block_size else max(upto, 0)
            if block.hash is None:  # (else registered when its step was scheduled, register_scheduled: a
                # reset_prefix_cache since then, while the step ran, took it out of the cache, which it stays out of)
                block.hash = self._key(seq, i)
                block.token_ids = tuple(seq.tokens(i * self.block_size, (i + 1) * self.block_size))
                self.hash_to_block.setdefault(block.hash, block.block_id)
            seq.last_block_hash = block.hash
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def drafts_written(self, seqs) -> None:
        """Draft-model speculation, once a step's draft forward ran: it wrote each sequence's draft KV from its first
        stale slot (draft_computed) up to its computed tokens, so a cached block there whose draft KV was known only
        up to a slot it wrote (draft_upto) is now known to hold it that far. Otherwise that block stayed marked until
        the sequence was freed, and a request that hit it and the blocks computed after it meanwhile fed the draft
        all those tokens again, its catch-up (Scheduler.lag) past max_num_batched_tokens."""
        bs = self.block_size
        for seq in seqs:  # (its feed stops at draft_fed: the draft's context, Sequence.draft_end)
            start, end = min(seq.draft_computed, seq.num_computed_tokens), min(seq.draft_fed, seq.num_computed_tokens)
            for i in range(max(start // bs, seq.num_freed_blocks), min(-(-end // bs), len(seq.block_table))):
                block = self.blocks[seq.block_table[i]]
                if block.draft_upto is not None and start <= i * bs + block.draft_upto:
                    upto = end - i * bs
                    block.draft_upto = None if upto >= bs else max(upto, block.draft_upto)

    # ------------------------------------------------------------------ release
    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks nobody uses go to the free list: cached ones (a prefix hash) last,
        to be reused as late as possible, the others first, since their contents are worth nothing and their
        memory is warm (on CPU, a block never used before costs page faults when first touched). A cached block
        whose draft-model KV the sequence had not written to its end keeps how far it had (draft_upto: allocate)."""
        held = seq.block_table[seq.num_freed_blocks:]  # (the entries before: the placeholder, freed already)
        for i, bid in enumerate(held, seq.num_freed_blocks):
            if self.blocks[bid].hash is not None:
                upto = seq.draft_computed - i * self.block_size
                self.blocks[bid].draft_upto = None if upto >= self.block_size else max(upto, 0)
        for bid in reversed(held):
            self._release(self.blocks[bid])
        seq.block_table = []
        if self.states is not None:
            self.states.release(seq)
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.draft_computed = seq.num_freed_blocks = 0
        seq.last_block_hash = None
        seq.draft_hidden = None  # (EAGLE: the target's states not fed yet are of positions recomputed from 0)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full blocks with the child (copy-on-write is not needed: only full blocks)."""
        full = parent.num_computed_tokens // self.block_size
        child.num_freed_blocks = min(parent.num_freed_blocks, full)  # (the placeholder: no reference)
        for i, bid in enumerate(parent.block_table[:full]):
            if i >= child.num_freed_blocks:
                self.blocks[bid].ref_count += 1
            child.block_table.append(bid)
        child.num_computed_tokens = child.num_cached_tokens = full * self.block_size
        child.draft_computed = min(parent.draft_computed, child.num_computed_tokens)  # (draft-model speculation)
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        last = parent.block_table[child.num_hashed_blocks - 1] if child.num_hashed_blocks else None
        child.last_block_hash = None if last is None else parent.last_block_hash if last == self.placeholder \
            else self.blocks[last].hash

    def reset_prefix_cache(self, counters: bool = True, in_use: bool = False) -> None:
        """Forget every cached prefix of the free blocks (blocks in use keep their contents) and, with `counters`, the
        hit counters: a benchmark run then starts as cold as a fresh engine (LLMEngine.reset_prefix_cache keeps them:
        they only grow, as /metrics counts them). With `in_use` the blocks of running requests are no longer shared
        either (they keep their hashes for their own chain, but no new request finds them)."""
        for block in self.blocks:
            if block.ref_count == 0:
                block.hash, block.token_ids = None, None
        self.hash_to_block = {} if in_use else \
            {h: b for h, b in self.hash_to_block.items() if self.blocks[b].ref_count > 0}
        if self.snapshots is not None:  # (a hybrid model's states: forgotten as the free blocks' prefixes are)
            self.snapshots.clear()
        if counters:
            self.prefix_queries = self.prefix_hits = 0

    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
