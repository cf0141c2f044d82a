"""Session 64's review of gpt-oss's packed MXFP4 experts: the dequantized values are transformers' at every e8m0
scale (255, OCP's NaN, as torch's ldexp of an int exponent: 0 stays 0, 0.5 is 2^127) on the CPU and in the Triton
kernel (interpreted); groups that dequantize to inf refused at load as float weights with inf are; reload_weights
between an MXFP4 and a float checkpoint of the same gpt-oss names the experts' kind (not "another number of
layers"); sleep offloads the packed experts and a reload takes new MXFP4 weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import ModelLoadError
from infer.kernels import reference

from helpers import nan_filled_empty
from test_probes_session60_gptoss import build, interpreted, to_mxfp4
from test_probes_session64_mxfp4 import moe_kernels, mxfp4_experts, routing  # noqa: F401 (a fixture)

PROMPTS = [[5, 9, 13, 21, 40], [7, 3, 2, 8, 11, 40, 77]]


@pytest.fixture(scope="module")
def gptoss_pair(tmp_path_factory):
    """(a float gpt-oss folder, the same gpt-oss with MXFP4 experts)."""
    root = tmp_path_factory.mktemp("rmx")
    build(root / "float", seed=3)
    shutil.copytree(root / "float", root / "mxfp4")
    to_mxfp4(root / "mxfp4", seed=3)
    return root / "float", root / "mxfp4"


@pytest.mark.parametrize("loaded,new", [("mxfp4", "float"), ("float", "mxfp4")])
def test_reload_weights_between_mxfp4_and_float_experts_names_the_experts_kind(gptoss_pair, tmp_path, loaded, new):
    """reload_weights of a float gpt-oss over an MXFP4 one (or the reverse): refused before anything is freed, naming
    a sparse layer's experts and their kind in each checkpoint (it said "another number of layers?"); the engine
    runs on as before."""
    folders = dict(zip(("float", "mxfp4"), gptoss_pair))
    shutil.copytree(folders[loaded], tmp_path / "engine")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=32) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
        for f in ("model.safetensors", "config.json"):
            shutil.copy(folders[new] / f, tmp_path / "engine" / f)
        with pytest.raises(ModelLoadError) as e:
            llm.collective_rpc("reload_weights")
        kinds = {"float": "float", "mxfp4": "MXFP4"}
        assert "layers.0.mlp.experts" in e.value.message, e.value.message
        assert f"{kinds[new]} in the new checkpoint, {kinds[loaded]} in the loaded one" in e.value.message
        assert "another number of layers" not in e.value.message and "start a new engine" in e.value.hint
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == want


def transformers_dequantized(w: reference.Mxfp4Experts, dtype: torch.dtype) -> torch.Tensor:
    """transformers' dequantized experts (integrations.mxfp4.convert_moe_packed_tensors, [E, in, out]) as the
    [E, out, in] of F.linear."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    return convert_moe_packed_tensors(w.blocks, w.scales, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_dequantize_is_transformers_at_every_scale(dtype):
    """Every byte at every e8m0 scale 0..255: reference.mxfp4_dequantize equals transformers' values (float16's
    overflow to inf included); scale 255 (OCP's NaN) was 2^128 = inf times the value (code 0: nan), transformers'
    torch.ldexp of an int exponent gives 0 for code 0, +-2^127 for +-0.5 (inf beyond)."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 1, 256 // 16, 16).expand(2, 128, 1, 16, 16)
    blocks = blocks.reshape(2, 128, 16, 16).contiguous()  # each row's 16 groups: every byte once
    scales = torch.arange(256, dtype=torch.uint8).reshape(2, 128, 1).expand(2, 128, 16).contiguous()
    w = reference.Mxfp4Experts(blocks, scales)
    got, want = w.dequantize(dtype), transformers_dequantized(w, dtype)
    assert not got.isnan().any() and torch.equal(got, want)
    top = got[1, 127]  # scale 255: a row of every code
    assert (top == 0).any() and top.isinf().any()
    if dtype != torch.float16:
        assert top[top.abs() < float("inf")].abs().max() == 2.0 ** 127


@interpreted
def test_triton_mxfp4_kernel_takes_scale_255_as_transformers(moe_kernels):  # noqa: F811
    """A group of the down projection at scale 255 (codes 0 and +-0.5: +-2^127 and 0, finite) and groups at scale
    0 (2^-127): the Triton kernel (interpreted) and the CPU reference equal the float fused MoE over transformers'
    dequantized experts, finite (the kernel's 2^(255 - 127) = inf made 0 x inf = nan of code 0)."""
    t, e, k, h, i = 6, 3, 2, 64, 32
    w13, w2 = mxfp4_experts(e, h, 2 * i, seed=5), mxfp4_experts(e, i, h, seed=6)
    w13.scales[:, ::5, 0] = 0
    w2.blocks[:, 0, 0] = torch.tensor([0x91, 0x00, 0x19, 0x10] * 4, dtype=torch.uint8)
    w2.scales[:, 0, 0] = 255
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(7)) * 2.0 ** -64  # (products below 2^128)
    w, ids = routing(t, e, k, seed=8)
    ids[:, 0] = 1  # (routing leaves expert 0 out)
    want = reference.fused_moe(x, transformers_dequantized(w13, x.dtype), transformers_dequantized(w2, x.dtype), w,
                               ids)
    assert want.isfinite().all() and want[:, 0].abs().min() > 1.0 and want[:, 1:].abs().max() < 1e-10
    assert torch.equal(reference.fused_moe_mxfp4(x, w13, w2, w, ids), want)
    with nan_filled_empty(moe_kernels):
        got = moe_kernels.fused_moe_mxfp4(x, w13, w2, w, ids)
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)  # (float32 sums)


