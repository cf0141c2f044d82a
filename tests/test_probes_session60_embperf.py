"""Session 60: the CPU prefill of several whole prompts of one length (a pooling or generation step of a bench
level: 8 prompts of 128 tokens) attends them in one gather and one SDPA a layer (reference._whole_prompts), not one
gather, finiteness check and SDPA per prompt. Its outputs equal a brute-force oracle and the per-sequence path (a
key or value that is not finite: the per-sequence path's split, unchanged); a step of a level's prompts holds them
all and its embeddings and greedy tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.kernels import reference
from infer.models.tiny import ensure_builtin

from helpers import check_equal_transformers, random_prompts
from lora_helpers import hf_float
from test_probes_session54_window import _batch, _oracle
from test_probes_session59_embed import check_close, hf_hidden, pooled, vectors

CASES = {  # lens, queries: whole prompts one after another, apart (another prompt between), beside chunks and decodes
    "equal": ([20, 20, 20], [20, 20, 20]),
    "apart": ([12, 5, 12, 30, 12], [12, 5, 12, 30, 12]),
    "with-context-and-decodes": ([12, 40, 12, 9], [12, 12, 12, 1]),  # (12 queries after 28 tokens: not whole)
}


@pytest.fixture
def batched(monkeypatch):
    """The sequences of each _whole_prompts call that attended them (returned True)."""
    calls = []
    real = reference._whole_prompts

    def spy(q, k_cache, v_cache, block_tables, seqs, *args):
        done = real(q, k_cache, v_cache, block_tables, seqs, *args)
        if done:
            calls.append(list(seqs))
        return done
    monkeypatch.setattr(reference, "_whole_prompts", spy)
    return calls


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("case", CASES)
def test_whole_prompts_attended_at_once_equal_the_oracle(case, window, batched):
    """Whole prompts of one length (GQA: 4 query heads on 2 KV heads) attended together equal the brute-force
    oracle; a window shorter than the prompts (20 > 16) keeps them per sequence (masked), one as long or longer
    (12) does not."""
    lens, queries = CASES[case]
    q, kc, vc, tables, lens_t, qsl = _batch(lens, queries, seed=2)
    got = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, max(queries), window=window)
    torch.testing.assert_close(got.float(), _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, window), atol=2e-5,
                               rtol=2e-5)
    groups = {}  # the whole prompts by length
    for b, (n, m) in enumerate(zip(lens, queries)):
        if n == m > 1:
            groups.setdefault(n, []).append(b)
    assert batched == [seqs for n, seqs in groups.items() if len(seqs) > 1 and (not window or n <= window)]


def test_whole_prompts_with_a_key_that_is_not_finite_equal_each_prompt_alone(batched):
    """A NaN key of one prompt: the batch falls back to the per-sequence path, whose split keeps that prompt's
    queries before the NaN finite; every output equals the prompt attended alone."""
    lens = [12, 12, 12]
    q, kc, vc, tables, lens_t, qsl = _batch(lens, lens, seed=3)
    kc[int(tables[1, 1]), 2, 0, 0] = float("nan")  # prompt 1's key at position 6
    got = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, 12)
    assert batched == []
    for b in range(3):
        alone = reference.paged_attention(q[12 * b:12 * b + 12], kc, vc, tables[b:b + 1], lens_t[b:b + 1],
                                          qsl[:2], 0.3, 12)
        torch.testing.assert_close(got[12 * b:12 * b + 12], alone, equal_nan=True, atol=0, rtol=0)
    assert got[12:18].isfinite().all() and got[18:24, :2].isnan().all()  # (query heads 0, 1 read KV head 0)


def test_a_pooling_step_holds_a_levels_prompts_and_equals_transformers(batched):
    """8 prompts of 128 tokens (a bench level of --runner pooling -c 8 --input-len 128) under the CPU defaults: one
    step attends all 8 at once in every layer, and each embedding equals transformers' last_hidden_state pooled."""
    path = ensure_builtin("tiny-qwen3")
    hf = hf_float(path)
    prompts = random_prompts(hf.config.vocab_size, [128] * 8, seed=6)
    with LLM(str(path), runner="pooling") as llm:
        assert llm.engine.config.max_num_batched_tokens >= 8 * 128
        got = vectors(llm.embed(prompts))
    check_close(got, [pooled(hf_hidden(hf, p), "LAST") for p in prompts])
    assert batched == [list(range(8))] * hf.config.num_hidden_layers


def test_generation_of_equal_prompts_beside_others_equals_transformers(batched):
    """Generation: prompts of one length prefilled together, beside a prompt of another length, then decoded:
    greedy tokens and logprobs equal transformers'."""
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    prompts = random_prompts(hf.config.vocab_size, [24, 9, 24, 24], seed=7)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    with LLM(str(path), block_size=4) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, sp)]
    check_equal_transformers(hf, prompts, outs, 6, "equal-length prefill")
    assert batched and all(seqs == [0, 2, 3] for seqs in batched)
