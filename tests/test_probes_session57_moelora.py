"""Session 57: LoRA adapters on mixtures of experts' MLPs: a dense layer's MLP (mlp_only_layers /
decoder_sparse_step), Qwen2-MoE's shared expert, and the stacked experts (peft's target_parameters on transformers
5's mlp.experts.gate_up_proj / down_proj, its ParamWrapper: lora_A [E * r, in], lora_B [out, r * E], nested per
parameter), each request with its own adapter in one batch; greedy tokens equal peft's on the same weights, on the
CPU path and on the GPU code path under the Triton interpreter; what infer does not adapt (the router,
shared_expert_gate, per-expert modules) refused clearly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams

from helpers import greedy_each, random_prompts
from lora_helpers import PeftOracle, hf_float, save_adapter
from test_probes_session55_moe import build

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _adapters(root, hf, specs: dict) -> dict:
    """Each of `specs` (name -> LoraConfig arguments) saved under root / name, seeds 1, 2, ..."""
    return {n: save_adapter(hf, root / n, seed=i + 1, lora_dropout=0.0, **kw) for i, (n, kw) in
            enumerate(specs.items())}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3-MoE with a dense layer (mlp_only_layers [1] of 3) and three adapters: the experts (r 4), the
    experts named as transformers 4's modules, gate_proj, up_proj and down_proj, which peft turns into the stacked
    parameters (gate_up_proj at r 16, alpha 32: rank_pattern), with the attention (r 8), the experts' down_proj alone
    (rslora, r 6)."""
    root = tmp_path_factory.mktemp("moelora-qwen3")
    build(root / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])
    hf = hf_float(root / "base")
    paths = _adapters(root, hf, {
        "experts": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS),
        "mixed": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                      target_parameters=["mlp.experts.gate_up_proj"]),
        "down": dict(r=6, lora_alpha=12, use_rslora=True, target_modules=["o_proj"],
                     target_parameters=["mlp.experts.down_proj"]),
    })
    return root / "base", hf, paths


def peft_tokens(hf, paths: dict, prompts, names, n: int = 6) -> list[list[int]]:
    """peft's greedy tokens of each prompt with its adapter (None: the base), each adapter loaded alone (peft holds
    several adapters with target_parameters only where they target the same parameters)."""
    want = {i: greedy_each(hf, [p], n)[0] for i, (p, a) in enumerate(zip(prompts, names)) if a is None}
    for name in dict.fromkeys(a for a in names if a is not None):
        oracle = PeftOracle(hf, {name: paths[name]})
        try:
            want.update({i: oracle.greedy(name, p, n) for i, (p, a) in enumerate(zip(prompts, names)) if a == name})
        finally:
            oracle.close()
    return [want[i] for i in range(len(prompts))]


def _engine_tokens(base, paths, prompts, names, n=6, **kw):
    with LLM(str(base), loras={k: str(p) for k, p in paths.items()}, max_loras=3, max_lora_rank=16, block_size=4,
             **kw) as llm:
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        mixed = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
        alone = [llm.generate([p], params, lora=a)[0].token_ids for p, a in zip(prompts, names)]
    return mixed, alone


def test_qwen3_moe_expert_adapters_equal_peft_alone_and_mixed(qwen3):
    """Three adapters on the experts (both projections, gate_up only, down only) beside the attention and a dense
    layer's MLP, and a request with none, in one batch and each alone: peft's greedy tokens."""
    base, hf, paths = qwen3
    prompts = random_prompts(512, (7, 5, 11, 6), seed=3)
    names = ["experts", "mixed", None, "down"]
    mixed, alone = _engine_tokens(base, paths, prompts, names)
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want
    base_tokens = greedy_each(hf, prompts, 6)
    for i in (0, 1, 3):  # each adapter changes its tokens
        assert want[i] != base_tokens[i], names[i]
