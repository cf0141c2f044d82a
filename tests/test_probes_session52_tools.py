"""Probes of the fifty-second session (tools: tool calling and reasoning on `infer serve` as agent frameworks and vLLM
users set them up)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("flag, words", [
    (["--enable-reasoning"], "--reasoning-parser"),
    (["--tool-parser-plugin", "my_parser.py"], "no parser plugins"),
    (["--reasoning-parser-plugin", "my_parser.py"], "no parser plugins"),
    (["--exclude-tools-when-tool-choice-none"], "without tools"),
    (["--expand-tools-even-if-tool-choice-none"], "renders the tools"),
    (["--tool-server", "demo"], "function tools only"),
], ids=["enable-reasoning", "tool-parser-plugin", "reasoning-parser-plugin", "exclude-tools", "expand-tools",
        "tool-server"])
def test_vllms_tool_and_reasoning_options_say_what_to_do(flag, words):
    """vLLM's tool-calling and reasoning options of `vllm serve` were click's guesses: `--enable-reasoning` (which
    vLLM setups of DeepSeek-R1 and QwQ type beside --reasoning-parser) got "Possible options: --enable-lora,
    --enable-prefix-caching", `--tool-parser-plugin` "Possible options: --tool-call-parser" (a Python file is not a
    parser's name). They now say what infer does instead, as vLLM's other options do."""
    res = runner.invoke(app, ["serve", "tiny-llama", *flag])
    assert res.exit_code == 2
    assert "is vLLM's option" in res.output and words in res.output, res.output
    assert "Possible options" not in res.output


def test_the_plugin_hints_name_every_parser_infer_has():
    from infer.cli.vllm_flags import VLLM_HINTS
    from infer.serve import reasoning, tools
    for name in [*tools.PARSERS, *tools.PARSER_ALIASES]:
        assert name in VLLM_HINTS["--tool-parser-plugin"]
    for name in reasoning.PARSERS:
        assert name in VLLM_HINTS["--reasoning-parser-plugin"] and name in VLLM_HINTS["--enable-reasoning"]


def test_enable_reasoning_typed_to_infer_run_names_runs_own_reasoning_parser():
    res = runner.invoke(app, ["run", "tiny-llama", "in.jsonl", "--enable-reasoning"])
    assert res.exit_code == 2
    assert "infer run splits the reasoning" in res.output and "vllm serve" not in res.output, res.output
