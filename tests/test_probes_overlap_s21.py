"""Probe of overlapped steps whose constrained rows read a token still on the device (SamplingInputs.late: the mask
is filled inside the launch, after LLMEngine.step's `settle` completed the step before). The engine must give, with
overlap on, exactly what it gives with it off; and a launch that fails after that completion must not strand the
outputs it made."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams, StructuredOutputsParams as S
from infer.engine import sampler as sampler_mod

from helpers import drive_requests, random_prompts, tiny_llama_str as path  # noqa: F401 (a fixture)

pytest.importorskip("xgrammar")


@pytest.fixture
def late_steps(monkeypatch):
    """How many steps took the late path (their bitmask filled after the step before completed)."""
    count = [0]
    real = sampler_mod.SamplingInputs.settle

    def settle(self, vocab, device):
        count[0] += 1
        return real(self, vocab, device)
    monkeypatch.setattr(sampler_mod.SamplingInputs, "settle", settle)
    return count


def _final(out) -> tuple:
    return (tuple(out.token_ids), out.text, out.finish_reason, out.stop_reason, out.error, out.logprobs,
            out.prompt_logprobs)


def _same(a, b) -> bool:
    """Equal, logprob values to 1e-4: a batch of other rows (the steps overlap schedules before the step before
    has completed, so preemption and prefix-cache hits can differ) moves them by float rounding only."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= 1e-4  # a == b: -inf, a top token a grammar masked
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _drive(llm, requests, abort_after=None, arrive_every=0):
    """Feed (id, prompt, params) one every `arrive_every` steps (0: all at once), abort request r after its
    abort_after[r]-th output; {id: final output}. No block or penalty row is left in use."""
    final, seen, abort_after = {}, {}, dict(abort_after or {})

    def record(out) -> bool:
        seen[out.request_id] = seen.get(out.request_id, 0) + 1
        if out.finished:
            final[out.request_id] = _final(out)
            return False
        return abort_after.get(out.request_id) == seen[out.request_id]
    drive_requests(llm, requests, record, arrive_every)
    return final


def test_late_masks_with_preemption_chunked_prefill_penalties_and_seeds(path, late_steps):
    """Grammars of every kind and bad words of several tokens, seeded draws and greedy rows, penalties, logprobs,
    min_tokens, stop strings and an abort, arriving over time through a cache small enough to preempt and a token
    budget that chunks prefills: the same final outputs with and without overlap, the late path taken."""
    prompts = random_prompts(512, (9, 5, 12, 7, 10, 6, 11, 4), seed=21)
    params = [
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, repetition_penalty=1.5,
                       structured_outputs=S(regex="[a-c]{2,5}(-[0-9])?"), logprobs=2),
        SamplingParams(max_new_tokens=12, bad_words=["ab", "the cat", "ers"], frequency_penalty=0.8, seed=4,
                       temperature=0.8, top_k=40, ignore_eos=True),
        SamplingParams(max_new_tokens=14, structured_outputs=S(json={"type": "array", "items": {"type": "integer"},
                                                                     "maxItems": 3}), presence_penalty=1.0),
        SamplingParams(max_new_tokens=9, structured_outputs=S(choice=["yes", "no", "maybe so"]), seed=5,
                       temperature=1.3),
        SamplingParams(max_new_tokens=16, repetition_penalty=2.0, bad_words=["hello", "can"], min_tokens=4,
                       stop=["e"], logprobs=0),
        SamplingParams(max_new_tokens=11, structured_outputs=S(grammar='root ::= "(" [a-z]+ ")" | "[" [0-9]* "]"'),
                       seed=6, temperature=0.9, frequency_penalty=0.5),
        SamplingParams(max_new_tokens=13, ignore_eos=True, seed=7, temperature=1.1, presence_penalty=0.5),
        SamplingParams(max_new_tokens=8, structured_outputs=S(regex="[ab]+"), bad_words=["ba"], prompt_logprobs=1),
    ]
    requests = [(str(i), p, params[i]) for i, p in enumerate(prompts)]
    results, llms = [], []
    for overlap in (False, True):
        llm = LLM(path, block_size=4, overlap=overlap, num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=8,
                  max_model_len=32)
        results.append(_drive(llm, requests, abort_after={"6": 3}, arrive_every=1))
        llms.append(llm)
    assert _same(results[1], results[0]), {r: (results[0][r], results[1][r]) for r in results[0]
                                           if not _same(results[0][r], results[1].get(r))}
    assert {r: v[:5] for r, v in results[1].items()} == {r: v[:5] for r, v in results[0].items()}
    assert results[0]["6"][2] == "abort"
    assert all(llm.engine.scheduler.num_preemptions > 0 for llm in llms)
    assert late_steps[0] >= 5


