"""The Triton multi-LoRA kernels (kernels.lora_ops: one shrink and one expand launch per layer) against the torch
reference: under TRITON_INTERPRET=1 on CPU at tiny shapes, at real shapes on a GPU (-m gpu)."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import lora_reference as ref
from infer.lora.batch import LoRAGroups, lora_groups

from helpers import check_env_choice, interpreted_module


@pytest.fixture(scope="module")
def ops():
    """infer.kernels.lora_ops, interpreted on CPU when there is no GPU."""
    yield from interpreted_module("infer.kernels.lora_ops")


@pytest.fixture
def poisoned(ops, monkeypatch):
    """The shrink's partial-sum buffer filled with NaN: the expand must read only what the shrink wrote."""
    def nan_partials(split, t, nr, device):
        return torch.full((split, t, nr), float("nan"), dtype=torch.float32, device=device)
    monkeypatch.setattr(ops, "partials", nan_partials)
    return ops


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def layer(outs, num_slots, max_rank, k, seed, dtype=torch.float32, ranks=None):
    """Random stacked weights of a merged layer, zero past every (shard, slot)'s rank, as LoRALayer keeps them:
    (lora_a [S, n*R, K], lora_b flat (every shard's B^T [S, R, out_i], shard after shard), scalings [n, S],
    ranks [n, S] int32, column bounds)."""
    g = torch.Generator().manual_seed(seed)
    n, bounds = len(outs), [0]
    for o in outs:
        bounds.append(bounds[-1] + o)
    a = torch.randn(num_slots, n * max_rank, k, generator=g) * 0.3
    bs = [torch.randn(num_slots, max_rank, o, generator=g) for o in outs]
    if ranks is None:
        ranks = torch.randint(4, max_rank + 1, (n, num_slots), generator=g)
    for i in range(n):
        for s in range(num_slots):
            r = int(ranks[i, s])
            a[s, i * max_rank + r:(i + 1) * max_rank] = 0
            bs[i][s, r:] = 0
    scal = torch.rand(n, num_slots, generator=g) + 0.5
    b = torch.cat([t.flatten() for t in bs])
    return a.to(dtype), b.to(dtype), scal, ranks.to(torch.int32), bounds


def check(ops, host_slots, outs=(24, 16, 8), num_slots=5, max_rank=16, k=48, dtype=torch.float32, seed=0,
          ranks=None, groups=None):
    """Run lora_apply on a y of known base values; rows without adapter must keep them bit for bit."""
    dev, t = _dev(), len(host_slots)
    slots = torch.tensor(host_slots, dtype=torch.long)
    a, b, scal, rk, bounds = layer(list(outs), num_slots, max_rank, k, seed, dtype, ranks)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, k, generator=g).to(dtype)
    y = (torch.randn(t, bounds[-1], generator=g) * 10).to(dtype)
    want = y.float().clone()
    ref.lora_apply(x.float(), want, a.float(), b.float(), scal, bounds, lora_groups(slots, num_slots))
    got = y.clone().to(dev)
    if groups is None:
        groups = lora_groups(slots.to(dev), num_slots)
    ops.lora_apply(x.to(dev), got, a.to(dev), b.to(dev), scal.to(dev), bounds, groups, rk.to(dev))
    got = got.cpu()
    base = slots < 0
    assert torch.equal(got[base], y[base]), "rows without adapter changed"
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=1e-2)
    assert torch.allclose(got.float(), want, **tol), (got.float() - want).abs().max()
    assert (got[~base].float() - y[~base].float()).abs().max() > 1.0  # the adapters did add something


