"""LFM2-MoE (Lfm2MoeForCausalLM, models.lfm2 with models.moe's experts) takes adapters as LFM2 does: its attention's
q, k, v and out_proj, its short convs' in_proj and out_proj, its dense layers' MLP (w1, w3, w2) equal peft mixed in
one batch; adapters of its experts (target_parameters, transformers 4's per-expert modules) or of its router
(feed_forward.gate) are refused naming them, at registration and by `infer lora-validate`; the memory plan counts
the slots it allocates (none for the experts)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.errors import LoRAError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from quant_helpers import needs_gptqmodel

NAME = "tiny-lfm2-moe"
EVERY = ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w3", "w2"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """tiny-lfm2-moe in float32 (transformers) and two adapters of it: "all" (every projection peft finds: the
    attention's, the short convs', layer 0's dense MLP) and "conv" (the short convs' in_proj and out_proj alone)."""
    from lora_helpers import hf_float, save_adapters
    hf = hf_float(ensure_builtin(NAME))
    paths = save_adapters(hf, tmp_path_factory.mktemp("lfm2moe"), {
        "all": dict(r=8, lora_alpha=16, target_modules=EVERY),
        "conv": dict(r=4, lora_alpha=4, target_modules=r".*\.conv\.(in_proj|out_proj)")}, scale=0.5)
    return hf, paths


def test_mixed_adapters_on_every_projection_equal_peft(adapters):
    """"all" (q, k, v, out_proj of the attention and of the short convs, in_proj, the dense layer's w1, w3, w2),
    the base and "conv" in one batch and each alone: peft's tokens; "all" adapts the dense MLP (its LoRA tensors are
    there, layer 0's alone: the experts' layers have no w1)."""
    from lora_helpers import check_mixed_adapters_equal_peft
    from safetensors import safe_open
    hf, paths = adapters
    with safe_open(str(paths["all"] / "adapter_model.safetensors"), "pt") as f:
        mlp = {k.split(".")[4] + "." + k.split(".")[6] for k in f.keys() if ".feed_forward." in k}
    assert mlp == {"0.w1", "0.w3", "0.w2"}
    check_mixed_adapters_equal_peft(ensure_builtin(NAME), hf, paths, random_prompts(512, (7, 12, 5), seed=2),
                                    ["all", None, "conv"], n=5)


@pytest.mark.parametrize("targets", [None, ["qkv_proj", "out_proj"], ["in_proj", "w1", "w3", "w2"]])
def test_adapter_slots_are_the_memory_plans(targets):
    """The slots allocated (every layer; the attention's with both kinds of out_proj; the short convs' in_proj with
    the dense MLP, 96 wide), none on the experts, are what the memory plan and lora_slot_bytes count, byte for byte."""
    from infer.memory.sizes import lora_slot_bytes
    with LLM(NAME, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, lora_target_modules=targets) as llm:
        manager, cfg = llm.engine.lora_manager, llm.engine.runner.model.config
        assert not manager.expert_layers
        got = manager.device_bytes()
        assert got == llm.engine.memory_plan.lora_bytes == lora_slot_bytes(cfg, 2, 4, torch.float32, targets) > 0


def _validate(base, adapter) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(adapter)])
    return res.exit_code, " ".join(res.output.split())


def test_lora_validate_accepts_a_good_adapter(adapters):
    from lora_helpers import check_lora_validate_ok
    check_lora_validate_ok(ensure_builtin(NAME), adapters[1]["all"])


REFUSED = r"infer does not adapt LFM2-MoE's experts or router \(feed_forward.experts, feed_forward.gate\)"


def test_an_adapter_of_the_experts_is_refused_naming_them(adapters, tmp_path):
    """peft adapts the stacked experts (target_parameters): refused naming them, at registration and by lora-validate,
    saying what to train instead."""
    from lora_helpers import save_adapter
    hf, _ = adapters
    path = save_adapter(hf, tmp_path / "ex", 1, r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0,
                        target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"])
    with pytest.raises(LoRAError, match=r'target_parameters \["feed_forward.experts.gate_up_proj", "feed_forward.'
                       r'experts.down_proj"\]: ' + REFUSED + r".*train the adapter with target_modules on the "
                       r"attention \(q_proj, k_proj, v_proj, out_proj\), the short convs"):
        LLM(NAME, loras={"x": str(path)}, max_lora_rank=8)
    code, out = _validate(ensure_builtin(NAME), path)
    assert code != 0 and "infer does not adapt LFM2-MoE's experts or router" in out


@pytest.mark.parametrize("module, cols, rows, what", [
    ("layers.1.feed_forward.experts.3.w1", 64, 32, "adapts model.layers.1.feed_forward.experts.3.w1"),
    ("layers.2.feed_forward.gate", 64, 8, r"targets \['gate'\]")])
def test_an_adapter_of_an_expert_or_the_router_is_refused_naming_it(adapters, tmp_path, module, cols, rows, what):
    """An adapter (of transformers 4's time) with LoRA weights on one expert's w1, or on the router (gate, not a
    Linear layer: peft cannot adapt it), is refused naming it, as an unknown module would not be."""
    from lora_helpers import adapter_with_module, save_adapter
    hf, _ = adapters
    src = save_adapter(hf, tmp_path / "q", 1, r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0)
    path = adapter_with_module(src, tmp_path / "x", module, 4, cols, rows)
    if module.endswith(".w1"):  # (its target_modules as a regex of the attention and the expert: no name listed)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r".*\.(q_proj|w1)"}))
    with pytest.raises(LoRAError, match=what + ": " + REFUSED):
        LLM(NAME, loras={"x": str(path)}, max_lora_rank=8)
    code, out = _validate(ensure_builtin(NAME), path)
    assert code != 0 and "infer does not adapt LFM2-MoE's experts or router" in out


def test_an_adapter_of_the_depthwise_conv_is_refused_by_name(adapters, tmp_path):
    """target_modules naming the short convs' depthwise conv (conv) are refused as on LFM2, naming LFM2-MoE."""
    from lora_helpers import save_adapter
    hf, _ = adapters
    path = save_adapter(hf, tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "conv"]}))
    with pytest.raises(LoRAError, match=r"targets \['conv'\]: infer's adapters of lfm2_moe \(LFM2-MoE\) adapt the "
                                        r"attention's, the short convs' and the MLP's projections"):
        LLM(NAME, loras={"x": str(path)}, max_lora_rank=8)


