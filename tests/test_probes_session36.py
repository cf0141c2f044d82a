"""Session 36: the data-parallel server's runtime adapter load with a replica that died unnoticed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from infer.errors import LoRAError
from infer.serve.async_engine import NoEngineError

from fakeray import FakeRay, Handle

DEAD = object()  # an answer: the replica died unnoticed (a call on it fails as Ray's ActorDiedError)


class _Slots:
    def __init__(self):
        self.loaded = set()

    def has(self, name):
        return name in self.loaded

    def add(self, name, path=None):
        self.loaded.add(name)


class _Adapters:
    """A replica's adapter calls: add_lora answers `answer` (None: loaded; a dict: the replica's error)."""

    def __init__(self, index, answer, removed):
        self.index, self.answer, self.removed = index, answer, removed

    def add_lora(self, name, path):
        return self.answer

    def remove_lora(self, name):
        self.removed.append(self.index)
        return 0


def _replica(index, answer, removed):
    from infer.parallel.serve_engine import _Replica
    handle = Handle(_Adapters(index, answer, removed))
    handle.alive = answer is not DEAD
    return _Replica(index, handle, {"host": f"host{index}"})


def _engine(answers):
    """A RayAsyncEngine's adapter calls over fake replicas (no Ray cluster, no driver thread): each answers
    add_lora with `answers[i]` (None: loaded; a dict: the replica's error; DEAD: the call fails as on a dead
    actor)."""
    from infer.parallel.serve_engine import RayAsyncEngine
    eng, removed = RayAsyncEngine.__new__(RayAsyncEngine), []
    eng.ray, eng._lora_changes, slots = FakeRay(), None, _Slots()
    eng.replicas = [_replica(i, a, removed) for i, a in enumerate(answers)]
    eng.engine = SimpleNamespace(lora_slots=lambda: slots)

    async def on_driver_thread(fn):  # (what the driver thread runs: here, with no request routed to send first)
        return fn(eng)
    eng._call, eng._send = on_driver_thread, lambda flush=False: None
    return eng, slots, removed


def test_an_adapter_loads_on_the_live_replicas_when_one_died_unnoticed():
    """A replica that died while idle (the driver not yet aware) failed every runtime adapter load: the live
    replica dropped the adapter again and the server answered 400 "the replica stopped", until the driver's
    check noticed. The dead one is left out, as the driver leaves it out."""
    eng, slots, removed = _engine([None, DEAD])
    asyncio.run(eng.add_lora("sql", "/srv/adapters/sql"))
    assert slots.has("sql") and removed == []


def test_an_adapter_load_with_every_replica_dead_is_no_engine_and_a_replica_error_still_fails_it():
    eng, slots, _ = _engine([DEAD, DEAD])
    with pytest.raises(NoEngineError, match="no engine replica is left"):
        asyncio.run(eng.add_lora("sql", "/srv/adapters/sql"))
    assert not slots.has("sql")
    # a live replica that cannot read the adapter still fails the load, and the one that loaded it drops it
    eng, slots, removed = _engine([None, {"message": "no adapter_config.json in /srv/adapters/sql"},
                                   DEAD])
    with pytest.raises(LoRAError, match="replica 1 \\(host1\\): no adapter_config.json"):
        asyncio.run(eng.add_lora("sql", "/srv/adapters/sql"))
    assert not slots.has("sql") and removed == [0]


def test_a_load_with_no_replica_left_is_a_503_as_a_request_is(monkeypatch):
    """NoEngineError from the load (every replica dead) was an unhandled 500."""
    import httpx

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine

    async def no_replica(name, path, replace=False):
        raise NoEngineError("no engine replica is left", "restart the server")
    aengine = AsyncEngine(LLMEngine(EngineConfig("tiny-llama", max_model_len=64, enable_lora=True)))
    monkeypatch.setattr(aengine, "add_lora", no_replica)
    with serve_in_thread(Server(aengine, "tiny-llama", runtime_lora=True, retry_after=3)) as base:
        r = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/srv/a"}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "3", r.text
    assert r.json()["error"]["code"] == "no_engine_replica"


def test_request_outputs_carry_vllms_metrics():
    """RequestOutput.metrics (vLLM's RequestMetrics): with one sequence at a time the second request waits in the
    queue until the first is done, and each one's times run in order."""
    from infer import LLM, SamplingParams
    with LLM("tiny-llama", max_model_len=64, max_num_seqs=1) as llm:
        first, second = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3, ignore_eos=True))
        for out in (first, second):
            m = out.metrics
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time \
                <= m.finished_time
            assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
            assert m.last_token_time == out.token_times[-1]
        assert second.metrics.first_scheduled_time >= first.metrics.finished_time
        engine = llm.engine
        engine.add_request("r", [5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True))
        running = engine.step()[0]
        assert not running.finished and running.metrics.finished_time is None
        assert running.metrics.first_scheduled_time is not None
        while engine.has_unfinished_requests():
            engine.step()
