"""LoRA on a mixture of experts' stacked experts (peft's target_parameters on transformers 5's
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]; Nemotron 3's `mixer.experts.up_proj`
[E, I, H] and `down_proj`) for a batch whose tokens use different adapters.

An `ExpertLoRA` is the `lora` hook of one SparseMoeBlock (models.moe): for every device slot, every expert's A and B
of both projections, zero-padded to the slots' rank, the module's scaling folded into B: a13 [S, E, r, H], b13
[S, E, 2I, r], a2 [S, E, r, I], b2 [S, E, H, r] (an adapter that does not adapt a projection leaves it zero). The
fused MoE (kernels.fused_moe, fused_moe_int4) adds each token-expert pair's delta with its token's slot
(kernels.reference.moe_lora_delta); a step where no active adapter adapts the experts skips it.
"""

from __future__ import annotations

import torch

from ..kernels.reference import MoELoRA
from .adapter import LoRAModule
from .batch import LoRABatch

PARAMS = ("gate_up_proj", "down_proj")
UNGATED_PARAMS = ("up_proj", "down_proj")  # (Nemotron 3's experts: relu² without gate, w13 their up rows alone)


def expert_names(block) -> list[str]:
    """The adapter module names (lora.adapter) of a SparseMoeBlock's stacked experts: model.layers.N.mlp.experts.X
    (Mixtral's block_sparse_moe and Nemotron 3's mixer read as transformers 5's mlp, as lora.adapter names them):
    gate_up_proj and down_proj, or up_proj and down_proj for experts without gate."""
    layer = block.prefix.split(".")[2]
    return [f"model.layers.{layer}.mlp.experts.{p}" for p in (PARAMS if block.experts.gated else UNGATED_PARAMS)]


def expert_slot_elements(num_experts: int, hidden: int, inter: int, max_rank: int, gates: int = 2) -> int:
    """The elements of one adapter slot of one sparse layer's experts: A and B of gate_up (H -> 2I; up alone, H -> I,
    where `gates` is 1) and of down (I -> H), each expert's at the slots' rank."""
    return num_experts * max_rank * ((hidden + gates * inter) + (inter + hidden))


class ExpertLoRA:
    """The `lora` hook of one SparseMoeBlock: every slot's adapters of its experts (see the module docstring)."""

    def __init__(self, block, max_loras: int, max_rank: int, device, dtype: torch.dtype):
        ex = block.experts
        e, h, i = ex.num_experts, ex.hidden, ex.inter
        self.names = expert_names(block)
        self.max_rank = max_rank

        def zeros(*shape):
            return torch.zeros(max_loras, e, *shape, dtype=dtype, device=device)
        self.a13, self.b13 = zeros(max_rank, h), zeros((2 if ex.gated else 1) * i, max_rank)
        self.a2, self.b2 = zeros(max_rank, i), zeros(h, max_rank)
        self.ranks = [[0] * max_loras for _ in self.names]  # ranks[param][slot] on the host, 0 = not adapted

    def tensors(self) -> list[torch.Tensor]:
        return [self.a13, self.b13, self.a2, self.b2]

    def set_slot(self, slot: int, modules: dict[str, LoRAModule]) -> None:
        """Load one adapter's expert modules (from its modules by name) into `slot`; zeros where it has none."""
        pin = self.a13.device.type == "cuda"
        for p, (name, a_dst, b_dst) in enumerate(zip(self.names, (self.a13, self.a2), (self.b13, self.b2))):
            m = modules.get(name)
            if m is None and not self.ranks[p][slot]:
                continue
            a = torch.zeros(a_dst.shape[1:], dtype=a_dst.dtype, pin_memory=pin)
            b = torch.zeros(b_dst.shape[1:], dtype=b_dst.dtype, pin_memory=pin)
            if m is not None:
                a[:, :m.rank].copy_(m.lora_a)
                b[:, :, :m.rank].copy_(m.lora_b.float() * m.scaling)
            a_dst[slot].copy_(a, non_blocking=pin)
            b_dst[slot].copy_(b, non_blocking=pin)
            self.ranks[p][slot] = 0 if m is None else m.rank

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, {})

    def targets(self, slot: int) -> bool:
        return any(r[slot] for r in self.ranks)

    def moe_lora(self, batch: LoRABatch) -> MoELoRA | None:
        """The step's kernels.reference.MoELoRA; None when no active adapter adapts the experts (a CUDA graph's
        static batch: always, its slots change between replays)."""
        if not batch.static and not any(self.targets(s) for s in batch.active_slots):
            return None
        return MoELoRA(self.a13, self.b13, self.a2, self.b2, batch.token_slots)
