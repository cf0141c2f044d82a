"""Session 42 probes of `infer bench`'s numbers and reports, as a `vllm bench serve` user reads them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app


@pytest.mark.parametrize("argv, words", [
    (["bench", "tiny-llama", "--burstiness", "0.5"], "Poisson"),
    (["bench", "tiny-llama", "--metric-percentiles", "50,99"], "p90 and p99"),
    (["bench", "tiny-llama", "--percentile-metrics", "ttft,itl"], "ttft, tpot, itl and e2el"),
])
def test_vllm_bench_serve_options_infer_lacks_say_what_infer_does(argv, words):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    option = next(a for a in argv if a.startswith("--"))
    assert f"{option} is vLLM's option" in result.output
    assert words in result.output
    assert "Possible options" not in result.output


def test_the_default_out_folder_is_checked_before_anything_runs(tmp_path, monkeypatch):
    """Without --out the report goes to ./bench-results/<timestamp>: a `bench-results` file in the current folder
    was only found after every level had been measured (the model loaded and ran, then "cannot write")."""
    import infer.bench.plan as plan_mod
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench-results").write_text("not a folder")
    monkeypatch.setattr(plan_mod, "run_plan", lambda *a, **k: pytest.fail("the benchmark ran"))
    result = CliRunner().invoke(app, ["bench", "tiny-llama", "-c", "1", "--num-prompts", "1"])
    assert result.exit_code == 2, result.output
    assert "bench-results" in result.output and "is a file, not a folder" in result.output


def test_the_default_out_folder_of_a_run_started_in_the_same_second_is_another(tmp_path, monkeypatch):
    from infer.cli import bench as bench_cli
    monkeypatch.setattr(bench_cli.time, "strftime", lambda fmt, *a: "20260101-000000")
    (tmp_path / "20260101-000000").mkdir()
    (tmp_path / "20260101-000000" / "results.json").write_text("[]")
    out = bench_cli.default_out(tmp_path)
    assert out == tmp_path / "20260101-000000-2" and out.is_dir()  # made: the next run started gets another
    assert bench_cli.default_out(tmp_path) == tmp_path / "20260101-000000-3"


def test_save_detailed_saves_vllms_per_request_lists_and_the_aggregates_are_what_they_imply(tmp_path):
    """vLLM's --save-detailed: results.json holds each request's input_lens, output_lens, ttfts, itls and
    generated_texts, from which every aggregate can be recomputed by hand (it was refused as an unknown option, and
    nothing per request was saved). Two requests of one token (no TPOT, no ITL) and one refused request (failed:
    counted, out of the latency figures)."""
    import json

    import numpy as np
    lines = [{"prompt": "hello there", "max_new_tokens": 1, "ignore_eos": True},
             {"prompt": "hello you", "max_new_tokens": 1, "ignore_eos": True},
             {"prompt": "hi", "max_new_tokens": 5, "ignore_eos": True},
             {"prompt": "hi there friend", "max_new_tokens": 4, "ignore_eos": True}]
    data = tmp_path / "w.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "tiny-llama", "-c", "2", "--dataset", f"jsonl:{data}", "-q",
                                      "--save-detailed", "--goodput", "tpot:100000", "-o", str(out)])
    assert result.exit_code == 0, result.output
    r = json.loads((out / "results.json").read_text())[0]
    assert r["output_lens"] == [1, 1, 5, 4] and len(r["input_lens"]) == 4
    assert [len(x) for x in r["itls"]] == [0, 0, 4, 3] and r["request_errors"] == [None] * 4
    assert len(r["generated_texts"]) == 4
    e2el = [t + sum(i) for t, i in zip(r["ttfts"], r["itls"])]
    tpot = [sum(i) / (n - 1) for i, n in zip(r["itls"], r["output_lens"]) if n > 1]
    itl = [g for i in r["itls"] for g in i]
    for name, values in (("ttft", r["ttfts"]), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        ms = np.asarray(values) * 1000
        assert r[f"mean_{name}_ms"] == pytest.approx(ms.mean(), rel=1e-6, abs=1e-6)
        assert r[f"p99_{name}_ms"] == pytest.approx(np.percentile(ms, 99), rel=1e-6, abs=1e-6)
    assert r["total_output_tokens"] == 11 and r["completed"] == 4
    assert r["output_throughput"] == pytest.approx(11 / r["duration"])
    assert r["request_goodput"] == pytest.approx(4 / r["duration"])
    assert "ttfts" not in (out / "results.csv").read_text()


def test_detailed_lists_of_a_failed_request_are_vllms():
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.bench.report import run_entry
    ok = RequestRecord(0, 3, send_time=0.0, chunk_times=[0.5, 0.75, 1.0], output_tokens=3, text="abc", success=True)
    bad = RequestRecord(1, 7, send_time=0.0, error="HTTP 400: too long")
    e = run_entry(RunResult("http", 2, [ok, bad], duration_s=2.0, num_requests=2), detailed=True)
    assert e["input_lens"] == [3, 7] and e["output_lens"] == [3, 0] and e["ttfts"] == [0.5, 0.0]
    assert e["itls"] == [[0.25, 0.25], []] and e["request_errors"] == [None, "HTTP 400: too long"]
    assert e["completed"] == 1 and e["failed"] == 1 and e["mean_tpot_ms"] == pytest.approx(250.0)
    assert "ttfts" not in run_entry(RunResult("http", 2, [ok, bad], duration_s=2.0, num_requests=2))


def test_results_json_has_vllms_save_result_names_of_the_run_settings():
    """A script reading `vllm bench serve --save-result` JSON reads max_concurrency, num_prompts and burstiness:
    results.json, said to use vLLM's key names, had only its own concurrency and num_requests."""
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.bench.report import run_entry
    ok = RequestRecord(0, 3, send_time=0.0, chunk_times=[0.5, 1.0], output_tokens=2, text="ab", success=True)
    e = run_entry(RunResult("infer", 4, [ok], duration_s=1.0, num_requests=6, request_rate=8.0))
    assert (e["max_concurrency"], e["num_prompts"], e["burstiness"]) == (4, 6, 1.0)
    assert (e["concurrency"], e["num_requests"], e["request_rate"]) == (4, 6, 8.0)


def test_timeline_plot_of_a_url_run_says_the_memory_is_the_clients_and_why_the_kv_panel_is_empty():
    """With --url the report has no peak memory (the server's is not seen), but timeline.png drew this client's
    RSS labelled plain "(RSS)" under "memory (GiB)", as if it were the server's, beside an empty KV panel."""
    from infer.bench.metrics import RunResult
    from infer.bench.plots import timeline_figure
    tl = [{"t": 0.1, "rss_bytes": 2**30, "in_flight": 1}, {"t": 0.2, "rss_bytes": 2**30, "in_flight": 0}]
    fig = timeline_figure([RunResult("http", 2, [], duration_s=0.2, num_requests=1, timeline=tl)])
    mem_ax, kv_ax = fig.axes
    labels = mem_ax.get_legend_handles_labels()[1]
    assert labels == ["http c=2 (this client's RSS, not the server's)"]
    assert any("no KV cache samples" in t.get_text() for t in kv_ax.texts)
    import matplotlib.pyplot as plt
    plt.close(fig)
