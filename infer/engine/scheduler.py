"""Who runs this step: running sequences first (decodes, unfinished prefill chunks), then new ones, within
max_num_seqs and max_num_batched_tokens. When KV blocks run out, the youngest running sequence is preempted and
recomputed later; no request is ever dropped.

With scheduling_policy "priority" (vLLM's), both queues are kept in the order of (priority, arrival, admission
number): waiting requests are admitted lowest priority value first, running ones are given their tokens in that
order, and the one preempted when blocks run out is the last of them (the lowest priority, latest arrived), so
that a preempted request goes back among the waiting ones at its own place."""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import LoRAError
from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed for each sequence this step
    zero: list[int] = field(default_factory=list)  # KV blocks handed out since the last step: the step zeroes them

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class RankedQueue:
    """The waiting requests under the priority policy: a heap by rank, as vLLM's PriorityRequestQueue, so that
    queueing one of n waiting requests is O(log n) (a deque kept sorted took O(n) each: a run of 10^5 lines of random
    priorities spent 13 s queueing them, 10^6 most of an hour); a request removed (aborted while waiting) is only
    marked, in O(1), and dropped when it reaches the top. The deque methods the scheduler calls; every position
    argument is the rank's. Iterated in rank order."""

    def __init__(self, rank):
        self._rank = rank
        # [rank, seq] (seq None once removed); ranks are unique (admission numbers), so seqs are never compared
        self._heap: list[list] = []
        self._entries: dict[int, list] = {}  # id(seq) -> its entry, for the requests waiting

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self):
        self._heap = sorted(e for e in self._heap if e[1] is not None)  # (a sorted list is a heap)
        return iter([seq for _, seq in self._heap])

    def __contains__(self, seq) -> bool:
        entry = self._entries.get(id(seq))
        return entry is not None and entry[1] is seq

    def __getitem__(self, index: int):
        if index == 0 and self._entries:
            self._drop_removed()
            return self._heap[0][1]
        return list(self)[index]

    def append(self, seq) -> None:
        entry = [self._rank(seq), seq]
        self._entries[id(seq)] = entry
        heapq.heappush(self._heap, entry)

    appendleft = append

    def extendleft(self, seqs) -> None:
        for seq in seqs:
            self.append(seq)

    def popleft(self):
        if not self._entries:
            raise IndexError("pop from an empty queue")
        self._drop_removed()
        seq = heapq.heappop(self._heap)[1]
        del self._entries[id(seq)]
        return seq

    def remove(self, seq) -> None:
        if seq not in self:
            raise ValueError("the sequence is not waiting")
        self._entries.pop(id(seq))[1] = None
        if len(self._heap) > 2 * len(self._entries) + 64:  # mostly removed ones: kept no longer
            self._heap = [e for e in self._heap if e[1] is not None]
            heapq.heapify(self._heap)

    def _drop_removed(self) -> None:
        while self._heap[0][1] is None:
            heapq.heappop(self._heap)


