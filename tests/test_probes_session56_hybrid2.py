"""Session 56: the hybrid KV cache of models whose layers mix sliding-window and full attention (Gemma 2, Gemma 3, a
Qwen2 with max_window_layers): the layers split into groups of the same number of layers (models.limits
.layer_groups), one pool of blocks of a group's layers, a block table per group; the sliding groups free their
blocks behind the window (engine.hybrid_blocks). Tiny models of window 16 in blocks of 4, far past the window:
tokens and logprobs equal transformers' (and the engine that keeps every block) with the freed blocks and the
placeholder NaN, under chunked prefill, preemption, the prefix cache, n > 1, beam search, n-gram speculation and
the GPU path (Triton interpreted, emulated graphs); the memory plan counts a sequence by its groups."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infer.engine.block_manager import block_key
from infer.engine.hybrid_blocks import HybridBlockManager
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence
from infer.models.limits import layer_groups

from helpers import greedy_each, norms_drawn, save_random_model

from test_probes_session55_swblocks import CHUNK, random_prompts

SL, FULL = "sliding_attention", "full_attention"
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
GEMMA = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=16)
FAMILIES = {
    # every other layer slides: 2 groups of 2 layers
    "gemma2": ("gemma2", "Gemma2ForCausalLM", dict(GEMMA, num_hidden_layers=4, attn_logit_softcapping=2.0,
                                                   final_logit_softcapping=1.5)),
    # 5 of 6 layers slide: 6 groups of 1 layer
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", dict(GEMMA, num_hidden_layers=6)),
    # layers 2.. slide: groups of 2 layers, the last sliding one padded
    "qwen2": ("qwen2", "Qwen2ForCausalLM", dict(num_hidden_layers=5, use_sliding_window=True, sliding_window=16,
                                                max_window_layers=2)),
}


def build(folder, family: str, seed: int = 0):
    model_type, arch, config = FAMILIES[family]
    return save_random_model(folder, model_type, arch, {**BASE, **config}, seed, norms_drawn(0.0))


def _no_groups(monkeypatch):
    """Engines built after this keep every block on every layer, as before."""
    import infer.engine.llm_engine as le
    import infer.memory.plan as plan
    for module in (le, plan):
        monkeypatch.setattr(module, "kv_groups", lambda *a, **k: None)


def _poison(llm) -> None:
    """The placeholder NaN, and every block a sliding group frees while no one holds it (prefix caching off: no one
    may take it back) NaN until it is handed out again (then zeroed): a kernel that read one would spread NaN."""
    bm = llm.engine.block_manager
    bm.fresh = [b for b in bm.fresh if b != bm.placeholder]
    nan_where_freed(bm, llm.engine.runner.kv_cache)


def nan_where_freed(bm, cache) -> None:
    """`cache` (a KV cache of bm's pool blocks) NaN at the placeholder and at every block a sliding group frees
    while no one holds it."""
    cache[:, :, bm.placeholder] = float("nan")
    for m in bm.groups[1:]:
        real = m.free_behind

        def free_behind(seq, real=real):
            before = set(seq.block_table)
            real(seq)
            gone = [b for b in before - set(seq.block_table) if bm.blocks[b].ref_count == 0]
            if gone:
                cache[:, :, gone] = float("nan")
        m.free_behind = free_behind


def _held(llm) -> list[int]:
    """The most blocks any sliding group's table held (less its placeholder entries), after each schedule."""
    most = []
    sched = llm.engine.scheduler
    real = sched.schedule

    def schedule():
        batch = real()
        bm = sched.bm
        for s in sched.running:
            for view in bm.views(s)[1:]:
                assert all(b == bm.placeholder for b in view.block_table[:view.num_freed_blocks])
                assert bm.placeholder not in view.block_table[view.num_freed_blocks:]
                most.append(len(view.block_table) - view.num_freed_blocks)
        return batch
    sched.schedule = schedule
    return most


def _run(llm, prompts, n, **kw):
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=0, **kw))
    return [o.token_ids for o in outs], [[r["logprob"] for r in o.logprobs] for o in outs]


# ----------------------------------------------------------------------------------------------- groups, plan
def test_layer_groups_of_each_family():
    gemma2 = SimpleNamespace(model_type="gemma2", sliding_window=16, num_hidden_layers=4)
    assert layer_groups(gemma2) == (2, [(0, [1, 3]), (16, [0, 2])])
    gemma3 = SimpleNamespace(model_type="gemma3_text", sliding_window=16, num_hidden_layers=6,
                             layer_types=[SL] * 5 + [FULL])
    assert layer_groups(gemma3) == (1, [(0, [5])] + [(16, [i]) for i in range(5)])
    qwen2 = SimpleNamespace(model_type="qwen2", sliding_window=16, num_hidden_layers=5, use_sliding_window=True,
                            max_window_layers=2)
    assert layer_groups(qwen2) == (2, [(0, [0, 1]), (16, [2, 3]), (16, [4])])
    mistral = SimpleNamespace(model_type="mistral", sliding_window=16, num_hidden_layers=4)
    assert layer_groups(mistral) is None and layer_groups(SimpleNamespace(model_type="llama",
                                                                          num_hidden_layers=2)) is None


