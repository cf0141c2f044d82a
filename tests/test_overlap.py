"""Overlapped steps (EngineConfig.overlap): step n+1 is launched before step n's tokens are handled on the host, its
input ids for those tokens taken on the device. Forced on here on CPU, the engine must give exactly what it gives
without overlap: same tokens, texts, finish reasons and stream of outputs, with stops, length limits, aborts,
preemption, seeds, penalties and (emulated) CUDA graphs, and no block left in use."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams

from helpers import drive_requests, hf_greedy, random_prompts, tiny_llama_str as path  # noqa: F401 (a fixture)

LENGTHS = (5, 9, 3, 14, 7, 11, 4, 20)


def _drive(llm, requests, abort_after: dict[str, int] | None = None, arrive_every: int = 0):
    """Feed `requests` [(id, prompt, params)] (one new one every `arrive_every` steps, or all at once), abort
    request r after its abort_after[r]-th output; returns {id: [(new_token_ids, delta_text, finished, reason)]}."""
    log, abort_after = {}, dict(abort_after or {})

    def record(out) -> bool:
        log.setdefault(out.request_id, []).append((out.new_token_ids, out.delta_text, out.finished,
                                                   out.finish_reason, out.token_ids))
        return abort_after.get(out.request_id) == len(log[out.request_id])
    drive_requests(llm, requests, record, arrive_every)
    return log


def _both(path, requests, **kw):
    engine_opts = kw.pop("engine", {})
    logs = []
    for overlap in (False, True):
        llm = LLM(path, block_size=4, overlap=overlap, **engine_opts)
        assert llm.engine.overlap is overlap
        logs.append(_drive(llm, requests, **kw))
    return logs


def _requests(path, params, seed=0):
    prompts = random_prompts(512, LENGTHS, seed=seed)
    return [(str(i), p, params[i % len(params)]) for i, p in enumerate(prompts)]


def test_greedy_with_stops_and_lengths_is_identical(path):
    prompts = random_prompts(512, LENGTHS, seed=0)
    full = LLM(path, block_size=4).generate(prompts[:1], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    lengths = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 7, 16)]
    requests = [(str(i), p, lengths[i % 4]) for i, p in enumerate(prompts)]
    requests += [("stop-text", prompts[0], SamplingParams(max_new_tokens=30, stop=[full.text[4:7]])),
                 ("stop-id", prompts[0], SamplingParams(max_new_tokens=30, stop_token_ids=[full.token_ids[3]])),
                 ("max-length", prompts[1], SamplingParams(max_new_tokens=12, max_length=len(prompts[1]) + 5))]
    off, on = _both(path, requests)
    assert on == off
    assert [off[r][-1][3] for r in ("stop-text", "stop-id", "max-length")] == ["stop", "stop", "length"]
    assert len(off["max-length"][-1][4]) == 5 and len(off["stop-id"][-1][4]) <= 4
    for rid, prompt, p in requests[:len(prompts)]:
        assert off[rid][-1][4] == hf_greedy(path, prompt, p.max_new_tokens)


def test_staggered_arrivals_and_preemption_are_identical(path):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (18, 25, 9, 30)]
    requests = _requests(path, params, seed=3)
    llms = []
    logs = []
    for overlap in (False, True):
        llm = LLM(path, block_size=4, overlap=overlap, num_kv_blocks=24, max_num_seqs=6, max_model_len=64)
        logs.append(_drive(llm, requests, arrive_every=2))
        llms.append(llm)
    assert logs[0] == logs[1]
    assert all(llm.engine.scheduler.num_preemptions > 0 for llm in llms)
    for rid, prompt, p in requests:
        assert logs[1][rid][-1][4] == hf_greedy(path, prompt, p.max_new_tokens)


def test_aborts_stop_a_request_with_a_prefix_of_its_tokens(path):
    requests = _requests(path, [SamplingParams(max_new_tokens=16, ignore_eos=True)])
    whole = _both(path, requests)[0]
    off, on = _both(path, requests, abort_after={"1": 3, "4": 1, "6": 9})
    for log in (off, on):
        for rid in ("1", "4", "6"):
            final = log[rid][-1]
            assert final[2] and final[3] == "abort"
            assert final[4] == whole[rid][-1][4][:len(final[4])]  # a prefix of the full reply
        assert {r: v for r, v in log.items() if r not in ("1", "4", "6")} == \
            {r: v for r, v in whole.items() if r not in ("1", "4", "6")}


def test_seeds_logprobs_and_penalties_are_identical(path):
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=7, logprobs=2),
              SamplingParams(max_new_tokens=12, temperature=1.2, seed=8, ignore_eos=True),
              SamplingParams(max_new_tokens=9, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.4),
              SamplingParams(max_new_tokens=11, logprobs=0, ignore_eos=True)]
    off, on = _both(path, _requests(path, params, seed=5))
    assert on == off
    llm = LLM(path, block_size=4, overlap=True)
    out = llm.generate(random_prompts(512, (6,), seed=1), params[0])[0]
    assert len(out.logprobs) == out.num_generated and out.logprobs[0]["token_id"] == out.token_ids[0]


def test_penalised_requests_see_every_token_they_generated(path):
    """Penalised batches overlap too: the token still on the device when the next step is prepared is counted in
    the penalty table on the device. With a strong repetition penalty a step that left it out would repeat it; the
    tokens are transformers'."""
    prompts = random_prompts(512, (4, 7, 5), seed=2)
    p = SamplingParams(max_new_tokens=16, repetition_penalty=8.0, ignore_eos=True)
    llm = LLM(path, block_size=4, overlap=True)
    runner, pending = llm.engine.runner, []
    prepare = runner.prepare

    def watched(batch, order=None, prev=None):
        pending.append(sum(s.num_pending for s in batch.seqs))
        return prepare(batch, order, prev)

    runner.prepare = watched
    outs = llm.generate(prompts, p)
    assert [o.token_ids for o in outs] == [hf_greedy(path, q, 16, repetition_penalty=8.0) for q in prompts]
    assert all(len(set(o.token_ids)) == 16 for o in outs)  # the penalty bites: no token twice
    assert sum(n == len(prompts) for n in pending) >= 10  # the steps overlapped: every row's last token pending
    assert not runner.penalties.rows


