"""Mamba-2 micro-benchmark (Granite 4.0-H's and Nemotron-H's mixers): the Triton kernels of a decode step
(kernels.delta_triton.causal_conv1d_update with the conv's bias, kernels.mamba2_triton.state_update_slots: the
selective state update of every sequence in one launch, in place at its slot) beside the torch code they replace
(delta_rule.causal_conv1d_update, mamba2.state_update_slots: gather the slots' states, compute, scatter them back),
in one run.

    python -m infer.bench.mamba2 --out mamba2.csv

Each row is one decode step of one Mamba-2 layer at granite-4.0-h-small's shape (128 heads of 64, one group of
128 state dims, conv kernel 4 over x|B|C: 8,448 channels), bfloat16 activations, float32 SSM states in a pool of
batch + 1 slots (the last the padding slot) visited in a random order, every sequence carrying its state. Timed
under CUDA graphs (triton.testing.do_bench_cudagraph; the states updated in place at every replay). Columns:
`conv_us` / `conv_torch_us` and `ssm_us` / `ssm_torch_us` the Triton kernel / the torch code; `*_gain` torch /
Triton (> 1: Triton is faster); `*_GBps` the bytes each op must move (its states read and written, its inputs and
outputs) per second of the Triton kernel; `*_floor_us` those bytes at the copy bandwidth measured in the same run
(the memory floor; small batches' states fit in L2); `max_abs_err` the largest difference of the Triton outputs
from torch's. GPU only.

    python -m infer.bench.mamba2 --prefill 2048 --out mamba2_prefill.csv

times a prefill step's SSD scan instead: for each batch, that many prompts of at most 2048 tokens (2048 down to
about half of it) over the same pool, Triton's (mamba2_triton.chunk_scan_varlen: every chunk of the step at once,
the chunk states carried linearly) beside the torch code (mamba2.chunk_scan_varlen: one chunk_scan a sequence, the
CPU path), under triton.testing.do_bench (the step's chunk layout syncs with the host: no graph). Columns
(PREFILL_COLUMNS): `tokens`, `triton_us`, `torch_us`, `gain` torch / Triton, `GBps` and `floor_us` the bytes the scan
must move (x, dt, B, C read, y written in float32, the states), `max_abs_err` Triton's outputs against torch's."""

from __future__ import annotations

import argparse
import sys

import torch

H, P, G, N, TAPS, CHUNK = 128, 64, 1, 128, 4, 256
BATCHES = (1, 8, 32, 64, 128, 256)
COLUMNS = ["batch", "conv_us", "conv_torch_us", "conv_gain", "conv_floor_us", "conv_GBps", "ssm_us", "ssm_torch_us",
           "ssm_gain", "ssm_floor_us", "ssm_GBps", "max_abs_err"]
PREFILL_COLUMNS = ["batch", "tokens", "triton_us", "torch_us", "gain", "floor_us", "GBps", "max_abs_err"]


def channels() -> int:
    """The conv's channels: x|B|C."""
    return H * P + 2 * G * N


def _params(device, gen: torch.Generator, dtype) -> dict:
    """A layer's A (float32, -1 to -16) and D, and dt_bias that puts softplus(dt_bias) between 0.001 and 0.1 (as
    mamba_ssm initialises them)."""
    kw = dict(device=device, generator=gen)
    step = torch.exp(torch.rand(H, **kw) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(0.001)))) * 0.001
    return dict(A=-1 - torch.rand(H, **kw) * 15, D=torch.randn(H, **kw).to(dtype),
                dt_bias=(step + torch.log(-torch.expm1(-step))).to(dtype))


