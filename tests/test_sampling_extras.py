"""vLLM's sampling extensions (min_p, min_tokens, logit_bias, allowed_token_ids, include_stop_str_in_output,
skip_special_tokens, truncate_prompt_tokens) against their oracles: transformers' logits processors (MinP,
MinNewTokensLength, SequenceBias, PrefixConstrained) on random logits and through `generate` on the same weights,
the tokenizer's own decode, and vLLM's rules where transformers has none (stop strings under min_tokens)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from infer import LLM, SamplingParams
from infer.engine.sampler import Sampler
from infer.engine.sequence import Sequence
from infer.errors import RequestError

from helpers import hf_greedy, hf_model, random_prompts
from helpers import plain_llm as llm, tiny_llama_str as path  # noqa: F401 (fixtures)

V = 64


def _hf_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order: temperature, top-k, top-p, min-p; then softmax."""
    ids, scores = torch.zeros(1, 1, dtype=torch.long), row.unsqueeze(0).clone()
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0].softmax(-1)


@pytest.mark.parametrize("seed", range(4))
def test_min_p_is_transformers_min_p_after_top_k_and_top_p(seed):
    rng = random.Random(seed)
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(seed)) * 3
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=rng.choice([0.5, 1.0, 1.7]),
                                                  top_k=rng.choice([0, 5, 30]), top_p=rng.choice([1.0, 0.9, 0.6]),
                                                  min_p=rng.choice([0.0, 0.05, 0.2, 0.5, 1.0])))
            for i in range(8)]
    mine = Sampler.probs(logits, seqs)
    for row, seq, p in zip(logits, seqs, mine):
        want = _hf_probs(row, seq.params)
        assert torch.equal(p > 0, want > 0), (seq.params, p, want)
        assert torch.allclose(p / p.sum(), want, atol=1e-6)


def _first_draw(path, prompt: list[int], params: SamplingParams) -> int:
    """The engine's first sampled token, derived independently: transformers' logits for the prompt, its warpers,
    and the exponential race with the request's own seeded generator (engine.sampler's documented draw)."""
    with torch.no_grad():
        row = hf_model(path)(torch.tensor([prompt])).logits[0, -1].float()
    q = torch.empty(row.shape[-1]).exponential_(generator=torch.Generator().manual_seed(params.seed))
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return int((_hf_probs(row, params) / q).argmax())


def test_min_p_reaches_the_draw_of_a_request(path, llm):
    """min_p of a request changes which token a seeded draw picks exactly where transformers' MinP says so."""
    prompts = random_prompts(512, (5, 9, 7, 4), seed=3)
    differs = 0
    for i, prompt in enumerate(prompts):
        for min_p in (0.0, 0.3):
            p = SamplingParams(max_new_tokens=1, temperature=1.5, seed=100 + i, min_p=min_p)
            got = llm.generate([prompt], p)[0].token_ids[0]
            assert got == _first_draw(path, prompt, p)
        differs += _first_draw(path, prompt, SamplingParams(temperature=1.5, seed=100 + i)) != got
    assert differs  # the seeds were chosen so that min_p changes at least one draw: the check can fail


def _stop_token(path, prompt, at: int) -> int:
    return hf_greedy(path, prompt, at + 1)[at]


def test_min_tokens_masks_eos_and_stop_tokens_as_transformers_min_new_tokens(path, llm):
    prompt = random_prompts(512, (6,), seed=4)[0]
    stop = _stop_token(path, prompt, 1)  # greedy would stop at the 2nd token
    short = llm.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))[0]
    assert len(short.token_ids) == 2 and short.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=[stop], min_tokens=6),
                       )[0]
    want = hf_greedy(path, prompt, 12, eos_token_id=[stop], min_new_tokens=6)
    if stop in want:
        want = want[:want.index(stop) + 1]
    assert out.token_ids == want and len(want) > 6
    assert stop not in out.token_ids[:6]


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_ends_its_mask_after_exactly_min_tokens(path, overlap):
    """The stop token is greedy's choice right at index min_tokens (the first index it may be sampled): the reply
    stops there. With overlap the sampler prepares that step while the previous token is still on the device: the
    count of the reply's tokens includes it (num_pending), or the mask would last one token too long."""
    m = 3
    for seed in range(20):
        prompt = random_prompts(512, (6,), seed=seed)[0]
        greedy = hf_greedy(path, prompt, m + 1)
        if greedy[m] not in greedy[:m]:
            break
    stop = greedy[m]
    got = LLM(path, block_size=4, overlap=overlap).generate(
        [prompt], SamplingParams(max_new_tokens=12, stop_token_ids=[stop], min_tokens=m))[0]
    assert got.token_ids == greedy == hf_greedy(path, prompt, 12, eos_token_id=[stop], min_new_tokens=m)[:m + 1]
    assert got.finish_reason == "stop"


