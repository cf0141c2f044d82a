"""The Triton GPTQ matmul against the torch reference: under TRITON_INTERPRET=1 on CPU at small sizes, at real
sizes on a GPU. Inputs are random (a fresh seed every run, printed on failure) and every output torch allocates
starts as NaN (fill_uninitialized_memory), so a tile the kernel forgets to write fails the comparison. Both
regimes are forced with explicit configs (decode: small BLOCK_M and split-K with an uneven split; prefill: grouped
tile order with several M tiles), and the default heuristic is exercised too."""

from __future__ import annotations

import json

import re

import pytest
import torch

from infer import kernels
from infer.kernels import gptq_configs
from infer.kernels import reference as ref
from infer.quant import packing

from helpers import check_env_choice, interpreted_module

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # max error / max |reference|
DECODE = dict(kernel="mma", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, GROUP_M=1, num_warps=4, num_stages=2)
PREFILL = dict(kernel="mma", BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, GROUP_M=2, num_warps=4, num_stages=2)
GEMV = dict(kernel="gemv", BLOCK_N=32, BLOCK_K=64, SPLIT_K=3, num_warps=4, num_stages=2)
ROWS = dict(kernel="gemv", BLOCK_M=4, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)
MMAT = dict(kernel="mmat", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)
FIELDS = dict(kernel="mma", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, GROUP_M=1, num_warps=4, num_stages=2,
              FIELD=True)  # one dot per packed field (needs BLOCK_K / pack >= 16)
GEMV_FIELDS = dict(GEMV, BLOCK_K=128, FIELD=True)
GEMV_INPLACE = dict(GEMV, BLOCK_K=128, INPLACE=True)  # fields OR-ed into the mantissa where they lie
MMAT_FIELDS = dict(MMAT, BLOCK_K=128, FIELD=True)
SCALED = dict(FIELDS, BLOCK_M=32, SPLIT_K=1, SCALE_W=True)  # the group's scale folded into the weights
PAIRS = dict(FIELDS, PAIRS=True)  # 4-bit: fields j and j + 4 of each word in one dot
PAIRS_SCALED = dict(SCALED, PAIRS=True)
MMAT_SCALED = dict(MMAT_FIELDS, SCALE_W=True)
MMAT_PAIRS = dict(MMAT_FIELDS, PAIRS=True)  # two fields per dot, the weight as the first operand
MMAT_PAIRS_SCALED = dict(MMAT_SCALED, PAIRS=True)
SHIFTS = dict(FIELDS, BYTES=False)  # 4-bit fields shifted out one at a time (the field tiles take them by byte)
MMAT_SHIFTS_SCALED = dict(MMAT_SCALED, BYTES=False)
MMAT_JOINED = dict(MMAT_SCALED, BYTE_DOTS=True)  # by byte, one dot per byte's two fields (where a config asks)
LATE_SCALES = dict(DECODE, AHEAD=False)  # each K step's scales loaded in that step, not during the step before
MMAT_LATE_SCALES = dict(MMAT_SCALED, AHEAD=False)
GEMV_LATE = dict(GEMV_INPLACE, AHEAD=False)  # the one-row gemv: each step's words, zeros and scales in that step
CONFIGS = {"decode": DECODE, "prefill": PREFILL, "gemv": GEMV, "rows": ROWS, "mmat": MMAT, "fields": FIELDS,
           "gemv_fields": GEMV_FIELDS, "mmat_fields": MMAT_FIELDS, "scaled": SCALED, "mmat_scaled": MMAT_SCALED,
           "gemv_inplace": GEMV_INPLACE, "pairs": PAIRS, "pairs_scaled": PAIRS_SCALED, "mmat_pairs": MMAT_PAIRS,
           "mmat_pairs_scaled": MMAT_PAIRS_SCALED, "shifts": SHIFTS, "mmat_shifts_scaled": MMAT_SHIFTS_SCALED,
           "mmat_joined": MMAT_JOINED, "late_scales": LATE_SCALES, "mmat_late_scales": MMAT_LATE_SCALES,
           "gemv_late": GEMV_LATE,
           "dequant": {"kernel": "dequant"},
           "dequant_chunks": {"kernel": "dequant", "CHUNK_N": 32}}  # columns a block at a time, a ragged last one


@pytest.fixture(scope="module")
def gemm():
    """infer.kernels.gptq_gemm, interpreted on CPU when there is no GPU."""
    yield from interpreted_module("infer.kernels.gptq_gemm")


pytestmark = pytest.mark.usefixtures("poisoned_outputs")  # (tests/conftest.py)


def make_weights(g, bits, group, in_f, out_f, sym, desc_act, v2=False):
    w = torch.randn(out_f, in_f, generator=g)
    perm = torch.randperm(in_f, generator=g) if desc_act else None
    qw, qz, s, gi = packing.quantize_rtn(w, bits, group, sym, perm)
    if v2:
        qz = packing.zeros_v1_to_v2(qz, bits)
    return [t.to(DEV) for t in (qw, qz, s, gi)]


def assert_close(got, want, dtype, g, what=""):
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite output (seed {g.initial_seed()})"
    err = (got - want).abs().max() / want.abs().max().clamp_min(1e-6)
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} (seed {g.initial_seed()})"


# (bits, group_size, desc_act, hint): hint = pass group_size to the kernel (plain g_idx), else it reads g_idx
LAYOUTS = [(4, 32, False, True), (4, 128, False, True), (4, -1, False, True), (4, 64, True, False),
           (8, 32, False, True), (8, 64, False, False), (8, -1, True, False), (8, 128, True, False)]


