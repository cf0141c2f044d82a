"""Hybrid models' prefix caching through replies and on exact repeats (engine.state_cache.StateSnapshots, session 65):
a sequence keeps a state snapshot at the last block boundary its decode reached (keyed once its tokens are on the
host, overlapped steps too), so a chat's next turn (the prompt, the reply, a new message) starts after the reply's
last full block, not after the prompt's; a block-aligned prompt's prefill is cut at its boundary before its last
token, so a repeat of it hits there; requests whose hit reaches further from a state the step snapshots wait a step
for it (identical prompts together). Tiny Qwen3.5 (Gated DeltaNet) and Granite 4.0 (Mamba-2), float32, against
transformers (peft) and caching off; cache_salt and adapters, preemption and a full pool (LRU eviction)."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.engine.state_cache import StateSnapshots
from infer.models.tiny import ensure_builtin

from helpers import check_state_slots_all_free, greedy_each, hf_model, prompt_steps, random_prompts

NAMES = ("tiny-qwen3_5", "tiny-granite4")
BASE = random_prompts(512, (37,), seed=6)[0]
MORE = ([5, 6, 7], [9])  # each later turn's new message


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    """(builtin path, transformers' float32 model) of each hybrid."""
    path = str(ensure_builtin(request.param))
    return path, hf_model(path)


def _chat(hf, first: list[int], n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Transformers' turns of a chat: each prompt (the one before, its greedy reply of n tokens, a new message) and
    its reply."""
    prompts, replies = [first], []
    for more in MORE + ((),):
        replies.append(greedy_each(hf, [prompts[-1]], n)[0])
        if more:
            prompts.append(prompts[-1] + replies[-1] + list(more))
    return prompts, replies


def _turns(llm, prompts, n: int, **kw) -> tuple[list[list[int]], list[int]]:
    """Each prompt's n greedy tokens, one request after the other; each one's cached prompt tokens."""
    got, cached = [], []
    for p in prompts:
        out = llm.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True, **kw))[0]
        got.append(out.token_ids)
        cached.append(out.num_cached_tokens)
    return got, cached


@pytest.mark.parametrize("overlap", [False, True])
def test_a_next_turn_starts_after_the_reply(model, overlap):
    """Three turns of 37, 50 and 61 tokens (blocks of 4), replies of 10 tokens: each turn's decode keeps its state at
    the last block boundary it reached (44, then 56: its last token is never computed), so the next turn finds it
    and computes only what follows, not from the prompt's last snapshot (36, 48). Overlapped steps key the snapshot
    once the token is on the host. Each reply keeps one snapshot (at its last boundary, the earlier ones it reached
    given back), each prompt its prefill's: 6 kept of 9 taken. Transformers' tokens, every slot free."""
    path, hf = model
    prompts, want = _chat(hf, BASE, 10)
    assert [len(p) for p in prompts] == [37, 50, 61]
    with LLM(path, block_size=4, overlap=overlap) as llm:
        steps = prompt_steps(llm)
        got, cached = _turns(llm, prompts, 10)
        snapshots = llm.engine.block_manager.snapshots
        assert not snapshots.unnamed
        assert snapshots.restored == 2
        assert (snapshots.saved, len(snapshots.slots), snapshots.evicted) == (9, 6, 0)
        assert len(snapshots.free) == snapshots.num_slots - 6
        check_state_slots_all_free(llm)
    assert got == want
    assert cached == [0, 44, 56]  # (the prompts' own snapshots would give 36 and 48)
    assert sum(steps) == 37 + (50 - 44) + (61 - 56)


def test_a_reply_snapshot_is_keyed_by_cache_salt(model):
    """A turn under salt "a": the next turn under "b" finds neither blocks nor the reply's snapshot, under "a" it
    starts after the reply. Transformers' tokens."""
    path, hf = model
    prompts, want = _chat(hf, BASE, 10)
    with LLM(path, block_size=4) as llm:
        got, cached = [], []
        for p, salt in ((prompts[0], "a"), (prompts[1], "b"), (prompts[1], "a")):
            out = llm.generate([p], SamplingParams(max_new_tokens=10, ignore_eos=True, cache_salt=salt))[0]
            got.append(out.token_ids)
            cached.append(out.num_cached_tokens)
    assert got == [want[0], want[1], want[1]]
    assert cached == [0, 0, 44]


def test_a_reply_snapshot_is_keyed_by_adapter(tmp_path):
    """tiny-qwen3_5 with an adapter of its attention and MLP (it changes the linear layers' inputs, so their
    states): a turn under it; the next turn under the base model finds no snapshot, under the adapter it starts
    after the reply. peft's tokens."""
    from lora_helpers import ALL, PeftOracle, hf_float, save_adapters
    base = ensure_builtin("tiny-qwen3_5")
    hf = hf_float(base)
    paths = save_adapters(hf, tmp_path, {"all": dict(r=8, lora_alpha=16, target_modules=ALL)})
    oracle = PeftOracle(hf, paths)
    try:
        reply = oracle.greedy("all", BASE, 10)
        nxt = BASE + reply + list(MORE[0])
        want = [reply, oracle.greedy(None, nxt, 6), oracle.greedy("all", nxt, 6)]
    finally:
        oracle.close()
    assert want[1] != want[2]  # (the adapter changes the tokens: the check means something)
    with LLM(str(base), loras={k: str(p) for k, p in paths.items()}, max_loras=1, max_lora_rank=8,
             block_size=4) as llm:
        got, cached = [], []
        for p, a, n in ((BASE, "all", 10), (nxt, None, 6), (nxt, "all", 6)):
            out = llm.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True), lora=a)[0]
            got.append(out.token_ids)
            cached.append(out.num_cached_tokens)
    assert got == want
    assert cached == [0, 0, 44]


