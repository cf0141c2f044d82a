"""Prefix caching of hybrid state-cache models (engine.state_cache.StateSnapshots: Qwen3.5's Gated DeltaNet and
Granite 4.0's Mamba-2 layers, float32): a prompt's conv and recurrent states are snapshotted at block-aligned
positions of its prefill, a later prefix hit is cut to the longest snapshot kept and starts from it. A second request
sharing a long prefix computes fewer prefill tokens and gives the tokens of caching off and of transformers; partial
blocks, eviction from a small pool, preemption, n > 1 and beams, sleep, emulated CUDA graphs; the warmup plan counts
the snapshots' bytes as the engine allocates them."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.memory.sizes import state_slot_bytes
from infer.models.tiny import ensure_builtin

from helpers import (check_sleep_frees_the_states_with_the_kv_cache, check_state_slots_all_free, estimated_plan,
                     greedy_each, greedy_tokens, hf_model, prompt_steps, random_prompts)

NAMES = ("tiny-qwen3_5", "tiny-granite4")


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    """(builtin path, transformers' float32 model) of each hybrid."""
    path = str(ensure_builtin(request.param))
    return path, hf_model(path)


def _one_by_one(llm, prompts, n: int) -> tuple[list[list[int]], list[int]]:
    """Each prompt's n greedy tokens, one request after the other; each one's cached prompt tokens."""
    got, cached = [], []
    for p in prompts:
        out = llm.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
        got.append(out.token_ids)
        cached.append(out.num_cached_tokens)
    return got, cached


BASE = random_prompts(512, (37,), seed=6)[0]


def test_a_second_request_sharing_a_prefix_starts_after_its_snapshot(model):
    """A 37-token prompt, then the same prompt with 7 more tokens (blocks of 4): the second finds the first's 9 full
    blocks and the states snapshotted at their end (the first prompt's prefill was cut there), so it computes only
    its last 8 tokens (in two chunks: its prompt of 11 blocks is cut at 40, the last boundary before its last
    token, for a request that repeats it); both give transformers' tokens and those of caching off."""
    path, hf = model
    prompts = [BASE, BASE + [5, 6, 7, 8, 9, 10, 11]]
    want = greedy_each(hf, prompts, 6)
    with LLM(path, block_size=4, enable_prefix_caching=False) as llm:
        assert _one_by_one(llm, prompts, 6)[0] == want
    with LLM(path, block_size=4) as llm:
        steps = prompt_steps(llm)
        got, cached = _one_by_one(llm, prompts, 6)
        snapshots = llm.engine.block_manager.snapshots
        assert snapshots.restored == 1
        assert llm.engine.stats()["prefix_cache_hits"] == 36
        check_state_slots_all_free(llm)
    assert got == want
    assert cached == [0, 36]
    # the first prompt's prefill: 36 tokens to its last block boundary, then its last one; the second's: 8 tokens
    assert [n for n in steps if n] == [36, 1, 4, 4]


def test_a_partial_block_prefix_is_cut_to_the_last_snapshot(model):
    """Chunks of up to 10 tokens, cut to block boundaries, snapshot the states at 8, 16, 24, 32 and 36, its decode
    at 40, the second prompt's at 12 (in 7 snapshot slots: none evicted before the third prompt); a prompt
    sharing 9 tokens gets 8; one sharing 22 tokens (5 full blocks and part of a sixth) takes the cached blocks up to
    the snapshot at 16, not the 20 tokens cached KV holds; one sharing 3 none."""
    path, hf = model
    prompts = [BASE, BASE[:9] + [8, 8], BASE[:22] + [3, 4, 5, 6, 7], BASE[:3] + [9, 9, 9]]
    want = greedy_each(hf, prompts, 5)
    with LLM(path, block_size=4, max_num_batched_tokens=10, max_num_seqs=8, state_snapshots=7) as llm:
        steps = prompt_steps(llm)
        got, cached = _one_by_one(llm, prompts, 5)
        assert llm.engine.block_manager.snapshots.num_slots == 7
    assert got == want
    assert cached == [0, 8, 16, 0]
    assert [n for n in steps if n] == [8, 8, 8, 8, 4, 1, 3, 8, 3, 4, 2]  # (chunks end at block boundaries)


def test_a_small_pool_evicts_the_least_recently_used_snapshot(model):
    """Prompts of a 37-token prefix and of another 21-token one, alternating, each snapshotted at its prefill's last
    block boundary and at its decode's (at 36 and 40, 20 and 24). --state-snapshots 1: each snapshot evicts the one
    before, so no extension finds a state (its KV blocks are cached) and each computes its prompt in full. 4 slots:
    the first prefix's snapshot at 36, used by its extension (most recently), outlives the other's at 20 and 24,
    which that extension's own snapshots evict: its second extension hits, the other's none. Transformers'
    tokens."""
    path, hf = model
    other = random_prompts(512, (21,), seed=9)[0]
    prompts = [BASE, other, BASE + [1, 2, 3, 4, 5], BASE + [9, 9], other + [1, 2, 3]]
    want = greedy_each(hf, prompts, 4)
    for slots, hits, evicted in ((1, [0, 0, 0, 0, 0], 9), (4, [0, 0, 36, 36, 0], 5)):
        with LLM(path, block_size=4, state_snapshots=slots) as llm:
            got, cached = _one_by_one(llm, prompts, 4)
            assert llm.engine.block_manager.snapshots.evicted == evicted, slots
            assert llm.engine.runner.snapshot_bytes == slots * state_slot_bytes(llm.engine.model_config,
                                                                                torch.float32)
        assert got == want, slots
        assert cached == hits, slots


def test_preempted_requests_sharing_a_prefix_recompute_from_a_snapshot(model):
    """16 KV blocks of 4 for 4 prompts sharing a 24-token prefix, admitted in two steps: some are preempted and
    recomputed, taking cached blocks and snapshots (their own prefix's too); transformers' tokens, every slot free."""
    path, hf = model
    shared = BASE[:24]
    prompts = [shared + t for t in random_prompts(512, (3, 6, 2, 5), seed=4)]
    want = greedy_each(hf, prompts, 12)
    with LLM(path, block_size=4, num_kv_blocks=16, max_model_len=64) as llm:
        assert greedy_tokens(llm, prompts[:1], 1) == [want[0][:1]]  # (its snapshot at 24 for the others)
        assert greedy_tokens(llm, prompts, 12) == want
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats()["prefix_cache_hits"] > 0
        check_state_slots_all_free(llm)


def test_samples_and_beams_share_the_prompt_state(model):
    """n = 3 greedy samples of a prompt (the later ones wait a step for the first's snapshot:
    BlockManager.awaits_snapshot) and again after it (each from the snapshot), and beam search over prompts sharing a
    prefix: the tokens of caching off."""
    from infer.engine.beam import BeamSearchParams
    path, _ = model
    params = SamplingParams(n=3, max_new_tokens=5, ignore_eos=True, temperature=0)
    beams = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    prompts = [BASE, BASE[:33] + [4, 4]]
    results = []
    for caching in (False, True):
        with LLM(path, block_size=4, enable_prefix_caching=caching) as llm:
            samples = [[c.token_ids for c in o.outputs] for o in llm.generate([BASE, BASE], params)]
            found = [o.num_cached_tokens for o in llm.generate([BASE + [2]], params)]
            searched = [[b.tokens for b in o.sequences] for o in llm.beam_search(prompts, beams)]
            results.append((samples, searched))
            if caching:
                assert found == [36]
                check_state_slots_all_free(llm)
    assert results[0] == results[1]
    assert all(s == results[0][0][0][0] for group in results[1][0] for s in group)


def test_sleep_forgets_the_snapshots(model):
    """sleep() frees the snapshots with the states (zeros on waking) and forgets them: the prompt's extension after
    waking finds no snapshot and computes in full, giving transformers' tokens."""
    path, hf = model
    prompts = [BASE, BASE + [7, 7, 7]]
    want = greedy_each(hf, prompts, 4)
    with LLM(path, block_size=4, enable_sleep_mode=True) as llm:
        assert greedy_tokens(llm, prompts[:1], 4) == want[:1]
        assert llm.engine.block_manager.snapshots.slots
        check_sleep_frees_the_states_with_the_kv_cache(llm)
        assert not llm.engine.block_manager.snapshots.slots
        got, cached = _one_by_one(llm, prompts[1:], 4)
    assert got == want[1:]
    assert cached == [0]


def test_emulated_decode_graphs_after_a_restored_state(model):
    """Decode steps through (emulated) CUDA graphs of requests that started from a snapshot: transformers' tokens."""
    path, hf = model
    prompts = [BASE, BASE + [3, 1], BASE + [3, 2, 2, 2, 2]]
    want = greedy_each(hf, prompts, 9)
    with LLM(path, max_num_seqs=8, block_size=4, num_kv_blocks=128, max_model_len=96, cuda_graph_max_tokens=16) as llm:
        llm.engine.runner.capture_graphs(96, emulate=True)
        assert greedy_tokens(llm, prompts[:1], 9) == want[:1]
        assert greedy_tokens(llm, prompts[1:], 9) == want[1:]
        assert llm.engine.runner.graphs.replays
        assert llm.engine.block_manager.snapshots.restored == 2
        check_state_slots_all_free(llm)


@pytest.mark.parametrize("name", NAMES)
def test_warmup_counts_the_snapshots_the_engine_allocates(name):
    """`infer warmup --estimate` counts the snapshot slots (half of --max-num-seqs by default, --state-snapshots, none
    without prefix caching) beside the running states, as many bytes as the engine allocates, and the KV blocks are
    fewer by them."""
    path = str(ensure_builtin(name))
    args = ("--max-length", "256", "--max-num-seqs", "8", "--memory-limit", "256MiB")
    plan = estimated_plan(path, *args)
    more = estimated_plan(path, *args, "--state-snapshots", "40")
    off = estimated_plan(path, *args, "--no-prefix-caching")
    with LLM(path, max_model_len=256, max_num_seqs=8) as llm:
        slot = state_slot_bytes(llm.engine.model_config, torch.float32)
        assert plan["snapshot_bytes"] == llm.engine.runner.snapshot_bytes == 4 * slot > 0
        assert plan["state_bytes"] == llm.engine.runner.state_bytes == 9 * slot
    assert more["snapshot_bytes"] == 40 * slot and off["snapshot_bytes"] == 0
    assert more["kv_blocks"] < plan["kv_blocks"] < off["kv_blocks"]


def test_non_hybrid_models_keep_no_snapshots():
    """A model without linear-attention layers: no snapshots (the option ignored), prefix caching as before."""
    with LLM(str(ensure_builtin("tiny-granite4-dense")), block_size=4, state_snapshots=5) as llm:
        assert llm.engine.block_manager.snapshots is None
        assert llm.engine.block_manager.enable_prefix_caching
        assert llm.engine.runner.snapshot_bytes == 0
