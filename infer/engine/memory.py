"""How many KV blocks the engine gets: the memory budget minus weights and activations, in whole blocks."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import OutOfMemoryError
from .config import EngineConfig


@dataclass
class MemoryPlan:
    device: str
    budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    kv_block_bytes: int
    num_blocks: int


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * (torch.finfo(dtype).bits // 8)


def available_cpu_memory() -> int:
    """Free RAM, or the cgroup limit minus usage when that is smaller."""
    import psutil
    avail = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_file).read().strip()
            if limit != "max":
                avail = min(avail, int(limit) - int(open(usage_file).read()))
            break
        except (OSError, ValueError):
            continue
    return max(0, avail)


def activation_estimate(cfg, config: EngineConfig, dtype: torch.dtype) -> int:
    """Peak activation bytes of one step of max_num_batched_tokens tokens (intermediate MLP + logits dominate)."""
    t = config.max_num_batched_tokens
    width = max(2 * cfg.intermediate_size, 3 * cfg.hidden_size)
    per_token = (width + 4 * cfg.hidden_size) * (torch.finfo(dtype).bits // 8)
    logits = min(t, config.max_num_seqs) * cfg.vocab_size * 4 * 2
    return t * per_token + logits


def weights_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def plan_memory(config: EngineConfig, cfg, model, dtype, device, max_len: int) -> MemoryPlan:
    per_token = kv_bytes_per_token(cfg, dtype)
    block = per_token * config.block_size
    weights = weights_bytes(model)
    act = activation_estimate(cfg, config, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)  # what is left under the limit
        kv_budget = budget - act
        budget += weights
    else:
        budget = config.memory_limit if config.memory_limit else int(available_cpu_memory() * 0.5) + weights
        kv_budget = budget - weights - act
    wanted = config.max_num_seqs * max_len  # more than this is never used at once
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = min(max(0, kv_budget) // block, -(-wanted // config.block_size) + config.max_num_seqs)
    if num_blocks < 1 or num_blocks * config.block_size < min(max_len, 1):
        raise OutOfMemoryError(
            f"no room for the KV cache: budget {budget / 2**30:.2f} GiB, weights {weights / 2**30:.2f} GiB, "
            f"activations {act / 2**30:.2f} GiB", "raise --memory-limit / --gpu-memory-utilization")
    return MemoryPlan(device.type, budget, weights, act, per_token, block, int(num_blocks))
