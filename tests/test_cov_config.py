"""EngineConfig choices that the CPU tests never reach: `--dtype auto` on a GPU (the checkpoint's half dtype, else
float16; a bfloat16 model must not be run in float16, whose range it overflows), `--device cuda` without a GPU, and
--lora given twice under one name."""

from __future__ import annotations

import pytest
import torch

from infer.engine.config import EngineConfig, parse_loras
from infer.errors import ConfigError


def test_auto_dtype_on_a_gpu_keeps_the_checkpoints_half_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = EngineConfig("tiny-llama", device="cuda")
    assert cfg.torch_device() == torch.device("cuda")
    assert cfg.torch_dtype(torch.bfloat16) == torch.bfloat16
    assert cfg.torch_dtype(torch.float16) == torch.float16
    assert cfg.torch_dtype(torch.float32) == torch.float16  # a float32 checkpoint runs in half precision on a GPU
    assert cfg.torch_dtype(None) == torch.float16
    assert EngineConfig("tiny-llama", device="cuda", dtype="float32").torch_dtype(torch.bfloat16) == torch.float32
    assert EngineConfig("tiny-llama", device="auto").torch_device().type == "cuda"


def test_auto_dtype_on_cpu_is_float32():
    cfg = EngineConfig("tiny-llama", device="cpu")
    assert cfg.torch_dtype(torch.bfloat16) == torch.float32 and cfg.torch_dtype(None) == torch.float32
    assert EngineConfig("tiny-llama", device="cpu", dtype="bfloat16").torch_dtype(None) == torch.bfloat16


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        EngineConfig("tiny-llama", device="cuda")


def test_one_lora_name_given_twice_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert parse_loras([f"x={a}", f"y={b}"]) == {"x": str(a), "y": str(b)}
    with pytest.raises(ConfigError, match="'x' is given twice"):
        parse_loras([f"x={a}", f"x={b}"])
    with pytest.raises(ConfigError, match="not a folder path"):
        parse_loras({"x": 5})
    with pytest.raises(ConfigError, match="is not NAME=PATH"):
        parse_loras(["x="])
