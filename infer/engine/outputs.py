"""What the engine hands back for a request after a step."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """vLLM's per-request timings (RequestOutput.metrics), in time.monotonic() seconds; None where the request has
    not got there (not scheduled yet, no token yet, not finished)."""
    arrival_time: float
    last_token_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    time_in_queue: float | None
    finished_time: float | None = None


class CompletionOutput:
    """One sample of a request, as vLLM's CompletionOutput: `RequestOutput.outputs[j]` (j < SamplingParams.n).
    logprobs are infer's records ({token_id, logprob, rank, top_logprobs}); cumulative_logprob is their sum (None
    when the request did not ask for logprobs)."""

    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "num_generated", "error",
                 "lora_request", "_cumulative")

    def __init__(self, index: int, text: str, token_ids: list[int], logprobs: list[dict] | None,
                 finish_reason: str | None, stop_reason: int | str | None = None, num_generated: int = 0,
                 error: str | None = None, lora_request=None):
        self.index, self.text, self.token_ids, self.logprobs = index, text, token_ids, logprobs
        self.lora_request = lora_request  # vLLM's: the request's LoRARequest (RequestOutput.lora_request)
        self.finish_reason, self.stop_reason, self.error = finish_reason, stop_reason, error
        self.num_generated = num_generated
        self._cumulative: float | None = None  # (a DELTA output's: the sum over the whole reply, not its logprobs')

    @classmethod
    def of(cls, out: RequestOutput, index: int = 0) -> CompletionOutput:
        return cls(index, out.text, out.token_ids, out.logprobs, out.finish_reason, out.stop_reason,
                   out.num_generated, out.error, out.lora_request)

    @property
    def cumulative_logprob(self) -> float | None:
        if self._cumulative is not None:
            return self._cumulative
        return None if self.logprobs is None else sum(r["logprob"] for r in self.logprobs)

    def finished(self) -> bool:  # vLLM's CompletionOutput.finished()
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids!r}, "
                f"finish_reason={self.finish_reason!r})")


class RequestOutput:
    """One request's state after a step. token_ids, logprobs, token_times and a running request's text are the
    request's as they were at that step: the engine hands out a length and copies the (append-only) lists and text
    only when they are read, so a step never copies every request's history, and the outputs a slow stream reader
    has not taken yet hold a length each, not a copy of the whole text so far (quadratic memory)."""

    prompt: str | None = None  # vLLM's: the prompt's text when LLM.generate / stream got it as text (else None)
    engine_index: int = 0  # the data-parallel replica that ran the request (the server's /metrics label engine)
    # vLLM's: the LoRARequest of the adapter the request ran with (the one given as lora_request=, else one of the
    # adapter's name, an id and its folder: LLMEngine.lora_request_of); None without an adapter
    lora_request = None
    # vLLM's fields of encoder-decoder, multimodal and disaggregated serving, which infer's text decoder models never
    # have: None (multi_modal_placeholders: {}), so vLLM code that reads them runs unchanged
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict | None = None

    @property
    def multi_modal_placeholders(self) -> dict:
        return {}

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int] | None = None,
                 new_token_ids: list[int] | None = None, text: str = "", delta_text: str = "",
                 finished: bool = False, finish_reason: str | None = None, error: str | None = None,
                 logprobs: list[dict] | None = None, lora: str | None = None, arrival_time: float = 0.0,
                 first_token_time: float | None = None, token_times: list[float] | None = None,
                 num_cached_tokens: int = 0, num_prefix_tokens: int = 0, stop_reason: int | str | None = None,
                 prompt_logprobs: list | None = None, bad_request: bool = False,
                 first_scheduled_time: float | None = None, finished_time: float | None = None):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self._token_ids = list(token_ids or [])
        self.new_token_ids = list(new_token_ids or [])
        self.text, self.delta_text = text, delta_text  # output text so far (stop strings removed); new text
        self.finished = finished
        self.finish_reason, self.error = finish_reason, error  # stop | length | abort | error
        # with finish_reason error: the request's own constraints left no token to sample (a dead end it reached)
        self.bad_request = bad_request
        self.stop_reason = stop_reason  # with finish_reason stop: the stop token id or string (None: EOS), as vLLM
        self._logprobs = logprobs
        self.lora, self.arrival_time, self.first_token_time = lora, arrival_time, first_token_time
        self.first_scheduled_time, self.finished_time = first_scheduled_time, finished_time
        self._token_times = list(token_times or [])
        self.num_cached_tokens = num_cached_tokens
        self.num_prefix_tokens = num_prefix_tokens  # the request's forced prefix_token_ids at the start of token_ids
        # with prompt_logprobs: None, then a record per prompt token from the second ({token_id, logprob, rank,
        # top_logprobs}), the model's raw distribution given the tokens before it (complete from the first token on)
        self.prompt_logprobs = prompt_logprobs
        self._seq, self._len = None, 0
        self._samples: list[CompletionOutput] | None = None  # with n > 1 (LLM.generate): every sample

    @classmethod
    def snapshot(cls, seq, new_token_ids: list[int], delta_text: str) -> RequestOutput:
        """The output of `seq` (an engine.sequence.Sequence) as it is now, its lists read lazily."""
        out = cls.__new__(cls)  # every field set here: this runs for every request at every step
        out.request_id, out.prompt_token_ids, out.new_token_ids = seq.request_id, seq.prompt_token_ids, new_token_ids
        # a running request's text is what its deltas handed out so far (a possible stop string or partial character
        # held back, as in vLLM), so each step's text extends the last and the final text
        if seq.finished:
            out._text, out._text_seq = seq.text, None
        else:  # read when asked for: each step's text is a prefix of every later one (see above)
            out._text, out._text_seq, out._text_len = None, seq, seq.sent_text_len
        out.delta_text, out.finished = delta_text, seq.finished
        out.finish_reason, out.error, out.lora = seq.finish_reason, seq.error, seq.lora_name
        out.lora_request = seq.lora_request
        out.bad_request = seq.bad_request
        out.stop_reason = seq.stop_reason if seq.finish_reason == "stop" else None
        out.arrival_time, out.first_token_time = seq.arrival_time, seq.first_token_time
        out.first_scheduled_time, out.finished_time = seq.first_scheduled_time, seq.finished_time
        out.num_cached_tokens, out.num_prefix_tokens = seq.num_cached_tokens, len(seq.params.prefix_token_ids)
        out.prompt_logprobs = seq.prompt_logprobs  # complete (and no longer growing) once a token is sampled
        out._token_ids = out._token_times = out._logprobs = None
        out._seq, out._len = seq, len(seq.output_token_ids)
        out._samples = None
        out.prompt = seq.prompt
        return out

    @classmethod
    def failed(cls, request_id: str, seq, message: str) -> RequestOutput:
        """The last output of a request an engine failure ended (finish_reason "error", `message`): the prompt, the
        tokens, text and times it had (`seq`, its engine.sequence.Sequence, or None where the engine never held
        it), finished now."""
        if seq is None:
            return cls(request_id, [], finished=True, finish_reason="error", error=message,
                       finished_time=time.monotonic())
        out = cls(request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), text=seq.text, finished=True,
                  finish_reason="error", error=message, lora=seq.lora_name, arrival_time=seq.arrival_time,
                  logprobs=None if seq.logprobs is None else list(seq.logprobs),
                  first_token_time=seq.first_token_time, token_times=seq.token_times,
                  num_cached_tokens=seq.num_cached_tokens, num_prefix_tokens=len(seq.params.prefix_token_ids),
                  first_scheduled_time=seq.first_scheduled_time,
                  finished_time=seq.finished_time if seq.finished_time is not None else time.monotonic())
        out.lora_request = seq.lora_request
        return out

    @classmethod
    def merged(cls, samples: list[RequestOutput]) -> RequestOutput:
        """The n samples of one prompt (LLM.generate with SamplingParams.n > 1) as one output, as vLLM returns
        them: `outputs[j]` is sample j; the fields of the output itself are sample 0's, but for its times (`metrics`:
        the group's, the first sample scheduled, the first token and the last any sample made); its usage counts the
        prompt once and every sample's tokens."""
        first = samples[0]

        def earliest(times):
            return min((t for t in times if t is not None), default=None)
        out = cls(first.request_id, first.prompt_token_ids, first.token_ids, text=first.text,
                  finished=all(s.finished for s in samples), finish_reason=first.finish_reason, error=first.error,
                  logprobs=first.logprobs, lora=first.lora, arrival_time=first.arrival_time,
                  first_token_time=earliest(s.first_token_time for s in samples), token_times=first.token_times,
                  num_cached_tokens=first.num_cached_tokens, num_prefix_tokens=first.num_prefix_tokens,
                  stop_reason=first.stop_reason, prompt_logprobs=first.prompt_logprobs, bad_request=first.bad_request,
                  first_scheduled_time=earliest(s.first_scheduled_time for s in samples),
                  finished_time=max((s.finished_time for s in samples if s.finished_time is not None),
                                    default=None) if all(s.finished for s in samples) else None)
        out.lora_request = first.lora_request
        out._samples = [CompletionOutput.of(s, j) for j, s in enumerate(samples)]
        # the request's times are the group's, as vLLM's for n > 1: its first token the first any sample made, its
        # last token the last any made (sample 0 may have stopped long before the others)
        out._last_token_time = max((s.token_times[-1] for s in samples if s.token_times), default=None)
        out.prompt = first.prompt
        return out

    @property
    def metrics(self) -> RequestMetrics:
        """vLLM's RequestMetrics of the request (times in time.monotonic() seconds): arrival, first scheduled,
        first and last token, finish, and the time it waited in the queue."""
        times, scheduled = self.token_times, self.first_scheduled_time
        last = getattr(self, "_last_token_time", None) if getattr(self, "_samples", None) else None
        return RequestMetrics(arrival_time=self.arrival_time,
                              last_token_time=last if last is not None else times[-1] if times else None,
                              first_scheduled_time=scheduled, first_token_time=self.first_token_time,
                              time_in_queue=None if scheduled is None else scheduled - self.arrival_time,
                              finished_time=self.finished_time)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's list of samples: one (this output's own) unless SamplingParams.n > 1 asked for more."""
        samples = getattr(self, "_samples", None)
        return samples if samples is not None else [CompletionOutput.of(self)]

    def __getstate__(self) -> dict:
        """Pickled (Ray, multiprocessing) with its lists read, never with the engine's Sequence: the request's whole
        state, and a structured-output request's xgrammar matcher, which cannot be pickled."""
        if self._seq is not None:
            self._materialize()
        self.text  # noqa: B018 (read: the Sequence is not pickled)
        return self.__dict__

    def _materialize(self) -> None:
        seq, n, gen = self._seq, self._len, self._len - len(self._seq.params.prefix_token_ids)
        self._token_ids = seq.output_token_ids[:n]
        self._token_times = seq.token_times[:gen]
        self._logprobs = seq.logprobs[:gen] if seq.logprobs is not None else None
        self._seq = None

    @property
    def text(self) -> str:
        """The output text so far (stop strings removed)."""
        if self._text_seq is not None:
            self._text, self._text_seq = self._text_seq.text[:self._text_len], None
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self._text_seq = value, None

    @property
    def token_ids(self) -> list[int]:
        """Every output token so far (forced prefix tokens included)."""
        if self._seq is not None:
            self._materialize()
        return self._token_ids

    @property
    def logprobs(self) -> list[dict] | None:
        if self._seq is not None:
            self._materialize()
        return self._logprobs

    @property
    def token_times(self) -> list[float]:
        if self._seq is not None:
            self._materialize()
        return self._token_times

    def token_times_from(self, start: int) -> list[float]:
        """token_times[start:], without copying the request's whole history (the server's metrics read the times of
        each step's new tokens)."""
        if self._seq is not None:
            return self._seq.token_times[start:self.num_generated]
        return self._token_times[start:]

    @property
    def num_generated(self) -> int:
        """Tokens the model generated: what max_new_tokens limits and completion_tokens counts."""
        n = self._len if self._seq is not None else len(self._token_ids)
        return n - self.num_prefix_tokens

    @property
    def usage(self) -> dict:
        samples = getattr(self, "_samples", None)
        made = self.num_generated if samples is None else sum(s.num_generated for s in samples)
        return {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": made}

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, text={self.text!r}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r})")


