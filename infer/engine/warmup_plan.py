"""The two ways `infer warmup` gets its figures: measured on the loaded model, or estimated from files alone."""

from __future__ import annotations

import torch

from .config import EngineConfig
from .memory import MemoryPlan, activation_bytes, budget_bytes, cuda_graph_bytes, make_plan
from .setup import checkpoint_dtype, model_max_len


def _model_parts(config: EngineConfig):
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    path = resolve_model(config.model)
    cfg = load_config(path)
    device = config.torch_device()
    return path, cfg, device, config.torch_dtype(checkpoint_dtype(cfg))


def _limit(cfg, config: EngineConfig) -> int:
    config_no_len = EngineConfig(model=config.model, device=config.device)
    return model_max_len(cfg, config_no_len)


def _check_length(cfg, config: EngineConfig, max_length: int) -> int:
    limit = _limit(cfg, config)
    if max_length > limit:
        from ..errors import ConfigError
        raise ConfigError(f"--max-length {max_length} is above the model's context of {limit}",
                          f"use --max-length {limit} or less")
    return limit


def estimate_plan(config: EngineConfig, max_length: int, concurrency: int) -> tuple[MemoryPlan, dict]:
    from ..models.loader import weight_files
    from .estimate import checkpoint_weights_bytes
    path, cfg, device, dtype = _model_parts(config)
    limit = _check_length(cfg, config, max_length)
    weights = checkpoint_weights_bytes(weight_files(path), cfg, dtype, device)
    rank = config.max_lora_rank if config.loras else 0
    act = activation_bytes(cfg, dtype, config.max_num_batched_tokens, concurrency, max_length, rank)
    act += cuda_graph_bytes(config, cfg, dtype)
    budget = budget_bytes(config, device, weights, loaded=False)
    plan = make_plan(config, cfg, dtype, device, weights, act, max_length, concurrency, limit, budget=budget)
    return plan, {"model": str(path), "dtype": str(dtype).replace("torch.", ""), "estimate": True}


def measured_plan(config: EngineConfig, max_length: int, concurrency: int) -> tuple[MemoryPlan, dict]:
    from ..models.loader import load_model
    from .warmup import fixed_mmap_threshold, measure, resident_bytes
    path, cfg, device, dtype = _model_parts(config)
    limit = _check_length(cfg, config, max_length)
    if device.type == "cpu":
        fixed_mmap_threshold()
    _warm_libraries(dtype, device)
    before = resident_bytes(device)
    model, cfg = load_model(path, dtype, device)
    resident = resident_bytes(device) - before
    lora_manager, largest = None, None
    if config.loras:
        from ..lora.manager import LoRAManager
        lora_manager = LoRAManager(model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                   max_cpu_loras=None, device=device, dtype=dtype)
        for name, adapter in config.loras.items():
            lora_manager.register(name, adapter)
        largest = max(config.loras, key=lora_manager.rank_of)
    budget = budget_bytes(config, device, resident)
    tuning_s = None
    if device.type == "cuda":  # what an engine start adds on this GPU: tuning the int4 matmul for shapes not in a table
        from ..kernels.gptq_tune import tune_model
        tuning_s = tune_model(model, config.max_num_batched_tokens, device)[1]
    with torch.inference_mode():
        plan, estimate = measure(model, cfg, config, dtype, device, max_length, concurrency, limit, lora_manager,
                                 largest, budget)
    extra = {"model": str(path), "dtype": str(dtype).replace("torch.", ""), "estimate": False,
             "activation_estimate_bytes": estimate, "weights_resident_bytes": resident,
             "lora_adapter": largest, "kernel_tuning_s": tuning_s}
    return plan, extra


def _warm_libraries(dtype: torch.dtype, device: torch.device) -> None:
    """Load the math libraries' code and thread pools first, so their memory is not counted as weights."""
    import safetensors.torch  # noqa: F401
    from ..kernels import cpu_gemm
    w = torch.randn(64, 64, dtype=dtype, device=device)
    x = torch.randn(4, 64, dtype=dtype, device=device)
    cpu_gemm.linear(x, w, None, cpu_gemm.prepack(w))
    torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None], is_causal=True)