CASES = {
    "every token its own adapter": [0, 1, 2, 3, 4],
    "uneven and empty segments, base rows": [3, -1, 0, 3, 3, -1, 0, 3, 3, 3, 1],
    "one adapter for all": [2] * 9,
    "no adapter but one row": [-1, -1, 4, -1],
    "segment longer than a tile": [1] * 19 + [3, -1, 1, 0],
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(poisoned, case):
    check(poisoned, CASES[case], seed=len(CASES[case]))


def test_no_adapter_at_all_leaves_y(poisoned):
    dev = _dev()
    a, b, scal, rk, bounds = layer([8, 8], 3, 16, 32, seed=1)
    y = torch.randn(6, 16).to(dev)
    want = y.clone()
    slots = torch.full((6,), -1, device=dev)
    poisoned.lora_apply(torch.randn(6, 32).to(dev), y, a.to(dev), b.to(dev), scal.to(dev), bounds,
                        lora_groups(slots, 3), rk.to(dev))
    assert torch.equal(y, want)


@pytest.mark.parametrize("split", [1, 2, 8, 16])
def test_shrink_split_given_by_the_caller(poisoned, monkeypatch, split):
    """The kernel bench's sweep: a shrink told its SPLIT_K (some splits empty past K at 16), the expand summing
    however many partials hp has; the same result as the reference, by token too."""
    dev = _dev()
    host = [3, -1, 0, 3, 1, 1, 4]
    a, b, scal, rk, bounds = layer([24, 8], 5, 16, 96, seed=3)
    x = torch.randn(len(host), 96, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor(host)
    want = torch.zeros(len(host), bounds[-1])
    ref.lora_apply(x, want, a, b, scal, bounds, lora_groups(slots, 5))
    for by_token in (False, True):
        groups = lora_groups(slots.to(dev), 5)
        hp = poisoned.shrink(x.to(dev), a.to(dev), 2, groups, rk.to(dev), by_token=by_token, split=split)
        assert hp.shape[0] == split
        got = torch.zeros(len(host), bounds[-1], device=dev)
        poisoned.expand(hp, got, b.to(dev), scal.to(dev), bounds, groups, rk.to(dev), by_token=by_token)
        assert torch.allclose(got.cpu(), want, atol=1e-3, rtol=1e-4), (split, by_token)
    with pytest.raises(ValueError, match="power of two"):
        poisoned.plan(7, 5, 96, split=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_random_ranks_up_to_64_split_k(poisoned, monkeypatch, dtype):
    """Ranks 4-64 in one buffer padded to 64, shards of different widths, K split over 4 programs."""
    monkeypatch.setattr(poisoned, "K_PER_PROGRAM", 64)
    assert poisoned.plan(7, 6, 256)["split"] == 4
    check(poisoned, [5, -1, 2, 2, 0, 5, 3], outs=(40, 24, 16), num_slots=6, max_rank=64, k=256, dtype=dtype,
          seed=11)


def test_more_shards_than_one_expand_launch_covers(poisoned):
    """Five shards: the expand runs one launch per MAX_SHARDS shards, each from its own column and shard index."""
    assert poisoned.MAX_SHARDS < 5
    check(poisoned, [1, 0, -1, 2, 1, 1], outs=(8, 16, 8, 24, 16), num_slots=3, max_rank=8, k=32, seed=9)


def test_untargeted_shard_and_rank_zero_slot(poisoned):
    """A slot whose adapter skips a shard (rank 0 there: its rows are never read) and a slot with no adapter."""
    ranks = torch.tensor([[8, 0, 4], [0, 0, 16]])
    check(poisoned, [0, 1, 2, 1, 0, 2], outs=(16, 24), num_slots=3, ranks=ranks, seed=5)


def test_graph_style_static_groups(poisoned):
    """The adapter map of a CUDA graph replay (engine.cuda_graphs): padding rows first in the order, every
    segment start shifted by them, a larger batch than the real rows."""
    host = [2, 0, 2, -1, 1]
    real = lora_groups(torch.tensor(host), 4)
    pad = 3
    order = torch.cat([torch.arange(5, 5 + pad), real.order])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), real.starts[1:] + pad])
    slots = host + [-1] * pad
    dev = _dev()
    check(poisoned, slots, num_slots=4, seed=3, groups=LoRAGroups(order.to(dev), starts.to(dev)))


