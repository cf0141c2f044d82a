"""Session 38, `infer run` and the Python API: probes of the JSONL contract."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from infer.cli.main import app
from infer.models.llama import LlamaForCausalLM

runner = CliRunner()


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _strict(line: str):
    """json.loads as JSON defines it: NaN and Infinity are not numbers there (JavaScript, Go, Rust refuse them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_records_of_a_model_that_overflowed_are_strict_json(tmp_path, monkeypatch):
    """A model whose logits overflow (float16 activations past 65,504) ends the request with an error, but its
    record carried the prompt logprobs computed before: NaN, written as is by json.dumps, which is not JSON."""
    real = LlamaForCausalLM.compute_logits

    def overflowing(self, hidden):
        out = real(self, hidden).clone()
        out[:, 7] = math.inf
        return out
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", overflowing)
    out = tmp_path / "out.jsonl"
    lines = [{"id": "a", "prompt": "hello there friend", "max_new_tokens": 3, "prompt_logprobs": 1, "logprobs": 1}]
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    [line] = out.read_text(encoding="utf-8").splitlines()
    rec = _strict(line)
    assert rec["finish_reason"] == "error" and "not finite" in rec["error"]
    assert len(rec["prompt_logprobs"]) > 1 and rec["prompt_logprobs"][0] is None
    assert all(r["logprob"] is None and r["token_id"] >= 0 for r in rec["prompt_logprobs"][1:])


def test_a_number_json_cannot_hold_is_null_and_the_rest_is_written_as_before():
    from infer.cli.batch_io import encode_record
    rec = {"id": "\ud800", "text": "é", "logprobs": [{"token_id": 5, "logprob": -1.5}]}
    assert json.loads(encode_record(rec)) == rec  # a lone surrogate \\u-escaped, reading back the same
    rec = {"id": "a", "text": "é", "logprobs": [{"token_id": 5, "logprob": -math.inf, "top": [math.nan, -0.5]}]}
    line = encode_record(rec).decode("utf-8")
    assert "é" in line and _strict(line)["logprobs"] == [{"token_id": 5, "logprob": None, "top": [None, -0.5]}]


def test_a_prompt_with_prefix_tokens_that_fills_the_context_names_both(tmp_path):
    """A 60-token prompt with 4 forced prefix tokens under a context of 64 was refused as "the prompt has 64
    tokens": the user counts 60 and cannot tell what is wrong."""
    lines = [{"id": "p", "prompt_token_ids": [5] * 60, "prefix_token_ids": [6] * 4, "max_new_tokens": 2},
             {"id": "q", "prompt_token_ids": [5] * 64, "max_new_tokens": 2}]
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q",
                              "--max-model-len", "64"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "the prompt (60 tokens) and prefix_token_ids (4) make 64 tokens, which leaves no room" in recs["p"]["error"]
    assert "the prompt has 64 tokens, which leaves no room" in recs["q"]["error"]


def test_resume_through_a_symlinked_output_completes_the_file_it_points_to(tmp_path):
    """-o LINK where LINK points to the output on another disk: --resume cut a torn last line by replacing LINK with
    a new file, so the records went there and the file LINK pointed to stayed torn and incomplete."""
    lines = [{"id": f"r{i}", "prompt": f"count to {i}", "max_new_tokens": 3} for i in range(6)]
    inp = _write(tmp_path / "in.jsonl", lines)
    data = tmp_path / "disk" / "out.jsonl"
    data.parent.mkdir()
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(data), "-q"])
    assert res.exit_code == 0, res.output
    full = data.read_bytes()
    data.write_bytes(full[:full.index(b"\n", len(full) // 2) + 20])  # whole records, then a torn one
    link = tmp_path / "out.jsonl"
    link.symlink_to(data)
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(link), "-q", "--resume"])
    assert res.exit_code == 0, res.output
    assert "is missing" not in res.output  # the run's resume record is found through the link
    assert link.is_symlink() and link.resolve() == data.resolve()
    recs = [json.loads(line) for line in data.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == [f"r{i}" for i in range(6)]
    data.write_bytes(full[:full.index(b"\n") + 1])
    fingerprint = json.loads((data.parent / "out.jsonl.resume.json").read_text())
    (data.parent / "out.jsonl.resume.json").write_text(json.dumps({**fingerprint, "complete": False}))
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(link), "-q"])  # a plain re-run, by the link
    assert res.exit_code == 2 and "did not finish" in res.output, res.output  # refused: the file's run is unfinished


