"""Session 64: the chunked gated delta rule's intra-chunk part in Triton (kernels.delta_triton.chunk_terms, one
program per chunk and value head: the cumulative gate, the decayed beta k k^T system, its unit triangular inverse,
w, u, the decayed q k^T and the decayed q and k), so that the whole chunked rule (chunk_gated_delta_rule_varlen) runs
in Triton on CUDA. Interpreted on CPU against the torch code (delta_rule.chunk_terms, chunk_gated_delta_rule_varlen:
float32, tight) over several sequences with partial last chunks, one shorter than a chunk, and GQA heads; compiled
for sm_90 / sm_89 at Qwen3-Next's shapes; its token rows past 2^31 elements; tiny-qwen3_5 through it gives
transformers' tokens."""

from __future__ import annotations

import textwrap

import pytest
import torch

from infer.kernels import delta_rule
from infer.kernels.moe import SM90_SMEM
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, interpreted_module, random_prompts, run_compile_only
from test_probes_session63_rdelta import COMPILED, SM89_SMEM

# sequences of 70 tokens (a whole chunk of 64, then 6), 5 (shorter than a chunk), 64 (exactly one) and 130 (two
# whole chunks of 64, then 2)
LENS = [70, 5, 64, 130]
TOL = 1e-5  # (float32: the kernel's sums in another order than torch's)


@pytest.fixture(scope="module")
def delta():
    yield from interpreted_module("infer.kernels.delta_triton")


def _inputs(gen, lens, hk, hv, dk, dv, dtype=torch.float32):
    """A prefill step's q, k [T, Hk, Dk] and v [T, Hv, Dv] (views of one row of q|k|v per token, as the model splits
    its conv output: strided), g [T, Hv] (negative), beta [T, Hv] in (0, 1), and query_start_loc."""
    t = sum(lens)
    x = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv), -torch.rand(t, hv, generator=gen) * 2,
            torch.rand(t, hv, generator=gen).to(dtype), starts)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("hk, hv, dk, dv, dtype", [
    (1, 2, 16, 48, torch.float32),  # (2 value heads on one key head; 48 value columns: a whole tile and half one)
    (2, 4, 24, 16, torch.float32),  # (GQA 2 value heads a key head; Dk 24 in a tile of 32)
    (2, 2, 16, 16, torch.bfloat16),
])
def test_chunk_terms_kernel_equals_torch(delta, monkeypatch, chunk, hk, hv, dk, dv, dtype):
    """Every term of every chunk of the step (u, w, inner, qd, kd, last: zero past a sequence's end) equals
    delta_rule.chunk_terms' at chunks of 16 and of 64 tokens."""
    monkeypatch.setattr(delta, "CHUNK", chunk)
    q, k, v, g, beta, starts = _inputs(torch.Generator().manual_seed(hk + dk), LENS, hk, hv, dk, dv, dtype)
    lay = delta_rule.chunk_layout(starts, chunk)
    want = delta_rule.chunk_terms(q, k, v, g, beta, lay["rows"])
    got = delta.chunk_terms(q, k, v, g, beta, lay)
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].shape == x.shape and got[name].dtype == torch.float32, name
        assert torch.allclose(got[name], x, atol=TOL, rtol=TOL), (name, float((got[name] - x).abs().max()))


