"""Session 55 review of partial rotary (Phi-4-mini) and Gemma 3's text model as merged: what the probes found wrong,
each against transformers on tiny random configs (float32)."""

from __future__ import annotations

from infer import LLM

from helpers import random_prompts
from test_probes_session55_gemma3 import FULL, SL, build, generate, hf_greedy


def test_gemma3_ignores_attn_logit_softcapping_as_transformers_does(tmp_path):
    """transformers' Gemma3Attention keeps config.attn_logit_softcapping but never passes it to the attention (Gemma
    2's does): a Gemma 3 config with the field set runs its scores uncapped there, and so must infer (it capped
    them as Gemma 2's, other tokens)."""
    hf = build(tmp_path, num_hidden_layers=2, layer_types=[SL, FULL], attn_logit_softcapping=0.5)
    prompts = random_prompts(512, (5, 20), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert [layer.self_attn.softcap for layer in llm.engine.runner.model.layers] == [0.0, 0.0]
        assert generate(llm, prompts, 8) == hf_greedy(hf, prompts, 8)
