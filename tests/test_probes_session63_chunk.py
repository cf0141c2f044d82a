"""Session 63: a Gated DeltaNet prefill step's chunked gated delta rule over all its sequences in one call
(delta_rule.chunk_gated_delta_rule_varlen: 64-token chunks of one sequence each, each sequence from its slot's state
or zero, its state after written back there) equals transformers' torch_chunk_gated_delta_rule run per sequence,
bit for bit in float32; its Triton form (kernels.delta_triton.chunk_gated_delta_rule_varlen: the inter-chunk state
recurrence and the output in Triton) under TRITON_INTERPRET=1 equals the torch code; tiny-qwen3_5 with its prefills
through the Triton form gives transformers' tokens; the benchmark's prefill row."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import delta_rule
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, interpreted_module, random_prompts

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# sequences of 70 tokens (a chunk and a partial one), 1 (a chunk of one token, from zero state), 130 (3 chunks, over a
# slot holding NaN, from zero state), 64 (exactly a chunk) and 5; the pool's last slot NaN
LENS, SLOTS, KEPT, NUM_SLOTS = [70, 1, 130, 64, 5], [3, 0, 5, 4, 1], [True, False, False, True, True], 6


def _step(hk, hv, dk, dv, dtype, gen):
    """One prefill step's inputs: q, k, v strided views of the conv's output, g, beta, query_start_loc."""
    t = sum(LENS)
    row = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen).to(DEV, dtype)
    q, k, v = row.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -torch.rand(t, hv, generator=gen).to(DEV) * 0.5
    beta = torch.rand(t, hv, generator=gen).to(DEV, dtype)
    starts = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return (q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), g, beta), starts


def _pool(hv, dk, dv, gen):
    pool = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen).to(DEV)
    pool[-1] = float("nan")
    return pool, torch.tensor(SLOTS, device=DEV), torch.tensor(KEPT, device=DEV)


def test_varlen_equals_transformers_per_sequence_bit_for_bit():
    """float32, GQA (2 key heads, 4 value heads): every output and every state written back are transformers'
    torch_chunk_gated_delta_rule's on each sequence alone (its state from the slot, or zero), exactly."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    gen = torch.Generator().manual_seed(0)
    (q, k, v, g, beta), starts = _step(2, 4, 16, 16, torch.float32, gen)
    pool, slots, kept = _pool(4, 16, 16, gen)
    want_pool, outs = pool.clone(), []
    for i, (s, e) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        state = want_pool[SLOTS[i]] if KEPT[i] else torch.zeros_like(want_pool[0])
        o, new = torch_chunk_gated_delta_rule(
            q[s:e].repeat_interleave(2, 1)[None], k[s:e].repeat_interleave(2, 1)[None], v[s:e][None], g[s:e][None],
            beta[s:e][None], initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        want_pool[SLOTS[i]] = new[0]
    got = delta_rule.chunk_gated_delta_rule_varlen(q, k, v, g, beta, pool, starts, slots, kept)
    assert torch.equal(got, torch.cat(outs))
    assert torch.equal(pool, want_pool) and not pool[:-1].isnan().any()


@pytest.fixture(scope="module")
def delta():
    yield from interpreted_module("infer.kernels.delta_triton")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hk, hv, dk, dv", [(2, 4, 16, 48), (1, 1, 24, 16)], ids=["gqa-2tiles", "dk24"])
def test_triton_chunk_equals_torch_over_two_steps(delta, dtype, tol, hk, hv, dk, dv):
    """The Triton form (Dv over two value tiles, one partly masked; a Dk short of its power-of-2 tile) against the
    torch code on the same step, twice in a row (every state carried the second time): outputs and states (the
    padding slot, written by the NaN-slot sequence, included)."""
    gen = torch.Generator().manual_seed(1)
    mine, slots, kept = _pool(hv, dk, dv, gen)
    ref = mine.clone()
    for step in range(2):
        args, starts = _step(hk, hv, dk, dv, dtype, gen)
        want = delta_rule.chunk_gated_delta_rule_varlen(*args, ref, starts, slots, kept)
        got = delta.chunk_gated_delta_rule_varlen(*args, mine, starts, slots, kept)
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.isfinite(got.float()).all()
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), step
        assert torch.allclose(mine, ref, atol=1e-5, rtol=1e-5, equal_nan=True), step
        kept = torch.ones_like(kept)


def test_triton_chunk_of_an_empty_step_writes_nothing(delta):
    gen = torch.Generator().manual_seed(2)
    pool, _, _ = _pool(2, 16, 16, gen)
    before = pool.clone()
    x = torch.zeros(0, 2, 16, device=DEV)
    none = torch.zeros(0, dtype=torch.long, device=DEV)
    got = delta.chunk_gated_delta_rule_varlen(x, x, x, x[..., 0], x[..., 0], pool, torch.zeros(1, device=DEV), none,
                                              none == 0)
    assert got.shape == (0, 2, 16) and torch.allclose(pool, before, equal_nan=True)


