"""Probes of the sixty-sixth session: inputs that were silently ignored, lost records or misled (the CLI, the server,
the tool parsers)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.batch_io import RecordWriter
from infer.cli.main import app
from infer.errors import OutputError


# ------------------------------------------------------------------------------------ replica options, one engine
@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("option", [["--max-replica-restarts", "5"], ["--replica-placement-timeout", "30"]])
def test_replica_options_without_data_parallel_are_refused(command, option, tmp_path, monkeypatch):
    """--max-replica-restarts and --replica-placement-timeout tune --data-parallel replicas; with one engine they were
    silently ignored (a crash was not restarted as the user believed): refused before the model loads, naming the
    option and --data-parallel. (Their default, given to replicas, is tested in test_cli_options.)"""
    from helpers import stub_calls  # (the command, not refused, stops where it would load the model and serve)
    stub_calls(monkeypatch, "infer.cli.run._run_in_process", "infer.cli.serve._serve")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    where = [str(prompts), "-o", str(tmp_path / "o.jsonl")] if command == "run" else ["--port", "0"]
    res = CliRunner().invoke(app, [command, "tiny-llama", *where, *option], env={"COLUMNS": "250"})
    assert res.exit_code == 2, (res.output, res.exception)
    text = " ".join(res.output.split())
    assert f"{option[0]} only apply to --data-parallel replicas" in text and "add --data-parallel N" in text, text
    assert not (tmp_path / "o.jsonl").exists()


# ------------------------------------------------------------------------------ the output deleted while written
def _records(path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("gone", ["file", "folder"])
def test_an_output_deleted_mid_run_is_made_again_with_every_record(tmp_path, gone, capsys):
    """`rm out.jsonl` (or `rm -r` of its folder) while a run wrote it: the records went to the deleted file, lost
    without a word. The next record makes the file again with the earlier ones, says so, and calls `recreated` (the
    run's resume fingerprint is written again)."""
    path, calls = tmp_path / "out" / "o.jsonl", []
    writer = RecordWriter(path, append=False, recreated=lambda: calls.append(1))
    writer.write({"id": "a", "text": "x"})
    writer.write({"id": "b", "text": "y"})
    if gone == "file":
        path.unlink()
    else:
        import shutil
        shutil.rmtree(path.parent)
    writer.write({"id": "c", "text": "z"})
    writer.write({"id": "d", "text": "w"})
    writer.close()
    assert _records(path) == ["a", "b", "c", "d"] and calls == [1] and writer.count == 4
    assert f"{path} was deleted during the run; it is made again with the 2 records" in capsys.readouterr().err


def test_an_output_deleted_after_its_last_record_is_made_again_before_the_run_ends(tmp_path):
    """Deleted between the last record and the run's end (when it marks the output complete): `finish` gets it back
    too."""
    path = tmp_path / "o.jsonl"
    writer = RecordWriter(path, append=False)
    writer.write({"id": "a", "text": "x"})
    path.unlink()
    writer.finish()
    writer.close()
    assert _records(path) == ["a"]


def test_an_output_replaced_mid_run_is_kept_and_the_records_saved_beside(tmp_path):
    """Another file put in the output's place: it is left as it is, and this run's records are saved beside it, the
    error naming where (not written into the file nobody can see any more)."""
    path = tmp_path / "o.jsonl"
    writer = RecordWriter(path, append=False)
    writer.write({"id": "a", "text": "x"})
    path.unlink()
    path.write_text("someone else's\n")
    with pytest.raises(OutputError) as e:
        writer.write({"id": "b", "text": "y"})
    writer.close()
    saved = tmp_path / next(p.name for p in tmp_path.iterdir() if ".saved-" in p.name)
    assert path.read_text() == "someone else's\n" and _records(saved) == ["a"]
    assert "was replaced by another file during the run, after 1 records" in e.value.message, e.value
    assert str(saved) in e.value.message and f"move {saved} to {path}" in e.value.hint, e.value


def test_an_output_whose_folder_cannot_be_made_again_saves_the_records_elsewhere(tmp_path, monkeypatch):
    """The output's folder removed and a file put where it was: the file cannot be made again; the records written go
    to the temporary folder, and the error says so."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = tmp_path / "out" / "o.jsonl"
    writer = RecordWriter(path, append=True)
    writer.write({"id": "a", "text": "x"})
    path.unlink()
    path.parent.rmdir()
    path.parent.write_text("")
    with pytest.raises(OutputError) as e:
        writer.write({"id": "b", "text": "y"})
    writer.close()
    saved = next((tmp_path / "tmp").iterdir())
    assert _records(saved) == ["a"], e.value
    assert "was deleted during the run after 1 records and cannot be made again" in e.value.message, e.value
    assert str(saved) in e.value.message and "--resume" in e.value.hint, e.value


def test_infer_run_whose_output_folder_is_removed_at_its_end_completes_and_resumes(tmp_path, monkeypatch):
    """End to end: the output's folder removed as the last record is written; the run's end makes the file again
    with every record, its fingerprint says complete, and --resume finds nothing left to run."""
    import infer.cli.batch_io as batch_io
    import shutil
    out = tmp_path / "out" / "o.jsonl"
    encode, seen = batch_io.encode_record, []

    def remove_at_last(record):  # (its record goes to the deleted file: the run's end gets it back)
        if len(seen) == 2:
            shutil.rmtree(out.parent)
        seen.append(record)
        return encode(record)
    monkeypatch.setattr(batch_io, "encode_record", remove_at_last)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{k}", "prompt": "hi " * k, "max_new_tokens": 2}) + "\n"
                           for k in range(1, 4)))
    args = ["run", "tiny-llama", str(src), "-o", str(out), "-q"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert sorted(_records(out)) == ["r1", "r2", "r3"] and "was deleted during the run" in res.output, res.output
    assert json.loads(out.with_name("o.jsonl.resume.json").read_text())["complete"] is True
    res = CliRunner().invoke(app, [*args[:-1], "--resume"])
    assert res.exit_code == 0 and "nothing to resume" in res.output, res.output


# ------------------------------------------------------------------------------- tool calls without arguments
@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31", "kimi_k2"])
def test_a_sectioned_call_without_arguments_is_a_call_with_empty_arguments(parser):
    """A function without parameters called with no arguments at all (DeepSeek's and Kimi's call tokens around
    nothing): the whole reply came back as text, the special tokens and all, the call lost (vLLM passes "" on,
    which a client's json.loads refuses). It is the call, its arguments "{}", whole and streamed a character at a
    time."""
    pytest.importorskip("xgrammar")
    import test_probes_session65_tools as s65
    from infer.serve.tools import split
    call = {"deepseek_v3": s65.v3("get_time", ""), "deepseek_v31": s65.v31("get_time", ""),
            "kimi_k2": s65.kimi("functions.get_time:0", " ")}[parser]
    begin, end = (s65.KIMI, s65.KIMI_END) if parser == "kimi_k2" else (s65.CALLS_BEGIN, s65.CALLS_END)
    reply, req = begin + call + end, s65._req(parser)
    content, calls = split(req, reply)
    assert not content and [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []] == [
        ("get_time", "{}")], (content, calls)
    pieces, whole = s65._streamed(req, reply, range(len(reply) + 1))
    assert [c["function"] for c in s65._joined(pieces)] == [c["function"] for c in whole]


# ---------------------------------------------------------------------------------- DeepSeek's odd rotary width
def test_an_odd_rotary_width_is_refused_naming_the_field(tmp_path):
    """A DeepSeek config.json whose qk_rope_head_dim is odd (transformers' config takes it) was refused as "a yarn
    rope over 16 of 15 head dimensions (partial_rotary_factor None)", hinting to remove a partial_rotary_factor it
    does not have: now the field and why. (A Llama's odd head_dim transformers refuses itself, naming it.)"""
    import shutil
    from infer.models.tiny import ensure_builtin
    folder = tmp_path / "m"
    shutil.copytree(ensure_builtin("tiny-deepseek-v3"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "qk_rope_head_dim": 15}))
    res = CliRunner().invoke(app, ["warmup", str(folder), "--estimate"], env={"COLUMNS": "250"})
    text = " ".join(res.output.split())
    assert res.exit_code == 2, text
    assert "config.json's qk_rope_head_dim 15 is odd: a rotary turns pairs of dimensions" in text, text
    assert "partial_rotary_factor" not in text, text
