"""`infer run --resume` against the oracle that matters: an uninterrupted run. A run cut at any record (with a torn
last line, or a record written twice) and resumed ends with exactly the uninterrupted run's records, the records
written before the cut kept as they were; options that change outputs cannot change on resume; ids and the
--max-new-tokens default reach the records."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()
N = 8


def _run(*args):
    return runner.invoke(app, ["run", "tiny-llama", *map(str, args), "-q"])


def _lines(path):
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return data.split(b"\n")[:-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An input of N greedy requests of different lengths, and its uninterrupted output."""
    tmp = tmp_path_factory.mktemp("resume")
    inp = tmp / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"request {i} about the weather", "temperature": 0,
                                       "max_new_tokens": 3 + i, "ignore_eos": True}) + "\n" for i in range(N)))
    out = tmp / "full.jsonl"
    res = _run(inp, "-o", out)
    assert res.exit_code == 0, res.output
    return inp, out


@pytest.mark.parametrize("cut, damage", [(0, b""), (3, b'{"id": "r3", "text": "tor'), (5, b"dup"), (N - 1, b"")])
def test_resumed_run_equals_the_uninterrupted_run(reference, tmp_path, cut, damage):
    inp, full = reference
    lines = _lines(full)
    kept = lines[:cut]
    if damage == b"dup":  # a record written twice (a copy of the first one): kept once
        damage = lines[0] + b"\n"
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(l + b"\n" for l in kept) + damage)
    (tmp_path / "out.jsonl.resume.json").write_bytes((full.parent / "full.jsonl.resume.json").read_bytes())
    res = _run(inp, "-o", out, "--resume")
    assert res.exit_code == 0, res.output
    got = _lines(out)
    assert got[:cut] == kept  # the partial output is kept as it was, in its order
    assert len(got) == N
    by_id = {json.loads(l)["id"]: json.loads(l) for l in got}
    assert by_id == {json.loads(l)["id"]: json.loads(l) for l in lines}


def test_resume_refuses_another_max_new_tokens_default(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hello", "ignore_eos": true}\n{"id": "b", "prompt": "hi there"}\n')
    out = tmp_path / "out.jsonl"
    assert _run(inp, "-o", out, "--max-new-tokens", "3").exit_code == 0
    assert json.loads(_lines(out)[0])["usage"]["completion_tokens"] == 3  # the default reached the line
    out.write_bytes(_lines(out)[0] + b"\n")
    res = _run(inp, "-o", out, "--resume", "--max-new-tokens", "5")
    assert res.exit_code == 2 and "max_new_tokens 3 -> 5" in res.output


def test_ids_are_kept_as_given_even_when_falsy(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x", "max_new_tokens": 2}\n{"id": 0, "prompt": "y", "max_new_tokens": 2}\n'
                   '{"id": "", "prompt": "z", "max_new_tokens": 2}\n{"id": null, "prompt": "w", "max_new_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    assert _run(inp, "-o", out).exit_code == 0
    assert sorted(json.loads(l)["id"] for l in _lines(out)) == sorted(["1", "0", "", "4"])
