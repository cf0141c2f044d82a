"""Session 49 (review of the forty-eighth session's changes): the text of a tokenizer without a decoder (grown token by
token) holds back no run of <0xNN>-named tokens, and warmup's measured plan counts a draft model's CUDA graphs."""

from __future__ import annotations

from infer.engine.detokenizer import Detokenizer
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence


def _word_level_with_byte_names():
    """A word-level vocabulary (no decoder: decode joins the token strings with spaces) that holds tokens named as
    SentencePiece's byte-fallback tokens (<0x41>...): without a ByteFallback decoder they are text like any other."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(20)}
    vocab.update({"<0x41>": 20, "<0xE2>": 21, "<0x82>": 22})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t1")
    assert tok._tokenizer.decoder is None
    return tok


def test_byte_named_tokens_without_a_decoder_stream_at_once_and_never_decode_the_reply_whole():
    """The joined path (a tokenizer without a decoder grows its text token by token) still held back the text of a
    trailing run of tokens named <0xNN> as if a ByteFallback decoder could merge them, and measured the text before
    the run by decoding it whole every step of the run (the cost in the square of the reply's length that the joined
    path removed). Without a decoder "<0xE2>" is final text: streamed at once, each id decoded alone."""
    tok = _word_level_with_byte_names()
    detok = Detokenizer(tok)
    assert detok.joined
    calls = []
    inner = detok._decode
    detok._decode = lambda ids: calls.append(len(ids)) or inner(ids)
    seq = Sequence("r", [2], SamplingParams())
    streamed = ""
    for token in [3, 4, 5, 20, 21, 22, 21, 22, 20, 6]:
        seq.output_token_ids.append(token)
        detok.update(seq, stop_token=False)
        assert seq.text == tok.decode(seq.output_token_ids)
        streamed += Detokenizer.delta(seq)
        assert streamed == seq.text  # nothing held back: no stop strings, no partial character
    assert max(calls) <= 2