@pytest.mark.parametrize("regime", list(CONFIGS))
@pytest.mark.parametrize("bits, group, desc_act, hint", LAYOUTS)
def test_matches_reference(gemm, gen, regime, bits, group, desc_act, hint):
    g = gen
    gs = group if group != -1 else 32 * int(torch.randint(2, 6, (1,), generator=g))
    in_f = gs * int(torch.randint(1, 4, (1,), generator=g)) if group != -1 else gs
    in_f = max(in_f, 64)
    out_f = 8 * int(torch.randint(5, 13, (1,), generator=g))  # not a multiple of BLOCK_N: masked columns
    sym, v2 = bool(torch.randint(0, 2, (1,), generator=g)), bool(torch.randint(0, 2, (1,), generator=g))
    qw, qz, s, gi = make_weights(g, bits, group, in_f, out_f, sym, desc_act, v2)
    lo, hi = {"decode": (1, 20), "prefill": (33, 90), "gemv": (1, 4), "rows": (1, 11), "mmat": (1, 40),
              "fields": (1, 20), "gemv_fields": (1, 3), "mmat_fields": (1, 40), "scaled": (17, 70),
              "mmat_scaled": (1, 40), "gemv_inplace": (1, 3), "pairs": (1, 20), "pairs_scaled": (17, 70),
              "mmat_pairs": (1, 20), "mmat_pairs_scaled": (17, 40), "shifts": (1, 20), "mmat_shifts_scaled": (1, 40),
              "mmat_joined": (1, 40), "late_scales": (1, 20), "mmat_late_scales": (1, 40), "gemv_late": (1, 3),
              "dequant": (1, 90),
              "dequant_chunks": (1, 90)}[regime]
    m = int(torch.randint(lo, hi, (1,), generator=g))
    cfg = CONFIGS[regime]
    # with plain groups, also the rows interleaved as the linear method repacks them on CUDA
    wp = gptq_configs.interleave_for(group, in_f, 32 // bits) if hint else 1
    layouts = [(qw, 1)] + ([(packing.interleave_rows(qw, bits, wp), wp)] if wp > 1 else [])
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(m, in_f, generator=g).to(dtype).to(DEV)
        want = ref.gptq_matmul(x, qw, qz, s, gi, bits, not v2)
        for w, il in layouts:
            y = gemm.gptq_matmul(x, w, qz, s, gi, bits, not v2, group if hint else None, il, config=cfg)
            assert y.dtype == dtype
            assert_close(y, want, dtype, g, f"{regime} {bits}-bit g{group} desc_act={desc_act} M={m} {dtype} "
                                            f"interleave={il}")


GATED_REGIMES = ["decode", "prefill", "gemv", "rows", "mmat", "fields", "mmat_scaled", "gemv_inplace", "pairs",
                 "mmat_joined", "mmat_64", "dequant"]


@pytest.mark.parametrize("regime", GATED_REGIMES)
def test_gated_epilogue_applies_silu_and_mul(gemm, gen, monkeypatch, regime):
    """A gate|up layer with `gated`: the fused kernels apply silu(gate) * up in their epilogue (each tile takes its
    gate columns and the up columns of the same outputs; with split-K, after the partials are summed), the same
    values as the plain matmul followed by silu_and_mul; where the tiles cannot hold aligned halves (or dequantize
    + cuBLAS runs) the launcher applies silu_and_mul after the matmul instead."""
    g = gen
    cfg = dict(MMAT_SCALED, BLOCK_M=64) if regime == "mmat_64" else CONFIGS[regime]
    launches = []
    launch = gemm._launch
    monkeypatch.setattr(gemm, "_launch", lambda *a, **kw: (launches.append(a[16] if len(a) > 16 else
                                                                          kw.get("gated")), launch(*a, **kw))[1])
    fused = regime != "dequant"
    for half, fits in ((64, regime not in ("dequant", "mmat_64")), (40, False)):  # 40: not a multiple of 16 columns
        qw, qz, s, gi = make_weights(g, 4, 32, 128, 2 * half, True, False)
        m = int(torch.randint(1, 4 if regime.startswith("gemv") else 70 if regime == "prefill" else 20, (1,),
                              generator=g))
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(m, 128, generator=g).to(dtype).to(DEV)
            bias = (torch.randn(2 * half, generator=g) * 0.1).to(dtype).to(DEV)
            plain = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, config=cfg, bias=bias)
            # in float32 from the same inputs: a float16 reference rounds the matmul, then silu and the product, and
            # stacks up to 2e-3 of its own error on the kernel's one rounding of its float32 result
            want = ref.silu_and_mul(ref.gptq_matmul(x.cpu().float(), qw.cpu(), qz.cpu(), s.cpu(), gi.cpu(), 4, True,
                                                    32, bias=bias.cpu().float()))
            launches.clear()
            y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, config=cfg, bias=bias, gated=True)
            assert y.shape == (m, half) and y.dtype == dtype
            assert launches == ([True] if fits else [False] if fused else []), (regime, half, launches)
            assert_close(y, want, dtype, g, f"{regime} gated half={half} M={m} {dtype}")
            assert_close(y, ref.silu_and_mul(plain.cpu().float()), dtype, g, f"{regime} gated vs plain + silu_and_mul")
            assert ref.gptq_matmul(x.cpu(), qw.cpu(), qz.cpu(), s.cpu(), gi.cpu(), 4, True, 32, bias=bias.cpu(),
                                   gated=True).shape == (m, half)


def test_gated_fits_needs_aligned_halves(gemm):
    assert gemm.gated_fits("mma", {"BLOCK_N": 128}, 2 * 11008)  # 11008 = 172 x 64
    assert not gemm.gated_fits("mma", {"BLOCK_N": 128}, 2 * 11000)  # halves not a whole number of 64-column tiles
    assert not gemm.gated_fits("mmat", {"BLOCK_N": 16}, 2 * 64)  # 8-column halves: below the 16-column alignment
    assert gemm.gated_fits("gemv", {"BLOCK_N": 32}, 2 * 48)
    assert not gemm.gated_fits("dequant", {}, 2 * 64)
    assert not gemm.gated_fits("mma", {"BLOCK_N": 64}, 2 * 48 + 1)
    assert gemm.gated_fits("mmat", {"BLOCK_M": 32, "BLOCK_N": 128}, 2 * 11008)
    assert not gemm.gated_fits("mmat", {"BLOCK_M": 64, "BLOCK_N": 128}, 2 * 11008)  # its registers: see gated_fits


@pytest.mark.parametrize("m", [1, 7, 80])
def test_default_config_bf16_and_leading_dims(gemm, gen, m):
    """pick_config's choice, bf16 activations, a 3-D non-contiguous x."""
    g = gen
    qw, qz, s, gi = make_weights(g, 4, 64, 128, 48, False, False)
    x = torch.randn(2, m, 256, generator=g).to(torch.bfloat16).to(DEV)[..., ::2]
    y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 64)
    assert y.shape == (2, m, 48)
    assert_close(y, ref.gptq_matmul(x, qw, qz, s, gi, 4, True), torch.bfloat16, g)


