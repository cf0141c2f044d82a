"""Session 70: Granite MoE's, GraniteMoeShared's and Granite 4.0's experts as GPTQ int4. GPTQModel 7.6's Granite
definitions look for the experts under block_sparse_moe.input_linear.N / output_linear.N, where transformers 5 stacks
them and GPTQModel's defuser splits them into experts.N.gate_proj / up_proj / down_proj: they quantized none (and it
has no GraniteMoeShared definition: its fallback left them float too). `infer quantize` now gives GPTQModel a tree of
infer's own (quant.quantize._granite_view): every expert int4, the router float; infer's greedy tokens equal
transformers' on the dequantized weights and GPTQModel's own load given that tree, on the CPU and (interpreted) the
GPU path, whose experts stay int4; the notes say who reads the checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from helpers import greedy_each, random_prompts
from quant_helpers import check_int4_experts_path_equals_cpu, check_quantized_moe_equals_references, needs_gptqmodel

pytestmark = needs_gptqmodel

PROMPTS = random_prompts(512, (4, 11, 23), seed=11)
MODELS = {"tiny-granitemoe": "Granite MoE", "tiny-granitemoeshared": "GraniteMoeShared", "tiny-granite4": "Granite 4.0"}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized_builtins of MODELS (groups of 32, 8 random samples of 32 tokens)."""
    from quant_helpers import quantized_builtins
    return quantized_builtins(tmp_path_factory.mktemp("granite-gptq"), MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_every_expert_is_int4_and_the_tokens_are_transformers_and_gptqmodels(quantized, name):
    """Every expert's gate_proj, up_proj and down_proj in every layer written int4, no float expert, the router
    float; infer's greedy tokens equal transformers' on the float model with every GPTQ layer's dequantized weight
    and GPTQModel's own load given infer's tree; --estimate's weights are the loaded model's; the notes say
    transformers does not read the experts, and GPTQModel.load needs infer's tree."""
    from infer.models.tiny import ensure_builtin
    from infer.quant.quantize import GRANITE_MOE_NOTE, _granite_view
    out, output = quantized[name]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    layers = {int(n.split(".")[2]) for n in names if ".block_sparse_moe." in n}
    assert layers
    experts = {f"model.layers.{i}.block_sparse_moe.experts.{e}.{p}.qweight" for i in layers for e in range(8)
               for p in ("gate_proj", "up_proj", "down_proj")}
    assert experts <= names, sorted(experts - names)
    assert not any(".experts." in n and n.endswith(".weight") for n in names)
    assert {f"model.layers.{i}.block_sparse_moe.router.weight" for i in layers} <= names
    assert f"transformers does not read GPTQ experts: its {MODELS[name]} experts stay float layers" in output
    assert "; infer read them" in output and GRANITE_MOE_NOTE in output
    check_quantized_moe_equals_references(ensure_builtin(name), out, PROMPTS, _granite_view)


def test_gptqmodels_own_load_leaves_the_experts_unread(quantized):
    """What GRANITE_MOE_NOTE says: GPTQModel.load of such a checkpoint without infer's tree builds the experts as
    float layers, which the checkpoint's int4 tensors never fill (the attention's layers are GPTQModel's quantized
    ones)."""
    from gptqmodel import BACKEND, GPTQModel
    out, _ = quantized["tiny-granitemoe"]
    model = GPTQModel.load(str(out), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16).model
    layer = model.model.layers[1]
    assert hasattr(layer.self_attn.q_proj, "qweight")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(layer.block_sparse_moe.experts[0], proj)
        assert type(linear) is torch.nn.Linear and not hasattr(linear, "qweight")


@pytest.mark.parametrize("name", ["tiny-granitemoe", "tiny-granite4"])
def test_the_gpu_path_holds_the_experts_int4_and_gives_the_cpu_paths_tokens(quantized, monkeypatch, name):
    """The GPU code path (every op through its Triton kernel, interpreted; decode steps through emulated CUDA graphs;
    prefills in chunks) keeps every sparse layer's experts int4 in their stacks (gate's and up's columns) and runs
    the int4 fused MoE: the CPU path's tokens, logprobs close."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.models.moe import SparseMoeBlock
    out, _ = quantized[name]

    def check(model):
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        assert blocks
        for block in blocks:
            ex = block.experts
            assert ex.w13.numel() == ex.w2.numel() == 0
            assert tuple(ex.w13_int4.words.shape) == (8, ex.hidden // 8, 2 * ex.inter)
    check_int4_experts_path_equals_cpu(out, monkeypatch, PROMPTS[:2], check)


def test_the_notes_are_for_granites_with_experts_alone():
    """quantize's notes for a Granite: transformers does not read the GPTQ experts, infer alone reads them, and
    GPTQModel.load needs infer's tree; none for a Granite 4.0 without experts (granite-4.0-micro's shape)."""
    from infer.quant.quantize import GRANITE_MOE_NOTE, moe_notes
    for model_type, arch in (("granitemoe", "Granite MoE"), ("granitemoeshared", "GraniteMoeShared"),
                             ("granitemoehybrid", "Granite 4.0")):
        notes = moe_notes({"model_type": model_type, "num_local_experts": 8}, {}, 3)
        assert notes[0].startswith(f"transformers does not read GPTQ experts: its {arch} experts")
        assert notes[0].endswith("; infer read them") and notes[1] == GRANITE_MOE_NOTE
    assert moe_notes({"model_type": "granitemoehybrid", "num_local_experts": 0}, {}, 3) == []


def test_gptq_experts_with_adapters_equal_peft_on_the_dequantized_weights_on_both_paths(quantized, tmp_path,
                                                                                         monkeypatch):
    """The GPTQ Granite MoE with adapters of its stacked experts (and q_proj) mixed with the base in one batch:
    peft's tokens on the dequantized float weights on the CPU path, and the same on the GPU code path (interpreted),
    whose int4 fused MoE keeps the experts int4 and adds the adapters' deltas (their weights at 0.5's scale: Granite's
    residual_multiplier of 0.22 leaves smaller deltas too small to change a token)."""
    from lora_helpers import GRANITE_EXPERTS, save_adapters
    adapters = {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=GRANITE_EXPERTS),
                "b": dict(r=8, lora_alpha=16, target_parameters=[GRANITE_EXPERTS[0]])}
    _check_adapters_equal_peft_on_both_paths(quantized, "tiny-granitemoe", monkeypatch,
                                             lambda hf: save_adapters(hf, tmp_path, adapters, scale=0.5))


def _check_adapters_equal_peft_on_both_paths(quantized, name: str, monkeypatch, make) -> None:
    """The adapters `make(hf)` saves ({name: folder}, the first and last of two) on the dequantized float model of
    the GPTQ built-in `name`, mixed with the base in one batch (prompts of 6, 10 and 5 tokens): peft's tokens on
    the CPU path, and the same on the GPU code path (interpreted); both adapters change their request's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.models.tiny import ensure_builtin
    from quant_helpers import dequantized_float_model
    from test_probes_session57_moelora import _cpu_and_gpu_path, peft_tokens
    out, _ = quantized[name]
    hf = dequantized_float_model(ensure_builtin(name), out)
    hf.generation_config.eos_token_id = None
    paths = make(hf)
    prompts = random_prompts(512, (6, 10, 5), seed=7)
    names = [next(iter(paths)), None, list(paths)[-1]]
    cpu, gpu = _cpu_and_gpu_path(out, paths, prompts, names, monkeypatch)
    assert cpu == peft_tokens(hf, paths, prompts, names, 5)
    assert gpu == cpu
    base_tokens = greedy_each(hf, prompts, 5)
    assert cpu[0] != base_tokens[0] and cpu[2] != base_tokens[2]


