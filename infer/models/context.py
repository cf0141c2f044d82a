"""What one forward pass needs besides token ids and positions: where the KV of every sequence lives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardContext:
    """A flat batch of `num_seqs` sequences and T tokens (prefill chunks and decodes mixed, no padding).

    query_start_loc[b]:query_start_loc[b+1] are sequence b's new tokens in the flat batch; seq_lens[b] is its length
    after this step (cached tokens + new ones); block_tables[b] its KV blocks; slot_mapping[t] the cache slot where
    token t's K/V are written. `lora` is the per-token adapter map (infer.lora) or None when no token uses one.
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    lora: Any = None
    # KV layer groups (engine.hybrid_blocks): the block tables [G - 1, B, max_blocks] and slot mappings [G - 1, T] of
    # groups 1.. (group 0's: block_tables, slot_mapping); an attention layer reads its group's (kv_group); None: one
    kv_groups: Any = None
    # a hybrid model's per-sequence state slots [B] int64 (models.qwen3_5: its linear-attention layers' states); None:
    # no such layers
    state_slots: Any = None
    # a hybrid model whose Mamba-2 time_step_limit clamps (models.granite4.Mamba2Mixer.clamps): [T] bool, whether each
    # token is the prompt's (its dt clamped, as transformers clamps a prompt's and not a decode step's), set only for
    # a step where that is not "a prefill's tokens are the prompt's, a decode's generated" (a prompt's last token
    # alone, a recomputed sequence's generated tokens); None: that rule holds
    dt_clamp: Any = None
