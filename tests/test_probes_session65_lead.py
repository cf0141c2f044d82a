"""The sixty-fifth session's lead's probes: the CPU decode batch's masked cache slots."""

import torch

from infer.kernels import reference


def test_a_rows_own_last_block_past_its_length_reaches_it_not_even_as_nan():
    """A decode batch of rows of unequal lengths: the slots past a shorter row's length in its own last block hold
    what their last owner left (NaN from a request that went non-finite); masked, they must not reach the row as
    0 x NaN. Each row equals its own attention over exactly its keys."""
    torch.manual_seed(0)
    cache = torch.randn(8, 16, 1, 48)
    cache[1, 5:] = float("nan")  # row 0 (21 keys: block 0 and slots 0-4 of block 1) never reads slots 5-15
    cache[7] = float("nan")  # a block no row's table names
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    lens = torch.tensor([21, 30, 30], dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    q = torch.randn(3, 4, 48)
    out = reference.paged_attention(q, cache, cache, tables, lens, qsl, 0.25)
    assert torch.isfinite(out).all()
    for b in range(3):
        keys = cache[tables[b].long()].flatten(0, 1)[:int(lens[b]), 0]  # [n, D]
        want = torch.softmax(0.25 * q[b] @ keys.T, dim=-1) @ keys
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-5)


def test_a_hybrids_chunk_that_leaves_prompt_tokens_ends_at_a_block_boundary_and_snapshots_there():
    """tiny-qwen3_5, blocks of 4, a step budget of 10 tokens (no multiple of 4): the first chunk of a 37-token prompt
    is cut to 8 tokens, so that its states are a prefix's (snapshotted at 8); a request aborted after it leaves that
    snapshot, and the same prompt then starts there with transformers' tokens."""
    from helpers import check_state_slots_all_free, greedy_each, hf_model, random_prompts

    from infer import LLM, SamplingParams
    from infer.models.tiny import ensure_builtin
    path = str(ensure_builtin("tiny-qwen3_5"))
    prompt = random_prompts(512, (37,), seed=6)[0]
    want = greedy_each(hf_model(path), [prompt], 5)
    with LLM(path, block_size=4, max_num_batched_tokens=10, max_num_seqs=4) as llm:
        engine = llm.engine
        engine.add_request("gone", prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=5))
        engine.step()
        assert engine.scheduler.running[0].num_computed_tokens == 8
        engine.abort_request("gone")
        while engine.has_unfinished_requests():
            engine.step()
        out = llm.generate([prompt], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
        assert engine.block_manager.snapshots.restored == 1
        check_state_slots_all_free(llm)
    assert out.token_ids == want[0]
    assert out.num_cached_tokens == 8
