"""Session 48 (review): a cached block's draft KV known to be written once a draft caught it up (a prefix hit's
catch-up within max_num_batched_tokens), and the unknown-adapter remedy of `infer run --data-parallel`."""

from __future__ import annotations

import pytest

from infer import LLM
from infer.models.tiny import ensure_builtin

from test_probes_session48_engine import _first_forwards, greedy


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


# ------------------------------------------------------------------ 1. a prefix hit's draft catch-up
# (the draft's first forward of each step counted as the engine probes count it)


def test_a_hit_on_blocks_computed_after_a_stale_one_catches_up_no_more_than_a_token(path, monkeypatch):
    """X finishes with its draft one token behind at a block's end (that block's draft_upto 3). Z extends X's text:
    it hits that block, its draft catches the slot up, and Z's later blocks get cached. Y, arriving while Z runs,
    hits all of them: the stale mark was kept until Z was freed, so Y's draft fed the slot and every token of Z's
    blocks again (a catch-up of 17 tokens: Y waited behind Z, then a draft forward of 18 tokens with a budget of
    8). Once Z's draft wrote the slot, the block says so."""
    kw = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    llm = LLM(str(path), speculative_config={"model": str(path), "num_speculative_tokens": 2}, **kw)
    eng, bm = llm.engine, llm.engine.block_manager
    prompt = list(range(10, 18))
    x = prompt + list(llm.generate([prompt], greedy(13))[0].outputs[0].token_ids)
    assert [b.draft_upto for b in bm.blocks if b.hash is not None] == [None, None, None, None, 3]  # (the setup)
    z = x[:20] + list(range(40, 56))
    y = z + [70, 71, 72, 73]
    fed = _first_forwards(monkeypatch)
    eng.add_request("z", z, greedy(30))
    while eng.requests["z"].num_computed_tokens < len(z):
        eng.step()
    eng.add_request("y", y, greedy(4))
    seq_y, outs, lags = eng.requests["y"], {}, []
    while eng.has_unfinished_requests():
        outs.update((o.request_id, list(o.token_ids)) for o in eng.step() if o.finished)
        if seq_y.block_table and not seq_y.finished:
            lags.append(eng.scheduler.lag(seq_y))
    assert fed and max(fed) <= 8, fed
    assert max(lags, default=0) <= 1, lags
    plain = LLM(str(path), **kw)
    want = plain.generate([z, y], [greedy(30), greedy(4)])
    assert [list(o.outputs[0].token_ids) for o in want] == [outs["z"], outs["y"]]
    assert bm.num_used_blocks == 0


# ------------------------------------------------------------------ 2. infer run --data-parallel: an unknown adapter
@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from pathlib import Path

    from lora_helpers import hf_float, save_adapter
    hf = hf_float(Path(ensure_builtin("tiny-llama")))
    return save_adapter(hf, tmp_path_factory.mktemp("s48r-adapter") / "qv", seed=3)


@pytest.mark.parametrize("with_lora", [False, True])
def test_infer_run_data_parallel_names_the_lora_option_for_an_unknown_adapter(adapter, with_lora):
    """`infer run --data-parallel N` checks the lines on a replica (Replica.validate, across Ray): it sent back
    str(e), the engine's API remedy (LLM.add_lora, lora_request), where one engine's infer run says --lora NAME=PATH.
    The replica sends the error itself (pickled, as Ray does), which the driver words as one engine's run does."""
    import pickle
    from types import SimpleNamespace

    from fakeray import FakeRay, Handle
    from infer.cli.run_parallel import _check_lines
    from infer.engine.config import EngineConfig
    from infer.parallel.replica import Replica

    class Ray(FakeRay):
        def call(self, ref):  # what crosses the actor boundary is pickled
            return pickle.loads(pickle.dumps(super().call(ref)))
    ray = Ray(eager=True)
    loras = {"qv": str(adapter)} if with_lora else {}
    replica = Replica(EngineConfig("tiny-llama", max_model_len=64, loras=loras))
    lines = [SimpleNamespace(id=rid, line_no=i + 1, error=None,
                             request=SimpleNamespace(prompt_token_ids=[5, 6, 7], params=greedy(2), lora=lora))
             for i, (rid, lora) in enumerate([("a", "sql"), ("b", None), ("c", "qv" if with_lora else None)])]
    _check_lines(ray, [Handle(replica, ray)], lines, strict=False)
    err = lines[0].error
    assert lines[0].request is None and err.startswith("line 1: unknown LoRA adapter 'sql'"), err
    assert "--lora sql=PATH" in err and "add_lora" not in err and "lora_request" not in err, err
    assert ("registered adapters: qv;" if with_lora else "registered adapters: none;") in err
    assert [x.error for x in lines[1:]] == [None, None]
    bad = replica.validate([("d", [5, 6, 7], greedy(2), None), ("e", [5] * 100, greedy(2), None)])
    assert list(bad) == ["e"] and "64" in str(bad["e"])  # (another request error: its own text)


# ------------------------------------------------------------------ 3. LLM.generate of several prompts
def test_several_prompts_naming_an_unknown_adapter_raise_unknown_adapter_error(path):
    """LLM.generate words a refused prompt's error "prompt i: ..." when there are several: it re-raised a plain
    RequestError, so `except UnknownAdapterError` (exported, raised for one prompt) missed it, and its fields (the
    name, the registered adapters) were gone. The error keeps its class and fields."""
    from infer.errors import RequestError, UnknownAdapterError
    llm = LLM(str(path), max_model_len=64)
    with pytest.raises(UnknownAdapterError) as one:
        llm.generate([[5, 6, 7]], greedy(2), lora="sql")
    with pytest.raises(UnknownAdapterError) as many:
        llm.generate([[5, 6, 7], [8, 9]], greedy(2), lora="sql")
    e = many.value
    assert e.message == f"prompt 0: {one.value.message}" and str(e).startswith("prompt 0: unknown LoRA adapter 'sql'")
    assert (e.name, e.known, e.slots, e.hint) == ("sql", (), False, one.value.hint)
    with pytest.raises(RequestError) as long:  # another refusal: its own class, its prompt named
        llm.generate([[5, 6, 7], [5] * 100], greedy(2))
    assert type(long.value) is RequestError and long.value.message.startswith("prompt 1: ")
    assert llm.generate([[5, 6, 7]], greedy(2))[0].outputs[0].token_ids  # the engine still runs
