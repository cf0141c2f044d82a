"""EAGLE speculative decoding with CUDA graphs (emulated on CPU: engine.cuda_graphs' emulate): the target's decode
and piecewise graphs keep its EAGLE-3 aux hidden states in static outputs, so its steps replay rather than run
eagerly; an EAGLE head's one-token forwards (drafts 2..k) replay graphs of their own (HeadGraphs); the graph pool's
formula counts both. Greedy tokens and drafts with graphs equal those without, the target's alone and an
independent reference of the head."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.engine.config import EngineConfig
from infer.models.context import ForwardContext

from helpers import random_prompts
from test_probes_session56_eagle import (KW, LAYERS, TARGET, VOCAB, _record, greedy, head, plain,  # noqa: F401
                                         reference_drafts, reference_eagle1, save_eagle1, spec, target)  # (fixtures)

AUX = (2, LAYERS // 2, LAYERS - 3)  # the head's default aux layers (vLLM's)


@pytest.fixture(scope="module")
def graphed(target, head):
    """An EAGLE-3 engine whose graphs are captured (emulated), as an engine on a GPU captures them at its start."""
    llm = LLM(str(target[0]), speculative_config=spec(head[0]), **KW)
    llm.engine.runner.capture_graphs(64, emulate=True)
    return llm


PROMPTS = [p for seed in (0, 1, 2) for p in random_prompts(VOCAB, (5, 19), seed=seed)]


def _tokens(llm, prompts, n):
    return [o.token_ids for o in llm.generate(prompts, greedy(n))]


# ------------------------------------------------------------------ the engine
def test_eagle3_with_graphs_equals_without_the_target_alone_and_the_reference(target, head, plain, graphed,
                                                                              monkeypatch):
    """Batched, chunked and preempted (24 blocks of 4): the same tokens as the target alone and as EAGLE-3 without
    graphs, the same drafts as without graphs and as the reference (a graph that kept no aux states, or another
    layer's, changes them), and the target's steps replayed (decode graphs and pieces) with the head's drafts 2..k."""
    folder, hf = target
    want = _tokens(plain, PROMPTS, 16)
    seen = _record(monkeypatch)
    with LLM(str(folder), speculative_config=spec(head[0]), **KW) as eager:
        assert _tokens(eager, PROMPTS, 16) == want
        assert eager.engine.runner.graphs is None
    eager_drafts, seen[:] = list(seen), []
    before = graphed.engine.stats()
    assert _tokens(graphed, PROMPTS, 16) == want
    assert seen == eager_drafts and len(seen) > 20
    for tokens, drafts in seen[::3]:
        assert drafts == reference_drafts(hf, head[1], tokens, len(drafts), AUX), tokens
    s = graphed.engine.stats()
    assert s["num_preemptions"] > before["num_preemptions"]
    assert s["cuda_graph_replays"] > before["cuda_graph_replays"]
    assert s["piecewise_graph_steps"] > before["piecewise_graph_steps"]  # (the verify steps of k + 1 tokens)
    assert s["draft_cuda_graph_replays"] > before["draft_cuda_graph_replays"]
    assert graphed.engine.block_manager.num_used_blocks == 0


def test_eagle3_steps_replay_rather_than_run_eagerly(graphed, monkeypatch):
    """Every target step of a run replays a graph (a decode graph or the pieces: stats' counters grow by the
    runner's forwards), and the head's drafts 2..k replay HeadGraphs: its eager forwards are each step's first (its
    feed), at most one a step."""
    engine = graphed.engine
    runner = engine.runner
    calls = {"forward": 0}
    real = type(runner).forward

    def forward(self, *args):
        calls["forward"] += 1
        return real(self, *args)
    monkeypatch.setattr(type(runner), "forward", forward)
    before = engine.stats()
    assert runner.model.aux_layers == AUX
    graphed.generate(random_prompts(VOCAB, (6, 9, 4), seed=40), greedy(10))
    s = engine.stats()
    grew = {k: s[k] - before[k] for k in ("cuda_graph_replays", "piecewise_graph_steps", "draft_cuda_graph_replays",
                                         "draft_eager_forwards", "num_steps")}
    assert calls["forward"] > 0 and grew["cuda_graph_replays"] + grew["piecewise_graph_steps"] == calls["forward"]
    assert grew["draft_cuda_graph_replays"] > 0 and 0 < grew["draft_eager_forwards"] <= grew["num_steps"]


# ------------------------------------------------------------------ the graphs' outputs
def _decode_ctx(n: int, pos: int, block_size: int = 4) -> ForwardContext:
    """n decodes at position `pos`, sequence i in blocks i*w..(i+1)*w-1."""
    w = pos // block_size + 1
    tables = torch.arange(n * w, dtype=torch.int32).view(n, w)
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    return ForwardContext(query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                          seq_lens=torch.full((n,), pos + 1, dtype=torch.int32), block_tables=tables,
                          slot_mapping=slots, max_query_len=1)


@torch.inference_mode()  # (as the engine runs them)
def test_decode_and_piecewise_graphs_keep_the_aux_states_an_eager_forward_keeps(graphed):
    """A decode step of 3 sequences (padded to the bucket of 4) and a prefill of 9 tokens through the pieces: the
    hidden states and model.aux_hidden (each aux layer's rows, in aux_layers' order) equal an eager forward's."""
    runner = graphed.engine.runner
    model = runner.model
    runner.zero_blocks(list(range(8)))
    ids = torch.tensor([7, 300, 45])
    ctx = _decode_ctx(3, 5)
    pos = torch.full((3,), 5)
    want = model(ids, pos, ctx)
    want_aux, model.aux_hidden = model.aux_hidden, None
    got = runner.graphs.run(ids, pos, ctx)
    assert runner.graphs.bucket_for(3) == 4 and len(model.aux_hidden) == len(AUX)
    torch.testing.assert_close(got, want)
    for a, b in zip(model.aux_hidden, want_aux, strict=True):
        assert a.shape == (3, TARGET["hidden_size"])
        torch.testing.assert_close(a, b)
    assert not torch.equal(want_aux[0], want_aux[1])  # (the layers' states differ: the order is checked)
    # the graph's own outputs (a real replay leaves nothing else: emulated, the model's call would)
    assert [a.data_ptr() for a in model.aux_hidden] == [o.data_ptr() for o in runner.graphs.extra[4]]
    n = 9
    ids = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(n)
    ctx = ForwardContext(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                         seq_lens=torch.tensor([n], dtype=torch.int32),
                         block_tables=torch.arange(3, dtype=torch.int32).view(1, 3), slot_mapping=torch.arange(n),
                         max_query_len=n)
    want = model(ids, pos, ctx)
    want_aux, model.aux_hidden = model.aux_hidden, None
    got = runner.pieces.run(ids, pos, ctx)
    torch.testing.assert_close(got, want)
    assert [a.data_ptr() for a in model.aux_hidden] == [o.data_ptr() for o in runner.pieces.aux]
    for a, b in zip(model.aux_hidden, want_aux, strict=True):
        torch.testing.assert_close(a, b)
    model.aux_hidden = None


@torch.inference_mode()  # (as the engine runs them)
def test_the_heads_graphs_give_its_eager_outputs(graphed):
    """HeadGraphs: the head's (normed, pre-norm) outputs of a one-token step of 3 sequences fed hidden states."""
    drafter = graphed.engine.drafter
    head, graphs = drafter.model, drafter.graphs
    drafter.zero(list(range(8)))
    ids, pos, ctx = torch.tensor([9, 31, 200]), torch.full((3,), 6), _decode_ctx(3, 6)
    hidden = torch.randn(3, TARGET["hidden_size"], generator=torch.Generator().manual_seed(5))
    want = head(ids, pos, ctx, hidden)
    got = graphs.run(ids, pos, ctx, hidden)
    assert len(got) == 2 and got[0].shape == (3, TARGET["hidden_size"])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert graphs.aux == 0 and not torch.equal(got[0], got[1])


def test_eagle1_with_graphs_equals_the_target_alone_and_the_reference(tmp_path, target, plain, monkeypatch):
    """EAGLE-1 (its head reads the target's output, which every graph gives): graphs captured for the target and the
    head, the same tokens as the target alone, the drafts the reference's."""
    folder, hf = target
    t = save_eagle1(tmp_path / "h1", seed=11)
    seen = _record(monkeypatch)
    llm = LLM(str(folder), speculative_config={"method": "eagle", "model": str(tmp_path / "h1"),
                                               "num_speculative_tokens": 3}, **KW)
    llm.engine.runner.capture_graphs(64, emulate=True)
    assert llm.engine.runner.graphs.aux == 0 and llm.engine.runner.pieces.aux == []
    prompts = random_prompts(VOCAB, (9, 6, 12), seed=9)
    assert _tokens(llm, prompts, 9) == _tokens(plain, prompts, 9)
    assert len(seen) >= 6
    for tokens, drafts in seen:
        assert drafts == reference_eagle1(hf, t, tokens, len(drafts)), tokens
    s = llm.engine.stats()
    assert s["draft_cuda_graph_replays"] > 0 and s["piecewise_graph_steps"] > 0


# ------------------------------------------------------------------ the graph pool's formula
def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_graph_pool_formula_counts_the_aux_states_and_the_heads_buffers(target, head, graphed, monkeypatch):
    """memory.plan.cuda_graph_bytes counts the aux states the target's graphs keep (each decode graph's outputs,
    the pieces' buffers), draft_graph_bytes the head graphs' fed hidden states and the pre-norm outputs the
    smaller ones keep; a plain engine's graphs keep no such buffers and its formula is what it was."""
    from infer.memory.plan import aux_graph_bytes, cuda_graph_bytes, draft_graph_bytes, head_graph_bytes
    with LLM(str(target[0]), **KW) as llm:  # no head: graphs as before, no aux outputs or buffers
        llm.engine.runner.capture_graphs(64, emulate=True)
        g = llm.engine.runner
        assert g.graphs.aux == 0 and set(g.graphs.extra.values()) == {()}
        assert g.pieces.aux == [] and getattr(g.model, "aux_hidden", None) is None
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)  # (the formulas' CUDA figures)
    runner, drafter = graphed.engine.runner, graphed.engine.drafter
    cfg = graphed.engine.config
    plain_cfg = EngineConfig(str(target[0]), **KW)
    model_cfg, head_cfg, dtype = runner.model.config, drafter.model_config, torch.float32
    graphs, pieces = runner.graphs, runner.pieces
    kept = _bytes(t for extra in graphs.extra.values() for t in extra) + _bytes(pieces.aux)
    assert kept > 0 and len(pieces.aux) == 3
    assert aux_graph_bytes(cfg, model_cfg, dtype) == kept
    assert cuda_graph_bytes(cfg, model_cfg, dtype) - cuda_graph_bytes(plain_cfg, model_cfg, dtype) == kept
    hg, largest = drafter.graphs, max(drafter.graphs.buckets)
    extra = _bytes([hg.hidden_in]) + _bytes(extra[0] for b, extra in hg.extra.items() if b != largest)
    assert head_graph_bytes(cfg, head_cfg, dtype) == extra > _bytes([hg.hidden_in])
    assert draft_graph_bytes(cfg, head_cfg, dtype) - draft_graph_bytes(plain_cfg, head_cfg, dtype) == extra
    assert aux_graph_bytes(plain_cfg, model_cfg, dtype) == head_graph_bytes(plain_cfg, head_cfg, dtype) == 0


