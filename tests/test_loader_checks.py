"""The weight loader's checks of a float checkpoint against its config.json (`infer run`): tensors config.json has no
place for are refused (they were dropped silently: a layer fewer than the weights hold), buffers older checkpoints
store are still skipped; and check_weights, which `infer convert` and `infer quantize` run before transformers loads
the folder, says what loading says, from the weight files' headers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.errors import ModelLoadError, UnsupportedModelError
from infer.models.loader import check_weights, load_model


@pytest.fixture(scope="module")
def tiny_llama():
    from infer.models.resolve import resolve_model
    return resolve_model("tiny-llama")


def _variant(src: Path, dest: Path, config: dict | None = None, extra: dict | None = None) -> Path:
    shutil.copytree(src, dest)
    if config:
        cfg = {**json.loads((dest / "config.json").read_text()), **config}
        (dest / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    if extra:
        save_file({**load_file(dest / "model.safetensors"), **extra}, dest / "model.safetensors",
                  metadata={"format": "pt"})
    return dest


def _load(path: Path):
    return load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("config, extra, words", [
    (dict(num_hidden_layers=1), None,
     "the checkpoint has tensors config.json has no place for: model.layers.1.input_layernorm.weight (and 8 more)"),
    (None, {"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)},
     "has no place for: model.layers.0.mlp.extra_proj.weight"),
    (dict(num_hidden_layers=3), None, "the checkpoint has weights for 2 layers, config.json implies 3"),
    (dict(vocab_size=600), None, "lm_head.weight has shape (512, 64), config.json implies (600, 64)"),
    (dict(model_type="gpt2", architectures=None), None, "unsupported architecture 'gpt2'"),
])
def test_load_and_check_weights_refuse_alike(tiny_llama, tmp_path, config, extra, words):
    src = _variant(tiny_llama, tmp_path / "m", config, extra)
    for check in (_load, check_weights):
        with pytest.raises(ModelLoadError) as e:
            check(src)
        assert words in str(e.value), (check, str(e.value))


def test_rotary_buffers_of_older_checkpoints_are_skipped(tiny_llama, tmp_path):
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.rand(8), "model.rotary_emb.inv_freq": torch.rand(8),
             "model.layers.1.self_attn.rotary_emb.cos_cached": torch.rand(1, 1, 16, 16)}
    src = _variant(tiny_llama, tmp_path / "m", extra=extra)
    check_weights(src)
    model, _ = _load(src)
    ref, _ = _load(tiny_llama)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_check_weights_of_a_bin_checkpoint(tiny_llama, tmp_path):
    src = _variant(tiny_llama, tmp_path / "m", dict(num_hidden_layers=1))
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no place for: model.layers.1"):
        check_weights(src)


def test_unsupported_rope_is_an_unsupported_model_error(tiny_llama, tmp_path):
    """convert leaves a model infer cannot run to transformers' own loading report: it tells them apart by this."""
    src = _variant(tiny_llama, tmp_path / "m", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}))
    with pytest.raises(UnsupportedModelError):
        check_weights(src)
