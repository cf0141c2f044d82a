"""Session 55: a model whose every layer slides over one window (Mistral, Phi-3, a Qwen2/Qwen3 whose layers all
slide) frees each running sequence's KV blocks that no future query reads (a block whose last position is before
its next query's position - window + 1: the kernels read kv > q - window only), back to the pool (cached ones
keep their hash), its table entries pointing at a placeholder block; admission gives a windowed sequence blocks
for its first step only; the memory plan counts a sequence's blocks as those of its window and a step. Tiny
Mistral / Phi-3 models of window 16 in blocks of 4, prompts and generations far past the window: greedy tokens
equal transformers' and the blocks a sequence holds stay bounded, on the CPU path and the GPU path (interpreted),
with chunked prefill, prefix caching, n-gram speculation, beam search, preemption, fp8 KV and prompt_logprobs."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from infer.engine.block_manager import BlockManager
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler
from infer.engine.sequence import Sequence

from helpers import greedy_each, norms_and_biases_shifted, save_random_model

from test_scheduler_property import World, _sequence, drive, lora_model, requests  # noqa: F401 (lora_model: a fixture)

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=160, vocab_size=512, eos_token_id=2, pad_token_id=0)
FAMILIES = {"mistral": ("mistral", "MistralForCausalLM", dict(sliding_window=16)),
            "phi3": ("phi3", "Phi3ForCausalLM", dict(sliding_window=16)),
            "qwen2-layer-1-slides": ("qwen2", "Qwen2ForCausalLM",
                                     dict(use_sliding_window=True, sliding_window=16, max_window_layers=1))}
CHUNK = 8  # max_num_batched_tokens of the windowed runs: a sequence holds ceil((16 + 8) / 4) + 1 = 7 blocks at most


def build(folder, family: str, seed: int = 0, window: bool = True):
    """A random model folder of `family` (float32, norms and biases random) with the tiny-llama tokenizer, and
    transformers' model of it (eager attention)."""
    model_type, arch, config = FAMILIES[family]
    if not window:
        config = {**config, "sliding_window": None}
    return save_random_model(folder, model_type, arch, {**SMALL, **config}, seed, norms_and_biases_shifted)


hf_greedy = greedy_each


def random_prompts(lengths, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _generate(llm, prompts, n, **kw):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, **kw))]


@pytest.fixture
def held(monkeypatch):
    """The most blocks any running sequence held after each schedule (its table less the placeholder entries), and a
    check that the placeholder entries are exactly each table's first num_freed_blocks."""
    most = []
    real = Scheduler.schedule

    def schedule(self):
        batch = real(self)
        bm = self.bm
        for s in self.running:
            table = s.block_table
            assert all(b == bm.placeholder for b in table[:s.num_freed_blocks])
            assert bm.placeholder not in table[s.num_freed_blocks:]
        most.append(max((len(s.block_table) - s.num_freed_blocks for s in self.running), default=0))
        return batch
    monkeypatch.setattr(Scheduler, "schedule", schedule)
    return most


def _poison_placeholder(llm) -> None:
    """The placeholder block NaN (never zeroed): a kernel that read it unmasked would spread NaN."""
    engine = llm.engine
    bm = engine.block_manager
    assert bm.placeholder >= 0
    bm.fresh = [b for b in bm.fresh if b != bm.placeholder]
    cache = engine.runner.kv_cache
    if cache.element_size() == 1:
        cache.view(torch.uint8)[:, :, bm.placeholder] = 0x7F  # (a float8 NaN)
    else:
        cache[:, :, bm.placeholder] = float("nan")


def _no_window(monkeypatch):
    """Engines built after this keep every block (the window's freeing off), as before session 55."""
    import infer.engine.llm_engine as le
    import infer.memory.plan as plan
    for module in (le, plan):
        monkeypatch.setattr(module, "kv_window", lambda *a, **k: (0, 0))


# ----------------------------------------------------------------------------------------------- block manager
def _seq(n: int) -> Sequence:
    return Sequence("r", list(range(3, 3 + n)), SamplingParams(max_new_tokens=10))


