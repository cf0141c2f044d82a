"""`infer warmup --estimate`'s weight count against the loaded model on this CPU (the prepacked matmul copies
included, for a tied and an untied output head), a `.bin` checkpoint counted by its size, a corrupted safetensors
header refused, and --max-length checked against the model's context at the boundary."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from transformers import AutoConfig

from infer.engine.config import EngineConfig
from infer.errors import ConfigError, ModelLoadError
from infer.memory.checkpoint import checkpoint_weights_bytes, safetensors_header
from infer.memory.sizes import weights_bytes
from infer.models.loader import load_model, weight_files
from infer.models.tiny import ensure_builtin

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama3"])  # untied and tied output head
def test_estimate_counts_what_the_cpu_engine_loads(name):
    from infer.kernels import cpu_gemm
    if not cpu_gemm.available(torch.empty(0)):
        pytest.skip("no CPU prepacked matmul on this machine")
    path = ensure_builtin(name)
    cfg = AutoConfig.from_pretrained(path)
    model, _ = load_model(path, torch.float32, CPU)
    rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("cos_sin"))
    estimate = checkpoint_weights_bytes(weight_files(path), cfg, torch.float32, CPU)
    assert estimate == weights_bytes(model) - rope  # the rotary tables are not weights of the checkpoint


def test_a_bin_checkpoint_is_counted_by_its_size(tmp_path):
    cfg = AutoConfig.from_pretrained(ensure_builtin("tiny-llama"))
    a, b = tmp_path / "pytorch_model-00001.bin", tmp_path / "pytorch_model-00002.bin"
    a.write_bytes(b"\0" * 1000)
    b.write_bytes(b"\0" * 234)
    assert checkpoint_weights_bytes([a, b], cfg, torch.float16, torch.device("meta")) == 1234


def _safetensors(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_a_corrupted_safetensors_header_is_a_load_error(tmp_path):
    ok = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    assert safetensors_header(_safetensors(tmp_path / "ok.safetensors", ok, b"\0" * 8))["w"]["shape"] == [2]
    with pytest.raises(ModelLoadError, match="truncated"):
        safetensors_header(_safetensors(tmp_path / "short.safetensors", ok, b"\0" * 7))
    no_shape = json.dumps({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}).encode()
    with pytest.raises(ModelLoadError, match="no dtype or shape"):
        safetensors_header(_safetensors(tmp_path / "bad.safetensors", no_shape, b"\0" * 8))
    with pytest.raises(ModelLoadError, match="header too large"):
        (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 200_000_000) + b"{}")
        safetensors_header(tmp_path / "huge.safetensors")


def test_warmup_max_length_may_equal_the_models_context():
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.setup import model_max_len
    cfg = AutoConfig.from_pretrained(ensure_builtin("tiny-llama"))
    engine = EngineConfig("tiny-llama", memory_limit=1 << 30)
    limit = model_max_len(cfg, EngineConfig("tiny-llama"))
    plan, _ = estimate_plan(engine, limit, 1)
    assert plan.max_length == limit and plan.max_length_limit == limit
    with pytest.raises(ConfigError, match=f"above the model's context of {limit}"):
        estimate_plan(engine, limit + 1, 1)
