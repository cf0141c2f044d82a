"""Session 39 probes of the engine under stress: prefix cache keys, the warm-up at start, context limits."""

from __future__ import annotations

import builtins

import pytest

from infer import LLM, SamplingParams
from infer.errors import ConfigError
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts
from test_model_variants import build

N = 8


def test_prefix_cache_does_not_trust_pythons_hash(monkeypatch):
    """The prefix cache keyed blocks on Python's hash() of the previous key and the block's ids, and compared only the
    block's own ids: hash() of a tuple of token ids is a 64-bit function, the same in every process and invertible,
    so a prompt can be crafted whose first block B has the key of another prompt's first block A (vLLM's
    CVE-2025-25183). Here hash() is made to collide on exactly that pair. [B | C] then registered its block C under
    the key that [A | C] looks up, and [A | C ...] reused C's K/V computed after B: other tokens than transformers'.
    Keys are SHA-256 now: the collision changes nothing."""
    from infer.engine import block_manager
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), block_size=4)
    a, b, c, d, tail = random_prompts(llm.engine.model_config.vocab_size, (4, 4, 4, 4, 3), seed=39)
    real = builtins.hash

    def colliding(x):  # B's first link hashes as A's
        return real((-1, tuple(a)) if x == (-1, tuple(b)) else x)
    monkeypatch.setattr(block_manager, "hash", colliding, raising=False)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    for prompt in (a + d + tail, b + c + tail):  # A registered first, then [B | C]
        assert llm.generate([prompt], params)[0].token_ids == hf_greedy(str(path), prompt, N)
    victim = a + c + tail
    out = llm.generate([victim], params)[0]
    assert out.token_ids == hf_greedy(str(path), victim, N)
    assert out.num_cached_tokens == 4  # block A only
    assert llm.engine.block_manager.num_used_blocks == 0


def test_warm_kernels_with_the_smallest_context():
    """warm_kernels (run by every GPU engine's start and by `infer serve`) sent a warm-up prompt of 2 tokens whatever
    the context, so `--max-model-len 2` (prompts of one token, one token of reply) failed at start with "the prompt
    has 2 tokens, which leaves no room", about a prompt the user never sent."""
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), block_size=4, max_model_len=2)
    llm.engine.warm_kernels()
    assert llm.engine.num_steps == 0 and llm.engine.block_manager.num_used_blocks == 0
    prompt = random_prompts(llm.engine.model_config.vocab_size, (1,), seed=2)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(str(path), prompt, 1) and out.finish_reason == "length"


def test_a_context_past_the_sliding_window_is_refused_naming_the_window(tmp_path):
    """A Llama's context is capped at its sliding_window (its attention is full; transformers' generate() cache keeps
    the last sliding_window keys); --max-model-len past it was refused as "above the model's limit of 16" for a model
    whose config says max_position_embeddings 256: the window is named now. (Mistral's sliding attention runs to
    max_position_embeddings: test_probes_session54_window.)"""
    build(tmp_path, "llama", sliding_window=16)
    with pytest.raises(ConfigError, match=r"limit of 16 \(its sliding_window.*max_position_embeddings is 256"):
        LLM(str(tmp_path), block_size=4, max_model_len=64)
    assert LLM(str(tmp_path), block_size=4, max_model_len=16).engine.max_model_len == 16
