"""Memory plan: KV formula vs real tensors, the activation formula vs the warmup measurement, `infer warmup`."""

import json

import pytest
import torch
from typer.testing import CliRunner

from infer.cli.main import app
from infer.engine.config import EngineConfig
from infer.cli.warmup_plan import estimate_plan, measured_plan
from infer.memory.meter import peak_rss_bytes, reset_peak_rss, rss_bytes

from helpers import measured_warmup

runner = CliRunner()


def test_kv_block_bytes_match_the_allocated_cache():
    from infer import LLM
    llm = LLM("tiny-qwen2", block_size=8, max_model_len=256, max_num_seqs=4)
    eng = llm.engine
    cache = eng.runner.kv_cache
    assert cache.numel() * cache.element_size() == eng.memory_plan.kv_block_bytes * eng.block_manager.num_blocks
    assert eng.memory_plan.kv_block_bytes == 8 * eng.memory_plan.kv_bytes_per_token


@pytest.mark.parametrize("model, max_length, concurrency, tokens", [
    ("tiny-llama", 4096, 16, 4096),
    ("llama-100m", 1024, 16, 2048),
])
def test_activation_formula_within_10_percent_of_measurement(model, max_length, concurrency, tokens):
    """Measured in a fresh process: on CPU the measurement is the growth of the process's peak RSS, which memory
    freed earlier in the same process (kept by the allocator) would hide."""
    args = [model, "--max-length", str(max_length), "--concurrency", str(concurrency),
            "--max-num-batched-tokens", str(tokens)]
    measured = measured_warmup(args)
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert abs(formula - peak) <= 0.10 * peak, (formula, peak)
    cfg = EngineConfig(model=model, max_num_seqs=concurrency, max_model_len=max_length,
                       max_num_batched_tokens=tokens)
    est, _ = estimate_plan(cfg, max_length, concurrency)
    assert est.activation_peak_bytes == formula
    assert abs(est.weights_bytes - measured["weights_bytes"]) <= 0.10 * measured["weights_bytes"] + 8 * 2**20


def _warmup(*args):
    res = runner.invoke(app, ["warmup", "tiny-llama", "--json", *args])
    return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])


def test_warmup_json_keys_and_fit():
    code, d = _warmup("--max-length", "1024", "--concurrency", "4")
    assert code == 0 and d["fits"] is True
    for key in ("fits", "max_length", "concurrency", "weights_bytes", "activation_peak_bytes", "kv_bytes_per_token",
                "kv_block_bytes", "kv_blocks", "max_concurrency_at_max_length", "max_length_at_concurrency",
                "budget_bytes", "device"):
        assert key in d
    assert d["max_concurrency_at_max_length"] >= 4


def test_too_long_gives_exit_1_and_the_suggestion_fits():
    code, d = _warmup("--max-length", "4096", "--concurrency", "16", "--memory-limit", "40MB")
    assert code == 1 and d["fits"] is False
    suggested = d["max_length_at_concurrency"]
    assert 0 < suggested < 4096
    res = runner.invoke(app, ["warmup", "tiny-llama", "--max-length", "4096", "--concurrency", "16",
                              "--memory-limit", "40MB"])
    text = " ".join(res.stdout.split()).lower()
    assert "does not fit" in text and "lower --max-length to" in text and "estimated maximum length" in text
    # on the same measurement the suggestion is the longest whole number of blocks whose KV fits the budget
    # (the KV gets what the larger of the measured peak and the formula an engine start reserves leaves)
    act = max(d["activation_peak_bytes"], d["activation_estimate_bytes"])
    block, used = d["kv_block_bytes"], d["weights_bytes"] + act + d["reserve_bytes"]
    assert suggested % d["block_size"] == 0
    assert used + 16 * (suggested // d["block_size"]) * block <= d["budget_bytes"]
    assert used + 16 * (suggested // d["block_size"] + 1) * block > d["budget_bytes"]
    # a new measurement (CPU: this process's peak RSS, which moves by a few percent from call to call, more after
    # many tests in one process) fits it too when the length leaves room for 10% more activations
    slack_blocks = -(-d["activation_peak_bytes"] // (10 * 16 * block))
    length = suggested - slack_blocks * d["block_size"]
    code, d2 = _warmup("--max-length", str(length), "--concurrency", "16", "--memory-limit", "40MB")
    assert code == 0 and d2["fits"] is True, (d, d2)


def test_engine_refuses_to_start_when_one_sequence_cannot_fit(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "--memory-limit", "12MB"])
    assert res.exit_code == 2 and "estimated maximum model length" in res.output
    assert "LoRA adapter slots" not in res.output and "a reserve of" in res.output
    # the adapter slots are part of the sum the message gives (they were left out: its figures did not add up)
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "--memory-limit", "12MB", "--enable-lora",
                              "--max-loras", "8", "--max-lora-rank", "64"])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "estimated maximum model length" in out, res.output
    assert ", LoRA adapter slots " in out and " and a reserve of " in out, out


