"""Session 55, fourth review of sliding-window block freeing: what the probes found."""

from __future__ import annotations

import pytest
import torch

from infer.engine.sampling_params import SamplingParams

from test_probes_session55_swblocks import CHUNK, build, random_prompts


def test_num_kv_blocks_refusal_under_a_window_names_a_count_that_starts(tmp_path):
    """num_kv_blocks one short under a window (one block is the placeholder): the refusal's hint names a count and a
    --max-model-len that start the engine (it named the count given, refused again)."""
    import re

    from infer import LLM
    from infer.errors import ConfigError
    build(tmp_path, "mistral", seed=4)
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4, max_model_len=120)
    with pytest.raises(ConfigError) as e:  # a sequence holds 7 blocks: 7 is one short with the placeholder
        LLM(str(tmp_path), num_kv_blocks=7, **kw)
    hint = str(e.value)
    blocks = int(re.search(r"use num_kv_blocks=(\d+)", hint).group(1))
    length = int(re.search(r"--max-model-len to (\d+)", hint).group(1))
    assert blocks != 7
    with LLM(str(tmp_path), num_kv_blocks=blocks, **kw) as llm:
        prompt = random_prompts((5,), seed=9)
        assert len(llm.generate(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))[0].token_ids) == 60
    with LLM(str(tmp_path), num_kv_blocks=7, **{**kw, "max_model_len": length}) as llm:
        assert llm.engine.max_model_len == length


def test_warmup_does_not_fit_counts_the_blocks_sequences_get(capsys):
    """warmup's 'does not fit' line under a window: the budget's blocks less the placeholder (it said 'needs 14 KV
    blocks, the budget leaves 14' of a plan that does not fit, the placeholder counted among the sequences')."""
    from infer.cli.warmup import print_plan
    from infer.memory.plan import MemoryPlan
    plan = MemoryPlan("cpu", 0, 0, 0, 0, 0, 0, 1, 4, 4, 14, 120, 2, max_length_limit=4096, window_blocks=7)
    assert not plan.fits
    print_plan(plan, {"model": "m", "estimate": True})
    out = " ".join(capsys.readouterr().out.split())
    assert "needs 14 KV blocks, the budget leaves 13" in out


def test_largest_length_under_a_window_counts_the_longer_steps():
    """A windowed plan at a max_length below max_num_batched_tokens (its step's chunk at most max_length) said any
    length fits at its concurrency (max_length_at_concurrency = the model's limit), but a longer max_length's
    chunks are longer: the blocks of a sequence of that length (window 16, chunks up to 512 tokens, blocks of 4:
    133) exceed what each of 3 sequences gets. The largest length reported is one whose own plan fits."""
    from transformers import AutoConfig

    from infer.engine.config import EngineConfig
    from infer.memory.plan import make_plan
    from test_probes_session55_swblocks import SMALL
    cfg = AutoConfig.for_model("mistral", **{**SMALL, "max_position_embeddings": 4096, "sliding_window": 16})
    ec = EngineConfig("tiny-llama", block_size=4, max_num_batched_tokens=512, device="cpu")
    dev = torch.device("cpu")

    def plan(length: int):
        return make_plan(ec, cfg, torch.float32, dev, 10**6, 10**6, length, 3, 4096, budget=6_570_000)
    small = plan(100)
    assert small.fits and small.blocks_for(100) == 25 and 30 < small.usable_blocks // 3 < 133
    longest = small.max_length_at_concurrency
    assert longest > 100
    at = plan(longest)
    assert at.kv_blocks == small.kv_blocks and at.fits, (longest, at.blocks_for(longest), at.usable_blocks)
    assert small.blocks_for(longest) == at.blocks_for(longest)
