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
