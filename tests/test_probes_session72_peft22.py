"""Session 72: peft 0.22 keeps target_modules gate_proj, up_proj and down_proj on the Linear layers they reach (a dense
layer's MLP, the shared experts) beside turning them into the stacked experts' parameters; infer, which refused those
weights as peft 0.21 dropped them, now serves them (each family's own test file checks them against peft on the CPU).
Until now no adapter of GLM-4.5's, DeepSeek's, ERNIE 4.5 MoE's or dots.llm1's dense layers' MLP was served: on the
GPU code path their deltas go to the next layer's norm (lora_consumer), which a family's own decoder layer must pass
on (Nemotron-H's did not: the seventy-first session's GPU-only bug). Each here, interpreted, equals the CPU path; and
(seventy-third session) `infer convert --merge-lora` of such an adapter gives the tokens serving it gives."""

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


@pytest.mark.parametrize("name", ["tiny-glm4-moe", "tiny-deepseek-v3"])
def test_merging_a_dense_mlp_shared_and_routed_experts_adapter_gives_what_serving_it_gives(name, tmp_path):
    """`infer convert --merge-lora` of peft 0.22's adapter of gate_proj, up_proj and down_proj (the dense layer's MLP,
    the shared experts, the routed experts' stacked parameters) and the attention's query: the merged model's greedy
    tokens are the adapter's served on the base (both differ from the base's)."""
    from typer.testing import CliRunner

    from infer import LLM, SamplingParams
    from infer.cli.main import app
    from lora_helpers import builtin_and_adapters
    query = "q_b_proj" if name == "tiny-deepseek-v3" else "q_proj"
    base, _, paths = builtin_and_adapters(tmp_path, name, {"mlp4": dict(r=4, lora_alpha=8, target_modules=[
        query, "gate_proj", "up_proj", "down_proj"])}, scale=0.3)
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "merged"), "--merge-lora",
                                   str(paths["mlp4"])])
    assert res.exit_code == 0, res.output
    prompts, params = random_prompts(512, (6, 9), seed=1), SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(str(tmp_path / "merged"), block_size=4) as llm:
        merged = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(base), loras={"x": str(paths["mlp4"])}, max_lora_rank=8, block_size=4) as llm:
        served = [o.token_ids for o in llm.generate(prompts, params, lora=["x", "x"])]
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert merged == served and merged[0] != plain[0] and merged[1] != plain[1]
