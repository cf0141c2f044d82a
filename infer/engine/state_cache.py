"""The per-sequence state slots of a hybrid model's linear-attention layers (models.qwen3_5: Qwen3.5's Gated
DeltaNet), vLLM's mamba cache: a pool of max_num_seqs slots allocated at the engine's start (ModelRunner), each
holding a running sequence's conv and recurrent states, of fixed size whatever its length. The block manager takes a
slot when it admits a sequence (`take`) and gives it back when the sequence finishes or is preempted (`release`);
a sequence's step that starts at position 0 (a new prefill, a preempted one recomputed) starts from zero state."""

from __future__ import annotations

import logging
from collections import OrderedDict

from ..errors import ConfigError
from ..models.registry import is_hybrid

log = logging.getLogger("infer")


def prefix_caching_for(model_config, caching: bool, snapshots: int = 0) -> bool:
    """Whether the engine caches prefixes. A hybrid model's cached prefix is of use only with its linear layers'
    states at its end: it caches them in `snapshots` snapshot slots (StateSnapshots, --state-snapshots; vLLM's mamba
    prefix caching, mode "align"); with none (--state-snapshots 0, or no layer groups allowed) every prompt is computed
    in full, said once in the log when asked."""
    if caching and is_hybrid(model_config):
        if snapshots > 0:
            log.info("prefix caching of %s keeps its linear-attention layers' states at block-aligned prompt "
                     "positions in %d snapshot slots (--state-snapshots): a prefix hit is cut to the longest one "
                     "kept", model_config.model_type, snapshots)
            return True
        log.info("prefix caching is off for %s: its linear-attention layers keep a state per sequence that cached "
                 "KV blocks cannot restore without state snapshots (--state-snapshots 0: every prompt is computed "
                 "in full)", model_config.model_type)
        return False
    return caching


def refuse_hybrid_options(config, model_config) -> None:
    """Speculative decoding on a hybrid model: a step's rejected draft tokens would leave the linear layers' states
    advanced past them (no state to roll back to: vLLM needed per-token state copies): refused."""
    if is_hybrid(model_config) and config.speculative_config is not None:
        raise ConfigError(f"--speculative-config cannot run {model_config.model_type}: its linear-attention layers "
                          "keep one state per sequence, which a rejected draft token would leave advanced",
                          "leave --speculative-config out for this model")


class StateSlots:
    """A free list of `num_slots` slots; the scheduler never runs more than max_num_seqs sequences at once, so
    max_num_seqs slots always suffice (a take from an empty list is an internal error)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))

    def take(self, seq) -> None:
        if seq.state_slot is None:
            assert self.free, "more running sequences than state slots"
            seq.state_slot = self.free.pop()

    def release(self, seq) -> None:
        if seq.state_slot is not None:
            self.free.append(seq.state_slot)
            seq.state_slot = None

    @property
    def num_free(self) -> int:
        return len(self.free)


class StateSnapshots:
    """A hybrid model's prefix cache of states (vLLM's mamba prefix caching, "align" mode; SGLang's mamba radix
    cache): `num_slots` snapshot slots beside the running sequences' (StateCacheMixin.allocate_snapshots), each
    holding the conv and recurrent states of a sequence at a block-aligned position, under the prefix-cache key of the
    full block that ends there (block_manager.block_key: its chain covers every token before, the adapter and the
    salt). The scheduler ends a prompt's prefill chunks at block boundaries (BlockManager.snapshot_chunk), the last
    one before its last token among them; after a step's forward is queued its sequences that reached such a boundary
    are copied here (`save`), least recently used slots evicted first. Past its prompt (its decode, a preempted
    sequence's recompute) a sequence keeps one snapshot, at the last block boundary it reached (`hold`: a follow-up
    turn's prompt holds the reply), moved on at each one it reaches. A prefix hit is cut to the longest run of
    cached blocks whose last block has a snapshot, which is copied into the admitted sequence's slot (`restore`): its
    prefill starts after it. Copies are queued on the device in host order, so a save after step k's forward and a
    restore before step k+1's need no sync. `copy(pairs, save)`: the model's (StateCacheMixin.copy_states)."""

    def __init__(self, num_slots: int, copy):
        self.num_slots = num_slots
        self.copy = copy
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> snapshot slot, least recently used first
        self.free = list(range(num_slots - 1, -1, -1))
        # overlapped steps: snapshots of a step whose last token the host does not know yet, so neither their key
        # (snapshot slot, sequence, its block whose end they are at), named once the token is known (`name`)
        self.unnamed: list[tuple[int, object, int]] = []
        self.saved = self.restored = self.evicted = 0  # (stats)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def restore(self, key: bytes, slot: int) -> None:
        """Copy the snapshot under `key` (found: the caller checked) into running slot `slot`."""
        snap = self.slots[key]
        self.slots.move_to_end(key)
        self.copy([(snap, slot)], save=False)
        self.restored += 1

    def _take(self) -> int | None:
        """A snapshot slot to write: a free one, else the least recently used one's (evicted); None when every one
        waits for its name (overlapped steps: that many sequences reached a block boundary at once)."""
        if self.free:
            return self.free.pop()
        if not self.slots:
            return None
        _, snap = self.slots.popitem(last=False)
        self.evicted += 1
        return snap

    def save(self, points: list[tuple[int, bytes]]) -> None:
        """Snapshot each (running slot, key) of a step whose forward is queued (a key kept already: touched)."""
        pairs = []
        for slot, key in points:
            if key in self.slots:
                self.slots.move_to_end(key)
                continue
            snap = self._take()
            if snap is not None:
                self.slots[key] = snap
                pairs.append((slot, snap))
        if pairs:
            self.copy(pairs, save=True)
            self.saved += len(pairs)

    def hold(self, points: list[tuple[int, object, int]]) -> None:
        """Snapshot each (running slot, sequence, block) of a step whose forward is queued, reached past its prompt:
        unnamed until `name` finds the block's tokens on the host. It takes the slot of the one its sequence kept
        before, if still kept (only its last is of use: a follow-up turn's prompt holds the whole reply)."""
        pairs = []
        for slot, seq, i in points:
            old, seq.state_snap_key = seq.state_snap_key, None
            snap = self.slots.pop(old) if old in self.slots else self._take()
            if snap is not None:
                self.unnamed.append((snap, seq, i))
                pairs.append((slot, snap))
        if pairs:
            self.copy(pairs, save=True)
            self.saved += len(pairs)

    def name(self, key_of) -> None:
        """Key each unnamed snapshot whose block's tokens the host knows now (`key_of(seq, i)`, None while it does
        not), dropping one its sequence kept before (two taken before the first was named), or one a kept snapshot
        of the same key makes a copy of; one whose sequence finished without them (its last token dropped, its step
        failed) is dropped."""
        waiting = []
        for snap, seq, i in self.unnamed:
            key = key_of(seq, i)
            if key is None:
                if seq.finished:
                    self.free.append(snap)
                else:
                    waiting.append((snap, seq, i))
                continue
            old = self.slots.get(seq.state_snap_key) if seq.state_snap_key is not None else None
            if old is not None and seq.state_snap_key != key:
                del self.slots[seq.state_snap_key]
                self.free.append(old)
            seq.state_snap_key = key
            if key in self.slots:
                self.slots.move_to_end(key)
                self.free.append(snap)
            else:
                self.slots[key] = snap
        self.unnamed = waiting

    def clear(self) -> None:
        """Forget every snapshot (the prefix cache reset, the engine put to sleep)."""
        self.slots.clear()
        self.unnamed = []
        self.free = list(range(self.num_slots - 1, -1, -1))
