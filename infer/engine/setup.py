"""Everything the engine needs before its first step: model, tokenizer, stop ids, KV size, adapters."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, ModelLoadError
from .config import EngineConfig

log = logging.getLogger("infer")


@dataclass
class EngineParts:
    path: Path
    model: Any
    model_config: Any
    tokenizer: Any
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: set[int]
    num_blocks: int
    memory_plan: Any
    lora_manager: Any


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {e}",
                             "the model folder needs tokenizer files (tokenizer.json or tokenizer.model)") from e


def eos_ids(path: Path, cfg, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = path / "generation_config.json"
    sources = [getattr(cfg, "eos_token_id", None), tokenizer.eos_token_id]
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        except ValueError:
            pass
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(x) for x in s)
    return ids


def checkpoint_dtype(cfg) -> torch.dtype | None:
    d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def model_max_len(cfg, config: EngineConfig) -> int:
    limit = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and cfg.model_type == "mistral":
        limit = min(limit, int(window))  # attention is full up to the window, where it equals sliding attention
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ConfigError(f"--max-model-len {config.max_model_len} is above the model's limit of {limit}",
                              f"use --max-model-len {limit} or less")
        return config.max_model_len
    return limit


def load_engine_parts(config: EngineConfig) -> EngineParts:
    from ..models.loader import load_config, load_model
    from ..models.resolve import resolve_model
    from ..memory.plan import plan_memory

    path = resolve_model(config.model)
    cfg = load_config(path)
    device = config.torch_device()
    dtype = config.torch_dtype(checkpoint_dtype(cfg))
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(path)
    model, cfg = load_model(path, dtype, device)
    max_len = model_max_len(cfg, config)
    lora_manager = None
    if config.loras:
        from ..lora.manager import LoRAManager
        lora_manager = LoRAManager(model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                   max_cpu_loras=config.max_cpu_loras, device=device, dtype=dtype)
        for name, adapter in config.loras.items():
            lora_manager.register(name, adapter)
    plan = plan_memory(config, cfg, model, dtype, device, max_len,
                       lora_manager.device_bytes() if lora_manager is not None else 0)
    return EngineParts(path, model, cfg, tokenizer, dtype, device, max_len, eos_ids(path, cfg, tokenizer),
                       plan.num_blocks, plan, lora_manager)
