"""Speculative decoding for requests whose sampling has per-token state (session 46): penalties, structured outputs,
bad_words and min_tokens get drafts, and at verify row j every logits processor sees the state the request would
have with drafts[:j] accepted. The proof: greedy replies token for token equal to the plain engine's, with drafts
verified and accepted; and each verify row's scores equal those of the plain sampler after drafts[:j]."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.sampler import Sampler, SamplingInputs
from infer.engine.sequence import Sequence

from helpers import FEW, NGRAM_SPEC as SPEC, random_prompts
from helpers import ngram_llm as spec, plain_llm as plain, tiny_llama_path as path  # noqa: F401 (fixtures)

VOCAB = 40


def counters(llm) -> tuple[int, int]:
    s = llm.engine.stats()
    return s["spec_decode_num_drafts"], s["spec_decode_num_accepted_tokens"]


def same_with_drafts(plain, spec, prompts, params, loras=None):
    """spec's greedy replies equal plain's, and spec verified drafts of these requests and accepted some."""
    drafts, accepted = counters(spec)
    want = [o.token_ids for o in plain.generate(prompts, params, lora=loras)]
    got = [o.token_ids for o in spec.generate(prompts, params, lora=loras)]
    assert got == want
    after = counters(spec)
    assert after[0] > drafts and after[1] > accepted, (after, drafts, accepted)
    assert spec.engine.block_manager.num_used_blocks == 0
    return got


def verify_rows_equal_plain_rows(params: SamplingParams, prompt, output, drafts, setup=None):
    """The sampler's scores (masks and penalties applied) and draw distribution at the k + 1 verify rows of a
    sequence with `drafts` equal, row j, those of the same sequence with drafts[:j] appended to its output."""
    def seq(out, d):
        s = Sequence("r", list(prompt), params)
        s.output_token_ids = list(out)
        s.draft_token_ids = list(d)
        if setup is not None:
            setup(s)
        return s
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=g)
    sampler = Sampler(0)
    s = seq(output, drafts)
    rows = [s] * (len(drafts) + 1)
    x, _, _ = sampler._greedy(logits, rows, SamplingInputs.build(rows, VOCAB, torch.device("cpu")))
    for j in range(len(drafts) + 1):
        one = [seq(list(output) + list(drafts[:j]), [])]
        y, _, _ = sampler._greedy(logits[j:j + 1], one, SamplingInputs.build(one, VOCAB, torch.device("cpu")))
        assert torch.equal(x[j:j + 1], y), j
        if not params.greedy:
            assert torch.allclose(Sampler.probs(x[j:j + 1], one), Sampler.probs(y, one))


# ------------------------------------------------------------------ penalties
PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
             dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)]


@pytest.mark.parametrize("extra", PENALTIES)
def test_penalised_greedy_replies_equal_plain_with_drafts_accepted(plain, spec, extra):
    prompts = random_prompts(plain.engine.model_config.vocab_size, (6, 10, 8), seed=9)
    params = SamplingParams(**{"max_new_tokens": 24, "ignore_eos": True, "allowed_token_ids": FEW, **extra})
    same_with_drafts(plain, spec, prompts, params)


def test_penalised_requests_batched_with_plain_ones_and_a_prefix_cache_hit(plain, spec):
    vocab = plain.engine.model_config.vocab_size
    prompts = random_prompts(vocab, (7, 12, 9, 5), seed=3)
    pen = SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW, repetition_penalty=1.2,
                         frequency_penalty=0.3)
    free = SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW)
    params = [pen, free, pen, free]
    drafts, accepted = counters(spec)
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    again = [p + o[:10] for p, o in zip(prompts, got)]  # the prompt and part of the reply: a prefix cache hit
    hits = spec.engine.block_manager.prefix_hits
    assert [o.token_ids for o in spec.generate(again, params)] == \
        [o.token_ids for o in plain.generate(again, params)]
    assert spec.engine.block_manager.prefix_hits > hits
    assert counters(spec)[0] > drafts and counters(spec)[1] > accepted


@pytest.mark.parametrize("extra", PENALTIES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalties_at_each_verify_row_count_the_drafts_before_it(extra, temperature):
    params = SamplingParams(temperature=temperature, **extra)
    verify_rows_equal_plain_rows(params, [3, 4, 5], [5, 9, 9], [9, 5, 12])


# ------------------------------------------------------------------ structured outputs
SCHEMA = '{"type":"object","properties":{"a":{"type":"array","items":{"type":"integer"}}},"required":["a"]}'


def structured(**kw):
    pytest.importorskip("xgrammar")
    from infer.engine.sampling_params import StructuredOutputsParams
    return StructuredOutputsParams(**kw)


def drafts_checked(monkeypatch, llm):
    """Wraps llm's verify: every draft of a request with a grammar is one its matcher accepts (after the drafts
    before it); the matcher is left as it was. Returns the list of the drafts seen."""
    seen = []
    real = llm.engine.runner.verify

    def verify(batch):
        for seq in batch.seqs:
            if seq.grammar is not None and seq.draft_token_ids:
                for t in seq.draft_token_ids:
                    assert seq.grammar.accept_token(t) and not seq.grammar.is_terminated()
                seq.grammar.rollback(len(seq.draft_token_ids))
                seen.append(list(seq.draft_token_ids))
        return real(batch)
    monkeypatch.setattr(llm.engine.runner, "verify", verify)
    return seen


@pytest.mark.parametrize("kind", ["regex", "json", "choice", "json_object"])
def test_structured_greedy_replies_equal_plain_with_drafts_accepted(plain, spec, monkeypatch, kind):
    so = {"regex": dict(regex="[ab]{30}"), "json": dict(json=SCHEMA), "choice": dict(choice=["abababab", "bababa"]),
          "json_object": dict(json_object=True)}[kind]
    params = SamplingParams(max_new_tokens=30, structured_outputs=structured(**so))
    prompts = random_prompts(plain.engine.model_config.vocab_size, (6, 10, 8), seed=9) + [[5, 6, 7, 8] * 4]
    seen = drafts_checked(monkeypatch, spec)
    got = same_with_drafts(plain, spec, prompts, params)
    assert seen and all(got)


def test_structured_requests_mixed_with_penalised_and_plain_ones(plain, spec, monkeypatch):
    vocab = plain.engine.model_config.vocab_size
    prompts = random_prompts(vocab, (7, 12, 9, 5, 6), seed=4)
    regex = structured(regex="[ab]{24}")
    params = [SamplingParams(max_new_tokens=24, structured_outputs=regex),
              SamplingParams(max_new_tokens=24, ignore_eos=True, allowed_token_ids=FEW),
              SamplingParams(max_new_tokens=24, structured_outputs=regex, repetition_penalty=1.2),
              SamplingParams(max_new_tokens=24, structured_outputs=structured(json=SCHEMA), logprobs=2),
              SamplingParams(max_new_tokens=24, ignore_eos=True, allowed_token_ids=FEW, presence_penalty=0.4)]
    seen = drafts_checked(monkeypatch, spec)
    drafts, accepted = counters(spec)
    got = spec.generate(prompts, params)
    want = plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got[3].logprobs, want[3].logprobs):  # the grammar's mask at each row: the same records
        assert g["token_id"] == w["token_id"] and abs(g["logprob"] - w["logprob"]) < 1e-4
    assert all(o.error is None for o in got) and seen
    assert counters(spec)[0] > drafts and counters(spec)[1] > accepted
    again = [p + o.token_ids[:8] for p, o in zip(prompts, got)]  # a prefix cache hit (the grammar starts afresh)
    hits = spec.engine.block_manager.prefix_hits
    assert [o.token_ids for o in spec.generate(again, params)] == \
        [o.token_ids for o in plain.generate(again, params)]
    assert spec.engine.block_manager.prefix_hits > hits


def test_draft_bitmask_cuts_at_a_refused_draft_and_rolls_the_matcher_back(plain):
    so = structured(regex="(ab)+c")
    engine = plain.engine
    tok = engine.tokenizer
    a, b, c = (tok.encode(x, add_special_tokens=False) for x in "abc")
    assert len(a) == len(b) == len(c) == 1
    a, b, c = a[0], b[0], c[0]
    from infer.engine.structured import draft_bitmask, fill_bitmask
    vocab = engine.model_config.vocab_size
    m = engine.grammars.matcher(so)
    assert m.accept_token(a)
    before = fill_bitmask([m], vocab)
    kept, bitmask = draft_bitmask(m, [b, a, a, b], vocab)
    assert kept == [b, a] and bitmask.shape[0] == 3
    assert torch.equal(bitmask[0:1], before) and torch.equal(fill_bitmask([m], vocab), before)  # rolled back
    for j, t in enumerate(kept):  # row j + 1: the matcher's state after kept[:j + 1]
        assert m.accept_token(t)
        assert torch.equal(bitmask[j + 1:j + 2], fill_bitmask([m], vocab))
    m.rollback(len(kept))
    eos = sorted(engine.eos_token_ids)[0]
    kept, bitmask = draft_bitmask(m, [b, c, eos], vocab)  # the EOS that would end it is not drafted
    assert kept == [b, c] and bitmask.shape[0] == 3 and torch.equal(fill_bitmask([m], vocab), before)


# ------------------------------------------------------------------ bad_words
@pytest.mark.parametrize("words", [["##"], ["$%"], ["#$", "&&"], ["%%%"], ["#", "&%#"]])
def test_bad_words_greedy_replies_equal_plain_with_drafts_accepted(plain, spec, words):
    """(FEW are the tokens '#', '$', '%', '&'.) No reply holds a bad word, though drafts of them were proposed."""
    prompts = random_prompts(plain.engine.model_config.vocab_size, (6, 10, 8), seed=9) + [[5, 5, 5, 7, 7, 7] * 3]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, allowed_token_ids=FEW, bad_words=words)
    drafts, accepted = counters(spec)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    assert all(o.error is None for o in got) and not any(w in o.text for o in got for w in words)
    assert counters(spec)[0] > drafts and counters(spec)[1] > accepted


def test_bad_words_mixed_with_every_other_kind(plain, spec):
    vocab = plain.engine.model_config.vocab_size
    prompts = random_prompts(vocab, (7, 12, 9, 5), seed=5)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW, bad_words=["##", "%&"]),
              SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW),
              SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW, bad_words=["$$$"],
                             frequency_penalty=0.3),
              SamplingParams(max_new_tokens=20, structured_outputs=structured(regex="[ab]{20}"), bad_words=["bbb"])]
    same_with_drafts(plain, spec, prompts, params)


@pytest.mark.parametrize("output, drafts", [([], [5, 6, 5]), ([5], [6, 5, 6]), ([9, 5, 6], [5, 6, 7]),
                                            ([5, 6, 5, 6], [7, 5, 6])])
def test_bad_words_at_each_verify_row_see_the_drafts_before_it(output, drafts):
    def words(s):
        s.bad_words = [[5, 6, 7], [6, 5], [8]]
    params = SamplingParams(bad_words=["x"])
    verify_rows_equal_plain_rows(params, [3, 4, 5], output, drafts, setup=words)


# ------------------------------------------------------------------ min_tokens
@pytest.mark.parametrize("min_tokens", [3, 8, 13])
def test_min_tokens_greedy_replies_equal_plain_with_drafts_accepted(plain, spec, min_tokens):
    """A stop token the model keeps choosing ('#', 5; or EOS) is banned until min_tokens, then ends the reply."""
    eos = sorted(plain.engine.eos_token_ids)[0]
    prompts = random_prompts(plain.engine.model_config.vocab_size, (6, 10, 8), seed=9) + [[7, 5, 6, 5, 7, 5] * 3]
    stop = SamplingParams(max_new_tokens=24, allowed_token_ids=FEW, stop_token_ids=[5], min_tokens=min_tokens)
    eos_too = SamplingParams(max_new_tokens=24, allowed_token_ids=[6, 7, 8, eos], min_tokens=min_tokens,
                             logit_bias={eos: 1.5})
    got = same_with_drafts(plain, spec, prompts * 2, [stop] * len(prompts) + [eos_too] * len(prompts))
    assert all(len(t) >= min_tokens for t in got)
    assert any(len(t) < 24 for t in got[:len(prompts)]) and any(len(t) < 24 for t in got[len(prompts):])


def test_min_tokens_mixed_with_every_other_kind(plain, spec):
    vocab = plain.engine.model_config.vocab_size
    prompts = random_prompts(vocab, (7, 12, 9, 5, 8), seed=6)
    params = [SamplingParams(max_new_tokens=20, allowed_token_ids=FEW, stop_token_ids=[5], min_tokens=9),
              SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW),
              SamplingParams(max_new_tokens=20, allowed_token_ids=FEW, stop_token_ids=[5], min_tokens=6,
                             bad_words=["%%"], presence_penalty=0.2),
              SamplingParams(max_new_tokens=20, structured_outputs=structured(regex="[ab]{8,20}")),
              SamplingParams(max_new_tokens=20, allowed_token_ids=FEW, stop_token_ids=[7, 5], min_tokens=4,
                             repetition_penalty=1.1)]
    same_with_drafts(plain, spec, prompts, params)


@pytest.mark.parametrize("generated", [0, 1, 2, 3, 5])
def test_min_tokens_at_each_verify_row_counts_the_drafts_before_it(generated):
    def ban(s):
        s.min_tokens_ban = [5, 2]
    params = SamplingParams(min_tokens=4, stop_token_ids=[5])
    verify_rows_equal_plain_rows(params, [3, 4, 6], [9] * generated, [5, 9, 5], setup=ban)


# ------------------------------------------------------------------ every kind together
def mixed_params():
    regex = structured(regex="[ab]{6,24}")
    return [SamplingParams(max_new_tokens=24, ignore_eos=True, allowed_token_ids=FEW, repetition_penalty=1.2,
                           bad_words=["##"]),
            SamplingParams(max_new_tokens=24, structured_outputs=regex, frequency_penalty=0.4),
            SamplingParams(max_new_tokens=24, allowed_token_ids=FEW, stop_token_ids=[5], min_tokens=10,
                           presence_penalty=0.3),
            SamplingParams(max_new_tokens=24, ignore_eos=True, allowed_token_ids=FEW),
            SamplingParams(max_new_tokens=24, structured_outputs=structured(json=SCHEMA), bad_words=["9"])]


@pytest.mark.parametrize("kw", [dict(num_kv_blocks=24, max_model_len=64), dict(max_num_batched_tokens=8)],
                         ids=["preempted", "drafts-cut-by-budget"])
def test_every_kind_with_preemption_or_a_small_budget_equals_plain(path, kw):
    a = LLM(str(path), block_size=4, max_num_seqs=5, **kw)
    b = LLM(str(path), block_size=4, max_num_seqs=5, speculative_config=SPEC, **kw)
    prompts = random_prompts(a.engine.model_config.vocab_size, (5, 9, 14, 7, 11), seed=5)
    got = same_with_drafts(a, b, prompts, mixed_params())
    assert all(got)
    if "num_kv_blocks" in kw:
        assert b.engine.stats()["num_preemptions"] > 0


def test_penalised_replies_equal_transformers(path, spec):
    from test_speculative import hf_restricted
    prompts = random_prompts(spec.engine.model_config.vocab_size, (6, 11), seed=12) + [[5, 6, 7, 8] * 4]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, repetition_penalty=1.2, allowed_token_ids=FEW)
    drafts = counters(spec)
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == [hf_restricted(path, p, 20, repetition_penalty=1.2) for p in prompts]
    assert counters(spec)[0] > drafts[0] and counters(spec)[1] > drafts[1]


def test_adapters_with_every_kind_equal_plain(tmp_path, path):
    from lora_helpers import ALL, hf_float, save_adapter
    adapter = save_adapter(hf_float(path), tmp_path / "a", seed=3, r=4, lora_alpha=8, target_modules=ALL)
    kw = dict(block_size=4, loras={"a": str(adapter)})
    a, b = LLM(str(path), **kw), LLM(str(path), speculative_config=SPEC, **kw)
    prompts = random_prompts(a.engine.model_config.vocab_size, (6, 12, 4, 9, 7), seed=7)
    same_with_drafts(a, b, prompts, mixed_params(), loras=["a", None, "a", "a", "a"])