def test_late_masks_with_n_samples_prefix_caching_and_logprobs(path, late_steps):
    """LLM.generate's n seeded samples of constrained prompts, beside greedy ones, with prefix caching (prompts
    sharing a prefix), stop token ids and top logprobs: identical with and without overlap."""
    prompts = random_prompts(512, (10, 6, 8), seed=5)
    prompts.append(prompts[0][:8] + [11, 12])
    params = [SamplingParams(n=3, max_new_tokens=8, temperature=1.0, seed=11, structured_outputs=S(regex="[a-c]{2,6}"),
                             logprobs=3),
              SamplingParams(max_new_tokens=10, bad_words=["ab", "ba", "at"], repetition_penalty=1.3, logprobs=1),
              SamplingParams(n=2, max_new_tokens=12, temperature=0.7, seed=12, bad_words=["the cat", "so"],
                             stop_token_ids=[300, 301]),
              SamplingParams(max_new_tokens=9, structured_outputs=S(json_object=True), presence_penalty=0.3)]
    got = []
    for overlap in (False, True):
        llm = LLM(path, block_size=4, overlap=overlap, enable_prefix_caching=True, max_num_seqs=5)
        outs = llm.generate(prompts, params)
        got.append([[(tuple(s.token_ids), s.text, s.finish_reason, s.stop_reason, s.logprobs) for s in o.outputs]
                    for o in outs])
    assert _same(got[1], got[0])
    assert [[s[:4] for s in o] for o in got[1]] == [[s[:4] for s in o] for o in got[0]]
    assert len(got[0][0]) == 3 and len(got[0][2]) == 2
    assert late_steps[0] >= 3


def _engine_whose_sampler_fails_once_asked(monkeypatch):
    """An overlapped engine running a constrained request "c" (3 tokens) and a longer one "d", and a flag: set it,
    and the next sampling raises (once). (d's row reads the token of the step before, so the launch after c's last
    token settles that step first; c itself is not scheduled past its last token: Scheduler.ends_pending.)"""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    eng = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, overlap=True))
    eng.add_request("c", [5, 6, 7], SamplingParams(max_new_tokens=3, structured_outputs=S(regex="[ab]{1,12}")))
    eng.add_request("d", [5, 6, 8], SamplingParams(max_new_tokens=8, structured_outputs=S(regex="[ab]{8,12}")))
    real = eng.runner.sampler.sample
    fail = [False]

    def sample(logits, seqs, inputs=None):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("boom")
        return real(logits, seqs, inputs)
    monkeypatch.setattr(eng.runner.sampler, "sample", sample)
    return eng, fail


def test_a_request_finished_inside_a_failed_late_launch_keeps_the_engine_unfinished(monkeypatch):
    """The late path completes the step before inside the launch; when that completion finishes a request (its
    last token) and the launch then fails, its final output waits in LLMEngine._carried for the next step. The
    engine must still report unfinished work until it is handed out: a caller stepping while
    has_unfinished_requests() (or the server's loop, which sleeps until then) would otherwise never get it."""
    eng, fail = _engine_whose_sampler_fails_once_asked(monkeypatch)
    tokens, final, raised = [], None, 0
    while eng.has_unfinished_requests():
        seq = eng.requests.get("c")
        if seq is not None and seq.num_generated + seq.num_pending == 3 and not raised:
            fail[0] = True  # the launch that settles the request's last token fails after settling it
        try:
            outs = eng.step()
        except RuntimeError:
            raised += 1
            continue
        for o in outs:
            if o.request_id != "c":
                continue
            tokens += o.new_token_ids
            if o.finished:
                final = o
    assert raised == 1
    assert final is not None and final.finish_reason == "length"
    assert tokens == final.token_ids and len(tokens) == 3
    assert not eng.has_unfinished_requests() and not eng._carried


def test_an_id_reused_after_a_failed_late_launch_does_not_get_the_old_requests_end(monkeypatch):
    """The final output of a request that finished inside a failed late launch waits in LLMEngine._carried. A new
    request of the same id added before the next step (the id is free: the old request finished) must not be
    handed that output as its own end, as add_request already drops an aborted request's pending abort output."""
    eng, fail = _engine_whose_sampler_fails_once_asked(monkeypatch)
    raised = 0
    while not raised:
        seq = eng.requests["c"]
        if seq.num_generated + seq.num_pending == 3:
            fail[0] = True
        try:
            eng.step()
        except RuntimeError:
            raised += 1
    assert "c" not in eng.requests  # finished inside the failed launch: its end is carried
    eng.add_request("c", [9, 10, 11, 12], SamplingParams(max_new_tokens=6, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == "c"]
    assert [o.finished for o in outs] == [False] * 5 + [True]
    assert outs[-1].prompt_token_ids == [9, 10, 11, 12] and len(outs[-1].token_ids) == 6
