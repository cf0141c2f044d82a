"""Fixes from the seventeenth session's probes, each with the input that showed the bug."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin


def _lines(*objs) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def test_run_records_carry_stop_reason(tmp_path):
    """A record said finish_reason "stop" but not what stopped it (the server and the Python API say, as vLLM's
    stop_reason: the stop string or token id, None for EOS)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # the first two tokens of a greedy reply, then the same request stopped on its second token's text and id
    inp.write_bytes(_lines({"id": "probe", "prompt": "hello", "max_new_tokens": 2, "ignore_eos": True}))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    probe = json.loads(out.read_text())
    assert probe["finish_reason"] == "length" and probe["stop_reason"] is None
    second = probe["token_ids"][1]
    inp.write_bytes(_lines({"id": "tok", "prompt": "hello", "max_new_tokens": 8, "stop_token_ids": [second],
                            "ignore_eos": True},
                           {"id": "bad", "prompt": "hello", "max_new_tokens": -1}))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--quiet"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["tok"]["finish_reason"] == "stop" and recs["tok"]["stop_reason"] == second
    assert recs["tok"]["token_ids"][-1] == second
    assert recs["bad"]["finish_reason"] == "error" and recs["bad"]["stop_reason"] is None


def test_sigterm_stops_between_records_says_the_count_and_resume_completes(tmp_path):
    """SIGTERM (a scheduler stopping the job) ended `infer run` without a word: no count of the records on disk and
    no hint to resume. It now stops as Ctrl-C does (exit 143), and --resume completes the rest without duplicates."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines(*({"id": f"r{i}", "prompt": "hello", "max_new_tokens": 300, "ignore_eos": True}
                             for i in range(30))))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "infer.cli", "run", "tiny-llama", str(inp), "-o", str(out), "--max-num-seqs", "1"]

    def records() -> int:
        return out.read_bytes().count(b"\n") if out.exists() else 0

    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env={**os.environ},
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while records() < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 143, err[-2000:]
    written = records()
    assert written < 30 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"terminated: {written} of 30 records written to {out}; run the same " \
        "command with --resume to complete the rest"
    res = subprocess.run(cmd[:-2] + ["--resume", "--quiet"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(30))


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), device="cpu", max_model_len=32) as llm:
        yield llm


@pytest.mark.parametrize("prompt", [b"hello", bytearray(b"hi"), memoryview(b"hi"), [memoryview(b"hi")]])
def test_a_bytes_prompt_is_refused_not_read_as_token_ids(llm, prompt):
    """generate(b"hello") ran the token ids [104, 101, 108, 108, 111] (bytes iterate as ints, and a memoryview has
    tolist() and a shape like an array), while [b"hello"] was refused: both are refused now, nothing queued."""
    with pytest.raises(RequestError, match="bytes|memoryview"):
        llm.generate(prompt, SamplingParams(max_new_tokens=2))
    with pytest.raises(RequestError):
        llm.stream(prompt, SamplingParams(max_new_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    # token ids as an array, a range or a generator of prompts still work
    assert llm.generate(np.array([5, 6, 7]), SamplingParams(max_new_tokens=1))[0].prompt_token_ids == [5, 6, 7]
    assert llm.generate(range(5, 8), SamplingParams(max_new_tokens=1))[0].prompt_token_ids == [5, 6, 7]
    assert llm.generate((p for p in [[5, 6]]), SamplingParams(max_new_tokens=1))[0].prompt_token_ids == [5, 6]


@pytest.mark.parametrize("kwargs, hint", [({"n": 2}, "does not support"), ({"min_tokens": 2}, "does not support"),
                                          ({"max_completion_tokens": 3}, "spells it max_new_tokens"),
                                          ({"tempature": 0.5}, "temperature")])
def test_an_unknown_sampling_field_is_a_request_error_naming_it(kwargs, hint):
    """SamplingParams(n=2) or a typo was a bare TypeError from the dataclass __init__, with no word on what to write
    instead; it is a RequestError (a ValueError, as vLLM's) naming the field and what to do, as other bad fields."""
    (name,) = kwargs
    with pytest.raises(RequestError, match=f"no field '{name}'.*{hint}"):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
    assert SamplingParams(7, temperature=0.5).checked().max_new_tokens == 7  # positional and replace() still work


def test_vllm_max_tokens_is_max_new_tokens(llm):
    """vLLM's SamplingParams(max_tokens=4) was a TypeError: it is the same field as max_new_tokens now."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert params.max_new_tokens == 4 and params.max_tokens == 4
    assert len(llm.generate("hello", params)[0].token_ids) == 4
    with pytest.raises(RequestError, match="both max_tokens and max_new_tokens"):
        SamplingParams(max_tokens=4, max_new_tokens=5)
    with pytest.raises(RequestError, match="max_new_tokens must be in"):
        SamplingParams(max_tokens=0)
