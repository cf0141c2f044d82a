"""Tools found by probing as a hostile user (session 5), beside `infer run` (test_probes_session5.py): `infer bench`
with a report folder that is a file or prompts that cannot fit, `warmup` on damaged checkpoints or a worst case
that cannot fit, `convert`/`quantize` onto their source, and the Python API (LLM, SamplingParams) with bad
arguments."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from infer.errors import RequestError

runner = CliRunner()


def _lines(*objs) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def test_top_k_minus_one_is_off_and_other_negatives_are_refused():
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(RequestError, match="top_k"):
        SamplingParams(top_k=-2)


def test_stop_lists_are_capped_with_the_cap_named():
    SamplingParams(stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    with pytest.raises(RequestError, match=f"more than {MAX_STOP_STRINGS}"):
        SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(RequestError, match=f"more than {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))


def _bench(tmp_path, *args):
    return runner.invoke(app, ["bench", "tiny-llama", "-c", "1", "--num-prompts", "2", "--input-len", "4",
                               "--output-len", "2", "-q", *map(str, args)])


def test_bench_report_folder_that_is_a_file_fails_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr("infer.bench.plan.run_plan", lambda plan: (_ for _ in ()).throw(AssertionError("ran")))
    target = tmp_path / "file"
    target.write_text("x")
    for out, message in [(target, "is a file, not a folder"), (target / "sub", "is a file, not a folder"),
                         ("/sys/infer-probe", "is not writable")]:
        res = _bench(tmp_path, "--out", out)
        assert res.exit_code == 2 and message in res.output and "hint:" in res.output, res.output
    assert target.read_text() == "x"


def test_bench_where_requests_fail_says_why_and_exits_1(tmp_path):
    """A prompt longer than --max-model-len used to give a table of zeros and exit 0."""
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(_lines({"prompt": "word " * 40}, {"prompt": "hi"}))
    res = runner.invoke(app, ["bench", "tiny-llama", "-c", "1", "--dataset", f"jsonl:{data}", "--output-len", "2",
                              "--max-model-len", "32", "-q", "--out", str(tmp_path / "b")])
    assert res.exit_code == 1, res.output
    assert "error: 1 of 2 requests failed at concurrency 1: the prompt has" in res.output
    saved = json.loads((tmp_path / "b" / "results.json").read_text())[0]
    assert saved["failed"] == 1 and saved["completed"] == 1 and "leaves no room" in saved["errors"][0]


def test_bench_random_prompts_that_cannot_fit_are_refused_before_they_are_made(tmp_path, monkeypatch):
    """--input-len 100000000 spent minutes building prompts that could never run."""
    from infer.bench import datasets
    monkeypatch.setattr(datasets, "random_requests", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    for extra in (["--input-len", "100000000"], ["--input-len", "30", "--output-len", "3"]):
        res = runner.invoke(app, ["bench", "tiny-llama", "-c", "1", "--num-prompts", "2", "--max-model-len", "32",
                                  "-q", "--out", str(tmp_path / "b"), *extra])
        assert res.exit_code == 2 and "do not fit the engine's max length of 32" in res.output, res.output
        assert "hint:" in res.output and not (tmp_path / "b").exists()


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_convert_and_quantize_never_replace_their_source(tmp_path, command):
    """`infer quantize ./model -o ./model --overwrite` replaced the float model by its int4 copy; an output folder
    above the source would have been deleted with it."""
    import shutil

    from infer.models.tiny import ensure_builtin
    src = tmp_path / "models" / "m"
    shutil.copytree(ensure_builtin("tiny-llama"), src)
    before = sorted(p.name for p in src.iterdir())
    for out, message in [(src, "is the input folder"), (src.parent, "a folder that holds the input")]:
        res = runner.invoke(app, [command, str(src), "-o", str(out), "--overwrite", "--group-size", "32"]
                            if command == "quantize" else [command, str(src), "-o", str(out), "--overwrite"])
        assert res.exit_code == 2 and message in res.output and "hint:" in res.output, res.output
    assert sorted(p.name for p in src.iterdir()) == before


@pytest.mark.parametrize("damage", ["truncated", "list header", "entry without shape"])
def test_warmup_estimate_reads_a_damaged_checkpoint_as_damaged(tmp_path, damage):
    """`warmup --estimate` reads only safetensors headers: a copy cut short said "fits" (exit 0), and a header that
    is a list or lacks a shape ended in a traceback."""
    import shutil
    import struct

    from infer.models.tiny import ensure_builtin
    model = tmp_path / "m"
    shutil.copytree(ensure_builtin("tiny-llama"), model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    if damage == "truncated":
        weights.write_bytes(data[:len(data) // 2])
    else:
        name = next(k for k in header if k != "__metadata__")
        bad = [1, 2] if damage == "list header" else {**header, name: {"dtype": "F32", "data_offsets": [0, 4]}}
        raw = json.dumps(bad).encode()
        weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    res = runner.invoke(app, ["warmup", str(model), "--max-length", "64", "--concurrency", "1", "--estimate"])
    assert res.exit_code == 2 and not (res.exception and not isinstance(res.exception, SystemExit)), res.output
    assert ("is truncated" if damage == "truncated" else "cannot read the safetensors header") in res.output
    assert "hint:" in res.output


@pytest.fixture(scope="module")
def llm():
    from infer.engine.llm import LLM
    with LLM("tiny-llama", max_model_len=64) as model:
        yield model


def test_a_prompt_that_fills_its_cap_is_told_what_can_make_room(llm):
    """The hint said "raise max_length" even when the cap was the engine's context, which max_length cannot pass."""
    tokens = list(range(1, 71))
    with pytest.raises(RequestError) as e:
        llm.engine.validate(tokens, SamplingParams(max_new_tokens=2))
    assert "under the model's context (--max-model-len) of 64" in str(e.value)
    assert "--max-model-len up to 4096, the model's limit" in str(e.value) and "raise max_length" not in str(e.value)
    with pytest.raises(RequestError, match=r"under max_length of 16 .*raise max_length \(up to 64\)"):
        llm.engine.validate(tokens[:20], SamplingParams(max_new_tokens=2, max_length=16))
    full = replace(llm.engine.config, max_model_len=None)  # an engine at the model's own limit: only shorter prompts
    llm.engine.config, llm.engine.max_model_len, saved = full, 4096, (llm.engine.config, llm.engine.max_model_len)
    try:
        assert llm.engine._longer_hint(False) == "shorten the prompt: 4096 tokens is the model's limit"
    finally:
        llm.engine.config, llm.engine.max_model_len = saved


