"""The memory plan: budget = weights + peak activations + KV cache, and what that means for max_length.

On CUDA the budget is --gpu-memory-utilization of the device's memory; on CPU it is --memory-limit, or by default
half of the available memory (cgroup limit or free RAM) plus what the weights already use. Activations are
estimated by `activation_bytes` (a formula over the step's shapes, which `infer warmup` checks against a
measurement); KV takes every whole block that is left.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import OutOfMemoryError
from ..models.shapes import ModelShapes
from .config import EngineConfig


def _bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    return 2 * cfg.num_hidden_layers * ModelShapes.from_config(cfg).kv_size * _bytes(dtype)


def activation_bytes(cfg, dtype: torch.dtype, num_tokens: int, num_seqs: int, max_length: int,
                     lora_rank: int = 0) -> int:
    """Peak bytes of one step's temporaries, the larger of a prefill of `num_tokens` tokens and a decode of
    `num_seqs` sequences at context `max_length`."""
    b = _bytes(dtype)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = ModelShapes.from_config(cfg)
    heads, q, kv = shapes.num_heads, shapes.q_size, shapes.kv_size
    # prefill: residual + normed input, then the MLP's gate_up, silu(gate) and its product live together
    per_token = 2 * h + max(q + 2 * kv + 2 * (q + kv) + q, 4 * inter) + 2 * lora_rank
    prefill = num_tokens * per_token * b
    # decode: every sequence's K and V gathered for attention, plus float32 scores
    decode = num_seqs * max_length * (2 * kv * b + heads * 4) + num_seqs * per_token * b
    logits = min(num_tokens, max(num_seqs, 1)) * cfg.vocab_size * 4 * 3  # logits, log-softmax, a copy
    return max(prefill, decode) + logits


def cuda_graph_bytes(config: EngineConfig, cfg, dtype: torch.dtype) -> int:
    """The decode CUDA graphs' private memory pool (engine.cuda_graphs): the temporaries of one decode step of the
    largest bucket, which the graphs keep for themselves, and the attention partials of every sequence."""
    if not config.use_cuda_graphs():
        return 0
    rank = config.max_lora_rank if config.loras else 0
    step = activation_bytes(cfg, dtype, config.max_num_seqs, 1, 1, rank)
    shapes = ModelShapes.from_config(cfg)
    parts = -(-(config.max_model_len or cfg.max_position_embeddings) // 512)  # kernels.attention.PARTITION
    return step + config.max_num_seqs * shapes.num_heads * parts * (shapes.head_dim + 2) * 4


def dequant_scratch_bytes(model, dtype: torch.dtype, num_tokens: int) -> int:
    """The buffer a large prefill dequantizes the biggest GPTQ layer into before cuBLAS (kernels.gptq_gemm),
    when steps can be long enough to take that path (more than 256 tokens); 0 on CPU or without GPTQ layers."""
    if num_tokens <= 256:
        return 0
    sizes = [m.qweight.numel() * (32 // m.method.config.bits) for m in model.modules()
             if hasattr(m, "qweight") and getattr(m, "weight", None) is None and m.qweight.is_cuda]
    return max(sizes, default=0) * _bytes(dtype)


def weights_bytes(model) -> int:
    """Parameters and buffers (including CPU-prepacked matmul weights)."""
    tensors = list(model.parameters()) + [t for t in model.buffers() if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def available_cpu_memory() -> int:
    """Free RAM, or the cgroup limit minus usage when that is smaller."""
    import psutil
    avail = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(usage_file) as f:
                    avail = min(avail, int(limit) - int(f.read()))
            break
        except (OSError, ValueError):
            continue
    return max(0, avail)


def device_total(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    import psutil
    return psutil.virtual_memory().total


def budget_bytes(config: EngineConfig, device: torch.device, weights: int, loaded: bool = True) -> int:
    """What the engine may use in all: weights + activations + KV cache."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        others = total - free - (torch.cuda.memory_reserved(device) if loaded else 0)  # other processes
        return int(total * config.gpu_memory_utilization) - max(0, others)
    if config.memory_limit:
        return config.memory_limit
    return int(available_cpu_memory() * 0.5) + (weights if loaded else 0)


