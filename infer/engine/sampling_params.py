"""SamplingParams: how one request is decoded, validated on construction."""

from __future__ import annotations

import copy
import difflib
import enum
import functools
import logging
import math
import numbers
from dataclasses import dataclass, field, fields, replace

from ..checks import check_text
from ..errors import RequestError
from .structured import StructuredOutputsParams

MAX_TOKENS = 2**31 - 1  # token counts and top_k
MAX_SEED = 2**63 - 1
MAX_PRIORITY = 2**63 - 1  # request priorities are 64-bit integers either way (vLLM's are Python ints)
MAX_N = 1024  # samples per prompt in one call (each is an engine request)
# every stop string is searched and every stop token id compared after each token, on the engine's one thread:
# the lists are capped so that one request cannot slow every step of every other request
MAX_STOP_STRINGS = 256
MAX_STOP_TOKEN_IDS = 1024
# logit_bias and allowed_token_ids travel to the device with every step of the request: capped for the same reason
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 16384
MAX_BAD_WORDS = 256  # each is matched against the reply's end at every step of the request
MIN_REPETITION_PENALTY = 0.01  # 1 / the largest (100): a seen token's logit is scaled by at most 100 either way
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS): 0 only, after MIN_TEMPERATURE
# a positive temperature below this is raised to it, as vLLM (its _MAX_TEMP, with its warning): a request that asks
# for 1e-6 samples at 0.01 there, not greedily
MIN_TEMPERATURE = 1e-2
logger = logging.getLogger(__name__)


