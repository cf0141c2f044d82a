"""GPTQ matmul micro-benchmark: the Triton kernel against a torch fp16 matmul of the same shape, in the same run.

    python -m infer.bench.kernels --out gptq_gemm.csv
    python -m infer.bench.kernels --lora --out lora_kernels.csv    (multi-LoRA kernels: see infer.bench.lora_kernels)

For every M (tokens in the batch) and every (K, N) projection shape of a 7B and a 14B model it times the Triton
GPTQ matmul and `F.linear` on the fp16 weight (triton.testing.do_bench, median), and reports the achieved memory
bandwidth of the GPTQ kernel (weight + scales + zeros + activations read, output written), its TFLOP/s, the
speed ratio fp16_ms / gptq_ms (> 1: the int4 kernel is faster) and the max error relative to the torch reference.
The weights are random valid GPTQ tensors (the timing does not depend on their values). GPU only.
"""

from __future__ import annotations

import argparse
import sys

import torch

MS = (1, 2, 4, 8, 16, 32, 64, 256, 2048)
SHAPES = {"7B": ((4096, 4096), (4096, 11008), (11008, 4096)),
          "14B": ((5120, 5120), (5120, 13696), (13696, 5120))}


def random_gptq(k: int, n: int, bits: int, group_size: int, device) -> tuple:
    """Valid GPTQ tensors (v1 zeros) of any content: every packed field is a uniform random value."""
    from ..quant import packing
    pack, groups = 32 // bits, 1 if group_size == -1 else k // group_size
    word = lambda *shape: torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, device=device)  # noqa
    qweight, qzeros = word(k // pack, n), word(groups, n // pack)
    if bits == 4:  # sym-like zeros (stored 7, i.e. zero 8) keep the products well scaled
        qzeros = packing.pack_cols(torch.full((groups, n), 7, dtype=torch.int32, device=device), bits)
    scales = (torch.rand(groups, n, device=device) * 0.02 + 0.001).half()
    gs = k if group_size == -1 else group_size
    g_idx = (torch.arange(k, device=device) // gs).int()
    return qweight, qzeros, scales, g_idx


def measure(m: int, k: int, n: int, bits: int, group_size: int, tensors: tuple, w16: torch.Tensor) -> dict:
    import triton.testing

    from ..kernels import gptq_gemm, reference
    qweight, qzeros, scales, g_idx = tensors
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    run = lambda: gptq_gemm.gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, True, group_size)  # noqa: E731
    y = run()
    want = reference.gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, True)
    err = ((y.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
    gptq_ms = triton.testing.do_bench(run, return_mode="median")
    fp16_ms = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, w16), return_mode="median")
    moved = (qweight.numel() * 4 + qzeros.numel() * 4 + scales.numel() * 2 + x.numel() * 2 + m * n * 2)
    return {"M": m, "K": k, "N": n, "gptq_ms": gptq_ms, "fp16_ms": fp16_ms, "speedup_vs_fp16": fp16_ms / gptq_ms,
            "gptq_GBps": moved / gptq_ms / 1e6, "gptq_TFLOPs": 2 * m * n * k / gptq_ms / 1e9,
            "max_rel_err": err}


def run_all(ms, shapes: dict, bits: int, group_size: int) -> list[dict]:
    rows = []
    for model, pairs in shapes.items():
        for k, n in pairs:
            tensors = random_gptq(k, n, bits, group_size, "cuda")
            w16 = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
            for m in ms:
                rows.append({"model": model, **measure(m, k, n, bits, group_size, tensors, w16)})
            del tensors, w16
            torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    cols = ["model", "M", "K", "N", "gptq_ms", "fp16_ms", "speedup_vs_fp16", "gptq_GBps", "gptq_TFLOPs",
            "max_rel_err"]
    for c in cols:
        table.add_column(c, justify="left" if c == "model" else "right")
    fmt = {"gptq_ms": "{:.4f}", "fp16_ms": "{:.4f}", "speedup_vs_fp16": "{:.2f}x", "gptq_GBps": "{:.0f}",
           "gptq_TFLOPs": "{:.1f}", "max_rel_err": "{:.1e}"}
    for r in rows:
        table.add_row(*(fmt.get(c, "{}").format(r[c]) for c in cols))
    Console().print(table)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infer.bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="CSV file to write (one row per M x shape)")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--m", type=int, nargs="+", default=list(MS), help="batch sizes (tokens)")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--lora", action="store_true", help="time the multi-LoRA shrink/expand kernels instead")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.lora:
        from .lora_kernels import main as lora_main
        return lora_main(args.out, args.models)
    if not torch.cuda.is_available():
        print("infer.bench.kernels needs a CUDA GPU (the Triton GPTQ kernel runs only there); none was found",
              file=sys.stderr)
        return 2
    import pandas as pd
    rows = run_all(args.m, {k: SHAPES[k] for k in args.models}, args.bits, args.group_size)
    device = torch.cuda.get_device_name()
    for r in rows:
        r.update(device=device, bits=args.bits, group_size=args.group_size)
    print_table(rows, f"GPTQ int{args.bits} g{args.group_size} matmul vs fp16 on {device}")
    pd.DataFrame(rows).to_csv(args.out, index=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
