"""Turn the last-token logits of a batch into next tokens on the device, each row with its own sampling parameters.

The whole batch is sampled by a handful of tensor ops (as nano-vllm and gpt-fast do), with the per-row parameters
as tensors, and nothing is copied back to the host here: `Sampler.sample` returns device tensors and the caller
copies them once per step (`SampledBatch.packed`: the tokens and, when asked for, the logprob values together).

Per row, in vLLM's and transformers' order: penalties on the raw logits (repetition over prompt + output tokens, as
transformers' RepetitionPenaltyLogitsProcessor; presence and frequency over output tokens, as OpenAI defines them),
then temperature, top-k, top-p (as transformers' warpers), then one draw. Greedy rows take the argmax of the
penalised logits. A draw is an exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. is distributed as p. q is
drawn for each row from that request's own generator when it has a seed (so it gets the same tokens in any batch
and any batch order), and from the engine's generator for the other rows. Logprob records describe the model's
raw distribution (before penalties and temperature), as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence
from .transfer import to_device

NEG_INF = float("-inf")


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, one_minus_top_p: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with top-k then top-p applied per row, the dropped entries -inf.

    top_k [n] long in 1..V (V: off); one_minus_top_p [n] float, 1 - top_p (0: off). Semantics of transformers'
    TopKLogitsWarper (keep every value >= the k-th largest) and TopPLogitsWarper (sort ascending, drop while the
    cumulative probability is <= 1 - top_p, always keep the largest), with one sort for both.
    """
    vocab = logits.shape[-1]
    asc, idx = logits.sort(-1)
    kth = asc.gather(1, (vocab - top_k).unsqueeze(1))
    asc = asc.masked_fill(asc < kth, NEG_INF)
    drop = asc.softmax(-1).cumsum(-1) <= one_minus_top_p.unsqueeze(1)
    drop[:, -1] = False
    return torch.empty_like(logits).scatter_(1, idx, asc.masked_fill(drop, NEG_INF))


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """logits [n, V] penalised per row. seen [n, V] bool: token in prompt or output; counts [n, V]: occurrences in
    the output; repetition, presence, frequency [n] (1, 0, 0: off).

    Repetition (transformers): a seen token's logit l becomes l * r if l < 0, else l / r.
    Presence and frequency (OpenAI): l - frequency * count - presence * (count > 0).
    """
    r = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits < 0, logits * r, logits / r), logits)
    return logits - counts * frequency.unsqueeze(1) - (counts > 0).to(logits.dtype) * presence.unsqueeze(1)


def token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] float: how often each token id occurs in each row's list (one scatter for the batch)."""
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    width = max(map(len, rows), default=0)
    if width:
        ids = to_device([r + [vocab] * (width - len(r)) for r in rows], torch.long, device)  # vocab: padding column
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


@dataclass
class SampledBatch:
    """One step's sampled rows, on the device. `packed` is what is copied to the host (once): the token ids
    (int64 [n]), or with logprobs a float64 [n, 2 + 2k] of token, its logprob, k top ids, k top logprobs."""

    tokens: torch.Tensor  # [n] int64, on the device (the next step's input ids when steps overlap)
    packed: torch.Tensor
    logprobs: list[int | None]  # per row: the request's logprobs setting

    def decode(self, host: torch.Tensor) -> tuple[list[int], list[dict | None]]:
        """`packed` copied to the host -> (token ids, logprob records)."""
        if all(k is None for k in self.logprobs):
            return host.tolist(), [None] * len(self.logprobs)
        tokens, records, kmax = [], [], (host.shape[1] - 2) // 2
        for row, k in zip(host.tolist(), self.logprobs):
            token = int(row[0])
            tokens.append(token)
            rec = None if k is None else {"token_id": token, "logprob": row[1]}
            if k:
                rec["top_logprobs"] = [{"token_id": int(row[2 + j]), "logprob": row[2 + kmax + j]}
                                       for j in range(k)]
            records.append(rec)
        return tokens, records


class Sampler:
    def __init__(self, seed: int):
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}  # per device: rows of requests without a seed

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
        """logits [n, V] for the n sequences that sample this step -> (token ids, logprob records), on the host."""
        out = self.sample(logits, seqs)
        return out.decode(out.packed.cpu())

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledBatch:
        """The whole batch on the device, without a sync."""
        logits = logits.float()
        x = self.penalised(logits, seqs)
        tokens = x.argmax(-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            every = len(rows) == len(seqs)
            idx = None if every else to_device(rows, torch.long, logits.device)
            drawn = [seqs[i] for i in rows]
            probs = self.probs(x if every else x.index_select(0, idx), drawn)
            picked = (probs / self._exponentials(drawn, x.shape[-1], x.device)).argmax(-1)
            tokens = picked if every else tokens.index_copy(0, idx, picked)
        return self._pack(logits, tokens, [s.params.logprobs for s in seqs])

    @staticmethod
    def penalised(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [n, V] (float) with each row's repetition, presence and frequency penalties applied."""
        if not any(s.params.needs_penalties for s in seqs):
            return logits
        vocab, dev = logits.shape[-1], logits.device
        values = to_device([[s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty]
                            for s in seqs], torch.float32, dev)
        rep = [s.params.repetition_penalty != 1.0 for s in seqs]
        seen = token_counts([s.prompt_token_ids + s.output_token_ids if r else [] for s, r in zip(seqs, rep)],
                            vocab, dev) > 0
        outs = [s.output_token_ids if s.params.presence_penalty or s.params.frequency_penalty else [] for s in seqs]
        counts = token_counts(outs, vocab, dev)
        return apply_penalties(logits, seen, counts, values[:, 0], values[:, 1], values[:, 2])

    @staticmethod
    def probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each (non-greedy) row draws from: temperature, top-k, top-p, softmax."""
        vocab, dev = logits.shape[-1], logits.device
        values = to_device([[s.params.temperature, 1.0 - s.params.top_p,
                             min(s.params.top_k, vocab) if s.params.top_k else vocab] for s in seqs], torch.float32, dev)
        x = logits / values[:, 0:1]
        if any(s.params.top_k or s.params.top_p < 1.0 for s in seqs):
            x = filter_top_k_top_p(x, values[:, 2].long(), values[:, 1])
        return x.softmax(-1)

    def _exponentials(self, seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
        """[len(seqs), vocab] Exp(1) draws: a seeded request's row from its own generator."""
        q = torch.empty(len(seqs), vocab, device=device)
        if any(s.params.seed is None for s in seqs):
            q.exponential_(generator=self._engine_generator(device))
        for j, s in enumerate(seqs):
            if s.params.seed is not None:
                if s.generator is None:
                    s.generator = torch.Generator(device=device).manual_seed(s.params.seed)
                q[j].exponential_(generator=s.generator)
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[key]

    @staticmethod
    def _pack(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int | None]) -> SampledBatch:
        if all(k is None for k in ks):
            return SampledBatch(tokens, tokens, ks)
        logp = logits.log_softmax(-1)
        cols = [tokens.unsqueeze(1).double(), logp.gather(1, tokens.unsqueeze(1)).double()]
        kmax = max(k or 0 for k in ks)
        if kmax:
            vals, ids = logp.topk(kmax, -1)
            cols += [ids.double(), vals.double()]
        return SampledBatch(tokens, torch.cat(cols, 1), ks)
