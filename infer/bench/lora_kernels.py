"""Multi-LoRA kernel micro-benchmark: shrink + expand of every projection of a 7B (or 14B) layer under CUDA graphs,
beside the floor the adapter bytes set at the copy bandwidth measured in the same run.

    python -m infer.bench.kernels --lora --out lora_kernels.csv

Workloads (rank 16, 16 adapter slots, float16): 16 tokens each with its own adapter, 64 tokens over 16 adapters (4 each,
in slot order as the model runner lays out a batch), 64 tokens with one adapter, and a 2048-token prefill over 4
adapters. Each row times `kernels.lora_ops.lora_apply` (one shrink and one expand launch) on one merged projection from
a CUDA graph that cycles through copies of the adapters' weights larger than the L2 cache together
(`gptq_tune.time_graph`, as the int4 matmuls are timed: in a decode step they come from device memory), and reports: the
adapter bytes the step must read (A and B of every adapter in use, rank rows only), the time those bytes take at the
measured device copy bandwidth (the floor), time / floor, and an fp16 `F.linear` of the base projection's shape at the
same token count for scale; the shrink and the expand alone; the expand by token (as an int4 layer's decode step
launches it) in the early load order (`expand_by_token_us`) and the late one, the default since an H200 timed it faster
(`expand_late_us`; `lora_ops.early_loads`; `late_gain` > 1: the late order is faster); and the expand with one set of
weights, which then stays in L2 (`expand_hot_us`: how this bench timed every kernel before 2026-11-27, and how
`lora_ops`' launch constants were chosen; the 7B qkv and gate_up expands at 16 tokens took 5.5 and 7.8 us that way, 12
us each in a step's profile). At 16 and 64 tokens each row also sweeps the shrink's SPLIT_K
(`shrink_split{2,4,8,16}_us`; `pair_split{N}_us`: the by-token shrink at that split and the by-token expand that sums
its partials, one after the other, as a decode step launches them) and the by-token expand's columns per program
(`expand_n{256,512,1024}_us`, in the default load order), the constants `lora_ops.plan` fixes. Up to 64 tokens
the expand as a gather too (`expand_gather_us`, `lora_ops.expand_gather`, INFER_LORA_EXPAND=gather: each program
takes 16 tokens of any adapters; `gather_gain` = expand_us / expand_gather_us, > 1: the gather is faster than
the expand by segments, which a decode graph of more than GATHER_AUTO_TOKENS tokens launches), and its warps a
program swept (`gather_w{1,2,4}_us`). GPU only."""

from __future__ import annotations

import csv
import sys

import torch

RANK, SLOTS = 16, 16
LAYERS = {"7B": {"qkv": (4096, [4096] * 3), "o": (4096, [4096]), "gate_up": (4096, [11008] * 2),
                 "down": (11008, [4096])},
          "14B": {"qkv": (5120, [5120] * 3), "o": (5120, [5120]), "gate_up": (5120, [13696] * 2),
                  "down": (13696, [5120])}}
