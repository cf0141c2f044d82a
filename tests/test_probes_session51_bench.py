"""Session 51 probes of `infer bench`: what it reports checked against the raw per-request timestamps, and what it
keeps when a run stops half way."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infer.cli.main import app

from helpers import BenchTargetStub

SMALL = ["--input-len", "4", "--output-len", "3", "-q"]


def _fail_after(monkeypatch, steps: int, message: str = "CUDA error: an illegal memory access (simulated)"):
    """The engine's step raises after `steps` steps of the measured run (as a GPU fault or a bug half way)."""
    import infer.bench.driver as driver
    real = driver.run_in_process

    def failing(engine, requests, concurrency, *a, **k):
        real_step, calls = engine.step, [0]

        def step():
            calls[0] += 1
            if calls[0] > steps:
                raise RuntimeError(message)
            return real_step()
        engine.step = step
        try:
            return real(engine, requests, concurrency, *a, **k)
        finally:
            engine.step = real_step
    monkeypatch.setattr(driver, "run_in_process", failing)


def test_an_error_half_way_through_the_only_level_keeps_what_finished(tmp_path, monkeypatch):
    """A level that an error stopped half way (the engine's step failed after some requests had finished) lost every
    request measured: with one level nothing was written at all. The requests that finished are now written, the run
    marked partial with the error that stopped it, and the error still raised (exit status not 0)."""
    _fail_after(monkeypatch, 8)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(out), "-c", "2", "--num-prompts", "8", *SMALL])
    assert isinstance(res.exception, RuntimeError), res.output
    [r] = json.loads((out / "results.json").read_text())
    assert r["partial"] is True and 0 < r["completed"] < 8 and r["failed"] == 0
    assert "illegal memory access" in r["run_error"]
    assert r["total_output_tokens"] == 3 * r["completed"]
    assert (out / "report.md").is_file() and "yes" in (out / "report.md").read_text()
    assert "what was measured before it" in res.output


def test_an_error_in_a_later_lora_split_group_keeps_the_groups_before(monkeypatch):
    """--lora-policy split runs one adapter group after another: an error in a later group lost the groups that had
    finished. The merged result of every group measured goes back with the error."""
    import pytest

    import infer.bench.lora_split as split
    from infer.bench.datasets import BenchRequest
    from infer.bench.metrics import RequestRecord, RunResult

    def fake(engine, group, concurrency, **k):
        recs = [RequestRecord(j, 3, 0.0, [0.1, 0.2], 2, "ab", True) for j in range(len(group))]
        if group[0].lora is None:
            return RunResult("infer", concurrency, recs, 1.0, len(group), start_time=10.0)
        err = RuntimeError("boom")
        err.bench_partial = RunResult("infer", concurrency, recs[:1], 0.5, len(group), partial=True,
                                      start_time=11.0, error="RuntimeError: boom")
        raise err
    monkeypatch.setattr(split, "run_in_process", fake)
    reqs = [BenchRequest(None, [5, 6], 2, lora=name) for name in (None, "x", None, "x")]
    with pytest.raises(RuntimeError) as info:
        split.run_split(None, reqs, 2, progress=False)
    part = info.value.bench_partial
    assert part.partial and part.error == "RuntimeError: boom"
    assert [r.index for r in part.records] == [0, 1, 2]  # both base requests, the first adapter request
    assert part.duration_s == 1.5


def _run(backend: str, ttft: float, label: str | None = None):
    from infer.bench.metrics import RequestRecord, RunResult
    recs = [RequestRecord(0, 4, 0.0, [ttft, ttft + 0.01, ttft + 0.02], 3, "abc", True)]
    return RunResult(backend, 2, recs, duration_s=ttft + 0.02, num_requests=1, label=label)


ENV = {"versions": {"infer": "0"}, "device": "cpu", "git_commit": None}