def test_sampling_params_changed_after_construction_are_checked_and_do_not_reach_a_running_request(llm):
    """`sp.temperature = -1` after construction reached the sampler; a request also shared the caller's object, so
    changing it later changed the running request."""
    sp = SamplingParams(max_new_tokens=3)
    sp.temperature = -1.0
    with pytest.raises(RequestError, match=r"temperature must be in \[0, 100\], got -1.0"):
        llm.generate(["hi", "yo"], sp)
    assert not llm.engine.scheduler.has_unfinished()
    with pytest.raises(RequestError, match="temperature must be in"):  # the check servers make before queueing
        llm.engine.validate([5, 6], sp)
    sp.temperature, sp.top_k = 0.0, 2.5
    with pytest.raises(RequestError, match="top_k must be an integer"):
        llm.engine.add_request("x", [5, 6], sp)
    sp.top_k = 0
    llm.engine.add_request("x", [5, 6], sp)
    sp.max_new_tokens = 1  # the running request keeps what it was added with
    outs = []
    while llm.engine.scheduler.has_unfinished():
        outs += [o for o in llm.engine.step() if o.finished]
    assert [o.usage["completion_tokens"] for o in outs] == [3]


def test_llm_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm):
    """generate(["hi", too_long]) raised after "hi" was queued; the orphan then finished inside the next
    generate(), which counted it as its own and failed with KeyError (or returned too early)."""
    sp = SamplingParams(max_new_tokens=3)
    with pytest.raises(RequestError, match="leaves no room"):
        llm.generate(["hi", "word " * 100], sp)
    with pytest.raises(RequestError, match="leaves no room"):
        next(iter(llm.stream(["hi", "word " * 100], sp)))
    assert llm.engine.stats()["kv_blocks_used"] == 0 and not llm.engine.scheduler.has_unfinished()
    outs = llm.generate(["a", "b"], [sp, SamplingParams(max_new_tokens=2)])
    assert [o.usage["completion_tokens"] for o in outs] == [3, 2]


