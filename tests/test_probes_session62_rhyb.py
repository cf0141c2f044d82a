"""Review of the hybrid linear-attention models' state cache (engine.state_cache, models.qwen3_5): a slot a request
left non-finite does not poison the next sequence's zero state; sleep mode frees the states as the KV cache (never
copied, zeros on waking) and reload_weights keeps them; every path that ends a sequence (abort, stop, an
interrupted LLM.generate, n > 1 and beams past max_num_seqs, overlapped steps under preemption) gives its slot back,
with transformers' tokens."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import (add_greedy_requests, check_pooling_embeds_as_transformers,
                     check_prompt_logprobs_equal_transformers, check_requests_finish_as_transformers,
                     check_state_slots_all_free, greedy_each, greedy_tokens, hf_model, random_prompts, state_tensors)
from test_probes_parallel_bench_s35 import local_ray  # noqa: F401 (a fixture)

NAME = "tiny-qwen3_5"


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(NAME)))


def test_a_slot_left_non_finite_does_not_poison_a_one_token_prompt(hf):
    """Every slot holding NaN (what a request whose model output went non-finite leaves there): prompts of one token
    (their first step a decode from zero state, not NaN times zero) give transformers' tokens."""
    prompts = random_prompts(512, (1, 1), seed=3)
    with LLM(NAME, block_size=4, max_num_seqs=4) as llm:
        for t in state_tensors(llm):
            t.fill_(float("nan"))
        assert greedy_tokens(llm, prompts, 4) == greedy_each(hf, prompts, 4)
        check_state_slots_all_free(llm)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_states_as_the_kv_cache_and_reload_keeps_them(hf, level):
    """sleep(): the states are freed with the KV cache (not copied to host memory at level 1: worthless once the
    requests are aborted or preempted), zeros on waking (level 1: not the last run's); level 2's reload_weights()
    leaves them (it freed them: every later step failed): transformers' tokens after, every slot back."""
    prompts = random_prompts(512, (1, 13, 30, 9), seed=3)
    want = greedy_each(hf, prompts, 6)
    with LLM(NAME, block_size=4, max_num_seqs=4, enable_sleep_mode=True) as llm:
        assert greedy_tokens(llm, prompts, 6) == want
        assert any(bool(t.any()) for t in state_tensors(llm))  # (the last run's states)
        runner = llm.engine.runner
        kv_bytes = runner.kv_cache.untyped_storage().nbytes()
        llm.engine.sleep(level=level)
        assert sum(e.nbytes for e in llm.engine._sleep.slept["kv_cache"]) == \
            kv_bytes + runner.state_bytes + runner.snapshot_bytes  # (and the prefix cache's state snapshots)
        llm.engine.wake_up()
        if level == 2:
            llm.engine.reload_weights()
        assert all(not t.any() for t in state_tensors(llm))
        assert greedy_tokens(llm, prompts, 6) == want
        check_state_slots_all_free(llm)


def test_sleep_keep_resumes_running_requests_from_zero_state(hf):
    """sleep(mode="keep") with four requests mid-run (one-token prompts among them): preempted, their states
    dropped, recomputed from position 0 after wake_up: transformers' tokens, every slot back."""
    prompts = random_prompts(512, (1, 13, 30, 1), seed=8)
    with LLM(NAME, block_size=4, max_num_seqs=4, enable_sleep_mode=True) as llm:
        eng = llm.engine
        add_greedy_requests(eng, prompts, 8, steps=3)
        eng.sleep(level=1, mode="keep")
        check_state_slots_all_free(llm)
        eng.wake_up()
        check_requests_finish_as_transformers(llm, hf, prompts, 8)


