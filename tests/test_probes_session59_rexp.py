"""Review probes (session 59) of `infer run --resume --retry-failed`, the per-expert MoE adapter policy and the
hostile-newcomer fixes: each fix's test fails without it."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer.cli.main import app
from infer.errors import OutOfMemoryError
from helpers import random_prompts, stopped_after_each_record
from test_probes_parallel_bench_s35 import local_ray  # noqa: F401  (--data-parallel 2 in this process)
from test_probes_session59_experts import v4_base  # noqa: F401  (a tiny Qwen3 MoE and Mixtral)


def test_a_line_lora_that_no_path_can_be_gets_its_error_record(tmp_path):
    """A line whose lora names no registered adapter is told, if the name is a folder, the --lora NAME=PATH to
    give. A name no path can be (longer than the file system takes, "~user" of no user) made that check raise
    OSError ("File name too long") or RuntimeError: a traceback that ended the whole run, no record written.
    Now such a line gets the unknown adapter's error record and the other lines run."""
    from helpers import infer_run_records
    long = "x" * 5000
    recs, printed = infer_run_records(tmp_path, [
        {"id": "long", "prompt": "hi", "max_new_tokens": 2, "lora": long},
        {"id": "user", "prompt": "hi", "max_new_tokens": 2, "lora": "~no-such-user-59/x"},
        {"id": "ok", "prompt": "hi", "max_new_tokens": 2}])
    assert "Traceback" not in printed, printed
    assert recs["long"]["error"].startswith(f"line 1: unknown LoRA adapter '{long}' (registered adapters: none; "
                                            f"give it to infer run with --lora {long}=PATH"), recs["long"]["error"]
    assert "line 2: unknown LoRA adapter '~no-such-user-59/x'" in recs["user"]["error"]
    assert recs["ok"]["error"] is None and len(recs["ok"]["token_ids"]) == 2


