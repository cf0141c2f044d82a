"""The per-sequence state slots of a hybrid model's linear-attention layers (models.qwen3_5: Qwen3.5's Gated
DeltaNet), vLLM's mamba cache: a pool of max_num_seqs slots allocated at the engine's start (ModelRunner), each
holding a running sequence's conv and recurrent states, of fixed size whatever its length. The block manager takes a
slot when it admits a sequence (`take`) and gives it back when the sequence finishes or is preempted (`release`);
a sequence's step that starts at position 0 (a new prefill, a preempted one recomputed) starts from zero state."""

from __future__ import annotations

import logging

from ..errors import ConfigError
from ..models.registry import is_hybrid

log = logging.getLogger("infer")


def prefix_caching_for(model_config, caching: bool) -> bool:
    """Whether the engine caches prefixes: never for a hybrid model (a cached prefix's KV without the linear layers'
    state at its end is of no use: vLLM turned it off for these models too), said once in the log when asked."""
    if caching and is_hybrid(model_config):
        log.info("prefix caching is off for %s: its linear-attention layers keep a state per sequence that cached "
                 "KV blocks cannot restore (every prompt is computed in full)", model_config.model_type)
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
