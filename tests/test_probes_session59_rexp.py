"""Review probes (session 59) of `infer run --resume --retry-failed`, the per-expert MoE adapter policy and the
hostile-newcomer fixes: each fix's test fails without it."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer.cli.main import app
from test_probes_parallel_bench_s35 import local_ray  # noqa: F401  (--data-parallel 2 in this process)


def test_a_line_lora_that_no_path_can_be_gets_its_error_record(tmp_path):
    """A line whose lora names no registered adapter is told, if the name is a folder, the --lora NAME=PATH to
    give. A name no path can be (longer than the file system takes, "~user" of no user) made that check raise
    OSError ("File name too long") or RuntimeError: a traceback that ended the whole run, no record written.
    Now such a line gets the unknown adapter's error record and the other lines run."""
    from helpers import infer_run_records
    long = "x" * 5000
    recs, printed = infer_run_records(tmp_path, [
        {"id": "long", "prompt": "hi", "max_new_tokens": 2, "lora": long},
        {"id": "user", "prompt": "hi", "max_new_tokens": 2, "lora": "~no-such-user-59/x"},
        {"id": "ok", "prompt": "hi", "max_new_tokens": 2}])
    assert "Traceback" not in printed, printed
    assert recs["long"]["error"].startswith(f"line 1: unknown LoRA adapter '{long}' (registered adapters: none; "
                                            f"give it to infer run with --lora {long}=PATH"), recs["long"]["error"]
    assert "line 2: unknown LoRA adapter '~no-such-user-59/x'" in recs["user"]["error"]
    assert recs["ok"]["error"] is None and len(recs["ok"]["token_ids"]) == 2


def test_resume_with_another_pooler_config_is_refused(tmp_path):
    """--pooler-config (pooling type, normalize) changes every embedding of `infer run --runner pooling`, but the
    resume fingerprint did not hold it: a run stopped midway and resumed with another pooling wrote records of two
    poolings into one output, exit 0. Now the resume is refused naming it; the same pooling resumes."""
    from infer.cli import batch_io
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/embeddings",
                                       "body": {"input": f"hello {c}"}}) + "\n" for c in "abc"))

    def run(*args):
        return CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--runner", "pooling",
                                        "--block-size", "4", *args])
    mean = ("--pooler-config", '{"pooling_type": "MEAN"}')
    real = batch_io.RecordWriter.write

    def write_then_stop(self, record):
        real(self, record)
        raise KeyboardInterrupt
    batch_io.RecordWriter.write = write_then_stop
    try:
        assert run(*mean).exit_code == 130
    finally:
        batch_io.RecordWriter.write = real
    first = out.read_bytes()
    res = run("--resume")
    assert res.exit_code == 2, res.output
    assert "written with other options: pooler_config {'pooling_type': 'MEAN'} -> None" in res.output, res.output
    assert out.read_bytes() == first
    assert run("--resume", *mean).exit_code == 0
    whole = tmp_path / "whole.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(whole), "-q", "--runner", "pooling",
                                   "--block-size", "4", *mean])
    assert res.exit_code == 0, res.output
    got, want = ({r["id"]: torch.tensor(r["embedding"]) for r in map(json.loads, p.read_text().splitlines())}
                 for p in (out, whole))
    assert got.keys() == want.keys() == set("abc")
    for key in want:
        torch.testing.assert_close(got[key], want[key])


def test_retry_failed_with_data_parallel_replaces_each_error_once(tmp_path, local_ray):  # noqa: F811
    """`--data-parallel 2 --resume --retry-failed`: the driver retries the error records' lines as one engine does,
    a run stopped after its first retried record loses nothing, and the output ends with one record per id, those
    of a run given the adapter from the start; a beam-search line (not run with --data-parallel) fails again and
    keeps one record."""
    from infer.cli import batch_io
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float, save_adapter
    from test_probes_session59_experts import _by_id, _batch
    adapter = save_adapter(hf_float(ensure_builtin("tiny-llama")), tmp_path / "support", seed=1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in [
        _batch("s1", model="support"), _batch("b"), _batch("s2", model="support"),
        _batch("beam", model="support", use_beam_search=True, n=2)]))

    def run(out, *args):
        return CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--output-format",
                                        "openai", "--data-parallel", "2", "--max-num-seqs", "2", *map(str, args)])
    lora = ("--lora", f"support={adapter}")
    assert run(tmp_path / "ref.jsonl", *lora).exit_code == 1  # (the beam line)
    ref, out = _by_id(tmp_path / "ref.jsonl"), tmp_path / "out.jsonl"
    assert run(out).exit_code == 1
    assert {k: v[0] for k, v in _by_id(out).items()} == {"s1": 404, "b": 200, "s2": 404, "beam": 404}
    real = batch_io.RecordWriter.write

    def write_then_stop(self, record):
        real(self, record)
        raise KeyboardInterrupt
    batch_io.RecordWriter.write = write_then_stop
    try:
        assert run(out, "--resume", "--retry-failed", *lora).exit_code == 130
    finally:
        batch_io.RecordWriter.write = real
    assert len(out.read_text().splitlines()) == 5  # (a retried line's error and its new record)
    res = run(out, "--resume", "--retry-failed", *lora)
    assert res.exit_code == 1 and "replaced 1 error record(s)" in res.output, res.output
    assert _by_id(out) == ref and ref["beam"][0] == 400 and ref["s1"][0] == ref["s2"][0] == 200
