"""Output text for a sequence: decoded as the tokenizer decodes it, stop strings cut, safe deltas for streaming."""

from __future__ import annotations

from .sequence import Sequence


def _fast_decode(tokenizer):
    """The Rust tokenizer's own decode when it is exactly what `tokenizer.decode(ids, skip_special_tokens=True)`
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
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


def _concatenative(tokenizer) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) whenever decode(a) ends on a whole character: true of a
    byte-level BPE decoder (GPT-2, Llama 3, Qwen), which maps every token to bytes and decodes the concatenated
    bytes as UTF-8; not of decoders that strip or merge across tokens (SentencePiece's Metaspace, Strip, Fuse)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return _fast_decode(tokenizer) is not None and type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = _fast_decode(tokenizer) or (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        # incremental: only the tokens after the last whole character are decoded each step (else all of them)
        self.incremental = _concatenative(tokenizer)

    def update(self, seq: Sequence, stop_token: bool) -> bool:
        """Refresh seq.text from its output tokens; True if a stop string was found (text is cut before it).
        A final stop/EOS token is not part of the text."""
        ids = seq.output_token_ids[:-1] if stop_token else seq.output_token_ids
        if self.incremental and seq.decoded_tokens <= len(ids):
            tail = self._decode(ids[seq.decoded_tokens:])
            text = seq.decoded_text + tail
            if tail and not tail.endswith("\ufffd"):  # the bytes so far end on a character: final text
                seq.decoded_text, seq.decoded_tokens = text, len(ids)
        else:
            text = self._decode(ids)
        found = []  # the text ends before the earliest stop string in it (OpenAI), whatever the list's order
        if seq.params.stop and seq.stop_search_from is None:  # forced prefix tokens are not generated: not searched
            prefix = seq.params.prefix_token_ids
            seq.stop_search_from = len(self._decode(prefix).rstrip("\ufffd")) if prefix else 0
        for stop in seq.params.stop:
            # only look where the newest tokens could have completed a stop string
            start = max(seq.stop_search_from, len(seq.text) - len(stop) - 8)
            # a U+FFFD at the end may be a character whose last bytes have not come: not text yet (as vLLM)
            pos = text.find(stop, start, len(text.rstrip("\ufffd"))) if "\ufffd" in stop else text.find(stop, start)
            if pos != -1:
                found.append(pos)
        seq.text = text[:min(found)] if found else text
        return bool(found)

    @staticmethod
    def delta(seq: Sequence) -> str:
        """The text not yet handed out, holding back what may still become a stop string or a partial character."""
        end = len(seq.text)
        if not seq.finished:
            if seq.text.endswith("\ufffd"):
                end = seq.text.rstrip("\ufffd").__len__()
            if seq.params.stop:
                end -= max(len(s) for s in seq.params.stop) - 1
            end = max(seq.sent_text_len, end)
        out = seq.text[seq.sent_text_len:end]
        seq.sent_text_len = end
        return out
