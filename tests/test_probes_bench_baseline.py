"""Fixes from probing `infer bench` against its oracles: the HF baseline's EOS handling and sampling (transformers 5
fills an eos_token_id of None back from the checkpoint; a checkpoint's repetition_penalty leaked into the greedy
baseline), a jsonl workload's own adapters, and --baseline with --request-rate."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from infer.bench.datasets import BenchRequest
from infer.bench.hf_baseline import load_hf, run_hf_generate
from infer.bench.metrics import RunResult
from infer.models.tiny import ensure_builtin

from helpers import BenchTargetStub

N = 30


def _engine_texts(path, reqs: list[BenchRequest]) -> list[tuple[int, str]]:
    from infer.bench.driver import run_in_process
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    eng = LLMEngine(EngineConfig(str(path), max_num_seqs=len(reqs)))
    run = run_in_process(eng, reqs, concurrency=len(reqs), progress=False)
    return [(r.output_tokens, r.text) for r in run.records]


@pytest.fixture(scope="module")
def early_eos():
    """tiny-llama, and a prompt whose greedy continuation reaches EOS well before N tokens."""
    hf = load_hf("tiny-llama")
    eos = hf.model.generation_config.eos_token_id
    for i in range(40):
        ids = hf.tokenizer.encode(f"Question {i}: what is the capital of France? Answer:")
        with torch.no_grad():
            out = hf.model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, pad_token_id=0,
                                    eos_token_id=eos)[0, len(ids):].tolist()
        if eos in out and out.index(eos) < N - 5:
            return hf, ids, out.index(eos) + 1
    pytest.skip("no prompt reaches EOS early with these weights")


def test_hf_baseline_that_ignores_eos_runs_past_it(early_eos):
    hf, ids, _ = early_eos
    req = BenchRequest(None, ids, N, ignore_eos=True)
    [rec] = run_hf_generate(hf, [req], batch_size=1, progress=False).records
    assert rec.success and rec.output_tokens == N and len(rec.chunk_times) == N  # was: stopped at EOS
    assert [(rec.output_tokens, rec.text)] == _engine_texts(ensure_builtin("tiny-llama"), [req])


def test_hf_baseline_batch_mixing_ignore_eos(early_eos):
    hf, ids, stop_at = early_eos
    reqs = [BenchRequest(None, ids, N, ignore_eos=True), BenchRequest(None, ids, N, ignore_eos=False)]
    a, b = run_hf_generate(hf, reqs, batch_size=2, progress=False).records
    ours = _engine_texts(ensure_builtin("tiny-llama"), reqs)
    assert (a.output_tokens, a.text) == ours[0]  # was: EOS then pad tokens, counted as N tokens, text cut short
    assert (b.output_tokens, b.text) == ours[1] and b.output_tokens == stop_at and b.finish_reason == "stop"


def test_hf_baseline_is_plain_greedy_whatever_generation_config_says(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(ensure_builtin("tiny-qwen2"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(repetition_penalty=1.5, no_repeat_ngram_size=2, do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    (path / "generation_config.json").write_text(json.dumps(gen))
    from infer.bench.datasets import random_requests
    from infer.engine.setup import load_tokenizer
    reqs = random_requests(load_tokenizer(path), 2, 8, 24, seed=0)
    base = run_hf_generate(load_hf(str(path)), reqs, batch_size=1, progress=False)
    assert [(r.output_tokens, r.text) for r in base.records] == _engine_texts(path, reqs)


class _FakeTarget(BenchTargetStub):
    """The engine's side of a bench plan without an engine: each run's adapters go to `seen`, no request runs."""
    seen: list = []

    def run(self, requests, c):
        self.seen.append([r.lora for r in requests])
        return super().run(requests, c)


def test_jsonl_lines_keep_their_own_adapter(tmp_path, monkeypatch):
    """--lora registers the adapters a jsonl workload names; it must not spread them over the lines round-robin."""
    import infer.bench.plan as P
    from infer.engine.config import EngineConfig
    lines = [{"prompt": "hello there", "lora": "a1"}, {"prompt": "the base model"}, {"prompt": "again", "lora": "a1"}]
    f = tmp_path / "w.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    seen = []
    monkeypatch.setattr(_FakeTarget, "seen", seen)
    monkeypatch.setattr(P, "_Target", _FakeTarget)
    plan = P.BenchPlan(model="tiny-llama", levels=[2], out=tmp_path / "out", dataset=f"jsonl:{f}", loras=["a0", "a1"],
                       quiet=True, engine=EngineConfig("tiny-llama"))
    P.run_plan(plan)
    assert seen == [["a1", None, "a1"]]  # was: ["a0", "a1", "a0"]
    seen.clear()
    f.write_text("".join(json.dumps({"prompt": x["prompt"]}) + "\n" for x in lines))  # no adapters named: spread
    P.run_plan(plan)
    assert seen == [["a0", "a1", "a0"]]


def test_baseline_with_a_request_rate_is_refused(tmp_path, monkeypatch):
    from infer.cli.main import app
    import infer.bench.plan as P
    monkeypatch.setattr(P, "run_plan", lambda *a, **k: pytest.fail("the plan ran"))
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--baseline", "hf", "--request-rate", "5", "-q",
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "--baseline hf sends each static batch at once" in res.output
    assert "Traceback" not in res.output


def test_a_baseline_cut_short_leaves_our_complete_run_unmarked(tmp_path, monkeypatch):
    """Ctrl-C during the HF baseline marked the engine's run, which had finished, partial as well."""
    import infer.bench.hf_baseline as H
    import infer.bench.plan as P
    from infer.engine.config import EngineConfig

    def cut_short(hf, requests, batch_size, **kwargs):
        run = RunResult("hf", batch_size, [], 1.0, len(requests))
        run.partial = True
        return run
    monkeypatch.setattr(P, "_Target", _FakeTarget)
    monkeypatch.setattr(H, "load_hf", lambda *a, **k: object())
    monkeypatch.setattr(H, "run_hf_generate", cut_short)
    plan = P.BenchPlan(model="tiny-llama", levels=[2, 4], out=tmp_path / "out", baseline="hf", quiet=True,
                       engine=EngineConfig("tiny-llama"))
    _, interrupted = P.run_plan(plan)
    assert interrupted
    # ours runs every level before the baseline (session 51): the baseline's second level never ran
    r, second = json.loads((tmp_path / "out" / "results.json").read_text())
    assert r["partial"] is False and r["baseline"]["partial"] is True  # ours was marked partial too
    assert second["partial"] is False and "baseline" not in second
