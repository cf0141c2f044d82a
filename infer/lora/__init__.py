"""Batched multi-LoRA: PEFT adapters on the base model, one batch mixing adapters (S-LoRA / vLLM style).

Every token of a flat batch carries the device slot of its request's adapter (-1 = base model only); each
MergedLinear's `layer.lora` (a LoRALayer) adds `scaling * x @ A[slot]^T @ B[slot]^T` per token with
`kernels.lora_apply` (on the GPU one shrink and one expand launch for all of the layer's shards and slots), so no
batch is split by adapter.

What the engine does:

1. Setup: `mgr = LoRAManager(model, max_loras, max_lora_rank, max_cpu_loras, device, dtype)` after the weights are
   loaded (it attaches a LoRALayer to every MergedLinear of `model`), then `mgr.register(name, folder)` for every
   adapter (validates it against `model.config`; raises LoRAError naming the adapter). Use `mgr.has(name)` /
   `mgr.names()` to validate requests.
2. Scheduler: admit a request with adapter `name` (or None) only if `mgr.can_acquire(name)`; on admission call
   `mgr.acquire(name)` (pins the adapter in a device slot, swapping it in if needed); when the request finishes or
   is preempted call `mgr.release(name)` exactly once per acquire. None is accepted everywhere (no adapter).
3. Model runner, every step: build `token_slots`, one int per token of the flat batch in batch order,
   `mgr.slot_of(seq.lora)` (-1 for None), then set `ctx.lora = mgr.make_batch(token_slots)` (None when no token
   uses an adapter, so the base path costs nothing). Slots must not change between make_batch and the forward:
   acquire/release only happen in the scheduler, before `prepare`.
4. Stats: `mgr.swaps` (adapters copied into a device slot), `mgr.disk_loads` (adapter folders read).

`infer lora-validate`: `adapter_problems(name, folder, base_config, max_rank)` returns every Problem (str() gives
"message (hint)"); [] means the adapter can be served.
"""

from .adapter import LoRAAdapter, LoRAModule, Problem, adapter_problems, load_adapter, read_adapter
from .batch import LoRABatch, LoRAGroups, lora_groups
from .layer import LoRALayer
from .manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRAModule", "Problem", "adapter_problems", "load_adapter", "read_adapter",
           "LoRABatch", "LoRAGroups", "LoRALayer", "LoRAManager", "lora_groups"]
