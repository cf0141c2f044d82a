"""Session 54, third review of the Gemma family: config variants real checkpoints and transformers allow, each
against transformers on tiny random models (tests/test_probes_session54_gemma.py builds them)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams

from helpers import random_prompts
from test_probes_session54_gemma import GEMMA2, build, hf_greedy


@pytest.mark.parametrize("model_type", ["gemma", "gemma2"])
def test_gemma_attention_bias_loads_its_biases_as_transformers(tmp_path, model_type):
    """transformers' Gemma and Gemma 2 give q, k, v and o biases where config.json says attention_bias: true, as
    Llama's do; infer refused the checkpoint ('unexpected bias ... config.json says this layer has no bias')."""
    hf = build(tmp_path, model_type, attention_bias=True, **(GEMMA2 if model_type == "gemma2" else dict(head_dim=16)))
    assert any(n.endswith("o_proj.bias") for n, _ in hf.named_parameters())
    prompts = random_prompts(512, (5, 13), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 6)
    with torch.no_grad():
        logp = hf(torch.tensor([prompts[0] + outs[0].token_ids])).logits[0, len(prompts[0]) - 1:-1].log_softmax(-1)
    for i, rec in enumerate(outs[0].logprobs):
        assert abs(rec["logprob"] - float(logp[i, rec["token_id"]])) < 1e-4
