"""Options shared by run / serve / bench / warmup, as Annotated aliases, and their conversion to EngineConfig."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ConfigError

ENGINE = "Engine options"
LORA = "LoRA options"

Model = Annotated[str, typer.Argument(help="A local Hugging Face model folder (float or GPTQ), or a built-in model: "
                                           "tiny-llama, tiny-qwen2.", show_default=False)]
Dtype = Annotated[str, typer.Option(help="auto | float32 | float16 | bfloat16 (auto: the checkpoint's dtype on GPU, "
                                         "float32 on CPU).", rich_help_panel=ENGINE)]
Device = Annotated[str, typer.Option(help="auto | cpu | cuda.", rich_help_panel=ENGINE)]
MaxNumSeqs = Annotated[int, typer.Option(help="Most sequences in one step.", rich_help_panel=ENGINE)]
MaxBatchedTokens = Annotated[int, typer.Option(help="Most tokens (prefill + decode) in one step.",
                                               rich_help_panel=ENGINE)]
BlockSize = Annotated[int, typer.Option(help="Tokens per KV cache block.", rich_help_panel=ENGINE)]
MaxModelLen = Annotated[Optional[int], typer.Option(help="Context limit (default: the model's).",
                                                    rich_help_panel=ENGINE)]
Seed = Annotated[int, typer.Option(help="Seed for sampling of requests without their own seed.",
                                   rich_help_panel=ENGINE)]
PrefixCaching = Annotated[bool, typer.Option("--prefix-caching/--no-prefix-caching",
                                             help="Reuse the KV of shared prompt prefixes.", rich_help_panel=ENGINE)]
MemoryLimit = Annotated[Optional[str], typer.Option(help="CPU memory budget for weights, activations and KV cache, "
                                                         "e.g. 8GB (default: half the available RAM).",
                                                    rich_help_panel=ENGINE)]
GpuUtil = Annotated[float, typer.Option(help="Fraction of the GPU's memory the engine may use.",
                                        rich_help_panel=ENGINE)]
Lora = Annotated[Optional[list[str]], typer.Option("--lora", help="An adapter as NAME=PATH (PEFT folder); repeat for "
                                                                  "more.", rich_help_panel=LORA, show_default=False)]
MaxLoras = Annotated[int, typer.Option(help="Adapters resident on the device at once.", rich_help_panel=LORA)]
MaxLoraRank = Annotated[int, typer.Option(help="Largest adapter rank (slots are padded to it).",
                                          rich_help_panel=LORA)]
Eager = Annotated[bool, typer.Option("--eager", help="CUDA: run decode steps eagerly instead of replaying CUDA "
                                                    "graphs (slower; for debugging).", rich_help_panel=ENGINE)]
MaxCpuLoras = Annotated[Optional[int], typer.Option(help="Adapters kept in CPU memory (default: all registered).",
                                                    rich_help_panel=LORA)]

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?i?B?)?\s*$", re.I)


def parse_size(text: str | None) -> int | None:
    """'8GB', '512MiB', '1e9' -> bytes."""
    if text is None:
        return None
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"cannot read the size {text!r}", "write it like 8GB, 512MB or 2GiB")
    unit = (m.group(2) or "").upper().replace("I", "").replace("B", "")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def parse_loras(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {item!r} is not NAME=PATH", "e.g. --lora support=./adapters/support")
        if name in out:
            raise ConfigError(f"--lora name {name!r} is given twice")
        if not Path(path).is_dir():
            raise ConfigError(f"--lora {name}: {path} is not a folder", "pass a PEFT adapter folder")
        out[name] = path
    return out


def engine_config(model: str, dtype: str = "auto", device: str = "auto", max_num_seqs: int = 64,
                  max_num_batched_tokens: int = 4096, block_size: int = 16, max_model_len: int | None = None,
                  seed: int = 0, prefix_caching: bool = True, memory_limit: str | None = None,
                  gpu_memory_utilization: float = 0.9, lora: list[str] | None = None, max_loras: int = 4,
                  max_lora_rank: int = 64, max_cpu_loras: int | None = None, eager: bool = False):
    from ..engine.config import EngineConfig
    return EngineConfig(model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                        max_model_len=max_model_len, seed=seed, enable_prefix_caching=prefix_caching,
                        memory_limit=parse_size(memory_limit), gpu_memory_utilization=gpu_memory_utilization,
                        loras=parse_loras(lora), max_loras=max_loras, max_lora_rank=max_lora_rank,
                        max_cpu_loras=max_cpu_loras, enforce_eager=eager)