def test_free_behind_frees_exactly_the_blocks_before_the_first_read_position():
    """Window 16, blocks of 4: with f tokens computed the next query is at f and reads keys f - 15..f, so blocks
    0..(f - 15) // 4 - 1 are freed and the block holding key f - 15 kept (for every f)."""
    for f in range(1, 60):
        bm = BlockManager(40, 4, enable_prefix_caching=False, window=16, step_tokens=4)
        seq = _seq(f + 1)
        bm.allocate(seq)
        seq.num_computed_tokens = f
        bm.free_behind(seq)
        first = f - 16 + 1
        freed = max(0, first) // 4
        assert seq.num_freed_blocks == freed
        assert seq.block_table[:freed] == [bm.placeholder] * freed
        if first > 0:  # the block holding the first key read is kept
            assert seq.block_table[first // 4] != bm.placeholder
        assert bm.num_free_blocks == bm.num_blocks - (len(seq.block_table) - freed)
        bm.free_seq(seq)
        assert bm.num_free_blocks == bm.num_blocks


def test_freed_blocks_stay_cached_and_a_hit_takes_only_the_window():
    """Prefix caching: blocks freed behind the window keep their hash (evictable, at the LRU end); a later request of
    the same prompt finds the whole prefix but takes only the blocks from its window on (the others: the
    placeholder), and its admission counts only those."""
    bm = BlockManager(40, 4, enable_prefix_caching=True, window=16, step_tokens=8)
    a = _seq(41)
    bm.allocate(a)
    a.num_computed_tokens = 40
    bm.register_computed(a)
    bm.free_behind(a)
    assert a.num_freed_blocks == (40 - 15) // 4 == 6
    freed = [bm.blocks[b] for b in bm.free if bm.blocks[b].hash is not None]
    assert len(freed) == 6
    b = _seq(41)
    assert bm.can_allocate(b, budget=8)
    bm.allocate(b, budget=8)
    assert b.num_computed_tokens == 40 and b.num_freed_blocks == 6
    assert b.block_table[:6] == [bm.placeholder] * 6 and len(b.block_table) == 11
    bm.free_seq(b)
    bm.free_seq(a)
    assert bm.num_free_blocks == bm.num_blocks


def test_window_cap_and_admission_of_a_long_prompt():
    """A windowed sequence's admission takes blocks for the tokens its first step computes (not its whole prompt),
    and window_cap bounds what it holds."""
    bm = BlockManager(10, 4, enable_prefix_caching=False, window=16, step_tokens=8)
    assert bm.num_blocks == 9 and bm.placeholder == 9 and bm.fresh == [9]
    assert bm.window_cap(200) == 7 and bm.window_cap(8) == 2
    seq = _seq(100)
    assert bm.can_allocate(seq, budget=8)
    bm.allocate(seq, budget=8)
    assert len(seq.block_table) == 2
    plain = BlockManager(10, 4, enable_prefix_caching=False)
    assert plain.window_cap(200) == 50 and not plain.can_allocate(_seq(100), budget=8)


# ----------------------------------------------------------------------------------------------- engines
@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_greedy_tokens_equal_transformers_with_bounded_blocks(tmp_path, family, held):
    """Prompts of 5, 40 and 100 tokens and 50 generated (up to 150 positions, far past the window of 16), chunked
    prefill in steps of 8 tokens: tokens transformers', each sequence holding at most 7 blocks at once (without
    the freeing the longest holds 38), the placeholder NaN (never read); every block back at the end."""
    from infer import LLM
    hf = build(tmp_path, family)
    prompts = random_prompts((5, 40, 100))
    want = hf_greedy(hf, prompts, 50)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=3) as llm:
        bm = llm.engine.block_manager
        assert bm.window == 16 and bm.window_cap(150) == 7
        _poison_placeholder(llm)
        assert _generate(llm, prompts, 50) == want
        assert max(held) <= 7
        assert bm.num_used_blocks == 0 and llm.engine.stats()["kv_blocks_freed_window"] > 0


