"""vLLM's priority scheduling (--scheduling-policy priority / scheduling_policy="priority"): waiting requests are
admitted lowest priority value first (then by arrival), and when the KV cache runs out the running request preempted
is the lowest priority, latest arrived one (vLLM's max over (priority, arrival_time)), not the youngest. The tokens
are the same as without preemption (and as transformers' greedy ones); the default policy (fcfs) refuses a priority
other than 0 everywhere (Python API, server, batch lines), as vLLM does."""

from __future__ import annotations

import json

import pytest

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.errors import ConfigError, RequestError
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts

P = SamplingParams(max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


def _engine(policy: str = "priority", **kw) -> LLMEngine:
    kw = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 1, "max_num_batched_tokens": 64, **kw}
    return LLMEngine(EngineConfig("tiny-llama", scheduling_policy=policy, **kw))


def _finish_order(engine: LLMEngine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


@pytest.mark.parametrize("policy, want", [("priority", ["b", "d", "c", "a", "e"]),
                                          ("fcfs", ["a", "b", "c", "d", "e"])])
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy, want):
    """One sequence at a time: under priority the lowest value runs first, equal values in arrival order (d after
    b); a request added while others wait takes its place among them (e, priority 4, after a's 3)."""
    engine = _engine(policy)
    try:
        for rid, priority in (("a", 3), ("b", 1), ("c", 2), ("d", 1)):
            engine.add_request(rid, [5, 6, 7], P, priority=priority if policy == "priority" else 0)
        engine.step()  # b (or a) admitted
        engine.add_request("e", [5, 6, 8], P, priority=4 if policy == "priority" else 0)
        assert _finish_order(engine) == want
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.close()


def _preempted(monkeypatch, engine) -> list[str]:
    seen = []
    real = engine.scheduler.preempt

    def preempt(seq):
        seen.append(seq.request_id)
        real(seq)
    monkeypatch.setattr(engine.scheduler, "preempt", preempt)
    return seen


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_the_preempted_request_is_the_lowest_priority_one_not_the_youngest(monkeypatch, path, policy, victim):
    """Two requests that cannot both finish in 6 blocks of 4 tokens: fcfs preempts the youngest (here the urgent
    one, added second); priority preempts the one of the larger priority value although it came first. Either way
    both end with transformers' greedy tokens."""
    prompts = random_prompts(512, (4, 4), seed=3)
    engine = _engine(policy, max_num_seqs=2, num_kv_blocks=6, max_model_len=24)
    try:
        seen = _preempted(monkeypatch, engine)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        engine.add_request("low", prompts[0], params, priority=5 if policy == "priority" else 0)
        engine.add_request("high", prompts[1], params)
        tokens = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = o.token_ids
        assert seen and set(seen) == {victim}
        assert tokens == {"low": hf_greedy(path, prompts[0], 12), "high": hf_greedy(path, prompts[1], 12)}
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.close()


def test_a_preempted_request_waits_at_its_own_rank(monkeypatch):
    """A preempted request goes back among the waiting ones by its priority (fcfs puts it at the front): an urgent
    request that arrived while it ran is admitted before it."""
    engine = _engine(max_num_seqs=2, num_kv_blocks=6, max_model_len=24)
    try:
        seen = _preempted(monkeypatch, engine)
        admitted = []
        real = engine.block_manager.allocate
        monkeypatch.setattr(engine.block_manager, "allocate", lambda seq, *rest: admitted.append(seq.request_id)
                            or real(seq, *rest))
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        engine.add_request("low", [5, 6, 7, 8], params, priority=5)
        engine.add_request("mid", [9, 10, 11, 12], params, priority=1)
        engine.step()
        engine.add_request("urgent", [13, 14, 15, 16], params, priority=0)  # waits: two sequences run
        _finish_order(engine)
        assert seen[0] == "low" and sorted(admitted[:2]) == ["low", "mid"]
        assert admitted.index("urgent") < admitted.index("low", admitted.index("low") + 1)
    finally:
        engine.close()


def test_fcfs_refuses_a_priority_and_names_the_policy():
    engine = _engine("fcfs")
    try:
        engine.add_request("zero", [5, 6, 7], P, priority=0)
        for bad in (3, -1):
            with pytest.raises(RequestError, match="first come, first served") as e:
                engine.add_request(f"p{bad}", [5, 6, 7], P, priority=bad)
            assert "--scheduling-policy priority" in e.value.hint and e.value.field == "priority"
        with pytest.raises(RequestError, match="first come, first served"):
            engine.add_request("sp", [5, 6, 7], SamplingParams(max_new_tokens=3, priority=2))
        with pytest.raises(RequestError, match="must be an integer"):
            engine.add_request("t", [5, 6, 7], P, priority=True)
        assert _finish_order(engine) == ["zero"]
    finally:
        engine.close()