def test_kv_groups_step():
    """The groups' step counts the n-gram lookahead (with a draft model: test_probes_session57_hybspec)."""
    from infer.memory.sizes import kv_groups
    cfg = SimpleNamespace(model_type="gemma2", sliding_window=16, num_hidden_layers=4)
    engine = SimpleNamespace(max_num_batched_tokens=8, speculative_config={"num_speculative_tokens": 3})
    assert kv_groups(engine, cfg, 100) == (2, [0, 16], 11)


def test_warmup_estimate_of_a_mixed_model_fits_more_sequences(tmp_path, monkeypatch):
    """`infer warmup --estimate` of the Gemma 3-shaped model at 240 tokens: blocks of one layer, a sequence 60 of
    them for its full layer and 9 for each sliding one's window and a step (16 + 16 tokens, + 1), where keeping
    every block counts 60 blocks of 6 layers: more sequences fit."""
    import json
    from typer.testing import CliRunner
    from infer.cli.main import app
    build(tmp_path, "gemma3")
    args = ["warmup", str(tmp_path), "--estimate", "--json", "--max-length", "240", "--concurrency", "4",
            "--max-num-batched-tokens", "16", "--block-size", "4", "--memory-limit", "40MB"]

    def estimate():
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        return json.loads(res.output.strip().splitlines()[-1])
    got = estimate()
    assert (got["kv_groups"], got["full_groups"], got["window_blocks"]) == (6, 1, 9)
    _no_groups(monkeypatch)
    old = estimate()
    assert old["kv_groups"] == 0 and old["kv_block_bytes"] == 6 * got["kv_block_bytes"]
    assert got["max_concurrency_at_max_length"] > 2 * old["max_concurrency_at_max_length"]


def test_plan_counts_a_sequence_by_its_groups():
    """Blocks of one layer, 1 full group and 5 sliding ones of window 16 (9 blocks with a step of 16 tokens): a
    sequence of 240 tokens holds 60 + 5 x 9 blocks, of 20 tokens 5 + 5 x 5; the longest length 4 sequences reach
    in 999 blocks is the last one of at most 249 blocks each."""
    from infer.memory.plan import MemoryPlan
    plan = MemoryPlan("cpu", 0, 0, 0, 0, 0, 0, 1, 4, 4, 1000, 240, 4, max_length_limit=1024, window_blocks=9,
                      window=16, window_batched=16, window_ahead=0, kv_groups=6, full_groups=1)
    assert (plan.usable_blocks, plan.blocks_for(240), plan.blocks_for(20)) == (999, 105, 30)
    assert plan.max_concurrency_at_max_length == 999 // 105
    longest = plan.max_length_at_concurrency
    assert plan.blocks_for(longest) <= 249 < plan.blocks_for(longest + 1)


def test_data_parallel_validation_counts_the_groups():
    from infer.parallel.serve_engine import _Blocks
    blocks = _Blocks(100, 4, 16, 8, groups=[0, 16, 16])
    assert blocks.window_cap(120) == 30 + 2 * 7


# ----------------------------------------------------------------------------------------------- block manager
def _seq(n: int) -> Sequence:
    return Sequence("r", list(range(3, 3 + n)), SamplingParams(max_new_tokens=10))


def _cached(bm: HybridBlockManager, n: int = 41) -> list[list[int]]:
    """A sequence of n tokens that computed n - 1 and was freed: each group's chain of cached blocks."""
    a = _seq(n)
    bm.allocate(a)
    a.num_computed_tokens = n - 1
    bm.register_computed(a)
    chains = [list(v.block_table) for v in bm.views(a)]
    bm.free_seq(a)
    assert bm.num_free_blocks == bm.num_blocks
    return chains


def _evict(bm, bid: int) -> None:
    bm.free.move_to_end(bid, last=False)
    assert bm.groups[0]._take_free() == bid
    bm.groups[0]._release(bm.blocks[bid])


