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


def test_strict_lists_the_engines_checks_with_the_lines_in_one_round(tmp_path, monkeypatch):
    """--strict read the lines before the model loaded and stopped at what reading finds; the engine's checks (a
    token id outside the vocabulary, a prompt that fills the context, min_tokens banning every allowed token, an
    adapter no engine has) came in a second round, after the fix and a model load. Now they are one round, and the
    model still never loads."""
    from infer.engine import llm_engine

    def no_load(*a, **k):
        raise AssertionError("the model must not load when --strict finds bad lines")
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([
        '{"prompt": "fine"}',
        '{"prompt": 5}',  # line 2: what reading finds
        '{"prompt_token_ids": [1, 99999]}',  # line 3: outside the vocabulary
        json.dumps({"prompt_token_ids": [1] * 64}),  # line 4: fills --max-model-len 64
        '{"prompt": "hi", "min_tokens": 1, "allowed_token_ids": [2]}',  # line 5: 2 is EOS
        '{"prompt": "hi", "lora": "nope"}',  # line 6: no such adapter
    ]) + "\n")
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "out.jsonl"), "--strict",
                              "--max-model-len", "64", "-q"])
    assert res.exit_code == 2, res.output
    assert "5 of 6 input lines are invalid (--strict)" in res.output, res.output
    for line, says in ((2, "line 2:"), (3, "vocabulary"), (4, "leaves no room"), (5, "min_tokens"),
                       (6, "unknown LoRA adapter")):
        assert f"line {line}:" in res.output and says in res.output, (line, res.output)
    assert not (tmp_path / "out.jsonl").exists()


def test_strict_run_of_good_lines_generates_as_without_it(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt_token_ids": [5, 6, 7]}\n')
    for flags in ((), ("--strict",)):
        out = tmp_path / f"out{len(flags)}.jsonl"
        assert _run(inp, "-o", out, *flags).exit_code == 0
    assert _records(tmp_path / "out0.jsonl") == _records(tmp_path / "out1.jsonl")