def test_logit_bias_is_transformers_sequence_bias(path, llm):
    prompts = random_prompts(512, (6, 9), seed=5)
    for prompt in prompts:
        base = hf_greedy(path, prompt, 8)
        bias = {base[0]: -100.0, base[2]: -3.5, 77: 4.0, "301": 2.5}  # JSON's keys are strings
        out = llm.generate([prompt], SamplingParams(max_new_tokens=8, logit_bias=bias, ignore_eos=True),
                           )[0]
        want = hf_greedy(path, prompt, 8, sequence_bias={(int(t),): b for t, b in bias.items()})
        assert out.token_ids == want and want != base


def test_allowed_token_ids_as_a_prefix_constraint(path, llm):
    prompt = random_prompts(512, (7,), seed=6)[0]
    allowed = [11, 40, 97, 260, 333, 480]
    out = llm.generate([prompt, prompt], [SamplingParams(max_new_tokens=8, allowed_token_ids=allowed, ignore_eos=True),
                                          SamplingParams(max_new_tokens=8, ignore_eos=True)])
    want = hf_greedy(path, prompt, 8, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert out[0].token_ids == want and set(want) <= set(allowed)
    assert out[1].token_ids == hf_greedy(path, prompt, 8)  # the row beside it is not restricted


def test_masks_and_penalties_in_one_batch(path, llm):
    """A batch mixing every processor, each row against transformers alone: the flat indices land in their rows."""
    prompts = random_prompts(512, (5, 8, 6, 7), seed=7)
    allowed = list(range(100, 140))
    params = [SamplingParams(max_new_tokens=6, logit_bias={5: 3.0, 9: -2.0}, ignore_eos=True),
              SamplingParams(max_new_tokens=6, allowed_token_ids=allowed, repetition_penalty=1.5, ignore_eos=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=6, logit_bias={200: 1.5}, repetition_penalty=2.0, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    wants = [hf_greedy(path, prompts[0], 6, sequence_bias={(5,): 3.0, (9,): -2.0}),
             hf_greedy(path, prompts[1], 6, prefix_allowed_tokens_fn=lambda b, i: allowed, repetition_penalty=1.5),
             hf_greedy(path, prompts[2], 6),
             hf_greedy(path, prompts[3], 6, sequence_bias={(200,): 1.5}, repetition_penalty=2.0)]
    assert [o.token_ids for o in outs] == wants


def test_include_stop_str_in_output_and_min_tokens_with_stop_strings(path, llm):
    prompt = random_prompts(512, (6,), seed=8)[0]
    whole = llm.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    text = whole.text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in
                text[i:i + 2])
    cut = llm.generate([prompt], SamplingParams(max_new_tokens=20, stop=[stop], ignore_eos=True))[0]
    kept = llm.generate([prompt], SamplingParams(max_new_tokens=20, stop=[stop], ignore_eos=True,
                                                 include_stop_str_in_output=True))[0]
    pos = text.index(stop)
    assert cut.text == text[:pos] and kept.text == text[:pos + len(stop)] and kept.stop_reason == stop
    # min_tokens: no stop string ending inside the first min_tokens tokens' text ends the reply (vLLM)
    n = len(cut.token_ids) + 2
    late = llm.generate([prompt], SamplingParams(max_new_tokens=20, stop=[stop], ignore_eos=True, min_tokens=n),
                        )[0]
    head = llm.tokenizer.decode(whole.token_ids[:n], skip_special_tokens=True)
    after = text.find(stop, len(head) - len(stop) + 1)
    assert late.text == (text[:after] if after != -1 else text) and len(late.token_ids) > n


def test_skip_special_tokens_false_keeps_their_text(path, llm):
    tok = llm.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = random_prompts(512, (6,), seed=9)[0]
    p = dict(max_new_tokens=6, ignore_eos=True, logit_bias={eos: 100.0})
    skipped = llm.generate([prompt], SamplingParams(**p))[0]
    kept = llm.generate([prompt], SamplingParams(**p, skip_special_tokens=False))[0]
    assert skipped.token_ids == kept.token_ids == [eos] * 6
    assert skipped.text == "" and kept.text == tok.decode(kept.token_ids, skip_special_tokens=False) == \
        "<|im_end|>" * 6
    # EOS ends a reply without its text, unless include_stop_str_in_output (vLLM)
    ended = llm.generate([prompt], SamplingParams(max_new_tokens=6, logit_bias={eos: 100.0},
                                                  skip_special_tokens=False))[0]
    shown = llm.generate([prompt], SamplingParams(max_new_tokens=6, logit_bias={eos: 100.0}, skip_special_tokens=False,
                                                  include_stop_str_in_output=True))[0]
    assert ended.token_ids == shown.token_ids == [eos] and ended.text == "" and shown.text == "<|im_end|>"


def test_truncate_prompt_tokens_keeps_the_last_tokens(path, llm):
    prompt = random_prompts(512, (12,), seed=10)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=5, truncate_prompt_tokens=4, ignore_eos=True),
                       )[0]
    assert out.prompt_token_ids == prompt[-4:] and out.token_ids == hf_greedy(path, prompt[-4:], 5)


