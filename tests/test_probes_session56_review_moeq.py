"""Session 56 review of int4 (GPTQ / AWQ) experts on the GPU path: probes of the memory estimate, the stacks and the
int4 fused MoE that found defects, each test failing before its fix."""

from __future__ import annotations

import json

import pytest
import torch

from infer.kernels import packing


def rtn_gptq(src, out, group_size: int = 32, act_order: bool = False, bits: int = 4) -> None:
    """`src`'s float checkpoint written as a GPTQ one (round to nearest, sym, v1 zeros; every attention projection
    (DeepSeek's kv_a_proj_with_mqa too) and expert projection quantized, the router float): qweight, qzeros, scales
    and g_idx (act_order: g_idx a permutation of the plain one), quantization_config in config.json."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    tensors = {}
    for name, t in load_file(out / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not (name.endswith(("proj.weight", "proj_with_mqa.weight")) or ".experts." in name):  # (DeepSeek's MLA)
            tensors[name] = t
            continue
        n, k = t.shape
        groups = k // group_size
        w = t.float().t()  # [in, out]
        plain = torch.arange(k) // group_size
        # (one permutation per input width: the projections infer merges share their g_idx, as GPTQModel's do)
        g_idx = plain[torch.randperm(k, generator=torch.Generator().manual_seed(k))] if act_order else plain
        half = 2 ** (bits - 1)
        scales = torch.stack([w[g_idx == i].abs().amax(0) for i in range(groups)]).clamp_min(1e-4) / (half - 1)
        scales = scales.half()
        q = (w / scales[g_idx].float()).round().clamp(-half, half - 1).to(torch.int32) + half
        zeros = torch.full((groups, n), half - 1, dtype=torch.int32)
        tensors.update({f"{module}.qweight": packing.pack_rows(q, bits),
                        f"{module}.qzeros": packing.pack_cols(zeros, bits),
                        f"{module}.scales": scales, f"{module}.g_idx": g_idx.int()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                  "desc_act": act_order, "sym": True}
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_the_gpu_estimate_of_mixtral_gptq_experts_counts_one_g_idx_for_w1_and_w3(tmp_path, monkeypatch, model_type):
    """On a GPU an expert's gate and up (Mixtral's w1 and w3, Qwen's gate_proj and up_proj) are one int4 stack with
    one g_idx of H entries (Int4Stack): `warmup --estimate` counted Mixtral's w1 and w3 each with its own g_idx (the
    merged names were Qwen's only), E * H * 4 bytes a layer above what the engine holds."""
    from infer.memory.checkpoint import checkpoint_weights_bytes
    from infer.memory.sizes import weights_bytes
    from infer.models.loader import load_model, weight_files
    from quant_helpers import int4_kernel_path
    from test_probes_session55_moe import build
    build(tmp_path / "base", model_type, num_hidden_layers=1)
    rtn_gptq(tmp_path / "base", tmp_path / "q", act_order=True)
    int4_kernel_path(monkeypatch)
    model, cfg = load_model(tmp_path / "q", torch.float32, torch.device("cpu"))
    assert model.layers[0].mlp.experts.w13.numel() == 0  # (int4 stacks)
    held = weights_bytes(model) - sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                                      if n.endswith(("cos_sin", "packed_weight", "packed_head")))
    files = weight_files(tmp_path / "q")
    assert checkpoint_weights_bytes(files, cfg, torch.float32, torch.device("cuda"), 4, True) == held


def test_check_weights_for_a_gpu_builds_the_experts_as_a_gpu_load_does(tmp_path, monkeypatch):
    """`infer warmup --estimate` checks the checkpoint as a load on its device would: for a GPU the experts int4 (a
    GPU load refuses 8-bit GPTQ experts, UnsupportedModelError). check_weights built the model on the meta device
    as the CPU builds it (experts dequantized at load): the estimate of an 8-bit GPTQ MoE for a GPU passed while its
    load there is refused. The CPU's check still accepts it (the CPU runs it)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.errors import UnsupportedModelError
    from infer.models import loader
    from test_probes_session55_moe import build
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1)
    rtn_gptq(tmp_path / "base", tmp_path / "q8", bits=8)
    loader.check_weights(tmp_path / "q8")
    loader.check_weights(tmp_path / "q8", torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match=r"experts' gate/up projections .* are 8-bit GPTQ: on a GPU"):
        loader.check_weights(tmp_path / "q8", torch.device("cuda"))
    seen = []
    real = loader.check_weights
    monkeypatch.setattr(loader, "check_weights", lambda path, *device: seen.append(device) or real(path, *device))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path / "q8"), "--estimate", "--device", "cpu", "--max-length",
                                   "64", "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert seen and all(d and torch.device(d[0]).type == "cpu" for d in seen), seen


def test_reload_weights_takes_the_int4_stacks_group_size_with_their_g_idx(tmp_path, monkeypatch):
    """reload_weights (vLLM's, new weights written over the folder) adopts the fresh model's tensors; an Int4Stack's
    group_size (computed at load from its g_idx: the kernel's plain groups, or 0 to read g_idx) is no tensor and
    stayed the old load's: weights of plain groups replaced by act-order ones kept group_size 32, and the int4 fused
    MoE read every row's group as row // 32, not its g_idx. The reloaded engine gives the fresh engine's tokens and
    logprobs."""
    import shutil

    from infer import LLM, SamplingParams
    from helpers import random_prompts
    from quant_helpers import int4_kernel_path
    from test_probes_session55_moe import build
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1)
    rtn_gptq(tmp_path / "base", tmp_path / "plain")
    rtn_gptq(tmp_path / "base", tmp_path / "act", group_size=16, act_order=True)
    shutil.copytree(tmp_path / "plain", tmp_path / "m")
    int4_kernel_path(monkeypatch)
    prompts = random_prompts(512, (5, 14), seed=4)[:2]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1)
    opts = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32)
    with LLM(str(tmp_path / "act"), **opts) as llm:
        want = llm.generate(prompts, params)
    with LLM(str(tmp_path / "m"), **opts) as llm:
        experts = llm.engine.runner.model.layers[0].mlp.experts
        assert experts.w13_int4.group_size == 32 and experts.w13_int4.perm is None
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / "act" / f, tmp_path / "m" / f)
        llm.engine.reload_weights()
        # act-order of groups of 16: sorted by group at load (session 58), the permutation and the group size taken
        # with the tensors
        assert experts.w13_int4.group_size == 16 and experts.w13_int4.perm is not None
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-5