def test_resume_with_another_pooler_config_is_refused(tmp_path):
    """--pooler-config (pooling type, normalize) changes every embedding of `infer run --runner pooling`, but the
    resume fingerprint did not hold it: a run stopped midway and resumed with another pooling wrote records of two
    poolings into one output, exit 0. Now the resume is refused naming it; the same pooling resumes."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/embeddings",
                                       "body": {"input": f"hello {c}"}}) + "\n" for c in "abc"))

    def run(*args):
        return CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--runner", "pooling",
                                        "--block-size", "4", *args])
    mean = ("--pooler-config", '{"pooling_type": "MEAN"}')
    with stopped_after_each_record():
        assert run(*mean).exit_code == 130
    first = out.read_bytes()
    res = run("--resume")
    assert res.exit_code == 2, res.output
    assert "written with other options: pooler_config {'pooling_type': 'MEAN'} -> None" in res.output, res.output
    assert out.read_bytes() == first
    assert run("--resume", *mean).exit_code == 0
    whole = tmp_path / "whole.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(whole), "-q", "--runner", "pooling",
                                   "--block-size", "4", *mean])
    assert res.exit_code == 0, res.output
    got, want = ({r["id"]: torch.tensor(r["embedding"]) for r in map(json.loads, p.read_text().splitlines())}
                 for p in (out, whole))
    assert got.keys() == want.keys() == set("abc")
    for key in want:
        torch.testing.assert_close(got[key], want[key])


def test_retry_failed_with_data_parallel_replaces_each_error_once(tmp_path, local_ray):  # noqa: F811
    """`--data-parallel 2 --resume --retry-failed`: the driver retries the error records' lines as one engine does,
    a run stopped after its first retried record loses nothing, and the output ends with one record per id, those
    of a run given the adapter from the start; a beam-search line (not run with --data-parallel) fails again and
    keeps one record."""
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float, save_adapter
    from test_probes_session59_experts import _by_id, _batch
    adapter = save_adapter(hf_float(ensure_builtin("tiny-llama")), tmp_path / "support", seed=1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in [
        _batch("s1", model="support"), _batch("b"), _batch("s2", model="support"),
        _batch("beam", model="support", use_beam_search=True, n=2)]))

    def run(out, *args):
        return CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--output-format",
                                        "openai", "--data-parallel", "2", "--max-num-seqs", "2", *map(str, args)])
    lora = ("--lora", f"support={adapter}")
    assert run(tmp_path / "ref.jsonl", *lora).exit_code == 1  # (the beam line)
    ref, out = _by_id(tmp_path / "ref.jsonl"), tmp_path / "out.jsonl"
    assert run(out).exit_code == 1
    assert {k: v[0] for k, v in _by_id(out).items()} == {"s1": 404, "b": 200, "s2": 404, "beam": 404}
    with stopped_after_each_record():
        assert run(out, "--resume", "--retry-failed", *lora).exit_code == 130
    assert len(out.read_text().splitlines()) == 5  # (a retried line's error and its new record)
    res = run(out, "--resume", "--retry-failed", *lora)
    assert res.exit_code == 1 and "replaced 1 error record(s)" in res.output, res.output
    assert _by_id(out) == ref and ref["beam"][0] == 400 and ref["s1"][0] == ref["s2"][0] == 200


@pytest.mark.parametrize("v4_base", ["qwen3_moe"], indirect=True)  # (Mixtral's w2 key: a stacked name never has it)
def test_the_rslora_hint_keeps_a_rank_pattern_modules_scaling(v4_base, tmp_path):  # noqa: F811
    """transformers 4's per-expert adapter with use_rslora and a rank_pattern (the experts' down at rank 2): refused
    (peft fuses the gate and up sqrt(2) times too strong), but its hint said only "use_rslora false, lora_alpha x
    sqrt(r)", which leaves the down at lora_alpha x sqrt(r) / 2, not lora_alpha / sqrt(2) as trained: an adapter
    infer and peft then served as another model without a word. The hint now gives the alpha_pattern too; the
    config it gives scales every stacked parameter as trained, in peft, and infer serves peft's tokens."""
    import math

    from test_probes_session57_moelora import _engine_tokens, _v4_adapter, peft_tokens
    from test_probes_session59_experts import _check_refused, _peft_scalings
    base, hf, (gate, up, down) = v4_base
    path = _v4_adapter(hf, tmp_path / "rs", (gate, up, down), seed=3, ranks={down: 2}, use_rslora=True,
                       rank_pattern={down: 2})  # r 4, lora_alpha 8
    trained = {"gate_up_proj": 8 / math.sqrt(4), "down_proj": 8 / math.sqrt(2)}
    _check_refused(base, path, "(use_rslora", f'set use_rslora to false and lora_alpha to 16, alpha_pattern to '
                   f'{{"{down}": {round(8 * math.sqrt(2), 6)}}} (each alpha x sqrt(its rank)', tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(use_rslora=False, lora_alpha=16, alpha_pattern={down: round(8 * math.sqrt(2), 6)})
    (path / "adapter_config.json").write_text(json.dumps(config))
    got = _peft_scalings(hf, path)
    assert got.keys() == trained.keys() and all(math.isclose(got[k], v, rel_tol=1e-6) for k, v in trained.items())
    prompts = random_prompts(512, (7, 5), seed=21)
    mixed, alone = _engine_tokens(base, {"a": path}, prompts, ["a", None])
    assert mixed == alone == peft_tokens(hf, {"a": path}, prompts, ["a", None])


_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
REAL_CONTEXTS = {  # config.json as published (the fields the rope reads), and the float32 rope tables' bytes
    "Llama-3-8B": (_LLAMA3, 8192 * 128 * 4),
    "Llama-3.1-8B": ({**_LLAMA3, "max_position_embeddings": 131072, "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}}, 131072 * 128 * 4),
    "Qwen2.5-7B": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                    "num_hidden_layers": 28, "intermediate_size": 18944, "num_attention_heads": 28,
                    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
                    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "sliding_window": 131072,
                    "use_sliding_window": False, "max_window_layers": 28, "torch_dtype": "bfloat16"},
                   32768 * 128 * 4),
    # two tables (the sliding layers' local base, the full layers' scaled global one), head_dim 256
    "Gemma-3-4B": ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 2560,
                    "num_hidden_layers": 34, "intermediate_size": 10240, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208,
                    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
                    "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16"}, 2 * 131072 * 256 * 4),
}


