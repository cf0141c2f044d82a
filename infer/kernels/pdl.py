"""Programmatic dependent launch (PDL, Hopper and newer) for the Triton kernels of a model step.

A decode step is a chain of a few hundred small kernels (per layer: norm, int4 matmuls, rotary, attention,
activation), each of which waits for the one before it to finish completely before its own programs are even
placed on the GPU: a launch latency and a pipeline fill per kernel, in which the memory system idles. With PDL a
kernel is launched with CUDA's programmatic stream serialization (Triton's `launch_pdl`), so its programs may start
while the kernel before it still runs, as soon as every program of that one has said so
(`gdc_launch_dependents`). Until it executes `gdc_wait`, which returns when the kernel before has completed and its
writes are visible, a program may only do work that depends on nothing the step computes: the int4 matmuls
prefetch the first K steps of their packed weights into L2 there (`prefetch_rows`), so that the weights stream in
while the previous kernel (the attention, a norm) finishes.

The rules every kernel here keeps when its PDL constexpr is set (`start` at its top):
- every program calls `gdc_wait` unconditionally, before any load of step data and any store or atomic: a kernel
  completes only after all its programs waited, so the completion of the kernel before implies that of every
  earlier one (a kernel whose programs exited without waiting would break that chain);
- before the wait it reads only the weights (constant while the engine runs), through L2 prefetches;
- `gdc_launch_dependents` right at the top: the next kernel's programs are placed only once every program of this
  one has started, so they never take an SM that this kernel still needs.

The host side: `configure(device, want)` at the engine start decides per device (True: on for compute capability
9.0 and newer when this Triton has the GDC ops, after a probe graph with two PDL launches replays correctly; None
and False: off). It is off by default because it cost time where it was measured: on an H100 (2026-11-27, 7B int4,
CUDA graphs) a decode step took 4.14 ms with PDL and 3.69 ms without at 16 concurrent, 8.52 and 7.96 ms at 64: the
early-placed programs of the next kernel hold SM slots that the running split-K matmul could use
(`gpu_e2e --compare-pdl` measures it again).
`on(device)` is what every launcher asks, and `launch(device)` gives the launch's extra keyword. Both the constexpr
and the launch attribute come from the same answer: a kernel launched with PDL but compiled without the wait would
read its inputs before they are written.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

try:  # Triton 3.4 and newer
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off, and these stand-ins are never reached
    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass
    HAVE_GDC = False

log = logging.getLogger("infer")

_ON: dict = {}  # torch.device (with its index) -> whether the kernels on it launch with PDL
_FORCED: list = []  # a stack of forced answers (kernel-sass compiles the PDL variants for sm_90 on a CPU)
PREFETCH_CHOICES = (0, 1, 2, 4, 8, 16)
# K steps (of BLOCK_K input rows) of its packed weights an int4 matmul asks into L2 before its wait (0: none); None:
# INFER_PDL_PREFETCH, default 2 (`python -m infer.bench.kernels --pdl --pdl-prefetch 0 2 8` times the choices)
prefetch_steps: int | None = None


def prefetch() -> int:
    """The K steps of weights the int4 matmuls prefetch before their wait (`prefetch_steps`, else the environment's
    INFER_PDL_PREFETCH, else 2); ConfigError for a value that is not one of PREFETCH_CHOICES."""
    global prefetch_steps
    if prefetch_steps is None:
        value = os.environ.get("INFER_PDL_PREFETCH", "2").strip()
        if not value.isdigit() or int(value) not in PREFETCH_CHOICES:
            from ..errors import ConfigError
            raise ConfigError(f"INFER_PDL_PREFETCH={value!r} is not a number of K steps the int4 matmuls can "
                              f"prefetch", f"use one of {', '.join(map(str, PREFETCH_CHOICES))} (default 2), or "
                              "unset it")
        prefetch_steps = int(value)
    return prefetch_steps


@triton.jit
def start(PDL: tl.constexpr):
    """The top of a kernel of the step: with PDL, let the next kernel launch, then wait for the previous one."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


PREFETCH_PTX = tl.constexpr("prefetch.global.L2 [$1];\n\tmov.b32 $0, 0;")


