"""Session 72: peft 0.22 keeps target_modules gate_proj, up_proj and down_proj on the Linear layers they reach (a dense
layer's MLP, the shared experts) beside turning them into the stacked experts' parameters; infer, which refused those
weights as peft 0.21 dropped them, now serves them (each family's own test file checks them against peft on the CPU).
Until now no adapter of GLM-4.5's, DeepSeek's, ERNIE 4.5 MoE's or dots.llm1's dense layers' MLP was served: on the
GPU code path their deltas go to the next layer's norm (lora_consumer), which a family's own decoder layer must pass
on (Nemotron-H's did not: the seventy-first session's GPU-only bug). Each here, interpreted, equals the CPU path."""

from __future__ import annotations

import pytest
import torch

from helpers import greedy_each, random_prompts

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


@pytest.mark.parametrize("name", ["tiny-glm4-moe", "tiny-deepseek-v3", "tiny-ernie4_5-moe", "tiny-dots1"])
def test_dense_mlp_shared_and_routed_experts_adapters_on_the_gpu_path_equal_the_cpu_path(name, tmp_path,
                                                                                         monkeypatch):
    """An adapter of the attention's query, gate_proj, up_proj and down_proj (the dense layer's MLP, the shared
    experts and, converted, the routed experts), the base between two of its requests in one batch: every op through
    its Triton kernel (interpreted), the fused MoE given the experts' adapters, decodes through emulated CUDA graphs,
    gives the CPU path's tokens, which the adapter changes."""
    from infer.lora.adapter import read_adapter
    from lora_helpers import builtin_and_adapters
    from test_probes_session57_moelora import _cpu_and_gpu_path
    query = "q_b_proj" if name == "tiny-deepseek-v3" else "q_proj"
    base, hf, paths = builtin_and_adapters(tmp_path, name, {"mlp4": dict(r=4, lora_alpha=8, target_modules=[
        query, "gate_proj", "up_proj", "down_proj"])}, scale=0.3)
    modules = set(read_adapter("mlp4", paths["mlp4"]).modules)
    assert "model.layers.0.mlp.down_proj" in modules and "model.layers.1.mlp.experts.down_proj" in modules, modules
    prompts = random_prompts(512, (6, 3, 5), seed=7)
    cpu, gpu = _cpu_and_gpu_path(base, paths, prompts, ["mlp4", None, "mlp4"], monkeypatch, n=4)
    assert gpu == cpu
    assert cpu[0] != greedy_each(hf, prompts[:1], 4)[0] and cpu[2] != greedy_each(hf, prompts[2:], 4)[0]
