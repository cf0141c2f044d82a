"""Probes of vLLM's priority scheduling (--scheduling-policy priority), session 44."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4, max_model_len=64, scheduling_policy="priority") as llm:
        yield llm


def test_a_priority_out_of_range_in_generates_list_names_its_prompt(llm):
    """generate(prompts, priority=[...]) refused a value out of range without saying which prompt's it was, where
    every other per-prompt refusal (the engine's, the encoding's) starts with "prompt i:"."""
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for bad in (2**70, -2**70):
        with pytest.raises(RequestError, match=r"^prompt 1: priority must be in"):
            llm.generate(["a", "b", "c"], params, priority=[0, bad, 1])
    assert not llm.llm_engine.requests
    assert [len(o.token_ids) for o in llm.generate(["a", "b"], params, priority=[0, 2**63 - 1])] == [2, 2]


class _Rank:
    """A rank whose comparisons are counted (the waiting queue's cost, without timing it)."""
    count = 0

    def __init__(self, key):
        self.key = key

    def __lt__(self, other):
        _Rank.count += 1
        return self.key < other.key

    def __eq__(self, other):
        return self.key == other.key

    def __gt__(self, other):
        return other < self

    def __le__(self, other):
        return not other < self

    def __ge__(self, other):
        return not self < other


def test_queueing_many_waiting_requests_by_priority_is_not_quadratic(monkeypatch):
    """Under the priority policy a request was put among n waiting ones with bisect on a deque (each of its log2 n
    probes indexes the deque, O(n), and takes that request's rank) and deque.insert: queueing a run of 10^5 lines
    of random priorities took 13 s, 10^6 most of an hour. vLLM keeps a heap. Counted here (no timing): ranks taken
    and compared per request queued; the queue still hands requests out in (priority, arrival, admission) order, a
    preempted one at its own rank, an aborted waiting one removed."""
    import random

    from infer.engine.config import EngineConfig
    from infer.engine.scheduler import Scheduler
    from infer.engine.sequence import Sequence
    calls = []

    def rank(seq):
        calls.append(seq)
        return _Rank((seq.params.priority, seq.number))
    monkeypatch.setattr(Scheduler, "rank", staticmethod(rank))
    sched = Scheduler(EngineConfig("tiny-llama", scheduling_policy="priority"), block_manager=None)
    rng = random.Random(0)
    params = [SamplingParams(priority=p) for p in range(-50, 50)]
    seqs = [Sequence(str(i), [1, 2, 3], rng.choice(params)) for i in range(4096)]
    _Rank.count = 0
    for seq in seqs:
        sched.add(seq)
    # each request's rank is taken once, as it is queued (bisect on the deque took log2 n of them, each an O(n) index)
    assert len(calls) == 4096, f"{len(calls) / 4096:.1f} ranks taken per request queued"
    assert _Rank.count < 4096 * 16, f"{_Rank.count / 4096:.0f} rank comparisons per request queued"
    # aborted while waiting (a client gone, generate's prompts taken back out): deque.remove compared the request
    # with those before it (Sequence's dataclass __eq__, its params and prompt): 5,000 aborts took 19 s
    eq = Sequence.__eq__
    compared = []
    monkeypatch.setattr(Sequence, "__eq__", lambda a, b: compared.append(1) or eq(a, b))
    gone = rng.sample(seqs, 512)
    for seq in gone:
        sched.finish(seq, "abort")
    assert len(compared) < 512 * 4, f"{len(compared) / 512:.0f} requests compared per abort"
    assert all(seq not in sched.waiting for seq in gone) and len(sched.waiting) == 4096 - 512
    monkeypatch.setattr(Sequence, "__eq__", eq)
    want = sorted((s for s in seqs if all(s is not g for g in gone)), key=lambda s: (s.params.priority, s.number))
    assert list(sched.waiting) == want and sched.waiting[0] is want[0]
    first = sched.waiting.popleft()
    sched.waiting.appendleft(first)  # (a preempted request goes back at its rank)
    assert [sched.waiting.popleft() for _ in range(len(want))] == want