@pytest.mark.parametrize("by_token", [False, True])
def test_early_loads_give_the_late_ones_result(poisoned, monkeypatch, by_token):
    """The expand's two load orders (lora_ops.early_loads; INFER_LORA_EXPAND_LOADS) compute the same sums: the early
    one (every other test runs the default, late) matches the reference (rows without adapter kept, an untargeted
    shard, ranks below the padding) and equals the late one bit for bit, at sorted positions and by token (an int4
    layer's decode delta)."""
    monkeypatch.setattr(poisoned, "expand_loads", "early")
    ranks = torch.tensor([[8, 0, 4], [3, 16, 16]])
    check(poisoned, [0, 1, 2, -1, 0, 2, 2], outs=(16, 24), num_slots=3, ranks=ranks, seed=6)
    dev = _dev()
    a, b, scal, rk, bounds = layer([16, 24], 3, 16, 48, seed=7, ranks=ranks)
    slots = torch.tensor([2, -1, 0, 2, 1, 0], device=dev)
    groups = lora_groups(slots, 3)
    x = torch.randn(6, 48, generator=torch.Generator().manual_seed(8)).to(dev)
    hp = poisoned.shrink(x, a.to(dev), 2, groups, rk.to(dev), by_token=by_token)
    y0 = torch.randn(6, 40, generator=torch.Generator().manual_seed(9)).to(dev)
    got = {}
    for early in (True, False):
        got[early] = y0.clone()
        poisoned.expand(hp, got[early], b.to(dev), scal.to(dev), bounds, groups, rk.to(dev), by_token=by_token,
                        early=early)
    assert torch.equal(got[True], got[False]) and not torch.equal(got[True], y0)


def test_expand_load_order_from_the_environment(ops, monkeypatch):
    check_env_choice(monkeypatch, ops, "expand_loads", ops.early_loads, "INFER_LORA_EXPAND_LOADS",
                     ((None, False), ("early", True), (" late", False)), "first", ("late", "early"))


GATHER_CASES = {  # (token slots, shard widths, max rank, dtype)
    "every token its own adapter, base rows": ([3, 0, -1, 1, 4, 2, -1], (24, 16, 8), 16, torch.float32),
    "one token": ([2], (24, 16, 8), 16, torch.float32),
    "two token tiles, shared adapters": ([1, 0, 3] * 6 + [-1, 2], (16, 24), 16, torch.float16),
    "five shards (two launches), rank 64: 8-token tiles": ([0, 2, 1, -1, 2, 0, 1, 1, 0, 2, 2], (8, 16, 8, 24, 16), 64,
                                                            torch.float32),
}


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_gather_expand_matches_reference(poisoned, case):
    """The expand as a gather (`expand_gather`, INFER_LORA_EXPAND=gather: each program takes up to 16 tokens of any
    adapters) from partials by token: the reference's sums (lora_reference.add_delta), rows of slot -1 and shards of
    rank 0 kept bit for bit, nothing read past a rank (the partials there are NaN), and the same sums as the
    segments' expand by token up to its TF32-free rounding."""
    host, outs, max_rank, dtype = GATHER_CASES[case]
    dev, t, n = _dev(), len(host), len(outs)
    g = torch.Generator().manual_seed(t)
    ranks = torch.randint(1, max_rank + 1, (n, 5), generator=g)
    ranks[0, 1] = 0  # an adapter that does not target the first shard
    a, b, scal, rk, bounds = layer(list(outs), 5, max_rank, 48, seed=t, dtype=dtype, ranks=ranks)
    slots = torch.tensor(host, dtype=torch.long, device=dev)
    groups = lora_groups(slots, 5)
    x = torch.randn(t, 48, generator=g).to(dtype).to(dev)
    hp = poisoned.shrink(x, a.to(dev), n, groups, rk.to(dev), by_token=True)
    y0 = (torch.randn(t, bounds[-1], generator=g) * 10).to(dtype)
    want = y0.clone()
    ref.add_delta(ref.LoRADelta(torch.nan_to_num(hp.cpu()), b.float(), slots.cpu(), scal, rk, bounds, None), want)
    got = y0.clone().to(dev)
    poisoned.expand_gather(hp, got, b.to(dev), scal.to(dev), bounds, slots, rk.to(dev))
    got = got.cpu()
    base = slots.cpu() < 0
    assert torch.equal(got[base], y0[base]), "rows without adapter changed"
    untargeted = (slots.cpu() == 1)
    assert torch.equal(got[untargeted, :outs[0]], y0[untargeted, :outs[0]]), "a shard of rank 0 changed"
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=1e-2)
    assert torch.allclose(got.float(), want.float(), **tol), (got.float() - want.float()).abs().max()
    assert (got[~base].float() - y0[~base].float()).abs().max() > 1.0  # the adapters did add something
    seg = y0.clone().to(dev)
    poisoned.expand(hp, seg, b.to(dev), scal.to(dev), bounds, groups, rk.to(dev), by_token=True)
    assert torch.allclose(got.float(), seg.cpu().float(), **tol)