def test_add_requests_priority_overrides_the_params_and_a_bad_policy_is_refused():
    engine = _engine()
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True, priority=9))
        engine.add_request("b", [5, 6, 8], SamplingParams(max_new_tokens=3, ignore_eos=True, priority=9),
                           priority=1)
        engine.add_request("c", [5, 6, 9], P, priority=5)
        assert _finish_order(engine) == ["b", "c", "a"]
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="scheduling-policy 'lifo' is not one of fcfs, priority"):
        EngineConfig("tiny-llama", scheduling_policy="lifo")
    with pytest.raises(RequestError, match="priority must be an integer"):
        SamplingParams(priority=1.5)


def test_llm_generate_takes_a_priority_per_prompt(path):
    prompts = random_prompts(512, (5, 7, 3), seed=1)
    want = [hf_greedy(path, p, 4) for p in prompts]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(path, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy="priority") as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, priority=[2, 0, 1])] == want
        assert [o.token_ids for o in llm.generate(prompts, params, priority=7)] == want
        order = [i for i, _, o in llm.stream(prompts, params, priority=[2, 0, 1]) if o.finished]
        assert order == [1, 2, 0]
        with pytest.raises(RequestError, match="3 prompts but 2 priority"):
            llm.generate(prompts, params, priority=[0, 1])
        with pytest.raises(RequestError, match="integer per prompt"):
            llm.generate(prompts, params, priority=[0, 1.0, 2])
        assert not llm.llm_engine.requests
    with LLM(path, block_size=4) as llm:
        with pytest.raises(RequestError, match="prompt 1: priority=1, but this engine schedules first come"):
            llm.generate(prompts, params, priority=[0, 1, 0])
        assert [o.token_ids for o in llm.generate(prompts, params, priority=[0, 0, 0])] == want


def test_infer_run_orders_a_batch_by_its_lines_priority(tmp_path):
    """`infer run --scheduling-policy priority`: the lines' priority (plain lines and OpenAI batch bodies) orders
    the run; without the option a line with a priority ends as an error record and the others complete."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in (
        {"id": "a", "prompt": "x", "max_new_tokens": 2, "priority": 2},
        {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "y", "max_tokens": 2, "priority": -1}},
        {"id": "c", "prompt": "z", "max_new_tokens": 2})))
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--max-num-seqs", "1",
                                   "--max-num-batched-tokens", "64", "--scheduling-policy", "priority"])
    assert res.exit_code == 0, res.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("id") or r.get("custom_id") for r in records] == ["b", "c", "a"]
    out2 = tmp_path / "fcfs.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out2), "-q"])
    assert res.exit_code == 1
    text = out2.read_text()
    assert text.count("first come, first served") == 2 and len(text.splitlines()) == 3


def test_the_server_takes_priority_under_the_priority_policy():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    for policy, status in (("priority", 200), ("fcfs", 400)):
        engine = _engine(policy, max_num_seqs=2)
        with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama"))) as client:
            for priority in (-3, 5):
                r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": priority})
                assert r.status_code == status, r.text
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2, "priority": 1})
            assert r.status_code == status, r.text
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": "high"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def test_a_data_parallel_run_hands_out_the_most_urgent_lines_first(tmp_path):
    """`infer run --data-parallel-size N`: the driver's queue is in priority order (each replica's engine orders
    only what it holds), so with one slot the records come out by priority."""
    from fakeray import FakeRay, Handle as _Handle

    from infer.cli import run_parallel
    from infer.cli.batch_io import RecordWriter, read_inputs
    from infer.parallel.pool import ReplicaPool
    from infer.parallel.replica import Replica
    replica = Replica(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64,
                                   scheduling_policy="priority"))
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": "x", "priority": p}) + "\n"
                           for i, p in (("a", 3), ("b", 0), ("c", 1), ("d", 0))))
    out = tmp_path / "out.jsonl"
    writer = RecordWriter(out, append=False)
    todo = read_inputs(inp, replica.engine.tokenizer, {"max_new_tokens": 2}, None, 64)
    pool = ReplicaPool(FakeRay(), [_Handle(replica)], capacity=1, notify=lambda m: None)
    assert run_parallel._generate(pool, todo, writer, replica.engine.tokenizer, True) == 0
    writer.close()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["b", "d", "c", "a"]

