"""Session 70: `infer quantize` of ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM), refused before: GPTQModel 7.6's
ernie4_5_moe definition patches the model's forward with one written for the hub's remote code, which calls
_update_causal_mask (gone in transformers 5). infer gives GPTQModel that definition without its patch
(quant.quantize._ernie45_moe_view): the attention, the dense layers' MLP, every expert and the shared experts int4,
the router and its moe_statics bias float; infer's greedy tokens equal transformers' on the dequantized weights and
GPTQModel's own load, on the CPU and (interpreted) the GPU path."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from infer import LLM

from helpers import random_prompts
from quant_helpers import check_quantized_moe_equals_references, needs_gptqmodel

pytestmark = needs_gptqmodel

PROMPTS = random_prompts(512, (4, 11, 23), seed=11)
KINDS = {"interval2-shared2": ({}, [1, 3]),  # (config, its sparse layers)
         "all-sparse-top1-act": (dict(moe_layer_start_index=0, moe_layer_interval=1, moe_num_shared_experts=0,
                                      moe_k=1), [0, 1, 2, 3])}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """{kind: (the float model, its GPTQ checkpoint, quantize's output)}: session 63's random ERNIE 4.5 MoE (experts
    on every other layer beside 2 shared experts, drawn router biases), and one whose every layer is sparse, without
    shared experts, one expert a token (--desc-act)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from test_probes_session63_moe35 import build_ernie
    root = tmp_path_factory.mktemp("ernie-gptq")
    done = {}
    for kind, (config, _) in KINDS.items():
        build_ernie(root / kind, **config)
        extra = ["--desc-act"] if kind.endswith("act") else []
        res = CliRunner().invoke(app, ["quantize", str(root / kind), "-o", str(root / f"{kind}-q"), "--group-size",
                                       "32", "--num-samples", "8", "--seq-len", "32", *extra])
        assert res.exit_code == 0, res.output
        done[kind] = root / kind, root / f"{kind}-q", " ".join(res.output.split())
    return done


@pytest.mark.parametrize("kind", KINDS)
def test_ernie_quantizes_every_expert_and_the_tokens_are_transformers_and_gptqmodels(quantized, kind):
    """Every expert's gate_proj, up_proj and down_proj, the shared experts, the dense layers' MLP and the attention
    written int4, the router and its moe_statics bias float; infer's greedy tokens equal transformers' on the float
    model with every GPTQ layer's dequantized weight and GPTQModel's own load; --estimate's weights are the loaded
    model's; the notes say transformers does not read the experts."""
    src, out, output = quantized[kind]
    sparse = KINDS[kind][1]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    int4 = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in sparse for e in range(8)
            for p in ("gate_proj", "up_proj", "down_proj")} | {"model.layers.1.self_attn.q_proj"}
    if kind == "interval2-shared2":
        int4 |= {f"model.layers.{i}.mlp.shared_experts.{p}" for i in sparse for p in ("up_proj", "down_proj")}
        int4 |= {"model.layers.0.mlp.gate_proj", "model.layers.2.mlp.down_proj"}
    assert {f"{m}.qweight" for m in int4} <= names, sorted({f"{m}.qweight" for m in int4} - names)
    assert {f"model.layers.{sparse[0]}.mlp.gate.weight",
            f"model.layers.{sparse[0]}.mlp.gate.moe_statics.e_score_correction_bias"} <= names
    assert "transformers does not read GPTQ experts: its ERNIE 4.5 MoE experts stay float layers" in output
    assert "; infer and GPTQModel.load read them" in output
    check_quantized_moe_equals_references(src, out, PROMPTS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
@pytest.mark.parametrize("kind", KINDS)
def test_the_gpu_path_holds_the_experts_int4_and_gives_the_cpu_paths_tokens(quantized, monkeypatch, kind):
    """The GPU code path (every op through its Triton kernel, interpreted): every sparse layer's experts held int4
    (act-order ones sorted by group), the CPU path's greedy tokens."""
    from infer.models.moe import SparseMoeBlock
    from quant_helpers import check_kernel_path_equals_cpu, int4_kernel_path
    _, out, _ = quantized[kind]
    check_kernel_path_equals_cpu(out, monkeypatch)
    int4_kernel_path(monkeypatch)
    with LLM(str(out), block_size=4, max_model_len=32) as llm:
        blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == len(KINDS[kind][1])
        for block in blocks:
            assert block.experts.w13.numel() == 0 and tuple(block.experts.w13_int4.words.shape) == (8, 64 // 8, 64)
            assert (block.experts.w13_int4.perm is not None) == kind.endswith("act")