def test_every_end_of_a_sequence_gives_its_slot_back(hf):
    """Two slots: an abort mid-run, a stop token, an LLM.generate interrupted mid-run, n=3 sampled sequences of two
    prompts, a beam search of width 3: every slot back after each, and greedy tokens equal transformers' after."""
    from infer.engine.beam import BeamSearchParams
    prompts = random_prompts(512, (5, 13, 30, 9), seed=3)
    want = greedy_each(hf, prompts, 8)
    with LLM(NAME, block_size=4, max_num_seqs=2) as llm:
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_new_tokens=8, ignore_eos=True))
        eng.step(), eng.step()
        for i in range(len(prompts)):
            eng.abort_request(str(i))
        while eng.has_unfinished_requests():
            eng.step()
        check_state_slots_all_free(llm)
        out = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=[want[1][2]]))
        assert out[1].token_ids == want[1][:3] and out[1].finish_reason == "stop"
        check_state_slots_all_free(llm)
        step, calls = eng.step, []

        def interrupted():
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return step()
        eng.step = interrupted
        with pytest.raises(KeyboardInterrupt):
            greedy_tokens(llm, prompts, 8)
        del eng.step
        while eng.has_unfinished_requests():
            eng.step()
        check_state_slots_all_free(llm)
        out = llm.generate(prompts[:2], SamplingParams(n=3, max_new_tokens=4, temperature=1.0, seed=1))
        assert [len(o.outputs) for o in out] == [3, 3]
        check_state_slots_all_free(llm)
        beams = llm.beam_search([{"prompt_token_ids": prompts[1]}], BeamSearchParams(beam_width=3, max_tokens=3,
                                                                                      ignore_eos=True))
        assert len(beams[0].sequences) == 3
        check_state_slots_all_free(llm)
        assert greedy_tokens(llm, prompts, 8) == want


def test_overlapped_steps_under_preemption_equal_transformers(hf):
    """Overlapped scheduling (the next step launched before this one completes: a slot freed by a sequence that
    finished or was preempted is taken by a later step only) under a KV budget that preempts: transformers'
    tokens, every slot back."""
    prompts = random_prompts(512, (20, 25, 17, 30, 1), seed=4)
    with LLM(NAME, block_size=4, num_kv_blocks=16, max_model_len=64, overlap=True) as llm:
        assert llm.engine.overlap
        assert greedy_tokens(llm, prompts, 12) == greedy_each(hf, prompts, 12)
        assert llm.engine.scheduler.num_preemptions > 0
        check_state_slots_all_free(llm)