def test_add_delta_gathers_where_asked(poisoned, monkeypatch):
    """An int4 layer's expand launched on its own (`add_delta`) is the gather with INFER_LORA_EXPAND=gather up to
    GATHER_MAX_TOKENS tokens, the segments' expand above (and always by default), with the same sums either way."""
    calls = []
    real = {name: getattr(poisoned, name) for name in ("expand", "expand_gather")}
    for name in real:
        monkeypatch.setattr(poisoned, name, lambda *a, _n=name, **kw: (calls.append(_n), real[_n](*a, **kw)))
    monkeypatch.setattr(poisoned, "GATHER_MAX_TOKENS", 6)
    dev = _dev()
    a, b, scal, rk, bounds = layer([16, 8], 3, 8, 32, seed=11)
    out = {}
    for t in (6, 7):
        slots = torch.tensor([2, -1, 0, 1, 2, 0, 1][:t], device=dev)
        groups = lora_groups(slots, 3)
        x = torch.randn(t, 32, generator=torch.Generator().manual_seed(t)).to(dev)
        hp = poisoned.shrink(x, a.to(dev), 2, groups, rk.to(dev), by_token=True)
        delta = ref.LoRADelta(hp, b.to(dev), slots, scal.to(dev), rk.to(dev), bounds, groups, False)
        for mode in ("segments", "gather"):
            monkeypatch.setattr(poisoned, "expand_by", mode)
            out[t, mode] = torch.zeros(t, 24, device=dev)
            poisoned.add_delta(delta, out[t, mode])
        assert torch.allclose(out[t, "segments"], out[t, "gather"], atol=1e-4, rtol=1e-4)
    assert calls == ["expand", "expand_gather", "expand", "expand"], calls


def test_expand_way_from_the_environment(ops, monkeypatch):
    auto = ops.GATHER_AUTO_TOKENS
    for t, unset in ((auto, True), (auto + 1, False)):  # unset: "auto", gathers up to GATHER_AUTO_TOKENS tokens
        check_env_choice(monkeypatch, ops, "expand_by", lambda: ops.gathers(t), "INFER_LORA_EXPAND",
                         ((None, unset), ("auto", unset), ("gather", True), (" segments", False)), "bgmv",
                         ("auto", "segments", "gather"))
    monkeypatch.setattr(ops, "expand_by", "gather")
    assert ops.gathers(ops.GATHER_MAX_TOKENS) and not ops.gathers(ops.GATHER_MAX_TOKENS + 1)
    assert ops.gather_limit() == ops.GATHER_MAX_TOKENS > auto > 1
    monkeypatch.setattr(ops, "expand_by", "segments")
    assert not ops.gathers(1) and ops.gather_limit() == 0
    assert ops.gather_tiles(16, 16) == (16, 32, 16) and ops.gather_tiles(1, 16) == (1, 128, 16)
    assert ops.gather_tiles(64, 64) == (8, 16, 64) and ops.gather_tiles(3, 128) == (4, 16, 128)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the bench for real (scripts/gpu-check lora-kernels)")