def test_each_group_holds_its_blocks_and_the_sliding_one_frees_behind_its_window():
    bm = HybridBlockManager(100, 4, True, [0, 16], step_tokens=8)
    assert bm.window_cap(150) == 38 + 7 and bm.num_blocks == 99
    a = _seq(41)
    bm.allocate(a)
    assert len(a.block_table) == len(bm.views(a)[1].block_table) == 11 and bm.num_used_blocks == 22
    a.num_computed_tokens = 40
    bm.free_behind(a)
    view = bm.views(a)[1]
    assert view.num_freed_blocks == 6 and view.block_table[:6] == [bm.placeholder] * 6
    assert a.num_freed_blocks == 0 and bm.num_used_blocks == 11 + 5
    assert bm.slots_needed(a, 45) == 2
    bm.grow(a, 45)
    bm.free_seq(a)
    assert bm.num_free_blocks == bm.num_blocks and not set(a.block_table) | set(view.block_table)


def test_a_prefix_hit_holds_for_every_group():
    """The full group's contiguous hit, each sliding group's window hit capped at it, the least of them: a sliding
    block evicted before the window leaves the whole hit; one in the window shortens it for both; a full group's
    block evicted caps the sliding group's too."""
    bm = HybridBlockManager(100, 4, True, [0, 16], step_tokens=8)
    full, slide = _cached(bm)
    _evict(bm, slide[0])
    b = _seq(41)
    bm.allocate(b, budget=8)
    view = bm.views(b)[1]
    assert b.num_computed_tokens == 40 and b.block_table == full[:10] + b.block_table[10:]
    assert view.num_freed_blocks == 6 and view.block_table[6:10] == slide[6:10]
    assert bm.prefix_hits == 40
    bm.free_seq(b)
    _evict(bm, slide[8])
    c = _seq(41)
    bm.allocate(c, budget=8)
    assert c.num_computed_tokens == 32 and c.block_table[:8] == full[:8]
    assert bm.views(c)[1].block_table[4:8] == slide[4:8]
    bm.free_seq(c)
    _evict(bm, full[2])
    d = _seq(41)
    bm.allocate(d, budget=8)
    assert d.num_computed_tokens == 0  # (the sliding group's hit from the start stops at its evicted block 0)
    bm.free_seq(d)
    assert bm.num_free_blocks == bm.num_blocks


def test_every_groups_hits_are_claimed_before_any_group_takes_a_free_block():
    """The full group's last hit block first in the free list: the sliding group's new block (taken before, a
    group at a time) was that block, then in both tables (their layers in the same storage slot)."""
    bm = HybridBlockManager(100, 4, True, [0, 16], step_tokens=8)
    full, slide = _cached(bm)
    bm.free.move_to_end(full[9], last=False)
    b = _seq(41)
    bm.allocate(b, budget=8)
    tables = [set(v.block_table) - {bm.placeholder} for v in bm.views(b)]
    assert b.num_computed_tokens == 40 and full[9] in tables[0] and not tables[0] & tables[1]
    bm.free_seq(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_keys_of_different_groups_never_meet():
    bm = HybridBlockManager(100, 4, True, [0, 16, 16], step_tokens=8)
    chains = _cached(bm, 21)
    probe = _seq(21)
    key = block_key(probe, 0, 4)
    assert [bm.hash_to_block[key + bytes([g]) if g else key] for g in range(3)] == [c[0] for c in chains]


# ----------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tokens_and_logprobs_equal_transformers_with_freed_blocks_nan(tmp_path, monkeypatch, family):
    """Prompts of 5 and 50 tokens and 30 generated (far past the window of 16), chunked prefill of 8: tokens
    transformers', logprobs the engine's that keeps every block; the sliding groups' tables hold at most 7 blocks,
    the freed blocks and the placeholder NaN."""
    from infer import LLM
    hf = build(tmp_path, family)
    prompts = random_prompts((5, 50))
    want = greedy_each(hf, prompts, 30)
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=3, enable_prefix_caching=False)
    with LLM(str(tmp_path), **kw) as llm:
        assert isinstance(llm.engine.block_manager, HybridBlockManager)
        _poison(llm)
        held = _held(llm)
        tokens, logprobs = _run(llm, prompts, 30)
        assert tokens == want and max(held) <= 7
        assert llm.engine.stats()["kv_blocks_freed_window"] > 0 and llm.engine.block_manager.num_used_blocks == 0
    _no_groups(monkeypatch)
    with LLM(str(tmp_path), **kw) as llm:
        assert not isinstance(llm.engine.block_manager, HybridBlockManager)
        old_tokens, old_logprobs = _run(llm, prompts, 30)
    assert old_tokens == want
    assert [lp == pytest.approx(o, abs=1e-4) for lp, o in zip(logprobs, old_logprobs)] == [True] * 2