def test_mixed_layers_keep_every_block(tmp_path, held):
    """A Qwen2 whose first layer attends fully: its full layer's table (the first group's, Sequence.block_table)
    keeps every block; the sliding layers' tables (session 56's groups: test_probes_session56_hybrid2) free theirs."""
    from infer import LLM
    hf = build(tmp_path, "qwen2-layer-1-slides")
    prompts = random_prompts((60,))
    want = hf_greedy(hf, prompts, 20)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4) as llm:
        assert llm.engine.block_manager.windows == [0, 16]
        assert _generate(llm, prompts, 20) == want
        assert max(held) == 20 and llm.engine.stats()["kv_blocks_freed_window"] > 0


def test_prefix_caching_of_a_repeated_long_prompt(tmp_path, held):
    """A 90-token prompt run twice: the second finds its blocks (freed behind the first's window, cached) and
    takes only its window's; its tokens are transformers'; a third run after a reset of the cache computes all."""
    from infer import LLM
    hf = build(tmp_path, "mistral", seed=1)
    prompt = random_prompts((90,), seed=4)[0]
    want = hf_greedy(hf, [prompt], 30)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4, num_kv_blocks=40) as llm:
        assert _generate(llm, [prompt], 30) == want
        out = llm.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
        assert out.token_ids == want[0] and out.num_cached_tokens == 88
        assert max(held) <= 7
        llm.engine.reset_prefix_cache()
        assert _generate(llm, [prompt], 30) == want


def test_prefix_hit_stops_at_an_evicted_block(tmp_path):
    """A pool of 20 blocks: the first run's freed blocks (cached, oldest first) are reused by a second prompt, so a
    rerun of the first finds only what is left cached (a hit needs every block its window reads: session 56's
    test_probes_session56_hybrid), and computes the rest: still transformers'."""
    from infer import LLM
    hf = build(tmp_path, "mistral", seed=1)
    p1, p2 = random_prompts((60, 60), seed=6)
    want = hf_greedy(hf, [p1, p2], 20)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4, num_kv_blocks=21,
             max_model_len=80) as llm:
        assert _generate(llm, [p1], 20) == want[:1]
        assert _generate(llm, [p2], 20) == want[1:]
        out = llm.generate([p1], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
        assert out.token_ids == want[0] and out.num_cached_tokens < 60 - 16


def test_ngram_speculative_decoding(tmp_path, held):
    """n-gram drafts (rejected ones rolled back): transformers' tokens, blocks bounded by the window, a step's
    tokens and the lookahead (ceil((16 + 8 + 3) / 4) + 1 = 8)."""
    from infer import LLM
    hf = build(tmp_path, "mistral", seed=2)
    base = random_prompts((20, 30), seed=5)
    prompts = [base[0] * 3, base[1] + base[1][:20]]  # repeats for the drafter
    want = hf_greedy(hf, prompts, 60)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4, speculative_config=spec) as llm:
        _poison_placeholder(llm)
        assert llm.engine.block_manager.window_cap(200) == 8
        assert _generate(llm, prompts, 60) == want
        assert max(held) <= 8 and llm.engine.stats()["kv_blocks_freed_window"] > 0


def test_beam_search_equals_the_engine_that_keeps_every_block(tmp_path, monkeypatch):
    """Beam search (its beams' shared prefixes from the prefix cache, blocks freed behind each beam's window) gives
    the beams of the engine that keeps every block."""
    from infer import LLM, BeamSearchParams
    build(tmp_path, "phi3", seed=3)
    prompt = random_prompts((40,), seed=8)[0]
    params = BeamSearchParams(beam_width=2, max_tokens=30)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4) as llm:
        got = [(s.tokens, round(s.cum_logprob, 4)) for s in llm.beam_search([prompt], params)[0].sequences]
        assert llm.engine.stats()["kv_blocks_freed_window"] > 0
    _no_window(monkeypatch)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4) as llm:
        assert llm.engine.block_manager.window == 0
        want = [(s.tokens, round(s.cum_logprob, 4)) for s in llm.beam_search([prompt], params)[0].sequences]
    assert got == want