def test_lora_bench_rows_on_cpu_interpreted(ops, monkeypatch):
    """`infer.bench.kernels --lora`'s measuring code on CPU (interpreted kernels, one call of each timed function
    standing in for the CUDA-graph timer, a tiny layer): the row has every timing, the by-token expand in both load
    orders, and the floor; every kernel but the L2-hot expand is timed over distinct copies of the adapters'
    weights, enough of them to hold the bytes asked for (the L2 cache), as the int4 matmuls are timed."""
    import sys
    import time

    from infer.bench import lora_kernels
    mod = sys.modules["infer.kernels.lora_ops"]
    seen: list[int] = []
    shrink, expand, gather = mod.shrink, mod.expand, mod.expand_gather

    def rec_shrink(x, lora_a, *a, **kw):
        seen.append(lora_a.data_ptr())
        return shrink(x, lora_a, *a, **kw)

    def rec_expand(hp, y, lora_b, *a, **kw):
        seen.append(lora_b.data_ptr())
        return expand(hp, y, lora_b, *a, **kw)

    def rec_gather(hp, y, lora_b, *a, **kw):
        seen.append(lora_b.data_ptr())
        return gather(hp, y, lora_b, *a, **kw)
    timed = []

    def once(fns):
        seen.clear()
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        timed.append((len(fns), len(set(seen))))
        return (time.perf_counter() - t0) * 1e6
    monkeypatch.setattr(mod, "shrink", rec_shrink)
    monkeypatch.setattr(mod, "expand", rec_expand)
    monkeypatch.setattr(mod, "expand_gather", rec_gather)
    monkeypatch.setattr(lora_kernels, "time_us", once)
    k, outs, one_set = 64, [32, 16], lora_kernels.SLOTS * lora_kernels.RANK * (2 * 64 + 48) * 2
    row = lora_kernels.measure(k, outs, 4, 2, 1e10, device="cpu", l2_bytes=2 * one_set + 1)
    assert row["weight_sets"] == 3
    assert all(row[key] > 0 for key in ("lora_us", "shrink_us", "expand_us", "expand_hot_us", "expand_by_token_us",
                                        "expand_late_us", "late_gain", "expand_gather_us", "gather_gain", "floor_us",
                                        "fp16_linear_us")), row
    assert row["adapter_MB"] == 2 * lora_kernels.RANK * (2 * 64 + 48) * 2 / 1e6
    # lora_apply (a shrink and an expand per set), shrink, expand, the hot expand, the two orders, the gather, the
    # sweep of the shrink's splits, each followed by the shrink + expand pair at that split, and of the expand's
    # columns (a decode-sized row), the fp16 linear
    splits = [(3, 3), (3, 6)] * len(lora_kernels.SWEEP_SPLITS)
    assert timed == [(3, 6), (3, 3), (3, 3), (1, 1), (3, 3), (3, 3), (3, 3), *splits,
                     *[(3, 3)] * len(lora_kernels.SWEEP_BLOCK_N), *[(3, 3)] * len(lora_kernels.SWEEP_GATHER_WARPS),
                     (1, 0)], timed
    assert {f"shrink_split{s}_us" for s in lora_kernels.SWEEP_SPLITS} <= set(row), row
    assert {f"pair_split{s}_us" for s in lora_kernels.SWEEP_SPLITS} <= set(row), row
    assert {f"expand_n{n}_us" for n in lora_kernels.SWEEP_BLOCK_N} <= set(row), row
    assert {f"gather_w{w}_us" for w in lora_kernels.SWEEP_GATHER_WARPS} <= set(row), row