def test_negative_words_and_extreme_values(gemm, gen):
    """Every packed word has its sign bit set (value 15/255 in the top field) and zeros sit at both ends, through
    the kernels that unpack the words in their own ways (shifts; by byte permute; fields in place; two fields per
    lop3)."""
    g = gen
    for bits in (4, 8):
        maxq, in_f, out_f, gs = (1 << bits) - 1, 256, 32, 128
        q = torch.randint(0, maxq + 1, (in_f, out_f), generator=g)
        q.view(in_f // (32 // bits), 32 // bits, out_f)[:, -1] = maxq
        z = torch.randint(0, maxq + 1, (2, out_f), generator=g)
        z[0], z[1, :4] = 0, maxq
        qw, qz = packing.pack_rows(q, bits), packing.pack_cols(z, bits)  # v2 zeros
        assert bool((qw < 0).all())
        s = (torch.rand(2, out_f, generator=g) * 0.1).half()
        gi = (torch.arange(in_f) // gs).int()
        x = torch.randn(5, in_f, generator=g)
        args = [t.to(DEV) for t in (qw, qz, s, gi)]
        w = ((q - z[gi.long()]).half() * s[gi.long()]).float()  # [in, out], built without the packing module
        y = gemm.gptq_matmul(x.to(DEV), *args, bits, False, gs, config=DECODE)
        assert_close(y, x @ w, torch.float32, g, f"{bits}-bit")
        xh = x.half()
        for cfg, m in ((GEMV_INPLACE, 1), (PAIRS, 5), (PAIRS_SCALED, 5), (MMAT_PAIRS, 5), (FIELDS, 5),
                       (MMAT_SCALED, 5), (SHIFTS, 5)):
            y = gemm.gptq_matmul(xh[:m].to(DEV), *args, bits, False, gs, config=cfg)
            assert_close(y, xh[:m].float() @ w, torch.float16, g, f"{bits}-bit {cfg}")


def test_launcher_takes_4bit_fields_by_byte_permute(gemm, gen, monkeypatch):
    """The field tiles take 4-bit fields by byte permute (gptq_kernels._byte_fields) unless the config says
    BYTES=False; two fields per dot (PAIRS) and 8-bit fields keep their own unpacking."""
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(kw)
    monkeypatch.setattr(gemm, "mma_kernel", Recorder())
    g = gen
    for bits, cfg in ((4, FIELDS), (4, MMAT_SCALED), (4, SHIFTS), (4, PAIRS), (8, FIELDS), (4, DECODE)):
        qw, qz, s, gi = make_weights(g, bits, 128, 256, 32, False, False)
        gemm.gptq_matmul(torch.randn(5, 256, generator=g).half().to(DEV), qw.to(DEV), qz.to(DEV), s.to(DEV),
                         gi.to(DEV), bits, True, 128, config=cfg)
    assert [c["BYTES"] for c in calls] == [True, True, False, False, False, False]
    assert [c["FIELD_DOTS"] for c in calls] == [True] * 5 + [False]
    assert [c["BYTE_DOTS"] for c in calls] == [False] * 6  # one dot per field unless the config asks
    calls.clear()  # where it asks: transposed 4-warp field tiles taken by byte permute only
    for cfg in (MMAT_JOINED, dict(MMAT_JOINED, num_warps=8), dict(FIELDS, BYTE_DOTS=True),
                dict(MMAT_JOINED, BYTES=False), dict(MMAT_SCALED, BYTE_DOTS=False)):
        gemm.gptq_matmul(torch.randn(5, 256, generator=g).half().to(DEV), qw.to(DEV), qz.to(DEV), s.to(DEV),
                         gi.to(DEV), 4, True, 128, config=cfg)
    assert [(c["BYTES"], c["BYTE_DOTS"]) for c in calls] == [(True, True), (True, False), (True, False),
                                                             (False, False), (True, False)]


def test_groups_by_shift_or_by_division(gemm, gen, monkeypatch):
    """The kernels find a K step's group by a shift where the group size is a power of two (GS_LOG2, what
    `group_shift` gives the launch) and by a division otherwise: both right against the reference, across splits
    whose steps cross groups, on every kernel kind, interleaved or not."""
    assert [gemm.group_shift(v) for v in (1, 32, 128, 4096, 96, 320, 384, 0, -1)] == [0, 5, 7, 12, -1, -1, -1, -1, -1]
    seen = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["GS_LOG2"])
                return self.kernel[grid](*args, **kw)
            return launch
    for name in ("mma_kernel", "gemv_kernel", "gemv_rows_kernel"):
        monkeypatch.setattr(gemm, name, Recording(getattr(gemm, name)))
    g = gen
    # (group as checkpointed, K): 96 -> K steps of 32 rows, 3 to a group; -1 with K = 384 -> one group of 384 rows
    for group, k, want_log2 in ((128, 384, 7), (96, 384, -1), (-1, 384, -1), (-1, 256, 8), (32, 224, 5)):
        qw, qz, s, gi = make_weights(g, 4, group, k, 40, False, False)
        gs = k if group == -1 else group
        wp = gptq_configs.interleave_for(group, k, 8)
        layouts = [(qw, 1)] + ([(packing.interleave_rows(qw, 4, wp), wp)] if wp > 1 else [])
        for cfg in (DECODE, FIELDS, MMAT_SCALED, GEMV_INPLACE, ROWS):
            m = 1 if cfg["kernel"] == "gemv" and "BLOCK_M" not in cfg else 6
            x = torch.randn(m, k, generator=g).half().to(DEV)
            want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True)
            for w, il in layouts:
                seen.clear()
                y = gemm.gptq_matmul(x, w, qz, s, gi, 4, True, gs, il, config=cfg)
                assert seen == [want_log2], (group, k, cfg, seen)
                assert_close(y, want, torch.float16, g, f"g{group} K={k} {cfg} interleave={il}")


def test_loads_one_step_ahead_give_the_same_bits(gemm, gen, monkeypatch):
    """The tensor-core tiles load each K step's scales during the step before, and the one-row gemv each step's
    words, zeros and scales (AHEAD, the default: the loads' latency hides behind a whole step), unless the config
    says AHEAD=False (loaded in their own step): the same outputs bit for bit, with splits whose steps cross groups,
    ragged last steps, grouped tiles, and one-step splits."""
    g = gen
    for cfg, group, k, m in ((DECODE, 32, 224, 9), (MMAT_SCALED, 128, 384, 20), (FIELDS, 128, 640, 5),
                             (PREFILL, 64, 256, 70), (MMAT_FIELDS, -1, 320, 3), (dict(MMAT_SCALED, BLOCK_M=64), 128,
                                                                                   512, 40),
                             (GEMV_INPLACE, 128, 640, 1), (GEMV, 32, 224, 2), (dict(GEMV_INPLACE, SPLIT_K=5), 128,
                                                                                640, 1), (GEMV_FIELDS, -1, 320, 1)):
        qw, qz, s, gi = make_weights(g, 4, group, k, 72, False, False)
        gs = k if group == -1 else group
        x = torch.randn(m, k, generator=g).half().to(DEV)
        ahead = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, gs, config=cfg)
        late = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, gs, config=dict(cfg, AHEAD=False))
        assert torch.equal(ahead, late), (cfg, group, k)
        assert_close(ahead, ref.gptq_matmul(x, qw, qz, s, gi, 4, True), torch.float16, g, f"{cfg} g{group}")
    calls = []

    class Recorder:
        def __init__(self, flag):
            self.flag = flag

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(kw[self.flag])
    monkeypatch.setattr(gemm, "mma_kernel", Recorder("PRE_S"))
    monkeypatch.setattr(gemm, "gemv_kernel", Recorder("AHEAD"))
    qw, qz, s, gi = make_weights(g, 4, 128, 256, 32, False, False)
    # the one-row gemv ahead where a step is at most 8 words a thread (GEMV_INPLACE: 32 columns x 16 words over 4
    # warps; 128 columns: 16 words, not unless the config asks; 128 columns on 8 warps: 8)
    wide = dict(GEMV_INPLACE, BLOCK_N=128)
    cfgs = (FIELDS, MMAT_LATE_SCALES, DECODE, dict(FIELDS, AHEAD=True), GEMV_INPLACE, GEMV_LATE, wide,
            dict(wide, AHEAD=True), dict(wide, num_warps=8))
    for cfg in cfgs:
        gemm.gptq_matmul(torch.randn(1 if cfg["kernel"] == "gemv" else 5, 256, generator=g).half().to(DEV), qw, qz, s,
                         gi, 4, True, 128, config=cfg)
    assert calls == [True, False, True, True, True, False, False, True, True]
    calls.clear()  # INFER_INT4_LOADS=late: in their own step where the config does not say
    monkeypatch.setattr(gemm, "int4_loads", "late")
    for cfg in cfgs:
        gemm.gptq_matmul(torch.randn(1 if cfg["kernel"] == "gemv" else 5, 256, generator=g).half().to(DEV), qw, qz, s,
                         gi, 4, True, 128, config=cfg)
    assert calls == [False, False, False, True, False, False, False, True, False]
    # the rows gemv and dequantize + cuBLAS have no K-step loads to move
    assert not gemm.loads_ahead_for("gemv", ROWS, 4) and not gemm.loads_ahead_for("dequant", {}, 4)


