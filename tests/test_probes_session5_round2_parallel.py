"""Second probe round (session 5), data parallel: a request that makes an engine step raise inside a replica
fails alone (an error record in `run --data-parallel`, an error answer in `serve --data-parallel`) instead of
taking the replica, and then every other replica, down. The Replica class is plain Python: no Ray needed."""

from __future__ import annotations

from helpers import fail_steps_of
from infer import SamplingParams


def test_a_request_a_data_parallel_replica_fails_on_is_an_error_record_not_a_dead_replica(monkeypatch):
    """In `run --data-parallel`, an engine step that raised killed the Ray actor call: the pool declared the
    replica dead and re-ran the request on the next one, which died too, until 'every engine replica has stopped'
    ended the run (and --resume met the same request again). One engine fails only the running requests."""
    from infer.engine.config import EngineConfig
    from infer.parallel.replica import Replica
    fail_steps_of(monkeypatch, "poison")
    replica = Replica(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=1))
    new = [(rid, [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True), None) for rid in ("a", "poison", "b")]
    finished, rejected = {}, {}
    for _ in range(50):
        result = replica.step(new)
        new = []
        finished.update({o.request_id: o for o in result.finished})
        rejected.update(dict(result.rejected))
        if result.running == 0:
            break
    assert sorted(finished) == ["a", "b"] and all(len(o.token_ids) == 3 for o in finished.values())
    assert list(rejected) == ["poison"] and "simulated kernel failure" in rejected["poison"]
    assert replica.engine.block_manager.num_used_blocks == 0


def test_a_request_a_data_parallel_serving_replica_fails_on_fails_alone(monkeypatch):
    """The same for `serve --data-parallel`: serve_step raised and the driver dropped the replica."""
    from infer.engine.config import EngineConfig
    from infer.engine.model_runner import ModelRunner
    from infer.parallel.replica import Replica
    real = ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, batch: (_ for _ in ()).throw(RuntimeError("boom"))
                        if any(s.request_id == "poison" for s in batch.seqs) else real(self, batch))
    replica = Replica(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=1))
    new = [(rid, [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True), None) for rid in ("poison", "a")]
    finished, rejected = {}, {}
    for _ in range(50):
        outputs, bad, stats = replica.serve_step(new, [])
        new = []
        finished.update({o.request_id: o for o in outputs if o.finished})
        rejected.update(dict(bad))
        if not replica.engine.has_unfinished_requests():
            break
    assert list(rejected) == ["poison"] and "boom" in rejected["poison"]
    assert list(finished) == ["a"] and len(finished["a"].token_ids) == 3 and stats["kv_blocks_used"] == 0
