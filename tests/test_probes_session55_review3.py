"""Session 55, review 3 of the mixtures of experts (models.moe, kernels.moe): probes against transformers' Qwen3-MoE,
Mixtral and Qwen2-MoE on tiny random float32 models."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from infer import LLM, SamplingParams

from helpers import random_prompts
from test_probes_session55_moe import build, check_equal, hf_greedy


def test_qwen2_moe_without_a_shared_expert_equals_transformers(tmp_path):
    """shared_expert_intermediate_size 0 (a Qwen2-MoE whose shared expert is empty: transformers builds it 0 wide,
    its output 0): the shared MLP is 0 wide too, not read as intermediate_size (a shape error at load)."""
    hf = build(tmp_path, "qwen2_moe", num_hidden_layers=1, shared_expert_intermediate_size=0)
    with LLM(str(tmp_path), block_size=4, max_model_len=64) as llm:
        check_equal(hf, llm, random_prompts(512, (5, 12), seed=5)[:2], "qwen2_moe without a shared expert", n=6)


def test_qwen2_moe_without_a_shared_expert_on_the_gpu_code_path(tmp_path, monkeypatch):
    """The same on the GPU code path (Triton kernels interpreted, emulated graphs): the 0-wide shared expert is not
    run (silu_and_mul and the GEMMs take no 0-wide rows), its output being 0."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from quant_helpers import int4_kernel_path
    hf = build(tmp_path, "qwen2_moe", num_hidden_layers=1, shared_expert_intermediate_size=0)
    prompts = random_prompts(512, (5, 12), seed=4)[:2]
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path), block_size=4, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8,
             cuda_graph_max_tokens=4) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 5)


def test_mixtral_checkpoint_of_transformers_parameter_names_loads(tmp_path):
    """A Mixtral state_dict saved as transformers 5 names it (model.layers.N.mlp.gate.weight,
    mlp.experts.gate_up_proj / down_proj: its module is mlp, block_sparse_moe only in save_pretrained's files),
    which transformers reads, loads (and passes the estimate's loader checks), not 'the checkpoint has no tensor
    ...block_sparse_moe.experts.0.w1.weight'."""
    from typer.testing import CliRunner
    from infer.cli.main import app
    hf = build(tmp_path / "a", "mixtral", num_hidden_layers=1)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.gate.weight" in state
    save_file(state, str(tmp_path / "a" / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(512, (7, 12), seed=8)
    with LLM(str(tmp_path / "a"), block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))]
    assert got == hf_greedy(hf, prompts, 5)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path / "a"), "--estimate", "--max-length", "64",
                                   "--concurrency", "2", "--device", "cpu"])
    assert res.exit_code == 0, res.output
