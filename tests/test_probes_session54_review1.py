"""Session 54 review of the session's Phi-3/AWQ gaps and mma.sync changes: split gate/up checkpoints' messages, the
scales' checks on every load path, ..."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from infer import LLM
from infer.errors import ModelLoadError

from quant_helpers import needs_gptqmodel
from test_probes_session54_gaps import split_phi3  # noqa: F401 - the fixture


def _edited(split, tmp_path, edit, config=None):
    shutil.copytree(split, tmp_path / "q")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((tmp_path / "q" / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
        (tmp_path / "q" / "quantize_config.json").unlink(missing_ok=True)
    return tmp_path / "q"


def _drop_g_idx(t):
    for proj in ("gate_proj", "up_proj"):
        t.pop(f"model.layers.0.mlp.{proj}.g_idx")


def _far_g_idx(t):
    for proj in ("gate_proj", "up_proj"):
        t[f"model.layers.0.mlp.{proj}.g_idx"][3] = 7


G_IDX = {"desc_act-without-g_idx": (_drop_g_idx, {"desc_act": True},
                                    r"no tensor model\.layers\.0\.mlp\.gate_proj\.g_idx but config\.json sets "
                                    r"desc_act"),
         "g_idx-outside": (_far_g_idx, None, r"^model\.layers\.0\.mlp\.gate_proj\.g_idx points outside its 2 groups")}


@needs_gptqmodel
@pytest.mark.parametrize("case", G_IDX)
def test_a_split_phi3_checkpoints_g_idx_problems_name_the_tensors_its_files_hold(split_phi3, tmp_path,  # noqa: F811
                                                                                 case):
    """A split gate/up checkpoint (GPTQModel's Phi-3, act-order ones stay split) whose act-order layer has no g_idx,
    or whose g_idx points past its groups, was named as a tensor of mlp.gate_up_proj, which its files do not have."""
    edit, config, message = G_IDX[case]
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(_edited(split_phi3, tmp_path, edit, config)))


# --------------------------------------------------------------------------- scales with inf/NaN on a GPU load
@needs_gptqmodel
def test_non_finite_scales_are_refused_by_the_gpu_loads_check_as_by_the_cpu_ones(split_phi3, tmp_path):  # noqa: F811
    """On a CPU each tensor is checked for inf/NaN as it is read (scales included); on a GPU the loaded parameters
    are checked on the device (`_check_finite_on_device`), but a GPTQ layer's scales are a buffer, which it did not
    look at: a float16 checkpoint's inf or NaN scale loaded without a word there (every output of the layer NaN)."""
    import torch
    from infer.models.loader import _check_finite_on_device, load_model
    bad = _edited(split_phi3, tmp_path, lambda t: t["model.layers.0.mlp.up_proj.scales"].__setitem__((1, 5),
                                                                                                      float("nan")))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.scales has non-finite values"):
        load_model(bad, torch.float32, torch.device("cpu"))  # the CPU load's check, as the tensor is read
    model, _ = load_model(split_phi3, torch.float32, torch.device("cpu"))
    _check_finite_on_device(model, torch.float32)  # a sound checkpoint passes
    model.layers[0].mlp.gate_up_proj.scales[1, 5] = float("inf")
    with pytest.raises(ModelLoadError, match=r"layers\.0\.mlp\.gate_up_proj\.scales has non-finite values"):
        _check_finite_on_device(model, torch.float32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_bf16_scales_are_refused_as_broken_not_named_as_lost_bits_or_out_of_range(bad, caplog):
    """On a GPU load (no per-tensor inf/NaN check as they are read) bfloat16 scales reach `_check_scales` first: a
    NaN was counted among the scales 'below float16's normal range' that 'lose bits' (a warning, the load went on),
    an inf refused as beyond float16's range with the hint to use float16 scales; the checkpoint is broken."""
    import torch
    from infer.quant.gptq_linear import _check_scales
    scales = torch.full((2, 8), 0.01, dtype=torch.bfloat16)
    scales[1, 3] = bad
    with caplog.at_level("WARNING", logger="infer"), \
            pytest.raises(ModelLoadError, match=r"^x\.scales has non-finite values \(inf or NaN\)"):
        _check_scales("x.scales", scales)
    assert not caplog.records, caplog.text


# --------------------------------------------------------------------------- SYNC_MMA tiles read in slices
@pytest.fixture(scope="module")
def gemm():
    from helpers import interpreted_module
    yield from interpreted_module("infer.kernels.gptq_gemm")


def test_sliced_sync_tiles_of_64_columns_a_warp_and_the_other_loads_compute_right(gemm):
    """The sliced mma.sync forms session 54's probes left out: 256 columns on 4 warps (64 a slice: the bench's
    SYNC_MMA twin of `gptq_tune._wide_cols`), plain and gate|up with a bias, fields shifted out (BYTES=False), the
    scales loaded in their own step (AHEAD=False), a group size that is not a power of two (a division), against the
    torch reference under the interpreter."""
    import torch
    from infer.bench.kernels import synced
    from infer.kernels import gptq_configs, gptq_tune
    from infer.kernels import reference as ref
    from infer.quant import packing
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(541)
    wide = synced(gptq_tune._wide_cols(32, (2,))[0])
    assert wide["SYNC_MMA"] and (wide["BLOCK_N"], wide["num_warps"]) == (256, 4)

    def close(y, want, what):
        y, want = y.detach().cpu().float(), want.float()
        err = (y - want).abs().max() / want.abs().max()
        assert y.shape == want.shape and torch.isfinite(y).all() and err <= 2e-3, f"{what}: {err:.2e}"
    for bits, k, n, m, gs, cfg in ((4, 256, 296, 33, 128, wide), (8, 256, 264, 17, 128, dict(wide, AHEAD=False)),
                                   (4, 256, 200, 40, 128, dict(gptq_tune._field("mmat", 64, 128, 4, 1), SYNC_MMA=True,
                                                               BYTES=False)),
                                   (4, 768, 136, 20, 384, dict(gptq_tune._field("mmat", 32, 128, 4, 2, 3, False),
                                                               SYNC_MMA=True, AHEAD=False))):
        qw, qz, s, gi = packing.quantize_rtn(torch.randn(n, k, generator=g), bits, gs, True, None)
        wp = gptq_configs.interleave_for(gs, k, 32 // bits)
        qi = packing.interleave_rows(qw, bits, wp) if wp > 1 else qw
        x = torch.randn(m, k, generator=g).half()
        y = gemm.gptq_matmul(x.to(dev), qi.to(dev), qz.to(dev), s.to(dev), gi.to(dev), bits, True, gs, wp, config=cfg)
        close(y, ref.gptq_matmul(x, qw, qz, s, gi, bits, True), f"{bits}-bit N={n} group {gs} {cfg}")
    half, k = 256, 256
    qw, qz, s, gi = packing.quantize_rtn(torch.randn(2 * half, k, generator=g), 4, 128, True, None)
    wp = gptq_configs.interleave_for(128, k, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    x = torch.randn(24, k, generator=g).half()
    bias = (torch.randn(2 * half, generator=g) * 0.1).half()
    want = ref.silu_and_mul(ref.gptq_matmul(x.float(), qw, qz, s, gi, 4, True, 128, bias=bias.float()))
    assert gemm.gated_fits("mmat", wide, 2 * half)
    y = gemm.gptq_matmul(x.to(dev), qi.to(dev), qz.to(dev), s.to(dev), gi.to(dev), 4, True, 128, wp, config=wide,
                         bias=bias.to(dev), gated=True)
    close(y, want, "gated 32 x 256 on 4 warps")
