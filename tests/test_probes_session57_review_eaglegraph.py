"""Review of EAGLE heads under CUDA graphs (emulated on CPU): a step after a larger one's replay (buckets 1, 2, 4, 8,
9 and n = bucket + 1) gives an eager forward's hidden and aux states and head outputs (no stale rows of the larger
step); drafts with graphs equal those without under mixed LoRA adapters and KV layer groups (a Qwen2 with
max_window_layers), and after reload_weights; the graph pool's formula equals the buffers the graphs keep at other
sizes (one sequence, no piecewise graphs, a bucket past a power of two)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.engine.config import EngineConfig

from helpers import random_prompts, save_random_model
from test_probes_session56_eagle import TARGET, VOCAB, _record, greedy, save_eagle1, save_eagle3
from test_probes_session57_eaglegraph import _decode_ctx

KW = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=40, max_model_len=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama target, an EAGLE-3 head and an EAGLE-1 head: {name: folder}."""
    root = tmp_path_factory.mktemp("review_eaglegraph")
    save_random_model(root / "t", "llama", "LlamaForCausalLM", TARGET, seed=3)
    save_eagle3(root / "eagle3", seed=1)
    save_eagle1(root / "eagle", seed=11)
    return root


def _spec(root, method: str, k: int = 3) -> dict:
    return {"method": method, "model": str(root / method), "num_speculative_tokens": k}


def _run(folder, kw, prompts, n, spec=None, graphs=False, seen=None, **gen):
    """(greedy tokens, the drafts proposed sorted) of `prompts` on a fresh engine, its graphs captured (emulated) or
    not."""
    if seen is not None:
        seen[:] = []
    with LLM(str(folder), **({"speculative_config": spec} if spec else {}), **kw) as llm:
        if graphs:
            llm.engine.runner.capture_graphs(64, emulate=True)
        tokens = [o.token_ids for o in llm.generate(prompts, greedy(n), **gen)]
        if graphs:
            s = llm.engine.stats()
            assert s["piecewise_graph_steps"] > 0 and s["draft_cuda_graph_replays"] > 0
    return tokens, sorted(seen or [])


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
@torch.inference_mode()
def test_a_step_after_a_larger_ones_replay_equals_an_eager_forward(models, method):
    """Decode steps of 9, 5, 8, 3, 9 and 1 sequences (buckets 1, 2, 4, 8, 9: each after a larger or other bucket's
    replay): the target's hidden states and aux states (EAGLE-3) and the head's two outputs, fed other hidden
    states, equal the eager forwards' (a row past n of an earlier, larger step would differ or widen them)."""
    with LLM(str(models / "t"), speculative_config=_spec(models, method), **dict(
            KW, max_num_seqs=9, max_num_batched_tokens=32, num_kv_blocks=120)) as llm:
        runner, drafter = llm.engine.runner, llm.engine.drafter
        runner.capture_graphs(64, emulate=True)
        assert runner.graphs.buckets == drafter.graphs.buckets == [1, 2, 4, 8, 9]
        runner.zero_blocks(list(range(120)))
        model, head, g = runner.model, drafter.model, torch.Generator().manual_seed(0)
        for n in (9, 5, 8, 3, 9, 1):
            ids, pos, ctx = torch.randint(3, VOCAB, (n,), generator=g), torch.full((n,), 6), _decode_ctx(n, 6)
            want = model(ids, pos, ctx)
            want_aux, model.aux_hidden = getattr(model, "aux_hidden", None), None
            torch.testing.assert_close(runner.graphs.run(ids, pos, ctx), want)
            got_aux = getattr(model, "aux_hidden", None)
            assert (got_aux is None) == (want_aux is None) == (method == "eagle")
            for a, b in zip(got_aux or (), want_aux or (), strict=True):
                torch.testing.assert_close(a, b)
            model.aux_hidden = None
            hidden = torch.randn(n, TARGET["hidden_size"], generator=g)
            for a, b in zip(drafter.graphs.run(ids, pos, ctx, hidden), head(ids, pos, ctx, hidden), strict=True):
                torch.testing.assert_close(a, b)


