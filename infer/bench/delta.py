"""Gated DeltaNet decode micro-benchmark: the Triton kernels of a decode step (kernels.delta_triton: the causal conv1d
update, the fused recurrent gated delta rule) beside the torch code they replace (delta_rule.causal_conv1d_update,
recurrent_gated_delta_rule_slots: gather the slots' states, compute, scatter them back), in one run.

    python -m infer.bench.delta --out delta.csv

Each row is one decode step of one linear-attention layer at Qwen3-Next's / Qwen3.5's head shape (16 key heads and
32 value heads of 128, conv kernel 4, conv over q|k|v: 8,192 channels), bfloat16 activations, float32 recurrent
states in a pool of batch + 1 slots (the last the padding slot) visited in a random order, for a batch of sequences
that all carry their state. Timed under CUDA graphs (triton.testing.do_bench_cudagraph; the states updated in place
at every replay). Columns: `conv_us` / `conv_torch_us` and `rule_us` / `rule_torch_us` the Triton kernel / the torch
code; `conv_gain` and `rule_gain` torch / Triton (> 1: Triton is faster); `*_GBps` the bytes each op must move (its
states read and written, its inputs and outputs) per second of the Triton kernel; `*_floor_us` those bytes at the
copy bandwidth measured in the same run (small batches' states fit in L2: their floor is not a DRAM floor);
`max_abs_err` the largest difference of the Triton outputs from torch's. GPU only.

    python -m infer.bench.delta --prefill 512 --out delta_prefill.csv

times a prefill step's chunked rule instead: for each batch, that many prompts of 512 tokens (each sequence a
different length, 512 down to half of it, over the same pool), Triton's (kernels.delta_triton.
chunk_gated_delta_rule_varlen: one call over the step's sequences, all three parts in Triton) beside the torch loop
it replaces (delta_rule.chunk_gated_delta_rule once per sequence from its slot's state), the torch varlen code
(delta_rule.chunk_gated_delta_rule_varlen) and the mixed path (the intra-chunk terms in torch, delta_rule.
chunk_terms, the rest in Triton), under triton.testing.do_bench (the step syncs with the host: no graph). Columns
(PREFILL_COLUMNS): `tokens`, `triton_us`, `loop_us`, `varlen_us`, `mixed_us`, `gain` loop / Triton, `varlen_gain`
varlen / Triton, `mixed_gain` mixed / Triton; `terms_us` / `terms_torch_us` the intra-chunk terms alone (delta_triton.
chunk_terms / delta_rule.chunk_terms), `terms_gain` torch / Triton; `terms_rows_us` the Triton terms with session
64's row-by-row solve of the chunk's system (chunk_terms' solve_block = CHUNK: 63 serial steps), `blocked_gain` it /
`terms_us` (the blocked solve's gain); `max_abs_err` Triton's outputs against the loop's, `terms_max_abs_err` the
Triton terms against torch's."""

from __future__ import annotations

import argparse
import functools
import sys

import torch

HK, HV, DK, DV, TAPS = 16, 32, 128, 128, 4
BATCHES = (1, 8, 32, 64, 128, 256)
COLUMNS = ["batch", "conv_us", "conv_torch_us", "conv_gain", "conv_floor_us", "conv_GBps", "rule_us", "rule_torch_us",
           "rule_gain", "rule_floor_us", "rule_GBps", "max_abs_err"]


def build(batch: int, device, gen: torch.Generator, dtype=torch.bfloat16) -> dict:
    """One step's inputs: the conv input row of every sequence, the layer's conv weight, g and beta, and two copies
    of each state pool (one for the kernels, one for torch), the sequences' slots a random order of the pool's."""
    channels = 2 * HK * DK + HV * DV
    kw = dict(device=device, generator=gen)
    conv = torch.randn(batch + 1, channels, TAPS - 1, **kw).to(dtype)
    rec = torch.randn(batch + 1, HV, DK, DV, **kw) * 0.1
    weight = (torch.randn(channels, 1, TAPS, **kw) * 0.5).to(dtype)
    return dict(x=torch.randn(batch, channels, **kw).to(dtype), weight=weight,
                g=-torch.rand(batch, HV, **kw), beta=torch.rand(batch, HV, **kw).to(dtype),
                slots=torch.randperm(batch, **kw), kept=torch.ones(batch, dtype=torch.bool, device=device),
                conv=[conv, conv.clone()], rec=[rec, rec.clone()])


def split(out: torch.Tensor):
    """q, k [B, Hk, Dk], v [B, Hv, Dv]: views of the conv's output, as the model splits it."""
    b = out.shape[0]
    q, k, v = out.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return q.reshape(b, HK, DK), k.reshape(b, HK, DK), v.reshape(b, HV, DV)


