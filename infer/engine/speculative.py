"""Speculative decoding: the configuration (vLLM's "ngram" method, prompt lookup, or "draft_model", a smaller model
that drafts greedily: engine.draft), the n-gram proposer and the counters.

The proposer looks, in a decoding sequence's prompt and output, for the most recent earlier occurrence of its last n
tokens (n from prompt_lookup_max down to prompt_lookup_min) and proposes the (up to) k tokens that followed it. The
engine then verifies them in one forward over [last token + drafts] (LLMEngine._advance_speculative): the longest
prefix of drafts the target model agrees with is kept, plus one token of the target's own.

Every request may get drafts: at verify row j (after drafts[:j]) each logits processor sees the state the request
would have with drafts[:j] accepted (sampler.SamplingInputs: the penalties count them as output tokens, bad_words
see them as the reply's latest tokens, min_tokens counts them; a grammar's drafts are cut where it refuses one and
row j is masked with its state after drafts[:j]: structured.draft_bitmask), as vLLM's rejection sampler and
structured outputs do.
"""

from __future__ import annotations

import json
import numbers
import os
import sys
from array import array
from dataclasses import dataclass

from ..errors import ConfigError, json_problem

METHODS = ("ngram", "draft_model", "eagle3", "eagle")
EAGLE_METHODS = ("eagle3", "eagle")  # a draft head over the target's hidden states (engine.eagle): EAGLE-3, EAGLE-1
HEAD_METHODS = ("draft_model", *EAGLE_METHODS)  # the methods with a "model": a second network and its KV cache
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
DRAFT_KEYS = ("method", "model", "num_speculative_tokens")  # vLLM's draft-model speculation (method "draft_model")
NGRAM_NAMES = ("ngram", "[ngram]")
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
HINT = ('e.g. --speculative-config \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\', or a draft model: \'{"model": "./small-model", "num_speculative_tokens": 3}\'')
DRAFT_HINT = 'e.g. --speculative-config \'{"model": "./small-model", "num_speculative_tokens": 3}\''


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    model: str | None = None  # the draft model (method "draft_model"): a folder or a built-in name

    @property
    def uses_draft_model(self) -> bool:
        """Whether a second network drafts (a draft model, or an EAGLE head): its KV cache in the target's blocks."""
        return self.method in HEAD_METHODS

    @property
    def uses_eagle(self) -> bool:
        return self.method in EAGLE_METHODS

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in (DRAFT_KEYS if self.uses_draft_model else KEYS)}


def parse_speculative_config(value) -> dict | None:
    """--speculative-config (JSON text) or LLM(speculative_config=...) (a dict, or a SpeculativeConfig) as a checked
    dict of the KEYS (None: speculation off); ConfigError naming what is wrong."""
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):
        value = value.as_dict()
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:  # (a 5000-digit integer, arrays nested past the parser)
            raise ConfigError(f"--speculative-config is not JSON: {json_problem(e)}", HINT) from None
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {type(value).__name__}", HINT)
    method, model = value.get("method"), value.get("model")
    if method is None and model is not None:  # as vLLM infers it: "ngram" names the method, anything else a model
        method = "ngram" if model in NGRAM_NAMES else "draft_model"
    if method in HEAD_METHODS:
        return _draft_config(value, method)
    other = sorted(str(k) for k in value if k not in KEYS)
    if method not in NGRAM_NAMES:
        raise ConfigError(f"--speculative-config: method {method!r} is not supported: infer speculates only "
                          f"with \"ngram\" (prompt lookup) or a draft model (\"model\": a folder or a built-in name, "
                          f"method \"draft_model\"), or an EAGLE head (method \"eagle3\" or \"eagle\", \"model\": its "
                          f"folder; no MTP)", HINT)
    if "model" in other and model not in NGRAM_NAMES:  # a draft model with method "ngram": which one was meant?
        raise ConfigError(f"--speculative-config: method {method!r} (prompt lookup) takes no draft model, got "
                          f"\"model\": {model!r}", 'for draft-model speculation give "method": "draft_model" or '
                          'leave "method" out; for n-gram speculation leave "model" out')
    if other and other != ["model"]:
        raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(other)}",
                          f"infer's ngram speculation takes {', '.join(KEYS)}")
    k = value.get("num_speculative_tokens")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    # each value checked as given, before one left out takes the other's (vLLM's rule): a bad prompt_lookup_max
    # given alone was named prompt_lookup_min, a key the user never wrote
    for name, v in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if (v is not None or name == "num_speculative_tokens") and (
                isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ConfigError(f"--speculative-config: {name} must be an integer of at least 1, got {v!r}", HINT)
    if lo is None and hi is None:
        lo = hi = DEFAULT_LOOKUP
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    if lo > hi:
        raise ConfigError(f"--speculative-config: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})",
                          "give prompt_lookup_min <= prompt_lookup_max")
    return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": int(hi),
            "prompt_lookup_min": int(lo)}


