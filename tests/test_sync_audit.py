"""The engine's GPU code path never makes the host wait for the GPU inside a step (issue: "the GPU never waits for
Python between decode steps"), checked on CPU: whole engine steps run through the Triton kernels (interpreted) and
emulated CUDA graphs under `infer.bench.sync_audit.SyncAudit`, which records every call that would synchronise on
CUDA. The one wait a step may make is for the previous step's sampled tokens (`StepHandle.result`). On a GPU, the
`-m gpu` tests of test_overlap.py check the same with torch's sync debug mode.

The same runs count the host-to-device copies a step queues (`SyncAudit.copies`): one for a greedy step (every
integer input in one packed copy), at most two with sampled rows (the sampling parameters' floats apart)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams, kernels
from infer.bench.sync_audit import SyncAudit
from infer.lora.batch import LoRABatch
from infer.lora.manager import LoRAManager
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import THREE, hf_float, save_adapter

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU checks this with sync debug mode")
OPTS = dict(block_size=4, num_kv_blocks=160, max_model_len=64, max_num_seqs=8, overlap=True, max_loras=2,
            max_lora_rank=8, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = ensure_builtin("tiny-llama")
    tmp = tmp_path_factory.mktemp("sync")
    hf = hf_float(path)
    return str(path), {n: str(save_adapter(hf, tmp / n, seed=i + 1, **kw)) for i, (n, kw) in enumerate(THREE.items())}


def _step(eng, audit: SyncAudit | None, log: list) -> list:
    """eng.step(); appends (whether it launched a batch, the copies it made, whether a scheduled sequence had a
    token pending on the device) to `log`."""
    steps, copies = eng.num_steps, len(audit.copies) if audit else 0
    pending = any(s.num_pending for s in eng.scheduler.running)
    outs = eng.step()
    log.append((eng.num_steps > steps, (len(audit.copies) if audit else 0) - copies, pending))
    return outs


def _serve_a_mix(llm, audit: SyncAudit | None = None, log: list | None = None) -> dict:
    """Requests as a server meets them, all through engine steps: three adapters through two slots (swaps) beside
    the base model, greedy and sampled rows (top-k/top-p/min-p, seeds, penalties, logprobs, allowed_token_ids,
    min_tokens, logit_bias, prompt_logprobs), prompts longer than a step's token budget (chunked prefill), a prompt
    whose prefix is cached, a request aborted mid-run. `log`: see _step."""
    eng = llm.engine
    prompts = random_prompts(eng.model_config.vocab_size, (7, 30, 5, 9, 16, 6), seed=8)
    prompts.append(prompts[1][:20] + [3, 4])
    names = ["a", "b", None, "a", "c", "b", "b"]
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, allowed_token_ids=list(range(3, 300)),
                             prompt_logprobs=2),
              SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=5, seed=1,
                             logprobs=2, repetition_penalty=1.1, presence_penalty=0.5, min_p=0.05, min_tokens=3,
                             stop_token_ids=[7], logit_bias={5: 1.0, 9: -2.0})]
    for i, (p, n) in enumerate(zip(prompts, names)):
        eng.add_request(str(i), p, params[i % 2], lora=n)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.finish_reason for o in _step(eng, audit, log if log is not None else [])
                     if o.finished})
        steps += 1
        if steps == 3:
            eng.abort_request("3")
    assert eng.stats()["lora_swaps"] >= 3 and eng.block_manager.num_used_blocks == 0
    return done


@pytest.mark.parametrize("graphs", [True, False])
def test_engine_steps_on_the_gpu_code_path_never_wait_for_the_device(tiny, monkeypatch, graphs):
    path, loras = tiny
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    llm = LLM(path, loras=loras, **OPTS)
    if graphs:
        llm.engine.runner.capture_graphs(64, emulate=True)
    log = []
    with SyncAudit() as audit:
        done = _serve_a_mix(llm, audit, log)
    assert len(done) == 7 and done["3"] == "abort"
    assert not audit.found, "calls that wait for the GPU inside engine steps:\n" + audit.report()
    if graphs:
        assert sum(llm.engine.runner.graphs.replays.values()) >= 5
    launched = [copies for ran, copies, _ in log if ran]
    assert max(launched) <= 2 and 2 in launched, f"copies per step {launched}: {audit.copies}"
    assert all(copies == 0 for ran, copies, _ in log if not ran)


@pytest.mark.parametrize("graphs, adapters", [(True, True), (False, False)], ids=["True-True", "False-False"])
def test_a_greedy_step_makes_one_host_to_device_copy(tiny, monkeypatch, graphs, adapters):
    """Greedy steps (prefills, chunks, decodes, fresh KV blocks to zero, overlapped so that the previous step's
    tokens are taken on the device) queue exactly one copy each: token ids, positions, slots, adapter slots, block
    tables, the rows to sample, the pending tokens' places and the blocks to zero travel together. Graphs with
    adapters, and eager steps without; the two mixed cases (graphs without adapters, adapters without graphs) are
    left out since the suite runs in parallel: they took 100 s of CI's 2 cores (the steps with sampled rows of
    test_engine_steps_on_the_gpu_code_path_never_wait_for_the_device run both with and without graphs)."""
    path, loras = tiny
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    llm = LLM(path, loras=loras if adapters else None, **OPTS)
    eng = llm.engine
    if graphs:
        eng.runner.capture_graphs(64, emulate=True)
    prompts = random_prompts(eng.model_config.vocab_size, (7, 30, 5, 12, 3), seed=4)
    names = ["a", None, "b", "c", "a"] if adapters else [None] * 5
    for i, (p, n) in enumerate(zip(prompts, names)):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=6 + i, ignore_eos=True), lora=n)
    log = []
    with SyncAudit() as audit:
        while eng.has_unfinished_requests():
            _step(eng, audit, log)
    assert not audit.found, audit.report()
    copies = [c for ran, c, _ in log if ran]
    assert copies == [1] * len(copies), f"copies per step {copies}: {audit.copies}"
    assert all(c == 0 for ran, c, _ in log if not ran)
    assert sum(1 for ran, _, pending in log if ran and pending) >= 5  # overlapped: pending tokens filled in
    if graphs:
        assert sum(eng.runner.graphs.replays.values()) >= 5
    if adapters:
        assert eng.stats()["lora_swaps"] >= 1


def test_the_audit_sees_calls_that_wait(tiny, monkeypatch):
    """The audit is not blind: a step that builds its adapter map with torch.tensor(..., device=) (a copy from
    pageable memory) is reported at that line, and so is a value read back on the host inside infer's code."""
    path, loras = tiny
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(LoRAManager, "make_batch", lambda self, slots, on_device=None, groups=None:
                        LoRABatch.build(slots, self.max_loras, self.device))
    llm = LLM(path, loras=loras, **OPTS)
    eng = llm.engine
    for i, (p, n) in enumerate(zip(random_prompts(eng.model_config.vocab_size, (5, 3), seed=2), ["a", None])):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=2, ignore_eos=True), lora=n)
    with SyncAudit() as audit:  # a prefill and a decode with an adapter beside the base model
        while eng.has_unfinished_requests():
            eng.step()
    assert any(site.startswith("infer/lora/batch.py") and "torch.tensor" in why for site, why in audit.found)
    from infer.kernels import attention
    q = torch.randn(3, 2, 16)
    cache = torch.zeros(4, 4, 2, 16)
    with SyncAudit() as audit:  # without max_query_len the launcher reads the longest query back
        attention.paged_attention(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32),
                                  torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 0.25)
    assert [why for site, why in audit.found if site.startswith("infer/kernels/attention.py")] == [
        "reads a tensor's value on the host (.item(), int(), float(), bool())"]
