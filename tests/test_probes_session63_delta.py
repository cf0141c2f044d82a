"""Session 63: the Triton kernels of a Gated DeltaNet decode step (kernels.delta_triton: the causal conv1d update and
the fused recurrent gated delta rule, each on the states at the sequences' slots of a pool) under TRITON_INTERPRET=1
(compiled on a GPU) against the torch references (delta_rule.causal_conv1d_update, recurrent_gated_delta_rule_slots):
several sequences, GQA head mapping, a padding slot, sequences that start from zero state over a slot that holds NaN,
states carried over several steps; tiny-qwen3_5 with every op through its Triton kernel (graphs emulated) gives
transformers' tokens; the delta benchmark refuses without CUDA."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import delta_rule
from infer.models.tiny import ensure_builtin

from helpers import check_gpu_graphs_equal_hf, hf_greedy, interpreted_module, random_prompts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def delta():
    yield from interpreted_module("infer.kernels.delta_triton")


def _pool(shape, slots: int, dtype, gen):
    """A pool of `slots` states of `shape`, random, the last (the padding slot) NaN."""
    pool = torch.randn(slots, *shape, generator=gen).to(DEV, dtype)
    pool[-1] = float("nan")
    return pool


# slots of 3 sequences and 2 padding rows (the pool's last slot); the second sequence starts from zero state over a
# slot that holds NaN
SLOTS, KEPT, NUM_SLOTS = [4, 0, 2, 5, 5], [True, False, True, False, False], 6


def _step_args():
    return torch.tensor(SLOTS, device=DEV), torch.tensor(KEPT, device=DEV)


# bfloat16: two roundings (the conv's sum, then the silu), each of which TRITON_INTERPRET truncates toward zero: 2 ulps
BF16_TOL = 2e-2


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, BF16_TOL)])
def test_conv_update_equals_torch_over_steps(delta, dtype, tol):
    """Channels over one program (300 > CONV_BLOCK), kernel width 4, 3 steps of the same slots: each step's output
    and the pool after it (the padding slot left out: its rows race) equal the reference's."""
    gen = torch.Generator().manual_seed(0)
    c, taps = 300, 4
    weight = torch.randn(c, 1, taps, generator=gen).to(DEV, dtype)
    mine = _pool((c, taps - 1), NUM_SLOTS, dtype, gen)
    mine[SLOTS[1]] = float("nan")  # a sequence that starts at its step reads zero, not its slot's NaN
    ref = mine.clone()
    slots, kept = _step_args()
    for step in range(3):
        x = torch.randn(len(SLOTS), c, generator=gen).to(DEV, dtype)
        want = delta_rule.causal_conv1d_update(x, weight, ref, slots, kept)
        got = delta.causal_conv1d_update(x, weight, mine, slots, kept)
        real = slice(0, 3)
        assert torch.allclose(got[real].float(), want[real].float(), atol=tol, rtol=tol), step
        assert torch.allclose(mine[:-1].float(), ref[:-1].float(), atol=tol, rtol=tol, equal_nan=True), step
        assert torch.isfinite(got[real].float()).all()
        kept = torch.ones_like(kept)  # every sequence carries its state from now on
        kept[3:] = False


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("hk, hv, dk, dv", [(2, 4, 16, 48), (2, 2, 8, 8)], ids=["gqa-2tiles", "mha"])
def test_recurrent_rule_equals_torch_over_steps(delta, dtype, tol, hk, hv, dk, dv):
    """GQA (each key head read by 2 value heads) with Dv over two value tiles (48: one partly masked) and plain
    heads; q, k, v strided views of one row as the model's split gives them; 3 steps: outputs and states equal the
    reference's."""
    gen = torch.Generator().manual_seed(1)
    mine = _pool((hv, dk, dv), NUM_SLOTS, torch.float32, gen)
    mine[SLOTS[1]] = float("nan")
    ref = mine.clone()
    slots, kept = _step_args()
    b = len(SLOTS)
    for step in range(3):
        row = torch.randn(b, 2 * hk * dk + hv * dv, generator=gen).to(DEV, dtype)
        q, k, v = row.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(b, hk, dk), k.reshape(b, hk, dk), v.reshape(b, hv, dv)
        g = -torch.rand(b, hv, generator=gen).to(DEV)
        beta = torch.rand(b, hv, generator=gen).to(DEV, dtype)
        want = delta_rule.recurrent_gated_delta_rule_slots(q, k, v, g, beta, ref, slots, kept)
        got = delta.recurrent_gated_delta_rule_slots(q, k, v, g, beta, mine, slots, kept)
        assert got.dtype == dtype and got.shape == (b, hv, dv)
        real = slice(0, 3)
        assert torch.isfinite(got[real].float()).all()
        assert torch.allclose(got[real].float(), want[real].float(), atol=tol, rtol=tol), step
        assert torch.allclose(mine[:-1], ref[:-1], atol=tol, rtol=tol, equal_nan=True), step
        kept = torch.ones_like(kept)
        kept[3:] = False
    assert not torch.isnan(mine[:-1]).any()  # the NaN slot now holds its sequence's state