def test_preemption_with_the_prefix_cache(tmp_path):
    """40 blocks of 2 layers (Gemma 2): three sequences of 5..12 + 60 tokens (each up to 20 blocks of the full
    group and 7 of the sliding one) preempt each other in turn, a resumed one finding its blocks in the prefix cache
    (each group's hits claimed before any group takes a free block): tokens transformers'."""
    from infer import LLM
    hf = build(tmp_path, "gemma2", seed=4)
    prompts = random_prompts((5, 8, 12), seed=9)
    want = greedy_each(hf, prompts, 60)
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4, max_model_len=80)
    with LLM(str(tmp_path), num_kv_blocks=40, **kw) as llm:
        assert _run(llm, prompts, 60)[0] == want
        assert llm.engine.stats()["num_preemptions"] > 0


def test_prefix_cache_hits_past_evicted_sliding_blocks(tmp_path):
    """A 90-token prompt run twice finds 88 tokens; then with the sliding groups' first blocks evicted (NaN) it
    still finds 88 (their window needs none of them); tokens transformers' each time."""
    from infer import LLM
    hf = build(tmp_path, "gemma3", seed=1)
    prompt = random_prompts((90,), seed=4)[0]
    want = greedy_each(hf, [prompt], 12)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=2, num_kv_blocks=600) as llm:
        bm = llm.engine.block_manager
        assert _run(llm, [prompt], 12)[0] == want
        out = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
        assert out.num_cached_tokens == 88 and out.token_ids == want[0]
        probe = Sequence("p", prompt, SamplingParams())
        gone = [bm.hash_to_block[block_key(probe, i, 4) + bytes([g])] for g in range(1, 6) for i in range(4)]
        for bid in gone:
            _evict(bm, bid)
        cache = llm.engine.runner.kv_cache
        cache[:, :, gone] = float("nan")
        bm.fresh = [b for b in bm.fresh if b not in gone]
        out = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
        assert out.num_cached_tokens == 88 and out.token_ids == want[0]
        llm.engine.reset_prefix_cache()
        out = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
        assert out.num_cached_tokens == 0 and out.token_ids == want[0]


def test_n_samples_beam_search_and_ngram_drafts_equal_keeping_every_block(tmp_path, monkeypatch):
    """n = 3 seeded samples (sharing their prompt's blocks), a beam search of width 2 and n-gram speculation: the
    same as the engine that keeps every block; greedy n-gram tokens transformers'."""
    from infer import LLM, BeamSearchParams
    hf = build(tmp_path, "qwen2", seed=3)
    prompt = random_prompts((40,), seed=8)[0]
    base = random_prompts((20,), seed=5)[0]
    repeat = base * 3
    want = greedy_each(hf, [repeat], 40)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4)

    def run():
        with LLM(str(tmp_path), **kw) as llm:
            samples = [o.token_ids for o in llm.generate([prompt], SamplingParams(
                n=3, max_new_tokens=30, temperature=1.0, seed=7, ignore_eos=True))[0].outputs]
            beams = [(s.tokens, round(s.cum_logprob, 4)) for s in
                     llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=30))[0].sequences]
            freed = llm.engine.stats().get("kv_blocks_freed_window", 0)
        with LLM(str(tmp_path), speculative_config=spec, **kw) as llm:
            if isinstance(llm.engine.block_manager, HybridBlockManager):
                _poison(llm)
            drafted = _run(llm, [repeat], 40)[0]
        return samples, beams, drafted, freed
    samples, beams, drafted, freed = run()
    assert drafted == want and freed > 0
    _no_groups(monkeypatch)
    assert run()[:3] == (samples, beams, drafted)


def test_gpu_path_interpreted_equals_transformers(tmp_path, monkeypatch):
    """Triton kernels interpreted: each layer's group table and slots in the prefill and decode kernels, decodes
    through emulated CUDA graphs (per-group static tables), the rest through emulated piecewise graphs (per-group
    static slots); the placeholder and the freed blocks NaN: transformers' tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels")
    from infer import LLM
    from quant_helpers import int4_kernel_path
    hf = build(tmp_path, "gemma2", seed=2)
    prompts = random_prompts((30, 9), seed=6)
    want = greedy_each(hf, prompts, 16)
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path), block_size=4, max_model_len=64, max_num_batched_tokens=CHUNK, max_num_seqs=2,
             cuda_graph_max_tokens=8, enable_prefix_caching=False) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        assert llm.engine.runner.pieces is not None
        _poison(llm)
        assert _run(llm, prompts, 16)[0] == want
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
        assert llm.engine.stats()["piecewise_graph_steps"] > 0 and llm.engine.stats()["kv_blocks_freed_window"] > 0
