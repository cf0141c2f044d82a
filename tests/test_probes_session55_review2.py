"""Session 55, review 2 of the known gaps' fixes (warmup --estimate's loader checks, float32 scales, Gemma 2's
soft-capped estimate, stats() across sleep, checkpoint name prefixes, the draft's warm-up, bench's details)."""

from __future__ import annotations

import torch


# --------------------------------------------------------------------------- 1. a fused module's scales, one warning
def test_a_fused_modules_scales_below_float16s_range_are_warned_about_once_with_the_whole_count(caplog):
    """A checkpoint that stores a merged layer as one module (Phi-3's gate_up_proj, qkv_proj) had its float32 (or
    bfloat16) scales checked part by part as they were cut into shards: one warning per shard, each naming the same
    tensor with a part of the count. The tensor is checked once, as the checkpoint stores it."""
    from infer.models.layers import MergedLinear
    from infer.quant.config import GPTQConfig
    from infer.quant.gptq_linear import GPTQLinearMethod
    for dtype in (torch.float32, torch.bfloat16):
        caplog.clear()
        layer = MergedLinear(64, [32, 32], ["layers.0.mlp.gate_up_proj"] * 2, False,
                             GPTQLinearMethod(GPTQConfig(bits=4, group_size=32)), torch.float16)
        scales = torch.full((2, 64), 0.01, dtype=dtype)
        scales[0, 0] = scales[0, 40] = scales[1, 50] = 1e-6
        with caplog.at_level("WARNING", logger="infer"):
            layer.load_fused("scales", scales)
        warned = [r.message for r in caplog.records if "scale" in r.message]
        assert len(warned) == 1, warned
        assert warned[0].startswith(f"layers.0.mlp.gate_up_proj.scales: 3 {str(dtype)[6:]} scales below"), warned
        assert torch.equal(layer.scales, scales.half())
