"""Session 57: KV layer groups (engine.hybrid_blocks: the sliding groups free their blocks behind the window) with
speculative decoding. A draft model's or an EAGLE head's KV has a slot in every pool block and is read through the
first full group's table (never freed), so its catch-up and drafts read no sliding group's block. Tiny mixed-layer
models of window 16 in blocks of 4, far past the window: greedy tokens transformers' with a draft model (itself of
mixed layers, or a Llama) and an EAGLE-3 head, the freed blocks NaN in both caches, every draft of the target as its
own draft accepted, the same drafts accepted as the engine that keeps every block, prefix-cache hits (the EAGLE
head's last block computed again); the memory plan and `infer warmup --estimate` count the groups and the draft's
KV in each block."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from infer import LLM
from infer.engine.hybrid_blocks import HybridBlockManager
from infer.engine.sampling_params import SamplingParams

from helpers import greedy_each, save_random_model

from test_probes_session55_swblocks import CHUNK, random_prompts
from test_probes_session56_eagle import save_eagle3
from test_probes_session56_hybrid2 import BASE, _held, _no_groups, _poison, build, nan_where_freed

K = 3
KW = dict(block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=3)
NO_CACHE = dict(enable_prefix_caching=False)  # (the poisoned runs: a freed block no prefix hit may take back)


def _draft_spec(folder, k: int = K) -> dict:
    return {"model": str(folder), "num_speculative_tokens": k}


def _poison_draft(llm) -> None:
    """The draft's KV NaN at the placeholder and at every block a sliding group frees while no one holds it (as
    _poison does the target's): a proposal that read one would draft from NaN."""
    nan_where_freed(llm.engine.block_manager, llm.engine.drafter.kv_cache)


def _run(llm, prompts, n):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))]


def _spec_run(folder, spec, prompts, n, poison: bool, **kw):
    """(tokens, accepted drafts, drafts, blocks freed behind the window, the sliding tables' most blocks)."""
    with LLM(str(folder), speculative_config=spec, **{**KW, **kw}) as llm:
        grouped = isinstance(llm.engine.block_manager, HybridBlockManager)
        held = []
        if grouped and poison:
            _poison(llm)
            _poison_draft(llm)
            held = _held(llm)
        tokens = _run(llm, prompts, n)
        s = llm.engine.stats()
        assert llm.engine.block_manager.num_used_blocks == 0
        return (tokens, s["spec_decode_num_accepted_tokens"], s["spec_decode_num_draft_tokens"],
                s.get("kv_blocks_freed_window", 0) if grouped else None, held)


# ----------------------------------------------------------------------------------------------- a draft model
def _llama_draft(folder):
    """A Llama of the target's vocabulary (every layer full attention) as the draft."""
    cfg = dict(BASE, num_hidden_layers=2, max_position_embeddings=256)
    save_random_model(folder, "llama", "LlamaForCausalLM", cfg, seed=5)
    return folder


@pytest.mark.parametrize("family, draft", [("gemma2", "self"), ("gemma3", "self"), ("gemma3", "llama")])
def test_a_draft_model_on_a_mixed_target_frees_window_blocks_and_equals_transformers(tmp_path, monkeypatch,
                                                                                    family, draft):
    """Prompts of 5 and 50 tokens, 30 generated, chunks of 8, 3 drafts: the sliding groups free blocks and hold at
    most 8 (a step of 8 + 3 tokens), those blocks and the placeholder NaN in the target's and the draft's KV: tokens
    transformers'; the target as its own draft (mixed layers too) has every draft accepted; the drafts accepted are
    the engine's that keeps every block."""
    hf = build(tmp_path / "t", family)
    folder = tmp_path / "t" if draft == "self" else _llama_draft(tmp_path / "d")
    prompts = random_prompts((5, 50))
    want = greedy_each(hf, prompts, 30)
    spec = _draft_spec(folder)
    tokens, accepted, drafted, freed, held = _spec_run(tmp_path / "t", spec, prompts, 30, True, **NO_CACHE)
    assert tokens == want and freed > 0 and 0 < max(held) <= 8 and drafted > 0
    if draft == "self":
        assert accepted == drafted
    _no_groups(monkeypatch)
    old = _spec_run(tmp_path / "t", spec, prompts, 30, False, **NO_CACHE)
    assert old[0] == want and old[3] is None and old[1:3] == (accepted, drafted)