@pytest.mark.parametrize("name", ["tiny-granite4", "tiny-granitemoeshared"])
def test_gptq_shared_mlp_adapters_equal_peft_on_the_dequantized_weights_on_both_paths(quantized, tmp_path,
                                                                                      monkeypatch, name):
    """(Session 71) The GPTQ Granite 4.0 and GraniteMoeShared with adapters of their int4 shared MLP (input_linear,
    output_linear: test_probes_session71_granite_lora's "all8", every Linear layer and the stacked experts, and
    "mlp4") mixed with the base in one batch: peft's tokens on the dequantized float weights on the CPU path, and
    the same on the GPU code path (interpreted), whose shared MLP stays int4."""
    from test_probes_session71_granite_lora import _adapters
    with safe_open(str(quantized[name][0] / "model.safetensors"), "pt") as f:
        assert "model.layers.0.shared_mlp.input_linear.qweight" in set(f.keys())
    _check_adapters_equal_peft_on_both_paths(quantized, name, monkeypatch, lambda hf: _adapters(hf, tmp_path, name))


@pytest.mark.parametrize("name", ["tiny-granitemoe", "tiny-granite4"])
def test_lora_validate_quantized_checks_an_experts_adapter_against_peft(quantized, tmp_path, name):
    """(Seventy-third session) `infer lora-validate --quantized` on the GPTQ Granite MoE and Granite 4.0: its oracle
    (transformers' load of the dequantized checkpoint, the experts stacked as Granite's input_linear and
    output_linear: lora_check.dequantized_moe_oracle) agrees with infer on an adapter of q_proj and the stacked
    experts; it stopped at "no weight for model.layers.0.block_sparse_moe.experts.down_proj"."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    from lora_helpers import GRANITE_EXPERTS, save_adapters
    from transformers import AutoModelForCausalLM

    from infer.models.tiny import ensure_builtin
    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin(name), dtype=torch.float32)
    paths = save_adapters(hf, tmp_path, {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                   target_parameters=GRANITE_EXPERTS)}, scale=0.5)
    res = CliRunner().invoke(app, ["lora-validate", str(quantized[name][0]), f"a={paths['a']}", "--quantized",
                                   "--steps", "3", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index('{"name"'):].splitlines()[0])
    assert report["ok"] and report["numeric"]["tokens_agree"], report
    assert report["numeric"]["adapter_effect"] > 100 * report["numeric"]["max_abs_diff"], report