# decode-sized workloads also sweep the shrink's SPLIT_K and the expand's columns per program (lora_ops' constants)
SWEEP_MAX_TOKENS, SWEEP_SPLITS, SWEEP_BLOCK_N, SWEEP_GATHER_WARPS = 64, (2, 4, 8, 16), (256, 512, 1024), (1, 2, 4)
WORKLOADS = {"16 tok / 16 adapters": (16, 16), "64 tok / 16 adapters": (64, 16), "64 tok / 1 adapter": (64, 1),
             "2048 tok / 4 adapters": (2048, 4)}


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s: (read + write) of a 1 GiB copy, median of do_bench."""
    import triton.testing
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.nbytes / (ms * 1e-3)


def workload(t: int, adapters: int, device="cuda") -> torch.Tensor:
    """Token slots in slot order (as the model runner sorts a batch): adapter i of `adapters` for t/adapters rows."""
    return (torch.arange(t, device=device) * adapters // t).long()


def weight_sets(k: int, outs: list[int], device, min_bytes: int) -> list[tuple]:
    """Enough (lora_a, lora_b) sets of SLOTS random rank-RANK adapters that cycling through them reads at least
    `min_bytes`: in a decode step every layer's adapters come from device memory, not from the L2 cache."""
    n, width = len(outs), sum(outs)
    one = SLOTS * RANK * (n * k + width) * 2
    return [(torch.randn(SLOTS, n * RANK, k, device=device, dtype=torch.float16) * 0.01,
             torch.randn(SLOTS * RANK * width, device=device, dtype=torch.float16) * 0.01)  # flat, shard after shard
            for _ in range(max(1, -(-min_bytes // one)))]


def time_us(fns) -> float:
    """Microseconds per call of the callables, captured in turn into one CUDA graph (`gptq_tune.time_graph`)."""
    from ..kernels.gptq_tune import time_graph
    return time_graph(fns)


def measure(k: int, outs: list[int], t: int, adapters: int, bandwidth: float, device: str = "cuda",
            l2_bytes: int | None = None) -> dict:
    """One projection's row. Every kernel time cycles through copies of the adapters' weights that together
    exceed the L2 cache (`l2_bytes`, default gptq_tune.L2_BUST_BYTES), as the int4 matmuls' are timed: the
    partials and y stay one buffer each (in a step the kernel before just wrote them). `expand_hot_us` is the
    expand on one set of weights, which then sit in L2 (how this bench timed every kernel before 2026-11-27)."""
    from ..kernels import lora_ops
    from ..kernels.gptq_tune import L2_BUST_BYTES
    from ..lora.batch import lora_groups
    n, dev = len(outs), device
    bounds = [sum(outs[:i]) for i in range(n + 1)]
    sets = weight_sets(k, outs, dev, L2_BUST_BYTES if l2_bytes is None else l2_bytes)
    scalings = torch.full((n, SLOTS), 2.0, device=dev)
    ranks = torch.full((n, SLOTS), RANK, dtype=torch.int32, device=dev)
    x = torch.randn(t, k, device=dev, dtype=torch.float16)
    y = torch.zeros(t, bounds[-1], device=dev, dtype=torch.float16)
    slots = workload(t, adapters, dev)
    groups = lora_groups(slots, SLOTS, in_order=True)
    hp = lora_ops.shrink(x, sets[0][0], n, groups, ranks)
    hp_t = lora_ops.shrink(x, sets[0][0], n, groups, ranks, by_token=True)  # as an int4 layer's decode launches it

    def each(op):
        return [lambda a=a, b=b: op(a, b) for a, b in sets]
    us = {
        "lora_us": time_us(each(lambda a, b: lora_ops.lora_apply(x, y, a, b, scalings, bounds, groups, ranks))),
        "shrink_us": time_us(each(lambda a, b: lora_ops.shrink(x, a, n, groups, ranks))),
        "expand_us": time_us(each(lambda a, b: lora_ops.expand(hp, y, b, scalings, bounds, groups, ranks))),
        "expand_hot_us": time_us([lambda: lora_ops.expand(hp, y, sets[0][1], scalings, bounds, groups, ranks)]),
    }
    for name, early in (("expand_by_token_us", True), ("expand_late_us", False)):  # both load orders
        us[name] = time_us(each(lambda a, b, e=early: lora_ops.expand(hp_t, y, b, scalings, bounds, groups, ranks,
                                                                     by_token=True, early=e)))
    if t <= lora_ops.GATHER_MAX_TOKENS:  # the expand as a gather (INFER_LORA_EXPAND=gather), from partials by token
        us["expand_gather_us"] = time_us(each(lambda a, b: lora_ops.expand_gather(hp_t, y, b, scalings, bounds, slots,
                                                                                  ranks)))
    if t <= SWEEP_MAX_TOKENS:  # the launch constants (lora_ops.plan) against the weights from device memory
        for split in SWEEP_SPLITS:
            us[f"shrink_split{split}_us"] = time_us(each(lambda a, b, s=split: lora_ops.shrink(x, a, n, groups, ranks,
                                                                                              split=s)))
            # the pair a decode step launches (by token), the expand summing this split's partials: a finer split
            # feeds more SMs in the shrink and gives every expand program more partials to read
            hp_s = lora_ops.partials(split, t, hp_t.shape[2], dev)

            def pair(a, b, s=split, h=hp_s):
                lora_ops.shrink(x, a, n, groups, ranks, by_token=True, split=s, out=h)
                lora_ops.expand(h, y, b, scalings, bounds, groups, ranks, by_token=True)
            us[f"pair_split{split}_us"] = time_us(each(pair))
        for block_n in SWEEP_BLOCK_N:
            us[f"expand_n{block_n}_us"] = time_us(each(lambda a, b, bn=block_n: lora_ops.expand(
                hp_t, y, b, scalings, bounds, groups, ranks, block_n=bn, by_token=True)))
        for warps in SWEEP_GATHER_WARPS:  # the gather's warps a program (lora_ops.GATHER_WARPS)
            us[f"gather_w{warps}_us"] = time_us(each(lambda a, b, w=warps: lora_ops.expand_gather(
                hp_t, y, b, scalings, bounds, slots, ranks, num_warps=w)))
    w = torch.randn(bounds[-1], k, device=dev, dtype=torch.float16)
    linear_us = time_us([lambda: torch.nn.functional.linear(x, w)])
    used = min(adapters, t)
    adapter_bytes = used * RANK * (n * k + bounds[-1]) * 2
    floor_us = adapter_bytes / bandwidth * 1e6
    p = lora_ops.plan(t, SLOTS, k)
    return {"T": t, "adapters": adapters, "K": k, "N": bounds[-1], "shards": n, **us,
            "late_gain": us["expand_by_token_us"] / us["expand_late_us"],
            **({"gather_gain": us["expand_us"] / us["expand_gather_us"]} if "expand_gather_us" in us else {}),
            "adapter_MB": adapter_bytes / 1e6,
            "floor_us": floor_us, "x_floor": us["lora_us"] / floor_us, "fp16_linear_us": linear_us,
            "split_k": p["split"], "tiles": p["tiles"], "weight_sets": len(sets)}


def run_all(models: list[str]) -> list[dict]:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write of a 1 GiB copy)")
    rows = []
    for model in models:
        for wl, (t, adapters) in WORKLOADS.items():
            per_layer = {"lora_us": 0.0, "floor_us": 0.0}
            for name, (k, outs) in LAYERS[model].items():
                row = {"model": model, "workload": wl, "proj": name, **measure(k, outs, t, adapters, bandwidth),
                       "copy_GBps": bandwidth / 1e9}
                rows.append(row)
                print_row(row)
                per_layer = {key: per_layer[key] + row[key] for key in per_layer}
            print(f"  {model} {wl}: one decoder layer {per_layer['lora_us']:.1f} us of LoRA, floor "
                  f"{per_layer['floor_us']:.1f} us ({per_layer['lora_us'] / per_layer['floor_us']:.2f}x); "
                  f"2 launches per projection", flush=True)
    return rows


def print_row(r: dict) -> None:
    print(f"{r['model']:4s} {r['workload']:22s} {r['proj']:8s} K={r['K']:5d} N={r['N']:5d}  lora {r['lora_us']:7.1f} us"
          f" (shrink {r['shrink_us']:6.1f} + expand {r['expand_us']:6.1f})  floor {r['floor_us']:6.1f} us"
          f" = {r['x_floor']:5.2f}x  [{r['adapter_MB']:.2f} MB]  fp16 linear {r['fp16_linear_us']:7.1f} us"
          f"  split_k={r['split_k']} tiles={r['tiles']}  by token: expand {r['expand_by_token_us']:6.1f} us, with "
          f"the late loads {r['expand_late_us']:6.1f} ({r['late_gain']:.2f}x); expand from L2 {r['expand_hot_us']:6.1f}"
          f" us" + (f"; as a gather {r['expand_gather_us']:6.1f} us ({r['gather_gain']:.2f}x the expand by segments)"
                   if "expand_gather_us" in r else ""), flush=True)
    sweep = [f"{key[:-3]} {value:.1f}" for key, value in r.items()
             if key.startswith(("shrink_split", "pair_split", "expand_n", "gather_w"))]
    if sweep:
        print(f"      sweep (us): {', '.join(sweep)}", flush=True)


def main(out: str, models: list[str]) -> int:
    if not torch.cuda.is_available():
        print("infer.bench.kernels --lora needs a CUDA GPU (the Triton LoRA kernels run only there); none was found",
              file=sys.stderr)
        return 2
    rows = run_all(models)
    device = torch.cuda.get_device_name()
    with open(out, "w", newline="") as f:
        fields = list(dict.fromkeys(key for r in rows for key in r))  # the sweep's columns only in decode rows
        writer = csv.DictWriter(f, fieldnames=[*fields, "device"])
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "device": device})
    print(f"wrote {out}")
    return 0