def test_preemption_in_a_pool_that_fits_only_because_blocks_are_freed(tmp_path, monkeypatch, held):
    """12 blocks (11 for sequences) of 4 tokens: three sequences of 5 + 100 tokens run (preempted and resumed in
    turn), tokens transformers'; the engine that keeps every block cannot take a sequence of that length at all."""
    from infer import LLM
    from infer.errors import InferError
    hf = build(tmp_path, "mistral", seed=4)
    prompts = random_prompts((5, 8, 12), seed=9)
    want = hf_greedy(hf, prompts, 100)
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4, num_kv_blocks=12, max_model_len=120)
    with LLM(str(tmp_path), **kw) as llm:
        assert _generate(llm, prompts, 100) == want
        assert llm.engine.stats()["num_preemptions"] > 0 and max(held) <= 7
    _no_window(monkeypatch)
    with pytest.raises(InferError):
        with LLM(str(tmp_path), **kw) as llm:
            _generate(llm, prompts, 100)


def test_more_sequences_fit_at_long_context(tmp_path, monkeypatch, held):
    """31 blocks (30 for sequences, one sequence of 120 tokens): three sequences of 5 + 100 tokens run at once
    without a preemption (each holds at most 7 blocks); the engine that keeps every block preempts them in turn
    (27 blocks each). Tokens transformers' both ways."""
    from infer import LLM
    hf = build(tmp_path, "mistral", seed=4)
    prompts = random_prompts((5, 8, 12), seed=9)
    want = hf_greedy(hf, prompts, 100)
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4, num_kv_blocks=31, max_model_len=120)
    with LLM(str(tmp_path), **kw) as llm:
        assert _generate(llm, prompts, 100) == want
        assert llm.engine.stats()["num_preemptions"] == 0 and max(held) <= 7
    _no_window(monkeypatch)
    with LLM(str(tmp_path), **kw) as llm:
        assert _generate(llm, prompts, 100) == want
        assert llm.engine.stats()["num_preemptions"] > 0


def test_fp8_kv_and_prompt_logprobs_equal_the_engine_that_keeps_every_block(tmp_path, monkeypatch):
    """fp8 KV (its placeholder a float8 NaN) and a long prompt's prompt_logprobs: the same tokens and logprobs as the
    engine that keeps every block."""
    from infer import LLM
    build(tmp_path, "phi3", seed=5)
    prompts = random_prompts((70, 30), seed=10)
    kw = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4, kv_cache_dtype="fp8")

    def run():
        with LLM(str(tmp_path), **kw) as llm:
            if llm.engine.block_manager.window:
                _poison_placeholder(llm)
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True, prompt_logprobs=1))
            return [(o.token_ids, [r and round(r["logprob"], 4) for r in (o.prompt_logprobs or [])]) for o in outs]
    got = run()
    _no_window(monkeypatch)
    assert run() == got


