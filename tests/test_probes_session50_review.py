"""The fiftieth session's review probes: defects found reading its new code (a fresh replica's placement deadline,
a draft model of a shorter context). Replicas are stand-ins behind tests/fakeray.py."""

from __future__ import annotations

import time

from infer.parallel.pool import ReplicaPool

from fakeray import FakeRay, Handle


class _Stub:
    def info(self) -> dict:
        return {"error": None, "host": "h", "pid": 0}


def _fresh_placed_at_deadline(handles: list):
    """A restart whose actor is pending at first (the test places it: handles[-1].pending = False)."""
    def restart(index: int) -> Handle:
        handles.append(Handle(_Stub(), pending=True))
        return handles[-1]
    return restart


def test_the_pool_keeps_a_fresh_replica_placed_before_its_deadline_was_read():
    """A fresh replica whose `where` had answered (Ray placed it) but which the driver had not read yet when the
    placement deadline passed (the loop read another replica's result first) was killed as never placed, and
    another started in its place (or the replica stayed stopped). Now a placed one loads."""
    made, notes = [], []
    pool = ReplicaPool(FakeRay(), [Handle(_Stub())], capacity=2, notify=notes.append,
                       restart=_fresh_placed_at_deadline(made), max_restarts=1, placement_timeout=60)
    r = pool.replicas[0]
    r.alive = False
    assert pool._replace(r)
    made[-1].pending = False  # Ray placed it: its `where` answered
    r.place_by = time.monotonic() - 1  # ... and then the deadline passed before the driver read it
    pool._unplaced()
    assert len(made) == 1 and made[0].alive and r.handle is made[0], notes
    assert not any("not placed" in n for n in notes), notes
    assert r.place_by is None and list(pool._starting.values()) == [r]
    assert next(iter(pool._starting)).method == "load"  # it loads the model now


def test_the_server_engine_keeps_a_fresh_replica_placed_before_its_deadline_was_read():
    from infer.parallel.serve_engine import RayAsyncEngine, _Replica
    made = []
    r = _Replica(0, Handle(_Stub()), {}, alive=False)
    engine = RayAsyncEngine.__new__(RayAsyncEngine)
    engine.ray, engine.replicas, engine._starting = FakeRay(), [r], {}
    engine._restart, engine.max_restarts = _fresh_placed_at_deadline(made), 1
    engine._replace(r)
    assert r.starting and len(made) == 1
    made[-1].pending = False
    r.place_by = time.monotonic() - 1
    engine._unplaced()
    assert len(made) == 1 and made[0].alive and r.starting and r.error is None
    assert [(ref.method, stage) for ref, (_, stage, *_) in engine._starting.items()] == [("load", "info")]


def test_add_lora_skips_a_replica_that_stopped_after_the_live_ones_were_read():
    """add_lora read the live replicas, then sent the adapter to each one's actor: one that the driver thread had
    found stopped in between had a fresh actor in its place, still loading (no engine yet), and the adapter reached
    that one: its call failed and the adapter was refused (the in-place reload's path checked, the plain one did
    not). Now it is left out as a replica that died; the fresh one gets the adapters once it has loaded."""
    import asyncio
    from types import SimpleNamespace

    from infer.engine.config import EngineConfig
    from infer.parallel.replica import Replica
    from infer.parallel.serve_engine import RayAsyncEngine, _Adapters, _Replica
    from test_probes_session49_review2 import _engine, _Fresh

    ray = FakeRay(eager=True)
    fresh = Replica(EngineConfig("tiny-llama", max_model_len=128), None, False)  # (loads in its `load` call)

    class Racing(_Replica):
        race = False

        def __getattribute__(self, name):
            if name == "handle" and object.__getattribute__(self, "race"):
                # the driver thread, just before: the replica stopped and a fresh actor is starting in its place
                object.__setattr__(self, "race", False)
                self.alive, self.starting, self.handle = False, True, Handle(fresh, ray)
            return object.__getattribute__(self, name)

    first = Racing(0, Handle(_Fresh(), ray), {}, alive=True)
    other = _Replica(1, Handle(_Fresh(), ray), {}, alive=True)
    engine = _engine([first, other])
    engine.ray, engine._lora_changes = ray, None
    adapters = _Adapters(["a"], {"a": "/a"})
    engine.engine = SimpleNamespace(lora_slots=lambda: adapters, lora_manager=adapters)
    first.race = True
    asyncio.run(RayAsyncEngine.add_lora(engine, "c", "/c"))
    assert adapters.has("c") and ("add_lora", "c", "/c", False) in other.handle.replica.calls


