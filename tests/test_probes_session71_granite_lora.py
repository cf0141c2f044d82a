"""Session 71: adapters of Granite 4.0's and GraniteMoeShared's shared MLP (shared_mlp.input_linear, gate|up as one
Linear, and output_linear), which peft adapts as plain Linear layers (target_modules "input_linear", or "all-linear",
the usual fine-tuning target) and infer refused: granite-4.0-micro's shared MLP is its only MLP. Mixed with the base
in one batch they equal peft on float bases, and on GPTQ bases (peft on the dequantized weights) on the CPU and the
GPU code path (interpreted: test_probes_session70_granite_gptq); --lora-target-modules takes input_linear and
output_linear (Granite 4.0 without experts no longer offers gate_proj/up_proj/down_proj, which it does not have),
and the memory plan counts GraniteMoeShared's shared MLP's slots, which it left out."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import GRANITE_EXPERTS, check_mixed_adapters_equal_peft, hf_float, save_adapters

# per built-in: "all8" adapts every Linear layer peft finds (all-linear: the attention, the Mamba-2 mixers'
# in_proj/out_proj, the shared MLP) and the stacked experts where there are some; "mlp4" the shared MLP alone, or
# its output_linear and the attention's v_proj
ADAPTERS = {
    "tiny-granite4": {"all8": dict(r=8, lora_alpha=16, target_modules="all-linear", target_parameters=GRANITE_EXPERTS),
                      "mlp4": dict(r=4, lora_alpha=4, target_modules=["input_linear", "output_linear"])},
    "tiny-granite4-dense": {"all8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
                            "mlp4": dict(r=4, lora_alpha=4, target_modules=["output_linear", "v_proj"])},
    "tiny-granitemoeshared": {"all8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                             "input_linear", "output_linear"],
                                           target_parameters=GRANITE_EXPERTS),
                              "mlp4": dict(r=4, lora_alpha=4, target_modules=["input_linear"])}}


def _adapters(hf, root, name: str) -> dict:
    """ADAPTERS[name] on `hf`, saved under root (weights at 0.5's scale: Granite's residual_multiplier of 0.22 leaves
    0.15's deltas too small to change a token)."""
    return save_adapters(hf, root, ADAPTERS[name], scale=0.5)


@pytest.mark.parametrize("name", ADAPTERS)
def test_shared_mlp_adapters_mixed_with_the_base_equal_peft(tmp_path, name):
    """"all8" and "mlp4" and the base model in one batch and each alone: peft's tokens; each adapter holds the
    shared MLP's input_linear (gate|up rows) or output_linear of every layer."""
    from infer.lora.adapter import read_adapter
    base = ensure_builtin(name)
    hf = hf_float(base)
    paths = _adapters(hf, tmp_path, name)
    layers = hf.config.num_hidden_layers
    for adapter, projs in (("all8", ("input_linear", "output_linear")),
                           ("mlp4", [p for p in ("input_linear", "output_linear")
                                     if p in str(ADAPTERS[name]["mlp4"]["target_modules"])])):
        modules = read_adapter(adapter, paths[adapter]).modules
        assert {f"model.layers.{i}.shared_mlp.{p}" for i in range(layers) for p in projs} <= set(modules)
    prompts = random_prompts(512, (7, 12, 5), seed=2)
    check_mixed_adapters_equal_peft(base, hf, paths, prompts, ["all8", None, "mlp4"], n=5)
    with LLM(str(base), loras={"mlp4": str(paths["mlp4"])}, max_lora_rank=4, block_size=4) as llm:  # (it counts)
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        assert llm.generate(prompts[2:], params, lora="mlp4")[0].token_ids != \
            llm.generate(prompts[2:], params)[0].token_ids


@pytest.mark.parametrize("name", ADAPTERS)
def test_target_modules_of_the_shared_mlp_alone_are_the_plans_slots(name):
    """--lora-target-modules input_linear,output_linear: slots on each layer's shared MLP and nothing else,
    lora_slot_bytes' count byte for byte; every layer's slots (GraniteMoeShared's shared MLP among them, which the
    plan left out) are counted too."""
    from infer.memory.sizes import lora_slot_bytes
    for targets in (["input_linear", "output_linear"], ["output_linear"], None):
        with LLM(name, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4,
                 lora_target_modules=targets) as llm:
            manager = llm.engine.lora_manager
            config = llm.engine.runner.model.config
            names = sorted(n for m in manager.linears for n in m.names)
            if targets is not None:
                want = sorted(f"model.layers.{i}.shared_mlp.{p}" for i in range(config.num_hidden_layers)
                              for p in targets for _ in range(2 if p == "input_linear" else 1))
                assert names == want
            assert manager.device_bytes() == lora_slot_bytes(config, 2, 4, torch.float32, targets)


def test_granite4_without_experts_names_its_own_mlp():
    """Granite 4.0 without experts (granite-4.0-micro's shape): its MLP is the shared one. --lora-target-modules
    gate_up_proj (which it does not have: it used to give no slots at all) is refused listing input_linear and
    output_linear; an adapter of gate_proj, up_proj and down_proj is refused as modules the base does not have."""
    from infer.errors import ConfigError
    from infer.lora.adapter import expected_shapes
    from infer.models.loader import load_config
    with pytest.raises(ConfigError, match=r"--lora-target-modules gate_up_proj: no layer of this model "
                                          r"\(granitemoehybrid has adapter slots for q_proj, k_proj, v_proj, "
                                          r"qkv_proj, o_proj, input_linear, output_linear\)"):
        LLM("tiny-granite4-dense", enable_lora=True, lora_target_modules=["gate_up_proj"])
    config = load_config(ensure_builtin("tiny-granite4-dense"))
    assert {"input_linear": (64, 128), "output_linear": (64, 64)}.items() <= expected_shapes(config).items()
    assert not {"gate_proj", "up_proj", "down_proj"} & set(expected_shapes(config))


def test_an_adapter_of_llamas_mlp_names_on_granite4_dense_is_refused(tmp_path):
    """target_modules gate_proj/up_proj/down_proj on Granite 4.0 without experts (peft finds no such module): an
    adapter that has them (made elsewhere) is refused naming them and the base's layers."""
    import json

    from infer.errors import LoRAError
    paths = save_adapters(hf_float(ensure_builtin("tiny-granite4-dense")), tmp_path,
                          {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj"])})
    config = json.loads((paths["a"] / "adapter_config.json").read_text())
    (paths["a"] / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj",
                                                                                           "gate_proj"]}))
    with pytest.raises(LoRAError, match=r"targets \['gate_proj'\], which the base model does not have \(its "
                                        r"granitemoehybrid layers have q_proj, k_proj, v_proj, o_proj, input_linear, "
                                        r"output_linear\)"):
        LLM("tiny-granite4-dense", loras={"a": str(paths["a"])}, max_lora_rank=8)