def test_an_exactly_block_aligned_repeat_hits_before_its_last_block(model):
    """A 36-token prompt (9 blocks of 4) is prefilled to 32, the last boundary before its last token, then to 36
    (both snapshotted): the same prompt again starts from 32 and computes its last block only, and its extension
    from 36, kept as a prompt's (the replies' snapshots, at 40, move on without it). Transformers' tokens."""
    path, hf = model
    prompts = [BASE[:36], BASE[:36], BASE[:36] + [4, 4]]
    want = greedy_each(hf, prompts, 6)
    with LLM(path, block_size=4) as llm:
        steps = prompt_steps(llm)
        got, cached = _turns(llm, prompts, 6)
        check_state_slots_all_free(llm)
    assert got == want
    assert cached == [0, 32, 36]
    assert [n for n in steps if n] == [32, 4, 4, 2]


def test_identical_prompts_together_share_the_first_ones_state(model):
    """Three identical 37-token prompts in one call: the later two wait a step for the state the first's chunk to 36
    snapshots and start there (the prompt computed once, not three times). Caching off's tokens."""
    path, _ = model
    prompts = [BASE] * 3
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(path, block_size=4, enable_prefix_caching=False) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(path, block_size=4) as llm:
        steps = prompt_steps(llm)
        outs = llm.generate(prompts, params)
        check_state_slots_all_free(llm)
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 36, 36]
    assert [n for n in steps if n] == [36, 3]


def test_chats_preempted_and_a_full_pool(model):
    """Three chats at once, 24 KV blocks of 4 (some preempted and recomputed, their replies' snapshots taken during
    the recompute too), in 4 snapshot slots (evicted least recently used first): each turn gives transformers'
    tokens, and some next turn starts after a snapshot."""
    path, hf = model
    firsts = random_prompts(512, (21, 26, 30), seed=12)
    chats = [_chat(hf, f, 8) for f in firsts]
    with LLM(path, block_size=4, num_kv_blocks=24, max_model_len=64, state_snapshots=4) as llm:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        turns = []
        for t in range(3):
            outs = llm.generate([c[0][t] for c in chats], params)
            turns.append([o.token_ids for o in outs])
        assert llm.engine.scheduler.num_preemptions > 0
        snapshots = llm.engine.block_manager.snapshots
        assert snapshots.evicted > 0 and snapshots.restored > 0
        assert not snapshots.unnamed
        check_state_slots_all_free(llm)
    assert turns == [[c[1][t] for c in chats] for t in range(3)]


class _Seq:
    """A sequence as StateSnapshots reads it: its length, pending tokens, whether finished, its kept key."""

    def __init__(self, n: int, pending: int = 0):
        self.n, self.num_pending, self.finished, self.state_snap_key = n, pending, False, None

    def __len__(self) -> int:
        return self.n


def test_snapshots_past_a_prompt_named_moved_and_dropped():
    """StateSnapshots.hold / name: a snapshot is keyed once its block's tokens are known, a sequence's next one
    takes its slot, one whose sequence finished without its tokens goes back to the free list, one whose key is
    kept already too, and with every slot waiting for its name a further one is not taken."""
    copies = []
    snaps = StateSnapshots(3, lambda pairs, save: copies.append((pairs, save)))

    def key_of(seq, i):
        return None if len(seq) - seq.num_pending < (i + 1) * 4 else bytes([seq.n % 256, i])
    a, b = _Seq(8, pending=1), _Seq(8)
    snaps.hold([(0, a, 1), (1, b, 1)])
    assert copies == [([(0, 0), (1, 1)], True)]
    snaps.name(key_of)
    assert [s for s, *_ in snaps.unnamed] == [0] and list(snaps.slots.values()) == [1]  # (a's token is pending)
    a.num_pending = 0
    snaps.name(key_of)
    assert snaps.slots == {bytes([8, 1]): 1} and snaps.free == [2, 0]  # (the same key: a copy, given back)
    b.n = 12
    snaps.hold([(1, b, 2)])  # (b's next boundary: the slot of the one it kept)
    assert copies[-1] == ([(1, 1)], True) and not snaps.slots
    snaps.name(key_of)
    assert snaps.slots == {bytes([12, 2]): 1} and b.state_snap_key == bytes([12, 2])
    c, d, e = _Seq(16, pending=1), _Seq(16, pending=1), _Seq(16, pending=1)
    snaps.hold([(2, c, 3), (3, d, 3), (4, e, 3)])  # (2 free slots, then the least recently used one's)
    assert snaps.evicted == 1 and [s for s, *_ in snaps.unnamed] == [0, 2, 1] and not snaps.slots
    snaps.hold([(5, _Seq(16, pending=1), 3)])  # (none to take: every slot waits for its name)
    assert len(snaps.unnamed) == 3 and copies[-1] == ([(2, 0), (3, 2), (4, 1)], True)
    c.finished = True  # (its last token dropped: never named)
    snaps.name(key_of)
    assert [s for s, *_ in snaps.unnamed] == [2, 1] and snaps.free == [0]
