"""Session 70: `infer quantize` of MiniMax-M2 (MiniMaxM2ForCausalLM), refused before: GPTQModel 7.6's minimax_m2
definition looks for the experts under block_sparse_moe (w1, w3, w2), where transformers 5 holds them under mlp (its
defuser's experts.N.gate_proj, up_proj, down_proj): it quantized the attention alone. infer gives GPTQModel a tree of
transformers 5's names with the MoE hooks of those names (quant.quantize._minimax_m2_view), then writes the hub's
names (minimax_m2_name: block_sparse_moe.experts.N.w1, w3, w2, block_sparse_moe.gate, e_score_correction_bias):
every expert int4, the router and its bias float; infer's greedy tokens equal transformers' on the dequantized
weights and GPTQModel's own load of its layout given that tree, on the CPU and (interpreted) the GPU path."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors import safe_open

from infer import LLM

from helpers import random_prompts
from quant_helpers import check_quantized_moe_equals_references, needs_gptqmodel

pytestmark = needs_gptqmodel

PROMPTS = random_prompts(512, (4, 11, 23), seed=11)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(the float model: session 66's random MiniMax-M2 with drawn correction biases, its GPTQ checkpoint, quantize's
    output)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from test_probes_session66_moefam import build
    root = tmp_path_factory.mktemp("minimax-gptq")
    build(root / "f", "minimax_m2")
    res = CliRunner().invoke(app, ["quantize", str(root / "f"), "-o", str(root / "q"), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    return root / "f", root / "q", " ".join(res.output.split())


def _gptqmodels_layout(out, folder):
    """A copy of the checkpoint `out` in `folder` under the names GPTQModel saved (transformers 5's: mlp.experts.N.
    gate_proj, up_proj, down_proj, mlp.gate, mlp.e_score_correction_bias)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(out, folder)
    back = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def name(key):
        key = re.sub(r"block_sparse_moe\.experts\.(\d+)\.(w1|w3|w2)", lambda m: f"mlp.experts.{m[1]}.{back[m[2]]}",
                     key)
        return key.replace(".block_sparse_moe.", ".mlp.")
    state = load_file(str(out / "model.safetensors"))
    save_file({name(k): v for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_every_expert_is_int4_under_the_hubs_names_and_the_tokens_are_transformers_and_gptqmodels(quantized,
                                                                                                  tmp_path):
    """Every expert's w1, w3 and w2 written int4 under block_sparse_moe (as the hub names them), the router and its
    correction bias float there, nothing left under mlp; the report names the modules so; infer's greedy tokens
    equal transformers' on the float model with every GPTQ layer's dequantized weight and GPTQModel's own load of
    its layout given infer's tree; --estimate's weights are the loaded model's; the notes say who reads it."""
    from infer.quant.quantize import MINIMAX_NOTE, _minimax_m2_view
    src, out, output = quantized
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    experts = {f"model.layers.{i}.block_sparse_moe.experts.{e}.{p}.qweight" for i in (0, 1) for e in range(8)
               for p in ("w1", "w3", "w2")}
    assert experts <= names, sorted(experts - names)
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.e_score_correction_bias",
            "model.layers.1.self_attn.q_proj.qweight"} <= names
    assert not any(".mlp." in n for n in names)
    assert "block_sparse_moe.experts.6.w2" in output and "mlp.experts" not in output
    assert MINIMAX_NOTE in output and "its MiniMax-M2 experts stay float layers" in output
    check_quantized_moe_equals_references(src, out, PROMPTS, _minimax_m2_view,
                                          _gptqmodels_layout(out, tmp_path / "gptqmodel"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
def test_the_gpu_path_holds_the_experts_int4_and_gives_the_cpu_paths_tokens(quantized, monkeypatch):
    """The GPU code path (every op through its Triton kernel, interpreted): both sparse layers' experts held int4,
    the CPU path's greedy tokens."""
    from infer.models.moe import SparseMoeBlock
    from quant_helpers import check_kernel_path_equals_cpu, int4_kernel_path
    _, out, _ = quantized
    check_kernel_path_equals_cpu(out, monkeypatch)
    int4_kernel_path(monkeypatch)
    with LLM(str(out), block_size=4, max_model_len=32) as llm:
        blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == 2 and all(b.experts.w13.numel() == 0 for b in blocks)


def test_minimax_names_are_the_hubs():
    """minimax_m2_name: GPTQModel's tensor names and report rows of the experts, router and correction bias as the
    hub's checkpoints name them; every other name, and a longer one that only starts alike, unchanged."""
    from infer.quant.quantize import minimax_m2_name
    cases = {"model.layers.3.mlp.experts.12.gate_proj.qweight": "model.layers.3.block_sparse_moe.experts.12.w1.qweight",
             "model.layers.3.mlp.experts.0.up_proj.scales": "model.layers.3.block_sparse_moe.experts.0.w3.scales",
             "model.layers.0.mlp.experts.7.down_proj.g_idx": "model.layers.0.block_sparse_moe.experts.7.w2.g_idx",
             "model.layers.3.mlp.gate.weight": "model.layers.3.block_sparse_moe.gate.weight",
             "model.layers.3.mlp.e_score_correction_bias": "model.layers.3.block_sparse_moe.e_score_correction_bias",
             "mlp.experts.5.up_proj": "block_sparse_moe.experts.5.w3",
             "model.layers.3.self_attn.q_proj.qweight": "model.layers.3.self_attn.q_proj.qweight",
             "mlp.experts.5.up_proj_extra": "mlp.experts.5.up_proj_extra", "mlp.gate.weight": "mlp.gate.weight"}
    assert {k: minimax_m2_name(k) for k in cases} == cases
