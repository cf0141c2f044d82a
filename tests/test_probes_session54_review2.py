"""Session 54 review of the engine's changes: a one-token step's block shared in its step only when the step holds a
query of several tokens (never the fused decode kernel, whose reads race its writes), checked as an invariant of
every scheduled step (chunked prefills, preemption, prompt lookup, the priority policy, overlapped steps), and on
the GPU code path (Triton interpreted, CUDA graphs emulated) against the cache off and transformers."""

from __future__ import annotations

import pytest

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams as Params
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts
from test_probes_session54_engine import _run


def _engine(caching: bool = True, **kw) -> LLMEngine:
    kw = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=20, enable_prefix_caching=caching) | kw
    return LLMEngine(EngineConfig("tiny-llama", **kw))


@pytest.mark.parametrize("kw", [
    dict(),
    dict(overlap=True),
    dict(max_num_batched_tokens=12, num_kv_blocks=20, max_model_len=48),  # chunks, and preemptions
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    dict(scheduling_policy="priority"),
], ids=["sync", "overlap", "chunked-tiny", "ngram", "priority"])
def test_a_one_token_steps_block_is_shared_in_its_step_only_beside_a_query_of_several_tokens(kw):
    """Every step: a block that a sequence of one token this step put in the prefix cache as it was scheduled
    (BlockManager.scheduled) is in a step whose longest query (the runner's max_query_len, drafts included) has
    several tokens, so the step never takes the fused decode kernel (nor its CUDA graph), where a request sharing
    the block would read it while the decode writes it. Some such blocks are shared, and every request's tokens
    are those of the cache off."""
    base = random_prompts(500, (10, 27, 1, 30), seed=31)
    outs, shared = {}, []
    for caching in (True, False):
        engine = _engine(caching, **kw)
        sched = engine.scheduler
        real = sched.schedule

        def checked():
            batch = real()
            mine = {bid for seq, n in zip(batch.seqs, batch.num_new_tokens) if n == 1
                    for bid in seq.block_table if bid in set(engine.block_manager.scheduled)}
            if mine:
                assert max(batch.num_new_tokens) >= 2, "a one-token step's block shared in a step of decodes only"
                shared.append(len(mine))
            return batch
        sched.schedule = checked
        params = Params(max_new_tokens=8, ignore_eos=True)
        requests = [("a", base[0], params), ("x", base[1], Params(max_new_tokens=2, ignore_eos=True))]
        for rid, prompt, p in requests:
            engine.add_request(rid, prompt, p)
        engine.step()
        engine.step()
        while len(engine.requests["a"].output_token_ids) < 2:
            engine.step()
        a = engine.requests["a"].output_token_ids[:2]
        b_prompt = base[0] + a + base[2]
        later = [("b", b_prompt, params), ("c", b_prompt + base[3], params), ("d", base[0][:8] + base[3], params)]
        outs[caching] = _run(engine, later)
    assert shared or kw.get("overlap")  # (overlapped: a decode's token is pending on the host when scheduled)
    for rid in outs[False]:
        assert outs[True][rid].outputs[0].token_ids == outs[False][rid].outputs[0].token_ids, rid


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decodes_block_shared_beside_a_prefill_chunk_on_the_gpu_path(monkeypatch, overlap):
    """The GPU code path on CPU (every op through its Triton kernel, interpreted; CUDA graphs emulated: decode
    graphs for the steps of decodes, piecewise graphs for the mixed ones): A decodes beside X's prefill chunks; in
    the step where A's token completes its third block, B (A's prompt, its first two tokens and one more) is
    admitted and shares that block at once (12 cached tokens; overlapped, B comes a step later, the token that
    completes the block having been pending on the host when its step was scheduled). B's tokens are those of the
    cache off and of transformers."""
    from infer import kernels
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    a_prompt, x_prompt, tail = random_prompts(500, (10, 60, 1), seed=31)
    outs, b_prompts = {}, set()
    for caching in (True, False):
        engine = _engine(caching, overlap=overlap, cuda_graph_max_tokens=32)
        engine.runner.capture_graphs(32, emulate=True)
        engine.add_request("a", a_prompt, Params(max_new_tokens=8, ignore_eos=True))
        engine.add_request("x", x_prompt, Params(max_new_tokens=2, ignore_eos=True))
        for _ in range(3 if overlap else 2):
            engine.step()  # a holds its first two tokens; x has 31 (overlapped: 12) to compute
        a = engine.requests["a"]
        assert a.num_computed_tokens == (12 if overlap else 11)
        b_prompt = a_prompt + a.output_token_ids[:2] + tail
        b_prompts.add(tuple(b_prompt))
        outs[caching] = _run(engine, [("b", b_prompt, Params(max_new_tokens=4, ignore_eos=True))])["b"]
        assert sum(engine.runner.pieces.replays.values()) and sum(engine.runner.graphs.replays.values())
    assert len(b_prompts) == 1
    assert outs[True].num_cached_tokens == 12
    assert outs[True].outputs[0].token_ids == outs[False].outputs[0].token_ids \
        == hf_greedy(ensure_builtin("tiny-llama"), b_prompt, 4)


@pytest.mark.parametrize("k", [0, 3, -1])
def test_a_prompt_logprob_chunk_holds_nothing_of_the_chunk_before(monkeypatch, k):
    """Prompt logprobs in chunks (ModelRunner._prompt_logprobs, memory.sizes.prompt_logprob_rows positions at a
    time: 2 here): when a chunk's logits are computed, nothing of the chunk before is still held on the device. Its
    [rows, 3 + 2k] float64 results were (16 bytes a top entry: a third more than a whole-vocabulary chunk's peak that
    prompt_logprob_row_bytes counts, beside the next one, and past the measured worst case, which runs one chunk),
    and its log-softmax with prompt_logprobs 0. The records equal those of one chunk of every position."""
    import weakref

    import torch

    from infer.engine import model_runner
    held = []
    real_ranks, real_copy = model_runner.token_ranks, torch.Tensor.copy_

    def ranks(logp, values):
        held.extend([weakref.ref(logp), weakref.ref(values)])
        return real_ranks(logp, values)

    def copy(self, src, *a, **kw):
        if isinstance(src, torch.Tensor) and src.dtype == torch.float64 and src.dim() == 2:
            held.append(weakref.ref(src))
        return real_copy(self, src, *a, **kw)
    prompt = random_prompts(500, (9,), seed=2)[0]
    params = Params(max_new_tokens=2, ignore_eos=True, prompt_logprobs=k)
    records = {}
    for seqs in (2, 8):
        engine = _engine(max_num_seqs=seqs, max_logprobs=-1)
        real_logits = engine.runner.model.compute_logits
        alive = []

        def logits(hidden, *a, **kw):
            alive.extend(r for r in held if r() is not None)
            held.clear()
            return real_logits(hidden, *a, **kw)
        monkeypatch.setattr(model_runner, "token_ranks", ranks)
        monkeypatch.setattr(torch.Tensor, "copy_", copy)
        engine.runner.model.compute_logits = logits
        try:
            out = _run(engine, [("p", prompt, params)])["p"]
        finally:
            monkeypatch.undo()
        assert not alive, f"{len(alive)} tensors of the chunk before held beside a chunk's logits"
        records[seqs] = [r and (r["token_id"], r["rank"], round(r["logprob"], 5),
                                [t["token_id"] for t in r.get("top_logprobs", [])]) for r in out.prompt_logprobs]
    assert len(records[2]) == len(prompt) and records[2] == records[8]
