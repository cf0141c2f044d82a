"""Probes of inputs and feature combinations (session 50): seeded sampling with speculative decoding and chunked
prefill, ..."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("n", [1, 2])
def test_a_seeded_request_samples_the_same_tokens_whether_its_prompt_was_chunked(n):
    """With speculative decoding, the last chunk of a prompt prefilled in several steps (a prompt longer than
    --max-num-batched-tokens) got n-gram drafts from the prompt, so a seeded request drew from its generator for
    rows that the same prompt prefilled in one step did not have: the same request with the same seed sampled other
    tokens on an engine with a smaller token budget (or the first time, before the prefix cache held its prompt)."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9]  # 9 tokens: a budget of 8 prefills 8, then the last one alone
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=7, n=n, ignore_eos=True)
    runs = []
    for budget in ({"max_num_batched_tokens": 8, "max_num_seqs": 8}, {}):
        with LLM("tiny-llama", block_size=4, max_model_len=64, speculative_config=SPEC, enable_prefix_caching=False,
                 **budget) as llm:
            runs.append([[c.token_ids for c in o.outputs] for o in llm.generate([prompt], params)])
    assert runs[0] == runs[1]