def test_structured_output_and_prompt_logprobs(hf):
    """A JSON schema on three prompts through two slots: each reply parses as the schema asks; prompt_logprobs:
    transformers' log-probabilities of every prompt token (within 1e-4)."""
    import json

    from infer import StructuredOutputsParams
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    with LLM(NAME, block_size=4, max_num_seqs=2) as llm:
        out = llm.generate(prompts, SamplingParams(max_new_tokens=30, structured_outputs=StructuredOutputsParams(
            json=schema)))
        for o in out:
            assert o.finish_reason == "stop"
            got = json.loads(o.text)
            assert isinstance(got, list) and len(got) <= 3 and all(isinstance(x, int) for x in got)
        out = llm.generate(prompts, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
        check_state_slots_all_free(llm)
    assert all(o.prompt_logprobs[0] is None for o in out)
    check_prompt_logprobs_equal_transformers(hf, prompts, out)


def test_data_parallel_run_equals_one_engine_and_transformers(tmp_path, local_ray, hf):
    """`infer run --data-parallel 2` (in-process replicas) of five prompts and a bad line: one engine's records,
    each reply transformers' greedy tokens, the bad line an error record."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    prompts = random_prompts(512, (5, 13, 30, 1, 9), seed=3)
    lines = [{"id": str(i), "prompt_token_ids": p, "max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
             for i, p in enumerate(prompts)]
    lines.insert(2, {"id": "bad", "prompt_token_ids": [1, 2], "max_new_tokens": -1})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = {}
    for name, extra in (("one", ()), ("dp", ("--data-parallel", "2"))):
        res = CliRunner().invoke(app, ["run", NAME, str(src), "-o", str(tmp_path / name), "-q", "--max-num-seqs",
                                       "2", *extra])
        assert res.exit_code == 1, res.output  # (the bad line)
        records[name] = {r["id"]: r for r in map(json.loads, (tmp_path / name).read_text().splitlines())}
    assert records["dp"] == records["one"]
    assert "max_new_tokens must be in" in records["dp"]["bad"]["error"]
    assert [records["dp"][str(i)]["token_ids"] for i in range(len(prompts))] == greedy_each(hf, prompts, 6)


def test_served_concurrent_streams_and_a_disconnect(hf):
    """`infer serve` (in a thread, two slots): four concurrent streamed /v1/completions give transformers' greedy
    text; a client that disconnects after its first chunk frees its slot (the engine ends the request
    before its 400 tokens)."""
    pytest.importorskip("fastapi")
    import json
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from transformers import AutoTokenizer

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    prompts = random_prompts(512, (5, 13, 30, 1), seed=9)
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin(NAME)))
    want = [tok.decode(t) for t in greedy_each(hf, prompts, 8)]
    engine = LLMEngine(EngineConfig(NAME, block_size=4, max_model_len=512, max_num_seqs=2))

    def body(prompt, n):
        return {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    with serve_in_thread(Server(AsyncEngine(engine), NAME)) as base:
        def streamed(prompt) -> str:
            with httpx.stream("POST", f"{base}/v1/completions", json=body(prompt, 8), timeout=120) as s:
                return "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                               if line.startswith("data: {"))
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(streamed, prompts)) == want
        steps = engine.num_steps
        with httpx.stream("POST", f"{base}/v1/completions", json=body(prompts[2], 400), timeout=120) as s:
            next(line for line in s.iter_lines() if line.startswith("data: {"))
        for _ in range(600):  # (the server notices the disconnect and aborts the request)
            if engine.block_manager.states.num_free == 2 and not engine.has_unfinished_requests():
                break
            time.sleep(0.05)
        assert engine.block_manager.states.num_free == 2 and engine.block_manager.num_used_blocks == 0
        assert engine.num_steps - steps < 400  # (aborted, not run to its end)
        assert streamed(prompts[0]) == want[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_equals_transformers_in_the_same_dtype(hf, dtype):
    """--dtype bfloat16 / float16 (the conv state in the model's dtype, the recurrent state float32): transformers'
    greedy tokens in that dtype, batched, one-token prompt included."""
    import copy
    hf = copy.deepcopy(hf).to(getattr(torch, dtype))  # (hf_model's is cached: the other tests' float32 model)
    prompts = random_prompts(512, (5, 13, 30, 1), seed=3)
    with LLM(NAME, block_size=4, dtype=dtype, max_num_seqs=2) as llm:
        assert llm.engine.runner.model.linear_layers()[0].conv_state.dtype == getattr(torch, dtype)
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        check_state_slots_all_free(llm)


def test_a_pooling_runner_embeds_as_transformers(hf):
    """--runner pooling on Qwen3.5 (last-token pooling, normalized), prompts cut into steps of 8 tokens (the state
    carried across chunks): transformers' last hidden state, normalized, of each prompt; every slot back."""
    check_pooling_embeds_as_transformers(NAME, hf, random_prompts(512, (5, 30, 1, 19), seed=13))



def test_a_failing_step_in_llm_generate_gives_every_slot_back(hf, monkeypatch):
    """LLM.generate whose steps holding its third request raise (a kernel failure): those running with it end
    "error", the others transformers' tokens, every slot back; the engine then gives transformers' tokens."""
    from helpers import fail_steps_of
    prompts = random_prompts(512, (5, 13, 30, 9), seed=3)
    want = greedy_each(hf, prompts, 8)
    with LLM(NAME, block_size=4, max_num_seqs=2) as llm:
        with monkeypatch.context() as m:
            fail_steps_of(m, "llm-3")
            out = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert out[2].finish_reason == "error" and "simulated kernel failure" in out[2].error
        assert all(o.token_ids == w for o, w in zip(out, want) if o.finish_reason == "length")
        check_state_slots_all_free(llm)
        assert greedy_tokens(llm, prompts, 8) == want
