"""Session 48 (engine): draft-model speculation's step within max_num_batched_tokens (the draft's catch-up counted),
the unknown-adapter error's remedy in the caller's terms, and the quantization report's lm_head row."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from quant_helpers import needs_gptqmodel


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


# ------------------------------------------------------------------ 1. the draft's first forward within the budget
def _first_forwards(monkeypatch) -> list:
    """The tokens of the draft's first forward of each step (its catch-up and the step's own tokens)."""
    from infer.engine.draft import DraftRunner
    fed, real_propose, real_forward = [], DraftRunner.propose, DraftRunner._forward

    def propose(self, batch):
        fed.append(None)
        return real_propose(self, batch)

    def forward(self, feeds, rows):
        if fed[-1] is None:
            fed[-1] = sum(len(tokens) for _, _, tokens in feeds)
        return real_forward(self, feeds, rows)
    monkeypatch.setattr(DraftRunner, "propose", propose)
    monkeypatch.setattr(DraftRunner, "_forward", forward)
    return fed


@pytest.mark.parametrize("budget, k, lengths", [(6, 1, (3, 3, 30)), (7, 2, (2, 3, 2, 25, 9))])
def test_the_drafts_first_forward_never_exceeds_max_num_batched_tokens(path, monkeypatch, budget, k, lengths):
    """Sequences whose drafts were all accepted (the last one's draft KV fed only the next step) lose their drafts
    to a prompt's chunk: the draft still feeds their catch-up token, which the step's budget must count."""
    fed = _first_forwards(monkeypatch)
    kw = dict(block_size=4, max_num_batched_tokens=budget, max_num_seqs=len(lengths))
    llm = LLM(str(path), speculative_config={"model": str(path), "num_speculative_tokens": k}, **kw)
    prompts = [list(range(10 + 40 * i, 10 + 40 * i + n)) for i, n in enumerate(lengths)]
    got = [o.token_ids for o in llm.generate(prompts, greedy(12))]
    assert got == [o.token_ids for o in LLM(str(path), **kw).generate(prompts, greedy(12))]
    assert fed and max(fed) <= budget, fed
    s = llm.engine.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0


def test_the_scheduler_counts_a_lagging_draft_against_the_budget(path):
    """Scheduler unit: a decoding sequence whose draft lags one token costs two of the budget without drafts, and
    a draft of its own needs no more than that one."""
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=5, max_num_seqs=4,
              speculative_config={"model": str(path), "num_speculative_tokens": 1})
    sched = llm.engine.scheduler
    assert sched.draft_model
    from infer.engine.sequence import Sequence
    seqs = [Sequence(f"r{i}", [3 + i, 4, 5, 6, 7], greedy(8), None) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.num_new_tokens == [5]
    for s in seqs[:1]:  # as after a step that accepted every draft: the draft KV lacks the last token
        s.num_computed_tokens, s.draft_computed = 5, 4
    batch = sched.schedule()
    # the first: its own token and its draft's catch-up (2); the second: the 3 left of its prompt
    assert batch.num_new_tokens == [1, 3] and sched.lag(seqs[0]) == 1
    draft_fed = sum(n + sched.lag(s) for s, n in zip(batch.seqs, batch.num_new_tokens))
    assert draft_fed <= 5


def test_an_admitted_prefix_hit_whose_draft_lags_counts_its_catch_up(path, monkeypatch):
    """A request admitted on a cached prefix whose last slot the draft never wrote (block_manager's draft_upto)
    catches up that slot with its first chunk: the budget left to the requests admitted after it counts it."""
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=5, max_num_seqs=4,
              speculative_config={"model": str(path), "num_speculative_tokens": 1})
    sched = llm.engine.scheduler
    from infer.engine.sequence import Sequence
    a, b = Sequence("a", list(range(3, 11)), greedy(4), None), Sequence("b", [7, 8, 9], greedy(4), None)
    real = sched.bm.allocate

    def allocate(seq, *rest):
        real(seq, *rest)
        if seq is a:  # as a hit of its first block, whose last slot's draft KV is stale
            seq.num_computed_tokens, seq.draft_computed = 4, 3
    monkeypatch.setattr(sched.bm, "allocate", allocate)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"] and batch.num_new_tokens == [4]
    assert sum(n + sched.lag(s) for s, n in zip(batch.seqs, batch.num_new_tokens)) <= 5


# ------------------------------------------------------------------ 2. an unknown adapter, in the caller's terms
@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from lora_helpers import hf_float, save_adapter
    from pathlib import Path
    hf = hf_float(Path(ensure_builtin("tiny-llama")))
    return save_adapter(hf, tmp_path_factory.mktemp("s48-adapter") / "qv", seed=3)


def _run(tmp_path, lines, *extra):
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(app, ["run", str(ensure_builtin("tiny-llama")), str(inp), "-o", str(out), "-q",
                                   "--max-new-tokens", "3", "--max-model-len", "64", *extra])
    return res, {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("with_lora", [False, True])
def test_infer_run_names_the_lora_option_for_an_unknown_adapter_not_the_api(tmp_path, adapter, with_lora):
    lines = [{"id": "a", "prompt": "hello there", "lora": "sql"}, {"id": "b", "prompt": "hi"}]
    res, recs = _run(tmp_path, lines, *(["--lora", f"qv={adapter}"] if with_lora else []))
    assert res.exit_code == 1, res.output
    err = recs["a"]["error"]
    assert recs["a"]["finish_reason"] == "error" and "unknown LoRA adapter 'sql'" in err
    assert "--lora sql=PATH" in err and "add_lora" not in err and "LLM(" not in err and "lora_request" not in err
    assert ("registered adapters: qv;" if with_lora else "registered adapters: none;") in err
    assert recs["b"]["error"] is None and len(recs["b"]["token_ids"]) == 3


def test_the_api_names_add_lora_and_lora_request_with_the_errors_fields(path, adapter):
    from infer.errors import RequestError, UnknownAdapterError
    import infer
    assert infer.UnknownAdapterError is UnknownAdapterError and issubclass(UnknownAdapterError, RequestError)
    llm = LLM(str(path), max_model_len=64, loras={"qv": str(adapter)})
    with pytest.raises(UnknownAdapterError) as e:
        llm.engine.validate([5, 6, 7], greedy(2), "sql")
    assert (e.value.name, e.value.known, e.value.slots) == ("sql", ("qv",), True)
    assert "registered adapters: qv" in str(e.value) and "LLM.add_lora" in str(e.value)
    assert "lora_request=LoRARequest" in str(e.value)
    bare = LLM(str(path), max_model_len=64)
    with pytest.raises(UnknownAdapterError) as e:
        bare.engine.validate([5, 6, 7], greedy(2), "sql")
    assert e.value.slots is False and e.value.known == ()
    assert "enable_lora=True" in str(e.value) and "LLM.add_lora" in str(e.value)


def test_the_server_answers_an_unknown_adapter_with_a_404_naming_the_served_ones(adapter):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, loras={"qv": str(adapter)}))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as url:
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        bad = httpx.post(f"{url}/v1/completions", json={**body, "model": "sql"}, timeout=60)
        assert bad.status_code == 404, bad.text
        msg = bad.json()["error"]["message"]
        assert "'sql' does not exist" in msg and "qv" in msg and "tiny-llama" in msg and "add_lora" not in msg
        for model in ("qv", "tiny-llama"):  # the others still complete
            ok = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=60)
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length", ok.text


# ------------------------------------------------------------------ 3. the quantization report's lm_head row
def _gptq_log(head_module: str = "lm_head", head_loss=6e-5) -> dict:
    """GPTQModel's per-module log of a 2-layer model quantized with lm_head=True: the head is its layer 2."""
    rows = [{"layer": layer, "module": m, "loss": 1e-3 * (layer + 1), "samples": 256, "damp": 0.05, "time": 0.01}
            for layer in (1, 0) for m in ("self_attn.q_proj", "mlp.down_proj")]
    return {"gptq": [rows[2], rows[3], rows[0], rows[1],
                     {"layer": 2, "module": head_module, "loss": head_loss, "samples": 256, "damp": 0.05,
                      "time": 0.07}]}


def test_the_report_keys_the_head_as_lm_head_not_a_decoder_layer(tmp_path):
    import pandas as pd

    from infer.quant.quantize import report_frame
    frame = report_frame(_gptq_log(), 2)
    assert list(frame.layer) == [0, 0, 1, 1, "lm_head"] and list(frame.module)[-1] == "lm_head"
    frame.to_csv(tmp_path / "r.csv", index=False)
    back = pd.read_csv(tmp_path / "r.csv")
    decoder = back[back.layer != "lm_head"]
    assert decoder.layer.astype(int).nunique() == 2 and len(back[back.layer == "lm_head"]) == 1
    # a head of another name is known by its number: the decoder's layers end before it
    assert list(report_frame(_gptq_log("embed_out"), 2).layer)[-1] == "lm_head"
    assert list(report_frame({"gptq": _gptq_log()["gptq"][:4]}, 2).layer) == [0, 0, 1, 1]


def test_the_summaries_name_the_head_lm_head(tmp_path, capsys):
    import math

    from infer.cli.quantize import RichObserver, print_summary
    from infer.errors import InferError
    from infer.quant.quantize import QuantizeOptions, QuantizeResult, _check_losses, report_frame
    result = QuantizeResult(tmp_path, report_frame(_gptq_log(head_loss=1.0), 2), None, 1.0)
    print_summary(result, QuantizeOptions(lm_head=True))
    out = capsys.readouterr().out
    assert "Largest error: lm_head (loss 1.000e+00)" in out and "layer 2" not in out, out
    with pytest.raises(InferError) as e:
        _check_losses(tmp_path, _gptq_log(head_loss=math.nan), 2)
    assert "non-finite error: lm_head (loss nan)" in str(e.value) and "layer 2" not in str(e.value)
    import io
    from types import SimpleNamespace

    from rich.console import Console
    obs = RichObserver(Console(file=io.StringIO()), lm_head=True)  # the progress: 2 layers and the head
    obs.start(2, SimpleNamespace(source="built-in", samples=[[1]], num_tokens=1))
    task = obs.progress.tasks[0]
    obs.stop()
    assert task.total == 3 and task.description == "Quantizing layers and lm_head"


@needs_gptqmodel
def test_quantize_lm_head_writes_the_heads_row_as_lm_head(tmp_path):
    import pandas as pd
    from typer.testing import CliRunner

    from infer.cli.main import app
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), "--lm-head", "--group-size", "32",
                                   "--num-samples", "4", "--seq-len", "64"])
    assert res.exit_code == 0, res.output
    report = pd.read_csv(out / "quantization_report.csv")
    assert list(report.layer)[-1] == "lm_head" and list(report.module)[-1] == "lm_head"
    assert sorted(set(report.layer[:-1].astype(int))) == [0, 1]  # tiny-llama's two decoder layers, no third