@pytest.mark.parametrize("name", list(REAL_CONTEXTS))
def test_the_rope_budget_check_takes_real_models_at_their_default_context(tmp_path, monkeypatch, name):
    """The rope-table check (engine start and infer warmup, before the model is built) on an 80 GiB GPU at the
    default --gpu-memory-utilization: published models at their full default context (no --max-model-len) pass,
    their tables the size build_cos_sin_cache builds (4 MiB to Gemma 3's 256 MiB); a budget below twice the table
    (computing it holds the angles too) is refused, naming the --max-model-len that fits."""
    from infer.engine.config import EngineConfig
    from infer.engine.setup import model_max_len
    from infer.memory.plan import check_rope_table
    from infer.models.loader import load_config
    from infer.models.rope import build_cos_sin_cache, rope_layer_types, rope_table_bytes
    raw, table = REAL_CONTEXTS[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, engine = load_config(tmp_path), EngineConfig(str(tmp_path))
    n = model_max_len(cfg, engine)
    assert n == raw["max_position_embeddings"] and rope_table_bytes(cfg, n) == table
    built = sum(build_cos_sin_cache(cfg, 1000, t).nbytes for t in rope_layer_types(cfg))  # (1,000 rows of each)
    assert built == rope_table_bytes(cfg, 1000) and built * n == 1000 * table
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79 << 30, 80 << 30))
    check_rope_table(engine, cfg, gpu, n)
    def budget(nbytes: int) -> EngineConfig:  # (the GPU's other 1 GiB in use is not the engine's)
        return EngineConfig(str(tmp_path), gpu_memory_utilization=(nbytes + (1 << 30)) / (80 << 30))
    check_rope_table(budget(2 * table + 16), cfg, gpu, n)
    with pytest.raises(OutOfMemoryError, match="rotary .rope. table") as err:
        check_rope_table(budget(2 * table - 16), cfg, gpu, n)
    assert "--max-model-len" in err.value.hint and "--gpu-memory-utilization" in err.value.hint


def test_a_retry_interrupted_before_its_first_record_says_to_resume(tmp_path, monkeypatch):
    """`--resume --retry-failed` on an output whose every record is an error, stopped (Ctrl-C) before its first new
    record: it said "run the same command again (with or without --resume: nothing was written to keep)", but the
    output holds every line's error record, and the run without --resume it offered is refused. Now it says to run
    it with --resume, which completes the output (one record per id); a --resume without --retry-failed keeps the
    error records, and its note says how to run their lines again."""
    from infer.cli import batch_io
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float, save_adapter
    from test_probes_session59_experts import _batch, _by_id, _run_retry
    adapter = save_adapter(hf_float(ensure_builtin("tiny-llama")), tmp_path / "support", seed=1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(_batch(c, model="support")) + "\n" for c in ("s1", "s2")))
    assert _run_retry(inp, out).exit_code == 1
    first = out.read_bytes()

    def stop(self, record):
        raise KeyboardInterrupt
    monkeypatch.setattr(batch_io.RecordWriter, "write", stop)
    lora = ("--lora", f"support={adapter}")
    res = _run_retry(inp, out, "--resume", "--retry-failed", *lora)
    monkeypatch.undo()
    said = " ".join(res.output.split())
    assert res.exit_code == 130 and out.read_bytes() == first, res.output
    assert "interrupted: 0 of 2 records written" in said and "with or without --resume" not in said, said
    assert "run the same command with --resume to complete the rest" in said
    assert _run_retry(inp, out, *lora).exit_code == 2  # (no --resume: refused, the records are kept)
    res = _run_retry(inp, out, "--resume", *lora)  # (the error records kept: the note names --retry-failed)
    assert res.exit_code == 1 and "2 error record(s) from before this resume (a resume keeps them; to run their " \
        "lines again once their cause is fixed, add --retry-failed)" in " ".join(res.output.split()), res.output
    res = _run_retry(inp, out, "--resume", "--retry-failed", *lora)
    assert res.exit_code == 0, res.output
    assert {k: v[0] for k, v in _by_id(out).items()} == {"s1": 200, "s2": 200}
