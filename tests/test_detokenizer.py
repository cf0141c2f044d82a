"""Incremental detokenizing (engine.detokenizer) gives, after every token, exactly the text that decoding the whole
output gives (`tokenizer.decode(ids, skip_special_tokens=True)`), also across bytes of split characters, invalid
UTF-8 and special tokens; tokenizers whose decoder is not byte-level decode the whole output."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from infer.engine.detokenizer import Detokenizer
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence
from infer.models.tiny import ensure_builtin


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_incremental_text_equals_whole_decode(name):
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin(name)))
    detok = Detokenizer(tok)
    assert detok.incremental
    rng = random.Random(0)
    multibyte = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]  # bytes of split characters
    special = tok.all_special_ids
    assert multibyte and special
    advanced = 0
    for trial in range(60):
        seq = Sequence("r", [1], SamplingParams())
        for _ in range(rng.randrange(1, 40)):
            pool = rng.choice([multibyte, special, range(tok.vocab_size)])
            seq.output_token_ids.append(rng.choice(list(pool)))
            detok.update(seq, stop_token=False)
            assert seq.text == tok.decode(seq.output_token_ids, skip_special_tokens=True)
        advanced += seq.decoded_tokens > 0
        detok.update(seq, stop_token=True)
        assert seq.text == tok.decode(seq.output_token_ids[:-1], skip_special_tokens=True)
    assert advanced > 30  # most outputs really were decoded incrementally


def test_text_of_real_replies_with_multibyte_characters():
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    detok = Detokenizer(tok)
    ids = tok("héllo wörld — ½ 日本語 🙂 done")["input_ids"]
    seq = Sequence("r", [1], SamplingParams())
    for t in ids:
        seq.output_token_ids.append(t)
        detok.update(seq, stop_token=False)
        assert seq.text == tok.decode(seq.output_token_ids, skip_special_tokens=True)
    assert seq.text.endswith("🙂 done")


def test_other_decoders_decode_the_whole_output():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"▁a": 0, "▁b": 1, "c": 2, "<unk>": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()  # strips the first token's leading space: not concatenative
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    detok = Detokenizer(tok)
    assert not detok.incremental
    seq = Sequence("r", [1], SamplingParams())
    for t in (0, 2, 1, 2):
        seq.output_token_ids.append(t)
        detok.update(seq, stop_token=False)
    assert seq.text == tok.decode(seq.output_token_ids, skip_special_tokens=True) == "ac bc"
