"""Property test of the whole engine on the tiny model, with peft as the oracle: random arrivals, prompts that share
prefixes, three adapters for two device slots, aborts at random steps, prefix caching on or off and a KV cache so
small that sequences are preempted and recomputed. Every request that is not aborted returns peft's greedy tokens for
its adapter (an aborted one a prefix of them); after every step the block reference counts equal the running
sequences' block tables and the adapter pins their adapters; at the end no block is used and no adapter pinned."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import THREE, PeftOracle, hf_float, save_adapter

BLOCK = 4
MAX_NEW = 5


class Setup(tuple):
    def __repr__(self) -> str:  # one line in hypothesis' report of a failing example
        return "<tiny-llama, adapters a, b, c, peft oracle>"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = ensure_builtin("tiny-llama")
    root = tmp_path_factory.mktemp("adapters")
    hf = hf_float(base)
    paths = {n: str(save_adapter(hf, root / n, seed=i + 11, **kw)) for i, (n, kw) in enumerate(THREE.items())}
    oracle = PeftOracle(hf, paths)
    yield Setup((base, paths, oracle))
    oracle.close()


PREFIXES = random_prompts(512, (12, 12), seed=7)
requests = st.lists(st.fixed_dictionaries({
    "arrival": st.integers(0, 6),
    "prefix": st.sampled_from(range(len(PREFIXES))),
    "prefix_len": st.sampled_from([0, 3, 4, 8, 12]),
    "tail": st.lists(st.integers(3, 511), min_size=1, max_size=6),
    "lora": st.sampled_from([None, *THREE]),
    "max_new": st.integers(1, MAX_NEW),
    "abort": st.one_of(st.none(), st.integers(0, 12)),
}), min_size=1, max_size=5)


def _check(engine) -> None:
    bm, running = engine.block_manager, engine.scheduler.running
    refs = [0] * bm.num_blocks
    for seq in running:
        for bid in seq.block_table:
            refs[bid] += 1
    assert [b.ref_count for b in bm.blocks] == refs, "reference counts differ from the running block tables"
    assert bm.num_free_blocks == refs.count(0) and bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert all(not s.block_table for s in engine.scheduler.waiting)
    lm = engine.lora_manager
    for name in lm.names():
        assert lm.pins(name) == sum(1 for s in running if s.lora == name), f"adapter {name!r} pins leak"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, extra_blocks=st.integers(0, 4), caching=st.booleans())
def test_engine_under_preemption_aborts_and_adapters_matches_peft(setup, reqs, extra_blocks, caching):
    base, paths, oracle = setup
    prompts = [PREFIXES[r["prefix"]][:r["prefix_len"]] + r["tail"] for r in reqs]
    need = max(-(-(len(p) + r["max_new"]) // BLOCK) for p, r in zip(prompts, reqs))
    llm = LLM(str(base), loras=paths, max_loras=2, max_lora_rank=8, block_size=BLOCK, max_model_len=need * BLOCK,
              num_kv_blocks=need + extra_blocks, enable_prefix_caching=caching)
    engine, done, step = llm.engine, {}, 0
    while step <= 6 or engine.has_unfinished_requests():
        assert step < 400, "the workload did not finish in a bounded number of steps"
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                params = SamplingParams(max_new_tokens=r["max_new"], ignore_eos=True)
                engine.add_request(str(i), prompts[i], params, lora=r["lora"])
            if r["abort"] == step and r["arrival"] <= step:
                engine.abort_request(str(i))
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
        _check(engine)
        step += 1
    assert sorted(done) == sorted(str(i) for i in range(len(reqs))), "a request never finished"
    for i, (p, r) in enumerate(zip(prompts, reqs)):
        out, expect = done[str(i)], oracle.greedy(r["lora"], p, r["max_new"])
        if out.finish_reason == "abort":
            assert out.token_ids == expect[:len(out.token_ids)]
        else:
            assert (out.finish_reason, out.token_ids) == ("length", expect), f"request {i} differs from peft"
    assert engine.block_manager.num_used_blocks == 0
    assert all(engine.lora_manager.pins(n) == 0 for n in THREE)
