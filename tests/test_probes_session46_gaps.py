"""Probes of the forty-sixth session (known gaps): what `infer serve`'s banner names, iteration_tokens_total with
speculative decoding, warmup's worst case with a verify step, data-parallel requests not yet on a replica, and the
memory a long prefill takes on a CPU under --memory-limit."""

from __future__ import annotations

import json

import pytest

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


class _NoUvicorn:
    def run(self, sockets=None):  # the banner is printed before this: serving nothing, it returns at once
        return None


def test_serve_banner_names_the_kv_cache_dtype_and_speculative_decoding(monkeypatch):
    """`infer run`'s banner said "KV cache N blocks x B tokens of float8_e5m2, max length L"; `infer serve`'s only
    "KV N blocks", with neither the cache's type nor speculative decoding."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.serve import lifecycle
    monkeypatch.setattr(lifecycle, "uvicorn_server", lambda *a, **k: _NoUvicorn())
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--device", "cpu", "--kv-cache-dtype",
                                   "fp8_e5m2", "--speculative-config", json.dumps(SPEC)])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("infer: serving"))
    assert "tokens of float8_e5m2, max length" in line, line
    assert "n-gram speculative decoding (3 draft tokens)" in line, line


def test_run_banner_names_speculative_decoding(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"), "--max-new-tokens",
                                   "2", "--speculative-config", json.dumps(SPEC)])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("infer: tiny-llama"))
    assert "n-gram speculative decoding (3 draft tokens)" in line and " of " not in line, line

