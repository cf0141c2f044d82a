"""Turn the last-token logits of a batch into next tokens, each row with its own sampling parameters."""

from __future__ import annotations

import torch

from .sequence import Sequence


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:  # HF semantics: over prompt and output tokens
        ids = torch.tensor(sorted(set(seq.all_token_ids)), device=logits.device)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:  # OpenAI semantics: output tokens
        ids, counts = torch.tensor(seq.output_token_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    return logits


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        if seq.generator is None:
            seq.generator = torch.Generator().manual_seed(seq.params.seed)
        return seq.generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
        """logits [n, V] for the n sequences that sample this step -> (token ids, logprob records)."""
        logits = logits.float()
        simple = all(s.params.greedy and not s.params.needs_penalties for s in seqs)
        if simple:
            tokens = logits.argmax(-1).tolist()
        else:
            tokens = [self._sample_row(logits[i].clone(), s) for i, s in enumerate(seqs)]
        records = [None] * len(seqs)
        if any(s.params.logprobs is not None for s in seqs):
            logp = logits.log_softmax(-1)
            for i, s in enumerate(seqs):
                if s.params.logprobs is not None:
                    records[i] = self._logprob_record(logp[i], tokens[i], s.params.logprobs)
        return tokens, records

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        row = _apply_penalties(row, seq)
        if p.greedy:
            return int(row.argmax())
        row = _filter(row / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self._generator_for(seq)))

    @staticmethod
    def _logprob_record(logp: torch.Tensor, token: int, k: int) -> dict:
        rec = {"token_id": token, "logprob": float(logp[token])}
        if k:
            vals, ids = torch.topk(logp, k)
            rec["top_logprobs"] = [{"token_id": int(i), "logprob": float(v)} for v, i in zip(vals, ids)]
        return rec