def test_penalties_through_preemption_aborts_and_reused_rows(path):
    """Penalised requests arriving over time through a small cache (preempted and recomputed), one aborted: a
    request's row in the penalty table is filled once, then takes only the tokens sampled since, and goes to a later
    request when it ends. Overlapped steps give the stream of steps that wait; the repetition penalty gives
    transformers' tokens."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, repetition_penalty=rp)
              for n, rp in ((18, 1.5), (25, 3.0), (9, 1.2), (30, 2.0))]
    params.append(SamplingParams(max_new_tokens=14, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5))
    requests = _requests(path, params, seed=4)
    llms, logs = [], []
    for overlap in (False, True):
        llm = LLM(path, block_size=4, overlap=overlap, num_kv_blocks=24, max_num_seqs=6, max_model_len=64)
        logs.append(_drive(llm, requests, abort_after={"2": 4}, arrive_every=2))
        llms.append(llm)
    assert logs[0] == logs[1]
    assert all(llm.engine.scheduler.num_preemptions > 0 for llm in llms)
    for rid, prompt, p in requests:
        if p.repetition_penalty != 1.0 and rid != "2":
            assert logs[1][rid][-1][4] == hf_greedy(path, prompt, p.max_new_tokens,
                                                   repetition_penalty=p.repetition_penalty)
    assert all(llm.engine.runner.penalties.used - 1 < len(requests) for llm in llms)  # rows were handed on


def test_prefill_chunks_beside_decodes_are_identical(path):
    """Prompts longer than a step's token budget run in chunks next to other requests' decodes: a chunk that does
    not finish its prompt samples nothing, so it leaves no token pending; overlapped steps give the same stream."""
    prompts = random_prompts(512, (3, 23, 5, 30), seed=6)
    requests = [(str(i), q, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for i, (q, n) in enumerate(zip(prompts, (12, 6, 9, 5)))]
    off, on = _both(path, requests, engine={"max_num_batched_tokens": 8, "max_num_seqs": 8}, arrive_every=1)
    assert on == off
    for rid, prompt, p in requests:
        assert on[rid][-1][4] == hf_greedy(path, prompt, p.max_new_tokens)


def test_emulated_cuda_graphs_take_pending_ids_from_the_device(path):
    prompts = random_prompts(512, (5, 9, 3, 12, 7), seed=11)
    lens = [3, 6, 9, 12, 15]
    llm = LLM(path, max_num_seqs=8, block_size=4, num_kv_blocks=128, max_model_len=96, overlap=True)
    llm.engine.runner.capture_graphs(96, emulate=True)
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens])
    assert sum(llm.engine.runner.graphs.replays.values()) >= 10
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, n) for p, n in zip(prompts, lens)]


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_overlap_gives_the_tokens_of_plain_steps(path, eager):
    prompts = random_prompts(512, LENGTHS, seed=4)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 9, 17, 30)]
    params += [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3, logprobs=1)]
    got = {}
    for overlap in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", max_num_seqs=8, block_size=16, enforce_eager=eager,
                  overlap=overlap, num_kv_blocks=128, max_model_len=256)  # small: several engines in one process
        outs = llm.generate(prompts, [params[i % len(params)] for i in range(len(prompts))])
        got[overlap] = [(o.token_ids, o.finish_reason) for o in outs]
        assert llm.engine.block_manager.num_used_blocks == 0
    assert got[True] == got[False]
    for i in range(4):
        assert got[True][i][0] == hf_greedy(path, prompts[i], params[i].max_new_tokens)


@pytest.mark.gpu
def test_gpu_decode_steps_never_wait_for_the_device_before_their_one_copy(path):
    """A steady decode step with overlap, sampling included, queues its work without a single synchronising
    call (torch's sync debug mode raises on one); the step's one wait is the event of the previous step's copy."""
    import torch
    llm = LLM(path, device="cuda", max_num_seqs=8, block_size=16, num_kv_blocks=128, max_model_len=256)
    assert llm.engine.overlap
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True),
              SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.7, top_k=20, top_p=0.9, seed=1),
              SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=1.0, logprobs=3)]
    for i, p in enumerate(params * 2):
        llm.engine.add_request(str(i), random_prompts(512, (7 + i,), seed=i)[0], p)
    for _ in range(4):  # prefills, first graph replays
        llm.engine.step()
    eng = llm.engine
    batch, prev = eng._inflight  # launched, its tokens pending: the next step reads them on the device
    nxt = eng.scheduler.schedule()
    eng.runner.zero_blocks(eng.block_manager.fresh)
    eng.block_manager.fresh.clear()
    assert all(s.num_pending == 1 for s in nxt.seqs)
    torch.cuda.set_sync_debug_mode("error")
    try:
        handle = eng.runner.launch(nxt, prev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eng._launched(nxt, handle.rows)
    eng._inflight = (nxt, handle)
    assert eng._complete(batch, prev.result()) and len(handle.rows) == 6
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert sorted(outs) == [str(i) for i in range(6)] and all(o.num_generated == 40 for o in outs.values())


def _three_adapters(path, tmp_path, seed: int):
    """Three saved adapters of the tiny model, six prompts and the adapter of each (None: the base model)."""
    from lora_helpers import hf_float, save_three
    loras = {n: str(p) for n, p in save_three(hf_float(path), tmp_path, 1).items()}
    return loras, random_prompts(512, (7, 12, 5, 9, 16, 6), seed=seed), ["a", "b", None, "a", "c", "b"]


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_steps_with_mixed_adapters_and_swaps_never_wait_for_the_device(path, tmp_path, monkeypatch, eager):
    """The same with three adapters through two device slots: whole engine steps (scheduling, which swaps an
    adapter in; a prefill beside decodes; decode steps, graph replays or eager, with mixed adapters; output
    handling) make no synchronising call but the one wait for the previous step's copy (`StepHandle.result`, let
    through here); the adapter map travels with the step's other integer inputs. Tokens equal plain steps'."""
    import torch

    from infer.engine.model_runner import StepHandle
    wait = StepHandle.result

    def allowed_wait(self):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return wait(self)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    monkeypatch.setattr(StepHandle, "result", allowed_wait)
    loras, prompts, names = _three_adapters(path, tmp_path, seed=8)
    got = {}
    for overlap in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", max_num_seqs=8, block_size=16, num_kv_blocks=128,
                  max_model_len=256, enforce_eager=eager, overlap=overlap, loras=loras, max_loras=2, max_lora_rank=8)
        eng, steps = llm.engine, 0
        for i, (p, n) in enumerate(zip(prompts, names)):
            eng.add_request(str(i), p, SamplingParams(max_new_tokens=24, ignore_eos=True), lora=n)
        outs = {}
        while eng.has_unfinished_requests():
            steps += 1
            if overlap and steps > 2:  # past the engine's first steps: every later step is checked
                torch.cuda.set_sync_debug_mode("error")
            try:
                done = [o for o in eng.step() if o.finished]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            outs.update({o.request_id: o.token_ids for o in done})
        got[overlap] = outs
        assert eng.stats()["lora_swaps"] > 2 and eng.block_manager.num_used_blocks == 0
    assert got[True] == got[False] and len(got[True]) == 6


