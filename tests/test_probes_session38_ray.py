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