def test_a_draft_models_prefix_cache_hits(tmp_path, monkeypatch):
    """A 60-token prompt run, then again beside a longer one that shares it: the second finds the first's blocks
    (each group's, the draft's KV in the full group's), tokens transformers' and every draft of the target as its
    own draft accepted, as with every block kept."""
    hf = build(tmp_path, "gemma2", seed=1)
    prompt = random_prompts((60,), seed=4)[0]
    longer = prompt + random_prompts((9,), seed=5)[0]
    want = greedy_each(hf, [prompt, longer], 20)

    def run(grouped: bool):
        with LLM(str(tmp_path), speculative_config=_draft_spec(tmp_path), **KW) as llm:
            assert isinstance(llm.engine.block_manager, HybridBlockManager) == grouped
            assert _run(llm, [prompt], 20) == want[:1]
            outs = llm.generate([prompt, longer], SamplingParams(max_new_tokens=20, ignore_eos=True))
            assert [o.token_ids for o in outs] == want
            s = llm.engine.stats()
            assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"] > 0
            return [o.num_cached_tokens for o in outs], s.get("kv_blocks_freed_window", 0)
    cached, freed = run(True)
    assert freed > 0 and cached[0] == 56 and cached[1] >= 56
    _no_groups(monkeypatch)
    assert run(False) == (cached, 0)


# ----------------------------------------------------------------------------------------------- an EAGLE head
def test_an_eagle_head_on_a_mixed_target_equals_transformers_and_keeping_every_block(tmp_path, monkeypatch):
    """A Qwen2 whose layers 2.. slide (window 16) driven by an EAGLE-3 head: tokens transformers', the sliding
    groups' blocks freed (NaN, the head's KV too), the same drafts accepted as the engine that keeps every block;
    then a prompt run twice hits the cache (less its last block, which the head computes again) and accepts the
    same drafts as that engine."""
    hf = build(tmp_path / "t", "qwen2", seed=3)
    save_eagle3(tmp_path / "h", seed=1)
    spec = {"method": "eagle3", "model": str(tmp_path / "h"), "num_speculative_tokens": K}
    prompts = random_prompts((5, 50), seed=6)
    prompt = random_prompts((42,), seed=7)[0]
    want = greedy_each(hf, prompts + [prompt], 30)

    def run(grouped: bool):
        with LLM(str(tmp_path / "t"), speculative_config=spec, enable_prefix_caching=False, **KW) as llm:
            assert isinstance(llm.engine.block_manager, HybridBlockManager) == grouped
            if grouped:
                _poison(llm)
                _poison_draft(llm)
            tokens = _run(llm, prompts, 30)
            s = llm.engine.stats()
            first = (s["spec_decode_num_accepted_tokens"], s["spec_decode_num_draft_tokens"])
            freed = s.get("kv_blocks_freed_window", 0)
        with LLM(str(tmp_path / "t"), speculative_config=spec, **KW) as llm:
            again = [_run(llm, [prompt], 30)[0] for _ in range(2)]
            t = llm.engine.stats()
            second = (t["spec_decode_num_accepted_tokens"], t["spec_decode_num_draft_tokens"])
            return tokens, again, first, second, t["prefix_cache_hits"], freed
    tokens, again, first, second, hits, freed = run(True)
    assert tokens == want[:2] and again == [want[2]] * 2 and freed > 0 and first[1] > 0
    assert hits == 36  # (40 tokens cached, less the last block: the head pairs its last position with the next)
    _no_groups(monkeypatch)
    assert run(False)[:5] == (tokens, again, first, second, hits)


