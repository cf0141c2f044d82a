"""vLLM's `n` in the Python API and its `RequestOutput.outputs`: LLM.generate / LLM.chat with SamplingParams(n=k)
give one output per prompt holding k samples, sample j being exactly what the prompt gives alone with
`params.sample(j)` (seed + j, as vLLM's parallel sampling and infer's server draw), and the server's `n` choices are
the same samples; a plain output's `outputs[0]` is itself, so vLLM code that reads `out.outputs[0].text` runs."""

from __future__ import annotations

import pytest

from infer import LLM, CompletionOutput, SamplingParams
from infer.engine.llm_engine import LLMEngine
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin

PROMPTS = ["hello world", "the cat sat on", [5, 9, 14, 20, 7]]


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4, max_num_seqs=16) as llm:
        yield llm


def _alone(llm, prompt, params, j) -> list[int]:
    return llm.generate(prompt, params.sample(j))[0].token_ids


def test_n_samples_are_the_prompts_own_draws_with_seed_plus_j(llm):
    params = SamplingParams(max_new_tokens=8, temperature=1.3, seed=11, n=3, logprobs=1)
    outs = llm.generate(PROMPTS, params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        assert [o.index for o in out.outputs] == [0, 1, 2]
        for j, sample in enumerate(out.outputs):
            assert isinstance(sample, CompletionOutput)
            assert sample.token_ids == _alone(llm, prompt, params, j)
            assert sample.cumulative_logprob == pytest.approx(sum(r["logprob"] for r in sample.logprobs))
            assert len(sample.logprobs) == len(sample.token_ids) and sample.finished()
        assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
        assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different draws, not one copied
        assert out.usage == {"prompt_tokens": len(out.prompt_token_ids),
                             "completion_tokens": sum(len(o.token_ids) for o in out.outputs)}
    assert params.sample(0).seed == 11 and params.sample(2).seed == 13 and params.sample(2).n == 1


def test_a_list_of_params_mixes_n_per_prompt_and_keeps_the_order(llm):
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=3, n=2), SamplingParams(max_new_tokens=6),
              SamplingParams(max_new_tokens=4, temperature=0.7, n=3)]
    outs = llm.generate(PROMPTS, params)
    assert [len(o.outputs) for o in outs] == [2, 1, 3]
    assert outs[0].outputs[1].token_ids == _alone(llm, PROMPTS[0], params[0], 1)
    assert outs[1].token_ids == llm.generate(PROMPTS[1], params[1])[0].token_ids
    assert all(len(o.token_ids) == 4 or o.finish_reason == "stop" for o in outs[2].outputs)


def test_greedy_samples_are_all_the_greedy_reply_and_chat_takes_n(llm):
    out = llm.generate("hello world", SamplingParams(max_new_tokens=6, n=4))[0]
    greedy = llm.generate("hello world", SamplingParams(max_new_tokens=6))[0]
    assert [o.token_ids for o in out.outputs] == [greedy.token_ids] * 4
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=5, temperature=1.0, seed=2,
                                                                          n=2))[0]
    assert len(chat.outputs) == 2
    assert chat.outputs[1].token_ids == llm.chat([{"role": "user", "content": "hi"}],
                                                 SamplingParams(max_new_tokens=5, temperature=1.0, seed=3))[0].token_ids


def test_a_plain_output_is_its_own_first_sample(llm):
    out = llm.generate("hello", SamplingParams(max_new_tokens=4))[0]
    (only,) = out.outputs
    assert (only.index, only.text, only.token_ids, only.finish_reason, only.stop_reason) == (
        0, out.text, out.token_ids, out.finish_reason, out.stop_reason)
    assert only.cumulative_logprob is None and only.logprobs is None


@pytest.mark.parametrize("value,message", [(0, "n must be in 1..1024"), (1025, "n must be in 1..1024"),
                                           (1.5, "n must be an integer"), (True, "n must be an integer")])
def test_bad_n_is_refused(value, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(n=value)


def test_stream_gives_each_sample_its_own_events_with_its_index(llm):
    """stream() with n > 1 (it refused n > 1): each sample's deltas add up to generate()'s sample of that index,
    `outputs[0].index` names the sample, and each sample's last event is finished."""
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=3), SamplingParams(max_new_tokens=5)]
    want = llm.generate(["hello", "the cat"], params)
    texts, ends = {}, {}
    for i, delta, out in llm.stream(["hello", "the cat"], params):
        (c,) = out.outputs
        assert not ends.get((i, c.index)), "an event after the sample finished"
        texts[(i, c.index)] = texts.get((i, c.index), "") + delta
        ends[(i, c.index)] = out.finished
        if i == 0:
            assert c.text == out.text and c.token_ids == out.token_ids
    assert set(texts) == {(0, 0), (0, 1), (0, 2), (1, 0)} and all(ends.values())
    for j in range(3):
        assert texts[(0, j)] == want[0].outputs[j].text
    assert texts[(1, 0)] == want[1].text
    assert len({texts[(0, j)] for j in range(3)}) > 1  # seeds 3, 4, 5: not one sample thrice


def test_the_engine_says_where_n_is_answered(llm):
    engine: LLMEngine = llm.engine
    with pytest.raises(RequestError, match="an engine request is one sample.*params.sample\\(j\\)"):
        engine.add_request("x", [5, 6], SamplingParams(n=2))
    assert "x" not in engine.requests


def test_a_bad_prompt_among_samples_queues_nothing(llm):
    with pytest.raises(RequestError, match="prompt 1: "):
        llm.generate(["fine", [10**9]], SamplingParams(max_new_tokens=3, n=3))
    assert not llm.engine.scheduler.has_unfinished()  # the samples queued before it were taken back out
    assert len(llm.generate("fine", SamplingParams(max_new_tokens=3, n=2))[0].outputs) == 2


def test_the_servers_n_choices_are_the_same_samples():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=16))
    with LLM("tiny-llama", block_size=4, max_num_seqs=16) as direct, \
            serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        body = {"prompt": [5, 9, 14, 20], "n": 3, "max_tokens": 6, "temperature": 1.2, "top_p": 1.0, "seed": 21,
                "return_token_ids": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        served = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        mine = direct.generate([5, 9, 14, 20], SamplingParams(max_new_tokens=6, temperature=1.2, seed=21, n=3))[0]
        assert served == [o.token_ids for o in mine.outputs]
