"""MLA decode micro-benchmark (DeepSeek-V3's and V2-Lite's absorbed attention over the latent cache): the Triton
kernels of kernels.mla (one cache row of L + R a token, read once for the scores and the values) beside the generic
paged attention (kernels.attention.paged_attention) called as the first MLA model code does, with one KV head and
v = k (every row read as a key and again as a value, L + R padded to a power of two), in one run.

    python -m infer.bench.mla --out mla.csv

Each row is one decode step of one layer: `batch` sequences of `context` keys each, bfloat16, block size 16, the
blocks handed out in a random order; V3 is H 128, L 512, R 64, V2-Lite H 16. Timed under CUDA graphs
(triton.testing.do_bench_cudagraph). Columns: `heads` and `splits` the kernel's plan (heads a program, splits a
sequence: kernels.mla.decode_plan); `mla_us` / `generic_us`; `gain` generic / MLA (> 1: the MLA kernel is faster;
"-" where the generic kernel failed to compile or run, its error printed); `floor_us` the bytes the step must read
and write (the cache rows once, q, the output, the block tables) at the copy bandwidth measured in the same run;
`GBps` those bytes per second of the MLA kernel and `of_copy` that over the copy bandwidth (a small step's cache
fits in the 50 MB L2: more than 1 there); `max_abs_err` the MLA output against the generic one's first L dims.
`--kv-cache-dtype fp8` (or fp8_e5m2) stores the cache rows as float8 (reference.to_cache: one byte an element, the
serving option's), which both kernels read and upcast: the bytes a step moves count them at one byte.
GPU only; `--interpret` runs a tiny interpreted check on CPU instead (no times: outputs against the definition).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

MODELS = {"v3": (128, 512, 64), "v2-lite": (16, 512, 64)}  # (H, L, R)
TINY = {"v3-tiny": (16, 32, 16), "v2-lite-tiny": (4, 32, 16)}  # --interpret's widths
PAGE = 16
BATCHES = (1, 16, 64)
CONTEXTS = (1024, 8192, 32768)
COLUMNS = ["model", "batch", "context", "heads", "splits", "mla_us", "generic_us", "gain", "floor_us", "GBps",
           "of_copy", "max_abs_err"]


def build(model: str, batch: int, context: int, device, gen: torch.Generator, dtype=torch.bfloat16,
          kv: torch.dtype | None = None) -> dict:
    """One decode step's q [batch, H, L+R], cache [blocks + 1, PAGE, 1, L+R] (random rows, blocks in a random
    order; `kv`: stored as a float8 cache holds them), block tables, seq_lens (context each) and query_start_loc."""
    from ..kernels import reference
    heads, latent, rope = MODELS[model]
    per = -(-context // PAGE)
    kw = dict(device=device, generator=gen)
    cache = reference.to_cache(torch.randn(batch * per + 1, PAGE, 1, latent + rope, **kw).to(dtype), kv or dtype)
    tables = torch.randperm(batch * per, **kw).to(torch.int32).view(batch, per)
    return dict(q=torch.randn(batch, heads, latent + rope, **kw).to(dtype), cache=cache, tables=tables,
                lens=torch.full((batch,), context, dtype=torch.int32, device=device),
                starts=torch.arange(batch + 1, dtype=torch.int32, device=device), latent=latent,
                scale=(latent + rope) ** -0.5)


def bytes_moved(model: str, batch: int, context: int, e: int = 2, cache_e: int | None = None) -> int:
    """The bytes a decode step must move: every sequence's cache rows once (`cache_e` bytes an element: a float8
    cache's 1; default e), q read, the output written, the block tables read."""
    heads, latent, rope = MODELS[model]
    return batch * (context * (latent + rope) * (cache_e or e) + heads * (2 * latent + rope) * e
                    + -(-context // PAGE) * 4)


def measure(model: str, batch: int, context: int, bandwidth: float, timer, gen: torch.Generator,
            device="cuda", generic_too: bool = True, kv: torch.dtype | None = None) -> dict:
    """One row: `timer(fn)` gives milliseconds per call of fn (None: no times, the outputs only); generic_too: the
    generic kernel run (and timed) beside; `kv`: a float8 cache's dtype (None: the cache in bfloat16)."""
    from ..kernels import attention, mla
    s = build(model, batch, context, device, gen, kv=kv)
    args = (s["tables"], s["lens"], s["starts"], s["scale"])
    out = torch.empty(batch, s["q"].shape[1], s["latent"], dtype=s["q"].dtype, device=device)

    def ours():
        return mla.mla_paged_attention(s["q"], s["cache"], *args, s["latent"], 1, out=out)

    def generic():
        return attention.paged_attention(s["q"], s["cache"], s["cache"], *args, 1)
    heads, splits = mla.decode_plan(batch, s["q"].shape[1], s["tables"].shape[1] * PAGE, s["q"].device,
                                    mla.decode_tile(s["cache"].dtype))
    row = dict(model=model, batch=batch, context=context, heads=heads, splits=splits)
    got = ours().float()
    err = _beside(row, generic, got, s["latent"], timer) if generic_too else float("nan")
    row["max_abs_err"] = float(f"{err:.2e}")
    if timer is None:
        return row
    us, moved = 1e3 * timer(ours), bytes_moved(model, batch, context, cache_e=s["cache"].element_size())
    row.update(mla_us=us, floor_us=moved / bandwidth * 1e6, GBps=round(moved / us / 1e3, 1),
               of_copy=round(moved / us / 1e-6 / bandwidth, 2))
    if "generic_us" in row:
        row["gain"] = row["generic_us"] / us
    return row


def _beside(row: dict, generic, got: torch.Tensor, latent: int, timer) -> float:
    """The generic kernel's run (its time into row["generic_us"] with a timer): the largest difference of `got`
    from its first `latent` dims (NaN, and its error on stderr, where it fails: at 128 heads a KV head and 1024
    lanes it may not compile or run)."""
    try:
        err = float((got - generic()[..., :latent].float()).abs().max())
        if timer is not None:
            row["generic_us"] = 1e3 * timer(generic)
        return err
    except Exception as exc:
        print(f"{row['model']} batch {row['batch']} context {row['context']}: the generic kernel failed: "
              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return float("nan")


def interpreted_check() -> list[dict]:
    """The kernels interpreted on CPU at tiny widths (H 4 and 16, L 32, R 16): each row's MLA output against the
    definition (reference.paged_attention(q, cache, cache)[..., :L]) and against the generic kernel's, interpreted
    too."""
    from .. import kernels
    from ..kernels import mla, reference
    gen, shipped = torch.Generator().manual_seed(0), kernels.use_triton
    kernels.use_triton = lambda t: True  # (CPU tensors through the kernels)
    MODELS.update(TINY)
    try:
        rows = _interpreted_rows(gen, mla, reference)
    finally:
        kernels.use_triton = shipped
        for name in TINY:
            MODELS.pop(name)
    return rows


def _interpreted_rows(gen, mla, reference) -> list[dict]:
    rows = []
    for model in TINY:
        for batch, context in ((1, 40), (3, 100)):
            row = measure(model, batch, context, 1.0, None, gen, "cpu")
            s = build(model, batch, context, "cpu", torch.Generator().manual_seed(batch))
            want = reference.paged_attention(s["q"], s["cache"], s["cache"], s["tables"], s["lens"], s["starts"],
                                             s["scale"])[..., :32].float()
            got = mla.mla_paged_attention(s["q"], s["cache"], s["tables"], s["lens"], s["starts"], s["scale"], 32)
            rows.append(dict(row, definition_err=float(f"{float((got.float() - want).abs().max()):.2e}")))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infer.bench.mla", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="mla.csv", help="the CSV file to write (default mla.csv)")
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES), help="batch sizes to time")
    p.add_argument("--context", type=int, nargs="+", default=list(CONTEXTS), help="keys a sequence")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--no-generic", action="store_true", help="time the MLA kernels only (not the generic one)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2"],
                   help="the cache rows' type: auto (bfloat16, as q), fp8 (e4m3) or fp8_e5m2, as the serving option")
    p.add_argument("--interpret", action="store_true",
                   help="without a GPU: a tiny check of the kernels interpreted on CPU (no times)")
    return p.parse_args(argv)


