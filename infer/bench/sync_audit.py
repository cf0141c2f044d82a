"""Find, on a CPU, the calls of the engine's GPU code path that would make the host wait for the GPU.

On CUDA a handful of torch operations copy a value back to the host, or copy host data from pageable memory, and so
block Python until every kernel queued before them has run. One of them in a step's preparation drains the GPU
between steps, which is what overlapped steps (EngineConfig.overlap) exist to avoid, and nothing on a CPU shows it:
the same calls are free there. `SyncAudit` records them while the GPU code path runs on CPU (kernels through the
Triton interpreter, CUDA graphs emulated), each with the line of `infer` that made it:

- operators whose CUDA implementation reads a result back: `.item()`, `int()`, `float()` and `bool()` of a tensor
  (`aten._local_scalar_dense`), `nonzero`, `masked_select`, boolean-mask indexing, `unique`, `bincount` (its CUDA
  kernel reads the largest value to size the output), `repeat_interleave` without `output_size`, `equal`;
- host-to-device copies from pageable memory (`torch.tensor(..., device=...)`, `torch.as_tensor(..., device=...)`),
  which PyTorch finishes with a stream synchronisation, and device-to-host reads (`.tolist()`, `.cpu()`, `.numpy()`).

Inside a Triton launch nothing is recorded (the interpreter's own work is not the engine's), nor inside the one wait
a step is allowed (`StepHandle.result`, the copy of the previous step's sampled tokens). Used by
tests/test_sync_audit.py (tiny models) and `scripts/kernel-sass --engine` (real shapes).

It also counts the host-to-device copies that do not wait (`copies`: each call of `engine.transfer.copy_to`, where
`to_device` and `Pack.to` queue theirs, by the line of `infer` that asked for it): on CUDA each one costs a pinned
allocation and a copy launch, tens of microseconds of host time, so a step's inputs travel together
(`engine.transfer.Pack`); tests/test_sync_audit.py checks how many a step makes.
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent  # the infer package
aten = torch.ops.aten
READS_BACK = {  # operator -> why it waits for the GPU on CUDA
    aten._local_scalar_dense.default: "reads a tensor's value on the host (.item(), int(), float(), bool())",
    aten.nonzero.default: "nonzero: its output size depends on the values",
    aten.masked_select.default: "masked_select: its output size depends on the values",
    aten.bincount.default: "bincount: on CUDA it reads the largest value back to size its output",
    aten.equal.default: "equal: returns a host bool",
    aten.is_nonzero.default: "truth value of a tensor",
    aten._unique2.default: "unique: its output size depends on the values",
    aten.unique_consecutive.default: "unique_consecutive: its output size depends on the values",
    aten.unique_dim.default: "unique: its output size depends on the values",
}
HOST_READS = {"tolist", "cpu", "numpy"}  # Tensor methods that bring device data to the host
MAKERS = {torch.tensor, torch.as_tensor, torch.asarray}


def _site(skip: tuple[str, ...] = ("sync_audit.py",)) -> str | None:
    """file:line function of the innermost frame in infer, files named in `skip` left out (None outside infer)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if ROOT in path.parents and path.name not in skip:
            return f"{path.relative_to(ROOT.parent)}:{frame.lineno} {frame.name}"
    return None


class SyncAudit:
    """with SyncAudit() as audit: ...; audit.found -> [(site, what)], each call that would wait on CUDA;
    audit.copies -> [site], each host-to-device copy made without waiting (`engine.transfer.copy_to`)."""

    def __init__(self):
        self.found: list[tuple[str, str]] = []
        self.copies: list[str] = []
        self._off = 0
        audit = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                why = READS_BACK.get(func)
                if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                    why = "repeat_interleave without output_size: its output size depends on the values"
                if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
                    if any(i is not None and i.dtype == torch.bool for i in args[1]):
                        why = "boolean-mask indexing: runs nonzero"
                if why:
                    audit._record(why)
                return func(*args, **kwargs)

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if func in MAKERS and kwargs.get("device") is not None:
                    audit._record(f"torch.{name}(..., device=...): a host-to-device copy from pageable memory, "
                                  "finished by a stream synchronisation")
                elif name in HOST_READS and isinstance(args[0] if args else None, torch.Tensor):
                    audit._record(f"Tensor.{name}(): reads device data on the host")
                return func(*args, **kwargs)

        self._modes = (Function(), Dispatch())
        self._stack: contextlib.ExitStack | None = None

    def _record(self, why: str) -> None:
        if self._off:
            return
        site = _site()
        if site is not None and "kernels/reference.py" not in site and "kernels/lora_reference.py" not in site:
            self.found.append((site, why))

    @contextlib.contextmanager
    def paused(self):
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        from ..engine import transfer
        from ..engine.model_runner import StepHandle
        self._stack = contextlib.ExitStack()
        for cls, name in ((InterpretedFunction, "run"), (JITFunction, "run"), (StepHandle, "result")):
            self._stack.enter_context(_paused_method(self, cls, name))
        self._stack.enter_context(_counted_copies(self, transfer))
        for mode in self._modes:
            self._stack.enter_context(mode)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def report(self) -> str:
        seen: dict[tuple[str, str], int] = {}
        for item in self.found:
            seen[item] = seen.get(item, 0) + 1
        return "\n".join(f"{site}: {why} (x{n})" for (site, why), n in seen.items())


@contextlib.contextmanager
def _paused_method(audit: SyncAudit, cls, name: str):
    real = getattr(cls, name)

    def paused(*args, **kwargs):
        with audit.paused():
            return real(*args, **kwargs)
    setattr(cls, name, paused)
    try:
        yield
    finally:
        setattr(cls, name, real)


@contextlib.contextmanager
def _counted_copies(audit: SyncAudit, transfer):
    """transfer.copy_to records the site of each call (to_device and Pack.to look it up in their module)."""
    real = transfer.copy_to

    def counted(*args, **kwargs):
        audit.copies.append(_site(("sync_audit.py", "transfer.py")))
        return real(*args, **kwargs)
    transfer.copy_to = counted
    try:
        yield
    finally:
        transfer.copy_to = real
