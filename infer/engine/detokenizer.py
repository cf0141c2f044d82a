"""Output text for a sequence: decoded as the tokenizer decodes it, stop strings cut, safe deltas for streaming."""

from __future__ import annotations

import functools
import re

from .sequence import Sequence

_UNSEEN = object()  # (Detokenizer._token) an id not decoded yet


def _fast_decode(tokenizer, skip_special_tokens: bool = True):
    """The Rust tokenizer's own decode when it is exactly what `tokenizer.decode(ids, skip_special_tokens=...)`
    returns (a transformers fast tokenizer with its stock _decode and no space clean-up), else None. It skips the
    Python wrapper's conversion of the id list, which costs more than the decoding of a short reply."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is None or not isinstance(tokenizer, TokenizersBackend)
            or type(tokenizer)._decode is not TokenizersBackend._decode or tokenizer.clean_up_tokenization_spaces):
        return None
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


def _concatenative(tokenizer) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) whenever decode(a) ends on a whole character: true of a
    byte-level BPE decoder (GPT-2, Llama 3, Qwen), which maps every token to bytes and decodes the concatenated
    bytes as UTF-8; not of decoders that strip or merge across tokens (SentencePiece's Metaspace, Strip, Fuse)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return _fast_decode(tokenizer) is not None and type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


def _space_joined(tokenizer) -> bool:
    """Whether decode(ids) is the ids' token strings joined by single spaces, the ids decode skips left out: the
    Rust tokenizer's decode when it has no decoder (a word-level vocabulary). Its text then grows token by token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return _fast_decode(tokenizer) is not None and getattr(backend, "decoder", 0) is None


def _byte_tokens(tokenizer) -> tuple[frozenset[int], int | None]:
    """Ids of SentencePiece's byte-fallback tokens (<0x00>..<0xFF>: Llama 2, Mistral), and the tokenizer's highest
    id (None if unknown). The decoder turns a run of byte tokens into UTF-8 as a whole, and every byte of a run that
    is not valid UTF-8 into U+FFFD, so the text of the run's first bytes can change when more arrive ("\n" then a
    lone 0xF0: "\n" becomes U+FFFD). An id past the highest (a model's padded vocabulary rows) decodes to nothing:
    the bytes on both sides of it join."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary to read: nothing to hold back
        return frozenset(), None
    ids = frozenset(i for t, i in vocab.items() if len(t) == 6 and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t))
    return ids, max(vocab.values(), default=None)


def _skipped_special_ids(tokenizer) -> frozenset[int]:
    """Ids that decode(ids, skip_special_tokens=True) drops: the named special tokens and every added token marked
    special, which all_special_ids does not list when no special-token field names it (Mistral's [INST], [SEP] added
    with special=True)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    try:
        ids.update(i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                   if getattr(t, "special", False))
    except Exception:  # no added-token table to read: the named special tokens
        pass
    return frozenset(ids)