@pytest.mark.parametrize("chunk", [16, 64])
def test_whole_chunked_rule_equals_torch(delta, monkeypatch, chunk):
    """delta_triton.chunk_gated_delta_rule_varlen (all three parts in Triton) against delta_rule's, two steps in a
    row (the states carried): outputs and states equal, a sequence from zero state over a slot that holds NaN, GQA
    heads; its intra-chunk part the Triton one (delta_rule.chunk_terms not called)."""
    monkeypatch.setattr(delta, "CHUNK", chunk)
    calls, real = [], delta_rule.chunk_terms
    monkeypatch.setattr(delta_rule, "chunk_terms", lambda *a: (calls.append(1), real(*a))[1])
    gen = torch.Generator().manual_seed(3)
    hk, hv, dk, dv = 2, 4, 16, 32
    slots, kept = torch.tensor([2, 0, 4, 1]), torch.tensor([True, True, False, True])
    mine = torch.randn(5, hv, dk, dv, generator=gen) * 0.1
    mine[4] = float("nan")
    ref = mine.clone()
    for step in range(2):
        q, k, v, g, beta, starts = _inputs(gen, LENS, hk, hv, dk, dv)
        got = delta.chunk_gated_delta_rule_varlen(q, k, v, g, beta, mine, starts, slots, kept)
        assert not calls  # (the intra-chunk part in Triton, not delta_rule.chunk_terms)
        want = delta_rule.chunk_gated_delta_rule_varlen(q, k, v, g, beta, ref, starts, slots, kept, chunk)
        calls.clear()
        assert torch.isfinite(got).all()
        assert torch.allclose(got, want, atol=TOL, rtol=TOL), (step, float((got - want).abs().max()))
        assert torch.allclose(mine[:4], ref[:4], atol=TOL, rtol=TOL), step
        kept = torch.ones_like(kept)


def test_terms_kernel_compiles_within_the_shared_memory_of_sm90_and_sm89():
    """Compiled for sm_90 and sm_89 through the real launcher (chunk_gated_delta_rule_varlen at Qwen3-Next's and
    Qwen3.5's shapes: Hk 16, Hv 32, Dk 128, Dv 128, q|k|v strided views of the conv output, a sequence of one whole
    chunk and one of 6 tokens), the intra-chunk kernel takes no more shared memory than a program may have there."""
    shared = run_compile_only(COMPILED, 600)
    assert {"_chunk_terms_kernel sm_90", "_chunk_terms_kernel sm_89"} <= set(shared), shared
    assert 0 < shared["_chunk_terms_kernel sm_90"] <= SM90_SMEM
    assert 0 < shared["_chunk_terms_kernel sm_89"] <= SM89_SMEM


FAR_ROWS = textwrap.dedent('''
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import json, torch
    from infer.kernels import delta_rule, delta_triton
    hk, hv, dk, dv, stride, t = 1, 2, 16, 16, 2 ** 30, 3
    width = 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(0)
    big = torch.empty((t - 1) * stride + width, dtype=torch.bfloat16)  # (virtual memory: only the rows' pages)
    x = big.as_strided((t, width), (stride, 1))  # row 2 starts at element 2^31
    x.copy_(torch.randn(t, width, generator=gen))
    q, k, v = (y.view(t, -1, d) for y, d in zip(x.split([hk * dk, hk * dk, hv * dv], dim=-1), (dk, dk, dv)))
    g, beta = -torch.rand(t, hv, generator=gen), torch.rand(t, hv, generator=gen)
    lay = delta_rule.chunk_layout(torch.tensor([0, t], dtype=torch.int32), delta_triton.CHUNK)
    want = delta_rule.chunk_terms(q.clone(), k.clone(), v.clone(), g, beta, lay["rows"])
    got = delta_triton.chunk_terms(q, k, v, g, beta, lay)
    print(json.dumps({n: torch.allclose(got[n], want[n], atol=1e-5, rtol=1e-5) for n in want}))
''')


def test_terms_kernel_reads_token_rows_past_2_31_elements():
    """The intra-chunk kernel over q, k, v whose third token row starts at element 2^31 of their tensor (as a long
    prompt's rows of Qwen3.5's in_proj_qkv view do), interpreted in a process of its own (an int32 offset wraps: a
    read 4 GiB before the tensor): every term equals the torch code's."""
    assert run_compile_only(FAR_ROWS, 300) == {n: True for n in ("u", "w", "inner", "qd", "kd", "last")}


