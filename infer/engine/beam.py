"""Beam search, as vLLM's `LLM.beam_search`: built on the engine's generation, one token per step for every live beam
of every prompt (their shared prefixes come from the prefix cache), each beam extended by its top 2 x beam_width
tokens (and the sampled one), the best beam_width candidates of a prompt kept by their score.

A beam's score is its cumulative logprob divided by its length (prompt included, a final EOS not counted) to the
power `length_penalty` (vLLM's get_beam_search_score). With EOS taken (ignore_eos false) a candidate ending in EOS is
a finished beam and leaves the search; at the end the running beams join the finished ones and the best beam_width
are returned, best first. The candidates of a step are the same as transformers' `generate(num_beams=...)`'s (its
top 2 x num_beams over every beam's tokens), so with EOS ignored the beams are transformers' too. As vLLM's, a
finished beam's tokens and text hold its EOS only with include_stop_str_in_output (its stop_reason names it).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from ..errors import RequestError

MAX_BEAM_WIDTH = 10  # 2 x beam_width candidates per beam come from the top logprobs, which stop at 20


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: beam_width beams, max_tokens new tokens at most."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # the draw of the token a step samples beside the top ones (0: greedy, vLLM's default)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the EOS token's own text kept at the end of a finished beam's text

    def __post_init__(self) -> None:
        for name, lo, hi in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, 2 ** 31 - 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
                raise RequestError(f"{name} must be an integer in {lo}..{hi}, got {value!r}"[:200],
                                   "beam_width is at most 10: each beam's candidates are its top 2 x beam_width "
                                   "tokens, and top logprobs stop at 20" if name == "beam_width" else None)
            setattr(self, name, int(value))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}"[:200])
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value!r}"[:200])
        if not 0 <= self.temperature <= 100:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")


class Logprob(float):
    """vLLM's Logprob, the values of a beam's `logprobs` ({token id: Logprob} per generated token): a float (the
    logprob, as infer's values were), with vLLM's fields `logprob`, `rank` (the token's rank in the model's
    distribution, 1 the most likely; None where the step did not say) and `decoded_token` (None: a beam's text is
    decoded whole)."""
    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> "Logprob":
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: `tokens` the prompt's and the beam's, `text` their decoded text (prompt included, as
    vLLM's), `logprobs` one {token id: Logprob} per generated token (each a float with vLLM's logprob and rank),
    `cum_logprob` their sum."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    num_prompt_tokens: int = 0
    stop_reason: int | None = None  # with finish_reason "stop": the EOS id that ended it (vLLM's)

    @property
    def output_token_ids(self) -> list[int]:
        """The beam's own tokens (after the prompt)."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's best beams, best first."""
    sequences: list[BeamSearchSequence]


def score(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the cumulative logprob over the length (prompt included, a last EOS not)."""
    return beam.cum_logprob / (_length(beam, eos) ** length_penalty)


def _length(beam: BeamSearchSequence, eos: set[int]) -> int:
    return len(beam.tokens) - (1 if beam.tokens[-1] in eos else 0)


def _log_score(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> tuple[int, float]:
    """A key that orders beams as `score` does, in logarithms: (the score's sign, log |score| signed so that a larger
    key is a larger score). For a length_penalty whose power is no float (length ** 1e6 overflows, length ** -1e6 is
    0.0, the quotient a division by zero)."""
    c = beam.cum_logprob
    if c == 0:
        return 0, 0.0
    log = math.log(abs(c)) - length_penalty * math.log(_length(beam, eos))
    return (1, log) if c > 0 else (-1, -log)


def ranked(beams: list[BeamSearchSequence], eos: set[int], length_penalty: float) -> list[BeamSearchSequence]:
    """`beams` best first by `score` (a stable sort: ties keep their order). A length_penalty (any finite number, as
    vLLM's) whose power is no float orders them by `_log_score`: the same order, where the quotient was an
    OverflowError (a 500, a traceback), a division by zero, or an infinity that tied every beam."""
    try:
        keys: list = [score(b, eos, length_penalty) for b in beams]
    except (OverflowError, ZeroDivisionError):
        keys = []
    if len(keys) < len(beams) or not all(map(math.isfinite, keys)):
        keys = [_log_score(b, eos, length_penalty) for b in beams]
    return [beams[k] for k in sorted(range(len(beams)), key=keys.__getitem__, reverse=True)]


class BeamSearch:
    """The search of some prompts, one step at a time, for whoever runs the steps: `LLM.beam_search` (beam_search
    below, over LLM.generate) and the server (its engine loop, beside other requests). Each step: `beams()` lists
    (prompt index, beam) whose next token the model must score, each scored by one request of `step` (one token,
    the top 2 x beam_width logprobs); `advance(beams, outs)` takes their outputs (each with `logprobs`); once
    `beams()` is empty `finish(tokenizer)` returns each prompt's best beams."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos: set[int], max_model_len: int,
                 priority: int = 0):
        from .sampling_params import SamplingParams
        for i, prompt in enumerate(prompts):
            if len(prompt) >= max_model_len:  # no max_tokens fits: "lower max_tokens to 0" is no advice
                raise RequestError(f"prompt {i} has {len(prompt)} tokens, which leaves no room under the context "
                                   f"({max_model_len} tokens) for even one new token",
                                   f"shorten the prompt to at most {max_model_len - 1} tokens")
            if len(prompt) + params.max_tokens > max_model_len:
                raise RequestError(f"prompt {i} has {len(prompt)} tokens: with max_tokens {params.max_tokens} its "
                                   f"beams outgrow the context ({max_model_len} tokens)",
                                   f"lower max_tokens to {max_model_len - len(prompt)} or less")
        self.params, self.eos = params, set(eos)
        self.step = SamplingParams(max_new_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                                   ignore_eos=True, detokenize=False, priority=priority)
        self.live = [[BeamSearchSequence(list(p), num_prompt_tokens=len(p))] for p in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def beams(self) -> list[tuple[int, BeamSearchSequence]]:
        """The live beams of every prompt, as (prompt index, beam): none once max_tokens steps ran."""
        if self.steps >= self.params.max_tokens:
            return []
        return [(i, beam) for i, group in enumerate(self.live) for beam in group]

    def advance(self, beams: list[tuple[int, BeamSearchSequence]], outs) -> None:
        """One step: `outs[k]` the output of `beams[k]`'s request."""
        params, width, eos, live, done = self.params, self.params.beam_width, self.eos, self.live, self.done
        candidates: list[list[BeamSearchSequence]] = [[] for _ in live]
        for (i, beam), out in zip(beams, outs):
            if not out.logprobs:  # the step failed (an engine error, an adapter gone): no token to extend the beam by
                raise RequestError(f"beam search of prompt {i} failed at step {self.steps + 1}: "
                                   f"{getattr(out, 'error', None) or 'its step returned no token'}",
                                   "the step's error says why; fix it and run the search again")
            record = out.logprobs[0]
            # each candidate with its rank, as vLLM's Logprob: the chosen token's from its record, the top ones' their
            # place among the top (1: the most likely)
            options = {record["token_id"]: Logprob(record["logprob"], record.get("rank"))}
            for j, x in enumerate(record.get("top_logprobs", [])):
                options.setdefault(x["token_id"], Logprob(x["logprob"], j + 1))
            for token, logprob in options.items():
                if logprob == -math.inf:
                    continue
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [options], beam.cum_logprob + logprob,
                                         num_prompt_tokens=beam.num_prompt_tokens)
                if token in eos and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    done[i].append(new)
                else:
                    candidates[i].append(new)
        for i, group in enumerate(candidates):
            live[i] = ranked(group, eos, params.length_penalty)[:width]
        self.steps += 1

    def finish(self, tokenizer) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width beams, best first, with their text."""
        params, results, eos, live, done = self.params, [], self.eos, self.live, self.done
        for i in range(len(live)):
            for beam in live[i]:
                beam.finish_reason = "length"
            best = ranked(done[i] + live[i], eos, params.length_penalty)[:params.beam_width]
            for beam in best:  # as vLLM's: a final EOS stays in the tokens (and the text) only with
                # include_stop_str_in_output; the text is the prompt's and the beam's, special tokens kept
                if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                    beam.tokens = beam.tokens[:-1]
                beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=False)
            results.append(BeamSearchOutput(best))
        return results


def beam_search(generate, tokenizer, eos: set[int], prompts: list[list[int]], params: BeamSearchParams,
                lora: list[str | None], max_model_len: int, salts: list[str | None] | None = None
                ) -> list[BeamSearchOutput]:
    """`generate(prompts, SamplingParams, loras)` runs one step of every beam (LLM.generate); `prompts` are token
    ids, `lora` an adapter (or None) per prompt, `salts` a prompt's cache_salt (or None): its beams' steps are
    {"prompt_token_ids": ..., "cache_salt": ...} prompts, sharing cached prefixes only with that salt's."""
    salts = salts or [None] * len(prompts)
    search = BeamSearch(prompts, params, eos, max_model_len)
    while beams := search.beams():
        outs = generate([beam.tokens if salts[i] is None else {"prompt_token_ids": beam.tokens, "cache_salt": salts[i]}
                         for i, beam in beams], search.step, [lora[i] for i, _ in beams])
        search.advance(beams, outs)
    return search.finish(tokenizer)
