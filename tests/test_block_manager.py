"""Property tests: random allocate / grow / fork / free never leak a block and keep reference counts consistent."""

from hypothesis import given, settings, strategies as st

from infer.engine.block_manager import BlockManager
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence


def _seq(i, tokens):
    return Sequence(str(i), list(tokens), SamplingParams(max_new_tokens=1000))


def _computed(bm: BlockManager, i, tokens) -> Sequence:
    """A sequence of `tokens` allocated in bm, all of them computed: its full blocks registered in the prefix cache."""
    s = _seq(i, tokens)
    bm.allocate(s)
    s.num_computed_tokens = len(s)
    bm.register_computed(s)
    return s


def _check(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id]
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    for h, bid in bm.hash_to_block.items():
        assert bm.blocks[bid].hash == h
    for s in live:
        assert len(s.block_table) == bm.blocks_needed(len(s)) or len(s.block_table) >= bm.blocks_needed(
            s.num_computed_tokens)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "compute", "grow", "fork", "free"]),
                         st.integers(0, 10_000), st.lists(st.integers(0, 3), min_size=1, max_size=30)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 40),
       caching=st.booleans())
def test_random_operations_keep_invariants(ops, block_size, num_blocks, caching):
    bm = BlockManager(num_blocks, block_size, caching)
    live: list[Sequence] = []
    for n, (op, pick, tokens) in enumerate(ops):
        if op == "alloc":
            s = _seq(n, tokens)
            if bm.can_allocate(s):
                bm.allocate(s)
                assert s.num_computed_tokens < len(s)  # at least one token is left to compute
                live.append(s)
        elif live:
            s = live[pick % len(live)]
            if op == "compute":
                s.num_computed_tokens = len(s)
                bm.register_computed(s)
            elif op == "grow":
                s.output_token_ids.append(tokens[0])
                if bm.slots_needed(s, len(s)) <= bm.num_free_blocks:
                    bm.grow(s, len(s))
                else:
                    s.output_token_ids.pop()
            elif op == "fork":
                child = _seq(n, s.all_token_ids)
                bm.fork(s, child)
                if bm.slots_needed(child, len(child)) <= bm.num_free_blocks:
                    bm.grow(child, len(child))
                    live.append(child)
                else:
                    bm.free_seq(child)
            else:
                bm.free_seq(s)
                live.remove(s)
        _check(bm, live)
    for s in live:
        bm.free_seq(s)
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_blocks_are_shared_and_confirmed_by_ids():
    bm = BlockManager(16, 4)
    a = _computed(bm, "a", range(10))
    b = _seq("b", list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free_seq(a)
    bm.free_seq(b)
    # kept in the LRU after their sequences end, found again
    c = _seq("c", list(range(9)))
    bm.allocate(c)
    assert c.num_cached_tokens == 8
    # a hash hit whose ids differ is not a hit
    blk = bm.blocks[c.block_table[0]]
    blk.token_ids = (42,) * 4
    d = _seq("d", list(range(9)))
    bm.allocate(d)
    assert d.num_cached_tokens == 0


def test_whole_prompt_cached_still_computes_last_token():
    bm = BlockManager(16, 4)
    _computed(bm, "a", range(8))
    b = _seq("b", range(8))
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 4


def test_eviction_reuses_least_recently_freed_first():
    bm = BlockManager(4, 2)
    a = _computed(bm, "a", range(4))
    bm.free_seq(a)
    assert len(bm.hash_to_block) == 2
    big = _seq("big", [7] * 7)  # needs all 4 blocks: the cached ones are evicted
    assert bm.can_allocate(big)
    bm.allocate(big)
    assert bm.hash_to_block == {} and bm.num_free_blocks == 0


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = BlockManager(16, 4)
    a = _computed(bm, "a", range(9))
    _computed(bm, "b", range(100, 109))
    bm.free_seq(a)
    bm.reset_prefix_cache()
    assert bm.prefix_cache_hit_rate() == 0.0
    again_a, again_b = _seq("a2", range(9)), _seq("b2", range(100, 109))
    bm.allocate(again_a)
    bm.allocate(again_b)
    assert again_a.num_cached_tokens == 0  # a's blocks were free: forgotten
    assert again_b.num_cached_tokens == 8  # b is still running: its blocks stay shareable


def test_uncached_blocks_are_reused_first_cached_ones_last():
    """A freed block without a prefix hash (caching off, or a partial block) goes to the front of the free list:
    its memory is warm and its contents worthless; a cached block goes to the back and survives longest."""
    bm = BlockManager(10, 4, enable_prefix_caching=True)
    a = _computed(bm, 0, range(10))  # blocks: 2 full (cached) + 1 partial
    table = list(a.block_table)
    bm.free_seq(a)
    b = _seq(1, [99, 98])  # different tokens: no prefix hit
    bm.allocate(b)
    assert b.block_table == [table[2]]  # the partial block, not a never-used one, not a cached one
    assert list(bm.free)[-2:] == [table[1], table[0]]  # cached blocks at the LRU end
    nocache = BlockManager(10, 4, enable_prefix_caching=False)
    c = _seq(2, range(10))
    nocache.allocate(c)
    used = list(c.block_table)
    nocache.free_seq(c)
    d = _seq(3, range(12))
    nocache.allocate(d)
    assert sorted(d.block_table) == sorted(used)