def test_many_tokens_big_tiles(poisoned):
    """A prefill-sized batch (tiles of 64 rows), slots in random order."""
    g = torch.Generator().manual_seed(0)
    host = torch.randint(-1, 3, (300,), generator=g).tolist()
    assert poisoned.plan(300, 3, 48)["block_m"] == 64
    check(poisoned, host, outs=(16, 8), num_slots=3, max_rank=8, seed=2)


def test_plan_depends_on_shapes_only(ops):
    """The launch grid of a CUDA graph: enough shrink programs at decode sizes, never more tiles than a worst
    case mix needs (T // BLOCK_M full tiles plus one partial tile per slot)."""
    p = ops.plan(16, 16, 4096)
    assert p["tiles"] == 17 and p["split"] == 4 and p["k_per_split"] == 1024
    p = ops.plan(16, 16, 11008)
    assert p["tiles"] == 17 and p["split"] == 16 and p["k_per_split"] * p["split"] >= 11008
    p = ops.plan(64, 16, 11008)
    assert p["tiles"] == 20 and p["split"] == 8 and p["k_per_split"] * p["split"] >= 11008


@pytest.fixture(scope="module")
def fused_ops():
    """infer.kernels.fused (silu_and_mul), interpreted on CPU when there is no GPU."""
    yield from interpreted_module("infer.kernels.fused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("host_slots", [[0, 1, 2, 3, 4], [3, -1, 0, 3, -1, 1, 1]])
def test_silu_and_mul_adds_the_gate_up_delta(poisoned, fused_ops, monkeypatch, dtype, host_slots):
    """The gate_up layer's expand folded into silu_and_mul (LoRALayer.deferred): the Triton shrink's partials by
    token, K split over programs (NaN wherever the shrink wrote nothing), then silu_and_mul(gate_up, lora) against
    the reference's add_delta then silu_and_mul; rows without adapter are exactly the plain silu_and_mul."""
    monkeypatch.setattr(poisoned, "K_PER_PROGRAM", 32)
    check_silu_delta(poisoned, fused_ops, dtype, host_slots, n=300, k=128, num_slots=5)


@pytest.mark.gpu
def test_silu_and_mul_adds_the_gate_up_delta_real_shapes_gpu(poisoned, fused_ops):
    """The same at Llama-2-7B's gate_up (11008 | 11008 columns, K = 4096), 16 tokens of 16 adapters and 64 tokens."""
    g = torch.Generator().manual_seed(0)
    check_silu_delta(poisoned, fused_ops, torch.float16, list(range(16)), n=11008, k=4096, num_slots=16)
    check_silu_delta(poisoned, fused_ops, torch.float16, torch.randint(-1, 16, (64,), generator=g).tolist(),
                     n=11008, k=4096, num_slots=16)


def check_silu_delta(ops, fused_ops, dtype, host_slots, n, k, num_slots, max_rank=16):
    from infer.kernels import reference as kref
    poisoned = ops
    dev, t = _dev(), len(host_slots)
    a, b, scal, rk, bounds = layer([n, n], num_slots, max_rank, k, seed=t, dtype=dtype)
    g = torch.Generator().manual_seed(t + 1)
    x = (torch.randn(t, k, generator=g) * (8 / k) ** 0.5).to(dtype)  # deltas of a few units at any K
    gate_up = torch.randn(t, 2 * n, generator=g).to(dtype)
    slots = torch.tensor(host_slots)
    d = poisoned.delta(x.to(dev), a.to(dev), b.to(dev), scal.to(dev), bounds, lora_groups(slots.to(dev), num_slots),
                       rk.to(dev), slots.to(dev))
    assert d.hp.shape[0] > 1  # the shrink's partial sums over slices of K
    got = fused_ops.silu_and_mul(gate_up.to(dev), lora=d).cpu()
    want = kref.silu_and_mul(gate_up, lora=ref.lora_delta(x.float(), a.float(), b.float(), scal, bounds,
                                                          lora_groups(slots, num_slots), rk, slots))
    plain = fused_ops.silu_and_mul(gate_up.to(dev)).cpu()
    base = slots < 0
    assert torch.equal(got[base], plain[base]), "rows without adapter changed"
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= (1e-5 if dtype == torch.float32 else 2e-3), err
    assert (got[~base].float() - plain[~base].float()).abs().max() > 0.5  # the adapters did add something


def _two_shard_delta():
    """A LoRADelta of two rows of a layer of two shards (4 | 12 columns), rank 4."""
    from infer.kernels.lora_reference import LoRADelta
    return LoRADelta(torch.zeros(1, 2, 8).to(_dev()), torch.zeros(64).to(_dev()), torch.zeros(2, dtype=torch.long),
                     torch.ones(2, 1), torch.ones(2, 1, dtype=torch.int32), [0, 4, 16], None)


def test_silu_and_mul_refuses_a_delta_of_other_shards(fused_ops):
    x, d = torch.randn(2, 16).to(_dev()), _two_shard_delta()
    with pytest.raises(ValueError, match=r"gate\|up layer of widths 8\|8"):
        fused_ops.silu_and_mul(x, lora=d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("host_slots,max_rank", [([0, 1, 2, 3, 4], 16), ([3, -1, 0, 3, -1, 1, 1], 8),
                                                 ([2, 0, -1, 1], 24)])
def test_rms_norm_adds_the_delta_of_the_layer_before(poisoned, fused_ops, monkeypatch, dtype, host_slots, max_rank):
    """The o/down layer's expand folded into the rms_norm after it (LoRALayer.deferred): the Triton shrink's
    partials by token (NaN wherever the shrink wrote nothing), then rms_norm(x, w, eps, residual, lora) against the
    reference's add_delta then rms_norm, both outputs (y and the next residual); B^T read in several chunks of rank
    rows (a small row tile) at rank 24; rows without adapter are exactly the plain rms_norm."""
    monkeypatch.setattr(poisoned, "K_PER_PROGRAM", 32)
    monkeypatch.setattr(fused_ops, "LORA_ROW_TILE", 8 * 512)
    check_norm_delta(poisoned, fused_ops, dtype, host_slots, n=300, k=128, num_slots=5, max_rank=max_rank)


@pytest.mark.gpu
def test_rms_norm_adds_the_delta_real_shapes_gpu(poisoned, fused_ops):
    """The same at Llama-2-7B's o and down (4096 columns, K = 4096 and 11008) and Qwen1.5-14B's down (5120 columns,
    K = 13696), 16 tokens of 16 adapters and 64 tokens."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((4096, 4096), (4096, 11008), (5120, 13696)):
        check_norm_delta(poisoned, fused_ops, torch.float16, list(range(16)), n=n, k=k, num_slots=16)
        check_norm_delta(poisoned, fused_ops, torch.float16, torch.randint(-1, 16, (64,), generator=g).tolist(),
                         n=n, k=k, num_slots=16, max_rank=64)


def check_norm_delta(ops, fused_ops, dtype, host_slots, n, k, num_slots, max_rank=16):
    from infer.kernels import reference as kref
    dev, t = _dev(), len(host_slots)
    a, b, scal, rk, bounds = layer([n], num_slots, max_rank, k, seed=t, dtype=dtype)
    g = torch.Generator().manual_seed(t + 2)
    x = (torch.randn(t, k, generator=g) * (8 / k) ** 0.5).to(dtype)  # deltas of a few units at any K
    y = torch.randn(t, n, generator=g).to(dtype)  # the layer's output without the adapters
    res = torch.randn(t, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    slots = torch.tensor(host_slots)
    d = ops.delta(x.to(dev), a.to(dev), b.to(dev), scal.to(dev), bounds, lora_groups(slots.to(dev), num_slots),
                  rk.to(dev), slots.to(dev))
    assert d.hp.shape[0] > 1  # the shrink's partial sums over slices of K
    got, got_h = (v.cpu() for v in fused_ops.rms_norm(y.to(dev), w.to(dev), 1e-5, res.to(dev), lora=d))
    want, want_h = kref.rms_norm(y, w, 1e-5, res, lora=ref.lora_delta(x.float(), a.float(), b.float(), scal, bounds,
                                                                      lora_groups(slots, num_slots), rk, slots))
    plain, plain_h = (v.cpu() for v in fused_ops.rms_norm(y.to(dev), w.to(dev), 1e-5, res.to(dev)))
    base = slots < 0
    assert torch.equal(got[base], plain[base]) and torch.equal(got_h[base], plain_h[base]), "rows without adapter"
    for g_, w_ in ((got, want), (got_h, want_h)):
        err = (g_.float() - w_.float()).abs().max() / w_.float().abs().max()
        assert err <= (1e-5 if dtype == torch.float32 else 4e-3), err
    assert (got_h[~base].float() - plain_h[~base].float()).abs().max() > 0.5  # the adapters did add something


def test_rms_norm_refuses_a_delta_of_other_shards(fused_ops):
    x, d = torch.randn(2, 16).to(_dev()), _two_shard_delta()
    with pytest.raises(ValueError, match=r"one-shard layer of width 16, not of bounds \[0, 4, 16\]"):
        fused_ops.rms_norm(x, torch.ones(16).to(_dev()), 1e-5, x, lora=d)
    d.bounds = [0, 16]
    with pytest.raises(ValueError, match="the LoRA delta has 2 rows, x has 3"):
        fused_ops.rms_norm(torch.randn(3, 16).to(_dev()), torch.ones(16).to(_dev()), 1e-5, lora=d)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [16, 64, 2048])
def test_real_shapes_gpu(t):
    from infer.kernels import lora_ops
    g = torch.Generator().manual_seed(t)
    slots = torch.randint(-1, 16, (t,), generator=g)
    a, b, scal, rk, bounds = layer([4096, 1024, 1024], 16, 16, 4096, seed=t, dtype=torch.float16)
    x = torch.randn(t, 4096, generator=g).half()
    y = torch.randn(t, bounds[-1], generator=g).half()
    want = y.float().clone()
    ref.lora_apply(x.float(), want, a.float(), b.float(), scal, bounds, lora_groups(slots, 16))
    got = y.cuda()
    lora_ops.lora_apply(x.cuda(), got, a.cuda(), b.cuda(), scal.cuda(), bounds, lora_groups(slots.cuda(), 16),
                        rk.cuda())
    assert torch.allclose(got.cpu().float(), want, rtol=2e-2, atol=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64])
def test_gather_expand_real_shapes_gpu(t):
    """The gather expand at a 7B qkv's sizes (rank 16 and 64, 1, 2 and 4 warps a program) on a GPU against the
    reference."""
    from infer.kernels import lora_ops
    for rank in (16, 64):
        g = torch.Generator().manual_seed(t + rank)
        slots = torch.randint(-1, 16, (t,), generator=g)
        a, b, scal, rk, bounds = layer([4096, 1024, 1024], 16, rank, 4096, seed=t, dtype=torch.float16)
        x = torch.randn(t, 4096, generator=g).half()
        y = torch.randn(t, bounds[-1], generator=g).half()
        want = y.float().clone()
        ref.lora_apply(x.float(), want, a.float(), b.float(), scal, bounds, lora_groups(slots, 16))
        groups = lora_groups(slots.cuda(), 16)
        hp = lora_ops.shrink(x.cuda(), a.cuda(), 3, groups, rk.cuda(), by_token=True)
        for warps in (1, 2, 4):  # (the kernel bench's sweep)
            got = y.cuda()
            lora_ops.expand_gather(hp, got, b.cuda(), scal.cuda(), bounds, slots.cuda(), rk.cuda(), num_warps=warps)
            assert torch.allclose(got.cpu().float(), want, rtol=2e-2, atol=0.5), (t, rank, warps)
