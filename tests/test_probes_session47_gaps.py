"""Probes of the forty-seventh session (known gaps): an adapter trained on the model a GPTQ checkpoint was quantized
from, and iteration_tokens_total when a stop ends a request inside its accepted drafts."""

from __future__ import annotations

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def _spec_run(prompt: list[int], drafts: list[int] | None = None, **params):
    """(the request's output tokens, the tokens each step handed it, the sum of the steps' last_step_tokens) on a
    fresh speculative engine (no prefix cache to carry over between runs) whose proposer drafts `drafts` (the
    continuation of the output so far), none when None."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.engine.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=2, max_num_batched_tokens=1024,
                                    enable_prefix_caching=False, speculative_config=SPEC))
    try:
        engine.add_request("r", prompt, SamplingParams(temperature=0.0, ignore_eos=True, **params))
        steps, counted, last = [], 0, None
        while engine.has_unfinished_requests():
            outs = engine.step()
            counted += engine.last_step_tokens
            for o in outs:
                steps.append(list(o.new_token_ids))
                last = o
        return list(last.token_ids), steps, counted
    finally:
        engine.close()


def test_iteration_tokens_leave_out_accepted_drafts_after_a_stop_token(monkeypatch):
    """A stop token among a step's accepted drafts ends the request there: the drafts accepted after it were never
    handed out, and vLLM's iteration_tokens_total counts only the tokens a request got. infer still counted them."""
    from infer.engine import llm_engine
    prompt = [5, 6, 7, 8, 9]
    monkeypatch.setattr(llm_engine, "propose_for", lambda seq, k, n_min, n_max: [])
    greedy, steps, counted = _spec_run(prompt, max_tokens=9)
    assert counted == len(prompt) + len(greedy) - 1
    # the proposer drafts the greedy continuation: the target accepts every draft (steps of 1 + 3 tokens)
    monkeypatch.setattr(llm_engine, "propose_for",
                        lambda seq, k, n_min, n_max: greedy[len(seq.output_token_ids):][:k])
    tokens, steps, counted = _spec_run(prompt, max_tokens=9)
    assert tokens == greedy and [len(s) for s in steps] == [1, 4, 4]
    assert counted == len(prompt) + len(tokens) - 1
    j = next(j for j in (1, 2) if greedy[j] not in greedy[:j])  # a first appearance, not the last of its step
    cut, steps, counted = _spec_run(prompt, max_tokens=9, stop_token_ids=[greedy[j]])
    assert cut == greedy[:j + 1] and steps == [greedy[:1], greedy[1:j + 1]]
    assert counted == len(prompt) + len(cut) - 1  # the drafts accepted after the stop are no tokens of the step
