"""Draft-model speculative decoding on the device: the draft's k forwards of a step read the device once (every
drafted token together, at the end), drafts 2..k take their input tokens from the forward before's argmax on the
device, and each forward's integer inputs travel in packed copies. Greedy outputs are those of a run without
speculation token for token, whatever k, with drafts trimmed unevenly, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.bench.sync_audit import SyncAudit
from infer.engine.draft import DraftRunner
from infer.models.tiny import ensure_builtin

from helpers import random_prompts


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


def spec(model, k: int) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


def _outputs(llm, prompts, lengths):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_drafts_equal_plain_for_any_k_with_uneven_drafts(path, k):
    """Mixed prompt and output lengths: near max_tokens the scheduler trims some sequences' drafts, so the later
    one-token forwards run over fewer sequences than the first (their rows picked on the device)."""
    kw = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = random_prompts(512, (3, 17, 9, 26, 5), seed=21)
    lengths = [5, 13, 2, 9, 11]
    want = _outputs(LLM(str(path), **kw), prompts, lengths)
    for draft in (path, "tiny-qwen2"):  # drafts all accepted, mostly rejected
        llm = LLM(str(path), speculative_config=spec(draft, k), **kw)
        assert _outputs(llm, prompts, lengths) == want
        assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0
        assert llm.engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hits_and_preemption_with_four_drafts(path):
    kw = dict(block_size=4, num_kv_blocks=18, max_model_len=48, max_num_seqs=4)
    prompts = random_prompts(512, (10, 7, 13, 6), seed=22)
    plain = LLM(str(path), **kw)
    first = _outputs(plain, prompts[:1], [14])[0]
    again = [prompts[0] + first[:10]] + prompts[1:]
    want = _outputs(plain, again, [20, 17, 20, 12])
    llm = LLM(str(path), speculative_config=spec(path, 4), **kw)
    assert _outputs(llm, prompts[:1], [14]) == [first]
    assert _outputs(llm, again, [20, 17, 20, 12]) == want
    s = llm.engine.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] >= 8, s
    assert s["spec_decode_num_accepted_tokens"] >= 0.9 * s["spec_decode_num_draft_tokens"] > 0, s


@pytest.mark.parametrize("k", [2, 5])
def test_a_step_of_k_drafts_reads_the_device_once(path, monkeypatch, k):
    """Under SyncAudit (what would wait for the GPU): each propose makes one read from the device (the drafted
    tokens, all at once) and at most two host-to-device copies (the first forward's inputs with the blocks to
    zero; those of drafts 2..k), whatever k: no per-draft .tolist() and no torch.tensor(..., device=...)."""
    per_call = []
    real = DraftRunner.propose

    def propose(self, batch):
        drafts = [len(s.draft_token_ids) for s in batch.seqs]
        with SyncAudit() as audit:
            real(self, batch)
        per_call.append((len(audit.found), len(audit.copies), drafts, audit.report()))
    monkeypatch.setattr(DraftRunner, "propose", propose)
    kw = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    prompts = random_prompts(512, (5, 11, 3), seed=23)
    llm = LLM(str(path), speculative_config=spec(path, k), **kw)
    assert _outputs(llm, prompts, [12, 9, 14]) == _outputs(LLM(str(path), **kw), prompts, [12, 9, 14])
    assert sum(max(d) == k for _, _, d, _ in per_call) >= 3  # steps of k drafts
    assert any(len(set(d) - {0}) > 1 for _, _, d, _ in per_call)  # and of uneven drafts
    assert all(found == (max(d) > 0) and copies <= 2 for found, copies, d, _ in per_call), per_call


# ------------------------------------------------------------------ the draft's one-token forwards as CUDA graphs
@pytest.mark.parametrize("k", [2, 4])
def test_the_drafts_one_token_forwards_replay_decode_graphs(path, monkeypatch, k):
    """Captured beside the target's (emulated on CPU): drafts 2..k replay the draft's own decode graphs, the first
    forward of a step (the step's own tokens) stays eager, and the tokens are those of a run without speculation."""
    decodes, real = [], DraftRunner._decode
    monkeypatch.setattr(DraftRunner, "_decode", lambda self, *a: decodes.append(a[0].shape[0]) or real(self, *a))
    kw = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    prompts = random_prompts(512, (3, 17, 9, 26, 5), seed=24)
    lengths = [5, 13, 2, 9, 11]
    want = _outputs(LLM(str(path), **kw), prompts, lengths)
    llm = LLM(str(path), speculative_config=spec(path, k), **kw)
    runner, drafter = llm.engine.runner, llm.engine.drafter
    runner.capture_graphs(64, emulate=True)
    graphs = drafter.graphs
    assert graphs is not None and graphs is not runner.graphs and graphs.model is drafter.model
    assert graphs.block_tables.data_ptr() != runner.graphs.block_tables.data_ptr()
    captured = sum(graphs.replays.values())
    assert _outputs(llm, prompts, lengths) == want
    assert decodes and sum(graphs.replays.values()) - captured == len(decodes)  # every one-token forward replayed
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_the_memory_plan_counts_the_drafts_graphs_as_warmup_does(monkeypatch):
    """With CUDA graphs the engine's start reserves the draft's decode graphs' pool beside the target's, and
    warmup's formula counts the same."""
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.setup import load_engine_parts
    kw = dict(max_num_seqs=4, max_model_len=128, memory_limit="64MB", block_size=4)
    draft = dict(kw, speculative_config=spec("tiny-qwen3", 3))

    def peak(graphs: bool, **opts) -> int:
        monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: graphs)
        return load_engine_parts(EngineConfig(model="tiny-llama", **opts)).memory_plan.activation_peak_bytes
    from infer.engine.config import EngineConfig
    alone, spec_graphs = peak(True, **kw) - peak(False, **kw), peak(True, **draft) - peak(False, **draft)
    assert spec_graphs > alone > 0  # the draft's graphs on top of the target's
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)
    assert estimate_plan(EngineConfig(model="tiny-llama", **draft), 128, 4)[0].activation_peak_bytes == \
        peak(True, **draft)
