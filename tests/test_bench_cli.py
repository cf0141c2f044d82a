"""`infer bench` through typer's CliRunner: report files with vLLM's keys, the HF baseline ratios, concurrency
lists, --url against our own server (same tokens as in-process), the split LoRA policy, Ctrl-C, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()
SMALL = ["--num-prompts", "6", "--input-len", "8", "--output-len", "6", "-q"]
VLLM_KEYS = {"completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput", "duration"} | {
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")}


def _bench(tmp_path: Path, *args: str, name: str = "out"):
    out = tmp_path / name
    res = runner.invoke(app, ["bench", "tiny-llama", "--out", str(out), *args])
    return res, out


def _results(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())


def test_in_process_writes_every_report_file(tmp_path):
    res, out = _bench(tmp_path, "-c", "2", *SMALL)
    assert res.exit_code == 0, res.output
    for f in ("results.json", "results.csv", "report.md", "throughput.png", "latency.png", "timeline.png"):
        assert (out / f).is_file(), f
    [r] = _results(out)
    assert VLLM_KEYS <= set(r)
    assert r["backend"] == "infer" and r["concurrency"] == 2 and not r["partial"]
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_input_tokens"] == 6 * 8 and r["total_output_tokens"] == 6 * 6
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert r["config"]["engine"]["max_num_seqs"] >= 2
    assert "output_throughput" in (out / "results.csv").read_text().splitlines()[0]


def test_baseline_hf_adds_ratios(tmp_path):
    res, out = _bench(tmp_path, "-c", "3", "--baseline", "hf", *SMALL)
    assert res.exit_code == 0, res.output
    [r] = _results(out)
    base = r["baseline"]
    assert base["backend"] == "hf" and base["concurrency"] == 3
    assert base["total_output_tokens"] == r["total_output_tokens"] == 36
    for key in ("output_throughput", "request_throughput", "total_token_throughput", "chars_per_s"):
        assert r["ratio"][key] == pytest.approx(r[key] / base[key])
    assert "x out tok/s" in (out / "report.md").read_text()


def test_concurrency_list_gives_one_result_per_level(tmp_path):
    res, out = _bench(tmp_path, "-c", "1,4", *SMALL)
    assert res.exit_code == 0, res.output
    results = _results(out)
    assert [r["concurrency"] for r in results] == [1, 4]
    assert all(r["completed"] == 6 for r in results)


def test_url_run_matches_in_process(tmp_path):
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine

    prompts = tmp_path / "p.jsonl"  # EOS is not ignored: the lengths come from greedy decoding itself
    prompts.write_text("".join(json.dumps({"prompt": f"tell me about item {i} please", "max_new_tokens": 5 + i})
                               + "\n" for i in range(5)))
    wl = ["--dataset", f"jsonl:{prompts}", "-c", "2", "-q"]
    res, local = _bench(tmp_path, *wl, name="local")
    assert res.exit_code == 0, res.output
    server = Server(AsyncEngine(LLMEngine(EngineConfig("tiny-llama", max_model_len=256))), "tiny-llama")
    with serve_in_thread(server) as url:
        res, remote = _bench(tmp_path, *wl, "--url", url, "--baseline", "hf", name="remote")
    assert res.exit_code == 0, res.output
    [a], [b] = _results(local), _results(remote)
    assert b["backend"] == "http" and b["completed"] == a["completed"] == 5
    assert b["total_output_tokens"] == a["total_output_tokens"]
    assert b["mean_reply_chars"] == pytest.approx(a["mean_reply_chars"])
    assert "ratio" in b and b["baseline"]["backend"] == "hf"


# ---------------------------------------------------------------------------------------------- LoRA policies
@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float, save_adapter
    hf = hf_float(Path(ensure_builtin("tiny-llama")))
    root = tmp_path_factory.mktemp("adapters")
    return {f"a{i}": save_adapter(hf, root / f"a{i}", i, scale=0.3, r=4, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj"]) for i in range(3)}


def _adapters_per_step(engine, monkeypatch) -> list[set]:
    seen: list[set] = []
    step = engine.step

    def spy():
        outs = step()
        if engine.scheduler.running or outs:
            seen.append({s.lora for s in engine.scheduler.running} | {o.lora for o in outs})
        return outs
    monkeypatch.setattr(engine, "step", spy)
    return seen


def test_split_policy_never_mixes_adapters(adapters, monkeypatch):
    from infer.bench.datasets import BenchRequest, assign_loras
    from infer.bench.driver import run_in_process
    from infer.bench.lora_split import run_split
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, max_loras=3, max_lora_rank=8,
                                    loras={k: str(v) for k, v in adapters.items()}))
    reqs = assign_loras([BenchRequest(None, [5 + i, 6, 7], 4, ignore_eos=True) for i in range(9)], list(adapters))
    seen = _adapters_per_step(engine, monkeypatch)
    split = run_split(engine, reqs, concurrency=3, progress=False)
    assert split.backend == "infer-split" and [r.index for r in split.records] == list(range(9))
    assert all(r.success and r.lora == reqs[r.index].lora for r in split.records)
    assert seen and all(len(s) == 1 for s in seen)
    seen.clear()
    mixed = run_in_process(engine, reqs, concurrency=3, progress=False)
    assert any(len(s) > 1 for s in seen)  # the engine itself does mix them
    assert sum(r.output_tokens for r in mixed.records) == sum(r.output_tokens for r in split.records) == 36


def test_lora_mix_and_policy_on_the_cli(tmp_path, adapters):
    loras = [a for k, v in adapters.items() for a in ("--lora", f"{k}={v}")]
    res, out = _bench(tmp_path, "-c", "3", "--lora-mix", "2", "--lora-policy", "split", *loras, *SMALL)
    assert res.exit_code == 0, res.output
    [r] = _results(out)
    assert r["backend"] == "infer-split" and r["completed"] == 6
    assert r["config"]["loras"] == ["a0", "a1"] and r["config"]["lora_policy"] == "split"
    res, _ = _bench(tmp_path, "--lora-mix", "4", *loras, *SMALL)
    assert res.exit_code == 2 and "--lora-mix 4 needs 4 adapters but 3 are registered" in res.output


# ---------------------------------------------------------------------------------------------- Ctrl-C, bad input
def test_ctrl_c_writes_a_partial_report(tmp_path, monkeypatch):
    from infer.engine.llm_engine import LLMEngine
    step, calls = LLMEngine.step, [0]

    def interrupted(self):
        calls[0] += 1
        if calls[0] == 12:  # past the warmup, inside the measured run
            raise KeyboardInterrupt
        return step(self)
    monkeypatch.setattr(LLMEngine, "step", interrupted)
    res, out = _bench(tmp_path, "-c", "2,4", "--num-prompts", "6", "--input-len", "8", "--output-len", "20", "-q")
    assert res.exit_code == 130, res.output
    assert "partial" in res.output and "Traceback" not in res.output
    [r] = _results(out)  # the second level never ran
    assert r["partial"] is True and r["completed"] < 6 and r["aborted"] > 0


@pytest.mark.parametrize("args, message", [
    (["--url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
    (["--url", "localhost:8000"], "is not an http(s) URL"),
    (["-c", "0"], "every level must be at least 1"),
    (["-c", "a,b"], "is not a number or a comma-separated list"),
    (["-c", "4,100000"], "--concurrency 100000 is more than the engine runs at once (65536)"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--dataset", "alpaca"], "--dataset 'alpaca' is not a known dataset"),
    (["--dataset", "jsonl:/nonexistent/p.jsonl"], "is not a file"),
    (["--baseline", "vllm"], "--baseline 'vllm' is not supported"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--lora-policy", "fair"], "--lora-policy 'fair' is not one of mixed, split"),
    (["--lora-mix", "1"], "--lora-mix 1 needs 1 adapters but 0 are registered"),
    (["--lora-policy", "split", "--url", "http://127.0.0.1:9"], "split runs the in-process engine"),
    (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1), got 1.0"),
    (["--random-range-ratio", "-0.5"], "--random-range-ratio must be in [0, 1), got -0.5"),
    (["--random-range-ratio", "nan"], "--random-range-ratio must be in [0, 1), got nan"),
    (["--random-range-ratio", "0.5", "--dataset", "liteqwen"], "--random-range-ratio applies to --dataset random"),
    (["--input-len", "200", "--output-len", "50", "--random-range-ratio", "0.5", "--max-model-len", "256"],
     "(the longest drawn with --random-range-ratio 0.5: 375) do not fit the engine's max length of 256"),
])
def test_bad_input_exits_2(tmp_path, args, message):
    res, _ = _bench(tmp_path, *args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("kind", ["jsonl", "sharegpt"])
def test_dataset_not_utf8_exits_2_before_loading(tmp_path, kind, monkeypatch):
    import infer.bench.plan as plan
    monkeypatch.setattr(plan, "_Target", None)  # the check comes before any model is loaded
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"prompt": "caf\xe9"}\n')
    res, _ = _bench(tmp_path, "--dataset", f"{kind}:{bad}", "-q")
    assert res.exit_code == 2, res.output
    assert "is not UTF-8 text (byte 15" in " ".join(res.output.split()) and "Traceback" not in res.output
    res, _ = _bench(tmp_path, "--dataset", f"{kind}:", "-q")
    assert res.exit_code == 2 and f"--dataset {kind}: names no file" in res.output


def test_prompt_with_a_unicode_line_separator_is_one_line(tmp_path):
    """jsonl lines end at \\n only (as `infer run` reads them): U+2028 inside a prompt string is text."""
    ds = tmp_path / "p.jsonl"
    ds.write_text(json.dumps({"prompt": "one\u2028two", "max_new_tokens": 3}, ensure_ascii=False) + "\n",
                  encoding="utf-8")
    res, out = _bench(tmp_path, "-c", "1", "--dataset", f"jsonl:{ds}", "-q")
    assert res.exit_code == 0, res.output
    assert _results(out)[0]["completed"] == 1


def test_out_with_a_tilde_is_one_folder(tmp_path, monkeypatch):
    """A literal ~ (quoted, or --out=~/x) means the home folder for every report file, not ./~ for some."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["bench", "tiny-llama", "--out", "~/rep", "-c", "2", *SMALL])
    assert res.exit_code == 0, res.output
    rep = tmp_path / "home" / "rep"
    assert (rep / "results.json").is_file() and (rep / "results.csv").is_file()
    assert not (tmp_path / "~").exists()


