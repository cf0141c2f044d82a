"""Session 54 probes: non-finite values (NaN/inf) of one request never reach another request nor stay after it.
A request goes non-finite here through a token whose embedding row is NaN (as a float16 overflow at that token
would leave it): it ends "not finite", and every other request's greedy tokens are those of a run without it."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

BAD = 7  # the token whose embedding is NaN
KW = dict(block_size=4, max_num_seqs=4, max_model_len=64)


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


def _clean(prompt):
    return [t if t != BAD else 8 for t in prompt]


PREFIX = _clean(random_prompts(512, (16,), seed=3)[0])  # four full blocks
POISONED = PREFIX + [BAD, 20, 21]  # the prefix, then the token the model overflows on
OTHER = PREFIX + [30, 31]  # the same prefix, then tokens of its own


def _llm(path, **kw):
    llm = LLM(str(path), **{**KW, **kw})
    llm.engine.runner.model.embed_tokens.weight[BAD] = float("nan")
    return llm


def _run(llm, groups, n=6):
    """Each group of prompts generated together, one group after the other: (tokens, finish reason) of each."""
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    got = []
    for group in groups:
        got += [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in llm.generate(group, sp)]
    return got


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("chunk", [None, 10])
def test_a_prompt_token_that_overflows_leaves_the_prefix_cache_finite(path, together, chunk):
    """A prompt whose token past a cached prefix overflows: the prefix's keys and values are those of the prefix
    alone (SDPA's masked weights, 0 x NaN, carried the token's NaN value into every query before it, and the
    prefix cache's blocks of it: a later request of the same prefix, or one sharing its blocks in the same step,
    ended "not finite"). With a chunked prefill (the token mid-way through a later chunk of more queries than
    paged_attention's decode batch takes, after a context) the same."""
    kw = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=2)
    want = _run(_llm(path, **kw), [[OTHER]])
    assert want[0][1] == "length"
    groups = [[POISONED, OTHER]] if together else [[POISONED], [OTHER]]
    got = _run(_llm(path, **kw), groups)
    assert got == [([], "error")] + want


@pytest.mark.parametrize("chunk", [None, 10])
def test_the_gpu_path_keeps_an_overflowed_prompt_token_from_the_queries_before_it(path, monkeypatch, chunk):
    """The same on the GPU code path (Triton interpreted): the prefill's attention kernel takes a tile of queries
    over keys up to its last query, the masked weights 0 x NaN of the token's value reaching the queries before
    it in the tile."""
    from infer import kernels
    kw = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=2)
    want = _run(_llm(path, **kw), [[OTHER]])
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    assert _run(_llm(path, **kw), [[OTHER]]) == want
    assert _run(_llm(path, **kw), [[POISONED], [OTHER]]) == [([], "error")] + want


def test_a_rejected_draft_the_model_overflows_on_leaves_the_request_going(path, monkeypatch):
    """Speculative decoding with a draft that proposes the overflowing token second: the target rejects it (its
    own token differs), and the rows of the verify before it (the accepted draft's, the step's own token) keep the
    NaN of its value out (the GPU path's verify: a tile of queries, Triton interpreted). Greedy tokens as without
    speculation."""
    from infer import kernels
    from infer.engine.draft import DraftRunner
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    prompts = [_clean(p) for p in random_prompts(512, (9, 14), seed=8)]
    want = _run(_llm(path), [prompts], n=10)
    assert all(BAD not in t and r == "length" for t, r in want)
    real, drafted = DraftRunner.propose, []

    def propose(self, batch):
        real(self, batch)
        for seq in batch.seqs:
            if len(seq.draft_token_ids) >= 2:
                seq.draft_token_ids[1] = BAD
                drafted.append(seq)
    monkeypatch.setattr(DraftRunner, "propose", propose)
    llm = _llm(path, speculative_config={"model": str(path), "num_speculative_tokens": 3})
    assert _run(llm, [prompts], n=10) == want
    assert drafted


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("context", [0, 5])
def test_paged_attention_keeps_a_value_that_is_not_finite_from_the_queries_before_it(monkeypatch, triton, context):
    """paged_attention of a prefill chunk (after `context` cached keys) whose seventh query's value is NaN and
    whose ninth's key is +inf: the queries before the seventh are those of the keys before it alone, every query
    from it on has the NaN (the CPU reference and the Triton kernel alike)."""
    import torch

    from infer import kernels
    if triton:
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    g = torch.Generator().manual_seed(0)
    n, hq, hk, d, bs = 10, 4, 2, 16, 4
    total = context + n
    blocks = -(-total // bs)
    k_cache = torch.randn(blocks + 2, bs, hk, d, generator=g)
    v_cache = torch.randn(blocks + 2, bs, hk, d, generator=g)
    table = torch.arange(blocks, 0, -1, dtype=torch.int32)[None]  # (not block 0 first)
    bad_v, bad_k = context + 6, context + 8
    k_cache[table[0, bad_k // bs], bad_k % bs] = float("inf")
    v_cache[table[0, bad_v // bs], bad_v % bs, 1, 3] = float("nan")
    q = torch.randn(n, hq, d, generator=g)
    args = (torch.tensor([total], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), d ** -0.5)
    out = kernels.paged_attention(q, k_cache, v_cache, table, *args, max_query_len=n)
    first = bad_v - context  # the first query that attends to the NaN value
    clean_v = v_cache.clone()
    clean_v[table[0, bad_v // bs], bad_v % bs] = 0.0
    clean_k = k_cache.clone()
    clean_k[table[0, bad_k // bs], bad_k % bs] = 0.0
    want = kernels.reference.paged_attention(q[:first], clean_k, clean_v, table,
                                             torch.tensor([bad_v], dtype=torch.int32),
                                             torch.tensor([0, first], dtype=torch.int32), d ** -0.5)
    assert torch.isfinite(out[:first]).all()
    torch.testing.assert_close(out[:first], want, atol=1e-5, rtol=1e-5)
    assert out[first:, 2:, 3].isnan().all()  # (the NaN's KV head 1: query heads 2, 3)
