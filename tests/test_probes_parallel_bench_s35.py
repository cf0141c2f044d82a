"""Probe round (session 35) of `infer run/serve --data-parallel` and `infer bench`: what a data-parallel run counts
and writes is one engine's, and bench's odd inputs and outputs are clear errors."""

from __future__ import annotations

import json

import pytest

from infer.engine.config import EngineConfig


def _write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


@pytest.fixture(scope="module")
def replicas():
    from infer.parallel.replica import Replica
    cfg = EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=2, memory_limit=2 ** 29)
    return [Replica(cfg) for _ in range(2)]


def _one_and_dp(tmp_path, replicas, lines: list) -> tuple[tuple[int, dict], tuple[int, dict]]:
    """(failed count, records by id) of one engine's _generate and of the data-parallel driver's (replicas in this
    process behind tests/fakeray.py's stand-in for Ray) on the same input."""
    from fakeray import FakeRay, Handle

    from infer.cli import run as one, run_parallel
    from infer.cli.batch_io import RecordWriter, read_inputs
    from infer.parallel.pool import ReplicaPool
    inp = _write(tmp_path / "in.jsonl", lines)
    tokenizer = replicas[0].engine.tokenizer
    results = []
    for name in ("one", "dp"):
        path = tmp_path / f"{name}.jsonl"
        todo = read_inputs(inp, tokenizer, {"max_new_tokens": 3}, None, 64)
        writer = RecordWriter(path, append=False)
        if name == "one":
            failed = one._generate(replicas[0].engine, todo, writer, True)
        else:
            pool = ReplicaPool(FakeRay(), [Handle(r) for r in replicas], capacity=2, notify=lambda m: None)
            failed = run_parallel._generate(pool, todo, writer, tokenizer, True)
        writer.close()
        results.append((failed, {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}))
    return results[0], results[1]


def test_a_request_the_engine_ends_with_an_error_fails_a_data_parallel_run_too(tmp_path, replicas):
    """A request the engine ends with finish_reason "error" (here bad_words leave no allowed token; also NaN logits
    or a deleted adapter) fails one engine's run (exit 1, counted in the summary): the data-parallel driver wrote
    the same record but counted it as ok, and the run exited 0."""
    (tt,) = set(replicas[0].engine.tokenizer.encode("tt", add_special_tokens=False))
    lines = [{"id": "a", "prompt": "x", "max_new_tokens": 3},
             {"id": "bw", "prompt": "y", "max_new_tokens": 3, "allowed_token_ids": [tt], "bad_words": ["tt"]}]
    (one_failed, want), (dp_failed, got) = _one_and_dp(tmp_path, replicas, lines)
    assert want["bw"]["finish_reason"] == "error" and got == want
    assert one_failed == dp_failed == 1


# ------------------------------------------------------------------ `infer run --data-parallel 2` without a Ray runtime


@pytest.fixture
def local_ray(monkeypatch):
    """`--data-parallel N` runs its replicas in this process (one engine each, built as the runtime builds them)."""
    import contextlib

    from fakeray import FakeRay, Handle
    from infer.cli import run_parallel
    from infer.parallel.replica import Replica
    from infer.parallel.runtime import replica_config

    def start_replicas(ray, engine, model_path, n, threads=None, placement_timeout=None):
        cfg = replica_config(engine, model_path, "cpu", n, single_node=False)
        handles = [Handle(Replica(cfg)) for _ in range(n)]
        return handles, [h.replica.info() for h in handles]
    monkeypatch.setattr(run_parallel, "require_ray", lambda: None)
    monkeypatch.setattr(run_parallel, "ray_runtime", lambda address, cpus: contextlib.nullcontext(FakeRay()))
    monkeypatch.setattr(run_parallel, "start_replicas", start_replicas)


def _cli(*args):
    from typer.testing import CliRunner

    from infer.cli.main import app
    return CliRunner().invoke(app, ["run", "tiny-llama", *map(str, args), "-q", "--memory-limit", "512MB",
                                    "--max-num-seqs", "2"])


def _records(path) -> dict:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_a_prompt_certainly_too_long_is_refused_as_one_engine_refuses_it(tmp_path, local_ray):
    """Without --max-model-len, the data-parallel driver read the input against no context: a prompt certainly too
    long was tokenized whole (megabytes of text, in the driver) and its error record was not one engine's ("the
    prompt has 80002 tokens ..." where one engine says "the prompt is 200,000 bytes long, at least ... tokens")."""
    inp = _write(tmp_path / "in.jsonl", [{"id": "ok", "prompt": "hello", "max_new_tokens": 2},
                                         {"id": "huge", "prompt": "word " * 40000, "max_new_tokens": 2}])
    for name, extra in (("one", ()), ("dp", ("--data-parallel", "2"))):
        res = _cli(inp, "-o", tmp_path / f"{name}.jsonl", *extra)
        assert res.exit_code == 1, res.output
    want, got = _records(tmp_path / "one.jsonl"), _records(tmp_path / "dp.jsonl")
    assert "bytes long, at least" in want["huge"]["error"]
    assert got == want



