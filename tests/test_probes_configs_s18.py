"""Config-space probes of the Llama family against transformers 5 (session 18): each test fails without its fix."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import UnsupportedModelError

from helpers import random_prompts
from test_model_variants import build


def _patch(folder, **fields):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("model_type", ["mistral", "llama"])
def test_a_window_with_use_sliding_window_false_still_slides_mistral_and_caps_llama(tmp_path, model_type):
    """transformers' Mistral slides over sliding_window whatever `use_sliding_window: false` in config.json says (only
    Qwen2/Qwen3 read that field), and its Llama's generate() cache keeps only the last sliding_window keys: infer
    ran full attention over the whole context (a 40-token prompt's logprobs off by up to 5.8 for Mistral). Now
    Mistral's attention slides over the window (its context max_position_embeddings, past the window the tokens
    transformers'), and a Llama's context is capped at the window, where its full attention equals transformers'."""
    hf = build(tmp_path, model_type, sliding_window=16)
    _patch(tmp_path, use_sliding_window=False)
    llm = LLM(str(tmp_path), block_size=4)
    limit = 16 if model_type == "llama" else 256
    assert llm.engine.max_model_len == limit
    prompt = random_prompts(512, (10,), seed=5)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=min(limit - 10, 20), do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    assert out.token_ids == want[0, 10:].tolist() and out.finish_reason == "length"


def test_rope_parameters_per_layer_type_are_refused_with_the_field_named(tmp_path):
    """rope_parameters nested by layer type ({"full_attention": {...}, "sliding_attention": {...}}): transformers'
    Qwen2 fails on it (KeyError 'rope_type') and infer failed with a bare KeyError 'rope_theta'; now it says why."""
    build(tmp_path, "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    _patch(tmp_path, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}})
    with pytest.raises(UnsupportedModelError, match=r"per layer type \(full_attention, sliding_attention\)"):
        LLM(str(tmp_path), block_size=4)


def test_a_mistral_config_with_layer_types_is_refused_naming_layer_types(tmp_path):
    """transformers reads a Mistral config.json that has layer_types as Ministral (sliding attention per layer) and
    runs MinistralForCausalLM; infer refused it as "unsupported architecture ['MistralForCausalLM'] (model_type
    'ministral')", which names neither the field nor a way out."""
    build(tmp_path, "mistral", sliding_window=16)
    _patch(tmp_path, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(UnsupportedModelError, match="layer_types") as e:
        LLM(str(tmp_path), block_size=4)
    assert "Ministral" in str(e.value)


def test_dynamic_ntk_rope_equals_transformers_up_to_max_position_embeddings(tmp_path):
    """rope_type dynamic (NTK) was refused; transformers rescales its rope only for a sequence longer than
    max_position_embeddings, past infer's context limit, so up to that limit the table is the unscaled one: the tokens
    and logprobs of prompts that fill the whole context equal transformers'."""
    build(tmp_path, "llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    _patch(tmp_path, max_position_embeddings=64)
    assert_fills_its_context_as_transformers(tmp_path, 64)


def assert_fills_its_context_as_transformers(path, context: int) -> None:
    """infer's context is `context` tokens, and prompts that fill it (with 13 tokens generated) give transformers'
    greedy tokens and logprobs."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), block_size=4)
    assert llm.engine.max_model_len == context
    prompts = random_prompts(512, (5, context - 14), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=13, ignore_eos=True, logprobs=1))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=13, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
            logits = hf(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
        assert out.token_ids == want[0, len(p):].tolist()
        assert max(abs(r["logprob"] - float(logits[i, r["token_id"]])) for i, r in enumerate(out.logprobs)) < 1e-4


def test_the_rope_table_holds_the_engines_context_not_max_position_embeddings(tmp_path):
    """The cos/sin table had max_position_embeddings rows whatever --max-model-len said: 512 MB of float32 on the
    device for a 1M-context model served at 4K. It holds the engine's context now, and the tokens are transformers'."""
    hf = build(tmp_path, "llama")
    _patch(tmp_path, max_position_embeddings=100_000)
    llm = LLM(str(tmp_path), block_size=4, max_model_len=48)
    assert llm.engine.runner.model.cos_sin.shape[0] == 48
    prompt = random_prompts(512, (30,), seed=3)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=18, ignore_eos=True))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=18, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
    assert out.token_ids == want[0, 30:].tolist()


@pytest.mark.parametrize("max_model_len", [None, 48])
def test_warmup_counts_the_rope_table_the_engine_builds(tmp_path, max_model_len):
    """warmup's measured plan loads the table an engine of the same options holds, and --estimate (no weights
    loaded) counts it: for a long-context model the table outweighs a small model's weights."""
    from infer.cli.warmup_plan import estimate_plan, measured_plan
    from infer.engine.config import EngineConfig
    from infer.models.rope import rope_table_bytes
    build(tmp_path, "llama")
    _patch(tmp_path, max_position_embeddings=100_000)
    engine = EngineConfig(model=str(tmp_path), device="cpu", max_num_seqs=2, max_model_len=max_model_len)
    est, _ = estimate_plan(engine, 32, 2)
    measured, _ = measured_plan(engine, 32, 2)
    llm = LLM(str(tmp_path), device="cpu", max_num_seqs=2, max_model_len=max_model_len)
    table = llm.engine.runner.model.cos_sin
    assert table.shape[0] == (max_model_len or 100_000)
    assert table.nbytes == rope_table_bytes(llm.engine.model_config, table.shape[0])
    assert abs(est.weights_bytes - measured.weights_bytes) <= 0.02 * measured.weights_bytes, \
        (est.weights_bytes, measured.weights_bytes, table.nbytes)
