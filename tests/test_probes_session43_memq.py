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


def test_a_budget_the_weights_and_the_reserve_take_says_so_not_to_lower_the_batch():
    """--memory-limit 4MB is the runtime reserve's minimum (4 MiB) on its own: with tiny-llama's 1 MiB of weights
    nothing can fit, yet warmup and an engine start said "lower --max-num-batched-tokens (or --max-num-seqs), whose
    activations take most of the budget", which no batch size makes fit. Both now name the weights and the reserve."""
    from typer.testing import CliRunner

    from infer import LLM
    from infer.cli.main import app
    from infer.errors import OutOfMemoryError
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-length", "256", "--concurrency", "2",
                                   "--memory-limit", "4MB"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert "the runtime reserve (4.0 MiB: 1% of the budget, at least 4 MiB) take the whole budget of 4.0 MiB: " \
           "raise --memory-limit well above" in text
    assert "--max-num-batched-tokens" not in text
    with pytest.raises(OutOfMemoryError) as e:
        LLM("tiny-llama", memory_limit="4MB", max_model_len=256)
    assert "the runtime reserve" in str(e.value) and "raise --memory-limit" in str(e.value)
    assert "--max-num-seqs" not in str(e.value)


def test_the_estimate_reads_a_layers_own_bits_from_the_config_when_it_has_no_g_idx(tmp_path, monkeypatch):
    """g_idx is optional in a GPTQ checkpoint (the loader builds the plain one): without it, `warmup --estimate`
    read an 8-bit down_proj and an 8-bit head (`dynamic`, lm_head) as 4-bit words, twice their width; it now takes
    each layer's bits from the quantization config, as the loader does, and counts what the g_idx copy counts."""
    import json
    import shutil

    from safetensors.torch import save_file

    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig
    from infer.models.tiny import ensure_builtin
    from infer.models import loader
    # (the two layers alone, for the sizes: the loader's checks, which refuse the rest missing, left out)
    monkeypatch.setattr(loader, "check_weights", lambda path, device=None: None)
    counts = {}
    for with_g_idx in (True, False):
        d = tmp_path / f"m{int(with_g_idx)}"
        d.mkdir()
        src = ensure_builtin("tiny-llama")
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (src / f).exists():
                shutil.copy(src / f, d / f)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                      "sym": True, "lm_head": True, "checkpoint_format": "gptq",
                                      "dynamic": {"+:.*down_proj": {"bits": 8}, "lm_head": {"bits": 8}}}
        (d / "config.json").write_text(json.dumps(cfg))
        tensors = {"model.layers.0.mlp.down_proj.qweight": torch.zeros(32, 64, dtype=torch.int32),
                   "lm_head.qweight": torch.zeros(16, 512, dtype=torch.int32)}
        if with_g_idx:
            tensors.update({"model.layers.0.mlp.down_proj.g_idx": torch.zeros(128, dtype=torch.int32),
                            "lm_head.g_idx": torch.zeros(64, dtype=torch.int32)})
        save_file(tensors, d / "model.safetensors")
        plan, _ = estimate_plan(EngineConfig(model=str(d), memory_limit="64MB", dtype="float32"), 256, 1)
        counts[with_g_idx] = plan.weights_bytes  # a stored g_idx is counted as the loaded one
    assert counts[False] == counts[True]
