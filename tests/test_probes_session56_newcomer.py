"""Session 56 probes: a newcomer follows README.md top to bottom on the built-in models and types the obvious
mistakes (a misspelt prompts file, Ctrl-C while the model loads); each error must say what to do."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli import run as run_module
from infer.cli.main import app


def _no_model(monkeypatch):
    monkeypatch.setattr(run_module, "_start_engine", lambda *a, **k: pytest.fail("the model was loaded"))


def _prompts(folder):
    folder.mkdir(exist_ok=True)
    path = folder / "prompts.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 2}) + "\n")
    return path


def test_a_misspelt_input_file_is_told_the_folders_closest_file(tmp_path, monkeypatch):
    """`infer run tiny-llama examples/prompt.jsonl` (the README's `examples/prompts.jsonl` one letter short) said
    only "give a JSONL file with one request per line", where a misspelt MODEL path is told its folder's closest
    entry; a folder that is not there is named as such."""
    _no_model(monkeypatch)
    monkeypatch.chdir(tmp_path)
    _prompts(tmp_path / "examples")
    res = CliRunner().invoke(app, ["run", "tiny-llama", "examples/prompt.jsonl", "-o", "out.jsonl", "-q"])
    assert res.exit_code == 2, res.output
    assert "input file examples/prompt.jsonl does not exist" in res.output
    assert "did you mean 'examples/prompts.jsonl'?" in res.output
    res = CliRunner().invoke(app, ["run", "tiny-llama", "exmaples/prompts.jsonl", "-o", "out.jsonl", "-q"])
    assert res.exit_code == 2 and "the folder 'exmaples' does not exist" in res.output, res.output
    res = CliRunner().invoke(app, ["run", "tiny-llama", "zzz.jsonl", "-o", "out.jsonl", "-q"])
    assert res.exit_code == 2 and "give a JSONL file with one request per line" in res.output, res.output


def test_a_misspelt_bench_dataset_file_is_told_the_folders_closest_file(tmp_path, monkeypatch):
    """`infer bench M --dataset jsonl:examples/repat.jsonl` said only "pass an existing file: jsonl:PATH"."""
    from infer.cli.bench import check_dataset
    from infer.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "repeat.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        check_dataset("jsonl:examples/repat.jsonl")
    assert "did you mean 'examples/repeat.jsonl'?" in e.value.hint and "jsonl:PATH" in e.value.hint