def build(batch: int, device, gen: torch.Generator, dtype=torch.bfloat16) -> dict:
    """One decode step's inputs: every sequence's conv input row and dt, the layer's conv weight and bias and
    parameters, two copies of each state pool (the kernels', torch's), the slots a random order of the pool's."""
    kw = dict(device=device, generator=gen)
    c = channels()
    conv = torch.randn(batch + 1, c, TAPS - 1, **kw).to(dtype)
    rec = torch.randn(batch + 1, H, P, N, **kw) * 0.1
    return dict(x=torch.randn(batch, c, **kw).to(dtype), dt=(torch.randn(batch, H, **kw) * 0.5).to(dtype),
                weight=(torch.randn(c, 1, TAPS, **kw) * 0.5).to(dtype), bias=torch.randn(c, **kw).to(dtype),
                slots=torch.randperm(batch, **kw), kept=torch.ones(batch, dtype=torch.bool, device=device),
                conv=[conv, conv.clone()], rec=[rec, rec.clone()], **_params(device, gen, dtype))


def split(out: torch.Tensor):
    """x [T, H, P], B and C [T, G, N]: views of the conv's output, as the mixer splits it."""
    t = out.shape[0]
    x, b, c = out.split([H * P, G * N, G * N], dim=-1)
    return x.reshape(t, H, P), b.reshape(t, G, N), c.reshape(t, G, N)


def bytes_moved(batch: int, dtype=torch.bfloat16) -> tuple[int, int]:
    """(the conv update's, the state update's) bytes a step must read and write."""
    e = torch.tensor([], dtype=dtype).element_size()
    conv = batch * channels() * (2 * (TAPS - 1) + 2) * e + channels() * (TAPS + 1) * e
    ssm = batch * (H * P * N * 4 * 2 + (2 * H * P + 2 * G * N + H) * e) + H * (4 + 2 * e)
    return conv, ssm


def measure(batch: int, bandwidth: float, timer, gen: torch.Generator, device="cuda") -> dict:
    """One decode row: `timer(fn)` gives milliseconds per call of fn."""
    from ..kernels import delta_rule, delta_triton, mamba2, mamba2_triton
    s = build(batch, device, gen)
    ops = {"triton": (delta_triton, mamba2_triton, 0), "torch": (delta_rule, mamba2, 1)}

    def conv(mod, i):
        return mod.causal_conv1d_update(s["x"], s["weight"], s["conv"][i], s["slots"], s["kept"], s["bias"])
    conv_out = {n: conv(cm, i) for n, (cm, sm, i) in ops.items()}
    x, b, c = split(conv_out["torch"])

    def ssm(mod, i):
        return mod.state_update_slots(x, s["dt"], s["A"], b, c, s["D"], s["dt_bias"], s["rec"][i], s["slots"],
                                      s["kept"])
    ssm_out = {n: ssm(sm, i) for n, (cm, sm, i) in ops.items()}
    err = max(float((out["triton"].float() - out["torch"].float()).abs().max()) for out in (conv_out, ssm_out))
    us = {}
    for n, (cm, sm, i) in ops.items():
        us[f"conv_{n}"] = 1e3 * timer(lambda cm=cm, i=i: conv(cm, i))
        us[f"ssm_{n}"] = 1e3 * timer(lambda sm=sm, i=i: ssm(sm, i))
    row = dict(batch=batch)
    for op, moved in zip(("conv", "ssm"), bytes_moved(batch)):
        row.update({f"{op}_us": us[f"{op}_triton"], f"{op}_torch_us": us[f"{op}_torch"],
                    f"{op}_gain": us[f"{op}_torch"] / us[f"{op}_triton"], f"{op}_floor_us": moved / bandwidth * 1e6,
                    f"{op}_GBps": round(moved / us[f"{op}_triton"] / 1e3, 1)})
    return dict(row, max_abs_err=float(f"{err:.2e}"))


