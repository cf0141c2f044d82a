"""Config switches the built-in tiny models leave at their defaults, each against transformers' logits on the same
weights: Llama's attention_bias (q/k/v and o_proj) and mlp_bias, a large rms_norm_eps, a rope_theta other than
10000 (Qwen2.5 and Llama 3 use 1e6 and 5e5), linear and yarn rope scaling, Qwen3 with attention_bias; Mistral's
sliding window (its attention slides, past the window); and a checkpoint with a tensor
missing is refused, not loaded with the parameter's initial value."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from infer import LLM, SamplingParams
from infer.errors import ModelLoadError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0)
VARIANTS = {
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-eps-theta": ("llama", dict(rms_norm_eps=0.5, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1e6})),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                          "factor": 4.0})),
    "qwen3-bias": ("qwen3", dict(head_dim=32, attention_bias=True, rms_norm_eps=0.25)),
    # fields a family's transformers class ignores (Mistral has no biases, only Llama's MLP has them); swish = silu
    "mistral-undeclared-biases": ("mistral", dict(attention_bias=True, mlp_bias=True, hidden_act="swish")),
    "qwen2-mlp-bias-ignored": ("qwen2", dict(mlp_bias=True, attention_bias=True)),
    "qwen2-yarn": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 64})),
}
ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM"}


def build(folder, model_type: str, seed: int = 0, **config):
    """A random HF model folder with the tiny-llama tokenizer; biases random too (they start at zero)."""
    cfg = AutoConfig.for_model(model_type, initializer_range=0.15, bos_token_id=None, **SMALL, **config)
    cfg.architectures = [ARCH[model_type]]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(ensure_builtin("tiny-llama") / f, folder / f)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(tmp_path, variant):
    model_type, config = VARIANTS[variant]
    hf = build(tmp_path, model_type, **config)
    llm = LLM(str(tmp_path), block_size=4)
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    n = 8
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=5))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
        assert out.token_ids == logits.argmax(-1).tolist(), f"greedy tokens differ from transformers ({variant})"
        for i, rec in enumerate(out.logprobs):
            assert abs(rec["logprob"] - float(logits[i, rec["token_id"]])) < 1e-4, (variant, i)
            assert [t["token_id"] for t in rec["top_logprobs"]] == logits[i].topk(5).indices.tolist()


@pytest.mark.parametrize("drop", ["model.norm.weight", "model.layers.1.post_attention_layernorm.weight",
                                  "model.layers.0.self_attn.o_proj.bias"])
def test_a_missing_tensor_is_refused(tmp_path, drop):
    build(tmp_path, "llama", attention_bias=True)
    weights = load_file(tmp_path / "model.safetensors")
    assert drop in weights
    del weights[drop]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="no tensor"):
        LLM(str(tmp_path), block_size=4)


def test_mistral_sliding_window_runs_past_the_window(tmp_path):
    hf = build(tmp_path, "mistral", sliding_window=16)
    llm = LLM(str(tmp_path), block_size=4)
    assert llm.engine.max_model_len == 256
    prompt = random_prompts(512, (10,), seed=5)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert out.token_ids == want[0, 10:].tolist() and out.finish_reason == "length"


@pytest.mark.parametrize("model_type, config, window", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), 16),  # layer 1 slides
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, head_dim=32), 16),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), None),  # no layer slides
    ("qwen2", dict(use_sliding_window=False, sliding_window=16), None),
])
def test_qwen_sliding_layers_run_past_the_window(tmp_path, model_type, config, window):
    """A Qwen2/Qwen3 layer at or past max_window_layers attends to the last sliding_window tokens only, and so does
    infer's (its context max_position_embeddings, as for Mistral); with no sliding layer every layer is full. A
    prompt past the window and its tokens equal transformers'."""
    hf = build(tmp_path, model_type, **config)
    llm = LLM(str(tmp_path), block_size=4)
    assert llm.engine.max_model_len == 256
    assert max(layer.self_attn.window for layer in llm.engine.runner.model.layers) == (window or 0)
    n = 40
    prompt = random_prompts(512, (n,), seed=5)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
    assert out.token_ids == want[0, n:].tolist()
    assert out.finish_reason == "length"


@pytest.mark.parametrize("same", [False, True])
def test_tied_config_with_a_stored_head(tmp_path, same, caplog):
    """tie_word_embeddings with an lm_head.weight in the checkpoint: transformers uses the stored head when it differs
    from the embeddings (and says so), so does infer; an identical stored head changes nothing."""
    build(tmp_path, "qwen2", tie_word_embeddings=True)
    weights = load_file(tmp_path / "model.safetensors")
    emb = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = emb.clone() if same else torch.randn_like(emb) * 0.15
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path), block_size=4)
    assert llm.engine.runner.model.tie_word_embeddings is same
    assert ("different lm_head" in caplog.text) is not same
    prompts = random_prompts(512, (5, 13), seed=3)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
        assert out.token_ids == logits.argmax(-1).tolist()
        assert abs(out.logprobs[0]["logprob"] - float(logits[0, out.token_ids[0]])) < 1e-4


def test_partial_rotary_is_refused_where_it_would_rotate_part_of_a_head(tmp_path):
    """partial_rotary_factor with a scaled rope: transformers' Llama fails on it and infer rotated part of each head;
    now it says so. (With the default rope transformers ignores the factor, and so does infer.)"""
    from infer.errors import UnsupportedModelError
    build(tmp_path, "llama")  # the factor is written into config.json afterwards: transformers' own init of such a
    cfg = json.loads((tmp_path / "config.json").read_text())  # model fails or not depending on what ran before
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    LLM(str(tmp_path), block_size=4)
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5"):
        LLM(str(tmp_path), block_size=4)
