"""Review of speculative decoding for requests with per-token state (session 46, specrev): cases the first tests
left out. A bad word's prefix that spans the reply and the drafts (the reply's part must match too), and a grammar
request whose drafts the scheduler cuts (its verify rows take the first rows of the bitmask made for every draft)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.sampler import _ends_with
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from test_probes_session46_specx import SPEC, structured, verify_rows_equal_plain_rows


@pytest.mark.parametrize("out, drafted, part, want", [
    ([9], [6], [5, 6], False), ([], [6], [5, 6], False), ([5], [6], [5, 6], True), ([9, 4], [5, 6], [4, 5, 6], True),
    ([9, 3], [5, 6], [4, 5, 6], False), ([4], [5], [4, 5, 6], False), ([7, 4, 5], [6], [4, 5, 6], True),
    ([4, 5], [6, 7], [4, 5, 6], False)])
def test_ends_with_checks_the_replys_part_of_a_word_that_spans_the_drafts(out, drafted, part, want):
    assert _ends_with(out, drafted, part) is want
    assert want is ((out + drafted)[-len(part):] == part)


@pytest.mark.parametrize("output, drafts", [([9], [6, 7, 5]), ([], [6, 5, 6]), ([9, 3], [5, 6, 7]), ([4], [6, 7, 8])])
def test_bad_words_at_verify_rows_whose_drafts_match_a_word_but_the_reply_does_not(output, drafts):
    """Row j bans a word's last token only when reply + drafts[:j] ends with the rest of it: the drafts' part alone
    matching the end of that rest is not enough."""
    def words(s):
        s.bad_words = [[5, 6, 7], [4, 5, 6, 7], [6, 8]]
    verify_rows_equal_plain_rows(SamplingParams(bad_words=["x"]), [3, 4, 5], output, drafts, setup=words)


def test_grammar_request_whose_drafts_the_budget_cuts_equals_plain(monkeypatch):
    """Four decoding requests and a budget of 6 tokens: 2 left for drafts, so the grammar request (first) keeps
    fewer drafts than it was proposed (and than its draft bitmask has rows for); its replies equal the plain
    engine's."""
    path = str(ensure_builtin("tiny-llama"))
    kw = dict(block_size=4, max_num_batched_tokens=6, max_num_seqs=4)
    plain, spec = LLM(path, **kw), LLM(path, speculative_config=SPEC, **kw)
    vocab = plain.engine.model_config.vocab_size
    prompts = [[5, 6, 7, 8] * 2] + random_prompts(vocab, (5, 4, 6), seed=2)
    few = SamplingParams(max_new_tokens=24, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8])
    params = [SamplingParams(max_new_tokens=24, structured_outputs=structured(regex="[ab]{24}"))] + [few] * 3
    cut = []
    real = spec.engine.runner.verify

    def verify(batch):
        for seq in batch.seqs:
            if seq.grammar is not None and seq.draft_token_ids:
                cut.append(seq.draft_bitmask.shape[0] > len(seq.draft_token_ids) + 1)
        return real(batch)
    monkeypatch.setattr(spec.engine.runner, "verify", verify)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    assert all(o.error is None for o in got) and any(cut)
    assert spec.engine.block_manager.num_used_blocks == 0


def test_a_finished_grammar_requests_sequence_holds_no_draft_bitmask(monkeypatch):
    """A finished request's output keeps its Sequence (its lists are read lazily), so whatever the Sequence holds
    lives as long as the caller keeps the outputs. Its draft bitmask ([k + 1, vocab / 32] int32, ~114 KB for a
    152k vocabulary and k = 5) stayed after its last speculative step, and after a step whose drafts the grammar
    cut to none (the usual last step: only EOS allowed): LLM.generate over many structured requests held one per
    output. It is released once used, and when the request is forgotten."""
    path = str(ensure_builtin("tiny-llama"))
    spec = LLM(path, block_size=4, speculative_config=SPEC)
    seqs = []
    real = spec.engine.runner.verify

    def verify(batch):
        seqs.extend(s for s in batch.seqs if s.grammar is not None)
        return real(batch)
    monkeypatch.setattr(spec.engine.runner, "verify", verify)
    prompts = [[5, 6, 7, 8] * 3] + random_prompts(spec.engine.model_config.vocab_size, (6, 9), seed=4)
    params = [SamplingParams(max_new_tokens=30, structured_outputs=structured(regex=r)) for r in
              ("[ab]{6}", "(ab)+c", "[ab]{3,12}")]
    drafts = spec.engine.stats()["spec_decode_num_drafts"]
    outs = spec.generate(prompts, params)
    assert all(o.finish_reason == "stop" and o.error is None for o in outs)
    assert spec.engine.stats()["spec_decode_num_drafts"] > drafts and seqs
    assert all(s.draft_bitmask is None for s in seqs)