class ArrivalQueue:
    """The waiting requests under the fcfs policy: a deque in arrival order (a preempted request goes back at the
    front), where a request removed (aborted while waiting) is only marked, in O(1), and skipped when it reaches the
    front; `seq in queue` is O(1) too (a deque's remove and `in` scanned it: aborting n waiting requests one by one
    took O(n^2)). The deque methods the scheduler calls; iterated in queue order."""

    def __init__(self):
        self._queue: deque[list] = deque()  # [seq] boxes (seq None once removed), in queue order
        self._entries: dict[int, list] = {}  # id(seq) -> its box, for the requests waiting

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self):
        return iter([box[0] for box in self._queue if box[0] is not None])

    def __contains__(self, seq) -> bool:
        box = self._entries.get(id(seq))
        return box is not None and box[0] is seq

    def __getitem__(self, index: int):
        if index == 0 and self._entries:
            self._drop_removed()
            return self._queue[0][0]
        return list(self)[index]

    def _box(self, seq) -> list:
        box = [seq]
        self._entries[id(seq)] = box
        return box

    def append(self, seq) -> None:
        self._queue.append(self._box(seq))

    def appendleft(self, seq) -> None:
        self._queue.appendleft(self._box(seq))

    def extendleft(self, seqs) -> None:
        for seq in seqs:
            self.appendleft(seq)

    def popleft(self):
        if not self._entries:
            raise IndexError("pop from an empty queue")
        self._drop_removed()
        seq = self._queue.popleft()[0]
        del self._entries[id(seq)]
        return seq

    def remove(self, seq) -> None:
        if seq not in self:
            raise ValueError("the sequence is not waiting")
        self._entries.pop(id(seq))[0] = None
        if len(self._queue) > 2 * len(self._entries) + 64:  # mostly removed ones: kept no longer
            self._queue = deque(box for box in self._queue if box[0] is not None)

    def _drop_removed(self) -> None:
        while self._queue[0][0] is None:
            self._queue.popleft()


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, lora=None):
        self.bm = block_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # draft-model speculation: the draft's first forward of a step also feeds what its KV lacks before the step's
        # own tokens (the last accepted draft of a step that accepted them all), counted against the same budget
        spec = config.speculative_config
        self.draft_model = bool(spec) and spec.get("method") in ("draft_model", "eagle3", "eagle")  # (EAGLE heads too)
        self.draft_context: int | None = None  # the draft's context (LLMEngine sets it): never fed past it
        self.lora = lora  # adapter slot manager (or None): admits a request only when its adapter gets a slot
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.failed: list[Sequence] = []  # finished with an error while scheduling; the engine hands them out
        self.by_priority = config.scheduling_policy == "priority"
        # waiting requests: arrival order (fcfs), or a heap by rank (priority)
        self.waiting: ArrivalQueue | RankedQueue = RankedQueue(self.rank) if self.by_priority else ArrivalQueue()
        self._numbers = itertools.count()  # admission numbers: ties of priority and arrival time go first come
        self._batched, self._singles = False, []  # (_register)

    @staticmethod
    def rank(seq: Sequence) -> tuple:
        """A sequence's place under the priority policy (smaller first; the largest is preempted first)."""
        return seq.params.priority, seq.arrival_time, seq.number

    def _queue(self, queue, seq: Sequence) -> None:
        """Put seq in `queue` (the running list; the waiting one is a RankedQueue) at its rank."""
        bisect.insort(queue, seq, key=self.rank)

    def add(self, seq: Sequence) -> None:
        seq.number = next(self._numbers)
        self.waiting.append(seq)  # (RankedQueue: at its rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def lag(self, seq: Sequence) -> int:
        """Draft-model speculation: the tokens seq's draft KV lacks before its next token (DraftRunner.propose feeds
        them with the step's own, never past the draft's context: Sequence.draft_end), which the step's budget
        counts; 0 otherwise."""
        if not self.draft_model:
            return 0
        return max(0, seq.draft_end(seq.num_computed_tokens, self.draft_context)
                   - min(seq.draft_computed, seq.num_computed_tokens))

    def _fit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """The tokens of seq this step within `budget`, which its draft's catch-up (lag) shares: the draft's first
        forward holds every scheduled sequence's lag and own tokens, no more than max_num_batched_tokens. (A first
        sequence whose lag alone fills the budget still gets one token: never reached, lag is at most one token and
        comes only from drafts, which a budget of one never gives.)"""
        n = min(seq.num_uncomputed_tokens, budget - self.lag(seq))
        n = n if n > 0 or batch else 1
        return self.bm.snapshot_chunk(seq, n) if n > 0 else n  # (a hybrid model's prompt: to a block boundary)

    def schedule(self) -> ScheduledBatch:
        self.bm.scheduled = []  # (the last step ran: its blocks' K/V are written, or being written on the device)
        self.bm.planned = set()  # (and its state snapshots taken)
        try:
            return self._schedule()
        except BaseException:  # (an adapter slot's load failing in _admit, Ctrl-C) the step never runs: the blocks
            # registered for it hold no K/V (its caller may abort the requests, leaving them cached when freed)
            self.bm.forget_scheduled(self.running)
            raise

    def _register(self, seq: Sequence, n: int) -> None:
        """Put the blocks the step completes for seq (n of its own tokens) in the prefix cache as it is scheduled
        (BlockManager.register_scheduled), for the requests admitted after it in the step. A step of one token may
        run in the fused decode kernel, whose reads race its writes: its blocks wait until the step holds a query of
        several tokens (which keeps the whole batch off that kernel), and are registered then, before any admission
        that follows; a decode's block completed in a step with a prefill chunk was shared only from the next step.
        A hybrid model's prompt state the step snapshots is planned, for those admitted after it (awaits_snapshot)."""
        self.bm.plan_snapshot(seq, n)
        if n < 2 and not self._batched:
            self._singles.append(seq)
            return
        if not self._batched:
            self._batched = True
            for single in self._singles:
                self.bm.register_scheduled(single, 1, batched=True)
            self._singles = []
        self.bm.register_scheduled(seq, n, batched=True)

    def _schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        self._batched, self._singles = False, []  # (_register: the step's queries of one token, while all are)
        for seq in self.running:
            if seq.block_table and self.ends_pending(seq):
                # the launched step's completion finishes it: its blocks are free from now (registered first: that
                # completion comes after this reset), as the synchronous engine has freed them before this schedule;
                # held, a younger request that needed one was preempted, and a waiting one was not admitted
                self.bm.register_computed(seq)
                self.bm.free_seq(seq)
            else:  # a sliding window's blocks that no query reads any more go back first (what seq holds)
                self.bm.free_behind(seq)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.ends_pending(seq):
                i += 1  # (no drafts: a sequence with a pending token has none)
                continue
            n = self._fit(seq, budget, batch)
            if n < 1:
                break
            if not self._reserve(seq, seq.num_computed_tokens + n):
                continue  # seq itself was preempted (it was the youngest); the list shrank
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            self._register(seq, n)  # (its own tokens: never drafts, which may be rejected)
            budget -= n + self.lag(seq)
            i += 1
        for seq in self.running[i:]:  # not scheduled this step: no drafts
            seq.draft_token_ids = []
        budget = self._with_drafts(batch, budget)
        self._admit(batch, budget)
        return batch

    @staticmethod
    def ends_pending(seq: Sequence) -> bool:
        """Overlapped steps: the token the launched step samples for seq is its last, whatever its value (max_tokens or
        the context reached): no step computes it, as vLLM's async scheduling skips such a request, and the launched
        step's completion finishes seq. Scheduled, the step past its end took a block it never used, preempting
        another request for it when the cache was full."""
        if not seq.num_pending:
            return False
        limit = seq.params.max_new_tokens
        return (limit is not None and seq.num_generated + seq.num_pending >= limit) \
            or 0 < seq.max_total_len <= len(seq)

    def _with_drafts(self, batch: ScheduledBatch, budget: int) -> int:
        """Speculative decoding: to each decoding sequence of the batch with drafts, as many of them as the budget and
        the free KV blocks that every running sequence's own tokens left hold (drafts never preempt anyone, nor keep
        a running sequence out of the step); the drafts left out are dropped. Returns the budget left. A sequence's
        draft catch-up (lag), already counted, is no more than its drafts' tokens: those need only what exceeds it
        (the target's verify holds the drafts, the draft's first forward the lag)."""
        for j, seq in enumerate(batch.seqs):
            if not seq.draft_token_ids:
                continue
            n, lag = batch.num_new_tokens[j], self.lag(seq)
            k = min(len(seq.draft_token_ids), budget + lag) if n == seq.num_uncomputed_tokens else 0
            while k > 0 and self.bm.slots_needed(seq, seq.num_computed_tokens + n + k) > self.bm.num_free_blocks:
                k -= 1
            del seq.draft_token_ids[k:]
            if k:
                self.bm.grow(seq, seq.num_computed_tokens + n + k)
                batch.num_new_tokens[j] += k
                budget -= max(k - lag, 0)
        return budget

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Add waiting requests to the running ones and the batch, first come first served within budget."""
        # requests that wait for an adapter slot (every slot pinned by running requests): the requests behind them
        # that use no adapter go first, as vLLM admits them, while those that use one wait in turn, so that the
        # slots' adapters drain and the first of them is the next to get one (no starvation)
        # (and a hybrid model's request whose prefix hit reaches further from a state this step snapshots: the next
        # step's, BlockManager.awaits_snapshot)
        skipped: list[Sequence] = []
        lora_waits = False
        try:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if (self.lora and seq.lora is not None and lora_waits) or self.bm.awaits_snapshot(seq):
                    skipped.append(self.waiting.popleft())
                    continue
                if not self.bm.can_allocate(seq, budget=budget):
                    break
                if self.lora and not self.lora.can_acquire(seq.lora):
                    skipped.append(self.waiting.popleft())
                    lora_waits = True
                    continue
                if self.lora and not self._acquire(seq):
                    continue
                self.waiting.popleft()
                self.bm.allocate(seq, budget)  # (a cached prefix's draft KV is taken up to its first stale block;
                # with a window, blocks for the tokens its first step computes, within the budget)
                seq.status = Status.RUNNING
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.monotonic()
                if self.by_priority:
                    self._queue(self.running, seq)
                else:
                    self.running.append(seq)
                n = self._fit(seq, budget, batch)  # (a cached prefix's draft may lag)
                if n < 1:
                    break  # running, its first tokens the next step's
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                self._register(seq, n)  # a later one of the same prefix shares the blocks it computes
                budget -= n + self.lag(seq)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _acquire(self, seq: Sequence) -> bool:
        """Pin seq's adapter in a slot; False (seq finished with the error) when its folder can no longer be read:
        it was deleted or changed since registration and the CPU copy had been evicted."""
        try:
            self.lora.acquire(seq.lora)
        except LoRAError as e:
            seq.error = str(e)
            self.finish(seq, "error")
            self.failed.append(seq)
            return False
        return True

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make sure `seq` has blocks for num_tokens, preempting the youngest others (under the priority policy, the
        lowest priority, latest arrived: the running list is in that order); False if seq was preempted."""
        while self.bm.slots_needed(seq, num_tokens) > self.bm.num_free_blocks:
            # (a request at its last token, whose blocks schedule() freed, frees nothing more: never the victim)
            victim = next(s for s in reversed(self.running) if s is seq or not self.ends_pending(s))
            self.preempt(victim)
            if victim is seq:
                return False
        self.bm.grow(seq, num_tokens)
        return True

    def preempt(self, seq: Sequence, counted: bool = True) -> None:
        """Back to the head of the waiting queue, its KV blocks freed (recomputed when it runs again). `counted`
        False: not a preemption the stats and /metrics count (sleep(mode="keep") pausing it)."""
        self.running.remove(seq)
        seq.draft_token_ids = []
        seq.pool_rows = seq.pool_sum = None  # (a pooling request's rows so far, on the device: recomputed too)
        self.bm.free_seq(seq)  # (draft_computed 0: recomputed, by the draft model too)
        if self.lora:
            self.lora.release(seq.lora)
        seq.status = Status.WAITING
        seq.num_preemptions += counted
        self.num_preemptions += counted
        self.waiting.appendleft(seq)  # (RankedQueue: at its rank)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free_seq(seq)
            if self.lora:
                self.lora.release(seq.lora)
        elif seq in self.waiting:
            self.waiting.remove(seq)
