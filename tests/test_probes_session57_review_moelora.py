"""Session 57, review of the adapters on mixtures of experts: the experts' adapter slots are freed by sleep (and
copied back on waking) as the other adapter slots are; `infer convert --merge-lora` merges an adapter of
transformers 4's per-expert modules (which peft converts on loading) instead of refusing it as unread."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app

from helpers import random_prompts
from lora_helpers import hf_float, save_adapter
from test_probes_session55_moe import build
from test_probes_session57_moelora import EXPERTS, _v4_adapter

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


def test_merging_a_transformers_4_per_expert_adapter_gives_what_serving_it_gives(qwen3, tmp_path):
    """An adapter of transformers 4's experts.N.gate_proj / up_proj / down_proj (peft converts them into the stacked
    parameters when it loads it) merges (it was refused: 'peft does not read ...experts.0.down_proj...'), and the
    merged model's greedy tokens are the adapter's served on the base."""
    root, hf = qwen3
    adapter = _v4_adapter(hf, tmp_path / "v4", ("gate_proj", "up_proj", "down_proj"), seed=3)
    res = CliRunner().invoke(app, ["convert", str(root / "base"), "-o", str(tmp_path / "merged"), "--merge-lora",
                                   str(adapter)])
    assert res.exit_code == 0, res.output
    prompts = random_prompts(512, (6, 9), seed=1)
    with LLM(str(tmp_path / "merged"), block_size=4) as llm:
        merged = _tokens(llm, prompts, None)
    with LLM(str(root / "base"), loras={"x": str(adapter)}, max_lora_rank=8, block_size=4) as llm:
        served = _tokens(llm, prompts, ["x", "x"])
        plain = _tokens(llm, prompts, None)
    assert merged == served != plain
