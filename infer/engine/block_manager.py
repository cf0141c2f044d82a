"""Paged KV blocks: a free list, reference counts, and automatic prefix caching.

A full block is identified by a chained hash of its token ids (SHA-256 of the previous block's hash and its own
ids), confirmed by comparing the ids. A block is registered in the cache when a step is scheduled to complete its K/V
(as vLLM's allocate_slots caches the full blocks of the tokens scheduled): a request admitted later in the same step
with the same prefix finds it and computes only its tail, reading K/V the same forward writes (each layer writes all
the step's keys and values before its attention reads them). Freed blocks keep their hash and sit in an LRU free
list, so a later request with the same prefix finds them until their space is needed; freed blocks without a hash
are reused first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU order
        self.hash_to_block: dict[bytes, int] = {}
        self.fresh: list[int] = []  # blocks handed out since the runner last zeroed them
        # blocks registered by register_scheduled since the scheduler's last step began: their K/V are this step's
        # (unwritten until its forward runs: a step that fails forgets them, forget_scheduled)
        self.scheduled: list[int] = []
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, found

    # ------------------------------------------------------------------ accounting
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ------------------------------------------------------------------ admission
    def _reads_cache(self, seq: Sequence) -> bool:
        """Whether admission looks the sequence up in the prefix cache. A request that wants its prompt's logprobs
        computes every prompt token (as vLLM: cached ones have no logits)."""
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix; at least one token is always left to compute."""
        if not self._reads_cache(seq):
            return []
        found = []
        for i in range((len(seq) - 1) // self.block_size):
            ids = tuple(seq.tokens(i * self.block_size, (i + 1) * self.block_size))
            bid = self.hash_to_block.get(block_key(seq, i, self.block_size))
            if bid is None or self.blocks[bid].token_ids != ids:
                break
            found.append(bid)
        return found

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        hits = self._cached_prefix(seq)
        hits_in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(len(seq)) - hits_in_use <= len(self.free) - reserve

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its current tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        hits = self._cached_prefix(seq)
        if not seq.num_preemptions:  # as vLLM: a preempted request's recompute, which finds its own blocks, is
            # neither a query of the hit rate nor its cached tokens (they say what its first admission found)
            if self._reads_cache(seq):  # as vLLM, a request that skips the cache (or every one, with the cache
                self.prefix_queries += len(seq)  # off) is no query
                self.prefix_hits += len(hits) * self.block_size
            # vLLM's meaning: the prompt tokens whose K/V came from the cache (usage's cached_tokens, at most its
            # prompt_tokens): blocks found past the prompt hold the forced prefix_token_ids, which are no prompt
            seq.num_cached_tokens = min(len(hits) * self.block_size, len(seq.prompt_token_ids))
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.draft_computed = seq.num_computed_tokens  # the draft model's KV is taken up to its first stale slot
        for i, bid in enumerate(hits):
            if self.blocks[bid].draft_upto is not None:
                seq.draft_computed = i * self.block_size + self.blocks[bid].draft_upto
                break
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = self.blocks[hits[-1]].hash if hits else None
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free())

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
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:  # (registered by an earlier step's schedule whose completion is pending)
                continue
            h = block_key(seq, i, self.block_size)
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
                    if not seq.num_preemptions:  # (allocate counted its hits: the blocks it took, all hashed then)
                        if self._reads_cache(seq):
                            self.prefix_hits -= (seq.num_hashed_blocks - k) * bs
                        seq.num_cached_tokens = min(seq.num_cached_tokens, k * bs)
                    seq.num_hashed_blocks = k
                    seq.num_computed_tokens = min(seq.num_computed_tokens, k * bs)
                    seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
                    seq.last_block_hash = self.blocks[seq.block_table[k - 1]].hash if k else None
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
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            upto = drafted - i * self.block_size
            block.draft_upto = None if upto >= self.block_size else max(upto, 0)
            if block.hash is None:  # (else registered when its step was scheduled, register_scheduled: a
                # reset_prefix_cache since then, while the step ran, took it out of the cache, which it stays out of)
                block.hash = block_key(seq, i, self.block_size)
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
            for i in range(start // bs, min(-(-end // bs), len(seq.block_table))):
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
        for i, bid in enumerate(seq.block_table):
            if self.blocks[bid].hash is not None:
                upto = seq.draft_computed - i * self.block_size
                self.blocks[bid].draft_upto = None if upto >= self.block_size else max(upto, 0)
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, "block freed twice"
            if block.ref_count == 0:
                self.free[bid] = None
                if block.hash is None:
                    self.free.move_to_end(bid, last=False)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.draft_computed = 0
        seq.last_block_hash = None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full blocks with the child (copy-on-write is not needed: only full blocks)."""
        full = parent.num_computed_tokens // self.block_size
        for bid in parent.block_table[:full]:
            self.blocks[bid].ref_count += 1
            child.block_table.append(bid)
        child.num_computed_tokens = child.num_cached_tokens = full * self.block_size
        child.draft_computed = min(parent.draft_computed, child.num_computed_tokens)  # (draft-model speculation)
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        child.last_block_hash = self.blocks[parent.block_table[child.num_hashed_blocks - 1]].hash \
            if child.num_hashed_blocks else None

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
        if counters:
            self.prefix_queries = self.prefix_hits = 0

    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