@pytest.mark.parametrize("family", ["mistral"])
def test_the_gpu_path_frees_blocks_and_equals_transformers(tmp_path, monkeypatch, family, held):
    """The GPU code path on CPU (every op its Triton kernel, interpreted; decodes through emulated CUDA graphs of
    fixed-width tables, the others piecewise; the overlapped step), the placeholder NaN: tokens transformers',
    blocks bounded."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels")
    from infer import LLM
    from quant_helpers import int4_kernel_path
    hf = build(tmp_path, family)
    prompts = random_prompts((5, 40), seed=7)
    want = hf_greedy(hf, prompts, 40)
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=2, overlap=True,
             cuda_graph_max_tokens=4) as llm:
        llm.engine.runner.capture_graphs(96, emulate=True)
        _poison_placeholder(llm)
        assert _generate(llm, prompts, 40) == want
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
        assert max(held) <= 7 and llm.engine.stats()["kv_blocks_freed_window"] > 0


# ----------------------------------------------------------------------------------------------- memory plan
def test_memory_plan_counts_a_windowed_sequence_by_its_window(tmp_path):
    """The plan of a windowed model counts a sequence of 4096 tokens as the blocks of its window and a step (+1),
    the same model without a window as all 4096 / 4: more sequences fit, any length at a concurrency that fits."""
    from transformers import AutoConfig
    from infer.engine.config import EngineConfig
    from infer.memory.plan import make_plan
    cfg = AutoConfig.for_model("mistral", **{**SMALL, "max_position_embeddings": 8192, "sliding_window": 256})
    plain = AutoConfig.for_model("mistral", **{**SMALL, "max_position_embeddings": 8192, "sliding_window": None})
    ec = EngineConfig("tiny-llama", block_size=4, max_num_batched_tokens=64, device="cpu")
    dev = torch.device("cpu")
    windowed = make_plan(ec, cfg, torch.float32, dev, 10**6, 10**6, 4096, 8, 8192, budget=10_300_000)
    full = make_plan(ec, plain, torch.float32, dev, 10**6, 10**6, 4096, 8, 8192, budget=10_300_000)
    assert windowed.kv_blocks == full.kv_blocks
    assert windowed.blocks_for(4096) == (256 + 64) // 4 + 1 and full.blocks_for(4096) == 1024
    assert windowed.max_concurrency_at_max_length > full.max_concurrency_at_max_length
    assert windowed.fits and windowed.max_length_at_concurrency == 8192


def test_kv_window_with_a_draft_model():
    """Draft-model speculation reads its own KV in the same blocks from its first stale slot: freed behind the larger
    window with its catch-up token counted, and not at all where the draft attends fully or its context ends
    before max_length (its KV stops moving there)."""
    from transformers import AutoConfig
    from infer.engine.config import EngineConfig
    from infer.memory.sizes import kv_window
    target = AutoConfig.for_model("mistral", **{**SMALL, "sliding_window": 16})
    ec = EngineConfig("tiny-llama", block_size=4, max_num_batched_tokens=8, max_num_seqs=4, device="cpu",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                          "prompt_lookup_min": 2})
    assert kv_window(ec, target, 160) == (16, 8 + 3)
    assert kv_window(ec, target, 160, AutoConfig.for_model("mistral", **{**SMALL, "sliding_window": 32})) \
        == (32, 8 + 3 + 1)
    assert kv_window(ec, target, 160, AutoConfig.for_model("llama", **SMALL)) == (0, 0)
    short = AutoConfig.for_model("mistral", **{**SMALL, "sliding_window": 16, "max_position_embeddings": 100})
    assert kv_window(ec, target, 160, short) == (0, 0)
    plain = AutoConfig.for_model("mistral", **{**SMALL, "sliding_window": None})
    assert kv_window(ec, plain, 160) == (0, 0)


def test_data_parallel_validation_and_metrics_know_the_window():
    """The data-parallel driver validates a request against a replica's pool as LLMEngine does (window_cap: its
    block manager stand-in had no such method), the placeholder out of the pool; /metrics counts the freed
    blocks of a windowed engine (and names no such counter for the others)."""
    from infer.parallel.serve_engine import _Blocks
    from infer.serve.metrics import _EngineCollector
    windowed, plain = _Blocks(12, 4, 16, 8), _Blocks(12, 4)
    assert (windowed.num_blocks, windowed.window_cap(120)) == (11, 7)
    assert (plain.num_blocks, plain.window_cap(120)) == (12, 30)
    names = {m.name for m in _EngineCollector(lambda: {"kv_blocks_freed_window": 5}, ["m", "0"]).collect()}
    assert "infer:kv_cache_window_freed_blocks" in names
    names = {m.name for m in _EngineCollector(lambda: {}, ["m", "0"]).collect()}
    assert "infer:kv_cache_window_freed_blocks" not in names


def test_warmup_estimate_of_a_windowed_model_fits_more_sequences(tmp_path):
    """`infer warmup --estimate` of a Mistral of window 16 counts a sequence of 160 tokens as 9 blocks (16 + a step of
    16 tokens, in blocks of 4, + 1) where the same model without a window counts 40: more sequences fit."""
    import json
    from typer.testing import CliRunner
    from infer.cli.main import app
    got = {}
    for window in (True, False):
        folder = tmp_path / str(window)
        folder.mkdir()
        build(folder, "mistral", window=window)
        res = CliRunner().invoke(app, ["warmup", str(folder), "--estimate", "--json", "--max-length", "160",
                                       "--concurrency", "4", "--max-num-batched-tokens", "16", "--block-size", "4",
                                       "--memory-limit", "40MB"])
        assert res.exit_code == 0, res.output
        got[window] = json.loads(res.output.strip().splitlines()[-1])
    assert (got[True]["window_blocks"], got[False]["window_blocks"]) == (9, 0)
    assert got[True]["max_concurrency_at_max_length"] > got[False]["max_concurrency_at_max_length"]


def test_draft_model_speculation_frees_behind_the_draft_kv(tmp_path, held):
    """Draft-model speculation with the model as its own draft (its KV in the same blocks, read from its first
    stale slot): transformers' tokens, blocks freed (bounded by the window, a step, the lookahead and the draft's
    catch-up token), every block back at the end; a repeated prompt's prefix hit too."""
    from infer import LLM
    hf = build(tmp_path, "mistral", seed=6)
    prompts = random_prompts((30, 70), seed=11)
    want = hf_greedy(hf, prompts, 50)
    spec = {"model": str(tmp_path), "num_speculative_tokens": 2}
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=4,
             speculative_config=spec) as llm:
        bm = llm.engine.block_manager
        assert bm.draft_reads and bm.window == 16 and bm.window_cap(200) == 8
        assert _generate(llm, prompts, 50) == want
        assert _generate(llm, prompts[1:], 50) == want[1:]
        assert max(held) <= 8 and llm.engine.stats()["kv_blocks_freed_window"] > 0 and bm.num_used_blocks == 0


