"""Session 48 (engine): draft-model speculation's step within max_num_batched_tokens (the draft's catch-up counted),
the unknown-adapter error's remedy in the caller's terms, and the quantization report's lm_head row."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


# ------------------------------------------------------------------ 1. the draft's first forward within the budget
def _first_forwards(monkeypatch) -> list:
    """The tokens of the draft's first forward of each step (its catch-up and the step's own tokens)."""
    from infer.engine.draft import DraftRunner
    fed, real_propose, real_forward = [], DraftRunner.propose, DraftRunner._forward

    def propose(self, batch):
        fed.append(None)
        return real_propose(self, batch)

    def forward(self, feeds, rows):
        if fed[-1] is None:
            fed[-1] = sum(len(tokens) for _, _, tokens in feeds)
        return real_forward(self, feeds, rows)
    monkeypatch.setattr(DraftRunner, "propose", propose)
    monkeypatch.setattr(DraftRunner, "_forward", forward)
    return fed


@pytest.mark.parametrize("budget, k, lengths", [(6, 1, (3, 3, 30)), (7, 2, (2, 3, 2, 25, 9))])
def test_the_drafts_first_forward_never_exceeds_max_num_batched_tokens(path, monkeypatch, budget, k, lengths):
    """Sequences whose drafts were all accepted (the last one's draft KV fed only the next step) lose their drafts
    to a prompt's chunk: the draft still feeds their catch-up token, which the step's budget must count."""
    fed = _first_forwards(monkeypatch)
    kw = dict(block_size=4, max_num_batched_tokens=budget, max_num_seqs=len(lengths))
    llm = LLM(str(path), speculative_config={"model": str(path), "num_speculative_tokens": k}, **kw)
    prompts = [list(range(10 + 40 * i, 10 + 40 * i + n)) for i, n in enumerate(lengths)]
    got = [o.token_ids for o in llm.generate(prompts, greedy(12))]
    assert got == [o.token_ids for o in LLM(str(path), **kw).generate(prompts, greedy(12))]
    assert fed and max(fed) <= budget, fed
    s = llm.engine.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0


def test_the_scheduler_counts_a_lagging_draft_against_the_budget(path):
    """Scheduler unit: a decoding sequence whose draft lags one token costs two of the budget without drafts, and
    a draft of its own needs no more than that one."""
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=5, max_num_seqs=4,
              speculative_config={"model": str(path), "num_speculative_tokens": 1})
    sched = llm.engine.scheduler
    assert sched.draft_model
    from infer.engine.sequence import Sequence
    seqs = [Sequence(f"r{i}", [3 + i, 4, 5, 6, 7], greedy(8), None) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.num_new_tokens == [5]
    for s in seqs[:1]:  # as after a step that accepted every draft: the draft KV lacks the last token
        s.num_computed_tokens, s.draft_computed = 5, 4
    batch = sched.schedule()
    # the first: its own token and its draft's catch-up (2); the second: the 3 left of its prompt
    assert batch.num_new_tokens == [1, 3] and sched.lag(seqs[0]) == 1
    draft_fed = sum(n + sched.lag(s) for s, n in zip(batch.seqs, batch.num_new_tokens))
    assert draft_fed <= 5