@pytest.mark.parametrize("kw, words", [
    (dict(logit_bias={600: 1.0}), "logit_bias names a token id outside"),
    (dict(allowed_token_ids=[3, 9999]), "allowed_token_ids names a token id outside"),
    (dict(min_tokens=9, max_new_tokens=4), "min_tokens (9) must be at most max_new_tokens (4)"),
    (dict(logit_bias={5: 101}), "logit_bias values must be in [-100, 100]"),
    (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={5: float("nan")}), "must be a finite number"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must hold"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be at least 1"),
    (dict(skip_special_tokens="no"), "skip_special_tokens must be true or false"),
])
def test_bad_values_are_request_errors(llm, kw, words):
    with pytest.raises(RequestError) as e:
        llm.generate([[5, 6, 7]], SamplingParams(**kw))
    assert words in str(e.value)


def test_allowed_tokens_all_banned_by_min_tokens_is_refused(llm):
    eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(RequestError, match="every token in allowed_token_ids is an EOS or stop token"):
        llm.generate([[5, 6, 7]], SamplingParams(allowed_token_ids=[eos, 7], stop_token_ids=[7], min_tokens=2),
                     )


def test_other_names_are_refused_in_python_with_what_to_do():
    """(n was refused here until the Python API took it: tests/test_n_samples.py.)"""
    with pytest.raises(RequestError, match="infer spells it min_tokens"):
        SamplingParams(min_new_tokens=2)


def test_infer_run_lines_carry_the_extensions(path, llm):
    """A plain JSONL line and an OpenAI batch line (string keys in logit_bias, as JSON writes them) give the
    SamplingParams the Python API would build; a long text with truncate_prompt_tokens is not refused untokenized."""
    from infer.engine.inputs import parse_request
    fields = dict(min_p=0.1, min_tokens=2, logit_bias={"40": 1.5}, allowed_token_ids=[40, 41],
                  include_stop_str_in_output=True, skip_special_tokens=False, truncate_prompt_tokens=5)
    plain = parse_request({"prompt": "hello", **fields}, llm.tokenizer, "1")
    batch = parse_request({"custom_id": "b", "body": {"prompt": "hello", **fields}}, llm.tokenizer, "2")
    want = SamplingParams(**fields)
    assert plain.params == batch.params == want and want.logit_bias == {40: 1.5}
    long = parse_request({"prompt": "hello " * 5000, "truncate_prompt_tokens": 5}, llm.tokenizer, "3", max_tokens=64)
    assert len(long.prompt_token_ids) > 64  # the engine keeps the last 5
    out = llm.generate([long.prompt_token_ids], SamplingParams(max_new_tokens=2, truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == long.prompt_token_ids[-5:]
    with pytest.raises(RequestError, match="field 'logit_bias' must be object"):
        parse_request({"prompt": "x", "logit_bias": [1, 2]}, llm.tokenizer, "4")
