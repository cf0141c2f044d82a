"""Sleep mode (vLLM's enable_sleep_mode): give the device memory of the weights and of the KV cache back between
uses of an engine, without closing it (an RLHF loop's trainer, or another model, takes the GPU meanwhile).

Each tensor keeps its object and its views (a layer's k_cache is a view of the runner's cache, a tied head shares
the embeddings' storage): what is freed is the storage under them, resized to 0 bytes (`storage.resize_(0)`), and
what wakes is the same storage at its size again, at a new address (the CUDA graphs, which recorded the old ones,
are captured again; LLMEngine.sleep / wake_up). Level 1 copies the weights' bytes to host memory first and back on
wake_up; level 2 keeps no copy (the weights wake as garbage until LLMEngine.reload_weights loads them again). The
KV cache is never copied: it wakes zeroed, and the prefix cache is forgotten. A LoRA adapter's slots and a draft
model's weights are copied at both levels (reload_weights reloads the base model's checkpoint only)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)  # vLLM's wake_up tags
# vLLM's sleep modes (its PauseMode): what becomes of the requests the engine holds when sleep() is called.
# "abort": they end now (finish_reason "abort"); "wait": they run to their end first, then the memory is freed;
# "keep": they are paused (their KV blocks freed, recomputed on waking) and go on once the engine is awake again
MODES = ("abort", "wait", "keep")
KV_ATTRS = ("k_cache", "v_cache", "conv_state", "rec_state")  # the KV cache's views, a linear layer's states
KV_ATTRS += ("conv_snap", "rec_snap")  # and their snapshots (a hybrid model's prefix cache: engine.state_cache)
# the error of a request sleep() aborted (its finish_reason "abort"): the server tells it from a shutdown's abort
SLEPT = "the engine was put to sleep (sleep mode) before the request finished"
# the error of a request pause_generation(mode="abort") ended: the server answers it as vLLM's, finish_reason "abort"
PAUSED = "generation was paused (pause_generation, mode \"abort\") before the request finished"


def module_tensors(modules) -> list[torch.Tensor]:
    """Every tensor the modules hold: parameters, buffers and plain tensor attributes (a list of tensors too), the
    KV cache's views left out."""
    out: list[torch.Tensor] = []
    for mod in modules:
        out += [t for t in mod._parameters.values() if t is not None]
        out += [t for t in mod._buffers.values() if t is not None]
        out += object_tensors(mod, skip=KV_ATTRS)
    return out


def object_tensors(obj, skip=()) -> list[torch.Tensor]:
    """The tensors among an object's attributes (and in its lists and tuples of them)."""
    out: list[torch.Tensor] = []
    for name, value in vars(obj).items():
        if name in skip:
            continue
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += [v for v in value if isinstance(v, torch.Tensor)]
    return out


def _storages(tensors, device: torch.device, exclude=()) -> list:
    """The distinct non-empty storages of the tensors on `device` (a view and its base, tied weights: once), less
    those of `exclude`."""
    seen = {id(s) for s in exclude}
    keys, out = set(), []
    for t in tensors:
        if t.device != device:
            continue
        try:
            s = t.untyped_storage()
        except NotImplementedError:  # an opaque tensor (a CPU matmul's oneDNN-packed weight): left as it is
            continue
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() == 0 or key in keys or id(s) in seen:
            continue
        keys.add(key)
        out.append(s)
    return out


def _bytes(storage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def free(tensors, device: torch.device) -> None:
    """Free the storages of the tensors on `device` (resized to 0 bytes: their contents are not needed again)."""
    for s in _storages(tensors, device):
        s.resize_(0)


@dataclass
class _Slept:
    storage: object
    nbytes: int
    copy: torch.Tensor | None  # its bytes in host memory; None: discarded (level 2's weights, the KV cache)


@dataclass
class SleepState:
    """An engine's sleep: the tags asleep (vLLM's: "weights", "kv_cache"), the level it went to sleep at, the storages
    freed per tag, and whether the weights were discarded (level 2) and not loaded again since."""
    level: int = 0
    tags: set = field(default_factory=set)
    slept: dict = field(default_factory=dict)  # tag -> list[_Slept]
    discarded: bool = False
    paused: bool = False  # sleep(mode="keep"): the requests it paused wait for the engine to be awake (and loaded)

    @property
    def asleep(self) -> bool:
        return bool(self.tags)

    def sleep(self, level: int, device: torch.device, weights: list[torch.Tensor], kept: list[torch.Tensor],
              kv: list[torch.Tensor]) -> int:
        """Free the storages of `weights` (copied to host memory at level 1, discarded at level 2), of `kept`
        (copied at both levels) and of `kv` (discarded). Returns the bytes freed on the device."""
        kv_storages = [t.untyped_storage() for t in kv]
        kv_keys = {(s.data_ptr(), s.nbytes()) for s in kv_storages}
        every = _storages([*weights, *kept], device)
        discard = {(s.data_ptr(), s.nbytes()) for s in _storages(weights, device)} if level == 2 else set()
        pin = device.type == "cuda"
        slept, freed = [], 0
        with torch.no_grad():
            for s in every:
                key = (s.data_ptr(), s.nbytes())
                if key in kv_keys:  # (a view of the cache among a module's tensors)
                    continue
                copy = None
                if key not in discard:
                    copy = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
                    copy.copy_(_bytes(s))
                slept.append(_Slept(s, s.nbytes(), copy))
            caches = [_Slept(s, s.nbytes(), None) for s in _storages(kv, device)]
            for entry in slept + caches:
                freed += entry.nbytes
                entry.storage.resize_(0)
        self.slept = {WEIGHTS: slept, KV_CACHE: caches}
        self.level, self.tags, self.discarded = level, set(TAGS), self.discarded or level == 2
        return freed

    def wake(self, tag: str) -> None:
        """The storages of `tag` at their size again, the copied ones holding their bytes again."""
        with torch.no_grad():
            for entry in self.slept.pop(tag, []):
                entry.storage.resize_(entry.nbytes)
                if entry.copy is not None:
                    _bytes(entry.storage).copy_(entry.copy)
                elif tag == KV_CACHE:  # zeros, as a new engine's: a short row's padded block table reads a block
                    _bytes(entry.storage).zero_()  # it holds no K/V of (masked, but NaN bytes would reach it)
        self.tags.discard(tag)
        if not self.tags:
            self.level = 0
