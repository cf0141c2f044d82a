"""EngineConfig: every engine option, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # None: sized from the memory budget
    memory_limit: int | None = None  # bytes (CPU budget); None: a fraction of available memory
    gpu_memory_utilization: float = 0.90
    loras: dict[str, str] = field(default_factory=dict)  # name -> adapter folder
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    enforce_eager: bool = False  # CUDA: no decode graphs (engine.cuda_graphs)

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in ("auto", *_DTYPES), f"--dtype {self.dtype!r} is not one of auto, float32, float16, bfloat16"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"--device {self.device!r} is not one of auto, cpu, cuda"),
            (self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1,
             f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}"),
            (self.block_size >= 1 and self.block_size <= 256, f"--block-size must be in 1..256, got {self.block_size}"),
            (self.max_model_len is None or self.max_model_len >= 1,
             f"--max-model-len must be at least 1, got {self.max_model_len}"),
            (0 < self.gpu_memory_utilization <= 1,
             f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}"),
            (self.max_loras >= 1, f"--max-loras must be at least 1, got {self.max_loras}"),
            (1 <= self.max_lora_rank <= 256, f"--max-lora-rank must be in 1..256, got {self.max_lora_rank}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked but no CUDA GPU is visible", "use --device cpu")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device().type == "cpu":
            return torch.float32
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.float16

    def use_cuda_graphs(self) -> bool:
        return self.torch_device().type == "cuda" and not self.enforce_eager
