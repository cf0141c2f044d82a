"""Session 43 probes of the memory plan on GPTQ checkpoints with a quantized lm_head and another bit width per
module (GPTQModel's `dynamic`): `infer warmup --estimate` against what the engine holds."""

from __future__ import annotations

import pytest
import torch


def test_the_cpu_estimate_dequantizes_each_layer_at_its_own_width(tmp_path):
    """On a CPU every GPTQ layer is held dequantized (and prepacked where oneDNN is there): a down_proj at 8 bits
    and an 8-bit head in a 4-bit checkpoint hold K x N floats, K from their g_idx, not the 2 x K a 4-bit reading
    of their int32 words gives (the estimate overcounted the head and each 8-bit layer twice over)."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from infer.kernels import cpu_gemm
    from infer.memory import checkpoint
    tensors = {"model.layers.0.mlp.down_proj.qweight": torch.zeros(32, 64, dtype=torch.int32),  # K 128 at 8 bits
               "model.layers.0.mlp.down_proj.g_idx": torch.zeros(128, dtype=torch.int32),
               "lm_head.qweight": torch.zeros(16, 512, dtype=torch.int32),  # K 64 at 8 bits
               "lm_head.g_idx": torch.zeros(64, dtype=torch.int32)}
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = SimpleNamespace(tie_word_embeddings=False, quantization_config={"bits": 4})
    stored = (32 * 64 + 16 * 512) * 4
    for dtype in (torch.float32, torch.float16):
        copies = 2 if cpu_gemm.available(torch.empty(0, dtype=dtype)) else 1
        floats = (128 * 64 + 64 * 512) * (torch.finfo(dtype).bits // 8) * copies
        g_idx = (128 + 64) * 4  # one int32 per input of each (merged) layer
        got = checkpoint.checkpoint_weights_bytes([tmp_path / "model.safetensors"], cfg, dtype, torch.device("cpu"), 4)
        assert got == stored + floats + g_idx, dtype
