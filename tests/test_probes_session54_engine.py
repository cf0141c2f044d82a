"""Probes of the engine's scheduler and prefix cache (session 54): num_cached_tokens' meaning, the prompt logprobs'
memory, reset_prefix_cache while requests run, and the prefix cache under preemption, aborts and adapters."""

from __future__ import annotations

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams as Params
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts


def _engine(caching: bool = True, **kw) -> LLMEngine:
    kw = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=caching) | kw
    return LLMEngine(EngineConfig("tiny-llama", **kw))


def _run(engine: LLMEngine, requests, each_step=None) -> dict:
    """requests: [(id, prompt, params)], added together; the finished outputs by id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if each_step is not None:
            each_step(engine)
    return done


def test_num_cached_tokens_counts_prompt_tokens_only_with_prefix_token_ids():
    """A request with forced prefix_token_ids whose prompt and prefix were cached by an earlier one: its
    num_cached_tokens (usage.prompt_tokens_details.cached_tokens) is at most its prompt's length, as vLLM's (the
    prompt tokens whose K/V came from the cache); the prefix's blocks counted too, 28 cached tokens of a 10-token
    prompt were reported. Its tokens are those of the cache off (and of transformers)."""
    prompt, prefix = random_prompts(500, (10, 20), seed=11)
    params = Params(max_new_tokens=3, ignore_eos=True, prefix_token_ids=prefix)
    engine = _engine()
    first = _run(engine, [("a", prompt, params)])["a"]
    again = _run(engine, [("b", prompt, params)])["b"]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(prompt)  # every prompt token's K/V came from the cache
    assert engine.block_manager.prefix_hits == 28  # (the hit counters count the blocks found, prefix ones too)
    want = hf_greedy(ensure_builtin("tiny-llama"), prompt + prefix, 3)
    assert again.outputs[0].token_ids[len(prefix):] == want
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
