"""`infer bench --baseline no-spec` (session 46): does n-gram speculative decoding pay on this workload? The same
workload through the same engine and options without --speculative-config, after ours (ours freed first), with
ours/baseline ratios labelled "infer (no speculation)" and ours' acceptance figures."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
LABEL = "infer (no speculation)"


def _repetitive(tmp_path: Path, n: int = 4, tokens: int = 24) -> Path:
    """Prompts that repeat a phrase: tiny-llama's greedy output then repeats itself too, so drafts are made."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    path = tmp_path / "rep.jsonl"
    lines = []
    for i in range(n):
        seg = " ".join(words[i:i + 5]) + "."
        lines.append(json.dumps({"prompt": "Repeat: " + " ".join([seg] * 6), "max_tokens": tokens,
                                 "ignore_eos": True}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _bench(tmp_path: Path, *args: str):
    out = tmp_path / "out"
    res = runner.invoke(app, ["bench", "tiny-llama", "--out", str(out), "-q", *args])
    return res, out


def _results(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())


def test_no_spec_baseline_runs_the_same_engine_without_drafts_and_reports_ratios(tmp_path):
    res, out = _bench(tmp_path, "--speculative-config", SPEC, "--baseline", "no-spec", "-c", "1,2",
                      "--dataset", f"jsonl:{_repetitive(tmp_path)}", "--save-detailed")
    assert res.exit_code == 0, res.output
    results = _results(out)
    assert [r["concurrency"] for r in results] == [1, 2]
    for r in results:
        base = r["baseline"]
        assert r["label"] == "infer" and base["label"] == LABEL and base["backend"] == "infer"
        assert base["concurrency"] == r["concurrency"] and not base["partial"] and not r["partial"]
        # ours drafted and accepted some; the baseline's engine ran without speculation
        assert r["engine_stats"]["run_spec_decode_num_drafts"] > 0
        assert r["engine_stats"]["run_spec_decode_num_accepted_tokens"] > 0
        assert 0 < r["spec_decode_acceptance_rate"] <= 1 and r["spec_decode_mean_acceptance_length"] > 1
        assert not any(k.startswith(("spec_decode", "run_spec_decode")) and base["engine_stats"][k]
                       for k in base["engine_stats"])
        assert "spec_decode_acceptance_rate" not in base
        # greedy speculative output is the output without speculation
        assert r["generated_texts"] == base["generated_texts"] and r["output_lens"] == base["output_lens"]
        for key in ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
                    "median_e2el_ms", "mean_tpot_ms", "p99_e2el_ms"):
            assert r["ratio"][key] == pytest.approx(r[key] / base[key]), key
        assert r["config"]["baseline"] == "no-spec"
        assert r["config"]["engine"]["speculative_config"]["method"] == "ngram"
        assert "freed" in r["config"]["baseline_engine"]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [row["label"] for row in rows] == ["infer", LABEL, "infer", LABEL]
    report = (out / "report.md").read_text()
    for words in (f"Baseline = {LABEL}", "| accept rate | accept len |", "x TPOT p50", "x E2EL p50", "x out tok/s"):
        assert words in report, words
    labels = [t["label"] for t in json.loads((out / "timelines.json").read_text())]
    assert labels == ["infer", "infer", LABEL, LABEL]


def test_ours_is_freed_before_the_baseline_engine_is_built(tmp_path, monkeypatch):
    """One engine in memory at a time: ours (speculative) closed, then the baseline's built, then closed."""
    from infer.engine.llm_engine import LLMEngine
    events = []
    init, close = LLMEngine.__init__, LLMEngine.close

    def spy_init(self, config, *a, **k):
        events.append(("build", config.speculative_config is not None))
        init(self, config, *a, **k)

    def spy_close(self):
        events.append(("close", self.config.speculative_config is not None))
        close(self)
    monkeypatch.setattr(LLMEngine, "__init__", spy_init)
    monkeypatch.setattr(LLMEngine, "close", spy_close)
    res, out = _bench(tmp_path, "--speculative-config", SPEC, "--baseline", "no-spec", "-c", "2",
                      "--num-prompts", "2", "--input-len", "8", "--output-len", "4")
    assert res.exit_code == 0, res.output
    assert events[:4] == [("build", True), ("close", True), ("build", False), ("close", False)]


def test_no_spec_baseline_with_lora_and_request_rate(tmp_path):
    """The baseline is the same engine: it serves the same adapters and takes --request-rate (hf cannot)."""
    from infer.cli.demo import make_random_adapter
    from infer.models.tiny import ensure_builtin
    adapter = tmp_path / "ad"
    make_random_adapter(ensure_builtin("tiny-llama"), adapter, 4, ["q_proj", "v_proj"], seed=1)
    res, out = _bench(tmp_path, "--speculative-config", SPEC, "--baseline", "no-spec", "-c", "2",
                      "--dataset", f"jsonl:{_repetitive(tmp_path, n=2, tokens=8)}", "--lora", f"a={adapter}",
                      "--request-rate", "1000", "--save-detailed")
    assert res.exit_code == 0, res.output
    [r] = _results(out)
    base = r["baseline"]
    assert base["label"] == LABEL and r["request_rate"] == base["request_rate"] == 1000
    assert r["generated_texts"] == base["generated_texts"] and base["completed"] == 2
    assert r["config"]["loras"] == ["a"]
    assert "no adapters" not in (out / "report.md").read_text()  # the hf note is not this baseline's


@pytest.mark.parametrize("args, words", [
    (["--baseline", "no-spec"], "--baseline no-spec compares against the same engine without --speculative-config"),
    (["--baseline", "no-spec", "--url", "http://127.0.0.1:9"], "--baseline no-spec runs the in-process engine"),
    (["--baseline", "hf", "--request-rate", "4"], "--baseline hf sends each static batch at once"),
])
def test_no_spec_baseline_refusals(tmp_path, monkeypatch, args, words):
    from infer.bench import plan
    monkeypatch.setattr(plan, "_Target", None)  # refused before any model loads
    res, out = _bench(tmp_path, "-c", "1", "--num-prompts", "1", *args)
    assert res.exit_code == 2, res.output
    assert words in " ".join(res.output.split())
    assert not (out / "results.json").exists()


def test_no_spec_baseline_takes_request_rate(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("infer.bench.plan.run_plan", lambda plan, **kw: (seen.append(plan), (None, False))[1])
    res, _ = _bench(tmp_path, "--speculative-config", SPEC, "--baseline", "no-spec", "--request-rate", "4",
                    "-c", "1,4")
    assert res.exit_code == 0, res.output
    assert seen[0].baseline == "no-spec" and seen[0].rate == 4 and seen[0].levels == [1, 4]


def test_the_api_refuses_a_no_spec_plan_without_speculation(tmp_path):
    from infer.bench.plan import BenchPlan, run_plan
    from infer.engine.config import EngineConfig
    from infer.errors import ConfigError
    plan = BenchPlan(model="tiny-llama", levels=[1], out=tmp_path / "o", baseline="no-spec",
                     engine=EngineConfig("tiny-llama"))
    with pytest.raises(ConfigError, match="this plan has none"):
        run_plan(plan)


def test_ctrl_c_while_the_baseline_engine_is_built_keeps_ours_complete(tmp_path, monkeypatch):
    from infer.bench import plan as P
    from infer.engine.config import EngineConfig
    real = P._Target

    class Target(real):
        def __init__(self, p, tokenizer):
            if p.engine.speculative_config is None:
                raise KeyboardInterrupt
            super().__init__(p, tokenizer)
    monkeypatch.setattr(P, "_Target", Target)
    plan = P.BenchPlan(model="tiny-llama", levels=[1], out=tmp_path / "o", baseline="no-spec", num_prompts=2,
                       input_len=8, output_len=4, quiet=True,
                       engine=EngineConfig("tiny-llama", speculative_config={"method": "ngram",
                                                                             "num_speculative_tokens": 2}))
    [r], interrupted = P.run_plan(plan)
    assert interrupted and not r["partial"] and r["completed"] == 2 and "baseline" not in r


def test_hf_baseline_also_reports_latency_ratios():
    """The ratios cover TTFT, TPOT, ITL and E2EL for every baseline (one code path), shown in the latency table."""
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.bench.report import build_results, table_rows

    def run(backend, step):
        recs = [RequestRecord(0, 4, 0.0, chunk_times=[step, 2 * step, 3 * step], output_tokens=3, success=True)]
        return RunResult(backend, 1, recs, duration_s=3 * step, num_requests=1)
    [entry] = build_results([run("infer", 1.0)], [run("hf", 2.0)], env={"versions": {}, "device": "cpu",
                                                                       "git_commit": None})
    assert entry["ratio"]["median_tpot_ms"] == pytest.approx(0.5)
    assert entry["ratio"]["mean_ttft_ms"] == pytest.approx(0.5)
    titles, [row] = table_rows([entry], "latency")
    assert row[titles.index("x ITL p50")] == "0.50x"
    assert not math.isnan(entry["ratio"]["p99_e2el_ms"])


def test_a_baseline_cut_short_is_flagged_in_the_partial_column():
    """Ctrl-C during the no-spec baseline (which runs after all of ours) left ours whole and the row unflagged, while
    its ratios compared a whole run with part of one."""
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.bench.report import build_results, table_rows
    recs = [RequestRecord(0, 4, 0.0, chunk_times=[1.0, 2.0], output_tokens=2, success=True)]
    ours = RunResult("infer", 1, recs, duration_s=2.0, num_requests=1)
    base = RunResult("infer", 1, recs, duration_s=2.0, num_requests=2, partial=True, label=LABEL)
    [entry] = build_results([ours], [base], env={"versions": {}, "device": "cpu", "git_commit": None})
    titles, [row] = table_rows([entry])
    assert row[titles.index("partial")] == "baseline"
