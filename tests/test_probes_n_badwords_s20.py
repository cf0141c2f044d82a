"""Probes of vLLM's n and bad_words (session 20): bad_words that leave a row with no token to sample. The sampler
masks a bad word's last token with -inf; with allowed_token_ids (and min_tokens' EOS ban) that can leave every
logit of a row at -inf, and the step then drew a token the request does not allow (token 0 on greedy rows) and
wrote it into the reply as if sampled. Such a request is refused when its first token already has nothing left,
and ends with the error (the token left out) when the reply reaches a dead end."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams, StructuredOutputsParams
from infer.errors import RequestError

from helpers import closing_llm as llm, tiny_llama_str as path  # noqa: F401 (fixtures)


def test_bad_words_banning_every_allowed_token_are_refused(llm):
    """The first token's row would be empty: nothing allowed is left, so the request can never reply."""
    assert llm.engine.bad_word_ids(["+"]) == [[13]]
    with pytest.raises(RequestError, match="ban every token in allowed_token_ids"):
        llm.generate("hello world", SamplingParams(max_new_tokens=4, allowed_token_ids=[13], bad_words=["+"]))
    with pytest.raises(RequestError, match="ban every token in allowed_token_ids"):  # EOS is min_tokens' ban
        llm.generate("hello world", SamplingParams(max_new_tokens=4, allowed_token_ids=[13, 2], min_tokens=2,
                                                   bad_words=["+"]))
    out = llm.generate("hello world", SamplingParams(max_new_tokens=4, allowed_token_ids=[13, 2], bad_words=["+"]))[0]
    assert out.token_ids == [2] and out.finish_reason == "stop"  # EOS is left: it is what the reply can be


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("extra", [{}, {"temperature": 1.0, "seed": 1}])
def test_a_reply_that_bad_words_leave_nothing_for_ends_with_the_error(path, overlap, extra):
    """allowed_token_ids=[3] ("!") and the bad word "!!": after one "!" every token is banned or not allowed. The
    reply is that "!" and the error, not "!" followed by a token outside allowed_token_ids."""
    with LLM(path, block_size=4, overlap=overlap) as llm:
        assert llm.engine.bad_word_ids(["!!"]) == [[3, 3]]
        outs = llm.generate(["hello world", "the cat"],
                            SamplingParams(max_new_tokens=6, allowed_token_ids=[3], bad_words=["!!"], **extra))
        for out in outs:
            assert out.token_ids == [3] and out.text == "!"
            assert out.finish_reason == "error" and "bad_words leave no token" in out.error
        # min_tokens' EOS ban with bad_words: "!" then neither "!" nor EOS
        out = llm.generate("hello", SamplingParams(max_new_tokens=6, allowed_token_ids=[3, 2], min_tokens=3,
                                                   bad_words=["!!"], **extra))[0]
        assert out.token_ids == [3] and out.finish_reason == "error"
        # a reply that can go on is not touched: "!" then the other allowed token
        out = llm.generate("hello", SamplingParams(max_new_tokens=4, allowed_token_ids=[3, 5], bad_words=["!!"],
                                                   ignore_eos=True, **extra))[0]
        assert out.finish_reason == "length" and out.error is None and set(out.token_ids) <= {3, 5}
        assert all(out.token_ids[i:i + 2] != [3, 3] for i in range(3))


def test_a_grammar_that_bad_words_leave_nothing_for_names_the_bad_words(llm):
    """The choice "!!!" after "!" allows only "!", which the bad word "!!" bans: the error says so, not that the
    grammar refused a token (token 0, drawn from the empty row)."""
    out = llm.generate("hello", SamplingParams(max_new_tokens=6, bad_words=["!!"],
                                               structured_outputs=StructuredOutputsParams(choice=["!!!"])))[0]
    assert out.token_ids == [3] and out.finish_reason == "error"
    assert "bad_words ban every token structured_outputs.choice allows" in out.error