class RequestOutputKind(enum.IntEnum):
    """vLLM's SamplingParams.output_kind (vllm.sampling_params.RequestOutputKind): what AsyncLLM.generate yields.
    CUMULATIVE: every output's outputs[0] holds the reply so far; DELTA: only what is new since the last output (its
    text, token_ids and logprobs); FINAL_ONLY: the finished output alone. LLM.generate / chat return finished outputs
    whichever it is (as vLLM's LLM)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 256  # tokens the model generates (forced prefix_token_ids not counted)
    max_length: int | None = None  # prompt + output cap
    temperature: float = 0.0  # 0 = greedy; 0 < t < 0.01 is raised to 0.01 (vLLM's _MAX_TEMP)
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM and the OpenAI-compatible servers spell it) = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    prefix_token_ids: list[int] = field(default_factory=list)  # forced first reply tokens
    logprobs: int | None = None  # top-k logprobs per generated token
    # vLLM's extensions (semantics and order of vLLM's and transformers' logits processors; see engine/sampler.py)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after top-k and top-p)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the reply, nor stop strings, before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) stays at the end of the text
    skip_special_tokens: bool = True  # special tokens' text left out of the output text
    # with skip_special_tokens=False: tokenizer.decode's spaces_between_special_tokens (transformers' fast tokenizers
    # ignore it; a tokenizer whose decode honours it joins special tokens with spaces, or not)
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: no text is made (outputs carry token ids only; stop strings refused)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: the context length's)
    prompt_logprobs: int | None = None  # each prompt token's logprob (and top-k) given the tokens before it
    # the reply follows a JSON schema, a regex, a choice or a grammar (engine/structured.py); a dict of its fields too
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] | None = None  # words never generated (vLLM's: their last token is masked after the rest)
    n: int = 1  # samples of the prompt (LLM.generate / LLM.chat: RequestOutput.outputs; sample j draws with seed + j)
    # vLLM's cache_salt (a prompt dict's key there, and the server's field): requests share prefix-cache blocks only
    # with requests of the same salt (a tenant cannot learn another's prompts from cache hits)
    cache_salt: str | None = None
    # vLLM's request priority (its add_request / generate keyword, the server's field; carried here so that it goes
    # wherever the request's parameters go): under --scheduling-policy priority lower values are admitted first and
    # preempted last; the default policy (fcfs) takes 0 only, as vLLM's
    priority: int = 0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # vLLM's (AsyncLLM.generate's outputs)

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = _ids(self.stop_token_ids)
        self.prefix_token_ids = _ids(self.prefix_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _ids(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.logit_bias = _bias(self.logit_bias)
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))  # a numpy float too, as a plain float from here on
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in tensors: "
                           "raised to %s, as vLLM raises it", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        checks = [
            (self.max_new_tokens is None or 1 <= self.max_new_tokens <= MAX_TOKENS,
             f"max_new_tokens must be in 1..{MAX_TOKENS}, got {self.max_new_tokens}"),
            (self.max_length is None or 1 <= self.max_length <= MAX_TOKENS,
             f"max_length must be in 1..{MAX_TOKENS}, got {self.max_length}"),
            (0 <= self.temperature <= 100, f"temperature must be in [0, 100], got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.top_k <= MAX_TOKENS, f"top_k must be in 0..{MAX_TOKENS} (0 or -1 = off), got {self.top_k}"),
            # below 1/100 a seen token's logit is multiplied past what the upper bound allows the other way; near 0
            # it overflows to inf and the request ended as if the model had (finish_reason error, "not finite")
            (MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 100], got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"stop has {len(self.stop)} strings, more than {MAX_STOP_STRINGS}"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"stop_token_ids has {len(self.stop_token_ids)} ids, more than {MAX_STOP_TOKEN_IDS}"),
            (all(isinstance(t, int) and 0 <= t < 2**31 for t in self.stop_token_ids),
             "stop_token_ids must be a list of token ids"),
            (all(isinstance(t, int) and 0 <= t < 2**31 for t in self.prefix_token_ids),
             "prefix_token_ids must be a list of token ids"),
            (self.seed is None or 0 <= self.seed <= MAX_SEED,  # (-1 is no seed: None by _check_types, as vLLM's)
             f"seed must be in 0..{MAX_SEED}, or -1 for none (a random draw), got {self.seed}"),
            # (the engine caps both at its max_logprobs, 20 by default: LLMEngine.validate)
            (self.logprobs is None or self.logprobs >= -1,
             f"logprobs must be at least 0, or -1 (the whole vocabulary), got {self.logprobs}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (0 <= self.min_tokens <= MAX_TOKENS, f"min_tokens must be in 0..{MAX_TOKENS}, got {self.min_tokens}"),
            (self.max_new_tokens is None or self.min_tokens <= self.max_new_tokens,
             f"min_tokens ({self.min_tokens}) must be at most max_new_tokens ({self.max_new_tokens})"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"logit_bias has {len(self.logit_bias)} tokens, more than {MAX_LOGIT_BIAS}"),
            (all(type(t) is int and 0 <= t < 2**31 for t in self.logit_bias),  # a bool key (True) is not one
             "logit_bias keys must be token ids"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
            (self.allowed_token_ids is None or 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
             f"allowed_token_ids must hold 1..{MAX_ALLOWED_TOKEN_IDS} token ids"),
            (all(type(t) is int and 0 <= t < 2**31 for t in self.allowed_token_ids or ()),
             "allowed_token_ids must be a list of token ids"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= -1,
             f"prompt_logprobs must be at least 0, or -1 (the whole vocabulary), got {self.prompt_logprobs}"),
            (all(isinstance(w, str) and w.strip() for w in self.bad_words or ()),
             "bad_words must be a list of non-empty strings"),
            (len(self.bad_words or ()) <= MAX_BAD_WORDS,
             f"bad_words has {len(self.bad_words or ())} words, more than {MAX_BAD_WORDS}"),
            (self.n is not None and 1 <= self.n <= MAX_N, f"n must be in 1..{MAX_N}, got {self.n}"),
            (self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
             f"cache_salt must be a non-empty string, got {self.cache_salt!r}"[:200]),
            (-MAX_PRIORITY <= self.priority <= MAX_PRIORITY,
             f"priority must be in {-MAX_PRIORITY}..{MAX_PRIORITY}, got {self.priority}"[:200]),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1
             or self.truncate_prompt_tokens == -1,
             f"truncate_prompt_tokens must be at least 1 (or -1: the context length), got "
             f"{self.truncate_prompt_tokens}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(msg)
        if self.stop and not self.detokenize:  # as vLLM: a stop string is searched for in the text
            raise RequestError("stop strings need the output text, which detokenize=False does not make",
                               "set detokenize=True, or stop on token ids with stop_token_ids")
        check_text(self.cache_salt, "cache_salt")
        check_text(self.stop, "stop")  # a lone surrogate: the tokenizer's TypeError when bad_words were encoded
        check_text(self.bad_words, "bad_words")
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.structured_outputs is not None:
            self._check_structured()

    def _check_structured(self) -> None:
        """What a constraint cannot be combined with: each could leave a step with no token to sample (its end
        allows only EOS), or take it past its end."""
        for name, on, why in (
                ("ignore_eos", self.ignore_eos, "the constraint's end allows only EOS"),
                ("min_tokens", self.min_tokens, "a reply the constraint completes sooner could only continue with "
                                                "EOS, which min_tokens forbids"),
                ("allowed_token_ids", self.allowed_token_ids, "the constraint chooses the tokens")):
            if on:
                raise RequestError(f"structured_outputs cannot be combined with {name}: {why}",
                                   f"remove {name}, or the constraint")

    def _check_types(self) -> None:
        """From Python nothing checked the types: ignore_eos="no" ignored EOS, top_k=2.5 reached the sampler."""
        for name in ("max_new_tokens", "max_length", "top_k", "seed", "logprobs", "min_tokens",
                     "truncate_prompt_tokens", "prompt_logprobs", "n", "priority"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise RequestError(f"{name} must be an integer, got {type(value).__name__}")
            if value is not None:
                setattr(self, name, int(value))  # a numpy integer too, as a plain int from here on
        if self.seed == -1:  # vLLM's (and many clients') "no seed": a random draw, not an error
            self.seed = None
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {type(getattr(self, name)).__name__}")
        if self.min_tokens is None:
            self.min_tokens = 0
        self.output_kind = _output_kind(self.output_kind)
        if self.priority is None:  # the server's field sent as null: its default
            self.priority = 0
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise RequestError("logit_bias must be an object of token id -> bias, got "
                               f"{type(self.logit_bias).__name__}")
        if self.bad_words is not None and not isinstance(self.bad_words, (str, list, tuple)):
            raise RequestError(f"bad_words must be a list of strings, got {type(self.bad_words).__name__}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise RequestError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        for name in ("stop_token_ids", "prefix_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (list, tuple))
                                      or any(isinstance(t, bool) for t in value)):
                raise RequestError(f"{name} must be a list of token ids")

    def checked(self) -> SamplingParams:
        """A validated copy, with its own lists: what the engine keeps for a request. The fields were checked on
        construction only, so `params.temperature = -1` afterwards reached the sampler; and a request shared the
        caller's object, which could change under it while it ran."""
        return replace(self)

    def clone(self) -> SamplingParams:
        """vLLM's SamplingParams.clone(): a deep copy, whose lists and dicts can be changed without touching these
        params (it was an AttributeError)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        """Temperature 0 (a positive one is at least MIN_TEMPERATURE, as vLLM makes it): the argmax."""
        return self.temperature < GREEDY_BELOW

    def sample(self, j: int) -> SamplingParams:
        """Sample j of n's own params (n = 1): a seeded request's sample j draws with seed + j, as vLLM's parallel
        sampling does, so the samples differ and each is reproducible."""
        seed = self.seed if self.seed is None or j == 0 else (self.seed + j) % (MAX_SEED + 1)
        return replace(self, n=1, seed=seed)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# names other APIs use (vLLM's SamplingParams, OpenAI, transformers' GenerationConfig) -> what to write here instead
_OTHER_NAMES = {"max_completion_tokens": "max_new_tokens", "top_logprobs": "logprobs", "min_new_tokens": "min_tokens",
                "guided_decoding": "structured_outputs (vLLM's newer name; its fields are the same)",
                "do_sample": "temperature > 0 (0, the default, is greedy)"}
# vLLM's fields infer does not implement -> the values that change nothing (vLLM's defaults), which are taken, so that
# vLLM code spelling a default out (use_beam_search=False, best_of=None) runs unchanged
_UNSUPPORTED = {"best_of": (None, 1), "use_beam_search": (False,), "num_beams": (1,), "logits_processors": (None, []),
                "extra_args": (None,)}


def _refuse_unknown_names(init):
    """vLLM's spelling `max_tokens` is taken for max_new_tokens (both given: refused). Any other misspelled or
    foreign keyword was Python's bare TypeError from the dataclass __init__; it is a RequestError naming the field
    and what to write instead, as every other bad field is."""
    names = {f.name for f in fields(SamplingParams)}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "max_tokens" in kwargs:
            if "max_new_tokens" in kwargs or len(args) >= 1:
                raise RequestError("SamplingParams got both max_tokens and max_new_tokens",
                                   "they are the same field (max_tokens is vLLM's name for it): give one")
            kwargs["max_new_tokens"] = kwargs.pop("max_tokens")
        for key in list(kwargs):
            if key in names:
                continue
            if key in _OTHER_NAMES:
                if key == "guided_decoding" and kwargs[key] is None:  # vLLM's default: no constraint
                    del kwargs[key]
                    continue
                hint = f"infer spells it {_OTHER_NAMES[key]}"
            elif key in _UNSUPPORTED:
                value, defaults = kwargs[key], _UNSUPPORTED[key]
                if any(value is d or (type(value) is type(d) and value == d) for d in defaults):
                    del kwargs[key]  # the default: nothing to do
                    continue
                hint = f"infer does not support it: only {' or '.join(map(repr, defaults))} (vLLM's default) is taken"
                if key in ("use_beam_search", "num_beams"):  # vLLM's own beam search is LLM.beam_search too
                    hint += "; for beam search call llm.beam_search(prompts, BeamSearchParams(beam_width=..., " \
                            "max_tokens=...))"
            else:
                hint = f"the fields are {', '.join(sorted(names))}"
                close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.8)
                if close:  # a typo: max_new_token, temprature
                    hint = f"did you mean {close[0]!r}? {hint}"
            raise RequestError(f"SamplingParams has no field {key!r}", hint)
        init(self, *args, **kwargs)
    return __init__


SamplingParams.__init__ = _refuse_unknown_names(SamplingParams.__init__)


def _set_max_tokens(self, value) -> None:
    self.max_new_tokens = value  # checked with the other fields when a request is made of the params (checked())


# vLLM code sets it too (`params.max_tokens = 64`): that was "property 'max_tokens' ... has no setter"
SamplingParams.max_tokens = property(lambda self: self.max_new_tokens, _set_max_tokens,
                                     doc="vLLM's name for max_new_tokens")


def _output_kind(value) -> RequestOutputKind:
    """output_kind as a RequestOutputKind: one, vLLM's own enum (read by its name), its name as text ("delta") or
    its value (1); anything else refused, naming the kinds."""
    if isinstance(value, RequestOutputKind):
        return value
    name = value.name if isinstance(value, enum.Enum) else value
    if isinstance(name, str) and name.upper() in RequestOutputKind.__members__:
        return RequestOutputKind[name.upper()]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value <= 2:
        return RequestOutputKind(int(value))
    raise RequestError(f"output_kind must be a RequestOutputKind, got {value!r}"[:200],
                       "from infer import RequestOutputKind; e.g. output_kind=RequestOutputKind.DELTA (CUMULATIVE, "
                       "DELTA or FINAL_ONLY)")


def _ids(values) -> list:
    """A list of token ids, numpy integers turned into ints (anything else is left for the checks to refuse)."""
    values = list(values or [])
    if all(type(t) is int for t in values):  # the usual case, without an ABC check a token (28 ms for 16,384 ids)
        return values
    return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in values]


def _bias(value) -> dict:
    """logit_bias as {int token id: float}: JSON's string keys ("50256") and numpy numbers read as numbers; anything
    else is left for the checks to refuse."""
    if not isinstance(value, dict):
        return {} if value is None else value
    out = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():  # "²" is a digit int() refuses
            key = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
            key = int(key)
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not math.isfinite(bias):
            raise RequestError(f"logit_bias[{key!r}] must be a finite number, got {bias!r}")
        out[key] = float(bias)
    return out
