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


# --------------------------------------------------------------------------- 2. Gemma 2's soft-capped prefill
def test_the_activation_formula_bounds_gemma2s_soft_capped_prefill_at_concurrency_1():
    """The soft-capped attention (kernels.reference._sdpa, which SDPA cannot do) holds a chunk of a prefill's scores
    in float32 and their softmax (MASK_ELEMENTS a head), where the plain SDPA's CPU kernel holds none: the formula
    counted the capped decode only, so at concurrency 1 with the default token budget (a prefill of the whole
    max_length the peak) the estimate was under the measured peak (tiny-gemma2 2048 x 1 in float32: 7.6 MB by the
    formula, 9.2 MB measured). Measured in a fresh process, as test_memory's test."""
    from helpers import measured_warmup
    from infer.memory.sizes import softcap_cpu_prefill_bytes
    from infer.models.loader import load_config
    from infer.models.resolve import resolve_model
    args = ["tiny-gemma2", "--max-length", "2048", "--concurrency", "1", "--dtype", "float32"]
    measured = measured_warmup(args)
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert peak <= formula <= 1.5 * peak, (formula, peak)
    # Gemma 3 (no soft-capping whatever its config says) and Llama hold no capped scores
    for name in ("tiny-gemma3", "tiny-llama"):
        assert softcap_cpu_prefill_bytes(load_config(resolve_model(name)), torch.float32, 2048, 2048) == 0