def test_int4_loads_from_the_environment(gemm, monkeypatch):
    check_env_choice(monkeypatch, gemm, "int4_loads", gemm.loads_ahead, "INFER_INT4_LOADS",
                     ((None, True), ("late", False), (" ahead", True)), "early", ("ahead", "late"))


def test_byte_fields_probe_and_its_fallback(gemm, monkeypatch, caplog):
    """The engine start's probe (gptq_gemm.configure_byte_fields): both ways of taking the fields give the same
    outputs bit for bit (here interpreted); a difference is reported, warned about at the start, and the field
    tiles on that device then shift their fields out one at a time."""
    assert gemm.probe_byte_fields("cpu") is None
    real = gemm.gptq_matmul

    def broken(*args, config=None, **kw):  # a GPU whose byte permute computes something else
        y = real(*args, config=config, **kw)
        return y + 1 if config and config.get("BYTES") else y
    monkeypatch.setattr(gemm, "gptq_matmul", broken)
    assert "other outputs than the shifted ones" in gemm.probe_byte_fields("cpu")
    monkeypatch.setattr(gemm, "gptq_matmul", real)
    monkeypatch.setattr(gemm, "_BYTES", {})
    monkeypatch.setattr(gemm, "probe_byte_fields", lambda device: "the byte-permuted fields give other outputs")
    with caplog.at_level("WARNING", logger="infer"):
        assert gemm.configure_byte_fields(torch.device("cuda", 0)) is False
    assert "keep shifting their fields out one at a time: the byte-permuted fields give" in caplog.text
    assert gemm.configure_byte_fields("cpu") is True  # no probe off a GPU
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(kw)
    monkeypatch.setattr(gemm, "mma_kernel", Recorder())
    monkeypatch.setitem(gemm._BYTES, torch.device("cpu"), False)  # as a failed probe leaves a GPU
    g = torch.Generator().manual_seed(0)
    qw, qz, s, gi = make_weights(g, 4, 128, 256, 32, False, False)
    gemm.gptq_matmul(torch.randn(5, 256, generator=g).half(), qw, qz, s, gi, 4, True, 128, config=FIELDS)
    gemm.gptq_matmul(torch.randn(5, 256, generator=g).half(), qw, qz, s, gi, 4, True, 128,
                     config=dict(FIELDS, BYTES=True))
    assert [c["BYTES"] for c in calls] == [False, True]


def test_warmup_reports_the_int4_unpacking(capsys):
    """`infer warmup` on a GPU says whether the start-up probe let the field tiles take their fields by byte
    permute, whether the int4 kernels load a K step ahead, whether the kernels use PDL, and (with adapters) up to
    how many tokens the LoRA expands of a step are gathers; off a GPU none of these rows is printed."""
    from infer.cli.warmup import print_plan
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig
    from infer.models.tiny import ensure_builtin
    plan, extra = estimate_plan(EngineConfig(str(ensure_builtin("tiny-llama"))), 64, 2)
    print_plan(plan, extra)
    out = capsys.readouterr().out
    assert "byte permute" not in out and "INFER_INT4_LOADS" not in out and "INFER_LORA_EXPAND" not in out
    for on, word in ((True, "yes"), (False, "no")):
        print_plan(plan, dict(extra, pdl=True, int4_byte_fields=on, int4_loads_ahead=not on,
                              lora_expand_gather=16 if on else 0))
        out = capsys.readouterr().out.replace("\n", " ")
        assert re.search(rf"int4 fields unpacked by byte permute.*?{word}", out, re.S), out
        other = "no" if on else "yes"
        assert re.search(rf"int4 loads one K step ahead \(INFER_INT4_LOADS\)\s*│\s*{other}", out), out
        gathered = "up to 16 tokens a step" if on else "no"
        assert re.search(rf"LoRA expands gathered \(INFER_LORA_EXPAND\)\s*│\s*{gathered}", out), out
        assert "programmatic dependent launch" in out


def test_wide_row_tiles_compute_right(gemm, gen):
    """The transposed field tiles of 128 and 256 rows (`gptq_tune._wide_rows`: 65-256 rows, and with GROUP_M for
    prefills), with masked rows and columns, on an interleaved layer, against the reference."""
    from infer.kernels import gptq_tune
    g = gen
    k, n = 256, 200
    qw, qz, s, gi = make_weights(g, 4, 128, k, n, True, False)
    wp = gptq_configs.interleave_for(128, k, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    for m, quick in ((128, True), (256, True), (256, False), (2048, True), (2048, False)):  # tuned over
        cands = gptq_tune.candidates(m, 128, quick, k)
        tiles = {(c["BLOCK_M"], c["num_warps"]) for c in cands if c["kernel"] == "mmat"}
        assert (128, 4) in tiles and ((256, 8) in tiles) == (m > 128), (m, quick, tiles)
    for m in (20, 32, 40, 64):  # the H100's 33-64-row winner: one transposed 4-warp tile of all the rows
        tiles = {(c["BLOCK_M"], c["num_warps"], c["SPLIT_K"]) for c in gptq_tune.candidates(m, 128, True, 4096)
                 if c["kernel"] == "mmat" and not c.get("PAIRS")}
        bm = 32 if m <= 32 else 64
        assert {(bm, 4, s) for s in (1, 2, 4, 8)} <= tiles, (m, tiles)
    for m, cfgs in ((100, gptq_tune._wide_rows(100, (2,))), (300, gptq_tune.candidates(600, 128, True, k))):
        x = torch.randn(m, k, generator=g).half().to(DEV)
        want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True)
        wide = [c for c in cfgs if c["kernel"] == "mmat" and c["BLOCK_M"] >= 128]
        assert wide and all(c["SCALE_W"] and c["FIELD"] for c in wide)
        for cfg in wide:
            assert_close(gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 128, wp, config=cfg), want, torch.float16, g,
                         f"M={m} {cfg}")



