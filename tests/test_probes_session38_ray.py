"""Session 38 probes, data parallelism with Ray. The Replica class is plain Python: what a replica returns must
survive the pickling Ray does to carry it back to the driver."""

from __future__ import annotations

import pickle

import pytest

from infer import SamplingParams
from infer.engine.structured import StructuredOutputsParams


@pytest.fixture(scope="module")
def replica():
    from infer.engine.config import EngineConfig
    from infer.parallel.replica import Replica
    return Replica(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=2))


@pytest.mark.parametrize("so", [StructuredOutputsParams(json_object=True),
                                StructuredOutputsParams(choice=["yes", "no"])])
def test_a_structured_output_request_served_over_replicas_does_not_kill_them(replica, so):
    """`infer serve --data-parallel 2` and one request with response_format json_object: every output of the step
    held the request's Sequence (read lazily), with its xgrammar matcher, which cannot be pickled; the replica's call
    failed, the driver took the replica for dead and re-ran the request on the next one, until none was left and
    every later request got 503 no_engine_replica."""
    params = SamplingParams(max_new_tokens=4, temperature=0, structured_outputs=so)
    new, outputs = [("so", [5, 6, 7], params, None)], []
    for _ in range(20):
        step, rejected, _stats = replica.serve_step(new, [])
        new = []
        assert rejected == []
        outputs += pickle.loads(pickle.dumps(step))  # what Ray does with the result
        if not replica.engine.has_unfinished_requests():
            break
    assert outputs and outputs[-1].finished
    assert outputs[-1].token_ids == [t for o in outputs for t in o.new_token_ids]


def test_replicas_do_not_draw_the_same_random_numbers(monkeypatch):
    """Every replica's engine got the driver's --seed (0 by default), so requests without a seed drew the same
    numbers on every replica: `n=2` at temperature 1 on `infer serve --data-parallel 2` gave the same text twice
    (its samples run on two replicas at once), where one engine gives two samples."""
    import torch

    from fakeray import FakeRay
    from infer.engine.config import EngineConfig
    from infer.models.resolve import resolve_model
    from infer.parallel.runtime import start_replicas
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # (the replicas' threads: not this process's)
    cfg = EngineConfig("tiny-llama", device="cpu", max_model_len=64, max_num_seqs=2, memory_limit=2 ** 30)
    handles, _ = start_replicas(FakeRay(), cfg, resolve_model("tiny-llama"), 2)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    texts = []
    for h in handles:
        finished = []
        new = [("s", [5, 6, 7], params, None)]
        while not finished:
            finished, new = h.replica.step(new).finished, []
        texts.append(finished[0].token_ids)
    assert texts[0] != texts[1]
    from infer import LLM
    one = LLM("tiny-llama", device="cpu", max_model_len=64, max_num_seqs=2, memory_limit=2 ** 30)
    assert one.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].token_ids == texts[0]  # replica 0: one engine's


def test_a_request_output_pickles_without_the_engines_sequence():
    """RequestOutput read its lists lazily from the engine's Sequence, which pickle took along (the request's whole
    state, and a structured request's xgrammar matcher, which cannot be pickled): any caller pickling an output
    mid-request (Ray, multiprocessing) failed; it pickles its own lists now."""
    import pickle
    from infer import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM("tiny-llama", max_model_len=64)
    eng = llm.engine
    eng.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=6, temperature=1.0, seed=0,
                                                   structured_outputs=StructuredOutputsParams(choice=["ab", "cd"])))
    out = next(o for o in eng.step() if o.request_id == "r")
    copy = pickle.loads(pickle.dumps(out))
    assert copy.token_ids == out.token_ids and copy.request_id == "r" and copy._seq is None
    while eng.has_unfinished_requests():
        eng.step()
    llm.close()