def test_resume_that_cuts_a_torn_line_keeps_the_outputs_mode(tmp_path):
    """The records were rewritten into a new file with the umask's mode: an output kept private (0600) became
    readable by everyone after a resume that removed a torn line."""
    lines = [{"id": f"r{i}", "prompt": f"count to {i}", "max_new_tokens": 3} for i in range(4)]
    inp, out = _write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"]).exit_code == 0
    full = out.read_bytes()
    out.write_bytes(full[:full.index(b"\n") + 20])
    out.chmod(0o600)
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume"])
    assert res.exit_code == 0 and "removed 1" in res.output, res.output
    assert out.stat().st_mode & 0o777 == 0o600
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == [f"r{i}" for i in range(4)]


def test_a_batch_lines_model_that_is_not_a_string_is_named(tmp_path):
    """body.model as a list or an object was "cannot read this request (TypeError: unhashable type: 'list')"."""
    lines = [{"custom_id": "l", "url": "/v1/completions", "body": {"prompt": "hi", "model": ["tiny-llama"]}},
             {"custom_id": "o", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "model": {"name": "x"}}}]
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    errors = {r["id"]: r["error"] for r in map(json.loads, out.read_text().splitlines())}
    assert errors == {"l": "line 1: body.model must be a string, got list",
                      "o": "line 2: body.model must be a string, got dict"}


def test_vllm_fields_that_change_the_reply_are_refused_not_dropped(tmp_path):
    """A batch line (and a server request, which shares the list) with vLLM's logits_processors or prompt_embeds got
    a reply that ignored them; SamplingParams refuses the first. (spaces_between_special_tokens=false is taken now:
    test_probes_session39_detok.)"""
    def line(cid, **extra):
        return {"custom_id": cid, "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2, **extra}}
    lines = [line("procs", logits_processors=["my.module:Processor"]), line("embeds", prompt_embeds="AAAA"),
             line("defaults", spaces_between_special_tokens=True, logits_processors=None, prompt_embeds=None)]
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "body.logits_processors" in recs["procs"]["error"] and "body.prompt_embeds" in recs["embeds"]["error"]
    assert recs["defaults"]["error"] is None and recs["defaults"]["finish_reason"] == "length"


def test_a_batch_lines_model_naming_both_the_base_and_an_adapter_is_refused(tmp_path):
    """`infer run tiny-llama --lora tiny-llama=ADAPTER`: a plain line's "lora": "tiny-llama" ran the adapter, a batch
    line's body.model "tiny-llama" silently ran the base (the server refuses such an adapter name at start)."""
    from lora_helpers import hf_float, save_adapter
    from infer.models.tiny import ensure_builtin
    adapter = save_adapter(hf_float(ensure_builtin("tiny-llama")), tmp_path / "ad", 1, r=4, lora_alpha=8)
    lines = [{"custom_id": "both", "url": "/v1/completions", "body": {"prompt": "Hi", "model": "tiny-llama"}},
             {"custom_id": "base", "url": "/v1/completions", "body": {"prompt": "Hi"}},
             {"id": "plain", "prompt": "Hi", "lora": "tiny-llama"}]
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q",
                              "--lora", f"tiny-llama={adapter}", "--max-new-tokens", "3"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "names both the base model and the adapter --lora tiny-llama=" in recs["both"]["error"]
    assert recs["base"]["error"] is None and recs["plain"]["error"] is None


def test_a_failed_line_without_its_own_id_never_takes_a_later_lines_id(tmp_path):
    """A line that failed and had no usable id of its own (a JSON array, "id": 1.5, no id and a bad field) took its
    line number as id, so a valid later line with that id was refused as its duplicate and never ran."""
    lines = [[1, 2], {"id": "1", "prompt": "a", "max_new_tokens": 2},
             {"id": 1.5, "prompt": "b"}, {"id": 3, "prompt": "c", "max_new_tokens": 2},
             {"prompt": "d", "temperature": "hot"}, {"id": "5", "prompt": "e", "max_new_tokens": 2},
             {"prompt": "f", "max_new_tokens": 2}, {"id": "7", "prompt": "g", "max_new_tokens": 2}]
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert all(recs[i]["error"] is None for i in ("1", "3", "5", "7"))
    assert recs["1~2"]["error"] == "line 1: expected a JSON object, got list"
    assert recs["3~2"]["error"].startswith("line 3: field 'id' must be")
    assert recs["5~2"]["error"].startswith("line 5: field 'temperature'")
    # a valid line without an id has its line number as id (the contract): a later "7" is its duplicate
    assert recs["7#line8"]["error"].startswith("line 8: duplicate id '7': line 7 already has it")
    assert len(recs) == 8
