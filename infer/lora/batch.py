"""One step's adapter map: every token's device slot (`LoRABatch`), and the tokens grouped by slot (`LoRAGroups`),
computed once per step and shared by every LoRA op of every layer (the `SlotGroups` contract of
infer.kernels.lora_reference, which the kernels read without importing this module).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAGroups:
    """The tokens of one batch grouped by adapter slot.

    `order` [T] int64 holds the token indices sorted by slot (stable), the tokens without adapter (slot -1) first;
    the tokens of slot s are order[starts[s + 1]:starts[s + 2]] (`starts` [S + 2] int64, starts[0] = 0).
    `in_order` says the batch's tokens are already sorted by slot (order is the identity): the model runner orders
    a batch's sequences by adapter, so that the decode path reads every slot's tokens as a view, without gathers.
    `cache` holds what the CPU kernels derive from order and starts on the host, once per step; whoever rewrites
    order or starts in place (engine.cuda_graphs) empties it.
    """

    order: torch.Tensor
    starts: torch.Tensor
    in_order: bool = False
    cache: dict = field(default_factory=dict)


def lora_groups(token_slots: torch.Tensor, num_slots: int, in_order: bool = False) -> LoRAGroups:
    """Group token indices by token_slots[t] in -1..num_slots-1 (see LoRAGroups), on token_slots' device, without a
    host sync. in_order: the caller knows token_slots is non-decreasing."""
    key = token_slots.long() + 1
    order = torch.argsort(key, stable=True)
    # not torch.bincount: on CUDA it reads the largest key back to the host to size its output (a sync per step)
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    starts = torch.zeros(num_slots + 2, dtype=torch.long, device=key.device)
    torch.cumsum(counts, 0, out=starts[1:])
    return LoRAGroups(order, starts, in_order)


def host_groups(token_slots: list[int], num_slots: int) -> tuple[list[int], list[int], bool]:
    """lora_groups' order and starts as lists, from the slots on the host (a step's inputs: they travel to the
    device with the step's other integers, instead of costing a handful of device ops each step), and in_order."""
    n = len(token_slots)
    in_order = all(a <= b for a, b in zip(token_slots, token_slots[1:]))
    order = list(range(n)) if in_order else sorted(range(n), key=token_slots.__getitem__)  # stable, as argsort's
    starts = [0] * (num_slots + 2)
    for s in token_slots:
        starts[s + 2] += 1
    for s in range(2, num_slots + 2):
        starts[s] += starts[s - 1]
    return order, starts, in_order


@dataclass
class LoRABatch:
    """What the model runner puts at `ctx.lora` for one step (see infer.lora): every token's adapter slot.

    token_slots [T] int64 on the model's device (-1 = base model only); active_slots the distinct slots >= 0, on the
    host, so that layers no active adapter targets cost nothing; groups the tokens sorted by slot, shared by
    every shrink/expand of the step. A static batch (a CUDA graph's) has contents that change between replays,
    so nothing about it may be decided on the host.
    """

    token_slots: torch.Tensor
    active_slots: tuple[int, ...]
    groups: LoRAGroups
    static: bool = False  # a CUDA graph's batch (engine.cuda_graphs): every layer, every slot, the full rank

    @classmethod
    def build(cls, token_slots, num_slots: int, device: torch.device | str | None = None,
              on_device: torch.Tensor | None = None, groups: LoRAGroups | None = None) -> "LoRABatch | None":
        """From a list (or tensor) of per-token slots; None when no token uses an adapter. `on_device`: the same
        slots already on the device as int64 (the engine's step copies them with its other inputs), so that
        building the batch neither copies nor waits for the device; `groups`: their LoRAGroups, already on the
        device too (host_groups' lists, copied with them)."""
        if isinstance(token_slots, torch.Tensor):
            host = token_slots.tolist()
            slots = token_slots.to(device=device or token_slots.device, dtype=torch.long)
        else:
            host = list(token_slots)
            slots = on_device if on_device is not None else torch.tensor(host, dtype=torch.long, device=device)
        active = tuple(sorted({s for s in host if s >= 0}))
        if not active:
            return None
        assert active[-1] < num_slots and min(host) >= -1, f"token slots must be in -1..{num_slots - 1}"
        in_order = all(a <= b for a, b in zip(host, host[1:]))
        return cls(slots, active, groups if groups is not None else lora_groups(slots, num_slots, in_order))
