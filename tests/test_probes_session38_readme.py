"""Session 38, README read as a newcomer: the commands' --help says what the README and the code do."""

from __future__ import annotations

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