def test_the_terminal_table_says_which_way_round_the_hf_ratios_are():
    """With --baseline hf the tables printed x columns (x out tok/s, x TTFT p50 ...) and nothing on the terminal said
    that x is ours / baseline, nor which way is better (only report.md did, in a closing line): 0.5x TTFT could be
    read either way. A line under the tables now says it, as it already did for a labelled baseline."""
    from rich.console import Console

    from infer.bench.report import build_results, print_table
    results = build_results([_run("infer", 0.01)], [_run("hf", 0.02)], env=ENV)
    assert results[0]["ratio"]["mean_ttft_ms"] == 0.5  # ours / baseline
    console = Console(record=True, width=400)
    print_table(results, console)
    text = console.export_text()
    assert "x = ours / baseline" in text and "below 1 on a latency, ours is better" in text
    assert "0.50x" in text


def test_a_latency_ratio_needs_samples_on_both_sides():
    """A run with no sample of a latency reports it as 0 ms (vLLM's convention for an empty list): ours with every
    request failed (or with one token each, for TPOT and ITL) had "x TTFT p50 0.00x" against the baseline, which
    reads as infinitely faster. Such ratios are now None ("-"); the throughput ratios (0.00x: nothing done) stay."""
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.bench.report import build_results, table_rows
    failed = RunResult("infer", 2, [RequestRecord(0, 4, 0.0, [], 0, "", False, "HTTP 500")], 0.1, 1)
    one_token = RunResult("infer", 2, [RequestRecord(0, 4, 0.0, [0.01], 1, "a", True)], 0.1, 1)
    [r] = build_results([failed], [_run("hf", 0.02)], env=ENV)
    assert r["mean_ttft_ms"] == 0.0 and r["ratio"]["mean_ttft_ms"] is None and r["ratio"]["p99_e2el_ms"] is None
    assert r["ratio"]["output_throughput"] == 0.0
    assert table_rows([r], "latency")[1][0][-4:] == ["-"] * 4
    [r] = build_results([one_token], [_run("hf", 0.02)], env=ENV)
    assert r["ratio"]["median_ttft_ms"] == 0.5 and r["ratio"]["median_e2el_ms"] == 0.25
    assert r["ratio"]["median_tpot_ms"] is None and r["ratio"]["median_itl_ms"] is None


def test_the_hf_baseline_runs_after_ours_with_ours_freed(tmp_path, monkeypatch):
    """--baseline hf loaded transformers' copy of the model before ours ran and interleaved the two level by level:
    ours' peak memory held the baseline's weights, and the baseline's held ours' weights and, on a GPU, ours' whole
    KV cache (torch.cuda.max_memory_allocated counts every allocation of the process), so the peak GiB of either
    side measured both. Every level of ours now runs first, ours' engine is freed, then transformers loads and runs
    each level, as the no-spec baseline does."""
    import infer.bench.hf_baseline as H
    import infer.bench.plan as P
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.engine.config import EngineConfig
    events = []

    def record(c):
        return [RequestRecord(0, 4, 0.0, [0.01, 0.02], 2, "ab", True)]

    class Target:
        hf_dtype, hf_device = "float32", "cpu"

        def __init__(self, plan, tokenizer):
            events.append("build")

        def warm_adapters(self, names):
            pass

        def run(self, requests, c):
            events.append(f"ours {c}")
            return RunResult("infer", c, record(c), 1.0, len(requests))

        def close(self):
            events.append("close")

    def load_hf(*a, **k):
        events.append("load hf")
        return object()

    def run_hf(hf, requests, batch_size, **k):
        events.append(f"hf {batch_size}")
        return RunResult("hf", batch_size, record(batch_size), 2.0, len(requests))
    monkeypatch.setattr(P, "_Target", Target)
    monkeypatch.setattr(H, "load_hf", load_hf)
    monkeypatch.setattr(H, "run_hf_generate", run_hf)
    plan = P.BenchPlan(model="tiny-llama", levels=[1, 2], out=tmp_path / "out", baseline="hf", quiet=True,
                       input_len=4, output_len=2, num_prompts=2, engine=EngineConfig("tiny-llama"))
    results, interrupted = P.run_plan(plan)
    assert not interrupted
    assert events == ["build", "ours 1", "ours 2", "close", "load hf", "hf 1", "hf 2"]
    assert [r["baseline"]["concurrency"] for r in results] == [1, 2]
    assert [r["ratio"]["output_throughput"] for r in results] == [2.0, 2.0]
    assert "one model in memory at a time" in results[0]["config"]["baseline_engine"]