def _lora_calls(monkeypatch, method: str) -> list[int]:
    """The token counts of every call of LoRALayer.`method` from now on (a spy that calls through)."""
    from infer.lora.layer import LoRALayer
    calls, real = [], getattr(LoRALayer, method)

    def counted(self, base, x, batch):
        calls.append(x.shape[0])
        return real(self, base, x, batch)
    monkeypatch.setattr(LoRALayer, method, counted)
    return calls


def _mixed_adapter_tokens(path, adapters, **config) -> dict:
    """{request id: greedy tokens} of `_three_adapters`' six requests (24 tokens each) on the GPU in float32, with
    the engine options `config`."""
    loras, prompts, names = adapters
    llm = LLM(path, device="cuda", dtype="float32", max_num_seqs=8, block_size=16, num_kv_blocks=128,
              max_model_len=256, loras=loras, max_loras=3, max_lora_rank=8, **config)
    eng = llm.engine
    for i, (p, n) in enumerate(zip(prompts, names)):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=24, ignore_eos=True), lora=n)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    llm.close()
    return outs


@pytest.mark.gpu
def test_gpu_lora_shrink_beside_the_matmul_gives_the_tokens_of_one_stream(path, tmp_path, monkeypatch):
    """EngineConfig.lora_streams: in the decode graphs every LoRA layer's shrink runs on a second stream beside the
    base matmul (two branches per layer in the captured graph), and with lora_expand_beside the expand too. Greedy
    tokens of mixed adapters in float32 equal those with every shrink on the main stream and those of eager steps,
    and the graphs did take that path."""
    calls = _lora_calls(monkeypatch, "apply_beside")
    adapters = _three_adapters(path, tmp_path, seed=9)
    got = {}
    for eager, streams, expand_beside in ((False, None, False), (False, None, True), (False, False, False),
                                          (True, None, False)):
        calls.clear()
        got[eager, streams, expand_beside] = _mixed_adapter_tokens(path, adapters, enforce_eager=eager,
                                                                   lora_streams=streams,
                                                                   lora_expand_beside=expand_beside)
        assert bool(calls) == (not eager and streams is None)  # captured once per graph size and layer, not replayed
    first = got[False, None, False]
    assert all(outs == first for outs in got.values()) and len(first) == 6


