"""Probes of n-gram speculative decoding (review): warmup's plan against the engine start with --speculative-config,
and what a vLLM user drives through it."""

from __future__ import annotations

from infer.cli.warmup_plan import estimate_plan, measured_plan
from infer.engine import profile
from infer.engine.config import EngineConfig
from infer.engine.setup import load_engine_parts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_warmup_counts_the_verify_steps_logit_rows_as_the_engine_start_does(monkeypatch):
    """An engine start with --speculative-config reserves the logits of a verify step's draft rows; warmup's formula
    (--estimate) and its worst case (which runs no verify step) left them out, promising KV blocks the engine did
    not have."""
    monkeypatch.setattr(profile, "_peak_activations", lambda *a, **k: 0)
    kw = dict(max_num_seqs=8, max_model_len=256, memory_limit="64MB", speculative_config=SPEC)
    engine = load_engine_parts(EngineConfig(model="tiny-llama", **kw)).memory_plan
    est, _ = estimate_plan(EngineConfig(model="tiny-llama", **kw), 256, 8)
    assert est.activation_peak_bytes == engine.activation_peak_bytes
    _, extra = measured_plan(EngineConfig(model="tiny-llama", **kw), 256, 8)
    assert extra["activation_estimate_bytes"] == engine.activation_peak_bytes


def _two_decoding(num_blocks: int, prompt_b: list[int], tokens: int = 64):
    from infer import SamplingParams
    from infer.engine.block_manager import BlockManager
    from infer.engine.scheduler import Scheduler
    from infer.engine.sequence import Sequence
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig("tiny-llama", max_num_seqs=4, max_num_batched_tokens=64), bm)
    a, b = Sequence("a", [1, 2, 3], SamplingParams(max_new_tokens=50)), Sequence("b", prompt_b, SamplingParams())
    for s in (a, b):
        sched.add(s)
    batch = sched.schedule()  # both prefills
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        s.output_token_ids.append(9)
    sched.max_num_batched_tokens = tokens
    return sched, a, b


def test_an_older_requests_drafts_never_preempt_a_younger_ones_own_token():
    """a's drafts took the last free block before b (younger, at a block's end) was scheduled: b's own token then
    found no block and b was preempted (its KV recomputed later), where a plain step preempts no one."""
    sched, a, b = _two_decoding(3, [1, 2, 3, 4])  # a: 4 tokens in one block, b: 5 tokens, its second block is new
    assert sched.bm.num_free_blocks == 1
    a.draft_token_ids = [5, 6, 7]
    batch = sched.schedule()
    assert sched.num_preemptions == 0 and batch.seqs == [a, b]
    assert batch.num_new_tokens == [1, 1] and a.draft_token_ids == []


def test_drafts_take_only_the_token_budget_the_running_requests_leave():
    """With a budget of 3 tokens, a's two drafts took the token b's own decode needed: b sat the step out."""
    sched, a, b = _two_decoding(8, [1, 2, 3], tokens=3)
    a.draft_token_ids = [5, 6]
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [2, 1] and a.draft_token_ids == [5]


def test_tokens_a_speculative_step_accepts_together_make_one_inter_token_latency():
    """A verify step hands a request several tokens at one time: vLLM observes one inter-token latency per step and
    request; each accepted draft added a 0 s observation, pulling the histogram toward 0."""
    from prometheus_client.parser import text_string_to_metric_families

    from infer.engine.outputs import RequestOutput
    from infer.serve.metrics import ServerMetrics
    metrics, counted = ServerMetrics(lambda: {}, max_model_len=64), {}
    times = [10.0, 10.5, 10.5, 10.5, 11.25]  # the second step accepted two drafts and added one token of its own
    for k in (1, 4, 5):
        out = RequestOutput("r", [1, 2], token_ids=list(range(k)), token_times=times[:k], arrival_time=9.0,
                            first_token_time=10.0, first_scheduled_time=9.5)
        metrics.observe_output(out, 9.0, counted)
    m = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert m["infer:inter_token_latency_seconds_count"] == 2 and m["infer:inter_token_latency_seconds_sum"] == 1.25
    assert m["infer:generation_tokens_total"] == 5
