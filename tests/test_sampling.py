"""Sampling per request: penalties and logprobs against HF, seeds, stop strings, stop ids, top-k/top-p."""

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, hf_model, random_prompts


@pytest.fixture(scope="module")
def llm():
    return LLM(str(ensure_builtin("tiny-llama")), block_size=4)


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(llm.engine.model_config.vocab_size, (6, 11, 17), seed=7)


def test_repetition_penalty_matches_hf(llm, prompts):
    path = llm.engine.model_path
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.3))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(path, p, 16, repetition_penalty=1.3)


def test_logprobs_match_hf(llm, prompts):
    p = prompts[0]
    out = llm.generate([p], SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=3))[0]
    m = hf_model(str(llm.engine.model_path))
    with torch.no_grad():
        logits = m(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
    for i, rec in enumerate(out.logprobs):
        assert rec["token_id"] == out.token_ids[i]
        assert abs(rec["logprob"] - float(logits[i, rec["token_id"]])) < 1e-4
        top = logits[i].topk(3)
        assert [t["token_id"] for t in rec["top_logprobs"]] == top.indices.tolist()


def test_same_seed_same_output_different_seed_differs(llm, prompts):
    sp = dict(max_new_tokens=24, ignore_eos=True, temperature=1.5, top_p=0.95)
    a = llm.generate(prompts, SamplingParams(seed=123, **sp))
    b = llm.generate(prompts[::-1], SamplingParams(seed=123, **sp))[::-1]  # other batch order, same result
    c = llm.generate(prompts, SamplingParams(seed=321, **sp))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_top_k_one_is_greedy(llm, prompts):
    greedy = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    topk1 = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_k=1))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def test_stop_strings_cut_text_and_stop_token_ids(llm, prompts):
    full = llm.generate([prompts[1]], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([prompts[1]], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.find(stop)] and stop not in out.text
    tid = full.token_ids[5]
    out = llm.generate([prompts[1]], SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=[tid]))[0]
    first = full.token_ids.index(tid)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]


def test_stream_deltas_add_up_to_the_text(llm, prompts):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    texts = {i: "" for i in range(len(prompts))}
    finals = {}
    for i, delta, out in llm.stream(prompts, params):
        texts[i] += delta
        if out.finished:
            finals[i] = out.text
    assert texts == finals


@pytest.mark.parametrize("kwargs", [dict(top_p=0), dict(top_p=1.5), dict(temperature=-1), dict(max_new_tokens=0),
                                    dict(top_k=-2), dict(logprobs=-2)])  # (99: the engine caps it, as vLLM)
def test_bad_sampling_params(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


def test_prompt_longer_than_max_length_is_rejected(llm):
    with pytest.raises(RequestError, match="max_length"):
        llm.engine.add_request("x", list(range(3, 40)), SamplingParams(max_length=20))