def test_interpreted_triton_qwen3_5_decodes_give_hf_tokens(monkeypatch):
    """tiny-qwen3_5 with every op through its Triton kernel (interpreted on CPU), prompts cut into steps of 8 tokens
    (a 20-token prompt's conv state carried across chunks, beside the others' decodes) and the decode steps through
    emulated CUDA graphs (padding rows on the padding slot): the steps run the delta kernels (counted), the tokens
    are transformers'."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (the engine tests of tiny-qwen3_5 on cuda)")
    from infer import LLM, SamplingParams, kernels
    from infer.kernels import delta_triton
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    calls = []
    for name in ("causal_conv1d_update", "recurrent_gated_delta_rule_slots", "causal_conv1d_varlen"):
        real = getattr(delta_triton, name)
        monkeypatch.setattr(delta_triton, name, lambda *a, _r=real, _n=name: (calls.append(_n), _r(*a))[1])
    path = ensure_builtin("tiny-qwen3_5")
    llm = LLM(str(path), max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64, cuda_graph_max_tokens=16,
              max_num_batched_tokens=8, state_snapshots=0)  # (no prefix snapshots: chunks not cut at block ends)
    llm.engine.runner.capture_graphs(64, emulate=True)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 20, 3, 4), seed=1)
    lens = [3, 6, 9, 12]
    got = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                       for n in lens])]
    assert set(llm.engine.runner.graphs.replays) == {1, 2, 4}  # 3 rows padded to 4: a row on the padding slot
    assert calls.count("causal_conv1d_update") >= 3 and calls.count("recurrent_gated_delta_rule_slots") >= 3
    assert calls.count("causal_conv1d_varlen") >= 3 * 3  # (3 linear layers, at least 3 prefill steps)
    assert got == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]


def test_bench_refuses_without_cuda(monkeypatch, capsys):
    from infer.bench import delta
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert delta.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_row_on_interpreted_kernels(delta):
    """A row of the benchmark at batch 1 with a stand-in timer (1 ms a call): the Triton outputs equal torch's within
    bfloat16's rounding, the gains 1, the bytes per second those of 1 ms."""
    from infer.bench import delta as bench
    row = bench.measure(1, 1e12, lambda fn: (fn(), 1.0)[1], torch.Generator(device=DEV).manual_seed(0), DEV)
    conv_bytes, rule_bytes = bench.bytes_moved(1)
    assert row["conv_gain"] == row["rule_gain"] == 1.0 and row["max_abs_err"] < 0.1
    assert row["rule_GBps"] == round(rule_bytes / 1e6, 1) and row["conv_floor_us"] == conv_bytes / 1e6
    assert rule_bytes > 32 * 128 * 128 * 8  # the float32 state read and written


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, BF16_TOL)])
def test_conv_varlen_equals_torch(delta, dtype, tol):
    """A prefill step's conv: sequences of 70 tokens (3 token tiles: only the first reads the state), 2 (shorter
    than the state: the new state mixes the old one and the tokens), 1 and 5 from zero state over a NaN slot, on 150
    channels (2 channel tiles); outputs and states equal the reference's, twice in a row (the state carried)."""
    gen = torch.Generator().manual_seed(2)
    c, taps, lens = 150, 4, [70, 2, 1, 5]
    slots, kept = torch.tensor([3, 0, 1, 4], device=DEV), torch.tensor([True, True, True, False], device=DEV)
    weight = torch.randn(c, 1, taps, generator=gen).to(DEV, dtype)
    mine = _pool((c, taps - 1), 6, dtype, gen)
    mine[4] = float("nan")
    ref = mine.clone()
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    for step in range(2):
        x = torch.randn(sum(lens), c, generator=gen).to(DEV, dtype)
        want = delta_rule.causal_conv1d_varlen(x, weight, ref, starts, slots, kept, max(lens))
        got = delta.causal_conv1d_varlen(x, weight, mine, starts, slots, kept, max(lens))
        assert torch.isfinite(got.float()).all()
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), step
        assert torch.allclose(mine[:-1].float(), ref[:-1].float(), atol=tol, rtol=tol, equal_nan=True), step
        kept = torch.ones_like(kept)


@pytest.mark.gpu
def test_qwen3_5_on_gpu_with_graphs_gives_hf_tokens():
    """On a GPU: tiny-qwen3_5 in float32 through the compiled delta kernels, eager and under real CUDA graphs (the
    slots through the graph's static buffer, padding rows on the padding slot): transformers' tokens both ways."""
    path = ensure_builtin("tiny-qwen3_5")
    prompts = random_prompts(256, (5, 20, 3, 4), seed=1)
    lens = [3, 6, 9, 12]
    check_gpu_graphs_equal_hf(path, prompts, lens, 8)


@pytest.mark.parametrize("argv, message", [(["--out", "{tmp}/missing/d.csv"], "missing does not exist"),
                                           (["--out", "{tmp}/d.csv", "--batch", "0"], "--batch 0: give batch sizes")])
def test_bench_refuses_a_bad_out_or_batch_before_timing(tmp_path, monkeypatch, capsys, argv, message):
    from test_probes_session62_probe import _on_a_gpu_that_never_times
    from infer.bench import delta as bench
    _on_a_gpu_that_never_times(monkeypatch)
    assert bench.main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
