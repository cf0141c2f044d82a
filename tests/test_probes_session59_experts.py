"""Session 59: reload_weights compiles the fused MoE's variants of a new experts' layout (act-order or not, gptq or
gptq_v2, group size) as the engine's start does (LLMEngine._warm_moe_blocks), not on the first long prefill;
transformers 4's per-expert adapters served as peft 0.21 computes them (or refused where peft's conversion breaks
them); `infer run --resume --retry-failed`."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams

from helpers import random_prompts

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


def record_int4_launches(monkeypatch) -> list:
    """Each int4 fused MoE matmul launched from now on as its compiled variant's key: its weight's shape, group size,
    act-order (a permutation) and zero points' format, BLOCK_M, ROW_DIV, WEIGHTED, x's dtype."""
    from infer.kernels import moe
    launched = []
    real = moe._gemm_int4

    def gemm(a, w, out, weights, aligned, top_k, row_div, weighted):
        launched.append((w.out_features, w.in_features, w.group_size, w.perm is None, bool(w.zeros_v1),
                         aligned.block_m, row_div, weighted, a.dtype))
        return real(a, w, out, weights, aligned, top_k, row_div, weighted)
    monkeypatch.setattr(moe, "_gemm_int4", gemm)
    return launched


@interpreted
def test_reload_weights_compiles_the_new_experts_layouts_variants_before_a_long_prefill(tmp_path, monkeypatch):
    """An engine that warmed its fused MoE at start (a GPU's; the GPU code path, interpreted) on act-order experts,
    reloaded with plain-group ones: the reload launches the plain layout's variants of every BLOCK_M a step can
    choose, so that a 130-token prefill and its decode then launch none it has not; a second reload of the same
    layout launches nothing. The tokens are a fresh engine's on the plain checkpoint."""
    import shutil

    from quant_helpers import int4_kernel_path
    from test_probes_session55_moe import build
    from test_probes_session56_review_moeq import rtn_gptq
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True)
    rtn_gptq(tmp_path / "base", tmp_path / "plain")
    rtn_gptq(tmp_path / "base", tmp_path / "act", act_order=True)
    shutil.copytree(tmp_path / "act", tmp_path / "m")
    int4_kernel_path(monkeypatch)
    launched = record_int4_launches(monkeypatch)
    prompt = random_prompts(512, (130, 131), seed=3)[0]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    opts = dict(block_size=8, max_num_batched_tokens=136, max_num_seqs=2, max_model_len=160)
    with LLM(str(tmp_path / "plain"), **opts) as llm:
        want = llm.generate([prompt], params)[0].token_ids
    with LLM(str(tmp_path / "m"), **opts) as llm:
        launched.clear()
        llm.engine._warm_moe_blocks()  # (the start of an engine on a GPU: warm_kernels)
        warmed = set(launched)
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / "plain" / f, tmp_path / "m" / f)
        launched.clear()
        llm.engine.reload_weights()
        reloaded = set(launched)
        launched.clear()
        got = llm.generate([prompt], params)[0].token_ids
        steps = set(launched)
        launched.clear()
        llm.engine.reload_weights()
        again = list(launched)
    assert got == want
    assert {bm for *_, bm, _, _, _ in steps} == {16, 32}, steps  # (the prefill's blocks and the decode's)
    assert reloaded - warmed and steps <= warmed | reloaded, sorted(steps - warmed - reloaded)
    assert again == []


def _batch(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"The rain in Spain, {cid}", "max_tokens": 4, "temperature": 0, **body}}


RETRY_LINES = [_batch("support-1", model="support"), _batch("base"), _batch("support-2", model="support")]


@pytest.fixture(scope="module")
def retry_setup(tmp_path_factory):
    """(tmp folder, the input, an adapter "support" of tiny-llama, the records of a run given it from the start by
    custom_id)."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float, save_adapter
    tmp = tmp_path_factory.mktemp("retry")
    adapter = save_adapter(hf_float(ensure_builtin("tiny-llama")), tmp / "support", seed=1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    inp = tmp / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in RETRY_LINES))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp / "ref.jsonl"), "-q",
                                   "--output-format", "openai", "--lora", f"support={adapter}"])
    assert res.exit_code == 0, res.output
    return tmp, inp, adapter, _by_id(tmp / "ref.jsonl")


def _by_id(path) -> dict:
    """An OpenAI batch output's records by custom_id (each id once), as (status, choices): what the line answered."""
    import json
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["custom_id"] for r in recs}) == len(recs), [r["custom_id"] for r in recs]
    return {r["custom_id"]: (r["response"]["status_code"], (r["response"]["body"] or {}).get("choices"))
            for r in recs}