def test_malformed_dataset_line_exits_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    res, _ = _bench(tmp_path, "--dataset", f"jsonl:{bad}", "-q")
    assert res.exit_code == 2, res.output
    assert "line 2 is not valid JSON" in res.output and "Traceback" not in res.output


def test_random_range_ratio_runs_uneven_requests(tmp_path):
    """The drawn lengths are the ones run: the report's input and output token totals are the sums of the
    workload's (EOS ignored), and the report's config names the ratio."""
    from transformers import AutoTokenizer

    from infer.bench.datasets import load_workload
    from infer.models.tiny import ensure_builtin
    res, out = _bench(tmp_path, "-c", "4", "--num-prompts", "8", "--input-len", "12", "--output-len", "8",
                      "--random-range-ratio", "0.5", "-q")
    assert res.exit_code == 0, res.output
    [r] = _results(out)
    wl = load_workload("random", AutoTokenizer.from_pretrained(ensure_builtin("tiny-llama")), num_prompts=8,
                       input_len=12, output_len=8, range_ratio=0.5)
    assert len({len(q.prompt_token_ids) for q in wl.requests}) > 1
    assert r["total_input_tokens"] == sum(len(q.prompt_token_ids) for q in wl.requests)
    assert r["total_output_tokens"] == sum(q.output_len for q in wl.requests)
