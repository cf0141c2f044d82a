"""In-process benchmark driver against a fake engine with LLMEngine's API (and once against the real one)."""

import math

import pytest

from infer.bench.datasets import BenchRequest
from infer.bench.driver import arrival_offsets, run_in_process
from infer.bench.monitor import ResourceSampler
from infer.engine.outputs import RequestOutput
from infer.errors import RequestError


class FakeEngine:
    """One token per running request per step; `max_prompt` refuses longer prompts; `interrupt_at` raises
    KeyboardInterrupt from that step."""

    def __init__(self, max_prompt=100, interrupt_at=None):
        self.reqs, self.aborted = {}, []
        self.max_in_engine = 0
        self.steps = 0
        self.max_prompt, self.interrupt_at = max_prompt, interrupt_at
        self.added = []

    def add_request(self, request_id, prompt_token_ids, params, lora=None):
        if len(prompt_token_ids) > self.max_prompt:
            raise RequestError("prompt too long")
        assert request_id not in self.reqs
        self.reqs[request_id] = dict(prompt=prompt_token_ids, n=params.max_new_tokens, out=[], lora=lora)
        self.added.append((request_id, lora, params.ignore_eos))
        self.max_in_engine = max(self.max_in_engine, len(self.reqs))

    def abort_request(self, request_id):
        if self.reqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.reqs) or bool(self.aborted)

    def step(self):
        self.steps += 1
        if self.interrupt_at is not None and self.steps == self.interrupt_at:
            raise KeyboardInterrupt
        outs = [RequestOutput(rid, [], [], [], "", "", True, "abort") for rid in self.aborted]
        self.aborted = []
        for rid, r in list(self.reqs.items()):
            r["out"].append(7)
            done = len(r["out"]) >= r["n"]
            outs.append(RequestOutput(rid, r["prompt"], list(r["out"]), [7], "ab" * len(r["out"]), "ab", done,
                                      "length" if done else None))
            if done:
                del self.reqs[rid]
        return outs

    def stats(self):
        return {"num_running": len(self.reqs), "num_waiting": 0, "kv_usage": len(self.reqs) / 10,
                "prefix_cache_hit_rate": 0.0, "num_preemptions": 0, "lora_swaps": 0}


def _reqs(n, out_len=3, prompt_len=5):
    return [BenchRequest(None, list(range(1, prompt_len + 1)), out_len + (i % 3), lora=f"a{i % 2}",
                         ignore_eos=True) for i in range(n)]


def test_concurrency_respected_and_every_request_accounted_for():
    eng = FakeEngine()
    reqs = _reqs(11)
    res = run_in_process(eng, reqs, concurrency=3, progress=False, sampler=ResourceSampler(eng, interval_s=0))
    assert eng.max_in_engine == 3
    assert not res.partial and res.num_requests == 11
    assert sorted(r.index for r in res.records) == list(range(11))
    for r in res.records:
        req = reqs[r.index]
        assert r.success and r.output_tokens == req.output_len and len(r.chunk_times) == req.output_len
        assert r.text == "ab" * req.output_len and r.lora == req.lora and r.prompt_tokens == 5
        assert r.send_time <= r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time
    m = res.metrics()
    assert m["completed"] == 11 and m["failed"] == 0
    assert m["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert [lora for _, lora, _ in eng.added] == [r.lora for r in reqs]
    assert res.timeline and max(s["kv_usage"] for s in res.timeline) <= 0.3
    assert max(s["in_flight"] for s in res.timeline) <= 3
    assert res.peak_rss_bytes > 0 and res.engine_stats["num_running"] == 0


def test_refused_request_is_a_failure_not_a_crash():
    eng = FakeEngine(max_prompt=5)
    reqs = _reqs(4) + [BenchRequest(None, list(range(1, 20)), 3)]
    res = run_in_process(eng, reqs, concurrency=2, progress=True)
    m = res.metrics()
    assert m["completed"] == 4 and m["failed"] == 1
    bad = [r for r in res.records if not r.success]
    assert bad[0].index == 4 and "too long" in bad[0].error


def test_interrupt_returns_partial_and_aborts_inflight():
    eng = FakeEngine(interrupt_at=6)
    reqs = _reqs(10, out_len=3)
    res = run_in_process(eng, reqs, concurrency=4, progress=False)
    assert res.partial
    assert res.aborted == 4 and len(eng.aborted) == 0 and not eng.reqs  # aborted and handed back
    assert all(r.success for r in res.records)
    assert len(res.records) + res.aborted <= 10 and len(res.records) >= 1


def test_poisson_arrivals():
    assert arrival_offsets(3) == [0.0, 0.0, 0.0]
    off = arrival_offsets(2000, request_rate=50.0, seed=1)
    assert off[0] == 0 and all(b >= a for a, b in zip(off, off[1:]))
    assert off[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)
    assert off == arrival_offsets(2000, request_rate=50.0, seed=1)
    eng = FakeEngine()
    res = run_in_process(eng, _reqs(4), concurrency=4, request_rate=200.0, seed=0, progress=False)
    offs = arrival_offsets(4, 200.0, 0)
    for r in res.records:  # never sent before its arrival time
        assert r.send_time - res.start_time >= offs[r.index] - 1e-9
    assert res.metrics()["completed"] == 4 and math.isclose(res.request_rate, 200.0)


def test_real_engine_tiny_llama():
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model="tiny-llama", device="cpu", max_num_seqs=8))
    reqs = [BenchRequest(None, [5 + i, 9, 11, 40], 4 + i, ignore_eos=True) for i in range(5)]
    res = run_in_process(engine, reqs, concurrency=2, progress=False)
    assert [r.output_tokens for r in res.records] == [4, 5, 6, 7, 8]
    assert all(r.success and len(r.chunk_times) == r.output_tokens for r in res.records)
    assert "kv_usage" in res.timeline[-1] and res.engine_stats["num_running"] == 0
    assert res.engine_stats["run_num_steps"] >= 30 / 2  # 30 tokens, at most 2 sequences a step
    again = run_in_process(engine, reqs[:1], concurrency=1, progress=False)
    assert again.engine_stats["run_num_steps"] == 4 and again.engine_stats["run_num_preemptions"] == 0
    assert not engine.has_unfinished_requests()
