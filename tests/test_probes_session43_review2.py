"""Review of session 43's changes: defects found in its new features (cache_salt / reset_prefix_cache, ...)."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams

PROMPT = list(range(5, 41))  # 36 tokens: 9 full blocks of 4


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", block_size=4, max_model_len=128)


def _hits(llm) -> int:
    return llm.engine.stats()["prefix_cache_hits"]


def test_reset_prefix_cache_also_forgets_the_prefixes_of_running_requests(llm):
    # reset_prefix_cache answered True while a running request's prompt blocks stayed shared: a request sent after
    # the reset still hit them (the docstring says "unshared", the README "cached prefixes forgotten")
    engine = llm.engine
    engine.add_request("running", {"prompt_token_ids": PROMPT}, SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.step()  # its prompt is computed and its blocks registered
    assert llm.reset_prefix_cache() is True
    before = _hits(llm)
    engine.add_request("after", {"prompt_token_ids": PROMPT}, SamplingParams(max_new_tokens=2, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert _hits(llm) - before == 0
    assert outs["after"].outputs[0].token_ids == outs["running"].outputs[0].token_ids[:2]
    # and the cache works again afterwards
    before = _hits(llm)
    llm.generate([PROMPT], SamplingParams(max_new_tokens=2))
    assert _hits(llm) - before >= 32


def test_bench_default_out_under_a_dangling_link_is_refused_not_looped_on(tmp_path, monkeypatch):
    # default_out made <timestamp>, <timestamp>-2, ... for ever when ./bench-results was a link to nothing (mkdir's
    # FileExistsError came from the link, not from the timestamp folder): `infer bench` hung before it started
    from pathlib import Path

    from infer.cli.bench import check_out, default_out
    from infer.errors import ConfigError
    (tmp_path / "bench-results").symlink_to(tmp_path / "gone")
    monkeypatch.chdir(tmp_path)
    calls = []
    real = Path.mkdir

    def counted(self, *args, **kwargs):
        calls.append(self)
        if len(calls) > 50:
            raise RuntimeError("default_out loops")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", counted)
    out = default_out()
    monkeypatch.setattr(Path, "mkdir", real)
    assert out.parent == Path("bench-results")
    with pytest.raises(ConfigError, match="is a link to .*gone, which does not exist"):
        check_out(out)  # said before the benchmark runs, not when its report cannot be written
    assert (tmp_path / "bench-results").is_symlink()


@pytest.mark.parametrize("bounds", [{"minimum": 0, "maximum": 50}, {"minimum": 0}, {}])
def test_an_enum_whose_values_meet_multiple_of_is_taken_and_kept(llm, bounds):
    # every value of the enum is a multiple of 5, yet it was refused "give enum only values that meet multipleOf";
    # and with the refusal gone, the range's multiples (0, 15, 20, ...) replaced the enum in the grammar
    schema = {"type": "integer", "multipleOf": 5, **bounds, "enum": [5, 10]}
    texts = {llm.generate(["x"], SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed,
                                                structured_outputs={"json": schema}))[0].outputs[0].text
             for seed in range(8)}
    assert texts and texts <= {"5", "10"}, texts


def test_an_enum_value_that_breaks_multiple_of_is_still_refused(llm):
    from infer.errors import RequestError
    with pytest.raises(RequestError, match="multipleOf at #/multipleOf beside enum"):
        llm.generate(["x"], SamplingParams(max_new_tokens=4, structured_outputs={
            "json": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50, "enum": [5, 12]}}))


def test_serve_a_request_never_sent_to_a_replica_that_stopped_is_not_counted_as_lost_there(monkeypatch):
    # a request routed to a replica but not sent yet (its calls queued: r.new) counted as "in flight" on it when it
    # stopped: on the next replica that stopped it was failed as "on 2 engine replicas that stopped" after one
    import collections
    import threading

    from infer.parallel.pool import MAX_LOST
    from infer.parallel.serve_engine import RayAsyncEngine, _Replica
    from infer.serve.async_engine import _Pending

    from fakeray import FakeRay, Handle
    engine = RayAsyncEngine.__new__(RayAsyncEngine)
    dead, *others = [_Replica(i, Handle(None), {}) for i in range(3)]
    engine.ray, engine.replicas, engine._calls, engine._owner = FakeRay(), [dead, *others], {}, {}
    engine._cond, engine._adds = threading.Condition(), collections.deque()
    failed = []
    monkeypatch.setattr(engine, "_fail", lambda rid, reason, message, seq=None: failed.append(rid))

    def pending(rid: str) -> _Pending:
        return _Pending(rid, [5, 6], SamplingParams(), None, (None, None), 0.0, lost=MAX_LOST - 1)

    sent, unsent = pending("sent"), pending("unsent")
    engine._sinks = {"sent": None, "unsent": None}
    dead.inflight = {"sent": sent, "unsent": unsent}
    dead.new = [unsent]
    engine._lost(dead, RuntimeError("died"))
    assert failed == ["sent"]
    assert unsent.lost == MAX_LOST - 1 and list(engine._adds) == [unsent]
