"""Session 70: `infer quantize` of GLM-4.5 / 4.6 (glm4_moe), refused before. GPTQModel 7.6's GLM-4.5 MoE block
(its defuser's one module an expert) takes the router's output for logits, where transformers 5's router returns
(logits, weights, experts): quantizing failed at "'tuple' object has no attribute 'sigmoid'". infer gives GPTQModel's
definition blocks routed by the router's own choice (quant.quantize._glm4_moe_view): the attention, the dense layers'
MLP, every expert and the shared experts int4, the router float; infer's greedy tokens equal transformers' on the
dequantized weights and GPTQModel's own load given that view, on the CPU and (interpreted) the GPU path; the hub's
GLM-4.5-Air in int4 fits one 80 GB GPU."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from infer import LLM

from conftest import restore_originals
from helpers import random_prompts
from quant_helpers import check_quantized_moe_equals_references, gptqmodel_greedy, needs_gptqmodel

pytestmark = needs_gptqmodel

PROMPTS = random_prompts(512, (4, 11, 23), seed=11)
# GLM-4.5-Air's config.json (the hub's values): 46 layers (the first dense, then 128 experts of 1408, top 8, beside
# one shared expert), 96 query heads of 128 over 8 KV heads, half of each head rotated, q/k/v biases
AIR = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
           num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408, n_routed_experts=128,
           num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
           norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False,
           partial_rotary_factor=0.5, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, _defuser_originals):
    """{kind: (the float model, its GPTQ checkpoint, quantize's output)}: session 62's random GLM-4.5 (a dense layer,
    then 8 experts in 4 groups beside a shared expert, drawn correction biases), and one whose every layer is sparse
    (--desc-act --no-sym)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from test_probes_session62_moe import build
    root = tmp_path_factory.mktemp("glm-gptq")
    done = {}
    for kind, config, extra in (("dense-first", {}, []),
                                ("all-sparse-act", {"first_k_dense_replace": 0}, ["--desc-act", "--no-sym"])):
        build(root / kind, **config)
        res = CliRunner().invoke(app, ["quantize", str(root / kind), "-o", str(root / f"{kind}-q"), "--group-size",
                                       "32", "--num-samples", "8", "--seq-len", "32", *extra])
        assert res.exit_code == 0, res.output
        done[kind] = root / kind, root / f"{kind}-q", " ".join(res.output.split())
    # (GPTQModel's defuser left transformers' GLM-4.5 MoE block replaced: the first test's transformers reference too)
    restore_originals(_defuser_originals)
    return done


@pytest.mark.parametrize("kind", ["dense-first", "all-sparse-act"])
def test_glm45_quantizes_every_expert_and_the_tokens_are_transformers_and_gptqmodels(quantized, kind):
    """The attention, the dense layer's MLP, every expert's gate_proj, up_proj and down_proj and the shared experts
    written int4, the router float; infer's greedy tokens equal transformers' on the float model with every GPTQ
    layer's dequantized weight and GPTQModel's own load given infer's view; --estimate's weights are the loaded
    model's; the notes say transformers does not read the experts and GPTQModel.load fails without infer's view."""
    from infer.quant.quantize import GLM4_MOE_NOTE, _glm4_moe_view
    src, out, output = quantized[kind]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    sparse = [1, 2] if kind == "dense-first" else [0, 1, 2]
    int4 = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in sparse for e in range(8)
            for p in ("gate_proj", "up_proj", "down_proj")}
    int4 |= {f"model.layers.{i}.mlp.shared_experts.{p}" for i in sparse for p in ("gate_proj", "down_proj")}
    int4 |= {"model.layers.1.self_attn.q_proj", "model.layers.2.self_attn.o_proj"}
    if kind == "dense-first":
        int4 |= {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"}
    assert {f"{m}.qweight" for m in int4} <= names, sorted({f"{m}.qweight" for m in int4} - names)
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"} <= names
    assert "transformers does not read GPTQ experts: its GLM-4.5 experts stay float layers" in output
    assert "; infer read them" in output and GLM4_MOE_NOTE in output
    check_quantized_moe_equals_references(src, out, PROMPTS, _glm4_moe_view)


def test_gptqmodels_own_load_fails_as_the_note_says(quantized):
    """What GLM4_MOE_NOTE says: GPTQModel.load of the checkpoint without infer's view fails on transformers 5 at its
    first forward, taking the router's tuple for logits."""
    _, out, _ = quantized["dense-first"]
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'sigmoid'"):
        gptqmodel_greedy(out, PROMPTS[:1], 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
@pytest.mark.parametrize("kind", ["dense-first", "all-sparse-act"])
def test_the_gpu_path_holds_the_experts_int4_and_gives_the_cpu_paths_tokens(quantized, monkeypatch, kind):
    """The GPU code path (every op through its Triton kernel, interpreted): the experts held int4 (no float
    experts; act-order ones sorted by group), the CPU path's greedy tokens."""
    from infer.models.moe import SparseMoeBlock
    from quant_helpers import check_kernel_path_equals_cpu, int4_kernel_path
    _, out, _ = quantized[kind]
    check_kernel_path_equals_cpu(out, monkeypatch)
    int4_kernel_path(monkeypatch)
    with LLM(str(out), block_size=4, max_model_len=32) as llm:
        blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == (2 if kind == "dense-first" else 3)
        for block in blocks:
            assert block.experts.w13.numel() == 0 and tuple(block.experts.w13_int4.words.shape) == (8, 64 // 8, 64)
            assert (block.experts.w13_int4.perm is not None) == (kind == "all-sparse-act")


def test_the_hubs_glm45_air_in_int4_fits_one_80_gb_gpu(tmp_path, monkeypatch):
    """A 4-bit GPTQ GLM-4.5-Air of the hub's config and shapes (groups of 128: every projection's, each expert's
    apart, in the layout `infer quantize` writes; its multi-token-prediction layer, which transformers drops, not
    stored): built as a GPU builds it, every sparse layer's experts int4; its 106 B parameters, about 199 GiB in
    bfloat16, come to about 0.54 bytes a parameter (58 GB), and `warmup --estimate` on an 80 GiB GPU fits two
    sequences of 32,768 tokens (its KV is 184 KiB a token, every layer's)."""
    import json

    from typer.testing import CliRunner

    from helpers import hub_shaped_folder
    from infer.cli.main import app
    from infer.memory.checkpoint import checkpoint_load_bytes
    from infer.models import moe
    from infer.models.loader import linear_method_factory, load_config
    from infer.models.registry import model_class
    from test_probes_session67_llama4b import on_an_80_gb_gpu
    params = hub_shaped_folder(tmp_path, "glm4_moe", "Glm4MoeForCausalLM", AIR, gptq_group=128)
    assert 105e9 < params < 108e9, params
    cfg = load_config(tmp_path)
    with moe.meta_as_gpu(), torch.device("meta"):
        model = model_class(cfg)(cfg, torch.bfloat16, linear_method_factory(tmp_path, cfg))
    blocks = [m for m in model.modules() if isinstance(m, moe.SparseMoeBlock)]
    assert len(blocks) == 45 and all(b.experts.w13.numel() == 0 and b.int4 is not None for b in blocks)
    weights = checkpoint_load_bytes(tmp_path, cfg, torch.bfloat16, torch.device("cuda"))
    assert 0.5 * params < weights < 0.56 * params, (weights, params)
    on_an_80_gb_gpu(monkeypatch)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--device", "cuda",
                                   "--max-length", "32768", "--concurrency", "2"])
    assert res.stdout.strip(), res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.exit_code == 0 and plan["fits"], res.output
    assert weights <= plan["weights_bytes"] < weights + 2 ** 28  # (with the tables of positions)


def test_glm47_flash_quantizes_every_expert_through_the_same_fix(tmp_path, _defuser_originals):
    """GLM-4.7-Flash (glm4_moe_lite: DeepSeek-V3's latent attention with GLM-4.5's router and experts) failed the
    same way ("'tuple' object has no attribute 'sigmoid'", after loading the model): through the same fix every
    expert, the shared experts and the latent attention's projections are int4; infer's greedy tokens equal
    transformers' on the dequantized weights and GPTQModel's own load given the fix; the notes say so. (The model's
    seed is 1: with seed 0 one prompt's fifth token is a near tie, 0.0016 apart in logprob, which infer's float16
    dequantization of the GPTQ weights, as GPTQ runtimes compute it, up to 2.4e-4 off the float32 dequantization
    both references use, decides the other way.)"""
    from typer.testing import CliRunner

    from helpers import save_random_model
    from infer.cli.main import app
    from infer.quant.quantize import GLM4_MOE_NOTE, _glm4_moe_view
    from test_probes_session65_deepseek import GLM_LITE
    save_random_model(tmp_path / "f", "glm4_moe_lite", "Glm4MoeLiteForCausalLM", GLM_LITE, 1)
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(tmp_path / "q"), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    restore_originals(_defuser_originals)
    assert res.exit_code == 0, res.output
    output = " ".join(res.output.split())
    assert "its GLM-4.7-Flash experts stay float layers" in output and GLM4_MOE_NOTE in output
    out = tmp_path / "q"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    int4 = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (1, 2) for e in range(8)
            for p in ("gate_proj", "up_proj", "down_proj")}
    int4 |= {"model.layers.1.mlp.shared_experts.down_proj", "model.layers.0.mlp.gate_proj",
             "model.layers.1.self_attn.kv_b_proj", "model.layers.2.self_attn.o_proj"}
    assert {f"{m}.qweight" for m in int4} <= names, sorted({f"{m}.qweight" for m in int4} - names)
    check_quantized_moe_equals_references(tmp_path / "f", out, PROMPTS, _glm4_moe_view)