def test_interpreted_triton_qwen3_5_prefills_give_hf_tokens(monkeypatch):
    """tiny-qwen3_5 with every op through its Triton kernel (interpreted on CPU): a 70-token prompt (two chunks in
    its first step) beside shorter ones, steps of up to 96 tokens (prefills beside decodes: a mixed step's decodes
    take the recurrent kernel, its prefills the chunked one); the prefill steps run the Triton chunked rule
    (counted), the tokens are transformers'."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (the engine tests of tiny-qwen3_5 on cuda)")
    from infer import LLM, SamplingParams, kernels
    from infer.kernels import delta_triton
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    calls = []
    for name in ("chunk_gated_delta_rule_varlen", "recurrent_gated_delta_rule_slots"):
        real = getattr(delta_triton, name)
        monkeypatch.setattr(delta_triton, name, lambda *a, _r=real, _n=name: (calls.append((_n, len(a[-2]))),
                                                                               _r(*a))[1])
    path = ensure_builtin("tiny-qwen3_5")
    llm = LLM(str(path), max_num_seqs=4, block_size=4, num_kv_blocks=96, max_model_len=96, enforce_eager=True,
              max_num_batched_tokens=96)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (70, 5, 20, 30), seed=3)
    lens = [4, 8, 3, 5]
    got = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                       for n in lens])]
    chunked = [n for name, n in calls if name == "chunk_gated_delta_rule_varlen"]
    assert len(chunked) >= 3 * 2 and max(chunked) >= 2  # (3 linear layers; a call over several sequences)
    assert any(name == "recurrent_gated_delta_rule_slots" for name, _ in calls)
    assert got == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]


def test_bench_prefill_row_on_interpreted_kernels(delta, monkeypatch):
    """A prefill row of the benchmark (2 prompts of at most 70 tokens) with a stand-in timer (1 ms a call): the
    Triton outputs equal the torch loop's within bfloat16's rounding, the gains 1."""
    from infer.bench import delta as bench
    monkeypatch.setattr(bench, "HK", 1)
    monkeypatch.setattr(bench, "HV", 2)
    monkeypatch.setattr(bench, "DK", 16)
    monkeypatch.setattr(bench, "DV", 16)
    row = bench.measure_prefill(2, 70, lambda fn: (fn(), 1.0)[1], torch.Generator(device=DEV).manual_seed(0), DEV)
    assert row["tokens"] == 70 + 35 and row["gain"] == row["varlen_gain"] == 1.0
    assert row["max_abs_err"] < 0.05


def test_bench_refuses_a_negative_prefill_before_timing(tmp_path, monkeypatch, capsys):
    from test_probes_session62_probe import _on_a_gpu_that_never_times
    from infer.bench import delta as bench
    _on_a_gpu_that_never_times(monkeypatch)
    assert bench.main(["--out", str(tmp_path / "d.csv"), "--prefill", "-1"]) == 2
    assert "--prefill -1: give the prompts' length in tokens" in capsys.readouterr().err


def test_a_mixed_step_takes_each_decode_recurrent_and_its_prefills_in_one_chunked_call(monkeypatch):
    """GatedDeltaNet._prefill over a mixed step (prefills of 3 and 5 tokens, one from zero state, between two
    one-token decodes and beside a one-token prefill from zero state): each decode the recurrent rule from its slot,
    the prefills one chunked call over the three of them; outputs and states those of each sequence alone."""
    from types import SimpleNamespace

    from infer import kernels
    from infer.models.qwen3_5 import GatedDeltaNet
    cfg = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4, model_type="qwen3_5", hidden_size=32,
                          rms_norm_eps=1e-6)
    layer = GatedDeltaNet(cfg, "model.layers.0.linear_attn", lambda names: None, torch.float32)
    gen = torch.Generator().manual_seed(4)
    layer.rec_state = torch.randn(7, 4, 16, 16, generator=gen)
    lens, slots, kept = [1, 3, 1, 5, 1], [5, 0, 2, 3, 1], [True, True, True, False, False]
    calls = []
    real = kernels.gated_delta_prefill
    monkeypatch.setattr(kernels, "gated_delta_prefill", lambda *a: (calls.append(len(a[-2])), real(*a))[1])
    t = sum(lens)
    conv = torch.randn(t, layer.conv_dim, generator=gen)
    g, beta = -torch.rand(t, 4, generator=gen), torch.rand(t, 4, generator=gen)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    want_pool, outs = layer.rec_state.clone(), []
    for i, (s, e) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        q, k, v = layer._split(conv[s:e])
        state = want_pool[slots[i]] if kept[i] else torch.zeros_like(want_pool[0])
        if e - s == 1 and kept[i]:
            o, new = delta_rule.recurrent_gated_delta_rule(q, k, v, g[s:e], beta[s:e], state[None])
        else:
            o, new = delta_rule.chunk_gated_delta_rule(q, k, v, g[s:e], beta[s:e], state)
        outs.append(o)
        want_pool[slots[i]] = new.reshape(want_pool[0].shape)
    ctx = SimpleNamespace(query_start_loc=starts, state_slots=torch.tensor(slots))
    got = layer._prefill(conv, g, beta, ctx, torch.tensor(kept))
    assert calls == [3]
    assert torch.equal(got, torch.cat(outs)) and torch.equal(layer.rec_state, want_pool)
