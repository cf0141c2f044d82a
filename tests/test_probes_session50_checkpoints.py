"""Checkpoints that loaded silently wrong (session 50 probe): integer tensors in a float checkpoint (cast to float:
garbage), float8 tensors and a float8 torch_dtype (upcast without a word), non-finite weights (normal-looking text on
CPU)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.errors import ModelLoadError
from infer.models.loader import check_weights, load_model


@pytest.fixture(scope="module")
def tiny_llama():
    from infer.models.resolve import resolve_model
    return resolve_model("tiny-llama")


def _with(src: Path, dest: Path, change, config: dict | None = None) -> Path:
    """A copy of src whose tensors are change(name, tensor) (None: unchanged)."""
    shutil.copytree(src, dest)
    state = load_file(dest / "model.safetensors")
    for name in list(state):
        new = change(name, state[name])
        if new is not None:
            state[name] = new
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = {**json.loads((dest / "config.json").read_text()), **config}
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _load(path: Path):
    return load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("target", ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                                    "model.embed_tokens.weight", "model.norm.weight"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_integer_tensors_in_a_float_checkpoint_are_refused(tiny_llama, tmp_path, target, dtype):
    src = _with(tiny_llama, tmp_path / "m",
                lambda n, t: (t * 100).clamp(0, 100).to(dtype) if n == target else None)
    for check in (_load, check_weights):
        with pytest.raises(ModelLoadError) as e:
            check(src)
        msg = str(e.value)
        assert target in msg and str(dtype).removeprefix("torch.") in msg and "quantization_config" in msg, msg


def _float8_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "float8" in r.getMessage()]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_weights_without_scales_load_upcast_with_one_warning(tiny_llama, tmp_path, caplog, dtype):
    src = _with(tiny_llama, tmp_path / "m", lambda n, t: t.to(dtype) if n.endswith("proj.weight") else None)
    with caplog.at_level(logging.WARNING, logger="infer"):
        model, _ = _load(src)
    got = _float8_warnings(caplog)
    assert len(got) == 1, got
    assert str(dtype).removeprefix("torch.") in got[0] and "model.layers.0.mlp.down_proj.weight" in got[0], got
    assert "upcasts them to float32" in got[0], got
    ref = load_file(src / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(model.layers[0].mlp.down_proj.weight, ref.float())  # the values, exactly


def test_a_float8_config_dtype_is_named_in_a_warning(tiny_llama, tmp_path, caplog):
    src = _with(tiny_llama, tmp_path / "m", lambda n, t: None, config={"dtype": "float8_e4m3fn"})
    with caplog.at_level(logging.WARNING, logger="infer"):
        _load(src)
    got = _float8_warnings(caplog)
    assert len(got) == 1 and "config.json's dtype is float8_e4m3fn" in got[0] and "float32" in got[0], got


def test_a_float_checkpoint_loads_without_a_float8_warning(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="infer"):
        _load(tiny_llama)
    assert not _float8_warnings(caplog)


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float4_e2m1fn_x2])
def test_sub_byte_and_scale_only_floats_are_refused(tiny_llama, tmp_path, dtype):
    target = "model.layers.0.mlp.up_proj.weight"

    def change(n, t):
        if n != target:
            return None
        return t.abs().to(dtype) if dtype != torch.float4_e2m1fn_x2 else t.to(torch.uint8).view(dtype)
    src = _with(tiny_llama, tmp_path / "m", change)
    with pytest.raises(ModelLoadError, match=f"{target} is {str(dtype).removeprefix('torch.')}, which infer cannot"):
        _load(src)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("target", ["model.layers.1.self_attn.k_proj.weight", "model.embed_tokens.weight",
                                    "model.layers.0.post_attention_layernorm.weight"])
def test_non_finite_weights_are_refused_at_load(tiny_llama, tmp_path, target, value):
    def change(n, t):
        if n != target:
            return None
        t = t.clone()
        t.view(-1)[3] = value
        return t
    src = _with(tiny_llama, tmp_path / "m", change)
    with pytest.raises(ModelLoadError, match=f"{target} has non-finite values"):
        _load(src)
    check_weights(src)  # reads headers only: no values to check


def test_values_beyond_the_dtype_are_named_as_such(tiny_llama, tmp_path):
    target = "model.layers.0.mlp.up_proj.weight"

    def change(n, t):
        if n != target:
            return None
        t = t.clone()
        t.view(-1)[0] = 1e6
        return t
    src = _with(tiny_llama, tmp_path / "m", change)
    with pytest.raises(ModelLoadError, match=f"{target} has values beyond float16's range"):
        load_model(src, torch.float16, torch.device("cpu"))


def test_non_finite_float8_weights_are_refused(tiny_llama, tmp_path):
    """float8 tensors are checked for inf/NaN too (torch has no isfinite for them: read as float32)."""
    target = "model.layers.0.mlp.up_proj.weight"

    def change(n, t):
        if n != target:
            return None
        t = t.clone()
        t.view(-1)[0] = float("nan")
        return t.to(torch.float8_e4m3fn)
    src = _with(tiny_llama, tmp_path / "m", change)
    with pytest.raises(ModelLoadError, match=f"{target} has non-finite values"):
        _load(src)


@pytest.mark.gpu
def test_non_finite_weights_are_refused_on_the_gpu_after_the_load(tiny_llama, tmp_path):
    """On a GPU the parameters are checked on the device once loaded (not each CPU copy as it is read)."""
    target = "model.layers.0.self_attn.k_proj.weight"

    def change(n, t):
        if n != target:
            return None
        t = t.clone()
        t.view(-1)[3] = float("nan")
        return t
    src = _with(tiny_llama, tmp_path / "m", change)
    with pytest.raises(ModelLoadError, match="non-finite values"):
        load_model(src, torch.float16, torch.device("cuda"))
    load_model(tiny_llama, torch.float16, torch.device("cuda"))  # a finite one loads


def test_the_device_check_names_the_parameter_with_a_nan(tiny_llama):
    """What a GPU model runs once its weights are in (loader._check_finite_on_device), here on a CPU model."""
    from infer.models.loader import _check_finite_on_device
    model, _ = load_model(tiny_llama, torch.float32, torch.device("cpu"))
    _check_finite_on_device(model, torch.float32)  # finite: nothing to say
    name, p = next((n, p) for n, p in model.named_parameters() if n.endswith("o_proj.weight"))
    with torch.no_grad():
        p.view(-1)[5] = float("inf")
    with pytest.raises(ModelLoadError, match=f"{name} has non-finite values"):
        _check_finite_on_device(model, torch.float32)
