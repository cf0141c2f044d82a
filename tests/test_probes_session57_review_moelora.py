"""Session 57, review of the adapters on mixtures of experts: the experts' adapter slots are freed by sleep (and
copied back on waking) as the other adapter slots are."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams

from helpers import random_prompts
from lora_helpers import hf_float, save_adapter
from test_probes_session55_moe import build
from test_probes_session57_moelora import EXPERTS

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3-MoE, its model in transformers, and its folder."""
    root = tmp_path_factory.mktemp("review-moelora")
    build(root / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=2)
    return root, hf_float(root / "base")


def _tokens(llm, prompts, names):
    return [o.token_ids for o in llm.generate(prompts, PARAMS, lora=names)]


def test_sleep_frees_the_experts_adapter_slots_and_wakes_them_with_their_weights(qwen3):
    """Level 1: every sparse layer's expert adapter slots (ExpertLoRA's a13, b13, a2, b2) hold no device memory while
    asleep (they stayed allocated), and after wake_up the adapter's tokens are those before."""
    root, hf = qwen3
    adapter = save_adapter(hf, root / "ex", seed=1, lora_dropout=0.0, r=4, lora_alpha=8, target_parameters=EXPERTS)
    prompts, names = random_prompts(512, (7, 5), seed=3), ["ex", None]
    with LLM(str(root / "base"), loras={"ex": str(adapter)}, max_lora_rank=8, block_size=4,
             enable_sleep_mode=True) as llm:
        want = _tokens(llm, prompts, names)
        experts = llm.engine.lora_manager.expert_layers
        assert len(experts) == 2
        llm.sleep(1)
        assert all(t.untyped_storage().nbytes() == 0 for layer in experts for t in layer.tensors())
        llm.wake_up()
        assert all(t.untyped_storage().nbytes() > 0 for layer in experts for t in layer.tensors())
        assert _tokens(llm, prompts, names) == want
        assert want[0] != _tokens(llm, prompts[:1], [None])[0]  # the adapter changes its tokens
