"""Review of hybrid prefix caching (engine.state_cache.StateSnapshots, session 64): the snapshot key is the block
chain's, so a snapshot taken under one LoRA adapter or cache_salt is never restored for another; a step that fails
after admitting a request onto blocks the same step registered recomputes it from the last snapshot it keeps (from
zero here); a request aborted after its first chunk leaves a snapshot a later one starts from. Tiny Qwen3.5 and
Granite 4.0 (float32) against transformers / peft."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import check_state_slots_all_free, greedy_each, hf_model, random_prompts

NAMES = ("tiny-qwen3_5", "tiny-granite4")
BASE = random_prompts(512, (37,), seed=6)[0]


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    """(builtin path, transformers' float32 model) of each hybrid."""
    path = str(ensure_builtin(request.param))
    return path, hf_model(path)


def _run(llm, prompts, n: int, **kw) -> tuple[list[list[int]], list[int]]:
    """Each prompt's n greedy tokens, one request after the other (`kw`: each one's SamplingParams extras, as lists);
    each one's cached prompt tokens."""
    got, cached = [], []
    for i, p in enumerate(prompts):
        extra = {k: v[i] for k, v in kw.items()}
        out = llm.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True, **extra))[0]
        got.append(out.token_ids)
        cached.append(out.num_cached_tokens)
    return got, cached


def test_a_snapshot_under_one_cache_salt_is_not_restored_for_another(model):
    """The 37-token prompt under salt "a" snapshots its states at 36; its extension under salt "b" and without a
    salt find neither the blocks nor the snapshot; under "a" it starts from it. Transformers' tokens."""
    path, hf = model
    ext = BASE + [5, 6, 7, 8]
    prompts = [BASE, ext, ext, ext]
    want = greedy_each(hf, prompts, 5)
    with LLM(path, block_size=4) as llm:
        got, cached = _run(llm, prompts, 5, cache_salt=["a", "b", None, "a"])
        assert llm.engine.block_manager.snapshots.restored == 1
        check_state_slots_all_free(llm)
    assert got == want
    assert cached == [0, 0, 0, 36]


def test_a_snapshot_under_one_adapter_is_not_restored_for_another(tmp_path):
    """tiny-qwen3_5 with two adapters of its attention and MLP projections (they change the linear layers' inputs,
    so their states): the prompt under "all" snapshots its states; its extension under the base model and under
    "qvu" starts from zero (no hit), under "all" from the snapshot. peft's tokens."""
    from lora_helpers import ALL, PeftOracle, hf_float, save_adapters
    base = ensure_builtin("tiny-qwen3_5")
    hf = hf_float(base)
    qvu = dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"])
    paths = save_adapters(hf, tmp_path, {"all": dict(r=8, lora_alpha=16, target_modules=ALL), "qvu": qvu})
    ext = BASE + [5, 6, 7, 8]
    prompts, names = [BASE, ext, ext, ext], ["all", None, "qvu", "all"]
    oracle = PeftOracle(hf, paths)
    try:
        want = [oracle.greedy(a, p, 5) for p, a in zip(prompts, names)]
        assert want[1] != want[3]  # (the adapter changes the tokens: the check means something)
    finally:
        oracle.close()
    with LLM(str(base), loras={k: str(p) for k, p in paths.items()}, max_loras=2, max_lora_rank=8,
             block_size=4) as llm:
        got, cached = [], []
        for p, a in zip(prompts, names):
            out = llm.generate([p], SamplingParams(max_new_tokens=5, ignore_eos=True), lora=a)[0]
            got.append(out.token_ids)
            cached.append(out.num_cached_tokens)
        assert llm.engine.block_manager.snapshots.restored == 1
    assert got == want
    assert cached == [0, 0, 0, 36]


def test_a_request_aborted_after_its_first_chunk_leaves_its_snapshot(model):
    """Chunks of 16 tokens: a request aborted once its first chunk ran leaves the states at 16 snapshotted (and its
    blocks cached); the same prompt then starts there, transformers' tokens, every slot free."""
    path, hf = model
    want = greedy_each(hf, [BASE], 5)
    with LLM(path, block_size=4, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        engine = llm.engine
        engine.add_request("gone", prompt_token_ids=BASE, params=SamplingParams(max_new_tokens=5))
        engine.step()
        assert engine.scheduler.running[0].num_computed_tokens == 16
        engine.abort_request("gone")
        while engine.has_unfinished_requests():
            engine.step()
        got, cached = _run(llm, [BASE], 5)
        assert engine.block_manager.snapshots.restored == 1
        check_state_slots_all_free(llm)
    assert got == want
    assert cached == [16]


def test_a_failed_step_sends_a_hit_on_its_blocks_back_to_a_kept_snapshot(model, monkeypatch):
    """20 KV blocks of 4, 3 snapshot slots (one is the running request's past its prompt). A running request holds
    the first 5 blocks of a 37-token prompt (its snapshots at 16 and 20 evicted later); the prompt itself snapshots
    at 36, and a 50-token one evicts its last 4 blocks. Two extensions of the prompt admitted in one step: the first
    computes it all (no snapshot at 20), registering blocks 5 to 8 as the step is scheduled; the second takes those
    and the held ones up to the snapshot at 36. The step fails (forget_scheduled): the second goes back to the last
    snapshot before the blocks the step registered, none (no state at 20), from zero, not to a snapshot at 20 that
    is not kept. Transformers' tokens for all."""
    from infer.engine.model_runner import ModelRunner
    path, hf = model
    first, second = BASE + [1, 2, 3, 4, 5, 6, 7], BASE + [9, 9, 9, 9, 9, 9, 9]
    real, failed, managers = ModelRunner.run, [], []

    def run(self, batch):
        if {s.request_id for s in batch.seqs} >= {"first", "second"} and not failed:
            seq = next(s for s in batch.seqs if s.request_id == "second")  # (which of its hits the step registers)
            failed.append([b in managers[0].scheduled for b in seq.block_table[:seq.num_hashed_blocks]])
            raise RuntimeError("simulated kernel failure")
        return real(self, batch)
    monkeypatch.setattr(ModelRunner, "run", run)
    outs: dict[str, list[int]] = {}

    def finish(engine, request_id: str, prompt: list[int], n: int) -> None:
        if prompt is not None:
            engine.add_request(request_id, prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=n,
                                                                                          ignore_eos=True))
        while request_id not in outs:
            try:
                outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
            except RuntimeError:
                pass
    with LLM(path, block_size=4, num_kv_blocks=20, max_model_len=64, state_snapshots=3, max_num_seqs=4) as llm:
        engine = llm.engine
        managers.append(engine.block_manager)
        engine.add_request("held", prompt_token_ids=BASE[:20], params=SamplingParams(max_new_tokens=20,
                                                                                      ignore_eos=True))
        engine.step()
        finish(engine, "prompt", BASE, 1)
        finish(engine, "other", random_prompts(512, (50,), seed=8)[0], 1)
        engine.add_request("first", prompt_token_ids=first, params=SamplingParams(max_new_tokens=4, ignore_eos=True))
        finish(engine, "second", second, 4)
        finish(engine, "first", None, 4)
        finish(engine, "held", None, 20)
        assert failed == [[False] * 5 + [True] * 4]  # (the second's 9 hits when the step failed)
        check_state_slots_all_free(llm)
    want = greedy_each(hf, [first, second, BASE[:20]], 4)
    assert [outs["first"], outs["second"], outs["held"][:4]] == want