def test_results_csv_holds_the_ratios_the_table_prints(tmp_path):
    """The throughput and latency tables print x columns (ours / baseline); results.csv, the file a spreadsheet
    reads, left them out (a dict), so its figures did not match the table. Ours' row now has ratio_<key> columns."""
    import pandas as pd

    from infer.bench.report import write_report
    results = write_report(tmp_path, [_run("infer", 0.01)], [_run("hf", 0.02)], show=False)
    table = pd.read_csv(tmp_path / "results.csv")
    ours, base = table.to_dict("records")
    assert ours["backend"] == "infer" and base["backend"] == "hf"
    for key, value in results[0]["ratio"].items():
        assert ours[f"ratio_{key}"] == value, key
    assert ours["ratio_median_ttft_ms"] == 0.5 and pd.isna(base["ratio_median_ttft_ms"])


def test_an_error_in_a_later_hf_batch_keeps_the_batches_before(tmp_path, monkeypatch):
    """The HF baseline caught only Ctrl-C: a later batch that failed (out of memory at the larger batch) lost the
    batches measured before it, and the level's baseline with them. They now go back with the error (bench_partial,
    partial, with the error), and run_plan writes them beside ours before raising it."""
    import time

    import pytest

    import infer.bench.hf_baseline as H
    from infer.bench.datasets import BenchRequest
    from infer.bench.metrics import RequestRecord
    calls = [0]

    def batch(model, tok, dev, rows, sampler, cache_implementation=None):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        now = time.perf_counter()
        return [RequestRecord(i, 3, now - 0.02, [now - 0.01, now], 2, "ab", True, end_time=now) for i, _ in rows]
    monkeypatch.setattr(H, "_run_batch", batch)
    reqs = [BenchRequest(None, [5, 6, 7], 2, ignore_eos=True) for _ in range(4)]
    with pytest.raises(RuntimeError) as info:
        H.run_hf_generate((None, None, None), reqs, batch_size=2, progress=False)
    part = info.value.bench_partial
    assert part.partial and part.aborted == 2 and "out of memory" in part.error
    assert [r.index for r in part.records] == [0, 1] and part.metrics()["completed"] == 2


def test_run_plan_writes_a_baseline_stopped_half_way(tmp_path, monkeypatch):
    """run_plan side of the above: the baseline's partial run is written beside ours, then the error raised."""
    import pytest

    import infer.bench.hf_baseline as H
    import infer.bench.plan as P
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.engine.config import EngineConfig

    def recs():
        return [RequestRecord(0, 4, 0.0, [0.01, 0.02], 2, "ab", True)]

    class Target(BenchTargetStub):
        def records(self):
            return recs()

    def run_hf(hf, requests, batch_size, **k):
        err = RuntimeError("CUDA out of memory (simulated)")
        err.bench_partial = RunResult("hf", batch_size, recs(), 2.0, len(requests), partial=True, error="oom")
        raise err
    monkeypatch.setattr(P, "_Target", Target)
    monkeypatch.setattr(H, "load_hf", lambda *a, **k: object())
    monkeypatch.setattr(H, "run_hf_generate", run_hf)
    plan = P.BenchPlan(model="tiny-llama", levels=[2], out=tmp_path / "out", baseline="hf", quiet=True,
                       input_len=4, output_len=2, num_prompts=2, engine=EngineConfig("tiny-llama"))
    with pytest.raises(RuntimeError):
        P.run_plan(plan)
    [r] = json.loads((tmp_path / "out" / "results.json").read_text())
    assert r["partial"] is False and r["baseline"]["partial"] is True and r["baseline"]["run_error"] == "oom"
    assert r["ratio"]["output_throughput"] == 2.0