def _problem(args: argparse.Namespace) -> str | None:
    from .kernels import out_problem
    return out_problem(args.out) or next((f"--batch {b}: give batch sizes of 1 or more" for b in args.batch
                                          if b < 1), None) \
        or next((f"--context {c}: give contexts of 1 key or more" for c in args.context if c < 1), None)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret and not torch.cuda.is_available():  # (chosen before anything imports triton)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    problem = _problem(args)
    if problem:
        print(f"python -m infer.bench.mla: error: {problem}", file=sys.stderr)
        return 2
    from .kernels import print_table
    if not torch.cuda.is_available():
        if not args.interpret:
            print("infer.bench.mla needs a CUDA GPU (the Triton MLA kernels are timed only there); none was found "
                  "(--interpret: a tiny check of the kernels interpreted on CPU, no times)", file=sys.stderr)
            return 2
        rows = interpreted_check()
        print_table(rows, "MLA kernels interpreted on CPU (no times): max_abs_err against the generic kernel, "
                    "definition_err against reference.paged_attention",
                    ["model", "batch", "context", "heads", "splits", "max_abs_err", "definition_err"])
        return 0
    import triton.testing

    from .delta import _write
    from .kernels import copy_bandwidth
    from ..engine.config import KV_CACHE_DTYPES
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    kv = KV_CACHE_DTYPES[args.kv_cache_dtype]
    cache = str(kv or torch.bfloat16).removeprefix("torch.")
    rows = []
    for m in args.models:
        for c in args.context:
            for b in args.batch:  # (each row printed as it comes: a timed-out run keeps them in its log)
                rows.append(measure(m, b, c, bandwidth, triton.testing.do_bench_cudagraph, gen,
                                    generic_too=not args.no_generic, kv=kv))
                print(rows[-1], flush=True)
    return _write(args.out, rows, COLUMNS, f"MLA decode step on {torch.cuda.get_device_name()}, microseconds under "
                  f"CUDA graphs, bfloat16, a {cache} cache, block {PAGE}, copy bandwidth {bandwidth / 1e12:.2f} TB/s",
                  {"copy_GBps": bandwidth / 1e9, "kv_cache": cache})


if __name__ == "__main__":
    sys.exit(main())
