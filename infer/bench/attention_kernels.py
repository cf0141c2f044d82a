"""Decode attention micro-benchmark: infer's fused decode kernel beside torch's SDPA on the same keys, in one run.

    python -m infer.bench.kernels --attention --out attention.csv

Each row is one decode step's attention of one layer (`kernels.attention.decode_attention`: the new token's rotary,
its key and value written into the paged cache, the attention over the context) at a model's head shape (Llama-2-7B:
32 query and KV heads; Llama-3-8B: 32 query heads over 8 KV heads; Qwen1.5-14B: 40 and 40; head dim 128), for a
batch of sequences that all hold `ctx` keys in a paged cache of 16-token blocks whose block tables are as wide as a
CUDA graph's (4,096 keys: an engine's max_model_len), float16. Timed under CUDA graphs (`gptq_tune.time_graph`),
cycling through enough copies of the cache to defeat the L2 cache (a step's layers each read their own). Columns:
`infer_us` with the partitions `decode_parts` picks (`parts`); `one_part_us` with every sequence in one partition (no
partial results to merge); `parts8_us` with 8 partitions a sequence (what the 512-key partitions of a 4,096-key table
gave before 2026-11-27, now merged in the same launch); `sdpa_us` torch's `scaled_dot_product_attention` on the
same keys laid out dense ([batch, heads, ctx, 128], the query alone: its flash or memory-efficient kernel), without
the rotary and the KV write; `floor_us` the keys' and values' bytes at the copy bandwidth measured in the same run;
`vs_sdpa` = sdpa_us / infer_us (> 1: infer is faster); `max_rel_err` the largest difference of the three partition
choices' outputs from SDPA's, relative to its largest value. GPU only."""

from __future__ import annotations

import csv
import sys

import torch

HEADS = {"7B": (32, 32), "8B": (32, 8), "14B": (40, 40)}  # query heads, KV heads
HEAD_DIM, PAGE, TABLE_KEYS = 128, 16, 4096
BATCHES, CONTEXTS = (1, 4, 16, 64), (128, 512, 2048)
L2_DEFEAT = 160 << 20  # bytes of keys and values cycled through per timing (more than an H100's or H200's L2)


