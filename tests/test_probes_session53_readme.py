"""A newcomer's pass over README's account of session 53's additions (AWQ, Phi-3, prompt tokens details,
max_logprobs, vLLM API parity), run for real: what the commands and their help texts say."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infer.cli.main import app


def _help(*cmd: str) -> str:
    res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "300"}, terminal_width=300)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_convert_help_names_awq_models():
    """convert reads AWQ checkpoints (--to gptq rewrites them): its MODEL help named only float and GPTQ."""
    assert "float, GPTQ or AWQ" in _help("convert")
