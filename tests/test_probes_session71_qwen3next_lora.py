"""Session 71: adapters on Qwen3-Next (Qwen3NextForCausalLM: Qwen3-Next-80B-A3B), refused before ("not supported
yet"). peft on transformers 5 reads a Qwen3-Next as Qwen2-MoE: target_modules gate_proj, up_proj and down_proj become
the stacked experts' parameters (gate_up_proj at twice the rank), as on Qwen3-MoE and GLM-4.5, and (peft >= 0.22)
keeps them on the shared expert's Linear layers; target_parameters name the experts directly. infer now serves its
attention's adapters (the gated q_proj, twice the query's width), the shared expert's and the experts' mixed with
the base in one batch, equal to peft (each adapter loaded alone in peft, which holds several target_parameters
adapters only where they target the same parameters), on the CPU and the GPU code path (interpreted); adapters of
the router (shared_expert_gate) or of the linear-attention layers are refused naming them."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM
from infer.errors import LoRAError

from helpers import random_prompts

NAME = "tiny-qwen3-next"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# "all8": the attention, the shared expert and the experts through transformers 4's names (peft converts them for the
# experts); "qv4": q and v and the experts through target_parameters
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=[*ATTENTION, "gate_proj", "up_proj", "down_proj"]),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS)}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of ADAPTERS (peft's) on tiny-qwen3-next."""
    from lora_helpers import builtin_and_adapters
    return builtin_and_adapters(tmp_path_factory.mktemp("qwen3next_lora"), NAME, ADAPTERS)


def test_attention_and_expert_adapters_equal_peft_alone_and_mixed(qwen3_next):
    """"all8", the base and "qv4" in one batch and each alone: peft's greedy tokens; each adapter changes its
    request's tokens; "all8" holds every layer's experts (converted from gate_proj/up_proj/down_proj) and shared
    expert."""
    from infer.lora.adapter import read_adapter
    from lora_helpers import check_expert_adapters_equal_peft
    base, hf, paths = qwen3_next
    modules = read_adapter("all8", paths["all8"]).modules
    assert {f"model.layers.{i}.mlp.{p}" for i in range(hf.config.num_hidden_layers) for p in (
        "experts.gate_up_proj", "shared_expert.gate_proj", "shared_expert.down_proj")} <= set(modules)
    check_expert_adapters_equal_peft(base, hf, paths, ["all8", None, "qv4"], random_prompts(512, (7, 5, 11), seed=3))


def test_gpu_code_path_interpreted_equals_the_cpu_path(qwen3_next, tmp_path, monkeypatch):
    """Every op through its Triton kernel (interpreted), the fused MoE given the experts' adapters, decodes through
    emulated CUDA graphs: the CPU path's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from lora_helpers import save_adapters
    from test_probes_session57_moelora import _cpu_and_gpu_path
    base, hf, paths = qwen3_next
    # (all8's experts at rank 4: peft's conversion doubles gate_up's rank, within the path's --max-lora-rank 8)
    all4 = save_adapters(hf, tmp_path, {"all4": {**ADAPTERS["all8"], "r": 4, "lora_alpha": 8}})["all4"]
    cpu, gpu = _cpu_and_gpu_path(base, {"all4": all4, "qv4": paths["qv4"]}, random_prompts(512, (6, 3, 5), seed=7),
                                 ["all4", None, "qv4"], monkeypatch, n=4)
    assert gpu == cpu


@pytest.mark.parametrize("module, rows, cols, match", [
    ("layers.3.mlp.shared_expert_gate", 1, 64, r"infer adapts a mixture of experts' attention, dense layers' MLPs, "
                                               r"shared expert and stacked experts, not its router"),
    ("layers.0.linear_attn.in_proj_qkvz", 192, 64, r"targets \['in_proj_qkvz'\], the projections of qwen3_next's "
                                                    r"linear-attention \(Gated DeltaNet\) layers")])
def test_adapters_of_the_router_or_linear_attention_are_refused(qwen3_next, tmp_path, module, rows, cols, match):
    """An adapter (made elsewhere: peft makes none of these on transformers 5) with weights on the shared expert's
    1-output gate or a linear-attention projection: refused at registration, naming it."""
    from lora_helpers import adapter_with_module
    _, _, paths = qwen3_next
    folder = adapter_with_module(paths["all8"], tmp_path / "a", module, 8, cols, rows)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert module.rpartition(".")[2] in config["target_modules"]
    with pytest.raises(LoRAError, match=match):
        LLM(NAME, loras={"a": str(folder)}, max_lora_rank=8)
