"""Session 71: `infer quantize` of Llama 4, refused before. GPTQModel 7.6's llama4 definition has no dense layer's
MLP ("layer module item `feed_forward.experts.0.gate_proj` not found" on a layer interleave_moe_layer_step leaves
dense), and its defuser guesses the layout of transformers 5's stacked experts (gate_up_proj [E, H, 2I], x @ W) from
their shape, wrongly where hidden_size >= 2 x intermediate_size. infer now quantizes it through a tree of its own with
the layout given (quant.quantize._llama4_view): the attention, the dense MLPs, every expert and the shared expert
int4, the router float; the text model (Llama4ForCausalLM) and the multimodal checkpoint
(Llama4ForConditionalGeneration, the hub's Scout and Maverick: its language model, the vision tower left float).
infer's greedy tokens equal transformers' on the dequantized weights and GPTQModel's own load given the view, on
the CPU and (interpreted) the GPU path, whose experts stay int4; the notes say who reads the checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from helpers import random_prompts
from quant_helpers import check_int4_experts_path_equals_cpu, check_quantized_moe_equals_references, needs_gptqmodel

pytestmark = needs_gptqmodel

PROMPTS = random_prompts(512, (4, 11, 23), seed=11)
# (the built-ins: 4 layers, the odd ones 8 experts of 32 (top 1) beside a shared expert of 32, the even ones a dense
# MLP of 128; hidden_size 64, so that GPTQModel's defuser guesses the stacks' layout wrongly)
MODELS = {"tiny-llama4": "", "tiny-llama4-mm": "language_model."}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized_builtins of MODELS (groups of 32, 8 random samples of 32 tokens)."""
    from quant_helpers import quantized_builtins
    return quantized_builtins(tmp_path_factory.mktemp("llama4-gptq"), MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_every_projection_is_int4_and_the_tokens_are_transformers_and_gptqmodels(quantized, name):
    """Every layer's attention, each sparse layer's experts (gate_proj, up_proj, down_proj apart, as GPTQModel
    writes them) and shared expert, and each dense layer's MLP written int4 under the checkpoint's names; the
    routers and (multimodal) the vision tower float; infer's greedy tokens (float32) equal transformers' on the
    dequantized weights and GPTQModel's own load given infer's view; the notes say transformers does not read the
    experts and GPTQModel.load needs the view."""
    from infer.models.tiny import ensure_builtin
    from infer.quant.quantize import LLAMA4_NOTE, _llama4_view
    out, output = quantized[name]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    p = f"{MODELS[name]}model.layers"
    int4 = {f"{p}.{i}.self_attn.{m}.qweight" for i in range(4) for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    int4 |= {f"{p}.{i}.feed_forward.experts.{e}.{m}.qweight" for i in (1, 3) for e in range(8)
             for m in ("gate_proj", "up_proj", "down_proj")}
    int4 |= {f"{p}.{i}.feed_forward.{part}{m}.qweight" for i, part in ((0, ""), (2, ""), (1, "shared_expert."),
                                                                       (3, "shared_expert."))
             for m in ("gate_proj", "up_proj", "down_proj")}
    assert int4 <= names, sorted(int4 - names)
    assert {f"{p}.{i}.feed_forward.router.weight" for i in (1, 3)} <= names
    assert not any(".experts." in n and not n.endswith(("qweight", "qzeros", "scales", "g_idx")) for n in names)
    if MODELS[name]:
        assert any(n.startswith("vision_model.") and n.endswith(".weight") for n in names)
        assert not any(n.startswith("vision_model.") and n.endswith(".qweight") for n in names)
    assert "transformers does not read GPTQ experts: its Llama 4 experts stay float layers" in output
    assert "; infer read them" in output and LLAMA4_NOTE in output
    check_quantized_moe_equals_references(ensure_builtin(name), out, PROMPTS, _llama4_view)


def test_gptqmodels_own_load_fails_without_infers_view(quantized):
    """What LLAMA4_NOTE says of this shape (hidden_size 64, experts of 32): GPTQModel.load of the checkpoint without
    infer's view splits the stacks wrongly and fails."""
    from quant_helpers import gptqmodel_greedy
    out, _ = quantized["tiny-llama4"]
    with pytest.raises(ValueError, match=r"Trying to set a tensor of shape"):
        gptqmodel_greedy(out, PROMPTS[:1], 2, every_float=True)


def test_the_gpu_path_holds_the_experts_int4_and_gives_the_cpu_paths_tokens(quantized, monkeypatch):
    """The GPU code path (every op through its Triton kernel, interpreted; decode steps through emulated CUDA graphs;
    prefills in chunks) keeps each sparse layer's experts int4 in their stacks and runs the int4 fused MoE on the
    router-scaled inputs: the CPU path's tokens, logprobs close."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.models.moe import SparseMoeBlock
    out, _ = quantized["tiny-llama4"]

    def check(model):
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == 2
        for block in blocks:
            ex = block.experts
            assert ex.w13.numel() == ex.w2.numel() == 0
            assert tuple(ex.w13_int4.words.shape) == (8, ex.hidden // 8, 2 * ex.inter)
    assert check_int4_experts_path_equals_cpu(out, monkeypatch, PROMPTS[:2], check)
