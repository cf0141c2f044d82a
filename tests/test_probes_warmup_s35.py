"""Probes of the thirty-fifth session: `infer warmup`'s promise against the engine an engine start sets up with the
same options (its KV blocks, the room figures it prints, the values it tells a user to try). The measured peak is
pinned where it decides a figure: on a CPU it moves from run to run."""

from __future__ import annotations

import pytest

from infer.cli.warmup_plan import estimate_plan, measured_plan
from infer.engine import profile
from infer.engine.config import EngineConfig
from infer.engine.setup import load_engine_parts


def _engine_plan(**kw):
    return load_engine_parts(EngineConfig(model="tiny-llama", **kw)).memory_plan


def test_engine_start_counts_the_lora_path_of_enable_lora_as_warmup_does():
    """An engine with --enable-lora and no adapter yet reserved the activations of a step without the LoRA path
    (its plan read the rank from --lora alone), while warmup counts the path, as the adapters added later take it:
    the engine gave the KV cache memory its first adapter's steps then use."""
    kw = dict(max_num_seqs=2, max_model_len=256, max_lora_rank=16, memory_limit="64MB", enable_lora=True)
    est, _ = estimate_plan(EngineConfig(model="tiny-llama", **kw), 256, 2)
    assert _engine_plan(**kw).activation_peak_bytes == est.activation_peak_bytes


def test_a_measured_peak_below_the_formula_promises_only_the_blocks_the_engine_allocates(monkeypatch):
    """The engine sizes its KV cache after the formula's activations; warmup's blocks came from the measured peak
    alone, so a peak below the formula said "fits" with blocks the engine then did not have (it preempted)."""
    monkeypatch.setattr(profile, "_peak_activations", lambda *a, **k: 0)
    kw = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64, memory_limit=6_000_000)
    plan, extra = measured_plan(EngineConfig(model="tiny-llama", **kw), 256, 4)
    assert plan.activation_peak_bytes < extra["activation_estimate_bytes"]
    engine = _engine_plan(**kw, num_kv_blocks=None)
    budget_blocks = (engine.budget_bytes - engine.weights_bytes - engine.activation_peak_bytes
                     - engine.reserve_bytes) // engine.kv_block_bytes  # before the engine's cap at 4 x 16 + 4
    assert plan.kv_blocks == budget_blocks
    assert plan.fits == (engine.kv_blocks >= 4 * 16)
