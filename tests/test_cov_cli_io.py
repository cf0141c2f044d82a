"""`infer run`'s records and resume checks as functions: logprob records name their tokens (the sampled and every
top one), a resume accepts an input that only grew and refuses one that changed or other options (naming them),
an unreadable fingerprint does not block a resume, and a plain re-run of an unfinished output is refused with its
record count."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from infer.cli.batch_io import output_record
from infer.cli.resume import check_not_unfinished, check_resume, fingerprint_path, mark_complete, write_fingerprint
from infer.engine.setup import load_tokenizer
from infer.errors import ConfigError
from infer.models.tiny import ensure_builtin

OPTIONS = {"model": "tiny-llama", "dtype": "auto", "seed": 0, "max_model_len": None, "max_new_tokens": 8,
           "loras": {}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_builtin("tiny-llama"))


def test_logprob_records_name_every_token(tok):
    records = [{"token_id": 40, "logprob": -0.5, "top_logprobs": [{"token_id": 41, "logprob": -0.2},
                                                                  {"token_id": 40, "logprob": -0.5}]},
               {"token_id": 50, "logprob": -1.5, "top_logprobs": []}]
    out = SimpleNamespace(text="x", token_ids=[40, 50], finish_reason="length", stop_reason=None,
                          usage={"prompt_tokens": 3, "completion_tokens": 2}, error=None, logprobs=records,
                          prompt_logprobs=None)
    rec = output_record("r", out, tok)
    name = tok.convert_ids_to_tokens
    assert rec["logprobs"] == [
        {"token_id": 40, "logprob": -0.5, "token": name(40),
         "top_logprobs": [{"token_id": 41, "logprob": -0.2, "token": name(41)},
                          {"token_id": 40, "logprob": -0.5, "token": name(40)}]},
        {"token_id": 50, "logprob": -1.5, "token": name(50), "top_logprobs": []}]
    assert name(41) != name(40)
    assert records[0]["top_logprobs"][0] == {"token_id": 41, "logprob": -0.2}  # the engine's records untouched
    plain = output_record("r", SimpleNamespace(**{**vars(out), "logprobs": None}), tok)
    assert "logprobs" not in plain and plain["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}


def _started(tmp_path, lines: list[str]):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(line + "\n" for line in lines))
    out.write_text('{"id": "a"}\n')
    write_fingerprint(out, inp, OPTIONS)
    return inp, out


def test_resume_accepts_a_grown_input_and_refuses_a_changed_one(tmp_path):
    inp, out = _started(tmp_path, ['{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": "y"}'])
    check_resume(out, inp, OPTIONS)
    with open(inp, "a") as f:
        f.write('{"id": "c", "prompt": "z"}\n')
    check_resume(out, inp, OPTIONS)  # lines appended: the same input
    inp.write_text(inp.read_text().replace('"x"', '"X"'))  # same size, other bytes
    with pytest.raises(ConfigError, match="another input"):
        check_resume(out, inp, OPTIONS)


def test_resume_names_the_options_that_changed(tmp_path):
    inp, out = _started(tmp_path, ['{"id": "a", "prompt": "x"}'])
    with pytest.raises(ConfigError) as e:
        check_resume(out, inp, {**OPTIONS, "seed": 1, "dtype": "float32"})
    assert "dtype 'auto' -> 'float32', seed 0 -> 1" in str(e.value)
    with pytest.raises(ConfigError, match="loras {} -> {'a': '/x'}"):
        check_resume(out, inp, {**OPTIONS, "loras": {"a": "/x"}})


def test_an_unreadable_fingerprint_does_not_block_a_resume(tmp_path, capsys):
    inp, out = _started(tmp_path, ['{"id": "a", "prompt": "x"}'])
    fingerprint_path(out).write_text("{not json")
    check_resume(out, inp, {**OPTIONS, "seed": 7})
    assert "unreadable; resuming without checking" in capsys.readouterr().err
    fingerprint_path(out).write_text(json.dumps({"input": {"path": "x"}, "options": {}}))  # no bytes / sha256
    check_resume(out, inp, OPTIONS)


def test_a_plain_rerun_of_an_unfinished_output_is_refused(tmp_path):
    inp, out = _started(tmp_path, ['{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": "y"}'])
    out.write_text('{"id": "a"}\n{"id": "b"}\n')
    with pytest.raises(ConfigError, match="holds 2 records of a run that did not finish"):
        check_not_unfinished(out)
    mark_complete(out)
    assert json.loads(fingerprint_path(out).read_text())["complete"] is True
    check_not_unfinished(out)  # a finished run may be started over
    out.write_text("")
    write_fingerprint(out, inp, OPTIONS)
    check_not_unfinished(out)  # nothing written yet: nothing to lose
