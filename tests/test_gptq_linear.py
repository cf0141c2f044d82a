"""GPTQLinearMethod through MergedLinear (a merged q,k,v of three shards): the layer computes F.linear with the
shards' dequantized weights, in both modes (the dequantized float cache of the CPU path, and the kernel path with
its load-time act-order reordering, run through the torch reference and through the Triton kernel in the
interpreter); broken checkpoints raise ModelLoadError naming the tensor."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from infer import kernels
from infer.errors import ModelLoadError
from infer.models.layers import MergedLinear
from infer.quant import packing
from infer.quant.config import GPTQConfig
from infer.quant.gptq_linear import GPTQLinearMethod

from helpers import interpreted_module

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
SIZES = [64, 32, 32]
IN_F = 128


def shard_tensors(g, cfg: GPTQConfig, perm=None):
    """Per shard: (tensors by name, float weight [n, in] it dequantizes to, bias)."""
    out = []
    for n in SIZES:
        w = torch.randn(n, IN_F, generator=g)
        qw, qz, s, gi = packing.quantize_rtn(w, cfg.bits, cfg.group_size, cfg.sym, perm)
        if not cfg.zeros_v1:
            qz = packing.zeros_v1_to_v2(qz, cfg.bits)
        deq = packing.dequantize(qw, qz, s, gi, cfg.bits, cfg.zeros_v1)
        out.append(({"qweight": qw, "qzeros": qz, "scales": s, "g_idx": gi}, deq, torch.randn(n, generator=g)))
    return out


def build(cfg, shards, use_kernel=None, skip=(), bias=True):
    layer = MergedLinear(IN_F, SIZES, NAMES, bias, GPTQLinearMethod(cfg, use_kernel), torch.float32)
    for i, (tensors, _, b) in enumerate(shards):
        for name, t in tensors.items():
            if (i, name) not in skip:
                layer.load_shard(name, i, t)
        if bias:
            layer.load_shard("bias", i, b)
    layer.finish_loading()
    return layer


CASES = [(bits, group, sym, fmt, desc_act) for bits, group, (sym, fmt), desc_act in itertools.product(
    [4, 8], [32, 64, 128, -1], [(True, "gptq"), (False, "gptq_v2"), (False, "gptq")], [False, True])]


@pytest.mark.parametrize("bits, group, sym, fmt, desc_act", CASES)
@pytest.mark.parametrize("use_kernel", [False, True])
def test_merged_layer_equals_linear_on_dequantized_weights(bits, group, sym, fmt, desc_act, use_kernel):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cfg = GPTQConfig(bits=bits, group_size=group, desc_act=desc_act, sym=sym, checkpoint_format=fmt)
    perm = torch.randperm(IN_F, generator=g) if desc_act else None  # one act-order shared by q, k and v
    shards = shard_tensors(g, cfg, perm)
    layer = build(cfg, shards, use_kernel)
    w = torch.cat([deq for _, deq, _ in shards])
    b = torch.cat([bias for _, _, bias in shards])
    x = torch.randn(7, IN_F, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4, msg=f"seed {g.initial_seed()}")
    assert torch.equal(layer.dequantized_weight(), w)
    if use_kernel:
        assert layer.weight is None and layer.gptq_group_size == (IN_F if group == -1 else group)
        assert (layer.act_perm is not None) == (desc_act and group not in (-1, 128))
        assert layer.gptq_interleave > 1  # the rows were repacked for the kernels, and y above is still right


def test_irregular_g_idx_keeps_the_row_by_row_path():
    g = torch.Generator().manual_seed(1)
    cfg = GPTQConfig(bits=4, group_size=32, desc_act=True)
    shards = shard_tensors(g, cfg)
    gi = torch.randint(0, 4, (IN_F,), generator=g).int()  # groups of uneven sizes: no plain order exists
    for tensors, _, _ in shards:
        tensors["g_idx"] = gi
    layer = build(cfg, shards, use_kernel=True)
    assert layer.gptq_group_size is None and layer.act_perm is None
    w = torch.cat([packing.dequantize(t["qweight"], t["qzeros"], t["scales"], gi, 4) for t, _, _ in shards])
    x = torch.randn(3, IN_F, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias), atol=1e-4, rtol=1e-4)


@pytest.fixture
def triton_gemm(monkeypatch):
    """kernels.gptq_matmul replaced by the Triton kernel (interpreted on CPU)."""
    for mod in interpreted_module("infer.kernels.gptq_gemm"):
        monkeypatch.setattr(kernels, "gptq_matmul", mod.gptq_matmul)
        yield


@pytest.mark.parametrize("bits, group, desc_act", [(4, 32, True), (8, 64, False), (4, -1, False)])
def test_kernel_mode_through_the_triton_kernel(triton_gemm, bits, group, desc_act):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cfg = GPTQConfig(bits=bits, group_size=group, desc_act=desc_act, sym=False)
    shards = shard_tensors(g, cfg, torch.randperm(IN_F, generator=g) if desc_act else None)
    layer = build(cfg, shards, use_kernel=True)
    assert layer.gptq_interleave > 1
    w = torch.cat([deq for _, deq, _ in shards])
    x = torch.randn(5, IN_F, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias), atol=1e-4, rtol=1e-4,
                               msg=f"seed {g.initial_seed()}")


def test_finish_loading_twice_changes_nothing():
    g = torch.Generator().manual_seed(2)
    cfg = GPTQConfig(bits=4, group_size=32, desc_act=True)
    layer = build(cfg, shard_tensors(g, cfg, torch.randperm(IN_F, generator=g)), use_kernel=True)
    before = layer.qweight.clone()
    layer.finish_loading()
    assert torch.equal(layer.qweight, before)


# ----------------------------------------------------------------------------------------------- broken checkpoints
def test_wrong_qweight_shape_names_the_tensor():
    cfg = GPTQConfig(bits=4, group_size=32)
    shards = shard_tensors(torch.Generator().manual_seed(3), cfg)
    shards[1][0]["qweight"] = shards[1][0]["qweight"][:, :-8]
    with pytest.raises(ModelLoadError, match=r"k_proj\.qweight has shape \(16, 24\) but config.json implies "
                                             r"\(16, 32\)"):
        build(cfg, shards)


def test_wrong_bits_shows_as_a_shape_error():
    shards = shard_tensors(torch.Generator().manual_seed(3), GPTQConfig(bits=8, group_size=32))
    with pytest.raises(ModelLoadError, match=r"q_proj\.qweight has shape \(32, 64\)"):
        build(GPTQConfig(bits=4, group_size=32), shards)


def test_missing_scales_names_the_tensor():
    cfg = GPTQConfig(bits=4, group_size=64)
    with pytest.raises(ModelLoadError, match=r"no tensor model\.layers\.0\.self_attn\.v_proj\.scales"):
        build(cfg, shard_tensors(torch.Generator().manual_seed(4), cfg), skip={(2, "scales")})


def test_missing_g_idx_defaults_to_plain_groups():
    g = torch.Generator().manual_seed(5)
    cfg = GPTQConfig(bits=4, group_size=32)
    shards = shard_tensors(g, cfg)
    layer = build(cfg, shards, skip={(i, "g_idx") for i in range(3)})
    x = torch.randn(2, IN_F, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat([d for _, d, _ in shards]), layer.bias))


def test_g_idx_missing_for_one_shard_only():
    cfg = GPTQConfig(bits=4, group_size=32)
    with pytest.raises(ModelLoadError, match=r"no tensor model\.layers\.0\.self_attn\.k_proj\.g_idx"):
        build(cfg, shard_tensors(torch.Generator().manual_seed(6), cfg), skip={(1, "g_idx")})


def test_mismatched_g_idx_names_both_tensors():
    g = torch.Generator().manual_seed(7)
    cfg = GPTQConfig(bits=4, group_size=32, desc_act=True)
    shards = shard_tensors(g, cfg, torch.randperm(IN_F, generator=g))
    shards[2][0]["g_idx"] = shards[2][0]["g_idx"].flip(0)
    with pytest.raises(ModelLoadError, match=r"v_proj\.g_idx differs from model\.layers\.0\.self_attn\.q_proj"):
        build(cfg, shards)


def test_g_idx_out_of_range_and_unexpected_tensor():
    cfg = GPTQConfig(bits=4, group_size=32)
    shards = shard_tensors(torch.Generator().manual_seed(8), cfg)
    for tensors, _, _ in shards:
        tensors["g_idx"] = torch.full((IN_F,), 4, dtype=torch.int32)
    with pytest.raises(ModelLoadError, match="g_idx points outside its 4 groups"):
        build(cfg, shards)
    layer = MergedLinear(IN_F, SIZES, NAMES, False, GPTQLinearMethod(cfg), torch.float32)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.weight"):
        layer.load_shard("weight", 0, torch.zeros(64, IN_F))