def build(model: str, batch: int, ctx: int, device, gen: torch.Generator, dtype=torch.float16) -> dict:
    """One step's inputs: a paged cache holding `ctx` keys per sequence in randomly placed blocks (the new token's
    slot, position ctx - 1, included), the qkv rows of the new tokens, a rotary table, and the dense copy of the keys
    and values (with the new token's rotated key and value in place, as the kernel writes them) for SDPA."""
    from ..kernels import reference
    hq, hk = HEADS[model]
    blocks = -(-ctx // PAGE)
    num_blocks = batch * blocks + 1
    kw = dict(device=device, generator=gen)
    perm = torch.randperm(num_blocks - 1, **kw)[:batch * blocks].view(batch, blocks).int() + 1
    tables = torch.zeros(batch, TABLE_KEYS // PAGE, dtype=torch.int32, device=device)
    tables[:, :blocks] = perm
    caches = [torch.randn(num_blocks, PAGE, hk, HEAD_DIM, dtype=dtype, **kw) for _ in range(2)]
    qkv = torch.randn(batch, (hq + 2 * hk) * HEAD_DIM, dtype=dtype, **kw)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    ang = torch.arange(ctx, device=device).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)
    slots = (tables[:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE)
    step = dict(positions=pos, qkv=qkv, cos_sin=cos_sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots,
                block_tables=tables, seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device))
    # the reference's own step gives the caches after the write and the rotated query for SDPA
    q, k, v = qkv.split([hq * HEAD_DIM, hk * HEAD_DIM, hk * HEAD_DIM], dim=-1)
    kc, vc = caches[0].clone(), caches[1].clone()
    q_rot = reference.rotary_store_kv(pos, q, k, v, cos_sin, HEAD_DIM, kc, vc, slots)
    idx = tables[:, :blocks].long()
    dense = [c[idx].reshape(batch, blocks * PAGE, hk, HEAD_DIM)[:, :ctx].transpose(1, 2) for c in (kc, vc)]
    step.update(q_dense=q_rot.reshape(batch, hq, 1, HEAD_DIM), k_dense=dense[0], v_dense=dense[1])
    return step


def run_infer(step: dict, model: str, parts: int | None) -> torch.Tensor:
    from ..kernels import attention
    hq, hk = HEADS[model]
    q, k, v = step["qkv"].split([hq * HEAD_DIM, hk * HEAD_DIM, hk * HEAD_DIM], dim=-1)
    return attention.decode_attention(step["positions"], q, k, v, step["cos_sin"], HEAD_DIM, step["k_cache"],
                                      step["v_cache"], step["slot_mapping"], step["block_tables"], step["seq_lens"],
                                      step["query_start_loc"], HEAD_DIM ** -0.5, parts=parts)


def run_sdpa(step: dict, model: str) -> torch.Tensor:
    hq, hk = HEADS[model]
    out = torch.nn.functional.scaled_dot_product_attention(step["q_dense"], step["k_dense"], step["v_dense"],
                                                           enable_gqa=hq != hk)
    return out.reshape(out.shape[0], hq, HEAD_DIM)


def measure(model: str, batch: int, ctx: int, bandwidth: float, device, timer, gen: torch.Generator) -> dict:
    """One row: `timer(fns)` gives microseconds per call of the callables, one per copy of the step's inputs."""
    from ..kernels import attention
    from ..kernels.intmath import decode_parts
    hq, hk = HEADS[model]
    kv_bytes = 2 * batch * ctx * hk * HEAD_DIM * 2
    steps = [build(model, batch, ctx, device, gen) for _ in range(max(1, min(8, L2_DEFEAT // kv_bytes)))]
    row = dict(model=model, batch=batch, ctx=ctx,
               parts=decode_parts(batch, hk, TABLE_KEYS, 64, attention._decode_programs(torch.device(device))),
               floor_us=kv_bytes / bandwidth * 1e6)
    want = run_sdpa(steps[0], model).float()
    scale = want.abs().max().clamp_min(1e-6)
    err = 0.0
    for col, parts in (("infer_us", None), ("one_part_us", 1), ("parts8_us", 8)):
        err = max(err, float(((run_infer(steps[0], model, parts).float() - want).abs().max() / scale)))
        row[col] = timer([lambda s=s, p=parts: run_infer(s, model, p) for s in steps])
    row["sdpa_us"] = timer([lambda s=s: run_sdpa(s, model) for s in steps])
    row["vs_sdpa"] = row["sdpa_us"] / row["infer_us"]
    row["max_rel_err"] = err
    return row


COLUMNS = ["model", "batch", "ctx", "parts", "infer_us", "one_part_us", "parts8_us", "sdpa_us", "vs_sdpa", "floor_us",
           "max_rel_err"]


def main(out: str, models=("7B", "8B", "14B")) -> int:
    if not torch.cuda.is_available():
        print("the attention bench needs a CUDA GPU (the Triton decode attention runs only there); none was found",
              file=sys.stderr)
        return 2
    from ..kernels.gptq_tune import time_graph
    from .kernels import copy_bandwidth, print_table
    bandwidth = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [measure(m, b, c, bandwidth, "cuda", time_graph, gen) for m in models for b in BATCHES for c in CONTEXTS]
    device = torch.cuda.get_device_name()
    print_table(rows, f"decode attention on {device} (copy bandwidth {bandwidth / 1e12:.2f} TB/s), microseconds "
                      f"under CUDA graphs, L2 defeated, float16, block tables {TABLE_KEYS} keys wide", COLUMNS)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + ["device", "copy_GBps"])
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, device=device, copy_GBps=bandwidth / 1e9))
    print(f"wrote {out}")
    return 0
