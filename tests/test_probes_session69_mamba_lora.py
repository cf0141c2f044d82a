"""Adapters of Granite 4.0's Mamba-2 mixers (in_proj, out_proj: models.granite4.Mamba2Mixer, which Bamba's adapters
already reached) and of Nemotron-H's in_proj (peft refuses its out_proj, as Falcon-H1's), refused before: mixed in one
batch with the attention's and the base model, equal to peft; --lora-target-modules of the mixers gives slots on them
alone, which the memory plan counts; Nemotron-H's out_proj refused naming it."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

# (Granite 4.0 hybrid with experts; Nemotron-H: Mamba-2, MLP and attention blocks; Nemotron 3: experts too): the
# mixers' module and the projections adapters may adapt
NAMES = {"tiny-granite4": ("mamba", ["in_proj", "out_proj"]), "tiny-nemotron-h": ("mixer", ["in_proj"]),
         "tiny-nemotron-h-moe": ("mixer", ["in_proj"])}


@pytest.mark.parametrize("name", NAMES)
def test_mixer_adapters_mixed_with_the_attentions_equal_peft(tmp_path, name):
    """"all" (q, k, v, o and the mixers' projections, rank 8) and "mamba" (the mixers' alone, rank 4) and the base
    model in one batch and each alone: peft's tokens."""
    from lora_helpers import check_mixed_adapters_equal_peft, hf_float, save_adapters
    base = ensure_builtin(name)
    hf = hf_float(base)
    parent, projs = NAMES[name]
    paths = save_adapters(hf, tmp_path, {
        "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", *projs]),
        "mamba": dict(r=4, lora_alpha=4, target_modules=rf".*\.{parent}\.({'|'.join(projs)})")}, scale=0.5)
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 12, 5), seed=2), ["all", None, "mamba"],
                                    n=5)


@pytest.mark.parametrize("name", ["tiny-granite4", "tiny-nemotron-h"])
def test_target_modules_of_the_mixers_alone_are_the_plans_slots(name):
    """--lora-target-modules of the mixers' projections (Granite 4.0: in_proj,out_proj; Nemotron-H: in_proj): slots
    on each Mamba-2 mixer's and nothing else, lora_slot_bytes' count byte for byte."""
    from infer.memory.sizes import lora_slot_bytes
    projs = NAMES[name][1]
    with LLM(name, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, lora_target_modules=projs) as llm:
        manager = llm.engine.lora_manager
        model = llm.engine.runner.model
        names = sorted(n for m in manager.linears for n in m.names)
        assert len(names) == len(projs) * len(model.linear_layers())
        assert all(n.endswith(tuple(f".{p}" for p in projs)) for n in names)
        assert manager.device_bytes() == lora_slot_bytes(model.config, 2, 4, torch.float32, projs)


def test_nemotron_h_out_proj_is_refused_naming_it(tmp_path):
    """An adapter whose target_modules name Nemotron-H's out_proj (peft refuses it; one made elsewhere may have it):
    refused at registration naming it and what infer adapts; --lora-target-modules out_proj too."""
    import json

    from lora_helpers import hf_float, save_adapters

    from infer.errors import ConfigError, LoRAError
    paths = save_adapters(hf_float(ensure_builtin("tiny-nemotron-h")), tmp_path,
                          {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj"])})
    config = json.loads((paths["a"] / "adapter_config.json").read_text())
    (paths["a"] / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "out_proj"]}))
    with pytest.raises(LoRAError, match=r"targets \['out_proj'\]: infer's adapters of nemotron_h \(Nemotron-H\) adapt "
                                        r"the attention's, the MLP's and the Mamba-2 mixers' in_proj, not the mixers' "
                                        r"out_proj or conv1d"):
        LLM("tiny-nemotron-h", loras={"a": str(paths["a"])}, max_lora_rank=8)
    with pytest.raises(ConfigError, match=r"--lora-target-modules out_proj: Mamba-2 mixer projections"):
        LLM("tiny-nemotron-h", enable_lora=True, lora_target_modules=["out_proj"])
