"""Probe round (session 35) of `infer run/serve --data-parallel` and `infer bench`: what a data-parallel run counts
and writes is one engine's, and bench's odd inputs and outputs are clear errors."""

from __future__ import annotations

import json

import pytest

from infer.engine.config import EngineConfig


def _write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


@pytest.fixture(scope="module")
def replicas():
    from infer.parallel.replica import Replica
    cfg = EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=2, memory_limit=2 ** 29)
    return [Replica(cfg) for _ in range(2)]


def _one_and_dp(tmp_path, replicas, lines: list) -> tuple[tuple[int, dict], tuple[int, dict]]:
    """(failed count, records by id) of one engine's _generate and of the data-parallel driver's (replicas in this
    process behind test_ray_pool's stand-in for Ray) on the same input."""
    from test_ray_pool import FakeRay, _Handle

    from infer.cli import run as one, run_parallel
    from infer.cli.batch_io import RecordWriter, read_inputs
    from infer.parallel.pool import ReplicaPool
    inp = _write(tmp_path / "in.jsonl", lines)
    tokenizer = replicas[0].engine.tokenizer
    results = []
    for name in ("one", "dp"):
        path = tmp_path / f"{name}.jsonl"
        todo = read_inputs(inp, tokenizer, {"max_new_tokens": 3}, None, 64)
        writer = RecordWriter(path, append=False)
        if name == "one":
            failed = one._generate(replicas[0].engine, todo, writer, True)
        else:
            pool = ReplicaPool(FakeRay(), [_Handle(r) for r in replicas], capacity=2, notify=lambda m: None)
            failed = run_parallel._generate(pool, todo, writer, tokenizer, True)
        writer.close()
        results.append((failed, {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}))
    return results[0], results[1]


def test_a_request_the_engine_ends_with_an_error_fails_a_data_parallel_run_too(tmp_path, replicas):
    """A request the engine ends with finish_reason "error" (here bad_words leave no allowed token; also NaN logits
    or a deleted adapter) fails one engine's run (exit 1, counted in the summary): the data-parallel driver wrote
    the same record but counted it as ok, and the run exited 0."""
    (tt,) = set(replicas[0].engine.tokenizer.encode("tt", add_special_tokens=False))
    lines = [{"id": "a", "prompt": "x", "max_new_tokens": 3},
             {"id": "bw", "prompt": "y", "max_new_tokens": 3, "allowed_token_ids": [tt], "bad_words": ["tt"]}]
    (one_failed, want), (dp_failed, got) = _one_and_dp(tmp_path, replicas, lines)
    assert want["bw"]["finish_reason"] == "error" and got == want
    assert one_failed == dp_failed == 1
