"""Session 38, README read as a newcomer: the commands' --help says what the README and the code do."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


def test_warmup_help_says_the_prefill_is_capped_at_concurrency_times_length():
    """warmup's worst-case prefill is the token budget, or CONCURRENCY x MAX_LENGTH tokens when that is less
    (engine.profile.worst_case_batches, and the README); its --help said it always ran the full token budget."""
    res = runner.invoke(app, ["warmup", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "full token budget" not in text
    assert "CONCURRENCY x MAX_LENGTH tokens when that is less" in text


def test_resume_refusal_names_every_difference_at_once(tmp_path):
    """The README: another input or changed options are refused "with the differences named". With both a changed
    input and a changed option, only the input was named; fixing it got a second refusal for the option."""
    first = tmp_path / "a.jsonl"
    first.write_text('{"id": "a", "prompt": "hello", "max_new_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(first), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    other = tmp_path / "b.jsonl"
    other.write_text('{"id": "b", "prompt": "there", "max_new_tokens": 2}\n')
    res = runner.invoke(app, ["run", "tiny-llama", str(other), "-o", str(out), "--resume", "--max-new-tokens", "9"])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "written from another input" in text
    assert "max_new_tokens 256 -> 9" in text


def test_serve_help_names_every_route():
    """`infer serve --help` listed five routes; the server also has vLLM's tokenizer routes and, with
    --allow-runtime-lora, the adapter routes (the README lists them all)."""
    res = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for route in ("/tokenize", "/detokenize", "/version", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert route in text, route


@pytest.mark.parametrize("command", ["run", "serve", "warmup", "bench"])
def test_lora_option_shows_name_equals_path_in_help(command):
    """--lora showed typer's `<list[str]>` as its placeholder; it reads NAME=PATH, as its help says."""
    res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert res.exit_code == 0 and "--lora" in res.output, res.output
    assert "list[str]" not in res.output and "--lora NAME=PATH" in " ".join(res.output.split()), res.output
