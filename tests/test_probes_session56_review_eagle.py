"""Review of EAGLE speculative decoding (session 56) against vLLM's llama_eagle3 / llama_eagle and the heads' on-disk
layouts: what a head's config.json says is read as vLLM reads it."""

from __future__ import annotations

import pytest

from infer import LLM

from helpers import random_prompts, save_random_model
from test_probes_session56_eagle import KW, LAYERS, TARGET, VOCAB, _record, greedy, reference_drafts, save_eagle3, spec


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("review_eagle_target")
    hf = save_random_model(folder, "llama", "LlamaForCausalLM", TARGET, seed=3)
    return folder, hf


def test_top_level_aux_layer_ids_are_read_as_vllm_reads_them(tmp_path, target, monkeypatch):
    """vLLM reads the head config's top-level eagle_aux_hidden_state_layer_ids (the speculators' heads store them
    there): the target's layers (5, 1, 6) feed the head, not the default (2, L // 2, L - 3)."""
    folder, hf = target
    t = save_eagle3(tmp_path / "h", seed=7, config={"eagle_aux_hidden_state_layer_ids": [5, 1, 6]})
    seen = _record(monkeypatch)
    llm = LLM(str(folder), speculative_config=spec(tmp_path / "h"), **KW)
    assert llm.engine.drafter.model.aux_layers == (5, 1, 6)
    llm.generate(random_prompts(VOCAB, (9, 12), seed=4), greedy(6))
    assert seen
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, t, tokens, len(drafts), (5, 1, 6))
    assert (5, 1, 6) != (2, LAYERS // 2, LAYERS - 3)