# ----------------------------------------------------------------------------------------------- property


class WindowWorld(World):
    """test_scheduler_property's world with a windowed block manager: the invariants hold for the blocks a sequence
    holds (past its placeholder entries), no block a future query reads is ever freed, none holds more than
    window_cap, and every block comes back."""

    def __init__(self, model, paths, block_size, num_blocks, caching, max_num_seqs, max_tokens, window):
        super().__init__(model, paths, block_size, num_blocks, caching, max_num_seqs, max_tokens)
        self.bm = BlockManager(num_blocks, block_size, caching, window=window, step_tokens=max_tokens)
        self.sched.bm = self.bm
        schedule = self.sched.schedule

        def checked():  # the step's queries start at each sequence's computed tokens: none of its reads freed
            batch = schedule()
            for seq in self.sched.running:
                first = max(0, seq.num_computed_tokens - self.bm.window + 1)
                assert seq.num_freed_blocks * self.bm.block_size <= first, "a block the step reads was freed"
            return batch
        self.sched.schedule = checked

    def check(self) -> None:
        bm, running = self.bm, self.sched.running
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        refs = [0] * bm.num_blocks
        for seq in running:
            freed = seq.num_freed_blocks
            assert seq.block_table[:freed] == [bm.placeholder] * freed
            assert len(seq.block_table) - freed <= bm.window_cap(seq.max_total_len)
            for bid in seq.block_table[freed:]:
                refs[bid] += 1
        for block in bm.blocks:
            assert block.ref_count == refs[block.block_id], "reference count differs from the block tables"
            assert (block.ref_count == 0) == (block.block_id in bm.free)
        for seq in self.seqs:
            if seq.status.value != "running":
                assert not seq.block_table
        for seq in running:
            bs, tokens = bm.block_size, seq.all_token_ids
            for i in range(seq.num_freed_blocks, -(-seq.num_computed_tokens // bs)):
                end = min((i + 1) * bs, seq.num_computed_tokens)
                assert self.written.get(seq.block_table[i]) == (seq.lora, tuple(tokens[:end]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 12),
       caching=st.booleans(), max_num_seqs=st.integers(1, 6), max_tokens=st.integers(1, 16),
       window=st.sampled_from([2, 3, 5, 8]))
def test_random_workloads_under_a_window_keep_invariants_and_finish(lora_model, reqs, block_size, extra_blocks,
                                                                    caching, max_num_seqs, max_tokens, window):
    seqs = [_sequence(i, r) for i, r in enumerate(reqs)]
    max_tokens = max(max_tokens, max_num_seqs)
    probe = BlockManager(2, block_size, window=window, step_tokens=max_tokens)
    need = max(probe.window_cap(s.max_total_len) for s in seqs)  # (the engine refuses a request above the pool)
    w = WindowWorld(*lora_model, block_size, need + extra_blocks + 1, caching, max_num_seqs, max_tokens, window)
    drive(w, seqs, reqs)
    assert w.bm.num_used_blocks == 0
