"""Fiftieth session: a resumed run must not mix records made with and without speculative decoding."""

import json

from typer.testing import CliRunner

from infer.cli.main import app


def test_resume_refuses_another_speculative_config(tmp_path):
    """Speculation draws a seeded sampled request's random numbers otherwise (rejection sampling), so the records of
    a run resumed with another --speculative-config would mix two samplers: refused naming it, as another
    --kv-cache-dtype is; the same config (a draft folder given by another path) is taken."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "hi there"}\n')
    out = tmp_path / "out.jsonl"
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    run = CliRunner()
    res = run.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--max-new-tokens", "3",
                           "--speculative-config", spec])
    assert res.exit_code == 0, res.output
    out.write_bytes(out.read_bytes().split(b"\n")[0] + b"\n")
    res = run.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume", "--max-new-tokens", "3"])
    assert res.exit_code == 2 and "speculative_config" in res.output, res.output
    res = run.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume", "--max-new-tokens", "3",
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert res.exit_code == 2 and "speculative_config" in res.output, res.output
    res = run.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume", "--max-new-tokens", "3",
                           "--speculative-config", spec])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]


def test_a_draft_folder_is_fingerprinted_by_its_absolute_path(tmp_path, monkeypatch):
    from infer.cli.run import _speculation
    (tmp_path / "draft").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = {"method": "draft_model", "model": "draft", "num_speculative_tokens": 3}
    assert _speculation(cfg) == dict(cfg, model=str((tmp_path / "draft").resolve()))
    assert _speculation(dict(cfg, model="tiny-llama")) == dict(cfg, model="tiny-llama")  # a built-in name stays