def test_interpreted_triton_qwen3_5_prefills_give_hf_tokens(monkeypatch):
    """tiny-qwen3_5 with every op through its Triton kernel (interpreted on CPU), prompts of 70 tokens (cut into
    steps of 48: the chunked rule's state carried from a step to the next, its second step's chunks a whole one and
    a partial one), 5 and 20 beside it: the prefill steps run the Triton intra-chunk kernel (counted) and the tokens
    are transformers'."""
    calls = check_interpreted_prefills(monkeypatch, "tiny-qwen3_5", 2, [4, 6, 3])
    assert len(calls) >= 2 * 3 and max(calls) >= 2  # (3 linear layers, at least 2 prefill steps, one of 2+ chunks)


def check_interpreted_prefills(monkeypatch, name: str, seed: int, lens: list[int]) -> list[int]:
    """Builtin `name` with every op through its Triton kernel (interpreted on CPU), prompts of 70 tokens (in steps of
    48), 5 and 20 generating `lens` tokens: transformers' tokens. Returns the chunks of each call of the intra-chunk
    kernel."""
    if torch.cuda.is_available():
        pytest.skip(f"a GPU runs the real kernels (the engine tests of {name} on cuda)")
    from infer import LLM, SamplingParams, kernels
    from infer.kernels import delta_triton
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    calls, real = [], delta_triton.chunk_terms
    monkeypatch.setattr(delta_triton, "chunk_terms", lambda *a, **k: (calls.append(a[-1]["rows"].shape[0]),
                                                                       real(*a, **k))[1])
    path = ensure_builtin(name)
    llm = LLM(str(path), max_num_seqs=4, block_size=4, num_kv_blocks=96, max_model_len=96, max_num_batched_tokens=48)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (70, 5, 20), seed=seed)
    got = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                       for n in lens])]
    assert got == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]
    return calls


def test_bench_prefill_row_times_the_terms_and_the_mixed_path(delta, monkeypatch):
    """A prefill row of infer.bench.delta (2 prompts of at most 70 tokens, small heads) with a stand-in timer (the
    n-th op timed takes n ms: triton, loop, varlen, mixed, then the Triton terms, torch's and the row-by-row solve's
    (session 65)): each column is its op's (the gains the ratios), the Triton terms equal torch's and the row-by-row
    solve's in float32 and the whole Triton rule's outputs the torch loop's within bfloat16's rounding."""
    from infer.bench import delta as bench
    for name, value in dict(HK=1, HV=2, DK=16, DV=16).items():
        monkeypatch.setattr(bench, name, value)
    calls, real = [], delta_rule.chunk_terms
    monkeypatch.setattr(delta_rule, "chunk_terms", lambda *a: (calls.append(1), real(*a))[1])
    timed, torch_terms = [], []  # (each op's result, and its calls of delta_rule.chunk_terms)

    def timer(fn):
        before = len(calls)
        timed.append(fn())
        torch_terms.append(len(calls) - before)
        return len(timed)

    row = bench.measure_prefill(2, 70, timer, torch.Generator().manual_seed(0), "cpu")
    assert list(row) == bench.PREFILL_COLUMNS and len(timed) == 7
    assert [row[c] for c in ("triton_us", "loop_us", "varlen_us", "mixed_us", "terms_us", "terms_torch_us",
                             "terms_rows_us")] == [1e3, 2e3, 3e3, 4e3, 5e3, 6e3, 7e3]
    assert torch_terms == [0, 2, 1, 1, 0, 1, 0]  # (the loop's per sequence; the mixed path's terms in torch)
    assert row["mixed_gain"] == 4.0 and row["terms_gain"] == 6 / 5 and row["blocked_gain"] == 7 / 5
    assert sorted(timed[4]) == sorted(timed[5]) == sorted(timed[6]) == ["inner", "kd", "last", "qd", "u", "w"]
    assert all(torch.allclose(timed[4][n], timed[6][n], atol=TOL, rtol=TOL) for n in timed[4])
    assert row["terms_max_abs_err"] < TOL and row["max_abs_err"] < 0.05