@pytest.mark.gpu
def test_gpu_lora_expands_in_their_consumers_give_the_tokens_of_the_expand_launches(path, tmp_path, monkeypatch):
    """EngineConfig.lora_expand_in_norm (on by default): the o and down expands added by the rms_norm after them;
    lora_expand_fused: the gate_up expand added by silu_and_mul, a decode step's qkv expand by the decode attention
    (LoRALayer.deferred), each switch alone and both, in the decode graphs (the shrink beside the matmul) and
    eagerly. Greedy tokens of mixed adapters in float32 equal those with every expand launched after its matmul,
    and the deferred path was taken where one is on."""
    calls = _lora_calls(monkeypatch, "deferred")
    adapters = _three_adapters(path, tmp_path, seed=5)
    got = {}
    for eager, fused, in_norm in ((False, False, False), (False, False, True), (False, True, True),
                                  (False, True, False), (True, False, True), (True, True, True)):
        calls.clear()
        got[eager, fused, in_norm] = _mixed_adapter_tokens(path, adapters, enforce_eager=eager,
                                                           lora_expand_fused=fused, lora_expand_in_norm=in_norm)
        assert bool(calls) == (fused or in_norm)
    first = got[False, False, False]
    assert all(outs == first for outs in got.values()) and len(first) == 6
