"""Probes of the Python API (LLM, SamplingParams, outputs) as a vLLM user uses it (session 39)."""

from __future__ import annotations

import pytest

from infer.engine.detokenizer import Detokenizer
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence


@pytest.fixture(scope="module")
def byte_fallback_tok():
    """A SentencePiece-style tokenizer whose only text tokens are "a", "b" and the 256 byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "a": 259, "b": 260}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("stop", ["世界", "界", "好世界"])
def test_stop_string_completed_by_the_last_byte_of_a_long_byte_run_stops_at_that_token(byte_fallback_tok, stop):
    """A byte-fallback decoder shows an unfinished run of byte tokens as one U+FFFD per byte, and the run's text as
    far fewer characters once its last byte comes. The stop string search started near the end of the old (longer)
    text, past the stop string in the new text: it was found a token late (that token kept in the reply), or never
    when the reply ended there (finish_reason length with the stop string in the text)."""
    run = [3 + b for b in "你好你好你好世界".encode()]
    ids = [259] + run + [260]
    detok = Detokenizer(byte_fallback_tok)
    seq = Sequence("r", [1], SamplingParams(max_new_tokens=100, stop=[stop]))
    found = None
    for k, token in enumerate(ids):
        seq.output_token_ids.append(token)
        if detok.update(seq, False):
            found = k
            break
    assert found == len(run)  # the run's last byte
    assert seq.text == "a你好你好你好世界"[:"a你好你好你好世界".index(stop)]
