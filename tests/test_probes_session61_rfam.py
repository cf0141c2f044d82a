"""Session 61 (rfam): review of the families whose MLP has no gate (Arcee, Nemotron, Apertus, and StarCoder2 after
its GeluMLP became UngatedMLP): what the family tests (test_probes_session61_fam.py) left out."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM, SamplingParams

from helpers import check_stray_sliding_window, family_builder, greedy_tokens, random_prompts
from lora_helpers import family_base_and_adapters
from test_probes_session61_fam import FAMILIES, SMALL

UNGATED = {**FAMILIES, "starcoder2": ("starcoder2", "Starcoder2ForCausalLM", dict())}
build = family_builder(SMALL, UNGATED)
MLP_NAMES = {"starcoder2": ["c_fc", "c_proj"]}  # (the others: up_proj, down_proj)


def _config(model_type: str):
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **SMALL)


@pytest.mark.parametrize("family", UNGATED)
def test_lora_target_modules_fuse_q_k_v_on_an_mlp_without_gate(family):
    """An MLP without gate has no gate_up_proj, but its q, k and v are still one fused layer (qkv_proj): naming
    qkv_proj selects q_proj, k_proj and v_proj, naming q_proj, k_proj and v_proj selects qkv_proj (whose slots the
    memory plan counts as a Llama's of the same attention), and q_proj alone is refused as on Llama (it was taken,
    StarCoder2's too since the refactor, and qkv_proj gave the attention no slots)."""
    from infer.errors import ConfigError
    from infer.lora.targets import check_target_modules, target_name
    from infer.memory.sizes import lora_slot_bytes
    cfg = _config(UNGATED[family][0])
    assert {"q_proj", "k_proj", "v_proj"} <= check_target_modules(["qkv_proj"], cfg)
    assert "qkv_proj" in check_target_modules(["q_proj", "k_proj", "v_proj"], cfg)
    with pytest.raises(ConfigError, match="names q_proj but not k_proj, v_proj"):
        check_target_modules(["q_proj"], cfg)
    llama = lora_slot_bytes(_config("llama"), 1, 8, torch.float32, ["qkv_proj"])
    assert llama > 0
    for names in (["qkv_proj"], ["q_proj", "k_proj", "v_proj"]):
        assert lora_slot_bytes(cfg, 1, 8, torch.float32, names) == llama, names
    assert target_name("q_proj", True) == "qkv_proj"
    mlp = MLP_NAMES.get(family, ["up_proj", "down_proj"])
    assert check_target_modules(mlp[:1], cfg) == {mlp[0]}  # (the MLP's first layer alone: a layer of its own)


@pytest.fixture(scope="module", params=list(UNGATED))
def ungated_lora(request, tmp_path_factory):
    return family_base_and_adapters(tmp_path_factory, build, request.param, attention_bias=True)


def test_qkv_proj_target_serves_an_adapter_of_q_k_v(ungated_lora):
    """--lora-target-modules qkv_proj,o_proj and the MLP's two layers serves an adapter of every projection with the
    tokens it has without the flag (every layer given slots: peft's, test_probes_session61_fam), other than the
    base's; before, the adapter was refused ("has weights on q_proj ... leaves without adapter slots")."""
    family, base, _, paths = ungated_lora
    prompts = random_prompts(512, (5, 20), seed=9)
    with LLM(str(base), loras={"a": str(paths["all8"])}, max_lora_rank=8, block_size=4) as llm:
        want = greedy_tokens(llm, prompts, 6, lora=["a", "a"])
        assert greedy_tokens(llm, prompts, 6) != want
    targets = ["qkv_proj", "o_proj", *MLP_NAMES.get(family, ["up_proj", "down_proj"])]
    with LLM(str(base), loras={"a": str(paths["all8"])}, max_lora_rank=8, block_size=4,
             lora_target_modules=targets) as llm:
        assert greedy_tokens(llm, prompts, 6, lora=["a", "a"]) == want


@pytest.mark.parametrize("name", ["tiny-arcee", "tiny-nemotron", "tiny-apertus", "tiny-starcoder2"])
def test_benchmarks_random_adapters_fit_an_mlp_without_gate(tmp_path, name):
    """The benchmarks' random adapters (bench.e2e_models.write_random_adapters, step_overhead --adapters) of a model
    whose MLP has no gate adapt its own MLP modules (up_proj/down_proj, StarCoder2's c_fc/c_proj: no gate_proj the
    model lacks, which the engine refused) and change the logprobs."""
    from transformers import AutoConfig

    from infer.bench.e2e_models import write_random_adapters
    from infer.models.tiny import ensure_builtin
    path = str(ensure_builtin(name))
    cfg = AutoConfig.from_pretrained(path)
    paths = write_random_adapters(cfg, tmp_path, 1, 4)
    written = json.loads((tmp_path / "lora0" / "adapter_config.json").read_text())["target_modules"]
    mlp = MLP_NAMES.get(cfg.model_type, ["up_proj", "down_proj"])
    assert written == ["q_proj", "k_proj", "v_proj", "o_proj", *mlp]
    prompts = random_prompts(cfg.vocab_size, (6, 11), seed=2)
    params = SamplingParams(max_new_tokens=1, logprobs=1)
    with LLM(path, loras=paths, max_lora_rank=4, block_size=4) as llm:
        base, adapted = (llm.generate(prompts, params, **kw) for kw in ({}, {"lora": ["lora0", "lora0"]}))
    assert all(b.logprobs[0]["logprob"] != a.logprobs[0]["logprob"] for b, a in zip(base, adapted))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stray_sliding_window_caps_the_context_and_slides_no_layer(tmp_path, family):
    """transformers' Arcee, Nemotron and Apertus attention never slides (their modeling code reads no
    sliding_window), while generate()'s cache keeps only the last sliding_window keys of a config that has the key:
    as a Llama's, the context is capped at the window and every layer attends fully (infer slid every layer over it,
    Nemotron's as StarCoder2's, which neither of transformers' ways computes: other tokens past the window)."""
    check_stray_sliding_window(tmp_path, build(tmp_path, family, sliding_window=16, num_hidden_layers=3), family)
