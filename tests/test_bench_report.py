"""Benchmark report files: they exist, parse, and carry vLLM's key names and our ratios."""

import io
import json
import math

import pytest

from infer.bench.metrics import RequestRecord, RunResult
from infer.bench.report import build_results, print_table, write_report

VLLM_KEYS = ["completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput"] + [
    f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")]
OUR_KEYS = ["chars_per_s", "peak_memory_bytes", "concurrency", "partial", "config", "versions", "device",
            "git_commit"]


def _run(backend, conc, speed, partial=False):
    recs = [RequestRecord(i, 4, send_time=0.0, chunk_times=[0.1 * speed, 0.2 * speed, 0.3 * speed],
                          output_tokens=3, text="abcdef", success=True) for i in range(conc)]
    tl = [{"t": 0.0, "rss_bytes": 2**30, "in_flight": conc, "kv_usage": 0.5},
          {"t": 0.3, "rss_bytes": 2**30 + 5, "in_flight": 0, "kv_usage": 0.1}]
    if backend == "hf":
        tl = [{k: v for k, v in s.items() if k != "kv_usage"} for s in tl]
    return RunResult(backend, conc, recs, duration_s=0.3 * speed, num_requests=conc, partial=partial,
                     peak_rss_bytes=2**30 + 5, timeline=tl)


def test_files_exist_parse_and_have_keys(tmp_path):
    import pandas as pd
    ours = [_run("infer", 1, 1.0), _run("infer", 4, 1.0, partial=True)]
    base = [_run("hf", 1, 2.0), _run("hf", 4, 4.0)]
    out = tmp_path / "bench"
    console_file = io.StringIO()
    from rich.console import Console
    write_report(out, ours, base, config={"model": "tiny-llama", "workload": "random"},
                 console=Console(file=console_file, width=250))
    for name in ("results.json", "results.csv", "report.md", "timelines.json", "throughput.png", "latency.png",
                 "timeline.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in ("throughput.png", "latency.png", "timeline.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert isinstance(results, list) and [r["concurrency"] for r in results] == [1, 4]
    for r in results:
        for k in VLLM_KEYS + OUR_KEYS:
            assert k in r, k
        assert set(VLLM_KEYS) <= set(r["baseline"])
        assert r["config"]["model"] == "tiny-llama" and "torch" in r["versions"]
    assert results[1]["partial"] is True and results[0]["partial"] is False
    # ours: 4 reqs * 3 tokens / 0.3 s = 40 tok/s; baseline at c=4 took 4x as long -> ratio 4
    assert results[1]["output_throughput"] == pytest.approx(40.0)
    assert results[1]["ratio"]["output_throughput"] == pytest.approx(4.0)
    assert results[0]["ratio"]["chars_per_s"] == pytest.approx(2.0)
    assert results[0]["peak_memory_bytes"] == 2**30 + 5 and results[0]["max_kv_usage"] == 0.5
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 4 and set(df["backend"]) == {"infer", "hf"} and "p99_itl_ms" in df.columns
    md = (out / "report.md").read_text()
    assert "| conc |" in md and "4.00x" in md and "![throughput](throughput.png)" in md
    printed = console_file.getvalue()
    assert "out tok/s" in printed and "4.00x" in printed
    tls = json.loads((out / "timelines.json").read_text())
    assert len(tls) == 4 and tls[0]["timeline"][0]["kv_usage"] == 0.5


def test_without_baseline_and_empty_run(tmp_path):
    empty = RunResult("infer", 2, [], duration_s=0.0, num_requests=5, partial=True, aborted=2)
    results = build_results([_run("infer", 2, 1.0), empty], env={"versions": {}, "device": "cpu", "git_commit": None})
    assert "baseline" not in results[0] and results[1]["completed"] == 0
    assert math.isnan(results[1]["output_throughput"])
    buf = io.StringIO()
    from rich.console import Console
    print_table(results, Console(file=buf, width=250))
    assert "x out tok/s" not in buf.getvalue()
    write_report(tmp_path, [empty], show=False)
    written = json.loads((tmp_path / "results.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert written[0]["aborted"] == 2 and written[0]["output_throughput"] is None


def test_report_lists_the_servers_replicas(tmp_path):
    """A --url run against `infer serve --data-parallel 2` carries the server's /health figures; the report names
    each replica and whether it was alive at the end."""
    run = _run("http", 2, 1.0)
    run.engine_stats = {"num_running": 0, "replicas": [{"replica": 0, "alive": True, "host": "n1", "device": "cuda:0"},
                                                      {"replica": 1, "alive": False, "host": "n2"}]}
    write_report(tmp_path, [run])
    md = (tmp_path / "report.md").read_text()
    assert "## Replicas" in md and "2 engine replicas (1 alive at the end)" in md
    assert "- replica 0: alive (n1, cuda:0)" in md and "- replica 1: dead (n2)" in md
    write_report(tmp_path / "one", [_run("http", 2, 1.0)])
    assert "## Replicas" not in (tmp_path / "one" / "report.md").read_text()


def test_server_stats_are_empty_without_a_health_endpoint():
    from infer.bench.http_driver import server_stats
    assert server_stats("http://127.0.0.1:9") == {}  # nothing listens on the discard port


def test_a_labelled_baseline_is_named_everywhere(tmp_path):
    """A baseline that ran the base model while ours ran adapters carries its label into results.json, results.csv,
    report.md, the printed table and the plots' legend; an unlabelled one is named by its backend."""
    import pandas as pd
    from rich.console import Console

    from infer.bench.plots import _names
    base = _run("hf", 2, 2.0)
    base.label = "hf (base, no adapters)"
    buf = io.StringIO()
    results = write_report(tmp_path, [_run("infer", 2, 1.0)], [base], console=Console(file=buf, width=250))
    [r] = json.loads((tmp_path / "results.json").read_text())
    assert r["label"] == "infer" and r["baseline"]["label"] == "hf (base, no adapters)"
    assert r["baseline"]["backend"] == "hf"
    assert list(pd.read_csv(tmp_path / "results.csv")["label"]) == ["infer", "hf (base, no adapters)"]
    md = (tmp_path / "report.md").read_text()
    assert "Baseline = hf (base, no adapters): transformers generate on the base model, without the adapters" in md
    printed = " ".join(buf.getvalue().split())
    assert "infer bench: throughput, baseline hf (base, no adapters)" in printed
    assert "baseline = hf (base, no adapters)" in printed
    assert _names(results) == ("infer", "hf (base, no adapters)")
    plain = build_results([_run("infer", 2, 1.0)], [_run("hf", 2, 2.0)], env={"versions": {}, "device": "cpu",
                                                                                "git_commit": None})
    assert plain[0]["baseline"]["label"] == "hf" and _names(plain) == ("infer", "hf (baseline)")