def test_a_shared_mlp_adapter_outside_the_target_modules_is_refused(tmp_path):
    """An adapter with weights on the shared MLP, served with --lora-target-modules of the attention alone: refused
    naming input_linear and output_linear (served without them, it would compute other tokens than peft)."""
    from infer.errors import LoRAError
    paths = save_adapters(hf_float(ensure_builtin("tiny-granite4-dense")), tmp_path,
                          {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "input_linear", "output_linear"])})
    with pytest.raises(LoRAError, match=r"has weights on input_linear, output_linear \(4 module\(s\), e\.g\. "
                                        r"model\.layers\.0\.shared_mlp\.input_linear\), which --lora-target-modules "
                                        r"qkv_proj leaves without adapter slots.*add input_linear, output_linear"):
        LLM("tiny-granite4-dense", loras={"a": str(paths["a"])}, max_lora_rank=8, lora_target_modules=["qkv_proj"])



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_mlps_adapter_temporaries_are_within_the_plans(tmp_path, dtype):
    """Granite 4.0's shared MLP of 64 (its experts 32 wide) through its adapter's torch path (the CPU's) on 64
    tokens, --lora-target-modules input_linear,output_linear: the tensors it keeps alive at once, with its input,
    are within memory.sizes.lora_cpu_token_bytes a token and a step's few bytes (it counted nothing for these names,
    and the experts' width where the shared MLP is wider), and not over twice them."""
    import types

    from infer.lora.targets import check_target_modules
    from infer.memory.sizes import lora_cpu_token_bytes
    from test_probes_session63_gaps import _LiveBytes
    targets, tokens = ["input_linear", "output_linear"], 64
    paths = save_adapters(hf_float(ensure_builtin("tiny-granite4")), tmp_path,
                          {"a": dict(r=8, lora_alpha=16, target_modules=targets)})
    with LLM("tiny-granite4", loras={"a": str(paths["a"])}, max_lora_rank=8, lora_target_modules=targets,
             dtype=str(dtype).removeprefix("torch.")) as llm:
        manager = llm.engine.lora_manager
        batch = manager.make_batch(torch.full((tokens,), manager.acquire("a")))
        config = llm.engine.runner.model.config
        mlp = llm.engine.runner.model.layers[0].shared_mlp
        x = torch.randn(tokens, config.hidden_size).to(dtype)
        with _LiveBytes() as meter:
            mlp(x, types.SimpleNamespace(lora=batch))
    held = meter.peak + x.nbytes
    formula = tokens * lora_cpu_token_bytes(config, dtype, 8, check_target_modules(targets, config))
    assert config.shared_intermediate_size > config.intermediate_size
    assert held <= formula + 256 and formula <= 2 * held, (held, formula)  # (+256: a step's few bytes, not a token's)