def test_wide_column_tiles_are_candidates_and_compute_right(gemm, gen, monkeypatch):
    """The transposed 4-warp field tiles over 256 weight columns (`gptq_tune._wide_cols`: 17-64 rows, each x tile
    read from L2 serving twice the columns), in the engine start's quick set and in the full set, split-K only at 64
    rows and with the Triton its registers were checked with (`_no_spill`), against the reference with masked rows
    and columns on an interleaved layer."""
    from infer.kernels import gptq_tune
    g = gen
    k, n = 256, 200
    for version, tall in (((3, 6), True), ((3, 9), False)):  # the 64-row tile spills with 3.9's code
        monkeypatch.setattr(gptq_tune, "TRITON", version)
        for m in (20, 32, 40, 64):
            bm = 32 if m <= 32 else 64
            for quick in (True, False):
                wide = [c for c in gptq_tune.candidates(m, 128, quick, 4096) if c["kernel"] == "mmat"
                        and c["BLOCK_N"] == 256 and c["num_warps"] == 4]
                splits = {c["SPLIT_K"] for c in wide}
                assert all(c["BLOCK_M"] == bm and c["SCALE_W"] and not c.get("PAIRS") for c in wide), (m, wide)
                want = ({1, 2, 4} if bm == 32 else {2, 4} if tall else set()) | ({8} if not quick and wide else set())
                assert splits == want, (version, m, quick, splits)
    assert not any(c["BLOCK_N"] == 256 and c["num_warps"] == 4 for c in gptq_tune.candidates(16, 128, True, 4096)
                   + gptq_tune.candidates(128, 128, True, 4096) if c["kernel"] == "mmat")
    qw, qz, s, gi = make_weights(g, 4, 128, k, n, True, False)
    wp = gptq_configs.interleave_for(128, k, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    for m, split in ((40, 2), (64, 2), (20, 1)):
        cfg = next(c for c in gptq_tune._wide_cols(32 if m <= 32 else 64, (1, 2)) if c["SPLIT_K"] == split)
        x = torch.randn(m, k, generator=g).half().to(DEV)
        want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True)
        assert_close(gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 128, wp, config=cfg), want, torch.float16, g,
                     f"M={m} {cfg}")

def test_sync_mma_tiles_are_candidates_and_compute_right(gemm, gen, monkeypatch):
    """The transposed field tiles whose field dots are batched over one slice of weight columns per warp, so that
    Triton lowers them to mma.sync instead of wgmma (`gptq_tune._sync`, SYNC_MMA): candidates at 2-64 rows in the
    quick set, at 2-256 rows in the full set; against the reference with masked rows and columns, the
    group scale folded into the weights and applied to the sum, with and without split-K, 4 and 8 warps."""
    from infer.kernels import gptq_tune
    g = gen
    for m, quick, want in ((1, True, set()), (16, True, {(16, 128, 4)}), (16, False, {(16, 128, 4)}),
                           (32, True, {(32, 128, 4), (32, 256, 8)}),
                           (64, True, {(64, 128, 4), (64, 256, 8)}), (128, True, set()),
                           (128, False, {(128, 128, 8)})):
        sync = [c for c in gptq_tune.candidates(m, 128, quick, 4096) if c.get("SYNC_MMA")]
        assert {(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]) for c in sync} == want, (m, quick, sync)
        assert all(c["kernel"] == "mmat" and c["FIELD"] and not c.get("PAIRS") for c in sync)
    k, n = 256, 200
    qw, qz, s, gi = make_weights(g, 4, 128, k, n, True, False)
    wp = gptq_configs.interleave_for(128, k, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    for m, bm, bn, w, split, scale_w in ((40, 64, 128, 4, 2, True), (20, 32, 256, 8, 1, True),
                                          (64, 64, 128, 4, 1, False), (9, 16, 128, 4, 2, True)):
        cfg = dict(gptq_tune._field("mmat", bm, bn, w, split, 3, scale_w), SYNC_MMA=True)
        x = torch.randn(m, k, generator=g).half().to(DEV)
        want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True)
        y = gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 128, wp, config=cfg)
        assert_close(y, want, torch.float16, g, f"M={m} {cfg}")
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(kw)
    monkeypatch.setattr(gemm, "mma_kernel", Recorder())
    sync = dict(gptq_tune._field("mmat", 32, 128, 4, 1), SYNC_MMA=True)
    for cfg in (sync, dict(sync, num_warps=8), dict(sync, BLOCK_N=32), dict(sync, kernel="mma"), dict(sync, PAIRS=True),
                dict(sync, BYTE_DOTS=True), dict(sync, SYNC_MMA=False)):  # only where one slice per warp holds 16+
        gemm.gptq_matmul(torch.randn(5, 256, generator=g).half().to(DEV), qw.to(DEV), qz.to(DEV), s.to(DEV),
                         gi.to(DEV), 4, True, 128, config=cfg)
    assert [c["SYNC"] for c in calls] == [4, 8, 0, 0, 0, 0, 0]


def test_heuristic_regimes():
    from infer.kernels import gptq_configs as gc
    one = gc.heuristic(1, 4096, 4096, sms=132)
    assert one["kernel"] == "gemv" and one["SPLIT_K"] > 1
    assert gc.heuristic(16, 4096, 4096, sms=132)["kernel"] == "mma"
    assert gc.heuristic(64, 11008, 4096, sms=132)["BLOCK_M"] == 64
    assert gc.heuristic(2048, 4096, 4096, sms=132)["kernel"] == "dequant"
    assert [gc.bucket(m) for m in (1, 2, 3, 16, 17, 5000)] == [1, 2, 4, 16, 32, 4096]
    assert gc.block_k_limit(32, 4096, 8) == 32 and gc.block_k_limit(-1, 64, 8) == 128
    assert gc.block_k_limit(None, 64, 8) == 0 and gc.block_k_limit(24, 96, 8) == 0  # g_idx read row by row
    mid = gc.heuristic(128, 12288, 4096, sms=132)
    assert mid["kernel"] == "mma" and mid["FIELD"] and mid["SCALE_W"] and mid["BLOCK_M"] == 128
    # interleaved blocks of one K step, only where K holds whole blocks and groups allow a K step
    assert gc.interleave_for(128, 4096, 8) == 16 and gc.interleave_for(32, 4096, 8) == 4
    assert gc.interleave_for(128, 4096, 4) == 32 and gc.interleave_for(-1, 192, 8) == 1
    assert gc.interleave_for(None, 4096, 8) == 1 and gc.interleave_for(24, 96, 8) == 1


