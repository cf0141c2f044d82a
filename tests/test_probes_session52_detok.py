"""Probes of the engine's output text, session 52: with a tokenizer whose decode cleans up tokenization spaces (a
WordPiece tokenizer with clean_up_tokenization_spaces, as BERT's), a token can change the text before it (" '"
then "s": "'s"); the streamed deltas had handed out the space the final text drops, so they did not add up to it."""

from __future__ import annotations

import pytest

from infer.engine.detokenizer import Detokenizer
from infer.engine.sampling_params import SamplingParams as Params
from infer.engine.sequence import Sequence, Status


def _wordpiece(clean: bool = True):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "##b": 4, "b": 5, ".": 6, ",": 7, "'": 8, "s": 9, "##s": 10,
             "n't": 11, "do": 12, "?": 13}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
                                  eos_token="[SEP]", clean_up_tokenization_spaces=clean)
    tok.add_tokens([AddedToken("<m>", special=False, normalized=False)])
    return tok


def _stream_by_hand(tok, ids: list[int], **kw) -> tuple[str, str, list[str]]:
    """(concatenated deltas, final text, deltas) of a reply of `ids`, detokenized as the engine does it."""
    det, seq, deltas = Detokenizer(tok), Sequence("r", [1], Params(**kw)), []
    for n, t in enumerate(ids, 1):
        seq.output_token_ids.append(t)
        stopped = det.update(seq, stop_token=False)
        if n == len(ids) or stopped:
            seq.status = Status.FINISHED
        deltas.append(Detokenizer.delta(seq))
        if stopped:
            break
    return "".join(deltas), seq.text, deltas


@pytest.mark.parametrize("words", [["a", "'", "s"], ["do", "n't"], ["a", "'", "<m>", "'", "a"], ["b", ",", "'", "a"],
                                   ["'", "a"]])
def test_clean_up_of_spaces_does_not_change_streamed_text(words):
    tok = _wordpiece()
    ids = tok.convert_tokens_to_ids(words)
    want = tok.decode(ids, skip_special_tokens=True)
    sent, text, deltas = _stream_by_hand(tok, ids)
    assert text == want
    assert sent == text, deltas  # was "a '" then "s": the deltas said "a 's", the text is "a's"


def test_the_text_streams_on_once_the_space_is_settled():
    tok = _wordpiece()
    ids = tok.convert_tokens_to_ids(["a", "'", "b", "b", "b"])
    sent, text, deltas = _stream_by_hand(tok, ids)
    assert text == "a'b b b" and sent == text
    assert deltas[0] == "a" and "".join(deltas[:3]) == "a'b"  # not everything held back to the end


def test_without_clean_up_nothing_is_held_back():
    tok = _wordpiece(clean=False)
    ids = tok.convert_tokens_to_ids(["a", "'", "s"])
    sent, text, deltas = _stream_by_hand(tok, ids)
    assert deltas == ["a", " '", " s"] and text == tok.decode(ids)


def test_a_stop_string_is_found_in_the_cleaned_text():
    tok = _wordpiece()
    ids = tok.convert_tokens_to_ids(["a", "'", "s", "b", "b"])
    sent, text, deltas = _stream_by_hand(tok, ids, stop=["'s"])
    assert text == "a" and sent == text


# ------------------------------------------------------------------ a stop token whose text holds a stop string
@pytest.fixture(scope="module")
def llm():
    from infer import LLM
    from infer.models.tiny import ensure_builtin
    return LLM(str(ensure_builtin("tiny-llama")), max_model_len=64)


def test_a_stop_string_in_the_stop_tokens_own_text_is_the_stop_reason(llm):
    """vLLM's output processor: a stop string the detokenizer finds is the stop_reason, also when the token that
    completed it is a stop token (its text kept by include_stop_str_in_output). infer reported the token's id."""
    from infer import SamplingParams
    tok = llm.get_tokenizer()
    t = tok("hello", add_special_tokens=False)["input_ids"][-1]
    word = tok.decode([t])
    assert word.strip()
    p = SamplingParams(max_tokens=4, allowed_token_ids=[t], stop_token_ids=[t], stop=[word.strip()],
                       include_stop_str_in_output=True)
    out = llm.generate(["a b"], p)[0].outputs[0]
    assert out.token_ids == [t] and out.finish_reason == "stop"
    assert out.stop_reason == word.strip()  # was t
    assert out.text == word[:word.index(word.strip()) + len(word.strip())]
    # without include_stop_str_in_output the stop token's text is not searched: its id is the reason
    out = llm.generate(["a b"], SamplingParams(max_tokens=4, allowed_token_ids=[t], stop_token_ids=[t],
                                               stop=[word.strip()]))[0].outputs[0]
    assert out.stop_reason == t and out.text == ""
