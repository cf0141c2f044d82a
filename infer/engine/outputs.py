"""What the engine hands back for a request after a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far (forced prefix tokens included)
    new_token_ids: list[int]
    text: str  # output text so far, stop strings removed
    delta_text: str  # text not handed out before (safe to stream)
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    logprobs: list[dict] | None = None
    lora: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_prefix_tokens: int = 0  # the request's forced prefix_token_ids at the start of token_ids

    @property
    def num_generated(self) -> int:
        """Tokens the model generated: what max_new_tokens limits and completion_tokens counts."""
        return len(self.token_ids) - self.num_prefix_tokens

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": self.num_generated}
