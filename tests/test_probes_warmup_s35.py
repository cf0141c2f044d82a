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


@pytest.mark.parametrize("mode", ["estimate", "measured"])
def test_the_room_figures_above_the_asked_size_fit_when_asked_for(monkeypatch, mode):
    """"sequences of 128 tokens at once: 50" and "largest max_length at concurrency 4: 1616" came from the KV blocks
    left at 4 x 128, but 50 sequences (or 4 of 1,616 tokens) make a step of up to 4,096 tokens whose activations
    leave no block: warmup asked for either said "does not fit". Each figure now fits when asked for, and one more
    sequence does not."""
    monkeypatch.setattr(profile, "_peak_activations", lambda *a, **k: 0)
    plan_of = estimate_plan if mode == "estimate" else measured_plan

    def plan(length, concurrency):
        cfg = EngineConfig(model="tiny-llama", max_num_seqs=concurrency, max_model_len=length, memory_limit="10MiB")
        return plan_of(cfg, length, concurrency)[0]
    small = plan(128, 4)
    room, longest = small.max_concurrency_at_max_length, small.max_length_at_concurrency
    assert small.fits and 4 < room < small.kv_blocks // 8 and 128 < longest < small.kv_blocks // 4 * 16
    assert plan(128, room).fits and plan(longest, 4).fits
    assert not plan(128, room + 1).fits and not plan(longest + 16, 4).fits
    assert small.to_dict()["max_concurrency_at_max_length"] == room and "room_concurrency" not in small.to_dict()


def test_when_the_activations_leave_no_block_warmup_names_the_token_budget_that_fits():
    """2 x 4,096 tokens under 13 MiB: the 4,096-token prefill's activations leave no KV block, and warmup said
    "lower --max-num-batched-tokens (4,096) or --concurrency (2)" with no value (and one concurrency fewer changes
    nothing: a single sequence of 4,096 tokens makes the same prefill). It now names the token budget that fits by
    the formula, which does, and one more token does not."""
    from typer.testing import CliRunner

    from infer.cli.main import app

    def plan(tokens=4096):
        cfg = EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=4096, memory_limit="13MiB",
                           max_num_batched_tokens=tokens)
        return estimate_plan(cfg, 4096, 2)
    big, extra = plan()
    tokens = extra["fitting_batched_tokens"]
    assert not big.fits and big.kv_blocks == 0 and 1 < tokens < 4096
    assert plan(tokens)[0].fits and not plan(tokens + 1)[0].fits
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-length", "4096", "--concurrency", "2",
                                   "--memory-limit", "13MiB"])
    text = " ".join(res.stdout.split())
    assert res.exit_code == 1 and f"With --max-num-batched-tokens {tokens:,} it fits" in text, text