def test_strict_lists_the_engines_checks_before_any_replica_starts(tmp_path, local_ray, monkeypatch):
    """`--data-parallel 2 --strict` read the lines before the replicas started and stopped at what reading finds;
    the engine's checks came in a second round after the replicas loaded the model: now one round, as one engine's
    --strict, and no replica starts."""
    from infer.cli import run_parallel
    monkeypatch.setattr(run_parallel, "start_replicas", lambda *a: pytest.fail("a replica started"))
    inp = _write(tmp_path / "in.jsonl", [{"prompt": 5}, {"prompt_token_ids": [1, 99999]},
                                         {"prompt": "hi", "lora": "nope"}, {"prompt": "fine"}])
    for extra in ((), ("--data-parallel", "2")):
        res = _cli(inp, "-o", tmp_path / "out.jsonl", "--strict", *extra)
        assert res.exit_code == 2, res.output
        assert "3 of 4 input lines are invalid (--strict)" in res.output, res.output
        assert "vocabulary" in res.output and "unknown LoRA adapter" in res.output


# ------------------------------------------------------------------ infer bench


@pytest.mark.parametrize("kind,text,want", [
    ("jsonl", '{"prompt": "hi", "max_new_tokens": ' + "9" * 5000 + "}\n",
     "line 1 is not valid JSON: Exceeds the limit"),
    ("jsonl", '{"prompt": "hi", "lora": ' + "[" * 100000 + "]" * 100000 + "}\n", "line 1 is not valid JSON: nested"),
    ("sharegpt", '[{"conversations": [], "x": ' + "9" * 5000 + "}]", "is not valid JSON: Exceeds the limit"),
    ("sharegpt", "[" * 100000 + "]" * 100000, "is not valid JSON: nested too deeply"),
])
def test_a_dataset_json_cannot_read_is_a_clear_error(tmp_path, kind, text, want):
    """An integer of more than 4300 digits or arrays nested past the decoder's depth in a bench dataset was a
    ValueError / RecursionError traceback (only JSONDecodeError was caught)."""
    from infer.bench.datasets import load_workload
    from infer.errors import ConfigError
    path = tmp_path / f"data.{kind}"
    path.write_text(text)
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        load_workload(f"{kind}:{path}", tokenizer=None)
    assert want in e.value.message and "set_int_max_str_digits" not in e.value.message


def test_a_dataset_output_length_over_the_limit_is_refused_naming_the_line(tmp_path):
    """max_new_tokens 10^11 in a jsonl line passed the dataset's check; after the model had loaded, building the
    request's SamplingParams raised and the bench died without a report ("max_new_tokens must be in ...", no file
    or line named)."""
    from infer.bench.datasets import load_workload
    from infer.errors import ConfigError
    path = _write(tmp_path / "d.jsonl", [{"prompt": "hi", "max_new_tokens": 4},
                                         {"prompt": "hi", "max_new_tokens": 10 ** 11}])
    with pytest.raises(ConfigError, match=r"line 2: max_new_tokens must be an integer in 1\.\.2147483647"):
        load_workload(f"jsonl:{path}", tokenizer=_tokenizer())


def _tokenizer():
    from infer.engine.setup import load_tokenizer
    from infer.models.resolve import resolve_model
    return load_tokenizer(resolve_model("tiny-llama"))


def test_a_request_whose_params_are_refused_fails_alone_in_the_bench_driver(replicas):
    """The driver built a request's SamplingParams outside its guard: one request with an output length out of
    range ended the whole run (no report) instead of being one failed request."""
    from infer.bench.datasets import BenchRequest
    from infer.bench.driver import run_in_process
    reqs = [BenchRequest(None, [5, 6, 7], 2, ignore_eos=True), BenchRequest(None, [5, 6, 7], 10 ** 11),
            BenchRequest(None, [8, 9], 2, ignore_eos=True)]
    result = run_in_process(replicas[0].engine, reqs, concurrency=2, progress=False)
    assert [r.success for r in result.records] == [True, False, True]
    assert "max_new_tokens must be in" in result.records[1].error