@triton.jit
def prefetch_rows(base, row0, rows_end, stride, col0, cols_end, ROWS: tl.constexpr, COLS: tl.constexpr,
                  LINE: tl.constexpr):
    """Ask L2 for rows row0 .. row0 + ROWS (clamped below rows_end) x columns col0 .. col0 + COLS (clamped below
    cols_end) of a row-major matrix, one prefetch per 128-byte line (LINE elements): no register receives data,
    nothing waits, and every address is inside the matrix. For a weight tile before `gdc_wait`."""
    LINES: tl.constexpr = max(1, COLS // LINE)
    rows = tl.minimum(row0 + tl.arange(0, ROWS), rows_end - 1)
    cols = tl.minimum(col0 + tl.arange(0, LINES) * LINE, cols_end - 1)
    tl.inline_asm_elementwise(PREFETCH_PTX, "=r,l", [base + rows[:, None] * stride + cols[None, :]], dtype=tl.int32,
                              is_pure=False, pack=1)


def supported(capability: tuple[int, int]) -> bool:
    """Whether kernels on a GPU of this compute capability can launch with PDL here: sm_90 and newer, a Triton
    with the GDC ops, compiled kernels (the interpreter has no launch attribute to honour)."""
    return HAVE_GDC and tuple(capability) >= (9, 0) and os.environ.get("TRITON_INTERPRET") != "1"


def device_key(device) -> torch.device:
    """`device` as a torch.device with its index (the current one for a bare "cuda"), as tensors carry it: the key of
    the per-device answers made at an engine start (here, and `gptq_gemm.configure_byte_fields`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def on(device) -> bool:
    """Whether the kernels launched on `device` (a torch.device, as tensors carry it) use PDL now."""
    if _FORCED:
        return _FORCED[-1]
    return _ON.get(device, False)


def launch(device) -> dict:
    """The launch keyword of a PDL launch on `device` ({} without PDL: the launch Triton makes by default)."""
    return {"launch_pdl": True} if on(device) else {}


class forced:
    """Within this block every launch uses PDL (True) or not (False) whatever the device: scripts/kernel-sass
    compiles the sm_90 variants of an engine's kernels on a CPU this way."""

    def __init__(self, value: bool):
        self.value = bool(value)

    def __enter__(self):
        _FORCED.append(self.value)
        return self

    def __exit__(self, *exc):
        _FORCED.pop()


@triton.jit
def _probe_kernel(x_ptr, y_ptr, n, ADD: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0 + ADD, mask=mask)


def probe(device: torch.device) -> str | None:
    """Two dependent PDL launches, eagerly and recorded in a CUDA graph, checked against their exact result; None
    when both are right, else what went wrong (an old driver that cannot record programmatic edges, say)."""
    try:
        n, block = 1 << 16, 1024
        x = torch.arange(n, device=device, dtype=torch.float32)
        y, z = torch.empty_like(x), torch.empty_like(x)

        def chain():
            _probe_kernel[(n // block,)](x, y, n, ADD=1.0, PDL=True, BLOCK=block, launch_pdl=True)
            _probe_kernel[(n // block,)](y, z, n, ADD=3.0, PDL=True, BLOCK=block, launch_pdl=True)
        chain()
        want = (x * 2 + 1) * 2 + 3
        if not torch.equal(z, want):
            return "the eager PDL launches computed a wrong result"
        z.zero_()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            chain()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize(device)
        if not torch.equal(z, want):
            return "the PDL launches replayed from a CUDA graph computed a wrong result"
    except Exception as e:  # noqa: BLE001 - any failure means: do not use PDL here
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def configure(device, want: bool | None) -> bool:
    """Decide at an engine start whether the kernels on `device` launch with PDL (want True: where supported and
    the probe passes, with a warning where it cannot be had; None, the default, and False: never, as measured
    slower: see the module's note). Returns the answer."""
    device = device_key(device)
    use = False
    if device.type == "cuda" and want:
        prefetch()  # a bad INFER_PDL_PREFETCH fails the start, not a step
        cap = torch.cuda.get_device_capability(device)
        if not supported(cap):
            if want:
                log.warning("programmatic dependent launch needs compute capability 9.0+ and Triton 3.4+ with "
                            "compiled kernels (this GPU: %d.%d, triton %s): kernels launch without it",
                            cap[0], cap[1], triton.__version__)
        else:
            problem = probe(device)
            if problem is not None:
                log.warning("programmatic dependent launch disabled: %s", problem)
            use = problem is None
    _ON[device] = use
    return use
