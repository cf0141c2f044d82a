"""The prefix cache keys a block by its whole prefix, not by its own token ids: a block's K/V depend on every token
before it, so an identical block after a different prefix (or at another position) must not be shared.
Comparing a hit's token ids confirms only the block itself; the chained hash has to carry the rest."""

from __future__ import annotations

from infer import LLM, SamplingParams
from infer.engine.block_manager import BlockManager
from infer.engine.sampling_params import SamplingParams as Params
from infer.engine.sequence import Sequence
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts

X, Y, Z, W = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]


def _computed(bm: BlockManager, name: str, tokens: list[int]) -> Sequence:
    """A sequence admitted and fully computed, its full blocks registered in the prefix cache."""
    seq = Sequence(name, list(tokens), Params(max_new_tokens=10))
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.register_computed(seq)
    return seq


def _admitted(bm: BlockManager, name: str, tokens: list[int]) -> Sequence:
    seq = Sequence(name, list(tokens), Params(max_new_tokens=10))
    bm.allocate(seq)
    return seq


def test_identical_block_after_a_different_prefix_is_not_shared():
    bm = BlockManager(32, 4)
    a = _computed(bm, "a", X + Z + [0])
    b = _computed(bm, "b", Y + W + [0])
    c = _admitted(bm, "c", Y + Z + [0])  # Y is b's first block; Z follows X in a, not Y
    assert c.num_cached_tokens == 4
    assert c.block_table[0] == b.block_table[0]
    assert c.block_table[1] != a.block_table[1]
    d = _admitted(bm, "d", Z + [0])  # Z as the first block: a's Z was computed after X
    assert d.num_cached_tokens == 0 and d.block_table[0] != a.block_table[1]


def test_freed_blocks_in_the_lru_keep_their_whole_prefix():
    bm = BlockManager(32, 4)
    for seq in (_computed(bm, "a", X + Z + W + [0]), _computed(bm, "b", Y + [0])):
        bm.free_seq(seq)  # both wait in the free list with their hashes
    c = _admitted(bm, "c", Y + Z + W + [0])
    assert c.num_cached_tokens == 4
    e = _admitted(bm, "e", X + Z + W + [0])  # the same prefix finds all three
    assert e.num_cached_tokens == 12


def test_blocks_filled_by_generated_tokens_chain_to_the_prompt():
    """Blocks completed by decode steps are registered with the hash of the blocks before them."""
    bm = BlockManager(32, 4)
    a = Sequence("a", X + [9, 10], Params(max_new_tokens=10))
    bm.allocate(a)
    a.num_computed_tokens = len(a)
    bm.register_computed(a)
    for t in [11, 12, 0]:  # decode: Z is completed by generated tokens
        a.output_token_ids.append(t)
        bm.grow(a, len(a))
        a.num_computed_tokens = len(a)
        bm.register_computed(a)
    assert _admitted(bm, "b", X + Z + [0]).num_cached_tokens == 8
    assert _admitted(bm, "c", Y + Z + [0]).num_cached_tokens == 0
    assert _admitted(bm, "d", Z + [0]).num_cached_tokens == 0


def test_engine_tokens_equal_hf_when_prompts_share_a_later_block_only():
    """Prompts x+z+.. and y+w+.. run first; then y+z+.. (y cached, z cached only after x) and z+.. (z at another
    position) must give transformers' greedy tokens."""
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, max_model_len=64)
    x, y, z, w, t1, t2, t3 = random_prompts(llm.engine.model_config.vocab_size, (4, 4, 4, 4, 3, 5, 2), seed=11)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    llm.generate([x + z + t1, y + w + t2], params)  # finished: their blocks wait in the prefix cache
    later = [y + z + t3, z + t1, y + z + w + t2]
    outs = llm.generate(later, params)
    for prompt, out in zip(later, outs):
        assert out.token_ids == hf_greedy(path, prompt, 8), f"prompt of {len(prompt)} tokens differs from HF"
    # y+z+w+..: y cached, and y+z computed by y+z+.. admitted before it in the same step (shared as vLLM does)
    assert [o.num_cached_tokens for o in outs] == [4, 0, 8]
    assert llm.engine.block_manager.num_used_blocks == 0