def test_mixed_adapters_draft_with_graphs_as_without(tmp_path, models, monkeypatch):
    """EAGLE-3 over a target serving two adapters mixed with the base in one batch (q/v/down and o/gate, ranks 8
    and 4): the same drafts with graphs as without, the same tokens as the target alone."""
    from lora_helpers import hf_float, save_adapter
    hf = hf_float(models / "t")
    a = save_adapter(hf, tmp_path / "a", 1, lora_dropout=0.0, r=8, target_modules=["q_proj", "v_proj", "down_proj"])
    b = save_adapter(hf, tmp_path / "b", 2, lora_dropout=0.0, r=4, target_modules=["o_proj", "gate_proj"])
    kw = dict(KW, loras={"a": str(a), "b": str(b)}, max_loras=2, max_lora_rank=8)
    prompts, names = random_prompts(VOCAB, (5, 9, 13, 7), seed=7), ["a", None, "b", "a"]
    want, _ = _run(models / "t", kw, prompts, 10, lora=names)
    seen = _record(monkeypatch)
    eager = _run(models / "t", kw, prompts, 10, _spec(models, "eagle3"), seen=seen, lora=names)
    graphed = _run(models / "t", kw, prompts, 10, _spec(models, "eagle3"), True, seen, lora=names)
    assert eager == graphed and graphed[0] == want and len(graphed[1]) > 10


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_kv_layer_groups_draft_with_graphs_as_without(tmp_path, models, monkeypatch, method):
    """A Qwen2 target whose layers 2.. slide (max_window_layers: KV layer groups, kept on with a head), far past its
    window of 16 and preempted: the same drafts with graphs as without, the same tokens as the target alone."""
    save_random_model(tmp_path / "q", "qwen2", "Qwen2ForCausalLM",
                      dict(TARGET, use_sliding_window=True, sliding_window=16, max_window_layers=2), seed=3)
    kw = dict(KW, num_kv_blocks=60)
    prompts = random_prompts(VOCAB, (5, 19, 13, 22), seed=7)
    want, _ = _run(tmp_path / "q", kw, prompts, 24)
    seen = _record(monkeypatch)
    eager = _run(tmp_path / "q", kw, prompts, 24, _spec(models, method), seen=seen)
    graphed = _run(tmp_path / "q", kw, prompts, 24, _spec(models, method), True, seen)
    assert eager == graphed and graphed[0] == want and len(graphed[1]) > 20


def test_reload_weights_captures_the_eagle_graphs_again(models, monkeypatch):
    """reload_weights() drops the graphs (their addresses are the old weights') and captures them again, the head's
    (which reads the target's embeddings) too: the same tokens and drafts as before it, the graphs replayed."""
    seen = _record(monkeypatch)
    prompts = random_prompts(VOCAB, (5, 9, 13), seed=1)
    with LLM(str(models / "t"), speculative_config=_spec(models, "eagle3"), **KW) as llm:
        engine = llm.llm_engine
        engine.runner.capture_graphs(64, emulate=True)
        first = [o.token_ids for o in llm.generate(prompts, greedy(10))]
        drafts, seen[:] = sorted(seen), []
        engine.reload_weights()
        assert engine.runner.graphs.aux == 3 and engine.drafter.graphs is not None
        before = engine.stats()
        assert [o.token_ids for o in llm.generate(prompts, greedy(10))] == first
        assert sorted(seen) == drafts and drafts
        assert engine.stats()["draft_cuda_graph_replays"] > before["draft_cuda_graph_replays"]


@pytest.mark.parametrize("seqs,tokens,pieces", [(1, 16, 16), (9, 48, 24), (16, 64, 0)])
def test_the_formula_equals_the_kept_buffers_at_other_sizes(models, monkeypatch, seqs, tokens, pieces):
    """aux_graph_bytes and head_graph_bytes equal what the graphs keep (the decode graphs' aux outputs, the pieces'
    aux buffers, the head's fed hidden states and the smaller buckets' pre-norm outputs) with one sequence, a
    bucket past a power of two (9) and no piecewise graphs."""
    from infer.memory.plan import aux_graph_bytes, head_graph_bytes

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)
    with LLM(str(models / "t"), speculative_config=_spec(models, "eagle3"), **dict(
            KW, max_num_seqs=seqs, max_num_batched_tokens=tokens, cuda_graph_max_tokens=pieces,
            num_kv_blocks=200)) as llm:
        runner, drafter, cfg = llm.engine.runner, llm.engine.drafter, llm.engine.config
        runner.capture_graphs(64, emulate=True)
        assert (runner.pieces is None) == (pieces == 0)
        monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)  # (the formulas' CUDA figures)
        kept = size(t for extra in runner.graphs.extra.values() for t in extra) \
            + (size(runner.pieces.aux) if runner.pieces else 0)
        assert kept == aux_graph_bytes(cfg, runner.model.config, torch.float32) > 0
        hg = drafter.graphs
        head = size([hg.hidden_in]) + size(extra[0] for b, extra in hg.extra.items() if b != max(hg.buckets))
        assert head == head_graph_bytes(cfg, drafter.model_config, torch.float32) > 0