def _draft_config(value: dict, method: str = "draft_model") -> dict:
    """parse_speculative_config's dict for vLLM's draft-model speculation (or an EAGLE-3 head's, `method` "eagle3"):
    the model (its folder or a built-in name, loaded and checked against the target by the engine) and
    num_speculative_tokens."""
    other = sorted(str(k) for k in value if k not in DRAFT_KEYS)
    if other:
        raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(other)} for method {method!r}",
                          f"infer's {method} speculation takes {', '.join(DRAFT_KEYS)}")
    model, k = value.get("model"), value.get("num_speculative_tokens")
    model = os.fspath(model) if isinstance(model, os.PathLike) else model
    if not isinstance(model, str) or not model.strip():
        if method in ("eagle3", "eagle"):  # (an EAGLE head: a folder of its own, never a built-in)
            raise ConfigError(f"--speculative-config: method \"{method}\" needs \"model\", the EAGLE head's folder, "
                              f"got {model!r}", f"e.g. --speculative-config '{{\"method\": \"{method}\", \"model\": "
                              "\"./eagle-head\", \"num_speculative_tokens\": 3}'")
        raise ConfigError(f"--speculative-config: method \"{method}\" needs \"model\", the draft model's folder or "
                          f"a built-in name, got {model!r}", DRAFT_HINT)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ConfigError(f"--speculative-config: num_speculative_tokens must be an integer of at least 1, got {k!r}",
                          DRAFT_HINT)
    return {"method": method, "model": model, "num_speculative_tokens": int(k)}


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of `tokens`' last n tokens, for the largest n
    in n_min..n_max that occurs earlier ([] where none does). Fewer than k near the end of `tokens`."""
    if k <= 0 or len(tokens) <= n_min:
        return []
    start = _ngram_start(array("q", tokens).tobytes(), len(tokens), n_min, n_max)
    return [] if start is None else [int(t) for t in tokens[start:start + k]]


def propose_for(seq, k: int, n_min: int, n_max: int) -> list[int]:
    """propose_ngram over a sequence's tokens (prompt and output, none pending), from the packed ids it keeps
    (Sequence.ngram_ids: extended by the tokens added since the last call; rebuilt where its last token is not the
    sequence's any more: an output token dropped, which only a request that ends does)."""
    size = len(seq.prompt_token_ids) + len(seq.output_token_ids)
    if k <= 0 or size <= n_min:
        return []
    held = seq.ngram_ids
    if held is None or held[1] > size or _last(held) != seq.token_at(held[1] - 1):
        held = (bytearray(array("q", seq.all_token_ids)), size)
    elif held[1] < size:
        held[0].extend(array("q", seq.tokens(held[1], size)))
        held = (held[0], size)
    seq.ngram_ids = held
    start = _ngram_start(held[0], size, n_min, n_max)
    return [] if start is None else seq.tokens(start, min(start + k, size))


_WIDTH = array("q").itemsize


def _last(held: tuple[bytearray, int]) -> int:
    buf, size = held
    return int.from_bytes(buf[(size - 1) * _WIDTH:size * _WIDTH], sys.byteorder, signed=True)


def _ngram_start(buf, size: int, n_min: int, n_max: int) -> int | None:
    """Where the proposal starts in the `size` tokens packed in `buf` (8 bytes each): after the most recent earlier
    occurrence of the last n tokens, n from n_max down to n_min (None: none occurs). One bytes.rfind per n, where
    numpy's conversion and masks cost tens of microseconds per sequence and step; a match across token boundaries
    is none (searched again before it)."""
    w = _WIDTH
    limit = (size - 1) * w  # an earlier occurrence ends before the last token
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern, end = bytes(buf[(size - n) * w:size * w]), limit
        while (at := buf.rfind(pattern, 0, end)) >= 0:
            if at % w == 0:
                return at // w + n
            end = at + len(pattern) - 1
    return None


class SpecStats:
    """vLLM's spec decode counters: drafts verified (one per request and step with drafts), draft tokens, accepted
    tokens, and accepted tokens by position."""

    def __init__(self, k: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def count(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}
