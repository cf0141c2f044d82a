"""Session 55 probes (second newcomer pass): what infer's commands print names the model as the user typed it, says
what is on, and tells the truth about what to do next."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infer.cli.main import app


def test_warmup_names_a_built_in_model_as_typed():
    """`infer warmup tiny-llama` titled its table and filled the --json `model` field with the cache folder
    (`/.../tiny-llama-v2`, which reads as Llama 2), where `infer run tiny-llama` names `tiny-llama`."""
    args = ["warmup", "tiny-llama", "--max-length", "64", "--concurrency", "2", "--estimate"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["model"] == "tiny-llama"
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "infer warmup: tiny-llama  (estimate)" in result.output and "-v2" not in result.output