@pytest.mark.parametrize("name", ["results.json", "throughput.png", "report.md"])
def test_a_report_file_that_cannot_be_written_is_refused_before_the_bench_runs(tmp_path, name):
    """--out FOLDER where FOLDER/results.json (or a plot) is a folder: the whole benchmark ran, then writing the
    report was an IsADirectoryError traceback and every figure measured was lost."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    (tmp_path / "out" / name).mkdir(parents=True)
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "-c", "1", "--num-prompts", "1", "--input-len", "4",
                                   "--output-len", "2", "-q", "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert f"the report file {tmp_path / 'out' / name} cannot be written (a folder)" in res.stderr
    assert "Traceback" not in res.output


def test_a_report_that_cannot_be_written_still_shows_the_table(tmp_path):
    """A report file the benchmark cannot write at its end (the disk filled up, the folder changed under it):
    an OutputError naming the file, after the table of what was measured (it was printed only after every file
    had been written, so a failure lost it)."""
    import io

    from rich.console import Console

    from infer.bench.metrics import RequestRecord, RunResult
    from infer.bench.report import write_report
    from infer.errors import OutputError
    recs = [RequestRecord(0, 4, send_time=0.0, chunk_times=[0.1, 0.2], output_tokens=2, text="ab", success=True)]
    run = RunResult("infer", 1, recs, duration_s=0.2, num_requests=1, timeline=[{"t": 0.0, "rss_bytes": 1}])
    (tmp_path / "latency.png").mkdir()
    buf = io.StringIO()
    with pytest.raises(OutputError, match="cannot write the benchmark report: .*latency.png"):
        write_report(tmp_path, [run], console=Console(file=buf, width=200))
    assert "infer bench: throughput" in buf.getvalue()


def test_a_level_that_cannot_run_keeps_the_report_of_the_levels_before(tmp_path, monkeypatch):
    """bench --url -c 1,2 against a server that went away after the first level: run_http's reachability check
    raised "cannot reach ..." and the first level's figures were lost (no report at all)."""
    from infer.bench import plan as bench_plan
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.errors import ConfigError

    def run(self, requests, concurrency):
        if concurrency == 2:
            raise ConfigError("cannot reach http://127.0.0.1:9: All connection attempts failed",
                              "start the server first (infer serve MODEL) or fix --url")
        recs = [RequestRecord(i, 4, send_time=0.0, chunk_times=[0.1, 0.2], output_tokens=2, text="ab", success=True)
                for i in range(len(requests))]
        return RunResult("http", concurrency, recs, duration_s=0.2, num_requests=len(requests))
    monkeypatch.setattr(bench_plan._Target, "run", run)
    plan = bench_plan.BenchPlan(model="tiny-llama", levels=[1, 2], out=tmp_path / "out", num_prompts=2,
                                input_len=4, output_len=2, url="http://127.0.0.1:9", model_id="tiny-llama", quiet=True)
    with pytest.raises(ConfigError, match="cannot reach .*the report in .* holds the levels measured before"):
        bench_plan.run_plan(plan)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["concurrency"], r["completed"]) for r in results] == [(1, 2)]


@pytest.mark.parametrize("reason,ok", [("stop", True), ("length", True), ("abort", False), ("error", False)])
def test_a_stream_the_server_aborted_is_a_failed_request(reason, ok):
    """A stream that vLLM or SGLang ends with finish_reason "abort" (the request was cut short) counted as a
    success of its few tokens in the HTTP driver's figures; the in-process driver counts only stop and length."""
    from infer.bench.driver import Progress
    from infer.bench.http_driver import _apply_chunk, _HttpRun
    from infer.bench.metrics import RequestRecord
    run = _HttpRun("http://x", "m", [], 1, 0.0, None, None, Progress(False, 1, "http"))
    rec = RequestRecord(0, 3, send_time=0.0)
    _apply_chunk(rec, {"choices": [{"text": "ab", "finish_reason": None}]}, 0.1)
    _apply_chunk(rec, {"choices": [{"text": "", "finish_reason": reason}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 1}}, 0.2)
    run._finish(rec)
    assert rec.success is ok and (ok or rec.error == f"finished with reason {reason!r}")


def test_a_replica_that_cannot_start_is_named_with_its_host(monkeypatch):
    """A replica whose engine could not start (too little --memory-limit; on a cluster, a --lora or model folder
    the driver has and that node lacks) was refused with the engine's message alone, as if the driver's own
    engine had failed: the replica and its host are named."""
    import socket

    import torch

    from fakeray import FakeRay
    from infer.errors import OutOfMemoryError
    from infer.parallel.runtime import start_replicas

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # (the replicas' threads: not this process's)
    cfg = EngineConfig("tiny-llama", device="cpu", memory_limit=1024)
    from infer.models.resolve import resolve_model
    with pytest.raises(OutOfMemoryError, match=f"^engine replica 0 \\(on {socket.gethostname()}\\): a single seq"):
        start_replicas(FakeRay(), cfg, resolve_model("tiny-llama"), 2)