@dataclass
class MemoryPlan:
    device: str
    total_bytes: int
    budget_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    lora_bytes: int
    reserve_bytes: int  # allocator fragmentation and per-step bookkeeping that no single step shows
    kv_bytes_per_token: int
    kv_block_bytes: int
    block_size: int
    kv_blocks: int
    max_length: int
    concurrency: int
    measured: bool = False

    @property
    def num_blocks(self) -> int:
        return self.kv_blocks

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    @property
    def max_concurrency_at_max_length(self) -> int:
        return self.kv_blocks // self.blocks_for(self.max_length)

    @property
    def max_length_at_concurrency(self) -> int:
        return min(self.max_length_limit, (self.kv_blocks // max(self.concurrency, 1)) * self.block_size)

    max_length_limit: int = 0  # the model's context limit

    @property
    def fits(self) -> bool:
        return self.max_concurrency_at_max_length >= self.concurrency

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(fits=self.fits, max_concurrency_at_max_length=self.max_concurrency_at_max_length,
                 max_length_at_concurrency=self.max_length_at_concurrency, kv_block_bytes=self.kv_block_bytes)
        return d

    def advice(self) -> str:
        """What to change when it does not fit (vLLM-style 'estimated maximum model length')."""
        tips = []
        if self.max_length_at_concurrency > 0:
            tips.append(f"lower --max-length to {self.max_length_at_concurrency}")
        if self.max_concurrency_at_max_length > 0:
            tips.append(f"lower --concurrency to {self.max_concurrency_at_max_length}")
        tips.append("raise --gpu-memory-utilization" if self.device == "cuda" else "raise --memory-limit")
        return ", or ".join(tips)


def runtime_reserve(budget: int) -> int:
    """1% of the budget (at least 4 MiB) kept free for allocator fragmentation and the engine's own objects, which
    grow over a long run but never show in one warmup step."""
    return max(4 << 20, budget // 100)


def make_plan(config: EngineConfig, cfg, dtype: torch.dtype, device: torch.device, weights: int, activation: int,
              max_length: int, concurrency: int, max_length_limit: int, lora: int = 0, measured: bool = False,
              budget: int | None = None) -> MemoryPlan:
    per_token = kv_bytes_per_token(cfg, dtype)
    block = per_token * config.block_size
    budget = budget_bytes(config, device, weights) if budget is None else budget
    reserve = runtime_reserve(budget)
    kv_blocks = max(0, budget - weights - activation - lora - reserve) // block
    return MemoryPlan(device.type, device_total(device), budget, weights, activation, lora, reserve, per_token, block,
                      config.block_size, int(kv_blocks), max_length, concurrency, measured, max_length_limit)


def _start_plan(config: EngineConfig, cfg, model, dtype, device, max_len: int, lora_bytes: int) -> MemoryPlan:
    act = activation_bytes(cfg, dtype, config.max_num_batched_tokens, config.max_num_seqs, max_len,
                           config.max_lora_rank if config.loras else 0) + cuda_graph_bytes(config, cfg, dtype) \
        + dequant_scratch_bytes(model, dtype, config.max_num_batched_tokens)
    plan = make_plan(config, cfg, dtype, device, weights_bytes(model), act, max_len, 1, max_len, lora_bytes)
    if config.num_kv_blocks:
        plan.kv_blocks = config.num_kv_blocks
    else:  # never more than can be in use at once (CPU), or twice that (CUDA: room for the prefix cache)
        most = config.max_num_seqs * plan.blocks_for(max_len) + config.max_num_seqs
        plan.kv_blocks = min(plan.kv_blocks, most if device.type == "cpu" else 2 * most)
    return plan


def largest_fitting_len(config: EngineConfig, cfg, model, dtype, device, max_len: int, lora_bytes: int = 0) -> int:
    """The largest max_model_len below `max_len` whose own plan holds one sequence (activations shrink with the
    length, so this is more than the KV left at `max_len`); 0 if none does. A binary search: fitting is monotone."""
    def fits(n: int) -> bool:
        plan = _start_plan(config, cfg, model, dtype, device, n, lora_bytes)
        return plan.kv_blocks >= plan.blocks_for(n)
    lo, hi = 0, max_len - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan_memory(config: EngineConfig, cfg, model, dtype, device, max_len: int, lora_bytes: int = 0) -> MemoryPlan:
    """The engine's sizing at start: estimated activations, and KV for what can run at once: on CPU no more than
    max_num_seqs sequences of max_len (CPU pages are only used as blocks fill), on CUDA twice that (room for the
    prefix cache) within the budget; --num-kv-blocks overrides both."""
    plan = _start_plan(config, cfg, model, dtype, device, max_len, lora_bytes)
    if plan.kv_blocks < plan.blocks_for(max_len):
        fit = largest_fitting_len(config, cfg, model, dtype, device, max_len, lora_bytes)
        more = "raise --gpu-memory-utilization" if device.type == "cuda" else "raise --memory-limit"
        raise OutOfMemoryError(
            f"a single sequence of {max_len} tokens does not fit: the KV cache gets {plan.kv_blocks} blocks "
            f"({plan.kv_blocks * config.block_size} tokens) after weights {gib(plan.weights_bytes)} and activations "
            f"{gib(plan.activation_peak_bytes)} within a budget of {gib(plan.budget_bytes)}; "
            f"estimated maximum model length is {fit}",
            f"use --max-model-len {fit} or less, or {more}" if fit > 1 else more)
    return plan


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"
