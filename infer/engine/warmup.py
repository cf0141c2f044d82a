"""Measure the worst case before serving: a prefill of the largest token budget and a decode of a full batch at
max_length (with the largest-rank adapter active when adapters are given). Peak activation memory comes from the
CUDA allocator's statistics, or on CPU from the growth of the process's peak resident memory (VmHWM, reset first)."""

from __future__ import annotations

import gc
import os

import torch

from .config import EngineConfig
from .memory import MemoryPlan, activation_bytes, cuda_graph_bytes, make_plan, weights_bytes
from .model_runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch
from .sequence import Sequence


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


def fixed_mmap_threshold(threshold: int = 128 << 10) -> None:
    """Make glibc serve every large allocation with mmap and return it on free (no dynamic threshold), so that
    resident-memory growth measures what a step really allocates, whatever the process allocated before."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (also turns off the dynamic adjustment)
    trim_heap()


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
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = max(0, peak_rss_bytes() - self.base)
        return False


def _fake_seq(i: int, length: int, vocab: int, table: list[int], computed: int) -> Sequence:
    g = torch.Generator().manual_seed(i)
    s = Sequence(f"warmup-{i}", torch.randint(0, vocab, (length,), generator=g).tolist(),
                 SamplingParams(max_new_tokens=1), None)
    s.block_table, s.num_computed_tokens = table, computed
    return s


def worst_case_batches(cfg, config: EngineConfig, max_length: int, concurrency: int, block_size: int):
    """(prefill batch, decode batch) over one shared set of blocks: all decode sequences point at the same
    max_length blocks, so the attention reads as much as a full batch does without the KV memory of one."""
    vocab = cfg.vocab_size
    table = list(range(-(-max(max_length, config.max_num_batched_tokens) // block_size)))
    prefill, left, i = ScheduledBatch([], []), config.max_num_batched_tokens, 0
    while left > 0 and len(prefill.seqs) < config.max_num_seqs:
        n = min(left, max_length - 1)
        prefill.seqs.append(_fake_seq(i, n, vocab, table, 0))
        prefill.num_new_tokens.append(n)
        left, i = left - n, i + 1
    decode = ScheduledBatch([_fake_seq(100 + j, max_length, vocab, table, max_length - 1)
                             for j in range(concurrency)], [1] * concurrency)
    return prefill, decode, len(table)


def measure(model, cfg, config: EngineConfig, dtype, device, max_length: int, concurrency: int,
            max_length_limit: int, lora_manager=None, lora_name: str | None = None, budget: int | None = None,
            weights: int | None = None):
    """Run the worst case and return (measured plan, estimated activation bytes)."""
    prefill, decode, nblocks = worst_case_batches(cfg, config, max_length, concurrency, config.block_size)
    runner = ModelRunner(config, model, dtype=dtype, device=device, num_blocks=nblocks, lora_manager=lora_manager)
    runner.zero_blocks(list(range(nblocks)))
    lora_bytes = 0
    if lora_manager is not None and lora_name is not None:
        lora_manager.acquire(lora_name)
        for s in prefill.seqs + decode.seqs:
            s.lora = lora_name
        lora_bytes = lora_manager.device_bytes()
    runner.run(prefill)  # first run: one-time allocations (kernels, thread pools) are not activations
    peaks = []
    for batch in (prefill, decode):
        runs = []
        for _ in range(2):  # twice: the first run of a shape also sets up the math libraries' own buffers
            with PeakMeter(device) as meter:
                runner.run(batch)
            runs.append(meter.peak)
        peaks.append(runs[-1])
    if lora_manager is not None and lora_name is not None:
        lora_manager.release(lora_name)
    del runner
    rank = config.max_lora_rank if lora_manager is not None else 0
    graphs = cuda_graph_bytes(config, cfg, dtype)  # the engine's decode graphs keep a pool of their own
    estimate = activation_bytes(cfg, dtype, config.max_num_batched_tokens, concurrency, max_length, rank) + graphs
    weights = weights_bytes(model) if weights is None else weights
    plan = make_plan(config, cfg, dtype, device, weights, max(peaks) + graphs, max_length, concurrency,
                     max_length_limit, lora_bytes, measured=True, budget=budget)
    return plan, estimate
