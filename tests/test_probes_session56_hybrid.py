"""Session 56: a sliding-window model's prefix-cache hit runs past evicted blocks (vLLM's sliding-window
find_longest_cache_hit): a hit of k blocks needs only the blocks from the first key a query after it reads (its
position k * block_size, or a draft model's first stale slot, minus window - 1) cached; the blocks before them may
be gone (their table entries: the placeholder). Tiny Mistral of window 16 in blocks of 4; the placeholder and the
evicted blocks NaN (never read): tokens equal transformers', the hit counted in the stats."""

from __future__ import annotations

import pytest
import torch

from infer.engine.block_manager import BlockManager, block_key
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence

from test_probes_session55_swblocks import CHUNK, _poison_placeholder, build, hf_greedy, random_prompts


def _seq(n: int) -> Sequence:
    return Sequence("r", list(range(3, 3 + n)), SamplingParams(max_new_tokens=10))


def _evict(bm: BlockManager, bid: int) -> None:
    """Reuse cached free block `bid` (its hash gone) and give it back, as another request's allocation would."""
    bm.free.move_to_end(bid, last=False)
    assert bm._take_free() == bid
    bm._release(bm.blocks[bid])


def _cached_run(n: int = 41, draft_reads: bool = False) -> tuple[BlockManager, list[int]]:
    """A pool where a sequence of n tokens computed n - 1 and was freed: its (n - 1) // 4 full blocks cached."""
    bm = BlockManager(40, 4, enable_prefix_caching=True, window=16, step_tokens=8)
    bm.draft_reads = draft_reads
    a = _seq(n)
    bm.allocate(a)
    a.num_computed_tokens = a.draft_computed = a.draft_fed = n - 1
    bm.register_computed(a)
    chain = list(a.block_table)
    bm.free_seq(a)
    assert bm.num_free_blocks == bm.num_blocks
    return bm, chain


def test_a_hit_runs_past_an_evicted_block_before_the_window():
    """Blocks 0 and 2 of a 10-block prefix evicted: a query at 40 reads keys 25..39 (blocks 6..9), so the hit is
    all 40 tokens, blocks 0..5 the placeholder, 40 tokens counted as hits."""
    bm, chain = _cached_run()
    _evict(bm, chain[0])
    _evict(bm, chain[2])
    b = _seq(41)
    assert bm.can_allocate(b, budget=8)
    bm.allocate(b, budget=8)
    assert b.num_computed_tokens == 40 and b.num_cached_tokens == 40 and b.num_freed_blocks == 6
    assert b.block_table[:6] == [bm.placeholder] * 6 and b.block_table[6:10] == chain[6:10]
    assert bm.prefix_hits == 40 and bm.prefix_queries == 82  # (the first run: 41 tokens, no hit)
    bm.free_seq(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_hit_stops_where_its_window_has_an_evicted_block():
    """Block 7 evicted (inside the window of a query at 40 and of one at 36): the hit is the 7 blocks before it;
    without a window's search (the whole prefix needed) a block 0 evicted leaves no hit at all."""
    bm, chain = _cached_run()
    _evict(bm, chain[7])
    b = _seq(41)
    bm.allocate(b, budget=8)
    assert b.num_computed_tokens == 28 and b.block_table[:7] == [bm.placeholder] * 3 + chain[3:7]
    plain = BlockManager(40, 4, enable_prefix_caching=True)
    a = _seq(41)
    plain.allocate(a)
    a.num_computed_tokens = 40
    plain.register_computed(a)
    first = a.block_table[0]
    plain.free_seq(a)
    _evict(plain, first)
    c = _seq(41)
    plain.allocate(c)
    assert c.num_computed_tokens == 0


def test_a_draft_models_stale_slot_widens_what_the_hit_needs():
    """Draft-model speculation: the draft KV of block 7 stale from its first slot (28): the draft's next query at
    28 reads keys 13..27, so blocks 3..9 must be cached: with block 0 evicted the hit holds (blocks 0..2 the
    placeholder), with block 4 evicted it does not (the hit: blocks 0..3)."""
    bm, chain = _cached_run(draft_reads=True)
    bm.blocks[chain[7]].draft_upto = 0
    _evict(bm, chain[0])
    b = _seq(41)
    bm.allocate(b, budget=8)
    assert b.num_computed_tokens == 40 and b.draft_computed == 28 and b.num_freed_blocks == 3
    bm.free_seq(b)
    bm, chain = _cached_run(draft_reads=True)
    bm.blocks[chain[7]].draft_upto = 0
    _evict(bm, chain[4])
    b = _seq(41)
    bm.allocate(b, budget=8)
    assert b.num_computed_tokens == 16


def test_blocks_of_the_step_being_scheduled_are_no_window_hit():
    """A block registered by the step being scheduled (a failed step takes it back, and the sequence then computes
    from it, reading the blocks before it) is a miss for a hit that skips evicted blocks: with block 0 evicted and
    block 8 this step's, the hit is blocks 1..7 (32 tokens), not the 40 tokens through block 9."""
    bm, chain = _cached_run()
    _evict(bm, chain[0])
    bm.scheduled = [chain[8]]
    b = _seq(41)
    bm.allocate(b, budget=8)
    assert b.num_computed_tokens == 32 and chain[8] not in b.block_table  # (blocks 1..7 found; block 9 alone not)


def _poison(llm, bids) -> None:
    cache = llm.engine.runner.kv_cache
    bm = llm.engine.block_manager
    bm.fresh = [b for b in bm.fresh if b not in bids]
    for b in bids:
        cache[:, :, b] = float("nan")


@pytest.mark.parametrize("gpu_path", [False, True])
def test_a_repeated_prompt_hits_past_its_evicted_first_blocks(tmp_path, monkeypatch, gpu_path):
    """A 90-token prompt run once, then its first 4 cached blocks evicted (and NaN, as the placeholder): a rerun
    finds 88 tokens (not 0) and its tokens are transformers'; the prefix cache's hits count them. On the GPU path
    too (Triton interpreted, decodes through emulated graphs)."""
    if gpu_path and torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels")
    from infer import LLM
    hf = build(tmp_path, "mistral", seed=1)
    prompt = random_prompts((90,), seed=4)[0]
    want = hf_greedy(hf, [prompt], 12)
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=2, num_kv_blocks=60)
    if gpu_path:
        from quant_helpers import int4_kernel_path
        int4_kernel_path(monkeypatch)
        kw.update(cuda_graph_max_tokens=4)
    with LLM(str(tmp_path), **kw) as llm:
        if gpu_path:
            llm.engine.runner.capture_graphs(96, emulate=True)
        bm = llm.engine.block_manager
        _poison_placeholder(llm)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        assert [o.token_ids for o in llm.generate([prompt], params)] == want
        probe = Sequence("p", prompt, params)
        chain = [bm.hash_to_block[block_key(probe, i, 4)] for i in range(22)]
        for bid in chain[:4]:
            _evict(bm, bid)
        _poison(llm, chain[:4])
        hits = llm.engine.stats()["prefix_cache_hits"]
        out = llm.generate([prompt], params)[0]
        assert out.num_cached_tokens == 88 and out.token_ids == want[0]
        assert llm.engine.stats()["prefix_cache_hits"] - hits == 88
