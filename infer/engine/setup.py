"""Everything the engine needs before its first step: model, tokenizer, stop ids, KV size, adapters."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checks import processor_chat_template, tokenizer_problem  # noqa: F401 (engine.setup's name too)
from ..errors import ConfigError, ModelLoadError
from ..models.limits import context_limit, sliding_window  # noqa: F401 (engine.setup's names too)
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
    draft: Any = None  # engine.draft.DraftParts: draft-model speculative decoding's model


def load_tokenizer(path: Path, chat_template: str | None = None):
    """The model's tokenizer; `chat_template` (EngineConfig.chat_template, --chat-template) replaces its own."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(*tokenizer_problem(path, e)) from e
    if chat_template is None and tokenizer.chat_template is None:  # a multimodal folder's template may be its
        chat_template = processor_chat_template(path)  # processor's alone (chat_template.json), as vLLM reads it
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def eos_ids(path: Path, model_config, tokenizer) -> set[int]:
    """The tokenizer's EOS and the generation config's (a list allowed), as vLLM stops: the generation config is
    generation_config.json when the folder has one (transformers' generate stops there too, not at a different
    eos_token_id in config.json), else config.json's."""
    ids: set[int] = set()
    gen = path / "generation_config.json"
    generation = getattr(model_config, "eos_token_id", None)
    if gen.is_file():
        try:
            data = json.loads(gen.read_text())
            if isinstance(data, dict) and data.get("eos_token_id") is not None:
                generation = data["eos_token_id"]
        except ValueError:
            pass
    sources = [generation, tokenizer.eos_token_id]
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(x) for x in s)
    return ids


def checkpoint_dtype(model_config) -> torch.dtype | None:
    d = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def model_max_len(model_config, engine_config: EngineConfig) -> int:
    limit, why = context_limit(model_config)
    if engine_config.max_model_len is not None:
        if engine_config.max_model_len > limit:
            raise ConfigError(f"--max-model-len {engine_config.max_model_len} is above the model's limit of "
                              f"{limit}{f' ({why})' if why else ''}", f"use --max-model-len {limit} or less")
        return engine_config.max_model_len
    return limit


def warn_unused_memory_option(engine_config: EngineConfig, device: torch.device) -> None:
    """Once at start: the memory option given that this device's budget does not read
    (EngineConfig.unused_memory_option)."""
    note = engine_config.unused_memory_option(device.type)
    if note:
        log.warning(note)


def check_lora_targets(engine_config: EngineConfig, model_config) -> None:
    """Once at start (an engine's, warmup's): --lora-target-modules names a module the model has (before its load),
    or, without adapters (no --enable-lora, no --lora), a warning that it does nothing (vLLM ignores it too; said, as
    it selects nothing)."""
    if engine_config.loras or engine_config.enable_lora:
        from ..lora.targets import check_target_modules
        check_target_modules(engine_config.lora_target_modules, model_config)
    elif engine_config.lora_target_modules is not None:
        log.warning("--lora-target-modules %s does nothing without adapters: no adapter slots are reserved (pass "
                    "--enable-lora or --lora NAME=PATH to serve adapters on those modules)",
                    ",".join(engine_config.lora_target_modules))


def load_engine_parts(engine_config: EngineConfig) -> EngineParts:
    from ..models.loader import load_config, load_model
    from ..models.resolve import resolve_model
    from ..memory.checkpoint import checkpoint_load_bytes
    from ..memory.plan import check_lora_slots, check_rope_table, plan_memory

    path = resolve_model(engine_config.model)
    model_config = load_config(path)
    check_lora_targets(engine_config, model_config)
    device = engine_config.torch_device()
    warn_unused_memory_option(engine_config, device)
    dtype = engine_config.torch_dtype(checkpoint_dtype(model_config))
    tokenizer = load_tokenizer(path, engine_config.chat_template)
    max_len = model_max_len(model_config, engine_config)
    check_rope_table(engine_config, model_config, device, max_len,
                     lambda: checkpoint_load_bytes(path, model_config, dtype, device))
    model, model_config = load_model(path, dtype, device, max_positions=max_len)  # the rope table: max_len rows
    from .draft import load_draft
    draft = load_draft(engine_config, model_config, dtype, device, max_len, model)  # (None without a draft model)
    lora_manager = None
    if engine_config.loras or engine_config.enable_lora:
        from ..lora.manager import LoRAManager
        check_lora_slots(engine_config, model_config, model, dtype, device)  # before they are allocated
        lora_manager = LoRAManager(model, max_loras=engine_config.max_loras,
                                   max_lora_rank=engine_config.max_lora_rank,
                                   max_cpu_loras=engine_config.max_cpu_loras, device=device, dtype=dtype,
                                   base_path=path, base_name=str(engine_config.model),
                                   target_modules=engine_config.lora_target_modules)
        for name, adapter in engine_config.loras.items():
            lora_manager.register(name, adapter)
    plan = plan_memory(engine_config, model_config, model, dtype, device, max_len,
                       lora_manager.budget_bytes() if lora_manager is not None else 0,
                       draft=(draft.model, draft.model_config) if draft is not None else None)
    return EngineParts(path, model, model_config, tokenizer, dtype, device, max_len,
                       eos_ids(path, model_config, tokenizer), plan.num_blocks, plan, lora_manager, draft)
