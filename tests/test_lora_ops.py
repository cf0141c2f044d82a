"""LoRA shrink/expand/apply: the torch reference (the CPU path and the oracle of the Triton kernels, whose tests are
in test_lora_kernel.py) against a per-token loop."""

from __future__ import annotations

import pytest
import torch

from infer import kernels
from infer.kernels import lora_reference as ref
from infer.lora.batch import lora_groups


def naive_shrink(x, a, slots, scale):
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] = scale * (x[t].double() @ a[s].double().t())
    return out


def naive_expand(h, b, slots, scalings, y, offset):
    y = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            y[t, offset:offset + b.shape[1]] += scalings[s].double() * (h[t].double() @ b[s].double().t())
    return y


def inputs(t, s, r, k, n, seed, slots=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = torch.randn(s, r, k, generator=g).to(dtype)
    b = torch.randn(s, n, r, generator=g).to(dtype)
    if slots is None:
        slots = torch.randint(-1, s, (t,), generator=g)
    scal = torch.rand(s, generator=g) + 0.5
    y = (torch.randn(t, 2 * n + 7, generator=g) * 100).to(dtype)  # poisoned: large values the op must keep
    return x, a, b, slots, scal, y


SLOTS = {"mixed": None, "one": lambda t: torch.full((t,), 2), "none": lambda t: torch.full((t,), -1),
         "one+base": lambda t: torch.tensor([1] * (t - 1) + [-1])}


@pytest.mark.parametrize("t", [1, 16, 300])
@pytest.mark.parametrize("case", list(SLOTS))
def test_reference_matches_per_token_loop(t, case):
    slots = None if SLOTS[case] is None else SLOTS[case](t)
    x, a, b, slots, scal, y = inputs(t, 5, 16, 48, 24, seed=t, slots=slots)
    h = ref.lora_shrink(x, a, lora_groups(slots, 5), 0.5)
    assert h.dtype == torch.float32 and h.shape == (t, 16)
    assert torch.allclose(h.double(), naive_shrink(x, a, slots, 0.5), atol=1e-4)
    wide = torch.cat([h, torch.randn(t, 16)], dim=1)  # expand reads a column slice, as merged layers do
    want = naive_expand(wide[:, :16], b, slots, scal, y, offset=7)
    ref.lora_expand(wide[:, :16], b, lora_groups(slots, 5), scal, y, offset=7)
    assert torch.allclose(y.double(), want, atol=1e-3)


@pytest.mark.parametrize("slots", [[4, 3, 2, 1, 0], [0, 1, 2, 3, 4, -1, 0, 2], [3, -1, 1, 3, -1, 4]])
def test_reference_decode_path_matches_per_token_loop(slots):
    """Many adapters with one or two tokens each (a decode step) take the padded-bmm path; every slot once in
    order needs no gather of the weights."""
    slots = torch.tensor(slots)
    x, a, b, slots, scal, y = inputs(len(slots), 5, 16, 48, 24, seed=len(slots), slots=slots)
    groups = lora_groups(slots, 5)
    assert ref.plan(groups)[0] == "padded"
    h = ref.lora_shrink(x, a, groups, 0.5)
    assert torch.allclose(h.double(), naive_shrink(x, a, slots, 0.5), atol=1e-4)
    want = naive_expand(h, b, slots, scal, y, offset=7)
    ref.lora_expand(h, b, groups, scal, y, offset=7)
    assert torch.allclose(y.double(), want, atol=1e-3)


def naive_apply(x, a, bs, scalings, slots, y, offsets):
    rank = a.shape[1] // len(bs)
    for i, (b, off) in enumerate(zip(bs, offsets)):
        h = naive_shrink(x, a[:, i * rank:(i + 1) * rank], slots, 1.0)
        y = naive_expand(h, b, slots, scalings[i], y, off)
    return y


def stacked(bs, first):
    """Per-shard B [S, out_i, R] as lora_apply takes them: one flat buffer of every shard's B^T [S, R, out_i], shard
    after shard, and the shards' column bounds."""
    bounds = [first]
    for b in bs:
        bounds.append(bounds[-1] + b.shape[1])
    return torch.cat([b.transpose(1, 2).flatten() for b in bs]), bounds


IN_ORDER = {  # token slots already sorted by slot, as the model runner lays out a batch
    "every slot once": [0, 1, 2, 3, 4],
    "base rows first": [-1, -1, 0, 1, 2, 3, 4],
    "middle slots": [-1, 1, 2, 3],
    "two tokens each": [0, 0, 1, 1, 2, 2, 3, 3, 4, 4],
    "uneven (padded)": [0, 1, 1, 2, 3, 4],
    "gap (padded)": [0, 1, 3, 4],
    "prefill (loop)": [-1] * 3 + [0] * 7 + [2] * 5 + [4] * 9,
}


@pytest.mark.parametrize("case", list(IN_ORDER))
def test_reference_in_order_decode_path(case):
    """Sorted tokens with the same count per consecutive slot run as bmm over views ("uniform"); the others
    fall back to the gathered path. Both agree with the per-token loop, for shrink/expand and lora_apply."""
    host = IN_ORDER[case]
    slots = torch.tensor(host)
    x, a, b, slots, scal, y = inputs(len(host), 5, 16, 48, 24, seed=len(host), slots=slots)
    groups = lora_groups(slots, 5, in_order=True)
    uniform = not case.endswith(("(padded)", "(loop)"))
    assert (ref.plan(groups)[0] == "uniform") == uniform
    h = ref.lora_shrink(x, a, groups, 0.5)
    assert torch.allclose(h.double(), naive_shrink(x, a, slots, 0.5), atol=1e-4)
    want = naive_expand(h, b, slots, scal, y, offset=7)
    y1 = y.clone()
    ref.lora_expand(h, b, groups, scal, y1, offset=7)
    assert torch.allclose(y1.double(), want, atol=1e-3)
    # a merged layer of two shards: stacked A [S, 2R, in], B per shard, scalings [2, S]
    a2 = torch.cat([a, a.flip(0) * 0.5], dim=1)
    bs = [b, b[:, :20].flip(0)]
    scal2 = torch.stack([scal, scal.flip(0)])
    want = naive_apply(x, a2, bs, scal2, slots, y, [3, 27])
    lora_b, bounds = stacked(bs, 3)
    ref.lora_apply(x, y, a2, lora_b, scal2, bounds, groups)
    assert torch.allclose(y.double(), want, atol=1e-3)


def test_reference_in_order_decode_path_bfloat16():
    slots = torch.tensor([-1, 0, 1, 2, 3, 4])
    x, a, b, slots, scal, y = inputs(6, 5, 8, 64, 32, seed=4, slots=slots, dtype=torch.bfloat16)
    groups = lora_groups(slots, 5, in_order=True)
    assert ref.plan(groups)[0] == "uniform"
    want = naive_apply(x, a, [b], scal[None], slots, y, [5])
    ref.lora_apply(x, y, a, b.transpose(1, 2).flatten(), scal[None], [5, 5 + b.shape[1]], groups)
    assert y.dtype == torch.bfloat16 and torch.allclose(y.double(), want, rtol=1e-2, atol=1.0)


@pytest.mark.parametrize("case", ["mixed", "one", "none"])
def test_reference_lora_apply_any_batch(case):
    t = 30
    slots = None if SLOTS[case] is None else SLOTS[case](t)
    x, a, b, slots, scal, y = inputs(t, 5, 16, 48, 24, seed=3, slots=slots)
    a2, bs, scal2 = torch.cat([a, a * 2], dim=1), [b, b[:, :10]], torch.stack([scal, scal * 3])
    want = naive_apply(x, a2, bs, scal2, slots, y, [0, 24])
    lora_b, bounds = stacked(bs, 0)
    ref.lora_apply(x, y, a2, lora_b, scal2, bounds, lora_groups(slots, 5))
    assert torch.allclose(y.double(), want, atol=1e-3)


def test_groups_shared_between_calls():
    x, a, b, slots, scal, y = inputs(50, 4, 8, 32, 16, seed=1)
    groups = lora_groups(slots, 4)
    assert torch.equal(slots[groups.order], slots.sort(stable=True).values)
    assert torch.equal(groups.order, slots.argsort(stable=True))  # stable: a slot's tokens keep their order
    assert groups.starts.tolist() == [0] + torch.bincount(slots + 1, minlength=5).cumsum(0).tolist()
    first = kernels.lora_shrink(x, a, groups)
    assert set(groups.cache) >= {"segments", "plan"}  # derived once, read by every later op of the step
    assert torch.equal(kernels.lora_shrink(x, a, groups), first)
    assert torch.equal(first, ref.lora_shrink(x, a, lora_groups(slots, 4)))


def test_any_object_with_the_contract_serves_as_groups():
    """The kernels never import infer.lora: a plain namespace with order, starts, in_order and cache works."""
    from types import SimpleNamespace
    x, a, b, slots, scal, y = inputs(20, 4, 8, 32, 16, seed=6)
    real = lora_groups(slots, 4)
    plain = SimpleNamespace(order=real.order, starts=real.starts, in_order=False, cache={})
    assert torch.allclose(ref.lora_shrink(x, a, plain, 0.5).double(), naive_shrink(x, a, slots, 0.5), atol=1e-4)


def test_low_precision_reference():
    x, a, b, slots, scal, y = inputs(40, 3, 8, 64, 32, seed=2, dtype=torch.bfloat16)
    groups = lora_groups(slots, 3)
    h = ref.lora_shrink(x, a, groups)
    assert torch.allclose(h.double(), naive_shrink(x, a, slots, 1.0), rtol=1e-3, atol=1e-3)
    want = naive_expand(h, b, slots, scal, y, 3)
    ref.lora_expand(h, b, groups, scal, y, 3)
    assert y.dtype == torch.bfloat16 and torch.allclose(y.double(), want, rtol=1e-2, atol=1.0)