@pytest.mark.parametrize("quick", [False, True])
def test_tuning_candidates_launch_and_compute_right(gemm, gen, quick):
    """Every configuration the tuner may pick, for every M bucket, is a valid launch on an interleaved layer: run
    here on one small layer (BLOCK sizes are the real ones; all quick ones on a GPU, else a random sample)."""
    from infer.kernels import gptq_configs as gc, gptq_tune
    g = gen
    k, n = 256, 40
    qw, qz, s, gi = make_weights(g, 4, 128, k, n, False, False)
    wp = gc.interleave_for(128, k, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    for m in gptq_tune.BUCKETS[:9]:
        cands = gptq_tune.candidates(m, gc.block_k_limit(128, k, 8), quick, k)
        assert cands and all(c["kernel"] in ("gemv", "mma", "mmat", "dequant") for c in cands)
        x = torch.randn(m, k, generator=g).half().to(DEV)
        want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True)
        sample = len(cands) if CUDA and quick else (8 if CUDA else 2)  # the full space is large: a random sample
        for cfg in [cands[i] for i in torch.randperm(len(cands), generator=g)[:sample].tolist()]:
            assert_close(gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 128, wp, config=cfg), want, torch.float16, g,
                         f"M={m} {cfg}")


def test_tuned_table_round_trip(tmp_path, monkeypatch):
    """A tuned config is saved to the cache, wins over the shipped table, and is found by the next process."""
    from infer.kernels import gptq_configs as gc
    monkeypatch.setenv("INFER_CACHE", str(tmp_path))
    monkeypatch.setattr(gc, "SHIPPED", tmp_path / "shipped")
    (tmp_path / "shipped").mkdir()
    shipped = {"48,64": {"16": DECODE, "1": GEMV}}
    (tmp_path / "shipped" / "GPU_X.json").write_text(__import__("json").dumps(shipped))
    gc.load.cache_clear()
    assert gc.load("GPU_X")[(k := "48,64")][16] == DECODE
    gc.save("GPU_X", {k: {16: PREFILL}})
    assert gc.load("GPU_X")[k][16] == PREFILL and gc.load("GPU_X")[k][1] == GEMV
    gc.load.cache_clear()
    assert gc.load("GPU_X")[k][16] == PREFILL and gc.cache_file("GPU_X").parent == tmp_path / "kernels"
    assert gc.load("GPU_X")[k][1] == GEMV  # the shipped buckets the cache does not hold stay
    gc.save("GPU_X", {"96,128": {2: ROWS}})  # another model's shape, tuned by a later engine start
    gc.load.cache_clear()
    assert gc.load("GPU_X")[k][16] == PREFILL and gc.load("GPU_X")["96,128"][2] == ROWS  # both kept
    gc.load.cache_clear()


def test_chunked_dequant_with_a_chunk_width_that_splits_a_word(gemm, gen):
    """CHUNK_N is rounded to whole words of zeros (a hand-written or older cache may hold any width): asymmetric
    4-bit weights, whose zeros differ per column, give the reference's y."""
    qw, qz, s, gi = make_weights(gen, 4, 32, 64, 96, False, False)
    x = torch.randn(5, 64, generator=gen).to(DEV)
    y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, config={"kernel": "dequant", "CHUNK_N": 44})
    assert_close(y, ref.gptq_matmul(x, qw, qz, s, gi, 4, True), torch.float32, gen)


def test_split_k_counters_grow_with_the_tiles(gemm):
    """The per-tile arrival counters are one buffer per device, grown when a launch has more tiles than it holds
    (a smaller one would let two tiles share a counter, or write past it)."""
    dev = torch.device(DEV)
    small = gemm._locks(dev, 4)
    assert small.numel() >= 4 and int(small.count_nonzero()) == 0
    big = gemm._locks(dev, small.numel() + 1000)
    assert big.numel() >= small.numel() + 1000 and int(big.count_nonzero()) == 0
    assert gemm._locks(dev, 4) is big
    # the smaller buffer stays allocated: a CUDA graph recorded before the growth still counts in it
    assert any(t is small for t in gemm._RETIRED_LOCKS[(dev, "gemm")])


def test_reserved_dequant_scratch_keeps_its_address(gemm, gen):
    """kernels.gptq_dequant.reserve_scratch sizes the scratch once (the engine does it before recording graphs):
    a layer within the reservation dequantizes into the same buffer, so a recorded address stays valid."""
    from infer.kernels import gptq_dequant
    dev = torch.device(DEV)
    gptq_dequant.release_scratch(dev)
    gptq_dequant.reserve_scratch(dev, torch.float32, 64 * 96)
    buf = gptq_dequant._SCRATCH[(dev, torch.float32)]
    qw, qz, s, gi = make_weights(gen, 4, 32, 64, 96, True, False)
    w = gptq_dequant.dequantize_into_scratch(qw, qz, s, gi, 4, True, torch.float32)
    assert w.data_ptr() == buf.data_ptr() and gptq_dequant._SCRATCH[(dev, torch.float32)] is buf
    x = torch.randn(3, 64, generator=gen).to(DEV)
    assert_close(x @ w, ref.gptq_matmul(x, qw, qz, s, gi, 4, True), torch.float32, gen)
    gptq_dequant.reserve_scratch(dev, torch.float32, 10)  # a smaller reservation changes nothing
    assert gptq_dequant._SCRATCH[(dev, torch.float32)] is buf
    gptq_dequant.release_scratch(dev)


def test_rejects_a_wrong_input_width(gemm):
    qw, qz, s, gi = make_weights(torch.Generator().manual_seed(0), 4, 32, 64, 16, True, False)
    with pytest.raises(ValueError, match="64"):
        gemm.gptq_matmul(torch.zeros(2, 65, device=DEV), qw, qz, s, gi, 4)


def test_dispatch_uses_the_reference_on_cpu(gen):
    qw, qz, s, gi = make_weights(gen, 8, 32, 64, 16, True, False)
    x = torch.randn(3, 64, generator=gen).to(DEV)
    y = kernels.gptq_matmul(x, qw, qz, s, gi, 8, True, 32)
    assert_close(y, ref.gptq_matmul(x, qw, qz, s, gi, 8), torch.float32, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 32, 64, 300])
