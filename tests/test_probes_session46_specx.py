"""Speculative decoding for requests whose sampling has per-token state (session 46): penalties, structured outputs,
bad_words and min_tokens get drafts, and at verify row j every logits processor sees the state the request would
have with drafts[:j] accepted. The proof: greedy replies token for token equal to the plain engine's, with drafts
verified and accepted; and each verify row's scores equal those of the plain sampler after drafts[:j]."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.sampler import Sampler, SamplingInputs
from infer.engine.sequence import Sequence
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
FEW = [5, 6, 7, 8]  # allowed_token_ids that make the tiny model's replies repetitive: drafts get proposed and accepted
VOCAB = 40


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


@pytest.fixture(scope="module")
def plain(path):
    return LLM(str(path), block_size=4)


@pytest.fixture(scope="module")
def spec(path):
    return LLM(str(path), block_size=4, speculative_config=SPEC)


def counters(llm) -> tuple[int, int]:
    s = llm.engine.stats()
    return s["spec_decode_num_drafts"], s["spec_decode_num_accepted_tokens"]


def same_with_drafts(plain, spec, prompts, params, loras=None):
    """spec's greedy replies equal plain's, and spec verified drafts of these requests and accepted some."""
    drafts, accepted = counters(spec)
    want = [o.token_ids for o in plain.generate(prompts, params, lora=loras)]
    got = [o.token_ids for o in spec.generate(prompts, params, lora=loras)]
    assert got == want
    after = counters(spec)
    assert after[0] > drafts and after[1] > accepted, (after, drafts, accepted)
    assert spec.engine.block_manager.num_used_blocks == 0
    return got


def verify_rows_equal_plain_rows(params: SamplingParams, prompt, output, drafts, setup=None):
    """The sampler's scores (masks and penalties applied) and draw distribution at the k + 1 verify rows of a
    sequence with `drafts` equal, row j, those of the same sequence with drafts[:j] appended to its output."""
    def seq(out, d):
        s = Sequence("r", list(prompt), params)
        s.output_token_ids = list(out)
        s.draft_token_ids = list(d)
        if setup is not None:
            setup(s)
        return s
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=g)
    sampler = Sampler(0)
    s = seq(output, drafts)
    rows = [s] * (len(drafts) + 1)
    x, _, _ = sampler._greedy(logits, rows, SamplingInputs.build(rows, VOCAB, torch.device("cpu")))
    for j in range(len(drafts) + 1):
        one = [seq(list(output) + list(drafts[:j]), [])]
        y, _, _ = sampler._greedy(logits[j:j + 1], one, SamplingInputs.build(one, VOCAB, torch.device("cpu")))
        assert torch.equal(x[j:j + 1], y), j
        if not params.greedy:
            assert torch.allclose(Sampler.probs(x[j:j + 1], one), Sampler.probs(y, one))


# ------------------------------------------------------------------ penalties
PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
             dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)]


@pytest.mark.parametrize("extra", PENALTIES)
def test_penalised_greedy_replies_equal_plain_with_drafts_accepted(plain, spec, extra):
    prompts = random_prompts(plain.engine.model_config.vocab_size, (6, 10, 8), seed=9)
    params = SamplingParams(**{"max_new_tokens": 24, "ignore_eos": True, "allowed_token_ids": FEW, **extra})
    same_with_drafts(plain, spec, prompts, params)


def test_penalised_requests_batched_with_plain_ones_and_a_prefix_cache_hit(plain, spec):
    vocab = plain.engine.model_config.vocab_size
    prompts = random_prompts(vocab, (7, 12, 9, 5), seed=3)
    pen = SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW, repetition_penalty=1.2,
                         frequency_penalty=0.3)
    free = SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW)
    params = [pen, free, pen, free]
    drafts, accepted = counters(spec)
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    again = [p + o[:10] for p, o in zip(prompts, got)]  # the prompt and part of the reply: a prefix cache hit
    hits = spec.engine.block_manager.prefix_hits
    assert [o.token_ids for o in spec.generate(again, params)] == \
        [o.token_ids for o in plain.generate(again, params)]
    assert spec.engine.block_manager.prefix_hits > hits
    assert counters(spec)[0] > drafts and counters(spec)[1] > accepted


@pytest.mark.parametrize("extra", PENALTIES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalties_at_each_verify_row_count_the_drafts_before_it(extra, temperature):
    params = SamplingParams(temperature=temperature, **extra)
    verify_rows_equal_plain_rows(params, [3, 4, 5], [5, 9, 9], [9, 5, 12])