@pytest.mark.parametrize("call,match", [
    (lambda llm: llm.generate(["a", "b"], [SamplingParams(max_new_tokens=2)]), "2 prompts but 1 SamplingParams"),
    (lambda llm: llm.generate(["a", "b"], SamplingParams(max_new_tokens=2), lora=[None]), "2 prompts but 1 lora"),
    (lambda llm: llm.generate(None), "prompts"),
    (lambda llm: llm.generate(["a"], {"max_new_tokens": 2}), "SamplingParams"),
])
def test_llm_mismatched_arguments_are_named_not_dropped(llm, call, match):
    """A short params list silently generated for fewer prompts than given."""
    with pytest.raises(RequestError, match=match):
        call(llm)
    assert not llm.engine.scheduler.has_unfinished()


@pytest.mark.parametrize("kwargs,field", [({"max_new_tokens": "5"}, "max_new_tokens"), ({"top_k": 2.5}, "top_k"),
                                          ({"seed": 1.5}, "seed"), ({"logprobs": 2.5}, "logprobs"),
                                          ({"max_length": "9"}, "max_length"), ({"ignore_eos": "no"}, "ignore_eos"),
                                          ({"stop": 5}, "stop"), ({"stop_token_ids": [True]}, "stop_token_ids"),
                                          ({"max_new_tokens": True}, "max_new_tokens")])
def test_sampling_params_of_the_wrong_type_are_request_errors(kwargs, field):
    """From Python, SamplingParams(ignore_eos="no") ignored EOS and top_k=2.5 or seed=1.5 went through; others
    were a TypeError from a comparison."""
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_warmup_that_cannot_fit_says_so_without_running_the_worst_case(monkeypatch):
    """--concurrency 65536 at 4096 tokens ran the worst case anyway: a 34 GB allocation, a traceback (or the
    machine's memory). When the KV cache alone cannot fit, the answer is known without running anything."""
    from infer.engine import profile
    monkeypatch.setattr(profile, "profile_run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    res = runner.invoke(app, ["warmup", "tiny-llama", "--max-length", "4096", "--concurrency", "65536", "--json",
                              "--memory-limit", "2GB", "--max-num-batched-tokens", "65536"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["fits"] is False and out["worst_case_run"] is False


def test_warmup_whose_worst_case_runs_out_of_memory_is_one_line(monkeypatch):
    from infer.engine import profile

    def oom(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 34359738368 bytes")
    monkeypatch.setattr(profile, "profile_run", oom)
    res = runner.invoke(app, ["warmup", "tiny-llama", "--max-length", "64", "--concurrency", "2"])
    assert res.exit_code == 1 and "ran out of memory while it was measured" in res.output, res.output
    assert "hint: lower --concurrency" in res.output and not isinstance(res.exception, RuntimeError)


def test_an_engine_whose_batch_sizes_use_the_memory_names_them(tmp_path):
    """--max-num-seqs 65536 was refused with 'use --max-model-len 652': the batch sizes are what to lower. (Their
    activations are 2.4 GiB on tiny-llama since the CPU decode attention gathers one sequence at a time, so 1 GB.)"""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines({"prompt": "hi", "max_new_tokens": 2}))
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"), "-q",
                              "--max-num-seqs", "65536", "--memory-limit", "1GB",
                              "--max-num-batched-tokens", "65536"])  # a token a sequence at least (session 43)
    assert res.exit_code == 2 and "does not fit" in res.output, res.output
    assert "lower --max-num-seqs (65536) or --max-num-batched-tokens" in " ".join(res.output.split())


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_convert_and_quantize_into_a_folder_nobody_can_write_is_one_line(command):
    args = [command, "tiny-llama", "-o", "/sys/infer-probe"] + (["--group-size", "32"] if command == "quantize" else [])
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "cannot write into /sys" in res.output and "hint:" in res.output, res.output
    assert not isinstance(res.exception, OSError)
