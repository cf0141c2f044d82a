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
from .transfer import Pack, to_device

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


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] float: how often each token id occurs in each row of ids [n, width] (the id `vocab` pads a row),
    one scatter for the batch."""
    counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)
    if ids.shape[1]:
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=ids.device))
    return counts[:, :vocab]


def _draw_values(seqs: list[Sequence], vocab: int) -> list[list[float]]:
    """Each row's temperature, 1 - top_p and top_k (vocab: off)."""
    return [[s.params.temperature, 1.0 - s.params.top_p, min(s.params.top_k, vocab) if s.params.top_k else vocab]
            for s in seqs]


class SamplingInputs:
    """What sampling a step's rows (`seqs`) needs from the host, gathered before the step's inputs are copied. The
    integers join the step's Pack (the model runner's one int64 copy): the indices of the drawn (non-greedy) rows
    when greedy rows are among them, and the token ids the penalties count, each row padded with the id `vocab`.
    The floats (each row's penalties, each drawn row's temperature, top-p, top-k) make one copy of their own, and
    none in a step of greedy rows without penalties. `load` makes the device side: idx, seen_ids, counted_ids,
    penalty_values [n, 3], draw_values [len(drawn), 3]."""

    def __init__(self, seqs: list[Sequence], vocab: int, pack: Pack):
        self.n = len(seqs)
        self.drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
        self.penalties = any(s.params.needs_penalties for s in seqs)
        self._idx = pack.add(self.drawn) if 0 < len(self.drawn) < self.n else None
        floats = []
        if self.penalties:
            seen = [s.prompt_token_ids + s.output_token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]
            outs = [s.output_token_ids if s.params.presence_penalty or s.params.frequency_penalty else [] for s in seqs]
            self._ids = []  # (place in the pack, width) of the seen and of the counted token ids
            for rows in (seen, outs):
                width = max(map(len, rows))
                self._ids.append((pack.add_rows(rows, width, vocab), width))  # vocab: the padding column
            floats += [[s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty]
                       for s in seqs]
        self.floats = floats + _draw_values([seqs[i] for i in self.drawn], vocab)
        self.idx = self.seen_ids = self.counted_ids = self.penalty_values = self.draw_values = None

    def load(self, data: torch.Tensor, device: torch.device) -> SamplingInputs:
        """The device side, from `data` (the step's Pack on the device) and one copy of the floats."""
        if self._idx is not None:
            self.idx = data[self._idx]
        values = to_device(self.floats, torch.float32, device) if self.floats else None
        if self.penalties:
            self.seen_ids, self.counted_ids = (data[at].view(self.n, width) for at, width in self._ids)
            self.penalty_values, values = values[:self.n], values[self.n:]
        self.draw_values = values
        return self

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, device: torch.device) -> SamplingInputs:
        """Loaded with copies of their own (a sampler used outside the model runner)."""
        pack = Pack()
        inputs = cls(seqs, vocab, pack)
        data = pack.to(device) if pack.values else torch.empty(0, dtype=torch.long, device=device)
        return inputs.load(data, device)


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

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs | None = None) -> SampledBatch:
        """The whole batch on the device, without a sync. `inputs`: the rows' SamplingInputs, loaded (the model
        runner builds them with the step's other inputs); None: built here."""
        logits = logits.float()
        if inputs is None:
            inputs = SamplingInputs.build(seqs, logits.shape[-1], logits.device)
        x = self.penalised(logits, seqs, inputs)
        tokens = x.argmax(-1)
        if inputs.drawn:
            idx = inputs.idx
            every = idx is None
            drawn = [seqs[i] for i in inputs.drawn]
            probs = self.probs(x if every else x.index_select(0, idx), drawn, inputs.draw_values)
            picked = (probs / self._exponentials(drawn, x.shape[-1], x.device)).argmax(-1)
            tokens = picked if every else tokens.index_copy(0, idx, picked)
        return self._pack(logits, tokens, [s.params.logprobs for s in seqs])

    @staticmethod
    def penalised(logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs | None = None) -> torch.Tensor:
        """logits [n, V] (float) with each row's repetition, presence and frequency penalties applied."""
        if not (inputs.penalties if inputs is not None else any(s.params.needs_penalties for s in seqs)):
            return logits
        vocab = logits.shape[-1]
        if inputs is None:
            inputs = SamplingInputs.build(seqs, vocab, logits.device)
        seen = token_counts(inputs.seen_ids, vocab) > 0
        counts = token_counts(inputs.counted_ids, vocab)
        values = inputs.penalty_values
        return apply_penalties(logits, seen, counts, values[:, 0], values[:, 1], values[:, 2])

    @staticmethod
    def probs(logits: torch.Tensor, seqs: list[Sequence], values: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution each (non-greedy) row draws from: temperature, top-k, top-p, softmax. `values`: the rows'
        temperature, 1 - top_p, top_k on the device [n, 3] (SamplingInputs.draw_values); None: copied here."""
        if values is None:
            values = to_device(_draw_values(seqs, logits.shape[-1]), torch.float32, logits.device)
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