def test_the_hf_baseline_samples_memory_no_more_often_than_ours(monkeypatch):
    """The HF baseline's sampler took a sample (psutil, /proc, ~0.1 ms) at every decoding step, inside generate's
    step, where ours samples at most every 50 ms: the baseline's TPOT and ITL carried a cost ours did not. It now
    samples as ours does. (A fake clock, 1 ms per read: 200 steps are 0.2 s.)"""
    import types

    import infer.bench.hf_baseline as H
    import infer.bench.monitor as M
    from infer.bench.datasets import BenchRequest
    from infer.bench.metrics import RequestRecord
    clock = [0.0]

    def perf_counter():
        clock[0] += 0.001
        return clock[0]
    monkeypatch.setattr(M, "time", types.SimpleNamespace(perf_counter=perf_counter))
    steps = []

    def batch(model, tok, dev, rows, sampler, cache_implementation=None):
        for _ in range(200):  # what StepClock does at each step
            sampler.sample()
        steps.append(200)
        return [RequestRecord(i, 3, 0.0, [0.01, 0.02], 2, "ab", True, end_time=0.02) for i, _ in rows]
    monkeypatch.setattr(H, "_run_batch", batch)
    run = H.run_hf_generate((None, None, None), [BenchRequest(None, [5, 6], 2, ignore_eos=True)], 1, progress=False)
    assert steps == [200] and len(run.timeline) <= 8  # one per 50 ms of the fake clock, and the last one


def test_url_levels_after_the_first_reset_the_server_prefix_cache_or_say_why_not(tmp_path, monkeypatch, capsys):
    """With --url and several levels every level sends the same prompts: the in-process engine's prefix cache is
    reset before each level, the server's was not, so from the second level on a server with prefix caching (vLLM's
    default, infer serve's) found every prompt cached and reported a TTFT no cold level has, without a word. The
    bench now asks the server to reset it (vLLM's POST /reset_prefix_cache) before each level, and says once when
    the server did not."""
    import infer.bench.http_driver as D
    import infer.bench.plan as P
    from infer.bench.metrics import RunResult
    resets, answer = [], [False]

    def reset(url, api_key=None):
        resets.append(url)
        return answer[0]
    monkeypatch.setattr(D, "reset_prefix_cache", reset)
    monkeypatch.setattr(D, "run_http", lambda url, model, reqs, c, *a, **k: RunResult("http", c, [], 1.0, len(reqs)))
    plan = P.BenchPlan(model="tiny-llama", levels=[1, 2, 4], out=tmp_path, url="http://127.0.0.1:9", model_id="m")
    for answer[0] in (False, True):
        target = P._Target(plan, None)
        for c in plan.levels:
            target.run([], c)
        note = capsys.readouterr().err
        assert len(resets) == 3 and note.count("did not reset its prefix cache") == (0 if answer[0] else 1)
        resets.clear()


def test_ctrl_c_while_the_hf_baseline_reads_the_servers_length_leaves_ours_whole(tmp_path, monkeypatch):
    """The hf baseline's requests are capped at the server's max model length (a /v1/models call with --url): a
    Ctrl-C there, after every level of ours had finished, marked ours' last level partial."""
    import infer.bench.hf_baseline as H
    import infer.bench.plan as P

    class Target(BenchTargetStub):
        kind = "http"

    def interrupted(plan):
        raise KeyboardInterrupt
    monkeypatch.setattr(P, "_Target", Target)
    monkeypatch.setattr(P, "_context_len", interrupted)
    monkeypatch.setattr(H, "load_hf", lambda *a, **k: object())
    plan = P.BenchPlan(model="tiny-llama", levels=[1, 2], out=tmp_path / "out", baseline="hf", quiet=True,
                       input_len=4, output_len=2, num_prompts=2, url="http://127.0.0.1:9", model_id="m")
    results, stopped = P.run_plan(plan)
    assert stopped and [r["partial"] for r in results] == [False, False]
