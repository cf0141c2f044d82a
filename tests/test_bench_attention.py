"""`python -m infer.bench.kernels --attention` (infer.bench.attention_kernels): its inputs and row on CPU at a tiny
head shape, the decode kernel interpreted (TRITON_INTERPRET=1), each variant's callables run once by a stand-in
timer. What a row's figures mean needs a GPU; here: the three partition choices compute SDPA's attention on the
same keys (the bench's own error column), and the paged cache the bench builds holds the same keys as the dense
copy SDPA reads."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import interpreted_module

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def attention():
    yield from interpreted_module("infer.kernels.attention")


@pytest.fixture
def bench(attention, monkeypatch):
    mod = importlib.import_module("infer.bench.attention_kernels")
    monkeypatch.setattr(mod, "HEADS", {"7B": (4, 4), "8B": (4, 2)})
    monkeypatch.setattr(mod, "HEAD_DIM", 16)
    monkeypatch.setattr(mod, "TABLE_KEYS", 512)
    return mod


@pytest.mark.parametrize("model,batch,ctx", [("7B", 2, 150), ("8B", 3, 64), ("8B", 1, 17)])
def test_attention_bench_row(bench, model, batch, ctx):
    calls = []

    def timer(fns):
        calls.append(len(fns))
        for f in fns:
            f()
        return 2.0

    row = bench.measure(model, batch, ctx, 1e12, "cpu", timer, torch.Generator().manual_seed(1))
    assert set(bench.COLUMNS) <= set(row), row
    assert row["max_rel_err"] < 4e-3, row  # float16 inputs, float32 softmax: every partition choice is SDPA's
    assert len(calls) == 4 and all(n == calls[0] for n in calls)  # infer x 3 choices, SDPA: the same copies
    hk = bench.HEADS[model][1]
    assert row["floor_us"] == pytest.approx(2 * batch * ctx * hk * 16 * 2 / 1e12 * 1e6)
    assert row["vs_sdpa"] == 1.0 and row["parts"] >= 1


def test_attention_bench_paged_and_dense_hold_the_same_keys(bench):
    step = bench.build("8B", 2, 40, "cpu", torch.Generator().manual_seed(2))
    tables, kc = step["block_tables"], step["k_cache"]
    for b in range(2):
        for pos in (0, 17, 38):  # keys before the new one: the cache as the bench wrote it
            block, off = int(tables[b, pos // 16]), pos % 16
            assert torch.equal(kc[block, off], step["k_dense"][b, :, pos])