def bytes_moved(batch: int, dtype=torch.bfloat16) -> tuple[int, int]:
    """(the conv update's, the recurrent rule's) bytes a step must read and write."""
    e = torch.tensor([], dtype=dtype).element_size()
    channels = 2 * HK * DK + HV * DV
    conv = batch * channels * (2 * (TAPS - 1) + 2) * e + channels * TAPS * e
    rule = batch * (HV * DK * DV * 4 * 2 + (2 * HK * DK + 2 * HV * DV) * e + HV * (4 + e))
    return conv, rule


def measure(batch: int, bandwidth: float, timer, gen: torch.Generator, device="cuda") -> dict:
    """One row: `timer(fn)` gives milliseconds per call of fn."""
    from ..kernels import delta_rule, delta_triton
    s = build(batch, device, gen)
    ops = {"triton": (delta_triton, 0), "torch": (delta_rule, 1)}
    conv_out = {n: m.causal_conv1d_update(s["x"], s["weight"], s["conv"][i], s["slots"], s["kept"])
                for n, (m, i) in ops.items()}
    qkv = split(conv_out["torch"])
    rule_out = {n: m.recurrent_gated_delta_rule_slots(*qkv, s["g"], s["beta"], s["rec"][i], s["slots"], s["kept"])
                for n, (m, i) in ops.items()}
    err = max(float((conv_out["triton"].float() - conv_out["torch"].float()).abs().max()),
              float((rule_out["triton"].float() - rule_out["torch"].float()).abs().max()))
    us = {}
    for n, (m, i) in ops.items():
        us[f"conv_{n}"] = 1e3 * timer(lambda m=m, i=i: m.causal_conv1d_update(s["x"], s["weight"], s["conv"][i],
                                                                                 s["slots"], s["kept"]))
        us[f"rule_{n}"] = 1e3 * timer(lambda m=m, i=i: m.recurrent_gated_delta_rule_slots(
            *qkv, s["g"], s["beta"], s["rec"][i], s["slots"], s["kept"]))
    conv_bytes, rule_bytes = bytes_moved(batch)
    return dict(batch=batch, conv_us=us["conv_triton"], conv_torch_us=us["conv_torch"],
                conv_gain=us["conv_torch"] / us["conv_triton"], conv_floor_us=conv_bytes / bandwidth * 1e6,
                conv_GBps=round(conv_bytes / us["conv_triton"] / 1e3, 1), rule_us=us["rule_triton"],
                rule_torch_us=us["rule_torch"], rule_gain=us["rule_torch"] / us["rule_triton"],
                rule_floor_us=rule_bytes / bandwidth * 1e6, rule_GBps=round(rule_bytes / us["rule_triton"] / 1e3, 1),
                max_abs_err=float(f"{err:.2e}"))


PREFILL_COLUMNS = ["batch", "tokens", "triton_us", "loop_us", "varlen_us", "mixed_us", "gain", "varlen_gain",
                   "mixed_gain", "terms_us", "terms_torch_us", "terms_gain", "terms_rows_us", "blocked_gain",
                   "max_abs_err", "terms_max_abs_err"]


