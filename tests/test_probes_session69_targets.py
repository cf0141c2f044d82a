"""--lora-target-modules in_proj on Falcon-H1 (its Mamba-2 mixers' in_proj, which adapters may adapt: lora.targets):
slots on those layers alone, counted by the memory plan, and an adapter of in_proj served through them equal to
peft's; a name the model has no layer of still refused."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

NAME = "tiny-falcon-h1"


def test_in_proj_slots_alone_are_the_plans_and_serve_peft_tokens(tmp_path):
    """in_proj alone: a slot on each layer's mixer in_proj and on nothing else, lora_slot_bytes' count byte for byte
    (and below every layer's); adapters of in_proj alone and of q_proj with in_proj (served with both named) give
    peft's tokens mixed in one batch."""
    from lora_helpers import check_mixed_adapters_equal_peft, hf_float, save_adapters

    from infer.memory.sizes import lora_slot_bytes
    with LLM(NAME, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4,
             lora_target_modules=["in_proj"]) as llm:
        manager = llm.engine.lora_manager
        config = llm.engine.runner.model.config
        names = [n for m in manager.linears for n in m.names]
        assert names and all(n.endswith(".mamba.in_proj") for n in names)
        assert len(names) == config.num_hidden_layers
        got = manager.device_bytes()
        assert got == lora_slot_bytes(config, 2, 4, torch.float32, ["in_proj"])
        assert 0 < got < lora_slot_bytes(config, 2, 4, torch.float32)
    base = ensure_builtin(NAME)
    hf = hf_float(base)
    paths = save_adapters(hf, tmp_path, {"mamba": dict(r=4, lora_alpha=4, target_modules=["in_proj"]),
                                         "q": dict(r=4, lora_alpha=8, target_modules=["q_proj", "in_proj"])},
                          scale=0.5)
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 12, 5), seed=2), ["mamba", None, "q"],
                                    n=5, lora_target_modules=["q_proj", "k_proj", "v_proj", "in_proj"])


def test_out_proj_is_refused_as_a_mamba_projection():
    """out_proj (whose adapters infer refuses on Falcon-H1) is no name --lora-target-modules takes: refused as the
    mixers' projection it is (it was called a Gated DeltaNet's), naming the ones it takes."""
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--lora-target-modules out_proj: Mamba-2 mixer projections, which infer's "
                                          r"adapters of this model do not adapt \(falcon_h1 has adapter slots for "
                                          r"q_proj, k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, "
                                          r"gate_up_proj, down_proj, in_proj\)"):
        LLM(NAME, enable_lora=True, lora_target_modules=["out_proj"])
