"""Session 56 review of the KV layer groups (engine.hybrid_blocks): what the first probes did not cover."""

from __future__ import annotations

import pytest

from infer.errors import ConfigError

from test_probes_session55_swblocks import CHUNK
from test_probes_session56_hybrid2 import build


def test_num_kv_blocks_too_few_names_a_max_model_len_that_fits(tmp_path):
    """Gemma 2-shaped (a full group and a sliding one of 2 layers each), blocks of 4, 64 tokens: a sequence holds 16
    blocks of the full group and 7 of the sliding one (23). 20 blocks (19 usable) are refused; the hint's
    --max-model-len was 76 (19 blocks x 4 tokens, as if one block held every layer), longer than the 64 refused:
    it is the longest the 19 blocks hold by the groups' count (48: 12 + 7), and the engine starts with it."""
    from infer import LLM
    build(tmp_path, "gemma2", seed=2)
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=2, num_kv_blocks=20)
    for blocks, longest in ((20, 48), (12, 20)):
        kw["num_kv_blocks"] = blocks
        with pytest.raises(ConfigError) as err:
            LLM(str(tmp_path), max_model_len=64, **kw)
        assert f"lower --max-model-len to {longest} or less" in str(err.value)
        assert "full layer groups" in str(err.value)
        with LLM(str(tmp_path), max_model_len=longest, **kw) as llm:
            assert llm.engine.block_manager.num_blocks == blocks - 1
        with pytest.raises(ConfigError):
            LLM(str(tmp_path), max_model_len=longest + 1, **kw)


def test_a_budget_too_small_for_a_sequence_counts_blocks_of_the_groups(tmp_path):
    """Gemma 3-shaped (6 groups of one layer), a budget that leaves 97 blocks: a sequence of 206 tokens holds 52 + 5
    x 9 = 97 of them, one more than the 96 usable (one is the placeholder). The refusal said "97 blocks (388 tokens)",
    as if a block held every layer (388 tokens > 206 read as room): it says the blocks are of one layer group each
    and how many the sequence holds; the estimated length (205) starts."""
    from infer import LLM
    from infer.errors import OutOfMemoryError
    build(tmp_path, "gemma3", seed=2)
    kw = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=2, memory_limit="7.1MB")
    with pytest.raises(OutOfMemoryError) as err:
        LLM(str(tmp_path), max_model_len=206, **kw)
    msg = str(err.value)
    assert "tokens) after weights" not in msg, msg
    assert "gets 97 blocks (each of one of 6 KV layer groups, 97 of them a sequence's)" in msg, msg
    assert "estimated maximum model length is 205" in msg
    with LLM(str(tmp_path), max_model_len=205, **kw) as llm:
        assert llm.engine.block_manager.num_blocks == 97  # (its activations less: a block more)
