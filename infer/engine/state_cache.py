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
    holding the conv and recurrent states of a prompt at a block-aligned position, under the prefix-cache key of the
    full block that ends there (block_manager.block_key: its chain covers every token before, the adapter and the
    salt). The scheduler ends a prompt's prefill chunks at block boundaries (BlockManager.snapshot_chunk), at least
    at the prompt's last full block; after a step's forward is queued its sequences that reached such a boundary are
    copied here (`save`), least recently used slots evicted first. A prefix hit is cut to the longest run of cached
    blocks whose last block has a snapshot, which is copied into the admitted sequence's slot (`restore`): its
    prefill starts after it. Copies are queued on the device in host order, so a save after step k's forward and a
    restore before step k+1's need no sync. `copy(pairs, save)`: the model's (StateCacheMixin.copy_states)."""

    def __init__(self, num_slots: int, copy):
        self.num_slots = num_slots
        self.copy = copy
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> snapshot slot, least recently used first
        self.free = list(range(num_slots - 1, -1, -1))
        self.saved = self.restored = self.evicted = 0  # (stats)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def restore(self, key: bytes, slot: int) -> None:
        """Copy the snapshot under `key` (found: the caller checked) into running slot `slot`."""
        snap = self.slots[key]
        self.slots.move_to_end(key)
        self.copy([(snap, slot)], save=False)
        self.restored += 1

    def save(self, points: list[tuple[int, bytes]]) -> None:
        """Snapshot each (running slot, key) of a step whose forward is queued (a key kept already: touched)."""
        pairs = []
        for slot, key in points:
            if key in self.slots:
                self.slots.move_to_end(key)
                continue
            if self.free:
                snap = self.free.pop()
            else:
                _, snap = self.slots.popitem(last=False)
                self.evicted += 1
            self.slots[key] = snap
            pairs.append((slot, snap))
        if pairs:
            self.copy(pairs, save=True)
            self.saved += len(pairs)

    def clear(self) -> None:
        """Forget every snapshot (the prefix cache reset, the engine put to sleep)."""
        self.slots.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))
