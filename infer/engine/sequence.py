"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


PENDING = -1  # token id of a position whose token was sampled on the device and is not yet known on the host


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # one request is one object: `in` and remove() on the queues compare by identity, not by building
class Sequence:  # a tuple of every field for each request ahead of the one removed
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None = None
    max_total_len: int = 0  # prompt + output cap (the smaller of the request's max_length and the model's)
    lora_key: object = None  # the adapter's prefix-cache key (LoRAManager.cache_key); the name when not set
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        # Forced first reply tokens are output tokens from the start; they are computed with the prompt.
        self.output_token_ids: list[int] = list(self.params.prefix_token_ids)
        # the adapter's name, as outputs report it; `lora` is the adapter manager's key of its weights, which a
        # replacement of the adapter while the request runs changes (LLMEngine.add_lora(replace=True))
        self.lora_name = self.lora
        self.lora_request = None  # vLLM's LoRARequest of the adapter (RequestOutput.lora_request; LLMEngine sets it)
        self.status = Status.WAITING
        self.number = 0  # the scheduler's admission number (Scheduler.add): ties of priority and arrival, in order
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, found in the prefix cache at admission
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.state_slot: int | None = None  # a hybrid model's state slot while it runs (engine.state_cache)
        self.num_freed_blocks = 0  # leading blocks freed behind a sliding window (the placeholder in the table)
        self.last_block_hash: bytes | None = None
        self.block_keys: list[bytes] = []  # prefix cache keys of the leading full blocks (block_manager.block_key)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.bad_request = False  # the error is the request's own (constraints that leave no token): the server's 400
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None  # (time.monotonic) when a step first took it
        self.finished_time: float | None = None
        self.token_times: list[float] = []
        self.logprobs: list[dict] | None = [] if self.params.logprobs is not None else None
        self.text = ""  # detokenized output, stop strings removed
        self.sent_text_len = 0  # how much of `text` the caller has seen (streaming)
        self.decoded_tokens, self.decoded_text = 0, ""  # output tokens whose text is final, and that text
        self.decoded_any = False  # (a tokenizer without a decoder) decoded_text holds a token: the next follows a space
        self.final_text_len: int | None = None  # `text` past this may still change (an open run of byte tokens)
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS)
        self.stop_search_from: int | None = None  # where stop strings may start in `text`: after the forced prefix
        self.num_preemptions = 0
        self.generator = None  # torch.Generator for seeded sampling, made by the sampler
        # the tokens min_tokens masks (EOS unless ignore_eos, and stop_token_ids) while the reply is shorter; set by
        # LLMEngine.add_request, emptied once the reply is long enough
        self.min_tokens_ban: list[int] = []
        # whether the sampler applies a logits processor of the request (allowed_token_ids, logit_bias, min_tokens,
        # bad_words, a grammar): one attribute read per row and step for the requests without
        self.logit_masks = bool(self.params.allowed_token_ids or self.params.logit_bias or self.params.min_tokens
                                or self.params.bad_words)
        self.grammar = None  # structured outputs: the request's xgrammar matcher (LLMEngine.add_request)
        self.bad_words: list[list[int]] = []  # bad_words as token ids (LLMEngine.add_request)
        # what the sampler masks depends on the last token sampled (a grammar, a bad word of several tokens): with
        # that token still on the device, the step's mask is filled after its forward is queued, once the step
        # before has completed on the host (SamplingInputs.settle, ModelRunner.launch)
        self.reads_last_token = False
        self.min_text_len: int | None = None  # with min_tokens: len(text) after that many tokens (stops end past it)
        # prompt_logprobs: a record per prompt token (None for the first, which nothing predicts), filled as the
        # prefill's steps complete; prompt_lp_next: the next prompt position a step was asked for (a preempted
        # request's recomputation does not ask again)
        self.prompt_logprobs: list | None = [None] if self.params.prompt_logprobs is not None else None
        self.prompt_lp_next = 1
        # Tokens sampled on the device whose values the host does not know yet (overlapped steps, see
        # LLMEngine): they count in len() and sit after output_token_ids; tokens() shows them as PENDING.
        self.num_pending = 0
        # speculative decoding: the tokens proposed for it this step (LLMEngine._propose), verified by the step that
        # schedules them (their KV is never registered: only the tokens the step accepts join the sequence)
        self.draft_token_ids: list[int] = []
        # with a grammar, its verify rows' bitmask [len(draft_token_ids) + 1, W] (structured.draft_bitmask)
        self.draft_bitmask = None
        # (speculative.propose_for) the ids the proposer searched last, packed 8 bytes each, and how many: each step
        # packs only the tokens added since
        self.ngram_ids: tuple[bytearray, int] | None = None
        # draft-model speculation (engine.draft): the leading tokens whose KV the draft model's cache holds, and the
        # positions the step's draft forwards wrote (draft_computed after the verify: those whose tokens stay)
        self.draft_computed = 0
        self.draft_fed = 0
        # EAGLE-3 (engine.eagle): (first position, the target's projected hidden states from there) not fed yet
        self.draft_hidden = None
        # a hybrid model's prefix cache: the key of the state snapshot this sequence keeps past its prompt, at the last
        # block boundary it reached (engine.state_cache.StateSnapshots.name moves it on)
        self.state_snap_key: bytes | None = None
        self.prompt: str | None = None  # the prompt's text when LLMEngine.add_request got text (RequestOutput.prompt)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    def draft_end(self, end: int, context: int | None) -> int:
        """Draft-model speculation: where the draft model's feed of this sequence's tokens up to `end` stops, its
        context (positions) being `context` (None: any): at `end`, or at the context (a sequence drafts only while its
        tokens and drafts fit it); nothing past the start once the sequence is that long (it drafts no more)."""
        if context is None:
            return end
        return min(end, context if len(self) < context else 0)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def num_generated(self) -> int:
        """Tokens sampled by the model (forced prefix tokens excluded)."""
        return len(self.output_token_ids) - len(self.params.prefix_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end); positions of pending tokens read PENDING (the model runner takes their values
        from the device)."""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if end > known:
            return self.tokens(start, max(start, known)) + [PENDING] * (end - max(start, known))
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