@pytest.mark.parametrize("k, half", [(4096, 11008), (5120, 13696)])
def test_gated_real_sizes_on_gpu(gemm, gen, m, k, half):
    """A 7B's and a 14B's gate|up with silu_and_mul in the epilogue (the tuned or heuristic tile, split-K as it
    picks, the engine's interleaved rows): the same as the plain matmul followed by silu_and_mul."""
    from infer.kernels import fused
    qw, qz, s, gi = make_weights(gen, 4, 128, k, 2 * half, True, False)
    wp = gptq_configs.interleave_for(128, k, 8)
    qw = packing.interleave_rows(qw, 4, wp)
    for dtype in (torch.float16, torch.bfloat16):
        # x of a norm's scale over unit-variance weights: gate and up of a few units, as in a model. Unscaled, they are
        # about sqrt(K) = 64-72 apiece and their product overflows float16 in the reference as in the kernel (an H200
        # run of 2026-11-27 saw infinities at M = 64 and 300 on the 14B's sizes, seeds differing from run to run)
        x = (torch.randn(m, k, generator=gen) * k ** -0.5 * 4).to(dtype).to(DEV)
        plain = fused.silu_and_mul(gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 128, wp))
        assert torch.isfinite(plain).all()
        y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 128, wp, gated=True)
        assert y.shape == (m, half)
        assert_close(y, plain, dtype, gen, f"gated M={m} {k}x{2 * half} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16, 32, 64])
@pytest.mark.parametrize("k, n", [(4096, 4096), (4096, 12288), (11008, 4096)])
def test_loads_ahead_real_sizes_on_gpu(gemm, gen, monkeypatch, m, k, n):
    """A 7B's o, qkv and down at the engine's row counts (the tuned kernel: at one row the gemv for o, tensor-core
    tiles otherwise; the engine's interleaved rows): a K step's loads issued during the step before (the default)
    give the same outputs bit for bit as issued in their step, and the reference's."""
    qw, qz, s, gi = make_weights(gen, 4, 128, k, n, False, False)
    wp = gptq_configs.interleave_for(128, k, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    x = torch.randn(m, k, generator=gen).half().to(DEV)
    got = {}
    for mode in ("ahead", "late"):
        monkeypatch.setattr(gemm, "int4_loads", mode)
        got[mode] = gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 128, wp)
    assert torch.equal(got["ahead"], got["late"]), (m, k, n)
    assert_close(got["ahead"], ref.gptq_matmul(x, qw, qz, s, gi, 4), torch.float16, gen, f"M={m} {k}x{n}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16, 64, 300, 2048])
@pytest.mark.parametrize("k, n, group, desc_act", [(4096, 4096, 128, False), (4096, 11008, 128, True),
                                                    (5120, 13696, 32, False), (13696, 5120, -1, False)])
def test_real_sizes_on_gpu(gemm, gen, m, k, n, group, desc_act):
    qw, qz, s, gi = make_weights(gen, 4, group, k, n, True, desc_act)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
        y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, None if desc_act else group)
        assert_close(y, ref.gptq_matmul(x, qw, qz, s, gi, 4), dtype, gen, f"M={m} {k}x{n} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(GEMV, BLOCK_N=128, BLOCK_K=128, SPLIT_K=16),
                                 dict(DECODE, BLOCK_N=64, BLOCK_K=128, SPLIT_K=8),
                                 dict(MMAT, BLOCK_N=128, BLOCK_K=128, SPLIT_K=8),
                                 dict(FIELDS, BLOCK_N=128, SPLIT_K=8), dict(GEMV_FIELDS, BLOCK_N=64, SPLIT_K=8),
                                 dict(GEMV_INPLACE, BLOCK_N=128, SPLIT_K=8), dict(PAIRS, BLOCK_N=128, SPLIT_K=8),
                                 dict(MMAT_FIELDS, BLOCK_M=64, BLOCK_N=128, SPLIT_K=2),
                                 dict(MMAT_SCALED, BLOCK_M=64, BLOCK_N=128, SPLIT_K=2, SYNC_MMA=True),
                                 dict(ROWS, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4),
                                 dict(PREFILL, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, GROUP_M=8)])
def test_split_k_counters_under_graph_replays(gemm, gen, cfg):
    """Split-K's arrival counters are reset by the last program of each tile: many replays of a graph that runs
    the kernel on several layers give the reference's y every time (a race or a stale counter would not)."""
    m = (8 if "BLOCK_M" in cfg else 1) if cfg["kernel"] == "gemv" else 16
    layers = [make_weights(gen, 4, 128, 4096, 4096, bool(i % 2), False) for i in range(3)]
    x = torch.randn(m, 4096, generator=gen).half().to(DEV)
    want = [ref.gptq_matmul(x, *t, 4) for t in layers]
    outs = [None] * len(layers)
    graph = torch.cuda.CUDAGraph()
    gemm.gptq_matmul(x, *layers[0], 4, True, 128, config=cfg)  # compile outside the capture
    with torch.cuda.graph(graph):
        for i, t in enumerate(layers):
            outs[i] = gemm.gptq_matmul(x, *t, 4, True, 128, config=cfg)
    for _ in range(20):
        graph.replay()
        for got, w in zip(outs, want):
            assert_close(got, w, torch.float16, gen, str(cfg))


@pytest.mark.skipif(CUDA, reason="checks the message shown without a GPU")
def test_benchmark_refuses_to_run_without_a_gpu(tmp_path, capsys):
    from infer.bench import kernels as bench
    assert bench.main(["--out", str(tmp_path / "k.csv")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "k.csv").exists()


def test_benchmark_times_the_other_unpacking_of_the_same_tile(gemm, gen):
    """The kernel bench labels each config and times the same tile with PAIRS / INPLACE flipped; both compute y."""
    from infer.bench import kernels as bench
    assert bench.kernel_label(PAIRS_SCALED) == "mma fields pairs scale-w"
    assert bench.kernel_label(GEMV_INPLACE) == "gemv in place" and bench.toggled(ROWS) is None
    assert bench.kernel_label(CONFIGS["dequant_chunks"]) == "dequant 32-column blocks"
    assert bench.toggled({"kernel": "dequant"}) is None and bench.toggled(DECODE) is None
    assert bench.kernel_label(MMAT_PAIRS) == "mmat fields pairs" and bench.toggled(MMAT_FIELDS)["PAIRS"]
    assert bench.shifted(MMAT_SCALED) == dict(MMAT_SCALED, BYTES=False) and bench.shifted(FIELDS)["BYTES"] is False
    assert bench.shifted(PAIRS) is None and bench.shifted(GEMV_INPLACE) is None and bench.shifted(SHIFTS) is None
    assert bench.joined(MMAT_SCALED) == MMAT_JOINED and bench.joined(FIELDS) is None
    assert bench.joined(dict(MMAT_SCALED, num_warps=8)) is None and bench.joined(MMAT_JOINED) is None
    assert bench.joined(MMAT_SHIFTS_SCALED) is None
    wide = dict(MMAT_SCALED, BLOCK_N=128)  # mma.sync on 4 warps: 32 columns each
    assert bench.synced(wide) == dict(wide, SYNC_MMA=True)
    assert bench.synced(dict(wide, SYNC_MMA=True)) == dict(wide, SYNC_MMA=False)
    assert bench.synced(MMAT_SCALED) is None and bench.synced(dict(wide, num_warps=16)) is None  # < 16 columns a warp
    assert bench.synced(dict(wide, PAIRS=True)) is None and bench.synced(dict(wide, BYTE_DOTS=True)) is None
    assert bench.synced(FIELDS) is None and bench.synced(dict(wide, FIELD=False)) is None
    qw, qz, s, gi = make_weights(gen, 4, 128, 256, 40, False, False)
    for cfg, m in ((FIELDS, 3), (PAIRS, 3), (MMAT_PAIRS, 2), (GEMV_INPLACE, 1), (GEMV, 1)):
        other = bench.toggled(cfg)
        assert bool(other.get("PAIRS", False) or other.get("INPLACE", False)) != bool(cfg.get("PAIRS") or
                                                                                      cfg.get("INPLACE"))
        x = torch.randn(m, 256, generator=gen).half().to(DEV)
        want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True)
        assert_close(gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 128, config=other), want, torch.float16, gen,
                     str(other))


