"""Probes of tokenizer varieties, session 42: on a SentencePiece-style tokenizer with byte fallback (Llama 2,
Mistral), the decoder joins byte tokens into one UTF-8 run across tokens that decode to nothing: an added token
marked special that no special-token field names (Mistral's control tokens; all_special_ids omits it) when special
tokens are skipped, and an id of the model's padded vocabulary rows that the tokenizer has no token for. The
detokenizer took both for text that ends the run, streamed the run's first bytes (an "N"), and the final text then
showed them as U+FFFD: the streamed deltas did not add up to the reply's text."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from infer import LLM, SamplingParams
from infer.engine.detokenizer import Detokenizer
from infer.engine.sampling_params import SamplingParams as Params
from infer.engine.sequence import Sequence, Status
from infer.models.tiny import ensure_builtin

BYTE_N, BYTE_DA = 3 + 0x4E, 3 + 0xDA  # <0x4E> ("N") and <0xDA> (a lead byte: "N" then it is not UTF-8)


def _byte_fallback_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "▁": 259, "a": 260,
             "▁a": 261}
    backend = Tokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_tokens([AddedToken("[SEP]", special=True, normalized=False)])  # special, in no special-token field
    return tok


@pytest.fixture(scope="module")
def tok():
    t = _byte_fallback_tokenizer()
    sep = t.convert_tokens_to_ids("[SEP]")
    assert sep == 262 and sep not in t.all_special_ids and t.convert_ids_to_tokens([BYTE_N, BYTE_DA]) == [
        "<0x4E>", "<0xDA>"]
    return t


@pytest.fixture(scope="module")
def model(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("bytefb") / "tiny-bytefb"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    for f in list(path.glob("tokenizer*")) + list(path.glob("special_tokens_map.json")):
        f.unlink()
    tok.save_pretrained(path)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**cfg, "eos_token_id": 2, "bos_token_id": 1}))
    return str(path)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, max_model_len=64)


def _stream_by_hand(tok, ids: list[int], **kw) -> tuple[str, str]:
    """(concatenated deltas, final text) of a reply of `ids`, detokenized as the engine does token by token."""
    det, seq, sent = Detokenizer(tok), Sequence("r", [1], Params(**kw)), ""
    for n, t in enumerate(ids, 1):
        seq.output_token_ids.append(t)
        det.update(seq, stop_token=False)
        if n == len(ids):  # the last token: the reply ends with it (length)
            seq.status = Status.FINISHED
        sent += Detokenizer.delta(seq)
    return sent, seq.text


@pytest.mark.parametrize("between", ["special", "beyond_tokenizer"])
def test_a_token_that_decodes_to_nothing_does_not_end_a_byte_run(tok, between):
    gap = tok.convert_tokens_to_ids("[SEP]") if between == "special" else 400  # 400: a model row, no token
    ids = [BYTE_N, gap, BYTE_DA]
    want = tok.decode(ids, skip_special_tokens=True)
    assert want == "\ufffd\ufffd"  # the decoder joins <0x4E><0xDA> into one run: not UTF-8, both bytes U+FFFD
    sent, text = _stream_by_hand(tok, ids)
    assert text == want
    assert sent == text  # was "N" then "\ufffd": a streamed "N" the final text does not have


def test_special_token_kept_still_ends_the_run(tok):
    sep = tok.convert_tokens_to_ids("[SEP]")
    ids = [BYTE_N, sep, BYTE_DA]
    sent, text = _stream_by_hand(tok, ids, skip_special_tokens=False)
    assert text == tok.decode(ids, skip_special_tokens=False) == "N[SEP]\ufffd"
    assert sent == text


@pytest.mark.parametrize("gap", ["[SEP]", 400])
def test_streamed_deltas_add_up_to_the_text_through_the_engine(llm, tok, gap):
    gap_id = tok.convert_tokens_to_ids(gap) if isinstance(gap, str) else gap
    seen = False
    for seed in range(16):  # seeds 3 and 9 ([SEP]), 3 and 13 (400) showed it
        p = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True,
                           allowed_token_ids=[BYTE_N, gap_id, BYTE_DA], logit_bias={BYTE_N: 3, BYTE_DA: 1})
        events = list(llm.stream(["a a"], p))
        out = events[-1][2]
        assert out.finished and out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert "".join(d for _, d, _ in events) == out.text, (out.token_ids, [d for _, d, _ in events])
        ids = out.token_ids
        shown = "".join({BYTE_N: "N", gap_id: "_", BYTE_DA: "D"}[t] for t in ids)
        seen |= re.match("N+_+D", shown) is not None  # valid bytes streamed, then the gap and a lead byte
    assert seen  # the sampled replies held the sequence that showed the defect
