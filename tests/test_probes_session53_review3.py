"""Review probes of prefix sharing within one step (session 53): blocks registered in the prefix cache when a step
is scheduled hold no K/V until that step runs; whatever keeps the step from running takes them back."""

from __future__ import annotations

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams as Params

from helpers import random_prompts


def _engine(caching: bool = True, **kw) -> LLMEngine:
    kw = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=caching) | kw
    return LLMEngine(EngineConfig("tiny-llama", **kw))


def _drain(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _result(out):
    c = out.outputs[0]
    return c.token_ids, [r["logprob"] for r in c.logprobs]


def _c_after_aborting(engine: LLMEngine, prompt, params) -> tuple:
    """After a failed step: a and b aborted, c (their prompt) on `engine` and on an engine without the prefix cache
    (got, want)."""
    engine.abort_request(["a", "b"])
    _drain(engine)
    engine.add_request("c", prompt, params)
    got = _drain(engine)["c"]
    off = _engine(False)
    off.add_request("c", prompt, params)
    return got, _drain(off)["c"]


def test_a_schedule_that_raises_after_registering_blocks_leaves_them_out_of_the_cache():
    """schedule() registered the first request's blocks, then failed (here: after admitting; on a GPU an adapter
    slot's load running out of memory) and the caller aborted the running requests, as LLM and the server do after
    a failed step: the blocks, never computed, must not stay in the prefix cache, or a later request with that
    prompt reads K/V nobody wrote."""
    prompt = random_prompts(500, (40,), seed=11)[0]
    params = Params(max_new_tokens=5, ignore_eos=True, logprobs=0)
    engine = _engine()
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    sched = engine.scheduler
    admit = sched._admit

    def failing_admit(batch, budget):
        admit(batch, budget)
        raise RuntimeError("adapter slot load failed")

    sched._admit = failing_admit
    with pytest.raises(RuntimeError):
        engine.step()
    sched._admit = admit
    got, want = _c_after_aborting(engine, prompt, params)
    tokens, logprobs = _result(got)
    assert tokens == _result(want)[0]
    assert logprobs == pytest.approx(_result(want)[1], abs=1e-4)
    assert got.num_cached_tokens == 0


def test_an_interrupt_between_schedule_and_the_step_leaves_the_blocks_out_of_the_cache(monkeypatch):
    """The same for a Ctrl-C that lands after schedule() returned, while the engine collects the requests it failed
    (LLMEngine._take_failed), before the step's own guard."""
    prompt = random_prompts(500, (40,), seed=12)[0]
    params = Params(max_new_tokens=5, ignore_eos=True, logprobs=0)
    engine = _engine()
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    take = engine._take_failed

    def interrupted():
        take()
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_take_failed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.setattr(engine, "_take_failed", take)
    got, want = _c_after_aborting(engine, prompt, params)
    assert _result(got)[0] == _result(want)[0]
    assert got.num_cached_tokens == 0
