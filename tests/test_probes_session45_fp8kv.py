"""Probes of --kv-cache-dtype fp8 as a vLLM user would use it: keys past float8's range (saturated, not NaN),
preemption by recompute, --resume across another KV dtype, vLLM's companion options."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import ConfigError
from infer.models.tiny import ensure_builtin

from helpers import hf_model, random_prompts
from test_fp8_kv_cache import hf_fp8_greedy

N = 8


@pytest.fixture(scope="module")
def loud_keys(tmp_path_factory):
    """tiny-llama with its k_proj and v_proj weights scaled so that keys and values pass e5m2's 57344 (its float model
    folder, and transformers on it)."""
    src = ensure_builtin("tiny-llama")
    out = tmp_path_factory.mktemp("loud") / "tiny-llama-loud"
    shutil.copytree(src, out)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(20000.0)
            layer.self_attn.v_proj.weight.mul_(20000.0)
            layer.self_attn.o_proj.weight.div_(20000.0)
    model.save_pretrained(out)
    loud = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    loud.generation_config.eos_token_id = None
    return out, loud


@pytest.mark.parametrize("kv, dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_keys_past_the_float8_range_saturate_as_vllm_does(loud_keys, kv, dtype):
    """Keys and values past the format's largest (448 e4m3, 57344 e5m2) are stored as it, as vLLM's saturating cast:
    unclamped, torch casts them to e5m2's infinity, and the attention's output is NaN from there on."""
    path, hf = loud_keys
    llm = LLM(str(path), block_size=4, kv_cache_dtype=kv)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (7, 13), seed=31)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=N, ignore_eos=True))
    cache = llm.engine.runner.kv_cache.float()
    assert cache.isfinite().all()
    assert cache.abs().max() == torch.finfo(dtype).max  # saturated somewhere
    assert [o.token_ids for o in outs] == [hf_fp8_greedy(hf, p, N, dtype) for p in prompts]


def test_preemption_by_recompute_under_a_tiny_fp8_cache():
    """Sequences preempted and recomputed rewrite their K and V through the same rounding: transformers' tokens."""
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), block_size=4, num_kv_blocks=24, max_model_len=64, kv_cache_dtype="fp8_e5m2")
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 17, 9, 30, 12), seed=4)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.num_used_blocks == 0
    hf = hf_model(str(path))
    assert [o.token_ids for o in outs] == [hf_fp8_greedy(hf, p, N, torch.float8_e5m2) for p in prompts]


def test_resume_refuses_another_kv_cache_dtype(tmp_path):
    """A run resumed with another KV cache type would mix tokens of two caches in one file: refused, as another
    --max-new-tokens is; fp8 and fp8_e4m3 are the same type."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hello", "max_new_tokens": 3}\n{"id": "b", "prompt": "hi there"}\n')
    out = tmp_path / "out.jsonl"
    run = CliRunner()
    res = run.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--kv-cache-dtype", "fp8",
                           "--max-new-tokens", "3"])
    assert res.exit_code == 0, res.output
    first = out.read_bytes().split(b"\n")[0] + b"\n"
    out.write_bytes(first)
    res = run.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume", "--max-new-tokens", "3"])
    assert res.exit_code == 2 and "kv_cache_dtype" in res.output, res.output
    res = run.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume", "--max-new-tokens", "3",
                           "--kv-cache-dtype", "fp8_e4m3"])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]


def test_vllms_calculate_kv_scales_says_the_scale_is_one():
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert res.exit_code == 2 and "scale 1.0" in res.output and "--calculate-kv-scales is vLLM's option" in res.output
    with pytest.raises(ConfigError, match="scale 1.0"):
        LLM("tiny-llama", kv_cache_dtype="fp8", calculate_kv_scales=True)


def test_run_announces_the_kv_cache_dtype(tmp_path):
    """`infer run` says what its KV cache holds when it is not the model's dtype (it says blocks and tokens)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"), "--max-new-tokens",
                                   "2", "--kv-cache-dtype", "fp8_e5m2"])
    assert res.exit_code == 0, res.output
    assert "tokens of float8_e5m2, max length" in res.output
