"""Probes of the thirty-eighth session (tools: quantize, convert, lora-validate, warmup, bench)."""

from __future__ import annotations

from typer.testing import CliRunner

from infer.cli.main import app


def test_warmup_under_a_budget_the_weights_exceed_says_so_not_to_lower_the_batch():
    """tiny-llama's 1 MiB of weights under --memory-limit 512KiB: warmup said "Lower --max-num-batched-tokens (4,096)
    or --concurrency (2), whose activations take most of the budget", which no batch size can make fit (llama-100m
    under 800MB with 16,384 batched tokens said the same). It now names the weights, as an engine start does."""
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-length", "256", "--concurrency", "2",
                                   "--memory-limit", "512KiB"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert "The weights alone take 1.0 MiB of the budget of 0.5 MiB: raise --memory-limit, or run a smaller or " \
           "quantized model" in text
    assert "--max-num-batched-tokens" not in text
