"""The fused mixture-of-experts kernels on a GPU: the int4 one (`kernels.moe.fused_moe_int4`, GPTQ/AWQ experts
dequantized in registers) beside the float one (`kernels.moe.fused_moe`) over the same experts dequantized to bf16,
each timed under a CUDA graph, with the floor of each: the bytes of the distinct experts a step's routing chooses
over the measured copy bandwidth. Qwen3-30B-A3B's expert shapes by default (E = 128, k = 8, H = 2048, I = 768,
groups of 128).

    python -m infer.bench.moe --tokens 1 8 64 512 --out moe.csv
    python -m infer.bench.moe --act-order      # desc_act checkpoints' experts, sorted by group as the engine loads them
    python -m infer.bench.moe --tokens 256 1024 4096 --block-m 16 32 64 128   # BLOCK_M's search (kernels.moe)

    python -m infer.bench.moe --tune --tokens 1 16 256 4096   # tune the int4 experts (kernels.moe_tune), --quick
    python -m infer.bench.moe --oai --experts 32 --top-k 4 --hidden 2880 --intermediate 2880 --group-size 32
                                               # gpt-oss-20b's experts: biases and clamped SwiGLU, fused vs apart
    python -m infer.bench.moe --mxfp4 --experts 32 --top-k 4 --hidden 2880 --intermediate 2880 --tokens 1 8 64 512 4096
                                               # gpt-oss-20b's MXFP4 experts (packed) vs the same experts in bf16
    python -m infer.bench.moe --ungated --experts 128 --top-k 6 --hidden 2688 --intermediate 1856
                                               # Nemotron 3 Nano's relu² experts without gate (w13: up alone)
    python -m infer.bench.moe --ungated --experts 512 --top-k 22 --hidden 1024 --intermediate 2688
                                               # Nemotron 3 Super's, in its latent of 1024

With --tune each count of tokens' bucket is tuned (the full candidate set; --quick: the engine start's) over the
int4 experts, the winners saved to this GPU's cache file as an engine start saves them, and each bucket's tuned
time printed beside the heuristics' (`tuned_vs_heuristic`: heuristic time / tuned time, above 1 a gain).

With --block-m each count of tokens is timed at every BLOCK_M listed too (the int4 kernel; `int4_us_mN` columns,
`best_block_m` the fastest) beside the one kernels.moe.choose_block_m picks (`block_m`): what a change of its
thresholds would gain.

With --oai the experts are gpt-oss's (random biases, the clamped SwiGLU: reference.OaiExperts, gate and up
interleaved): both the int4 and the bf16 experts are timed with the biases and the activation in the matmuls'
epilogue (`int4_us`, `bf16_us`: two launches, the engine's way) and apart (`int4_apart_us`, `bf16_apart_us`: plain
matmuls, then the index_select adds and the activation's torch ops, as session 60 ran them), and
`int4_epilogue_gain` / `bf16_epilogue_gain` apart / fused (above 1: the epilogue is faster).

With --ungated the experts have no gate (Nemotron 3's: w13 their up projections alone, I columns, and relu(up)² in
place of SwiGLU), their bytes two projections an expert, not three. A width no multiple of --group-size has a partial
last group, as GPTQModel writes it (Nemotron 3 Nano's 1856 in groups of 128).

With --cpu (no GPU needed) the CPU path's fused MoE over float experts (--dtype float32, the CPU's default, or
bfloat16): the engine's (`reference.fused_moe_grouped`: one grouped_mm per projection; `grouped_us`) beside the loop
over the chosen experts it replaced (`reference.fused_moe`, still the path of steps with adapters on the experts;
`loop_us`) and transformers' own experts (Qwen3MoeExperts) with its default `grouped_mm` implementation and its
`eager` loop (`hf_grouped_us`, `hf_eager_us`), each the median of --repeats calls; `x_loop`, `x_hf` the ratios
(above 1: infer faster), `equal_loop` whether infer's output is the loop's bit for bit.

    python -m infer.bench.moe --cpu --experts 8 --top-k 2 --hidden 64 --intermediate 32 --tokens 1 16 256
                                               # the built-in tiny mixtures of experts' shapes

With --mxfp4 the experts are gpt-oss's as the hub stores them (random MXFP4 blocks and e8m0 scales:
reference.Mxfp4Experts, kept packed as the engine holds them) with its biases and activation: the MXFP4 kernel
(`kernels.moe.fused_moe_mxfp4`, dequantized in registers; `mxfp4_us`) beside the bf16 fused MoE over the same
experts dequantized (`bf16_us`), `mxfp4_vs_bf16` their ratio (above 1: MXFP4 faster), each with its floor (the
chosen experts' bytes: half a byte a weight and a byte a group of 32 for MXFP4, two bytes a weight for bf16).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

import torch


def random_experts(experts: int, k: int, n: int, group: int, act_order: bool, seed: int, device: str = "cuda"):
    """int4 experts (reference.Int4Experts) of random words, v1 zeros, small positive scales; act-order: each
    expert's g_idx a permutation of the plain groups."""
    from ..kernels.reference import Int4Experts
    gen = torch.Generator(device=device).manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (experts, k // 8, n), device=device, dtype=torch.int32, generator=gen)
    groups = -(-k // group)  # (a last partial group where k is no multiple of it: Nemotron 3 Nano's 1856 of 128)
    zeros = torch.randint(-2**31, 2**31 - 1, (experts, groups, n // 8), device=device, dtype=torch.int32,
                          generator=gen)
    scales = (torch.rand(experts, groups, n, device=device, generator=gen) * 0.004 + 0.001).half()
    plain = (torch.arange(k, device=device) // group).int()
    g_idx = torch.stack([plain[torch.randperm(k, device=device, generator=gen)] if act_order else plain
                         for _ in range(experts)])
    return Int4Experts(words, zeros, scales, g_idx, 0 if act_order else group, True)


def int4_bytes(experts: int, k: int, n: int, group: int) -> float:
    """Bytes of `experts` int4 projections of k inputs and n outputs: half a byte a weight, a float16 scale and half
    a byte of zero point a group (the last one partial where k is no multiple of the group size) of each output."""
    return experts * (k * n / 2 + -(-k // group) * n * 2.5)


def oai_experts(experts: int, hidden: int, inter: int, device: str = "cuda"):
    """gpt-oss's expert biases (random, bf16) and activation constants (reference.OaiExperts: alpha 1.702, limit
    7, gpt-oss-20b's)."""
    from ..kernels.reference import OaiExperts
    gen = torch.Generator(device=device).manual_seed(2)
    return OaiExperts(torch.randn(experts, 2 * inter, device=device, generator=gen).bfloat16(),
                      torch.randn(experts, hidden, device=device, generator=gen).bfloat16(), 1.702, 7.0)


def random_mxfp4(experts: int, k: int, n: int, seed: int, device: str = "cuda"):
    """MXFP4 experts (reference.Mxfp4Experts) of random codes and scales 2^-8 to 2^-4 (a trained layer's range)."""
    from ..kernels.reference import Mxfp4Experts
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, n, k // 32, 16), device=device, dtype=torch.uint8, generator=gen)
    scales = torch.randint(119, 124, (experts, n, k // 32), device=device, dtype=torch.uint8, generator=gen)
    return Mxfp4Experts(blocks, scales)


def mxfp4_bytes(experts: int, k: int, n: int) -> int:
    """Bytes of `experts` MXFP4 projections of k inputs and n outputs: half a byte a weight, a byte a group of 32."""
    return experts * (k * n // 2 + k // 32 * n)


def _step(t: int, experts: int, top_k: int, hidden: int, device: str):
    """A step of `t` tokens of the bench (seeded by t): x [t, hidden] bfloat16, their top_k routing weights (bfloat16)
    and experts, and how many experts they choose."""
    gen = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, hidden, device=device, generator=gen).bfloat16()
    weights, ids = torch.topk(torch.randn(t, experts, device=device, generator=gen).softmax(-1), top_k, -1)
    weights = weights.bfloat16()
    chosen = int(ids.unique().numel())
    return x, weights, ids, chosen


def measure_mxfp4(tokens, experts: int, top_k: int, hidden: int, inter: int, bandwidth: float,
                  device: str = "cuda") -> list[dict]:
    """One row a count of tokens (the module docstring's --mxfp4): gpt-oss's experts, MXFP4 against bf16."""
    from ..kernels import moe
    from ..kernels.gptq_tune import time_graph
    w13, w2 = random_mxfp4(experts, hidden, 2 * inter, 0, device), random_mxfp4(experts, inter, hidden, 1, device)
    f13, f2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    oai = oai_experts(experts, hidden, inter, device)
    rows = []
    for t in tokens:
        x, weights, ids, chosen = _step(t, experts, top_k, hidden, device)
        ours = time_graph([lambda: moe.fused_moe_mxfp4(x, w13, w2, weights, ids, oai=oai)])
        dense = time_graph([lambda: moe.fused_moe(x, f13, f2, weights, ids, oai=oai)])
        q_bytes = mxfp4_bytes(chosen, hidden, 2 * inter) + mxfp4_bytes(chosen, inter, hidden)
        f_bytes = chosen * 3 * hidden * inter * 2
        rows.append({"tokens": t, "experts_chosen": chosen, "mxfp4_us": round(ours, 2), "bf16_us": round(dense, 2),
                     "mxfp4_vs_bf16": round(dense / ours, 3),
                     "mxfp4_floor_us": round(q_bytes / bandwidth * 1e6, 2),
                     "mxfp4_of_floor": round(q_bytes / bandwidth * 1e6 / ours, 3),
                     "bf16_floor_us": round(f_bytes / bandwidth * 1e6, 2),
                     "bf16_of_floor": round(f_bytes / bandwidth * 1e6 / dense, 3),
                     "block_m": moe.choose_block_m(t, top_k, experts)})
    return rows


def measure(tokens, experts: int, top_k: int, hidden: int, inter: int, group: int, act_order: bool,
            bandwidth: float, block_ms=(), oai: bool = False, device: str = "cuda",
            ungated: bool = False) -> list[dict]:
    """One row a count of tokens (device: "cuda"; the tests run the same code on "cpu", interpreted). oai: gpt-oss's
    experts, each also timed with its biases and activation apart (the module docstring's --oai); ungated:
    Nemotron 3's experts without gate (--ungated)."""
    from ..kernels import moe
    from ..kernels.gptq_tune import time_graph
    n13 = (1 if ungated else 2) * inter  # (w13's outputs: up alone without a gate, the kernels' relu(up)²)
    # (act-order: sorted by group, as models.moe.Int4Stack holds them)
    w13 = random_experts(experts, hidden, n13, group, act_order, 0, device).sorted_by_group(group)
    w2 = random_experts(experts, inter, hidden, group, act_order, 1, device).sorted_by_group(group)
    f13, f2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    extra = {"oai": oai_experts(experts, hidden, inter, device)} if oai else {}
    rows = []
    for t in tokens:
        x, weights, ids, chosen = _step(t, experts, top_k, hidden, device)
        ours = time_graph([lambda: moe.fused_moe_int4(x, w13, w2, weights, ids, **extra)])
        dense = time_graph([lambda: moe.fused_moe(x, f13, f2, weights, ids, **extra)])
        q_bytes = int4_bytes(chosen, hidden, n13, group) + int4_bytes(chosen, inter, hidden, group)
        f_bytes = chosen * (n13 + inter) * hidden * 2
        rows.append({"tokens": t, "experts_chosen": chosen, "act_order": act_order, "ungated": ungated,
                     "int4_us": round(ours, 2), "bf16_us": round(dense, 2), "int4_vs_bf16": round(dense / ours, 3),
                     "int4_floor_us": round(q_bytes / bandwidth * 1e6, 2),
                     "int4_of_floor": round(q_bytes / bandwidth * 1e6 / ours, 3),
                     "bf16_floor_us": round(f_bytes / bandwidth * 1e6, 2),
                     "bf16_of_floor": round(f_bytes / bandwidth * 1e6 / dense, 3),
                     "block_m": moe.choose_block_m(t, top_k, experts)})
        if oai:  # the same experts with the biases and the activation as torch ops after plain matmuls
            apart = {"int4": time_graph([lambda: moe.fused_moe_int4(x, w13, w2, weights, ids, apart=True, **extra)]),
                     "bf16": time_graph([lambda: moe.fused_moe(x, f13, f2, weights, ids, apart=True, **extra)])}
            for kind, us in apart.items():
                rows[-1][f"{kind}_apart_us"] = round(us, 2)
                rows[-1][f"{kind}_epilogue_gain"] = round(us / rows[-1][f"{kind}_us"], 3)
        if block_ms:
            times = {m: time_graph([lambda m=m: moe.fused_moe_int4(x, w13, w2, weights, ids, block_m=m)])
                     for m in block_ms}
            rows[-1].update({f"int4_us_m{m}": round(us, 2) for m, us in times.items()})
            rows[-1]["best_block_m"] = min(times, key=times.get)
    return rows


def tune(tokens, experts: int, top_k: int, hidden: int, inter: int, group: int, act_order: bool, quick: bool,
         log=None, ungated: bool = False) -> list[dict]:
    """Tune the int4 experts of these shapes (`ungated`: without gate, w13 of I columns) at the buckets of `tokens`
    (kernels.moe_tune.tune_layer), save the winners to this GPU's cache file (as an engine start does) and return
    one row a bucket: the heuristics' time, the tuned one, their ratio, the winner."""
    from ..kernels import gptq_configs, moe, moe_tune
    w13 = random_experts(experts, hidden, (1 if ungated else 2) * inter, group, act_order, 0).sorted_by_group(group)
    w2 = random_experts(experts, inter, hidden, group, act_order, 1).sorted_by_group(group)
    buckets = sorted({gptq_configs.bucket(t) for t in tokens})
    res = moe_tune.tune_layer(w13, w2, top_k, buckets, torch.bfloat16, quick=quick, log=log)
    key = moe.experts_key(w13, w2, top_k, torch.bfloat16)
    found = {b: cfg for b, (cfg, _, _) in res.items() if cfg is not None}
    if found:
        path = gptq_configs.save(gptq_configs.gpu_name(torch.device("cuda")), {key: found}, moe.SECTION)
        print(f"tuned configs saved to {path} ({key})" if path else f"tuned configs of {key} not saved (the "
              "cache file is not writable: set INFER_CACHE to a writable folder)")
    return [tuned_row(b, *r) for b, r in res.items()]


def tuned_row(bucket: int, cfg: dict | None, tuned_us: float, heuristic_us: float | None) -> dict:
    """A --tune row: the bucket, both times side by side, heuristic / tuned (above 1: the tuned config is faster)."""
    ok = cfg is not None and heuristic_us is not None
    return {"bucket": bucket, "heuristic_us": None if heuristic_us is None else round(heuristic_us, 2),
            "tuned_us": round(tuned_us, 2) if cfg is not None else None,
            "tuned_vs_heuristic": round(heuristic_us / tuned_us, 3) if ok else None,
            "config": json.dumps(cfg, sort_keys=True) if cfg is not None else None}


def measure_cpu(tokens, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                repeats: int) -> list[dict]:
    """--cpu: infer's CPU fused MoE (reference.fused_moe_grouped), the per-expert loop (reference.fused_moe) and
    transformers' Qwen3MoeExperts (grouped_mm and eager) on the same random float experts, each call timed with
    time.perf_counter (the median of `repeats` after one warm call)."""
    import statistics
    import time
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    from ..kernels import reference
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    peers = {}
    for impl in ("grouped_mm", "eager"):
        cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                             num_experts_per_tok=top_k)
        cfg._experts_implementation = impl
        hf = Qwen3MoeExperts(cfg).to(dtype)
        hf.gate_up_proj.data.copy_(w13)
        hf.down_proj.data.copy_(w2)
        peers[impl] = hf

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    rows = []
    for t in tokens:
        x, weights, ids, chosen = _step(t, experts, top_k, hidden, "cpu")
        x, weights = x.to(dtype), weights.to(dtype)
        with torch.no_grad():
            ours = timed(lambda: reference.fused_moe_grouped(x, w13, w2, weights, ids))
            loop = timed(lambda: reference.fused_moe(x, w13, w2, weights, ids))
            hf_grouped = timed(lambda: peers["grouped_mm"](x, ids, weights))
            hf_eager = timed(lambda: peers["eager"](x, ids, weights))
            equal = torch.equal(reference.fused_moe_grouped(x, w13, w2, weights, ids),
                                reference.fused_moe(x, w13, w2, weights, ids))
        rows.append({"tokens": t, "experts_chosen": chosen, "grouped_us": round(ours, 1), "loop_us": round(loop, 1),
                     "hf_grouped_us": round(hf_grouped, 1), "hf_eager_us": round(hf_eager, 1),
                     "x_loop": round(loop / ours, 2), "x_hf": round(hf_grouped / ours, 2), "equal_loop": equal})
    return rows


def _bad_shape(args) -> str | None:
    """What is wrong with the experts' shape flags, or None (--group-size 0 was a ZeroDivisionError, 0 or less
    experts, --top-k or sizes tracebacks from the random experts after the GPU had started)."""
    for flag, v in (("--experts", args.experts), ("--top-k", args.top_k), ("--hidden", args.hidden),
                    ("--intermediate", args.intermediate), ("--group-size", args.group_size)):
        if v < 1:
            return f"{flag} {v} must be at least 1" + (" (the bench's experts have groups: give one, e.g. 128)"
                                                      if flag == "--group-size" else "")
    if args.mxfp4 and (args.hidden % 32 or args.intermediate % 32):
        return (f"--mxfp4 packs groups of 32 values: --hidden {args.hidden} and --intermediate {args.intermediate} "
                "must be multiples of 32 (gpt-oss-20b's are 2880)")
    # (a width no multiple of the group size has a partial last group, as GPTQModel writes it: GLM-4.5-Air's dense
    # 10944 and Nemotron 3 Nano's experts' 1856 of 128)
    bad = [(flag, v) for flag, v in (("--hidden", args.hidden), ("--intermediate", args.intermediate)) if v % 8]
    if bad:
        return f"{bad[0][0]} {bad[0][1]} is no multiple of 8 " + (
            "(--cpu times torch's grouped_mm, whose rows must be multiples of 16 bytes)" if args.cpu else
            "(int4 packs 8 values a word)")
    if args.top_k > args.experts or min(args.tokens) < 1:
        return "--top-k must be at most --experts and every --tokens at least 1"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.bench.moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--act-order", action="store_true", help="act-order experts (sorted by group, as loaded)")
    ap.add_argument("--block-m", type=int, nargs="+", default=[], choices=(16, 32, 64, 128),
                    help="BLOCK_M candidates to time as well")
    ap.add_argument("--tune", action="store_true",
                    help="tune the int4 experts at the buckets of --tokens and print tuned vs heuristic times")
    ap.add_argument("--quick", action="store_true", help="with --tune: the engine start's candidate set")
    ap.add_argument("--oai", action="store_true", help="gpt-oss's experts (biases, clamped SwiGLU): each also timed "
                                                       "with those apart from the matmuls' epilogue")
    ap.add_argument("--mxfp4", action="store_true", help="gpt-oss's MXFP4 experts (packed, its biases and "
                                                         "activation) against the same experts in bf16")
    ap.add_argument("--ungated", action="store_true", help="experts without gate (Nemotron 3's relu² experts: w13 "
                    "their up projections alone)")
    ap.add_argument("--cpu", action="store_true", help="the CPU path's fused MoE over float experts beside the "
                    "per-expert loop and transformers' experts (no GPU needed)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="with --cpu: the experts' "
                    "dtype (float32: the CPU path's default)")
    ap.add_argument("--repeats", type=int, default=20, help="with --cpu: calls timed per row (their median)")
    ap.add_argument("--out", help="write the table as CSV here too")
    args = ap.parse_args(argv)
    if args.cpu:
        clash = [f for f, on in (("--tune", args.tune), ("--oai", args.oai), ("--act-order", args.act_order),
                                 ("--block-m", args.block_m), ("--mxfp4", args.mxfp4), ("--ungated", args.ungated))
                 if on]
        if clash:
            ap.error(f"--cpu times the CPU path's float experts (SwiGLU); {clash[0]} is an option of the GPU "
                     "kernels' table: drop one")
        if args.repeats < 1:
            ap.error(f"--repeats {args.repeats} must be at least 1")
    elif args.dtype != "float32" or args.repeats != 20:
        ap.error("--dtype and --repeats are options of --cpu (the GPU table times bfloat16 under CUDA graphs): "
                 "add --cpu, or drop them")
    if args.ungated and (args.oai or args.mxfp4):
        ap.error(f"--ungated times experts without gate (Nemotron 3's); {'--oai' if args.oai else '--mxfp4'} times "
                 "gpt-oss's gated ones: drop one")
    if args.mxfp4:
        clash = [f for f, on in (("--tune", args.tune), ("--oai", args.oai), ("--act-order", args.act_order),
                                 ("--block-m", args.block_m)) if on]
        if clash:
            ap.error(f"--mxfp4 times gpt-oss's MXFP4 experts (with their biases and activation) against bf16; "
                     f"{clash[0]} is the int4 experts' option: drop one")
        args.group_size = 32  # (MXFP4's groups: --group-size is the int4 experts')
    if args.quick and not args.tune:
        ap.error("--quick is the candidate set of --tune (the engine start's): add --tune, or drop --quick")
    if args.tune and args.oai:
        ap.error("--oai times gpt-oss's experts fused and apart; --tune tunes the plain experts' tiles: drop one")
    if args.tune and args.block_m:
        ap.error("--block-m lists BLOCK_M candidates of the timing table; --tune searches BLOCK_M itself: drop one")
    why = _bad_shape(args)  # (before the GPU check: a wrong flag is named on any machine, never a traceback)
    if why is None and args.out:
        from .kernels import out_problem
        why = out_problem(args.out)
    if why:
        ap.error(why)
    if args.cpu:
        print(f"CPU ({torch.get_num_threads()} threads): E={args.experts} k={args.top_k} H={args.hidden} "
              f"I={args.intermediate} {args.dtype}")
        rows = measure_cpu(args.tokens, args.experts, args.top_k, args.hidden, args.intermediate,
                           getattr(torch, args.dtype), args.repeats)
        _print_rows(rows, args.out)
        return 0
    if not torch.cuda.is_available():
        print("infer.bench.moe: no CUDA GPU here: it times the GPU kernels (on a CPU the experts run torch's "
              "reference, which --cpu times; `pytest tests/test_probes_session56_moeq.py` checks the kernels under "
              "TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from .kernels import copy_bandwidth
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; E={args.experts} "
          f"k={args.top_k} H={args.hidden} I={args.intermediate} g={args.group_size} act_order={args.act_order}"
          + (" ungated" if args.ungated else ""))
    if args.mxfp4:
        rows = measure_mxfp4(args.tokens, args.experts, args.top_k, args.hidden, args.intermediate, bandwidth)
    elif args.tune:
        rows = tune(args.tokens, args.experts, args.top_k, args.hidden, args.intermediate, args.group_size,
                    args.act_order, args.quick, log=lambda m: print(m, flush=True), ungated=args.ungated)
    else:
        rows = measure(args.tokens, args.experts, args.top_k, args.hidden, args.intermediate, args.group_size,
                       args.act_order, bandwidth, args.block_m, args.oai, ungated=args.ungated)
    _print_rows(rows, args.out)
    return 0


def _print_rows(rows: list[dict], out: str | None) -> None:
    """The table on stdout, and as CSV at `out` where given."""
    keys = list(rows[0])
    print("  ".join(keys))
    for r in rows:
        print("  ".join(str(r[k]) for k in keys))
    if out:
        with open(out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