@needs_gptqmodel
def test_infer_quantize_writes_every_projection_int4_equal_to_its_dequantized_weights(tmp_path):
    """`infer quantize` of tiny-lfm2-moe (GPTQModel's lfm2_moe definition under transformers 5's names) writes the
    short convs' in_proj and out_proj, the attention's q, k, v and out_proj, the dense MLP's w1, w3, w2 and every
    expert's projections int4 under LFM2-MoE's names (experts.N.w1, w3, w2), the router float; infer's CPU path gives
    transformers' greedy tokens on the same weights dequantized; warmup --estimate counts its weights as loaded."""
    from safetensors.torch import load_file

    from quant_helpers import check_gptq_moe_equals_dequantized, infer_quantize
    out = infer_quantize(NAME, tmp_path / "q")
    tensors = load_file(out / "model.safetensors")
    quantized = {k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")}
    want = {"model.layers.0.conv.in_proj", "model.layers.0.conv.out_proj", "model.layers.1.self_attn.out_proj",
            *(f"model.layers.1.self_attn.{p}_proj" for p in "qkv"),
            *(f"model.layers.0.feed_forward.w{i}" for i in (1, 3, 2)),
            *(f"model.layers.{i}.feed_forward.experts.{e}.w{p}" for i in (1, 2, 3) for e in range(8)
              for p in (1, 3, 2))}
    assert want <= quantized
    assert not any(k.endswith(".weight") and ("_proj." in k or ".w1." in k) for k in tensors)
    assert tensors["model.layers.1.feed_forward.gate.weight"].is_floating_point()
    check_gptq_moe_equals_dequantized(ensure_builtin(NAME), out, lambda layer: layer.self_attn.o_proj)


def test_no_target_modules_and_a_regex_of_the_router_are_refused_as_peft_refuses_them(adapters, tmp_path):
    """Without target_modules (peft has no lfm2_moe default) the adapter is refused as peft refuses it; a
    target_modules regex that selects the router (feed_forward.gate) or the experts (feed_forward.experts), not Linear
    layers, is named as peft cannot load it."""
    from lora_helpers import check_no_target_modules_refused_as_peft
    from transformers import AutoConfig

    from infer.lora.adapter import adapter_problems
    path = check_no_target_modules_refused_as_peft(ensure_builtin(NAME), adapters[1]["conv"], tmp_path / "a",
                                                   "lfm2_moe")
    config = json.loads((path / "adapter_config.json").read_text())
    for regex, module in ((r".*\.conv\.(in_proj|out_proj)|.*\.gate", "layers.1.feed_forward.gate"),
                          (r".*\.(conv\.in_proj|conv\.out_proj|feed_forward\.experts)",
                           "layers.1.feed_forward.experts")):
        (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": regex}))
        problems = [str(p) for p in adapter_problems("a", path, AutoConfig.from_pretrained(ensure_builtin(NAME)))]
        assert any(f"selects model.{module}, which is not a Linear layer" in p for p in problems), problems
