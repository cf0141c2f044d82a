"""The engine's greedy tokens equal Hugging Face transformers' on the same weights, in every batching situation."""

import pytest

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-qwen3", "tiny-llama3"]
LENGTHS = (3, 7, 12, 25, 40, 5, 18, 33, 9)
N = 20


def _check(llm, path, prompts, n=N, **params):
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, **params))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, p, n), f"prompt of {len(p)} tokens differs from HF"
        assert out.finish_reason == "length"
    return outs


@pytest.mark.parametrize("name", ARCHS)
def test_batch_of_prompts_equals_hf(name):
    path = ensure_builtin(name)
    llm = LLM(str(path), block_size=4)
    prompts = random_prompts(llm.engine.model_config.vocab_size, LENGTHS)
    _check(llm, path, prompts)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("per_sequence", [True, False])
def test_both_ways_of_cpu_decode_attention_equal_hf(monkeypatch, per_sequence):
    """The CPU decode attention runs each sequence on its own for long contexts and large batches and one padded
    batch otherwise (kernels.reference._per_sequence); the tiny models' batches are small, so each way is forced."""
    from infer.kernels import reference
    monkeypatch.setattr(reference, "_per_sequence", lambda *shape: per_sequence)
    path = ensure_builtin("tiny-qwen3")
    llm = LLM(str(path), block_size=4)
    _check(llm, path, random_prompts(llm.engine.model_config.vocab_size, LENGTHS, seed=3))


def test_staggered_arrivals_while_others_decode():
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), block_size=4)
    prompts = random_prompts(llm.engine.model_config.vocab_size, LENGTHS, seed=1)
    eng, done = llm.engine, {}
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
        for _ in range(3):  # a few decode steps before the next arrival
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    for i, p in enumerate(prompts):
        assert done[str(i)] == hf_greedy(path, p, N)


def test_prefix_caching_shared_prefixes():
    path = ensure_builtin("tiny-qwen2")
    llm = LLM(str(path), block_size=4)
    vocab = llm.engine.model_config.vocab_size
    system = random_prompts(vocab, [21], seed=2)[0]
    tails = random_prompts(vocab, (1, 4, 9, 13), seed=3)
    prompts = [system + t for t in tails]
    _check(llm, path, prompts[:1])
    outs = _check(llm, path, prompts[1:])  # submitted after the first finished: its blocks are in the cache
    assert all(o.num_cached_tokens == 20 for o in outs)
    assert llm.engine.block_manager.prefix_cache_hit_rate() > 0.3
    again = _check(llm, path, prompts[:1])  # a whole prompt from the cache still computes its last token
    assert again[0].num_cached_tokens == 20


def test_preemption_under_a_tiny_kv_budget():
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), block_size=4, num_kv_blocks=24, max_model_len=64)
    prompts = random_prompts(llm.engine.model_config.vocab_size, LENGTHS, seed=4)
    _check(llm, path, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_with_a_small_token_budget():
    path = ensure_builtin("tiny-mistral")
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = random_prompts(llm.engine.model_config.vocab_size, LENGTHS, seed=5)
    _check(llm, path, prompts)


def test_prefix_token_ids_are_forced_first_reply_tokens():
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path))
    p = random_prompts(llm.engine.model_config.vocab_size, [10], seed=6)[0]
    forced = [11, 12, 13]
    out = llm.generate([p], SamplingParams(max_new_tokens=7, ignore_eos=True, prefix_token_ids=forced))[0]
    assert out.token_ids[:3] == forced
    assert out.token_ids[3:] == hf_greedy(path, p + forced, 7)
    assert out.usage["completion_tokens"] == 7  # max_new_tokens and usage count generated tokens only
    # a prefix as long as (or longer than) max_new_tokens still gets exactly max_new_tokens generated tokens
    for n in (1, 2, 3):
        out = llm.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True, prefix_token_ids=forced))[0]
        assert out.token_ids == forced + hf_greedy(path, p + forced, n) and out.usage["completion_tokens"] == n