def test_warmup_graph_capture_records_the_heads_graphs(target, head, monkeypatch):
    """graph_capture (what `infer warmup` measures) with an EAGLE-3 head: the target's decode graphs and pieces
    (keeping its aux states) and the head's one-token graphs, counted apart; the target is left as it was."""
    from infer.cli import warmup_plan
    from infer.engine.draft import load_draft
    from infer.memory.graph_buckets import batch_buckets, token_buckets
    config = EngineConfig(str(target[0]), max_num_seqs=4, block_size=4, cuda_graph_max_tokens=16, max_model_len=64,
                          speculative_config=spec(head[0]))
    with LLM(str(target[0]), max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64) as llm:
        model = llm.engine.runner.model
        draft = load_draft(config, model.config, torch.float32, torch.device("cpu"), 64, target=model)
        got = warmup_plan.graph_capture(model, config, torch.float32, torch.device("cpu"), 64, emulate=True,
                                        draft=draft)
        decode, pieces = len(batch_buckets(4)), len(token_buckets(16)) * (LAYERS + 1)
        assert got["cuda_graphs_draft"] == decode and got["cuda_graphs"] == 2 * decode + pieces
        assert model.aux_layers == () and getattr(model, "aux_hidden", None) is None


def test_sleep_and_wake_up_capture_the_eagle_graphs_again(target, head, plain):
    """sleep() drops the graphs, wake_up() captures them again, aux states and head graphs included: the same
    greedy tokens as the target alone after it, the graphs replayed."""
    prompts = random_prompts(VOCAB, (7, 10), seed=50)
    want = _tokens(plain, prompts, 8)
    with LLM(str(target[0]), speculative_config=spec(head[0]), enable_sleep_mode=True, **KW) as llm:
        engine = llm.llm_engine
        engine.runner.capture_graphs(64, emulate=True)
        assert _tokens(llm, prompts, 8) == want
        llm.sleep(1)
        llm.wake_up()
        assert engine.runner.graphs.aux == 3 and len(engine.runner.pieces.aux) == 3
        assert engine.drafter.graphs is not None
        before = engine.stats()
        assert _tokens(llm, prompts, 8) == want
        s = engine.stats()
        assert s["piecewise_graph_steps"] > before["piecewise_graph_steps"]
        assert s["draft_cuda_graph_replays"] > before["draft_cuda_graph_replays"]
