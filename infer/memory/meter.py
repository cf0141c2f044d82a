"""Measuring a step's memory: peak bytes above a starting level, from the CUDA allocator's statistics, or on CPU
from the growth of the process's peak resident memory (VmHWM, reset first), with glibc's heap set up so that
resident growth shows what a step really allocates. `infer.engine.profile` runs the step these meters watch."""

from __future__ import annotations

import contextlib
import gc
import os

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return rss_bytes()


def file_rss_bytes() -> int:
    """The process's resident file-backed pages (RssFile: the code of the libraries it runs, files it maps)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


def _libc():
    import ctypes
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_heap() -> None:
    """Give freed heap memory back to the OS, so that what a step reuses shows again as resident growth."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def fixed_mmap_threshold(threshold: int = 4 << 10) -> None:
    """Make glibc serve every allocation of a page or more with mmap and return it on free (no dynamic threshold),
    so that resident-memory growth measures what a step really allocates, whatever the process allocated before.
    A page, not glibc's 128 KiB: a step's tensors under that threshold (a sequence's K and V slices, the router's
    rows) landed in the heap, whose free pages the meter's trim hands back and whose reuse then re-faults them page
    by page, scattered among the heap's older chunks: the peak counted the heap's history, 0.4 to 2.2 MB past the
    step's tensors on tiny models (over the formula: memory.sizes.activation_bytes) and different each run."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (also turns off the dynamic adjustment)
    trim_heap()


@contextlib.contextmanager
def survivors_frozen():
    """Collect garbage once, then freeze what survives (gc.freeze) until the block ends, so that the collections
    each meter makes before it reads (resident_bytes, PeakMeter) scan only what the measured code allocated: in a
    process that holds many Python objects (a server's, a test run's) each full collection took 0.1-0.3 s, and a
    worst-case run makes two a batch. What they free is the same: a cycle of objects from before the block was
    already garbage or still reachable when the block began, and reference counting frees the rest as before.
    Inside a freeze someone else made (gc.get_freeze_count()), nothing changes: unfreezing would undo theirs."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def resident_bytes(device: torch.device) -> int:
    """Memory in use now: the CUDA allocator's, or the process's resident set on CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return rss_bytes()


class PeakMeter:
    """Peak bytes above the level at start: CUDA allocator peak, or the process's peak RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            trim_heap()
            reset_peak_rss()
            self.base = rss_bytes()
            self.files = file_rss_bytes()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            # a library's code paged in while the step runs (a kernel not run since its pages were dropped) is no
            # activation: the growth of resident file pages comes off the peak's
            self.peak = max(0, peak_rss_bytes() - self.base - max(0, file_rss_bytes() - self.files))
        return False