def test_benchmark_tunes_what_the_gpus_table_lacks_first(monkeypatch):
    """On a GPU whose table (shipped, or the cache's) lacks a shape's M bucket, the kernel bench tunes it with the
    quick candidate set and saves it as an engine's first start there would, instead of timing the heuristic's
    guess (an H200, 2026-11-27, had no table: the bench would have timed configs no engine runs)."""
    from infer.bench import kernels as bench
    from infer.kernels import gptq_configs, gptq_tune
    qkv, o = "12288,4096", "4096,4096"
    have = {qkv: {1: {"kernel": "gemv"}, 16: {"kernel": "mma"}, 64: {"kernel": "mmat"}}, o: {16: {"kernel": "mma"}}}
    monkeypatch.setattr(gptq_configs, "table", lambda device: have)
    monkeypatch.setattr(gptq_configs, "gpu_name", lambda device: "Some_GPU")
    calls, saved, said = [], [], []

    def fake_tune(n, k, buckets, device=None, log=None, quick=False):
        calls.append((n, k, list(buckets), quick))
        return {b: ({"kernel": "mma", "tuned_for": b}, 1.0) for b in buckets}
    monkeypatch.setattr(gptq_tune, "tune_shape", fake_tune)
    monkeypatch.setattr(gptq_configs, "save", lambda name, found: saved.append((name, found)))
    todo = bench.untuned(["7B"], [1, 3, 16, 64], "dev")
    assert todo == {(4096, 4096): [1, 4, 64], (22016, 4096): [1, 4, 16, 64], (4096, 11008): [1, 4, 16, 64],
                    (12288, 4096): [4]}, todo
    found = bench.tune_missing(["7B"], [1, 3, 16, 64], "dev", log=said.append)
    assert sorted(calls) == sorted((n, k, b, True) for (n, k), b in todo.items())
    assert saved == [("Some_GPU", found)] and found[o] == {b: {"kernel": "mma", "tuned_for": b} for b in (1, 4, 64)}
    assert "Some_GPU" in said[0] and "12 (shape, M bucket)" in said[0], said
    for shape, by_m in found.items():  # what the real save does to the table in memory
        have.setdefault(shape, {}).update(by_m)
    calls.clear(), saved.clear()
    assert bench.tune_missing(["7B"], [1, 3, 16, 64], "dev") == {} and calls == [] and saved == []


def test_benchmark_tensors_are_valid_gptq():
    from infer.bench import kernels as bench
    qw, qz, s, gi = bench.random_gptq(256, 64, 4, 128, "cpu")
    assert (qw.shape, qz.shape, s.shape, gi.shape) == ((32, 64), (2, 8), (2, 64), (256,))
    assert torch.isfinite(ref.gptq_matmul(torch.randn(2, 256), qw, qz, s, gi, 4)).all()


@pytest.mark.skipif(CUDA, reason="a GPU runs the bench for real (scripts/gpu-check kernels)")
def test_benchmark_rows_on_cpu_interpreted(gemm, monkeypatch, capsys):
    """`infer.bench.kernels`' measuring code on CPU (interpreted kernels, a wall-clock stand-in for the CUDA-graph
    timer, a tiny layer): one row per M with the chosen kernel's error, the flipped option, and from 32 rows the
    whole and chunked dequantize; the table prints."""
    import time

    from infer.bench import kernels as bench
    from infer.kernels import gptq_tune

    def wall_clock(fns, reps=3):
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    monkeypatch.setattr(gptq_tune, "time_graph", wall_clock)
    monkeypatch.setattr(gptq_tune, "L2_BUST_BYTES", 1)
    rows = bench.measure_shape("7B", "tiny", 256, 128, [1, 3, 32], 1e12, device="cpu")
    assert [r["M"] for r in rows] == [1, 3, 32]
    assert all(r["max_rel_err"] < 2e-3 and r["infer_us"] > 0 and r["cublas_fp16_us"] > 0 for r in rows), rows
    assert "other_us" in rows[0] and "dequant_us" not in rows[1] and rows[2]["dequant_us"] > 0
    assert rows[2]["chunks_us"] > 0 and rows[2]["chunks"] >= 128
    # the field tiles (the heuristic's choice from 2 rows) also timed with their fields shifted out one at a time
    assert all(("shift_us" in r) == (bench.shifted(json.loads(r["config"])) is not None) for r in rows), rows
    assert rows[1]["shift_us"] > 0 and rows[1]["byte_gain"] == rows[1]["shift_us"] / rows[1]["infer_us"]
    assert all(("joined_us" in r) == (bench.joined(json.loads(r["config"])) is not None) for r in rows), rows
    assert all(("sync_us" in r) == (bench.synced(json.loads(r["config"])) is not None) for r in rows), rows
    # the tensor-core tiles and the one-row gemv also timed with each K step's loads issued in that step
    assert [("late_us" in r) for r in rows] == [bench.late_loads(json.loads(r["config"])) is not None for r in rows]
    assert "late_us" in rows[1], rows  # the field tile of 3 rows
    assert all(r["late_us"] > 0 and r["ahead_gain"] == r["late_us"] / r["infer_us"] for r in rows if "late_us" in r)
    gemv = dict(kernel="gemv", BLOCK_N=64, BLOCK_K=128, num_warps=4)
    assert bench.late_loads(dict(gemv, BLOCK_M=4)) is None and bench.late_loads(
        {"kernel": "mmat", "AHEAD": False}) is None and bench.late_loads({"kernel": "dequant"}) is None
    assert bench.late_loads(dict(gemv, BLOCK_N=128)) is None  # 16 words a thread: not ahead by default
    assert bench.late_loads({"kernel": "mma"}) == {"kernel": "mma", "AHEAD": False}
    assert bench.late_loads(gemv) == dict(gemv, AHEAD=False)
    # a transposed field tile (as a GPU's table may choose at 32 rows) is also timed with its dots as mma.sync
    tile = dict(MMAT_SCALED, BLOCK_M=32, BLOCK_N=128, SPLIT_K=1)
    monkeypatch.setattr(gptq_configs, "choose", lambda m, n, k, device: tile)
    rows += bench.measure_shape("7B", "tiny", 256, 128, [32], 1e12, device="cpu")
    assert json.loads(rows[-1]["config"]) == tile and rows[-1]["max_rel_err"] < 2e-3, rows[-1]
    assert rows[-1]["sync_us"] > 0 and rows[-1]["sync_gain"] == rows[-1]["infer_us"] / rows[-1]["sync_us"]
    bench.print_table(rows, "cpu")
    assert "tiny" in capsys.readouterr().out