def test_sleep_offloads_the_packed_experts_and_a_reload_takes_new_mxfp4_weights(gptoss_pair, tmp_path):
    """An MXFP4 gpt-oss in sleep mode: sleep(level=1) frees the experts' uint8 blocks and scales too, wake_up()
    restores them (the same tokens); sleep(level=2), new MXFP4 weights written over the folder and reload_weights:
    the tokens of a fresh engine on the new folder (the old ones' differ)."""
    _, mxfp4 = gptoss_pair
    shutil.copytree(mxfp4, tmp_path / "engine")
    shutil.copytree(gptoss_pair[0], tmp_path / "new")
    to_mxfp4(tmp_path / "new", seed=11)
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def tokens(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    with LLM(str(tmp_path / "new"), block_size=4, max_model_len=32) as llm:
        new = tokens(llm)
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=32, enable_sleep_mode=True) as llm:
        want = tokens(llm)
        assert want != new
        stacks = [m for n, m in llm.llm_engine.runner.model.named_modules() if n.endswith("_mxfp4")]
        assert stacks and all(s.blocks.dtype == s.scales.dtype == torch.uint8 for s in stacks)
        llm.sleep(level=1)
        assert all(t.untyped_storage().nbytes() == 0 for s in stacks for t in (s.blocks, s.scales))
        llm.wake_up()
        assert tokens(llm) == want
        llm.sleep(level=2)
        shutil.copy(tmp_path / "new" / "model.safetensors", tmp_path / "engine" / "model.safetensors")
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
        assert tokens(llm) == new


def _with_scale(src, out, scale: int, codes: int | None = None) -> None:
    """`src`'s MXFP4 checkpoint with layer 1's down_proj group (expert 2, row 3, group 0) at `scale` (its bytes all
    `codes` where given)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_scales"][2, 3, 0] = scale
    if codes is not None:
        tensors["model.layers.1.mlp.experts.down_proj_blocks"][2, 3, 0] = codes
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("scale,codes,dtype,refused", [
    (255, 0x77, torch.bfloat16, "non-finite values (inf) at expert 2, row 3, group 0 (scale 255)"),
    (254, 0x66, torch.float32, "non-finite values (inf) at expert 2, row 3, group 0 (scale 254)"),
    (255, 0x91, torch.bfloat16, None),  # (0 and +-0.5: 0 and +-2^127, finite as transformers dequantizes them)
    (141, 0x11, torch.float16, None),  # (0.5 x 2^14: within float16)
    (145, None, torch.float16, "beyond float16's range (inf) at expert 2, row 3, group 0 (scale 145)"),
    (145, None, torch.bfloat16, None),
])
def test_mxfp4_experts_that_dequantize_to_inf_are_refused_at_load(gptoss_pair, tmp_path, scale, codes, dtype,
                                                                   refused):
    """Float weights with inf (in the file, or past the dtype's range) are refused at load (loader._check_finite);
    the packed MXFP4 experts were never a float tensor it saw: a group that dequantizes to inf (scale 255, OCP's
    NaN, or 254 with large codes; a float16 model's scales past its range) loaded and gave NaN text. Now refused
    naming the tensor, the expert, row, group and scale; finite ones (code 0 at scale 255) load."""
    from infer.models.loader import load_model
    _with_scale(gptoss_pair[1], tmp_path / "m", scale, codes)
    if refused is None:
        model, _ = load_model(tmp_path / "m", dtype, torch.device("cpu"))
        assert model.layers[1].mlp.experts.w2_mxfp4.scales[2, 3, 0] == scale
        return
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path / "m", dtype, torch.device("cpu"))
    assert "layers.1.mlp.experts.down_proj_blocks/_scales" in e.value.message and refused in e.value.message
    assert ("--dtype" in e.value.hint) == (dtype == torch.float16)
