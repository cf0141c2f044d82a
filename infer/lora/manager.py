"""Which adapters are known, which sit in CPU memory, and which occupy the device slots.

Registered adapters (name -> folder) are validated once at `register`. Their weights are kept in a CPU LRU of at
most `max_cpu_loras` adapters (an evicted one is read from its folder again when needed). `max_loras` device slots
hold the weights every LoRALayer computes with; `acquire` swaps an adapter into a free slot, else into the least
recently used slot that no running request pins, and pins it until `release`.

Adapters can come and go while the engine runs (`LLMEngine.add_lora` / `remove_lora`): `load` reads and validates
a folder without touching the registry (a server does it off the engine thread), `add` registers what it read.
`retire` takes a name away from new requests at once; the requests already holding it run on with it, and
`unregister` frees its slot and memory once none is left (the engine decides when). `replace` puts new weights
under a name in use: the old ones are retired under a private key for the requests that hold them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import LoRAError, LoRANameError, OutOfMemoryError
from ..models.layers import MergedLinear
from ..models.moe import SparseMoeBlock, experts_adapted, shared_adapted
from ..models.registry import UNGATED
from .adapter import LoRAAdapter, adapter_path, load_adapter
from .batch import LoRABatch
from .experts import ExpertLoRA, expert_names
from .layer import LoRALayer
from .targets import check_adapter_targets, check_target_modules, module_proj, selects, slot_scope

log = logging.getLogger("infer")


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 base_path: Path | None = None, base_name: str | None = None,
                 target_modules: list[str] | None = None):
        """`base_path` / `base_name`: the base model's folder and the name it was given by; with them, an adapter
        whose adapter_config.json names another base model is logged as a warning when added (as lora-validate
        warns), since its sizes may fit by chance. `target_modules` (--lora-target-modules, lora.targets): only
        those layers get slots (None: every layer), and an adapter with weights on another is refused."""
        if max_loras < 1 or max_lora_rank < 1 or (max_cpu_loras is not None and max_cpu_loras < 1):
            raise LoRAError(f"max_loras={max_loras}, max_lora_rank={max_lora_rank}, max_cpu_loras={max_cpu_loras}",
                            "each must be at least 1")
        adapted = experts_adapted(model.config)  # (Llama 4's and LFM2-MoE's experts: no slots)
        linears = [m for m in model.modules() if isinstance(m, MergedLinear)
                   and not getattr(m, "output_head", False)  # a GPTQ lm_head: adapters never target it
                   and not getattr(m, "absorbed", False)  # (MLA's kv_b_proj: models.deepseek, never run as a layer)
                   and shared_adapted(model.config, m.names[0])]
        self.base_config = model.config
        self.target_modules = target_modules
        self._chosen = check_target_modules(target_modules, model.config)
        self.base_path, self.base_name = base_path, base_name
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.device = torch.device(device) if device is not None else _device_of(linears)
        self.dtype = dtype or (linears[0].dtype if linears else torch.float32)
        self._where: dict[str, tuple[LoRALayer, int]] = {}  # HF module path -> (its layer, shard index)
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and adapted]
        # the HF module paths of the layers --lora-target-modules leaves without slots
        self._left_out = {n for m in linears for n in m.names if not selects(self._chosen, module_proj(n))}
        if not selects(self._chosen, "experts.gate_up_proj"):
            self._left_out.update(n for block in blocks for n in expert_names(block))
            blocks = []
        linears = [m for m in linears if not self._left_out.issuperset(m.names)]
        self.layers: list[LoRALayer] = []
        self.linears = linears  # self.layers[i] is linears[i].lora
        self.expert_layers: list[ExpertLoRA] = []  # a mixture of experts' sparse layers' experts (lora.experts)
        try:
            for linear in linears:
                linear.lora = LoRALayer(linear, max_loras, max_lora_rank, self.device, self.dtype)
                self.layers.append(linear.lora)
                for i, name in enumerate(linear.names):
                    self._where.setdefault(name, (linear.lora, i))  # a fused module: its first shard
            for block in blocks:
                block.lora = ExpertLoRA(block, max_loras, max_lora_rank, self.device, self.dtype)
                self.expert_layers.append(block.lora)
                for name in block.lora.names:
                    self._where[name] = (block.lora, 0)
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError and CPU's ENOMEM are RuntimeErrors
            for holder in [*linears, *blocks]:
                holder.lora = None
            self.layers.clear()
            self.expert_layers.clear()
            if not isinstance(e, MemoryError) and "memory" not in str(e).lower():
                raise
            raise OutOfMemoryError(f"the adapter slots (--max-loras {max_loras} x --max-lora-rank {max_lora_rank} "
                                   f"on {slot_scope(target_modules)}) do not fit in memory "
                                   f"({str(e).splitlines()[0][:200]})",
                                   "lower --max-loras or --max-lora-rank (`infer warmup --estimate` counts the "
                                   "slots without allocating them)") from None
        self._paths: dict[str, Path] = {}
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._pins: dict[str, int] = {}
        # name -> its weights, kept until its last request ends (None: its folder could not be read any more)
        self._retired: dict[str, LoRAAdapter | None] = {}
        self._registration: dict[str, int] = {}  # name -> which registration it is (a name may be reused)
        self._stamps: dict[str, tuple] = {}  # name -> its folder's stamp when it was added (adapter.folder_stamp)
        self._registrations = 0
        self.swaps = 0  # adapters copied into a device slot
        self.disk_loads = 0  # adapters read from their folder (registration included)

    # ------------------------------------------------------------------------------------------ registry
    def register(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and validate the adapter at `path` under `name`; raises LoRAError if it cannot run on the model."""
        adapter = self.load(name, path)
        self.add(adapter)
        return adapter

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and validate the adapter at `path` (LoRAError if it cannot run on the model) without registering
        it: safe to call from another thread than the engine's."""
        if not isinstance(name, str) or not name:
            raise LoRANameError(
                f"invalid LoRA adapter name {name!r}: it must be a non-empty string",
                "e.g. --lora support=./adapters/support, or LLM.add_lora('support', './adapters/support')")
        if "\x00" in name:  # `replace` keeps old weights under NAME + NUL + a number: a name with a NUL could be one
            raise LoRANameError(f"invalid LoRA adapter name {name!r}: it holds a NUL character", "name it without one")
        return self._read(name, adapter_path(name, path))

    def add(self, adapter: LoRAAdapter) -> None:
        """Register an adapter `load` returned; LoRAError if its name is taken by another folder."""
        name, path = adapter.name, adapter.path
        if name in self._retired:
            raise LoRANameError(f"LoRA adapter {name!r} is being removed: requests accepted before its removal still "
                                "use it", "add it again once they finish, or under another name")
        if name in self._paths and self._paths[name] != path:
            raise LoRANameError(f"LoRA adapter {name!r} is already registered from {self._paths[name]}",
                                "give each adapter folder its own name")
        if self.base_path is not None:
            from .validate import base_name_warning
            warning = base_name_warning(name, adapter.config, SimpleNamespace(path=Path(self.base_path)),
                                        self.base_name or str(self.base_path))
            if warning:
                log.warning("%s (infer lora-validate checks it)", warning)
        self._paths[name] = path
        self._registrations += 1
        self._registration[name] = self._registrations
        self._stamps[name] = adapter.stamp
        self._cache(adapter)

    def replace(self, adapter: LoRAAdapter, in_use: bool = True) -> str | None:
        """Register `adapter` in place of the adapter registered under its name (vLLM's load_inplace): new requests
        get the new weights at once. The old weights are retired under a private key, returned (None when the name
        was free), which the caller moves the requests already holding them to: they finish with the weights they
        started with, and each registration keeps its own prefix-cache key, so no K/V of one is reused by the
        other. `in_use` False: no request holds the old weights (retire's), so their folder is not read again."""
        name = adapter.name
        if name not in self._paths:
            self.add(adapter)
            return None
        old = f"{name}\x00{self._registration[name]}"  # no adapter name holds a NUL: `load` refuses it
        serving = name not in self._retired
        if serving:
            self.retire(name, in_use)
        self._cpu.pop(name, None)  # the retired copy is the one requests use now
        for table in (self._paths, self._resident, self._pins, self._retired, self._registration, self._stamps):
            if name in table:
                table[old] = table.pop(name)
        try:
            self.add(adapter)
        except BaseException:  # the name keeps the old weights
            for table in (self._paths, self._resident, self._pins, self._retired, self._registration, self._stamps):
                if old in table:
                    table[name] = table.pop(old)
            if serving:  # served again (its CPU copy back in the LRU; read from its folder if it had none)
                kept = self._retired.pop(name, None)
                if kept is not None:
                    self._cache(kept)
            raise
        return old

    def cache_key(self, name: str | None) -> tuple[str, int] | None:
        """What the prefix cache keys a request's K/V on: the name and which registration of it, so an adapter
        added again under a name used before (other weights, or the same folder rewritten) never finds the K/V
        the earlier one computed."""
        return None if name is None else (name, self._registration.get(name, 0))

    def retire(self, name: str, in_use: bool = True) -> None:
        """Take `name` away from new requests (`has` is False from now on); requests that already hold it keep
        running with it until `unregister`. Its weights stay in memory (never read from its folder again), beside
        the CPU LRU, whose other adapters keep their copies. `in_use` False: no request holds it (the caller
        unregisters it at once), so its folder is not read again for it."""
        self._require(name)
        adapter = self._cpu.pop(name, None)
        if adapter is None and in_use:
            try:
                adapter = self._reread(name)
            except LoRAError:  # its folder is gone or changed and the CPU LRU had dropped it: removing must still work
                adapter = None  # requests holding its slot finish; one that needs it swapped in fails
        self._retired[name] = adapter

    def retired(self) -> list[str]:
        return list(self._retired)

    def unregister(self, name: str) -> None:
        if self._pins.get(name):
            raise LoRAError(f"LoRA adapter {name!r} is in use by running requests", "wait until they finish")
        self._require(name)
        if name in self._resident:
            slot = self._resident.pop(name)
            for layer in [*self.layers, *self.expert_layers]:
                layer.clear_slot(slot)
        self._cpu.pop(name, None)
        self._pins.pop(name, None)
        self._retired.pop(name, None)
        self._registration.pop(name, None)
        self._stamps.pop(name, None)
        del self._paths[name]

    def has(self, name: str) -> bool:
        """Whether new requests may use `name` (registered and not retired)."""
        return name in self._paths and name not in self._retired

    def names(self) -> list[str]:
        return [n for n in self._paths if n not in self._retired]

    def path_of(self, name: str) -> str:
        """The folder `name` was loaded from (vLLM's `root` of an adapter's /v1/models card)."""
        self._require(name)
        return str(self._paths[name])

    def _require(self, name: str) -> None:
        if name not in self._paths:
            raise LoRAError(f"unknown LoRA adapter {name!r}",
                            f"registered adapters: {', '.join(sorted(self._paths)) or 'none'}")

    def _read(self, name: str, path: Path) -> LoRAAdapter:
        adapter = load_adapter(name, path, self.base_config, self.max_lora_rank, self.dtype)
        self.disk_loads += 1
        missing = [m for m in adapter.modules if m not in self._where and m not in self._left_out]
        if missing:
            raise LoRAError(f"LoRA adapter {name!r} ({path}): adapts {missing[0]}, which the loaded model lacks",
                            "the adapter was trained for another architecture")
        check_adapter_targets(name, adapter.modules, self._chosen, self.target_modules,
                              self.base_config.model_type in UNGATED)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self._cpu[adapter.name] = adapter
        self._cpu.move_to_end(adapter.name)
        while self.max_cpu_loras is not None and len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    def cpu_adapter(self, name: str) -> LoRAAdapter:
        """The adapter's CPU copy, read from its folder again if the CPU LRU dropped it."""
        self._require(name)
        if name in self._retired:
            if self._retired[name] is None:
                raise LoRAError(f"LoRA adapter {name!r} was removed and its folder {self._paths[name]} can no longer "
                                "be read, so it cannot be swapped back in", "resend the request with another adapter")
            return self._retired[name]
        if name not in self._cpu:
            self._cache(self._reread(name))
        self._cpu.move_to_end(name)
        return self._cpu[name]

    def _reread(self, name: str) -> LoRAAdapter:
        """The adapter read from its folder again (the CPU LRU dropped it); LoRAError if it is gone or changed."""
        try:
            adapter = self._read(name, self._paths[name])
        except LoRAError as e:  # it was read and checked when added: its folder was deleted or rewritten since
            raise LoRAError(
                f"{e.message}; it was read when the adapter was added, and its weights had to be read again "
                f"(--max-cpu-loras {self.max_cpu_loras} keeps fewer adapters in CPU memory)",
                "keep adapter folders in place, unchanged, while infer serves them; remove the adapter and add it "
                "again from where it is now") from None
        if adapter.stamp != self._stamps.get(name, adapter.stamp):  # other weights: the prefix cache, running
            raise LoRAError(                                        # requests and the name mean the old ones
                f"LoRA adapter {name!r}: its folder {self._paths[name]} changed since it was added, and its "
                "earlier weights are no longer in memory", "add the new weights under a new name (or remove "
                "and add it again); keep adapter folders unchanged while infer serves them")
        return adapter

    def rank_of(self, name: str) -> int:
        """The adapter's largest rank over its modules."""
        return self.cpu_adapter(name).rank

    def device_bytes(self) -> int:
        """Bytes of the stacked A/B slot tensors of every layer (the LoRA slots' memory)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in [layer.lora_a, layer.lora_bt]) + \
            sum(t.numel() * t.element_size() for layer in self.expert_layers for t in layer.tensors())

    def host_bytes(self) -> int:
        """Bytes of the adapters' CPU copies it holds (the CPU LRU's, and the weights retired adapters keep)."""
        held = {id(a): a for a in [*self._cpu.values(), *self._retired.values()] if a is not None}
        return sum(a.nbytes for a in held.values())

    def budget_bytes(self) -> int:
        """What the adapters take of the memory budget: the device slots, and on a CPU, whose budget
        (--memory-limit) is the process's memory, the adapters' CPU copies too."""
        return self.device_bytes() + (self.host_bytes() if self.device.type == "cpu" else 0)

    def cpu_resident(self) -> list[str]:
        return list(self._cpu)

    # ------------------------------------------------------------------------------------------ device slots
    def slot_of(self, name: str | None) -> int:
        """The device slot of an acquired adapter, -1 for None (base model)."""
        if name is None:
            return -1
        if name not in self._resident:
            raise LoRAError(f"LoRA adapter {name!r} is not in a device slot", "acquire() it before running its tokens")
        return self._resident[name]

    def resident(self) -> dict[str, int]:
        return dict(self._resident)

    def _victim(self) -> int | None:
        """A free slot, else the slot of the least recently used adapter no request pins, else None."""
        used = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        return next((slot for n, slot in self._resident.items() if not self._pins.get(n)), None)

    def can_acquire(self, name: str | None) -> bool:
        """Whether `acquire` would not have to wait for a slot. True for a name not registered (any more): its
        acquire raises, which fails the request, where waiting for a slot would keep it waiting for ever."""
        return name is None or name in self._resident or name not in self._paths or self._victim() is not None

    def acquire(self, name: str | None) -> int:
        """Pin `name` in a device slot (swapping it in if needed) and return the slot; -1 for None."""
        if name is None:
            return -1
        self._require(name)
        if name not in self._resident:
            slot = self._victim()
            if slot is None:
                raise LoRAError(f"no free LoRA slot for adapter {name!r}: all {self.max_loras} hold adapters of "
                                "running requests", "raise --max-loras or wait for requests to finish")
            self._swap_in(name, slot)
        self._resident.move_to_end(name)
        self._pins[name] = self._pins.get(name, 0) + 1
        return self._resident[name]

    def release(self, name: str | None) -> None:
        """Unpin one use of `name`; the adapter stays in its slot until another one needs the slot."""
        if name is None:
            return
        assert self._pins.get(name, 0) > 0, f"release({name!r}) without a matching acquire"
        self._pins[name] -= 1

    def pins(self, name: str) -> int:
        return self._pins.get(name, 0)

    def _swap_in(self, name: str, slot: int) -> None:
        adapter = self.cpu_adapter(name)
        old = next((n for n, s in self._resident.items() if s == slot), None)
        if old is not None:
            del self._resident[old]
        for layer in self.layers:
            layer.set_slot(slot, layer.shard_modules(adapter.modules))
        for experts in self.expert_layers:
            experts.set_slot(slot, adapter.modules)
        self._resident[name] = slot
        self.swaps += 1

    # ------------------------------------------------------------------------------------------ per step
    def compile_calls(self, max_tokens: int) -> list:
        """Callables that compile every LoRA kernel variant the layers can launch for steps of up to max_tokens
        tokens (`LoRALayer.compile_calls`, once per distinct layer shape), for an engine start to run in parallel."""
        calls, seen = [], set()
        for linear, layer in zip(self.linears, self.layers):
            key = layer.compile_key(linear)
            if key not in seen:
                seen.add(key)
                calls += layer.compile_calls(linear, max_tokens)
        return calls

    def make_batch(self, token_slots, on_device: torch.Tensor | None = None, groups=None) -> LoRABatch | None:
        """The per-step `ctx.lora` from every token's slot (list of ints or a tensor); None when all are -1.
        `on_device`: the same slots already on the device (int64), and `groups` their LoRAGroups (batch.host_groups,
        on the device), so nothing is copied or computed on the device."""
        return LoRABatch.build(token_slots, self.max_loras, self.device, on_device, groups)


def _device_of(linears: list[MergedLinear]) -> torch.device:
    for linear in linears:
        for t in list(linear.parameters()) + list(linear.buffers()):
            return t.device
    return torch.device("cpu")