def build_prefill(batch: int, length: int, device, gen: torch.Generator, dtype=torch.bfloat16) -> dict:
    """A prefill step of `batch` prompts (lengths `length` down to about half of it): x, dt, B, C of its tokens (as
    the mixer's split of the conv output gives them), query_start_loc, the slots (a random order of a pool of
    batch + 1 states, every sequence carrying its state) and two copies of the pool."""
    lens = [length - (length // 2) * i // max(batch - 1, 1) for i in range(batch)]
    t = sum(lens)
    kw = dict(device=device, generator=gen)
    x, b, c = split(torch.randn(t, channels(), **kw).to(dtype))
    rec = torch.randn(batch + 1, H, P, N, **kw) * 0.1
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(xbc=(x, (torch.randn(t, H, **kw) * 0.5).to(dtype), b, c), starts=starts,
                slots=torch.randperm(batch, **kw), kept=torch.ones(batch, dtype=torch.bool, device=device),
                rec=[rec, rec.clone()], **_params(device, gen, dtype))


def prefill_bytes(batch: int, tokens: int, dtype=torch.bfloat16) -> int:
    """The bytes a prefill step's scan must move: x, dt, B and C read, y written (float32), the states read and
    written."""
    e = torch.tensor([], dtype=dtype).element_size()
    return tokens * ((H * P + H + 2 * G * N) * e + H * P * 4) + batch * H * P * N * 4 * 2


def measure_prefill(batch: int, length: int, bandwidth: float, timer, gen: torch.Generator, device="cuda") -> dict:
    """One prefill row: `timer(fn)` gives milliseconds per call of fn."""
    from ..kernels import mamba2, mamba2_triton
    s = build_prefill(batch, length, device, gen)
    x, dt, b, c = s["xbc"]
    ops = {"triton": (mamba2_triton.chunk_scan_varlen, 0), "torch": (mamba2.chunk_scan_varlen, 1)}

    def run(f, i):
        return f(x, dt, s["A"], b, c, s["D"], s["dt_bias"], CHUNK, s["rec"][i], s["starts"], s["slots"], s["kept"])
    out = {n: run(f, i) for n, (f, i) in ops.items()}
    us = {n: 1e3 * timer(lambda f=f, i=i: run(f, i)) for n, (f, i) in ops.items()}
    tokens = int(s["starts"][-1])
    moved = prefill_bytes(batch, tokens)
    err = float((out["triton"] - out["torch"]).abs().max())
    return dict(batch=batch, tokens=tokens, triton_us=us["triton"], torch_us=us["torch"],
                gain=us["torch"] / us["triton"], floor_us=moved / bandwidth * 1e6,
                GBps=round(moved / us["triton"] / 1e3, 1), max_abs_err=float(f"{err:.2e}"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infer.bench.mamba2", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="mamba2.csv", help="the CSV file to write (default mamba2.csv)")
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES), help="batch sizes to time")
    p.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                   help="time a prefill step's SSD scan instead, the batch's prompts TOKENS long at most")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from .delta import _refused, _write
    if _refused(args, "mamba2", "Mamba-2"):
        return 2
    import triton.testing

    from .kernels import copy_bandwidth
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    shape = f"H {H} P {P} G {G} N {N}, bfloat16, copy bandwidth {bandwidth / 1e12:.2f} TB/s"
    if args.prefill:
        rows = [measure_prefill(b, args.prefill, bandwidth, triton.testing.do_bench, gen) for b in args.batch]
        return _write(args.out, rows, PREFILL_COLUMNS, f"Mamba-2 prefill step (SSD scan, chunk {CHUNK}) on "
                      f"{torch.cuda.get_device_name()}, microseconds (do_bench), prompts of {args.prefill} tokens at "
                      f"most, {shape}", {"copy_GBps": bandwidth / 1e9})
    rows = [measure(b, bandwidth, triton.testing.do_bench_cudagraph, gen) for b in args.batch]
    return _write(args.out, rows, COLUMNS, f"Mamba-2 decode step on {torch.cuda.get_device_name()}, microseconds "
                  f"under CUDA graphs, {shape}", {"copy_GBps": bandwidth / 1e9})


if __name__ == "__main__":
    sys.exit(main())
