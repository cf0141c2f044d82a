"""Session 52 (errors): what a user gets wrong on the command line gets a message that names the bad value and what
to do, the exit code README's table gives, and keeps what was already written."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


def _no_load(monkeypatch):
    from infer.engine import llm_engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)


@pytest.mark.parametrize("argv", [
    ["run", "tiny-llama", "IN", "--max-model-len", "-1"],
    ["run", "tiny-llama", "IN", "--max-num-batched-tokens", "-8"],
    ["run", "tiny-llama", "IN", "--max-num-batched-tokens", "-2k"],
    ["warmup", "tiny-llama", "--max-length", "-4096"],
])
def test_a_negative_token_count_is_named_out_of_range_not_not_a_whole_number(tmp_path, monkeypatch, argv):
    """`--max-model-len -1` said "'-1' is not a whole number": it is one, only below the range."""
    _no_load(monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    r = runner.invoke(app, [str(src) if a == "IN" else a for a in argv])
    assert r.exit_code == 2, r.output
    assert "not a whole number" not in r.output
    assert "is not in the range" in r.output and "-" in r.output
