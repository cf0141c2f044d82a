"""A prompt too long for the context, refused from its size before it is tokenized.

Tokenizing costs time and memory in proportion to the text (a 24 MB JSONL line took 29 s and 4 GB to be refused
as too long; an 8 MB request body, 6 s of a parse thread and 1.4 GB). No token stands for more bytes than the
longest entry of the vocabulary, so a text of B bytes is at least B / longest tokens; the bound is halved for
normalizers that shrink text (NFC) and a prompt is refused only when even that many tokens leave no room.
"""

from __future__ import annotations

import weakref

from ..errors import RequestError

_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
NORMALIZER_SLACK = 2


class PromptTooLongError(RequestError):
    """The prompt cannot fit the context (the server answers it with code context_length_exceeded)."""


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the longest vocabulary entry, added tokens included (0 when the vocabulary is unknown)."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without get_vocab(): no bound
        longest = 0
    try:
        _LONGEST[tokenizer] = longest
    except TypeError:
        pass
    return longest


def check_prompt_size(tokenizer, num_bytes: int, max_tokens: int | None) -> None:
    """Raise PromptTooLongError when `num_bytes` of text is certainly more than `max_tokens` tokens."""
    longest = longest_token_bytes(tokenizer) if max_tokens else 0
    if not longest:
        return
    floor = num_bytes // (longest * NORMALIZER_SLACK)
    if floor >= max_tokens:
        raise PromptTooLongError(f"the prompt is {num_bytes:,} bytes long, at least {floor:,} tokens, which leaves "
                                 f"no room under the context of {max_tokens:,} tokens", "shorten the prompt")
