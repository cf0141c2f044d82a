"""Probes of the thirty-fifth session: `infer run --force-resume` onto the output of another input, whose error
records (ids this input does not have) failed the resumed run, and whose other records were kept without a word."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(*args):
    return runner.invoke(app, ["run", "tiny-llama", *map(str, args), "--max-new-tokens", "3", "-q"])


def test_force_resume_onto_another_inputs_output_counts_only_this_inputs_records(tmp_path):
    old, new, out = tmp_path / "old.jsonl", tmp_path / "new.jsonl", tmp_path / "out.jsonl"
    old.write_text('{"id": "bad", "prompt": 5}\n{"id": "kept", "prompt": "hello"}\n')
    assert _run(old, "-o", out).exit_code == 1  # "bad" has an error record
    new.write_text('{"id": "kept", "prompt": "hello"}\n{"id": "fresh", "prompt": "world"}\n')
    assert _run(new, "-o", out, "--resume").exit_code == 2  # another input: refused without --force-resume
    res = _run(new, "-o", out, "--force-resume")
    assert res.exit_code == 0, res.output  # the old input's error record is not this input's failure
    assert "holds 1 record(s) whose ids are not in" in res.output and "error record(s)" not in res.output
    assert sorted(r["id"] for r in _records(out)) == ["bad", "fresh", "kept"]  # nothing lost, nothing repeated
    # an error record of an id this input has still fails the resumed run
    new.write_text('{"id": "bad", "prompt": 5}\n{"id": "fresh", "prompt": "world"}\n')
    res = _run(new, "-o", out, "--force-resume")
    assert res.exit_code == 1 and "holds 1 error record(s) from before this resume" in res.output, res.output
    assert "holds 1 record(s) whose ids are not in" in res.output  # "kept"
    assert sorted(r["id"] for r in _records(out)) == ["bad", "fresh", "kept"]