def as_delta(out: RequestOutput, sent: list, index: int = 0) -> None:
    """vLLM's RequestOutputKind.DELTA: `out.outputs[0]` holds only what is new since the request's last output (its
    text, token ids and logprobs; `sent` counts what was handed out, the logprobs' sum so far and whether the
    prompt's logprobs went out, and is moved on); its cumulative_logprob is the whole reply's, as vLLM's. The
    output's own text and token_ids stay the reply so far, and delta_text / new_token_ids what is new, as with every
    output kind. Its prompt_logprobs come with the first output only (vLLM's DELTA pops them): a program joining the
    outputs' parts does not get them again at every step."""
    ids, logprobs, text = out.token_ids, out.logprobs, out.text
    new_logprobs = None if logprobs is None else logprobs[sent[1]:]
    sample = CompletionOutput(index, text[sent[2]:], ids[sent[0]:], new_logprobs, out.finish_reason,
                              out.stop_reason, out.num_generated, out.error, out.lora_request)
    if new_logprobs is not None:  # (a running sum: not every logprob again at every step)
        sent[3] += sum(r["logprob"] for r in new_logprobs)
        sample._cumulative = sent[3]
    out._samples = [sample]
    if sent[4]:  # (handed out with the first output)
        out.prompt_logprobs = None
    sent[:3], sent[4] = [len(ids), len(logprobs or ()), len(text)], True