def test_a_run_never_goes_beyond_the_reported_peak():
    """Once loaded, serving concurrency x max_length allocates no more than the warmup's activations + KV."""
    import gc
    from infer import LLM, SamplingParams
    max_length, conc = 512, 4
    opts = dict(max_num_seqs=conc, max_model_len=max_length, max_num_batched_tokens=512)
    plan, _ = measured_plan(EngineConfig(model="llama-100m", **opts), max_length, conc)
    reported = (plan.activation_peak_bytes + plan.reserve_bytes
                + conc * plan.blocks_for(max_length) * plan.kv_block_bytes)
    llm = LLM("llama-100m", **opts)
    gc.collect()
    reset_peak_rss()
    base = rss_bytes()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 30000, (200,), generator=g).tolist() for _ in range(conc)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=max_length - 201, ignore_eos=True))
    assert all(len(o.token_ids) == max_length - 201 for o in outs)
    used = peak_rss_bytes() - base
    assert used <= reported, (used, reported)


def test_warmup_with_adapters_runs_the_largest_rank(tmp_path):
    from infer.cli.demo import make_random_adapter
    from infer.models.tiny import ensure_builtin
    base = ensure_builtin("tiny-llama")
    make_random_adapter(base, tmp_path / "small", 4, ["q_proj", "v_proj"], seed=1)
    make_random_adapter(base, tmp_path / "big", 16, ["q_proj", "down_proj"], seed=2)
    code, d = _warmup("--max-length", "512", "--concurrency", "4", "--max-lora-rank", "16",
                      "--lora", f"small={tmp_path / 'small'}", "--lora", f"big={tmp_path / 'big'}")
    assert code == 0 and d["fits"] is True
    assert d["lora_adapter"] == "big" and d["lora_bytes"] > 0


def test_estimate_checks_the_adapters_as_an_engine_start_does(tmp_path):
    """--estimate loads no weights but reads the adapters: an adapter above --max-lora-rank, or a broken one,
    cannot say "fits" when the engine would refuse to start."""
    from infer.cli.demo import make_random_adapter
    from infer.models.tiny import ensure_builtin
    make_random_adapter(ensure_builtin("tiny-llama"), tmp_path / "big", 16, ["q_proj"], seed=2)
    args = ["warmup", "tiny-llama", "--max-length", "64", "--concurrency", "1", "--estimate"]
    res = runner.invoke(app, [*args, "--lora", f"big={tmp_path / 'big'}", "--max-lora-rank", "8"])
    assert res.exit_code == 2 and "rank 16 is larger than --max-lora-rank 8" in " ".join(res.output.split())
    (tmp_path / "big" / "adapter_model.safetensors").unlink()
    res = runner.invoke(app, [*args, "--lora", f"big={tmp_path / 'big'}", "--max-lora-rank", "16"])
    assert res.exit_code == 2 and "no weights" in res.output


def test_cuda_graph_pool_is_budgeted_only_with_graphs(monkeypatch):
    from transformers import LlamaConfig

    from infer.memory.plan import cuda_graph_bytes
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    assert cuda_graph_bytes(EngineConfig("m", max_num_seqs=16), cfg, torch.float16) == 0  # CPU: no graphs
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)
    small = cuda_graph_bytes(EngineConfig("m", max_num_seqs=16), cfg, torch.float16)
    big = cuda_graph_bytes(EngineConfig("m", max_num_seqs=64), cfg, torch.float16)
    assert 0 < small < big < 1 << 30  # one decode step's temporaries at the largest bucket: megabytes, not GiB


@pytest.mark.parametrize("mode", [[], ["--estimate"]])
def test_warmup_whose_token_budget_cannot_fit_names_it(mode, monkeypatch):
    """--max-num-batched-tokens 999999999999 ran the worst case into a MemoryError ("...while it was measured ()")
    and --estimate advised only --memory-limit: neither named the option that made the activations. (A step holds
    at most concurrency x max_length tokens: 4,096 x 2,048 here, whose activations exceed the budget.)"""
    from infer.engine import profile
    monkeypatch.setattr(profile, "profile_run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    res = runner.invoke(app, ["warmup", "tiny-llama", "--max-length", "2048", "--concurrency", "4096",
                              "--max-num-batched-tokens", "999999999999", "--memory-limit", "8GB", *mode])
    out = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert ("Lower --max-num-batched-tokens (999,999,999,999) or --concurrency (4,096), whose activations take most "
            "of the budget, or raise --memory-limit.") in out, out
    assert "()" not in out and not isinstance(res.exception, AssertionError)  # known without running the worst case


def test_warmup_out_of_memory_without_a_message_names_the_error_and_the_token_budget(monkeypatch):
    from infer.engine import profile

    def oom(*a, **k):
        raise MemoryError()  # what a failed Python allocation raises: no message
    monkeypatch.setattr(profile, "profile_run", oom)
    res = runner.invoke(app, ["warmup", "tiny-llama", "--max-length", "64", "--concurrency", "2"])
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and "ran out of memory while it was measured (MemoryError)" in out, res.output
    assert "lower --concurrency, --max-length or --max-num-batched-tokens (4,096: the worst case's prefill)" in out
