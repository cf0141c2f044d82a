"""LLM.beam_search (vLLM's, over the engine's one-token steps): with EOS ignored, each prompt's beams are
transformers' `generate(num_beams=k, num_return_sequences=k)` beams, best first, with their cumulative logprobs;
finished beams (EOS taken), length_penalty, adapters, bad params and prompts past the context."""

from __future__ import annotations

import math

import pytest
import torch

from infer import LLM, BeamSearchParams
from infer.engine.beam import BeamSearchSequence, score
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin

from helpers import hf_model, random_prompts


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


@pytest.fixture(scope="module")
def llm(path):
    with LLM(path, block_size=4, max_model_len=64) as engine:
        yield engine


def _hf_beams(path, prompt, width, n, **kw):
    m = hf_model(path)
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, num_beams=width, num_return_sequences=width,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kw)
    scores = getattr(out, "sequences_scores", None)  # (none for one beam: transformers then decodes greedily)
    return [row[len(prompt):].tolist() for row in out.sequences], None if scores is None else scores.tolist()


@pytest.mark.parametrize("width", [1, 3])
def test_beams_are_transformers_beams(llm, path, width):
    prompts = random_prompts(512, (5, 8), seed=2)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        beams, scores = _hf_beams(path, prompt, width, 6)
        assert [s.output_token_ids for s in out.sequences] == beams
        assert all(s.tokens[:len(prompt)] == prompt and s.finish_reason == "length" for s in out.sequences)
        for s, hf_score in zip(out.sequences, scores or []):  # transformers divides by the generated length
            assert math.isclose(s.cum_logprob / 6, hf_score, rel_tol=1e-4, abs_tol=1e-4)
            assert math.isclose(sum(s.logprobs[k][t] for k, t in enumerate(s.output_token_ids)), s.cum_logprob,
                                rel_tol=1e-6)
        assert out.sequences[0].text == llm.tokenizer.decode(out.sequences[0].tokens, skip_special_tokens=False)
    if width == 1:  # one beam is greedy decoding
        from infer import SamplingParams
        greedy = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert [o.sequences[0].output_token_ids for o in outs] == [g.token_ids for g in greedy]


def test_a_beam_that_ends_in_eos_is_finished_and_scored_without_it(llm, monkeypatch):
    """With EOS taken, a candidate ending in EOS leaves the search as a finished beam ("stop"), its score counting
    the length without the EOS; here the model's most likely second token is made the EOS."""
    prompt = [5, 9, 13]
    plain = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    second = plain.sequences[0].output_token_ids[1]
    monkeypatch.setattr(llm.engine, "eos_token_ids", {second})
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, include_stop_str_in_output=True))[0]
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped and all(s.output_token_ids[-1] == second for s in stopped)
    assert all(second not in s.output_token_ids for s in out.sequences if s.finish_reason == "length")
    scores = [score(s, {second}, 1.0) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    beam = BeamSearchSequence([1, 2, second], cum_logprob=-3.0, finish_reason="stop")
    assert score(beam, {second}, 1.0) == -1.5 and score(beam, {second}, 0.0) == -3.0


def test_length_penalty_orders_finished_and_running_beams():
    long = BeamSearchSequence([1] * 10, cum_logprob=-5.0)
    short = BeamSearchSequence([1] * 4, cum_logprob=-2.4)
    assert score(long, set(), 1.0) > score(short, set(), 1.0)  # -0.5 against -0.6
    assert score(long, set(), 0.0) < score(short, set(), 0.0)  # no penalty: the sums


def test_an_adapter_changes_the_beams(path, tmp_path):
    from lora_helpers import THREE, hf_float, save_adapter
    adapter = save_adapter(hf_float(path), tmp_path / "a", seed=5, **THREE["a"])
    with LLM(path, block_size=4, max_model_len=64, loras={"a": str(adapter)}) as llm:
        params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
        base, with_a = llm.beam_search([[5, 9, 13]] * 2, params, lora=[None, "a"])
        alone = llm.beam_search([5, 9, 13], params, lora="a")[0]
        assert [s.tokens for s in with_a.sequences] == [s.tokens for s in alone.sequences]
        assert [s.tokens for s in with_a.sequences] != [s.tokens for s in base.sequences]


@pytest.mark.parametrize("kw, match", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width must be an integer in 1..10"),
    ({"beam_width": 11, "max_tokens": 4}, "top logprobs stop at 20"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty must be a finite"),
    ({"beam_width": 2, "max_tokens": 4, "ignore_eos": "yes"}, "ignore_eos must be true or false"),
])
def test_bad_params_are_refused(kw, match):
    with pytest.raises(RequestError, match=match):
        BeamSearchParams(**kw)


def test_bad_calls_are_refused_before_anything_runs(llm):
    from infer import SamplingParams
    with pytest.raises(RequestError, match="takes a BeamSearchParams"):
        llm.beam_search(["hi"], SamplingParams())
    with pytest.raises(RequestError, match="outgrow the context"):
        llm.beam_search([[5] * 60], BeamSearchParams(beam_width=2, max_tokens=10))
    with pytest.raises(RequestError, match="chat messages"):
        llm.beam_search([[{"role": "user", "content": "hi"}]], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(RequestError, match="2 prompts but 1 lora"):
        llm.beam_search(["a", "b"], BeamSearchParams(beam_width=2, max_tokens=2), lora=[None])
    assert not llm.engine.requests


def test_samplingparams_beam_search_names_llm_beam_search():
    from infer import SamplingParams
    with pytest.raises(RequestError) as e:
        SamplingParams(use_beam_search=True)
    assert "llm.beam_search" in e.value.hint


def test_concurrency_limit_bounds_the_prompts_searched_at_once(llm, monkeypatch):
    """vLLM's concurrency_limit: the prompts are searched that many at a time, so a step runs at most
    limit x beam_width beams (the beams themselves are the same either way)."""
    sizes = []
    real = llm.generate
    monkeypatch.setattr(llm, "generate", lambda ids, *a, **kw: sizes.append(len(ids)) or real(ids, *a, **kw))
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompts = [[5, 9, 13], [7, 8, 9, 10], [3, 4], [6, 6, 6]]
    whole = llm.beam_search(prompts, params)
    assert max(sizes) == 4 * 2
    sizes.clear()
    limited = llm.beam_search(prompts, params, concurrency_limit=1)
    assert max(sizes) == 2 and len(sizes) == 4 * 3
    assert [[s.tokens for s in o.sequences] for o in limited] == [[s.tokens for s in o.sequences] for o in whole]
