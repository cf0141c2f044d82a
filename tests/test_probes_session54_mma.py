"""Session 54 probes of the int4 W4A16 GEMM's batched mma.sync tiles (SYNC_MMA, `gptq_kernels.mma_kernel` with
SYNC): the words, zeros and scales read in the batched dot's slices (`slice_cols`, SLICED), checked in the sm_90
machine code (registers, 16-byte copies of the words) and under the interpreter against the torch reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer.kernels import gptq_configs
from infer.kernels import reference as ref
from infer.quant import packing

from helpers import interpreted_module

ROOT = Path(__file__).resolve().parents[1]
triton = pytest.importorskip("triton")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _loops(specs):
    """({spec: {"REG": registers, "loop": main-loop instructions, opcode: count}}, (major, minor) of the Triton that
    compiled them) from scripts/kernel-sass --loop."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--loop", *specs],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {}
    for line in out.stdout.splitlines():
        for spec in specs:
            if line.startswith(spec + " ") and line[len(spec):].lstrip().startswith("loop"):
                counts = {k: int(v) for k, v in re.findall(r"(\w+)[=:](\d+)", line)}
                counts["loop"] = int(re.search(r"loop\s+(\d+)", line).group(1))
                rows[spec] = counts
    assert set(rows) == set(specs), out.stdout
    version = re.search(r"triton (\d+)\.(\d+)", out.stdout)
    assert version, out.stdout
    return rows, (int(version.group(1)), int(version.group(2)))


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_sync_mma_64_row_tile_fits_three_programs_per_sm_at_sm90():
    """The 64 x 128 mma.sync tile on 4 warps (the 17-64-row SYNC_MMA candidates): its words reach shared memory by
    16-byte copies along N, as the wgmma tile's do (reshaped from [128, 16] after the load, each thread copied them
    4 bytes at a time along K: 25 copies a K step instead of 13, and 16 more pointers live through the loop), so
    it takes at most 168 registers with Triton 3.6 (the GPU machine's; 250 before: 3 programs per SM at 128
    threads instead of 2) and at most 176 with another Triton (3.9: 169, 254 before), with the same mma.sync work
    (128 HMMA a K step, x by ldmatrix, no wgmma) and nothing spilled."""
    wgmma, sync, rows32 = "mmatb 64 128 4 3 16 1", "mmatb 64 128 4 3 16 1 sync", "mmatb 32 128 4 3 16 1 sync"
    c, version = _loops([wgmma, sync, rows32])
    cap = 168 if version == (3, 6) else 176
    assert c[sync]["REG"] <= cap and c[rows32]["REG"] <= 168, c
    assert c[sync]["HMMA"] == 128 and c[sync]["HGMMA"] == 0 and c[sync]["WARPGROUP"] == 0, c
    assert c[sync]["LDSM"] == 32 and c[rows32]["HMMA"] == 64, c  # x: 4 ldmatrix.x4 per field and warp
    assert c[sync]["LDGSTS"] == c[wgmma]["LDGSTS"] == c[rows32]["LDGSTS"], c  # the words by 16-byte copies
    assert c[sync]["loop"] < 530, c  # 544 before (Triton 3.6; 3.9 within 2%)
    for spec in (sync, rows32):
        assert c[spec]["STACK"] == 0 and c[spec]["LDL"] == c[spec]["STL"] == 0, c


@pytest.fixture(scope="module")
def gemm():
    yield from interpreted_module("infer.kernels.gptq_gemm")


def _close(got, want, what):
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    assert got.shape == want.shape, what
    err = (got - want).abs().max() / want.abs().max().clamp_min(1e-6)
    assert torch.isfinite(got).all() and err <= 2e-3, f"{what}: relative error {err:.2e}"


def test_sliced_sync_tiles_compute_right(gemm):
    """Every SYNC_MMA form against the reference: sliced words (32+ columns per warp) and the reshaped ones (128 x
    128 on 8 warps: 16), 4- and 8-bit, interleaved and GPTQ-order rows, K not a whole number of steps, masked
    columns, the scale folded or applied to the sum, split-K, and a gate|up layer with a bias whose tile's slices
    fall in both halves."""
    from infer.kernels import gptq_tune
    g = torch.Generator().manual_seed(54)
    for bits, k, n, m, (bm, bn, w), split, scale_w in (
            (4, 256, 200, 40, (64, 128, 4), 2, True), (4, 256, 136, 70, (128, 128, 8), 1, True),
            (4, 320, 72, 19, (32, 128, 4), 1, False), (8, 256, 96, 5, (16, 128, 4), 2, True),
            (4, 256, 296, 33, (64, 256, 8), 1, True)):
        qw, qz, s, gi = packing.quantize_rtn(torch.randn(n, k, generator=g), bits, 128, True, None)
        wp = gptq_configs.interleave_for(128, k, 32 // bits)
        qi = packing.interleave_rows(qw, bits, wp) if wp > 1 else qw
        x = torch.randn(m, k, generator=g).half()
        cfg = dict(gptq_tune._field("mmat", bm, bn, w, split, 3, scale_w), SYNC_MMA=True)
        want = ref.gptq_matmul(x, qw, qz, s, gi, bits, True)
        y = gemm.gptq_matmul(x.to(DEV), qi.to(DEV), qz.to(DEV), s.to(DEV), gi.to(DEV), bits, True, 128, wp,
                             config=cfg)
        _close(y, want, f"{bits}-bit K={k} N={n} M={m} {cfg}")
    half, k = 128, 256
    qw, qz, s, gi = packing.quantize_rtn(torch.randn(2 * half, k, generator=g), 4, 128, True, None)
    wp = gptq_configs.interleave_for(128, k, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    x = torch.randn(24, k, generator=g).half()
    bias = (torch.randn(2 * half, generator=g) * 0.1).half()
    want = ref.silu_and_mul(ref.gptq_matmul(x.float(), qw, qz, s, gi, 4, True, 128, bias=bias.float()))
    for split in (1, 2):
        cfg = dict(gptq_tune._field("mmat", 32, 128, 4, split), SYNC_MMA=True)  # (gated: up to 32 rows a tile)
        assert gemm.gated_fits("mmat", cfg, 2 * half)
        y = gemm.gptq_matmul(x.to(DEV), qi.to(DEV), qz.to(DEV), s.to(DEV), gi.to(DEV), 4, True, 128, wp, config=cfg,
                             bias=bias.to(DEV), gated=True)
        _close(y, want, f"gated split={split}")
