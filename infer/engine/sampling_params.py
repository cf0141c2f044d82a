"""SamplingParams: how one request is decoded, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import RequestError


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 256
    max_length: int | None = None  # prompt + output cap
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    prefix_token_ids: list[int] = field(default_factory=list)  # forced first reply tokens
    logprobs: int | None = None  # top-k logprobs per generated token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.prefix_token_ids = list(self.prefix_token_ids or [])
        checks = [
            (self.max_new_tokens is None or self.max_new_tokens >= 1,
             f"max_new_tokens must be at least 1, got {self.max_new_tokens}"),
            (self.max_length is None or self.max_length >= 1, f"max_length must be at least 1, got {self.max_length}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be a list of token ids"),
            (all(isinstance(t, int) and t >= 0 for t in self.prefix_token_ids),
             "prefix_token_ids must be a list of token ids"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in 0..20, got {self.logprobs}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