# ----------------------------------------------------------------------------------------------- the memory plan
def test_kv_groups_with_a_draft_where_they_hold_less():
    """With a draft (its KV in every pool block), groups where a sequence of max_length holds fewer bytes: at 100
    tokens (25 blocks, 8 of them a sliding group's) a Gemma 2 drafting itself holds (25 + 8) x (2 + 4) layers' blocks
    against 25 x (4 + 4); at 32 tokens (8 blocks, all of them the window's) 16 x 6 against 8 x 8: every block
    kept."""
    from infer.memory.sizes import kv_groups
    cfg = SimpleNamespace(model_type="gemma2", sliding_window=16, num_hidden_layers=4, hidden_size=64,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    engine = SimpleNamespace(max_num_batched_tokens=8, speculative_config={"num_speculative_tokens": 3}, block_size=4)
    assert kv_groups(engine, cfg, 100, draft_config=cfg) == kv_groups(engine, cfg, 100) == (2, [0, 16], 11)
    assert kv_groups(engine, cfg, 32) == (2, [0, 16], 11) and kv_groups(engine, cfg, 32, draft_config=cfg) is None


def test_the_engines_blocks_hold_a_group_and_the_draft(tmp_path):
    """The plan's block is a group's layers and the draft's every layer: the two caches the engine allocates."""
    build(tmp_path, "gemma3")
    with LLM(str(tmp_path), speculative_config=_draft_spec(tmp_path), **KW) as llm:
        plan, e = llm.engine.memory_plan, llm.engine
        assert plan.kv_groups == 6 and plan.full_groups == 1
        target, draft = e.runner.kv_cache, e.drafter.kv_cache
        assert target.shape[2] == draft.shape[2] == plan.kv_blocks
        per_block = (target[:, :, 0].numel() + draft[:, :, 0].numel()) * target.element_size()
        assert plan.kv_block_bytes == per_block and draft.shape[0] == 6 and target.shape[0] == 1


def test_warmup_estimate_with_a_draft_fits_more_sequences(tmp_path, monkeypatch):
    """`infer warmup --estimate` of the Gemma 2-shaped model drafting itself at 240 tokens: blocks of two layers of
    the target and the draft's four, a sequence 60 of them for its full group and 10 for its sliding one's window and
    a step (16 + 16 + 3 tokens, + 1), against 60 blocks of eight layers when every block is kept: more sequences
    fit."""
    from typer.testing import CliRunner
    from infer.cli.main import app
    build(tmp_path, "gemma2")
    args = ["warmup", str(tmp_path), "--estimate", "--json", "--max-length", "240", "--concurrency", "4",
            "--max-num-batched-tokens", "16", "--block-size", "4", "--memory-limit", "80MB",
            "--speculative-config", json.dumps({"model": str(tmp_path), "num_speculative_tokens": K})]

    def estimate():
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        return json.loads(res.output.strip().splitlines()[-1])
    got = estimate()
    assert (got["kv_groups"], got["full_groups"], got["window_blocks"]) == (2, 1, 10)
    _no_groups(monkeypatch)
    old = estimate()
    assert old["kv_groups"] == 0 and 3 * old["kv_block_bytes"] == 4 * got["kv_block_bytes"]
    assert got["max_concurrency_at_max_length"] > old["max_concurrency_at_max_length"] > 0


def test_gpu_path_interpreted_with_a_draft_equals_transformers(tmp_path, monkeypatch):
    """Triton kernels interpreted, the target's decodes and the draft's one-token forwards (drafts 2..3) through
    emulated CUDA graphs: a Gemma 2 drafting itself, the sliding group's freed blocks NaN in both caches: transformers'
    tokens, every draft accepted."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels")
    from quant_helpers import int4_kernel_path
    hf = build(tmp_path, "gemma2", seed=2)
    prompts = random_prompts((30, 9), seed=6)
    want = greedy_each(hf, prompts, 10)
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path), speculative_config=_draft_spec(tmp_path), max_model_len=128, cuda_graph_max_tokens=8,
             **KW, **NO_CACHE) as llm:
        assert isinstance(llm.engine.block_manager, HybridBlockManager)
        llm.engine.runner.capture_graphs(128, emulate=True)
        _poison(llm)
        _poison_draft(llm)
        assert _run(llm, prompts, 10) == want
        s = llm.engine.stats()
        assert s["kv_blocks_freed_window"] > 0 and s["draft_cuda_graph_replays"] > 0
        assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"] > 0
