"""Session 64, small gaps: the adapter slots of Granite 4.0's and Nemotron-H's Mamba-2 layers (in_proj and out_proj,
slots only with every layer's), of Granite 4.0's shared_mlp and of Nemotron-H's one-mixer blocks are what
memory.sizes.lora_slot_bytes counts (no attention's qkv and o on a Mamba-2 layer, no MLP on a Nemotron-H mixer's
block)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.memory.sizes import lora_slot_bytes


@pytest.mark.parametrize("model", ["tiny-granite4", "tiny-granite4-dense", "tiny-nemotron-h"])
@pytest.mark.parametrize("targets", [None, ["qkv_proj"], ["o_proj"]])
def test_mamba_hybrid_slots_are_counted(model, targets):
    """The slots allocated on Granite 4.0 (with and without experts) and Nemotron-H are lora_slot_bytes' count, byte
    for byte: a Mamba-2 layer's own in_proj and out_proj only with every layer's slots, never an attention's."""
    with LLM(model, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, device="cpu",
             lora_target_modules=targets) as llm:
        got = llm.engine.lora_manager.device_bytes()
        assert got == lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32, targets)
