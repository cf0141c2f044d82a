"""Probes of the eighteenth session: each test fails without the fix it names."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

import infer
from infer import errors


def test_every_error_class_imports_from_infer():
    """`from infer import RequestError` works, as `from vllm import ...` users expect, and gives the class infer raises
    (not a copy); `import infer` still loads no torch."""
    classes = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.InferError)}
    assert {"InferError", "RequestError", "ConfigError", "LoRAError", "ClosedError"} <= classes
    for name in classes:
        assert getattr(infer, name) is getattr(errors, name), name
        assert name in infer.__all__, name
    with pytest.raises(AttributeError, match="NotAnError"):
        infer.NotAnError  # noqa: B018
    code = "import sys, infer; infer.RequestError; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_debug_after_the_command_is_the_global_debug(tmp_path, monkeypatch):
    """`infer run M in.jsonl --debug` (the flag after the command, where users put it) shows the traceback as
    `infer --debug run ...` does, instead of "No such option"; without it the error stays one line and exit 2."""
    import logging

    from typer.testing import CliRunner

    from infer.cli import main
    from infer.cli.main import app
    monkeypatch.setitem(main._state, "debug", False)
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)
    missing = str(tmp_path / "missing.jsonl")
    plain = CliRunner().invoke(app, ["run", "tiny-llama", missing])
    assert plain.exit_code == 2 and "does not exist" in plain.output and plain.exception is not None
    assert isinstance(plain.exception, SystemExit)
    for args in (["run", "tiny-llama", missing, "--debug"], ["--debug", "run", "tiny-llama", missing]):
        res = CliRunner().invoke(app, args)
        assert isinstance(res.exception, errors.ConfigError), (args, res.output)  # raised: the traceback shows
    assert "--debug" not in CliRunner().invoke(app, ["run", "--help"]).output  # an option of infer, not of run


def test_a_plain_line_with_openai_max_tokens_says_its_name_here_and_the_summary_shows_the_first_error(tmp_path):
    """A plain JSONL line with OpenAI's `max_tokens` is refused (this format's field is max_new_tokens) with a hint
    that says so, and the run's summary on stderr shows the first error record, not only "1 failed"."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "hi", "max_new_tokens": 2}\n{"id": "b", "prompt": "hi", "max_tokens": 2}\n'
                   '{"id": "c", "prompt": "hi", "max_completion_tokens": 2, "tempreature": 1}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out)])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["a"]["error"] is None and len(recs["a"]["token_ids"]) == 2
    assert "unknown field(s) ['max_tokens']" in recs["b"]["error"]
    assert "this format calls max_tokens 'max_new_tokens'" in recs["b"]["error"]
    assert "this format calls max_completion_tokens 'max_new_tokens'" in recs["c"]["error"]
    assert "'tempreature'" in recs["c"]["error"]
    assert "1 ok, 2 failed" in res.stderr
    assert "first error (id b): line 2: unknown field(s) ['max_tokens']" in res.stderr
    assert str(out) in res.stderr.splitlines()[-1]
