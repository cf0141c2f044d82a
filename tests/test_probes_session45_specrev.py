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