def _run_retry(inp, out, *args):
    from typer.testing import CliRunner

    from infer.cli.main import app
    return CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--output-format", "openai",
                                    *map(str, args)])


def test_retry_failed_reruns_the_error_records_lines_once_their_adapter_is_given(retry_setup, tmp_path):
    """Lines whose body.model names an adapter not given get vLLM's 404 record; `--resume` keeps them (an error
    record is final), and refuses the added --lora without --retry-failed; `--resume --retry-failed --lora
    support=PATH` runs exactly those lines again: the output ends with one record per id, the base line's record
    as it was, the retried lines' as a run given the adapter from the start writes them; the fingerprint takes the
    adapter, so a later --resume with it has nothing to do."""
    _, inp, adapter, ref = retry_setup
    out = tmp_path / "out.jsonl"
    assert _run_retry(inp, out).exit_code == 1
    first = out.read_bytes()
    assert {k: v[0] for k, v in _by_id(out).items()} == {"support-1": 404, "base": 200, "support-2": 404}
    res = _run_retry(inp, out, "--resume")
    assert res.exit_code == 1 and "2 error record(s) from before this resume" in res.output, res.output
    res = _run_retry(inp, out, "--resume", "--lora", f"support={adapter}")
    assert res.exit_code == 2 and "written with other options: loras" in res.output, res.output
    assert out.read_bytes() == first
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}")
    assert res.exit_code == 0, res.output
    assert _by_id(out) == ref
    base_line = next(line for line in first.splitlines() if b'"base"' in line)
    assert base_line in out.read_bytes().splitlines()
    done = out.read_bytes()
    assert _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}").exit_code == 0
    assert _run_retry(inp, out, "--resume", "--lora", f"support={adapter}").exit_code == 0
    assert out.read_bytes() == done


def test_retry_failed_killed_midway_loses_nothing_and_the_next_resume_completes_it(retry_setup, tmp_path,
                                                                                   monkeypatch):
    """A --retry-failed run killed after its first retried record is on disk (the output holds that line's error
    and its new record): the next `--resume --retry-failed` keeps the new record in place of the error, runs the
    other failed line again, and ends with one record per id, a run's given the adapter from the start."""
    from infer.cli import batch_io
    _, inp, adapter, ref = retry_setup
    out = tmp_path / "out.jsonl"
    assert _run_retry(inp, out).exit_code == 1
    real = batch_io.RecordWriter.write

    def write_then_stop(self, record):
        real(self, record)
        raise KeyboardInterrupt
    monkeypatch.setattr(batch_io.RecordWriter, "write", write_then_stop)
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}")
    assert res.exit_code == 130, res.output
    monkeypatch.setattr(batch_io.RecordWriter, "write", real)
    assert len(out.read_text().splitlines()) == 4  # (the retried line's error and its new record)
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}")
    assert res.exit_code == 0 and "replaced 1 error record(s)" in res.output, res.output
    assert _by_id(out) == ref


def test_retry_failed_needs_resume_and_keeps_other_option_checks(retry_setup, tmp_path):
    """--retry-failed alone is refused before anything runs; with --resume, an adapter given before at another
    folder, or another option that changes outputs, is refused as ever."""
    _, inp, adapter, _ = retry_setup
    out = tmp_path / "out.jsonl"
    res = _run_retry(inp, out, "--retry-failed")
    assert res.exit_code == 2 and "--retry-failed" in res.output and "--resume" in res.output, res.output
    assert not out.exists()
    assert _run_retry(inp, out, "--lora", f"support={adapter}").exit_code == 0
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={tmp_path}")
    assert res.exit_code == 2 and "written with other options: loras" in res.output, res.output
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}", "--seed", "7")
    assert res.exit_code == 2 and "seed" in res.output, res.output