def _cleans_up(tokenizer) -> bool:
    """Whether decode() applies transformers' clean_up_tokenization (clean_up_tokenization_spaces: " ," to ",",
    " ' " to "'", " n't" to "n't", ...), which transformers 5 skips for a BPE model unless forced. A token can then
    change the text before it: "a '" becomes "a'b" when "b" comes."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return True
    if not isinstance(tokenizer, TokenizersBackend) or type(tokenizer)._decode is not TokenizersBackend._decode:
        return True
    return type(getattr(tokenizer._tokenizer, "model", None)).__name__ != "BPE" or bool(getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))


def _decode_joined(tokenizer, skip_special_tokens: bool, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = _fast_decode(tokenizer) or (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        # skip_special_tokens=False (vLLM's field): the special tokens' text stays
        self._decode_all = _fast_decode(tokenizer, False) or (
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        # spaces_between_special_tokens=False (vLLM's field): passed to the tokenizer's decode, as vLLM's text is that
        # decode's; the Rust decode (_fast_decode) is transformers' decode whatever it says, which ignores it
        self._decode_joined = {skip: _fast_decode(tokenizer, skip) or functools.partial(
            _decode_joined, tokenizer, skip) for skip in (True, False)}
        # incremental: only the tokens after the last whole character are decoded each step (else all of them)
        self.incremental = _concatenative(tokenizer)
        # each decode's text of one token id (_token), keyed by the decode function, then by the id
        self._token_text: dict = {}
        # no decoder: each token's string is appended after a space (decoding the whole reply each step costs time
        # in its length, which made a reply's text cost time in the square of its length)
        self.joined = not self.incremental and _space_joined(tokenizer)
        # decoded whole each step: text from a trailing run of byte tokens is not streamed until the run ends. Not
        # with `joined`: without a decoder a byte token's text is its string ("<0x41>"), final once appended (and
        # holding it back decoded the text before the run whole, every step of the run)
        self.byte_ids, self.max_id = (frozenset(), None) if self.incremental or self.joined \
            else _byte_tokens(tokenizer)
        self.special_ids = _skipped_special_ids(tokenizer)
        # clean-up of tokenization spaces: a space among the text's last 3 characters may still go (every pattern
        # starts with a space and is at most 4 characters long), so the text from it is not final (final_text_len)
        self.cleans_up = _cleans_up(tokenizer)

    def update(self, seq: Sequence, stop_token: bool) -> bool:
        """Refresh seq.text from its output tokens; True if a stop string was found (text is cut before it, or
        after it with include_stop_str_in_output). A final stop/EOS token is not part of the text unless
        include_stop_str_in_output. With min_tokens, no stop string is searched for until the reply is longer, and
        then only one that ends after the text of the first min_tokens tokens (as vLLM)."""
        p = seq.params
        if not p.detokenize:  # vLLM's detokenize=False: token ids only, no text (and no stop string to search)
            return False
        ids = seq.output_token_ids[:-1] if stop_token and not p.include_stop_str_in_output else seq.output_token_ids
        skip = p.skip_special_tokens
        if not p.spaces_between_special_tokens:
            decode = self._decode_joined[skip]
        else:
            decode = self._decode if skip else self._decode_all
        if self.joined and seq.decoded_tokens <= len(ids):
            text, after = seq.decoded_text, seq.decoded_any
            for token in ids[seq.decoded_tokens:]:
                piece = self._token(decode, token)
                if piece is not None:  # not skipped
                    text, after = (text + " " + piece if after else piece), True
            seq.decoded_text, seq.decoded_tokens, seq.decoded_any = text, len(ids), after
        elif self.incremental and seq.decoded_tokens <= len(ids):
            tail = decode(ids[seq.decoded_tokens:])
            text = seq.decoded_text + tail
            if tail and not tail.endswith("\ufffd"):  # the bytes so far end on a character: final text
                seq.decoded_text, seq.decoded_tokens = text, len(ids)
        else:
            text = decode(ids)
        # the text before this token that cannot have changed: an open run of byte tokens (final_text_len) turns
        # from one U+FFFD per byte into fewer characters when it completes, so the new text may start before the
        # old text's end (a stop string completed by a run's last byte was found a token late, or never)
        settled = len(seq.text) if seq.final_text_len is None else min(len(seq.text), seq.final_text_len)
        seq.final_text_len = None
        if self.byte_ids:  # the trailing run of byte tokens (skipped special tokens and ids the tokenizer has no
            run, top = len(ids), self.max_id  # token for decode to nothing: they do not end it)
            while run > 0 and (ids[run - 1] in self.byte_ids or (skip and ids[run - 1] in self.special_ids)
                               or (top is not None and ids[run - 1] > top)):
                run -= 1
            if any(i in self.byte_ids for i in ids[run:]):
                seq.final_text_len = len(decode(ids[:run]))
        found = []  # the text ends before the earliest stop string in it (OpenAI), whatever the list's order
        stops = p.stop
        if p.min_tokens and stops:
            if seq.num_generated < p.min_tokens:
                stops = ()
            elif seq.min_text_len is None:  # the first min_tokens tokens' text: no stop string ends in it
                seq.min_text_len = self._whole_len(seq, ids, decode, text)
                stops = ()
        if stops and seq.stop_search_from is None:  # forced prefix tokens are not generated: not searched
            prefix = p.prefix_token_ids
            seq.stop_search_from = len(decode(prefix).rstrip("\ufffd")) if prefix else 0
        for stop in stops:
            # only look where the newest tokens could have completed a stop string
            start = max(seq.stop_search_from, settled - len(stop) - 8)
            if seq.min_text_len is not None:
                start = max(start, seq.min_text_len - len(stop) + 1)
            # a U+FFFD at the end may be a character whose last bytes have not come: not text yet (as vLLM)
            pos = text.find(stop, start, len(text.rstrip("\ufffd"))) if "\ufffd" in stop else text.find(stop, start)
            if pos != -1:
                found.append((pos, stop))
        if found:
            pos, seq.stop_reason = min(found, key=lambda f: f[0])
            seq.text = text[:pos + len(seq.stop_reason)] if p.include_stop_str_in_output else text[:pos]
        else:
            seq.text = text
            if self.cleans_up:
                space = text.rfind(" ", max(0, len(text) - 3))
                if space != -1:
                    seq.final_text_len = space if seq.final_text_len is None else min(seq.final_text_len, space)
        return bool(found)

    def _token(self, decode, token: int) -> str | None:
        """decode([token]), decoded once per id and decode function; with `joined`, None for a token decode skips
        (a skipped special token, an id without a token), which alone decodes to "" as an empty token string
        does, but unlike it adds no space: decode([token, token]) tells them apart."""
        texts = self._token_text.get(decode)
        if texts is None:
            texts = self._token_text[decode] = {}
        text = texts.get(token, _UNSEEN)
        if text is not _UNSEEN:
            return text
        text = decode([token])
        if self.joined and not text and decode([token, token]) == "":
            text = None
        texts[token] = text
        return text

    @staticmethod
    def _whole_len(seq: Sequence, ids: list[int], decode, text: str) -> int:
        """len(text) without a character whose last bytes have not come yet, which vLLM's text holds back: a stop
        string that character completes with a later token ends after the text of the first min_tokens tokens (it
        was never found). Such a character is a trailing U+FFFD, or in an open run of byte tokens (shown as one
        U+FFFD per byte until the whole run is UTF-8) the last 1-3 bytes of the run."""
        if seq.final_text_len is None:
            return len(text.rstrip("\ufffd"))
        for cut in range(4):
            head = decode(ids[:len(ids) - cut]) if cut else text
            if len(head) >= seq.final_text_len and "\ufffd" not in head[seq.final_text_len:]:
                return len(head)
        return seq.final_text_len  # bytes that are not UTF-8: the text before the run

    @staticmethod
    def delta(seq: Sequence) -> str:
        """The text not yet handed out, holding back what may still become a stop string, a partial character or
        the text of an open run of byte tokens."""
        end = len(seq.text)
        if not seq.finished:
            if seq.text.endswith("\ufffd"):
                end = seq.text.rstrip("\ufffd").__len__()
            if seq.final_text_len is not None:  # an open run of byte tokens: its text may still change
                end = min(end, seq.final_text_len)
            if seq.params.stop:
                end -= max(len(s) for s in seq.params.stop) - 1
            end = max(seq.sent_text_len, end)
        out = seq.text[seq.sent_text_len:end]
        seq.sent_text_len = end
        return out