def test_an_overlapped_step_whose_launch_failed_leaves_its_blocks_to_be_zeroed():
    """The interrupted-step fix (the next step zeroes the KV blocks a step got but never zeroed) covered the draft,
    the verify and the plain forward, not the overlapped launch: one that raised before its zeroing (Ctrl-C or a
    failure while its inputs were prepared: "loses nothing") dropped the blocks' list, and nothing zeroed them
    (a kernel that reads a block's masked tail reads what their memory held: NaN, as uninitialised memory may)."""
    from infer import LLM, SamplingParams
    from infer.engine.model_runner import ModelRunner
    from infer.models.tiny import ensure_builtin

    from helpers import random_prompts
    path = str(ensure_builtin("tiny-llama"))
    kw = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=96)
    prompts = random_prompts(512, (18, 5), seed=50)
    want = [o.token_ids for o in LLM(path, overlap=False, **kw).generate(
        prompts, [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 2)]
    llm = LLM(path, overlap=True, **kw)
    eng = llm.engine
    dropped, zeroed, real = [], set(), ModelRunner.prepare

    def prepare(self, batch, *a):
        if batch.zero and not dropped:  # the first step that got blocks: it fails before it zeroes them
            dropped.extend(batch.zero)
            raise KeyboardInterrupt
        zeroed.update(batch.zero)
        return real(self, batch, *a)
    ModelRunner.prepare = prepare
    try:
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        got, interrupts = {}, 0
        while eng.has_unfinished_requests():
            try:
                outs = eng.step()
            except KeyboardInterrupt:
                interrupts += 1
                continue
            for out in outs:
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        ModelRunner.prepare = real
    assert interrupts == 1 and eng.overlap and dropped
    assert set(dropped) <= zeroed, "blocks handed out and never zeroed"
    assert [got[str(i)] for i in range(2)] == want


def test_a_prefix_hit_on_blocks_of_a_running_sequence_past_the_draft_context_takes_no_unwritten_draft_kv(tmp_path):
    """A sequence past a shorter draft's context feeds the draft nothing, yet its blocks entered the prefix cache
    unmarked (draft_upto was set only when it was freed): a request within the context that hit them while it ran
    took their draft KV as written, drafted from zeros, and every draft was rejected (greedy tokens the same). The
    target as its own draft accepts every draft of a right draft KV."""
    import json
    import shutil

    from infer import LLM, SamplingParams
    from infer.models.tiny import ensure_builtin

    from helpers import random_prompts
    path = ensure_builtin("tiny-llama")
    short = tmp_path / "draft"
    shutil.copytree(path, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 32}))
    kw = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=96)
    llm = LLM(str(path), speculative_config={"model": str(short), "num_speculative_tokens": 3},
              enable_prefix_caching=True, **kw)
    eng = llm.engine
    base = random_prompts(512, (36,), seed=3)[0]
    eng.add_request("owner", base + [9], SamplingParams(max_new_tokens=30, ignore_eos=True))  # past the context
    eng.step()
    eng.step()
    before = dict(eng.stats())
    prompt = base[:20] + [11]  # within it: hits the owner's first blocks while the owner runs
    eng.add_request("within", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    want = LLM(str(path), **kw).generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert got["within"] == list(want.token_ids)
    stats = eng.stats()
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == 20
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
