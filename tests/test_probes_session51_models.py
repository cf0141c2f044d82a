"""Session 51 probes of model configs against transformers on the same tiny random weights: the output head and the
embeddings of tied and untied checkpoints."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams
from infer.errors import ModelLoadError
from infer.models.loader import check_weights

from helpers import random_prompts
from test_model_variants import build


def _rewrite(folder, edit) -> None:
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_tied_checkpoint_storing_the_matrix_as_lm_head_only_equals_transformers(tmp_path):
    """safetensors' save_model keeps the first of shared tensors' names in sorted order: a tied model's matrix is
    stored as lm_head.weight, with no model.embed_tokens.weight. transformers ties the embeddings to it; infer refused
    the folder as incomplete ("no tensor model.embed_tokens.weight")."""
    build(tmp_path, "llama", tie_word_embeddings=True)

    def head_only(w):
        w["lm_head.weight"] = w.pop("model.embed_tokens.weight")
    _rewrite(tmp_path, head_only)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    check_weights(tmp_path)  # what convert and quantize check first
    prompt = random_prompts(512, (9,), seed=5)[0]
    out = LLM(str(tmp_path), block_size=4).generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, 9:].tolist()
    assert out.token_ids == want


def test_a_tied_head_only_checkpoint_of_the_wrong_shape_is_refused(tmp_path):
    build(tmp_path, "llama", tie_word_embeddings=True)

    def head_only(w):
        w["lm_head.weight"] = w.pop("model.embed_tokens.weight")[:-1]
    _rewrite(tmp_path, head_only)
    with pytest.raises(ModelLoadError, match=r"lm_head.weight has shape \(511, 64\), config.json implies \(512, 64\)"):
        LLM(str(tmp_path), block_size=4)

def test_an_untied_checkpoint_without_lm_head_names_the_tensor_and_tie_word_embeddings(tmp_path):
    """transformers fills a missing head at random; infer refuses it, but named it "model.lm_head.weight" (no such
    name in a checkpoint) and said nothing of the config field that decides whether a head is stored."""
    build(tmp_path, "llama")
    _rewrite(tmp_path, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(tmp_path), block_size=4)
    assert "no tensor lm_head.weight" in str(e.value) and "model.lm_head" not in str(e.value)
    assert "tie_word_embeddings" in str(e.value) and '"tie_word_embeddings": true' in e.value.hint


@pytest.mark.parametrize("model_type, config", [
    ("llama", dict(rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    ("qwen3", dict(head_dim=32, rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.25, "factor": 2.0})),
])
def test_a_proportional_rope_equals_transformers(tmp_path, model_type, config):
    """transformers 5's proportional rope gives frequencies for the whole head (those past partial_rotary_factor 0:
    unrotated), which its Llama, Mistral and Qwen attentions run; infer refused it as "rope type 'proportional' is
    not supported"."""
    hf = build(tmp_path, model_type, **config)
    prompt = random_prompts(512, (20,), seed=5)[0]
    out = LLM(str(tmp_path), block_size=4).generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, 20:].tolist()
    assert out.token_ids == want


class _Calibrating(Exception):
    pass


def test_quantize_refuses_a_tied_head_only_checkpoint_before_gptqmodel_naming_convert(tmp_path, monkeypatch):
    """`infer run` loads a tied checkpoint stored as lm_head.weight alone, so its checks pass it to GPTQModel, which
    leaves the embeddings unset and fails after calibrating ("Tensor.item() cannot be called on meta tensors"). It
    is refused first, naming the tensor and `infer convert`, which writes model.embed_tokens.weight."""
    from infer.errors import ConfigError
    from infer.quant import quantize as quantize_mod
    from infer.quant.quantize import QuantizeOptions, quantize_model

    def calibrating():
        raise _Calibrating()
    monkeypatch.setattr(quantize_mod, "require_gptqmodel", calibrating)
    src = tmp_path / "src"
    src.mkdir()
    build(src, "llama", tie_word_embeddings=True)
    opts = QuantizeOptions(group_size=32, num_samples=2, seq_len=32)
    with pytest.raises(_Calibrating):  # the usual tied checkpoint (embed_tokens only) goes on to GPTQModel
        quantize_model(src, tmp_path / "q", opts, check_weights=check_weights)

    def head_only(w):
        w["lm_head.weight"] = w.pop("model.embed_tokens.weight")
    _rewrite(src, head_only)
    with pytest.raises(ConfigError, match="only as lm_head.weight") as e:
        quantize_model(src, tmp_path / "q", opts, check_weights=check_weights)
    assert "infer convert" in e.value.hint


def test_the_weights_estimate_of_a_tied_head_only_checkpoint_counts_its_embeddings(tmp_path):
    """The estimate (memory plan, warmup --estimate) skipped a tied lm_head.weight as the embeddings' copy: for a
    checkpoint storing the tied matrix only under that name (which the loader makes the embeddings) it left the
    embeddings, and their CPU prepacked copy, out."""
    from transformers import AutoConfig

    from infer.memory.checkpoint import checkpoint_weights_bytes
    from infer.models.loader import weight_files
    build(tmp_path, "llama", tie_word_embeddings=True)
    cfg = AutoConfig.from_pretrained(tmp_path)
    cpu = torch.device("cpu")
    usual = checkpoint_weights_bytes(weight_files(tmp_path), cfg, torch.float32, cpu)

    def head_only(w):
        w["lm_head.weight"] = w.pop("model.embed_tokens.weight")
    _rewrite(tmp_path, head_only)
    assert checkpoint_weights_bytes(weight_files(tmp_path), cfg, torch.float32, cpu) == usual