def build_prefill(batch: int, length: int, device, gen: torch.Generator, dtype=torch.bfloat16) -> dict:
    """A prefill step of `batch` prompts (lengths `length` down to about half of it): q, k, v, g, beta of its tokens
    (as the model's split of the conv output gives them), query_start_loc, the sequences' slots (a random order of a
    pool of batch + 1 states, every sequence carrying its state) and two copies of the pool."""
    lens = [length - (length // 2) * i // max(batch - 1, 1) for i in range(batch)]
    t = sum(lens)
    kw = dict(device=device, generator=gen)
    q, k, v = split(torch.randn(t, 2 * HK * DK + HV * DV, **kw).to(dtype))
    rec = torch.randn(batch + 1, HV, DK, DV, **kw) * 0.1
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(qkv=(q, k, v), g=-torch.rand(t, HV, **kw), beta=torch.rand(t, HV, **kw).to(dtype), starts=starts,
                slots=torch.randperm(batch, **kw), kept=torch.ones(batch, dtype=torch.bool, device=device),
                rec=[rec, rec.clone()])


def prefill_loop(q, k, v, g, beta, states, starts, slots, kept):
    """The torch code the batched call replaced: chunk_gated_delta_rule once per sequence, from its slot."""
    from ..kernels import delta_rule
    outs = []
    for s, e, slot, kp in zip(starts[:-1].tolist(), starts[1:].tolist(), slots.tolist(), kept.tolist()):
        state = states[slot] if kp else torch.zeros_like(states[slot])
        o, states[slot] = delta_rule.chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state)
        outs.append(o)
    return torch.cat(outs)


def measure_prefill(batch: int, length: int, timer, gen: torch.Generator, device="cuda") -> dict:
    """One prefill row: `timer(fn)` gives milliseconds per call of fn."""
    from ..kernels import delta_rule, delta_triton
    s = build_prefill(batch, length, device, gen)
    args = (*s["qkv"], s["g"], s["beta"])
    mixed = functools.partial(delta_triton.chunk_gated_delta_rule_varlen, torch_terms=True)
    ops = {"triton": (delta_triton.chunk_gated_delta_rule_varlen, 0), "loop": (prefill_loop, 1),
           "varlen": (delta_rule.chunk_gated_delta_rule_varlen, 1), "mixed": (mixed, 1)}
    out = {n: f(*args, s["rec"][i], s["starts"], s["slots"], s["kept"]) for n, (f, i) in ops.items()
           if n in ("triton", "loop")}
    us = {n: 1e3 * timer(lambda f=f, i=i: f(*args, s["rec"][i], s["starts"], s["slots"], s["kept"]))
          for n, (f, i) in ops.items()}
    lay = delta_rule.chunk_layout(s["starts"], delta_triton.CHUNK)
    terms = {"terms": lambda: delta_triton.chunk_terms(*args, lay),
             "terms_torch": lambda: delta_rule.chunk_terms(*args, lay["rows"]),
             "terms_rows": lambda: delta_triton.chunk_terms(*args, lay, solve_block=delta_triton.CHUNK)}
    us.update({n: 1e3 * timer(f) for n, f in terms.items()})
    got, want = terms["terms"](), terms["terms_torch"]()
    err = float((out["triton"].float() - out["loop"].float()).abs().max())
    terms_err = max(float((got[n] - want[n]).abs().max()) for n in want)
    return dict(batch=batch, tokens=int(s["starts"][-1]), triton_us=us["triton"], loop_us=us["loop"],
                varlen_us=us["varlen"], mixed_us=us["mixed"], gain=us["loop"] / us["triton"],
                varlen_gain=us["varlen"] / us["triton"], mixed_gain=us["mixed"] / us["triton"],
                terms_us=us["terms"], terms_torch_us=us["terms_torch"], terms_gain=us["terms_torch"] / us["terms"],
                terms_rows_us=us["terms_rows"], blocked_gain=us["terms_rows"] / us["terms"],
                max_abs_err=float(f"{err:.2e}"), terms_max_abs_err=float(f"{terms_err:.2e}"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infer.bench.delta", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="delta.csv", help="the CSV file to write (default delta.csv)")
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES), help="decode batch sizes to time")
    p.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                   help="time a prefill step's chunked rule instead, the batch's prompts TOKENS long at most")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if _refused(args, "delta", "delta rule"):
        return 2
    import triton.testing

    from .kernels import copy_bandwidth
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.prefill:
        return _write(args.out, [measure_prefill(b, args.prefill, triton.testing.do_bench, gen) for b in args.batch],
                      PREFILL_COLUMNS, f"Gated DeltaNet prefill step (chunked rule) on {torch.cuda.get_device_name()}"
                      f", microseconds (do_bench), prompts of {args.prefill} tokens at most, Hk {HK} Hv {HV} Dk {DK} "
                      f"Dv {DV}, bfloat16", {})
    bandwidth = copy_bandwidth()
    rows = [measure(b, bandwidth, triton.testing.do_bench_cudagraph, gen) for b in args.batch]
    return _write(args.out, rows, COLUMNS, f"Gated DeltaNet decode step on {torch.cuda.get_device_name()} (copy "
                  f"bandwidth {bandwidth / 1e12:.2f} TB/s), microseconds under CUDA graphs, Hk {HK} Hv {HV} Dk {DK} "
                  f"Dv {DV}, bfloat16", {"copy_GBps": bandwidth / 1e9})


def _refused(args: argparse.Namespace, name: str, kernels: str) -> bool:
    """Whether python -m infer.bench.NAME refuses its arguments (--out, --batch, --prefill) or a machine without CUDA
    (the Triton KERNELS kernels run only there), said on stderr (infer.bench.delta's and infer.bench.mamba2's)."""
    from .kernels import out_problem
    problem = out_problem(args.out) or next((f"--batch {b}: give batch sizes of 1 or more" for b in args.batch
                                             if b < 1), None)
    if not problem and args.prefill < 0:
        problem = f"--prefill {args.prefill}: give the prompts' length in tokens (1 or more), or 0 for decode steps"
    if problem:
        print(f"python -m infer.bench.{name}: error: {problem}", file=sys.stderr)
        return True
    if not torch.cuda.is_available():
        print(f"infer.bench.{name} needs a CUDA GPU (the Triton {kernels} kernels run only there); none was found",
              file=sys.stderr)
        return True
    return False


def _write(out: str, rows: list[dict], columns: list[str], title: str, extra: dict) -> int:
    """Print the rows' table and write them to the CSV file `out` (with the device and `extra` columns)."""
    import csv

    from .kernels import print_table
    device = torch.cuda.get_device_name()
    print_table(rows, title, columns)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns + ["device", *extra])
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, device=device, **extra))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
