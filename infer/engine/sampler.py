"""Turn the last-token logits of a batch into next tokens on the device, each row with its own sampling parameters.

The whole batch is sampled by a handful of tensor ops (as nano-vllm and gpt-fast do), with the per-row parameters
as tensors, and nothing is copied back to the host here: `Sampler.sample` returns device tensors and the caller
copies them once per step (`SampledBatch.packed`: the tokens and, when asked for, the logprob values together).

Per row, in vLLM's and transformers' order: on the raw logits, a structured output's grammar (every token its
matcher does not allow next masked, engine/structured.py), allowed_token_ids (every other token masked), min_tokens
(EOS and the stop token ids masked while the reply is shorter), bad_words (a word's last token masked once the reply
ends with the rest of it) and logit_bias (added), as vLLM's logits processors; then the penalties (repetition over
prompt + output tokens, as transformers' RepetitionPenaltyLogitsProcessor; presence and frequency over output
tokens, as OpenAI defines them); then temperature, top-k, top-p and min-p (as transformers' warpers, in that order;
vLLM applies min-p before top-k and top-p), then one draw. Greedy rows take the argmax of the logits after the
masks, bias and penalties. A draw is an exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. is distributed as p.
q is drawn for each row from that request's own generator when it has a seed (so it gets the same tokens in any
batch and any batch order), and from the engine's generator for the other rows. Logprob records describe the model's
raw distribution (before the processors, penalties and temperature), as OpenAI and vLLM report them; for a row with
a grammar, as vLLM (which masks the logits before its sampler), that distribution over the tokens the grammar allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import torch

from ..kernels import apply_bitmask
from .sequence import Sequence
from .structured import fill_bitmask
from .transfer import Pack, copy_to, to_device

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


def token_ranks(logp: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[n, 1] each row's rank of `values` [n, 1] among its logprobs `logp` [n, V]: how many tokens are at least as
    likely, itself included (vLLM's batched_count_greater_than): 1 for the most likely token; tied tokens share the
    larger rank (a bf16 model's logits tie often)."""
    return (logp >= values).sum(-1, keepdim=True)


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


PROMPT = 1 << 30  # a penalty-table entry: the token's count in the output, plus PROMPT when the prompt holds it


class PenaltyTable:
    """The token counts the penalties read, kept on the device per request (as vLLM's GPU model runner keeps its bin
    counts): entry [row, t] is how often token t occurs in the request's output tokens, plus PROMPT when its prompt
    holds t. A request gets a row the first time it samples with penalties, filled from its whole history once,
    and keeps it until `release`; each later step adds only the tokens sampled since (the one still on the device
    with overlapped steps included), so a step's host work does not grow with the context. Row 0 stays zero: the
    rows of a penalised batch that have no penalties read it. The table grows by doubling up to max_rows + 1 rows
    (max_num_seqs: what can sample at once; only requests preempted with a row grow it further)."""

    def __init__(self, vocab: int, device: torch.device, max_rows: int | None = None):
        self.vocab, self.device, self.max_rows = vocab, device, max_rows
        self.table: torch.Tensor | None = None  # [capacity, vocab] int32
        self.rows: dict = {}  # key (a request id) -> row
        self.counted: dict = {}  # key -> output tokens already in its row (a pending one included)
        self.free: list[int] = []
        self.used = 1  # rows handed out so far, row 0 included

    def __len__(self) -> int:
        return len(self.rows)

    def release(self, key) -> None:
        """The request is gone: its row goes back to the free rows (its next user zeroes it first)."""
        row = self.rows.pop(key, None)
        if row is not None:
            self.free.append(row)
            del self.counted[key]

    def row(self, key) -> tuple[int, bool]:
        """(key's row, whether it is new)."""
        row = self.rows.get(key)
        if row is not None:
            return row, False
        if self.free:
            row = self.free.pop()
        else:
            row, self.used = self.used, self.used + 1
            self._fit(self.used)
        self.rows[key], self.counted[key] = row, 0
        return row, True

    def _fit(self, rows: int) -> None:
        have = 0 if self.table is None else self.table.shape[0]
        if rows <= have:
            return
        size = max(rows, 2 * have, 8)
        if self.max_rows:
            size = max(rows, min(size, self.max_rows + 1))
        table = torch.zeros(size, self.vocab, dtype=torch.int32, device=self.device)
        if have:
            table[:have] = self.table
        self.table = table


def draft_positions(seqs: list[Sequence]) -> list[int]:
    """Each row's place among its sequence's verify rows: 0 for a row without drafts, j for the row that follows
    drafts[:j] of a sequence with drafts (its k + 1 rows are consecutive; ModelRunner.prepare)."""
    at, prev, j = [], None, 0
    for s in seqs:
        j = j + 1 if s is prev and s.draft_token_ids else 0
        at.append(j)
        prev = s
    return at


def _verify_bitmask(seqs: list[Sequence], ruled: list[int], at: list[int], vocab: int) -> torch.Tensor:
    """The bitmask of the rows `ruled` (each with a grammar) of a speculative step: a verify row j of a sequence
    with drafts takes row j of the bitmask made when they were proposed (its matcher's next tokens after
    drafts[:j]); the other rows their matcher's next tokens now."""
    now = [k for k, i in enumerate(ruled) if not seqs[i].draft_token_ids]
    bitmask = torch.empty(len(ruled), -(-vocab // 32), dtype=torch.int32)
    if now:
        bitmask[now] = fill_bitmask([seqs[ruled[k]].grammar for k in now], vocab)
    for k, i in enumerate(ruled):  # a sequence's verify rows are consecutive, from j = 0: copied together
        if at[i] == 0 and seqs[i].draft_token_ids:
            rows = len(seqs[i].draft_token_ids) + 1
            bitmask[k:k + rows] = seqs[i].draft_bitmask[:rows]
    return bitmask


def _draw_values(seqs: list[Sequence], vocab: int) -> list[list[float]]:
    """Each row's temperature, 1 - top_p, top_k (vocab: off) and min_p."""
    return [[s.params.temperature, 1.0 - s.params.top_p, min(s.params.top_k, vocab) if s.params.top_k else vocab,
             s.params.min_p] for s in seqs]


def _ends_with(out: list[int], drafted: list[int], part: list[int]) -> bool:
    """Whether the reply `out` followed by the drafts `drafted` ends with `part` (without joining them)."""
    m, d = len(part), len(drafted)
    if d >= m:
        return drafted[d - m:] == part
    return len(out) >= m - d and out[len(out) - (m - d):] == part[:m - d] and drafted == part[m - d:]


def _masks(seqs: list[Sequence], vocab: int, words: bool = True,
           at: list[int] | None = None) -> tuple[list[int], list[int], list[int], list[int], list[float]]:
    """The rows' logits processors as flat indices row * vocab + token: (allowed tokens, rows without an allowed
    list, tokens min_tokens or bad_words mask, tokens with a bias, the biases). Empty lists: nothing to apply.
    words=False: bad_words left out (SamplingInputs.settle puts them in the rows' bitmask). at: each row's place
    among its sequence's verify rows (draft_positions; None: no drafts): row j sees drafts[:j] as reply tokens."""
    allowed, free, banned, biased, biases = [], [], [], [], []
    for i, s in enumerate(seqs):
        p, base = s.params, i * vocab
        j = at[i] if at is not None else 0
        if p.allowed_token_ids:
            allowed.extend([base + t for t in p.allowed_token_ids])
        else:
            free.append(i)
        # the token sampled now is the reply's (num_generated + num_pending + j)-th, counting from 0
        if s.min_tokens_ban and s.num_generated + s.num_pending + j < p.min_tokens:
            banned.extend([base + t for t in s.min_tokens_ban])
        for ids in s.bad_words if words else ():  # vLLM's bad_words: a word's last token, once the reply ends with
            if len(ids) == 1 or (s.output_token_ids[1 - len(ids):] == ids[:-1] if not j  # the rest of it
                                 else _ends_with(s.output_token_ids, s.draft_token_ids[:j], ids[:-1])):
                banned.append(base + ids[-1])
        for t, b in p.logit_bias.items():
            biased.append(base + t)
            biases.append(b)
    return allowed, free if allowed else [], banned, biased, biases


def late_bitmask(seqs: list[Sequence], vocab: int, words: bool = True) -> torch.Tensor:
    """[len(seqs), ceil(vocab / 32)] int32 on the host, filled once the step before has completed: each row's
    matcher's next tokens (every token for a request without one, or that finished meanwhile: its token is
    dropped), less (with `words`) the last token of each bad word the reply now ends the rest of (as `_masks` bans
    it: clear_bad_words)."""
    bitmask = torch.full((len(seqs), -(-vocab // 32)), -1, dtype=torch.int32)
    live = [k for k, s in enumerate(seqs) if s.grammar is not None]
    if live:
        bitmask[live] = fill_bitmask([seqs[k].grammar for k in live], vocab)
    return clear_bad_words(bitmask, seqs) if words else bitmask


def clear_bad_words(bitmask: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`bitmask` (one row per seq, changed in place and returned) less the last token of each bad word the reply now
    ends the rest of."""
    rows, tokens = [], []
    for k, s in enumerate(seqs):
        for ids in s.bad_words:
            if len(ids) == 1 or s.output_token_ids[1 - len(ids):] == ids[:-1]:
                rows.append(k)
                tokens.append(ids[-1])
    if rows:  # cleared byte by byte (little-endian, as apply_bitmask reads them)
        banned = torch.zeros(len(seqs), bitmask.shape[1] * 32, dtype=torch.bool)
        banned[rows, tokens] = True
        bits = (banned.view(len(seqs), -1, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(
            -1, dtype=torch.uint8)
        bitmask.view(torch.uint8).bitwise_and_(~bits)
    return bitmask


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor | None, free: torch.Tensor | None,
                banned: torch.Tensor | None, biased: torch.Tensor | None, biases: torch.Tensor | None,
                grammar: tuple | None = None) -> torch.Tensor:
    """logits [n, V] (not changed) -> a copy with the grammars, allowed_token_ids, min_tokens and logit_bias applied
    (the flat indices of `_masks`, on the device; None: that one is not applied). grammar: (rows or None for every
    row, their bitmask) of `structured.apply_bitmask`."""
    n, vocab = logits.shape
    x = logits if grammar is None else apply_bitmask(logits, *grammar)
    if allowed is not None:
        keep = torch.zeros(n * vocab, dtype=torch.bool, device=logits.device).index_fill_(0, allowed, True)
        keep = keep.view(n, vocab)
        if free is not None:
            keep.index_fill_(0, free, True)
        x = x.masked_fill(~keep, NEG_INF)
    if banned is not None:
        x = x.reshape(-1).index_fill(0, banned, NEG_INF).view(n, vocab)
    if biased is not None:
        x = x.reshape(-1).index_add(0, biased, biases).view(n, vocab)
    return x


class SamplingInputs:
    """What sampling a step's rows (`seqs`) needs from the host, gathered before the step's inputs are copied. The
    integers join the step's Pack (the model runner's one int64 copy): the indices of the drawn (non-greedy) rows
    when greedy rows are among them, and the penalty table's updates (`PenaltyTable`): each penalised row's table
    row, the rows new to the table, their prompt tokens, the output tokens not yet counted, and for a token still on
    the device its place among the previous step's sampled tokens. The floats (each row's penalties, each drawn
    row's temperature, top-p, top-k) make one copy of their own, and none in a step of greedy rows without
    penalties. `load` makes the device side: idx, penalty_counts [n, V] (the rows' table entries), penalty_values
    [n, 3], draw_values [len(drawn), 3]. `keys`: each row's key in `table` (default: its request id); `prev`: the
    step before (a model_runner.StepHandle), whose sampled tokens the host may not have yet."""

    def __init__(self, seqs: list[Sequence], vocab: int, pack: Pack, table: PenaltyTable, keys: list | None = None,
                 prev=None):
        self.n = len(seqs)
        self.drawn, self.penalties, masks, self.late, drafts = [], False, False, False, False
        for i, s in enumerate(seqs):  # one pass over the rows (this runs at every step)
            p = s.params
            if not p.greedy:
                self.drawn.append(i)
            if s.draft_token_ids:
                drafts = True
            if not self.penalties and p.needs_penalties:
                self.penalties = True
            if s.logit_masks:
                masks = True
                if s.num_pending and s.reads_last_token:  # its mask needs the token `prev` sampled: see settle
                    self.late = True
        # speculative decoding: each row's place j among its sequence's verify rows (ModelRunner.prepare: the rows of
        # a sequence with drafts follow one another), whose processors see drafts[:j] as output tokens
        self.at = draft_positions(seqs) if drafts else None
        # and each row's draft (-1: none; a sequence's last verify row), with the step's other integers
        self._drafts = pack.add([s.draft_token_ids[j] if j < len(s.draft_token_ids) else -1
                                 for s, j in zip(seqs, self.at)]) if drafts else None
        self._idx = pack.add(self.drawn) if 0 < len(self.drawn) < self.n else None
        floats: list[float] = []  # flat: the rows' penalties [n, 3], the drawn rows' draw values [d, 4], the biases
        if self.penalties:
            self.table = table
            self._updates = self._count(seqs, keys or [s.request_id for s in seqs], vocab, pack, prev)
            floats.extend(chain.from_iterable((s.params.repetition_penalty, s.params.presence_penalty,
                                               s.params.frequency_penalty) for s in seqs))
        floats.extend(chain.from_iterable(_draw_values([seqs[i] for i in self.drawn], vocab)))
        self.masked, self._biases, self._bitmask = False, 0, None
        self._ruled, self._late_rows = None, None
        if masks:
            allowed, free, banned, biased, biases = _masks(seqs, vocab, words=not self.late, at=self.at)
            self._masks = [pack.add(piece) if piece else None for piece in (allowed, free, banned, biased)]
            self.masked, self._biases = any(piece is not None for piece in self._masks), len(biases)
            floats += biases
            ruled = [i for i, s in enumerate(seqs) if s.grammar is not None or (self.late and s.bad_words)]
            if ruled:
                if self.late:  # their bitmask is filled by settle(), once the step before has completed
                    self._late_rows = [seqs[i] for i in ruled]
                elif self.at is not None:  # speculative: a verify row's from its drafts' (draft_bitmask)
                    self._bitmask = _verify_bitmask(seqs, ruled, self.at, vocab)
                else:  # each matcher's next tokens, now (the step before has completed)
                    self._bitmask = fill_bitmask([seqs[i].grammar for i in ruled], vocab)
                self._ruled = pack.add(ruled) if len(ruled) < self.n else None
                self.masked = True
        self.floats = floats
        self.idx = self.penalty_counts = self.penalty_values = self.draw_values = self.masks = self.grammar = None
        self.drafts = None  # (speculative) [n] each row's draft on the device, None: no row has one
        self.logprob_grammar = None  # (late rows with bad words and logprobs) the grammar's mask without the words

    def _count(self, seqs: list[Sequence], keys: list, vocab: int, pack: Pack, prev):
        """The table's updates for this step's penalised rows, on the host, as flat indices row * vocab + token."""
        table = self.table
        rows, fresh, marks, counts, pending, drafted = [], [], [], [], [], []
        for i, (s, key) in enumerate(zip(seqs, keys)):
            if not s.params.needs_penalties:
                rows.append(0)
                continue
            j = self.at[i] if self.at is not None else 0
            if j:  # a verify row after drafts[:j]: counted in the row's copy of its table entries, not in the table
                drafted.extend([i * vocab + t for t in s.draft_token_ids[:j]])
            row, new = table.row(key)
            rows.append(row)
            base = row * vocab
            if new:
                fresh.append(row)
                marks.extend([base + t for t in s.prompt_token_ids])
            done, known = table.counted[key], len(s.output_token_ids)
            if done < known:
                counts.extend([base + t for t in s.output_token_ids[done:known]])
            if s.num_pending and done < known + s.num_pending:  # sampled by `prev`, not on the host yet
                pending += (row, prev.row_of[s.request_id])
            table.counted[key] = known + s.num_pending
        self._prev_tokens = prev.sampled.tokens if pending else None
        return [pack.add(rows)] + [pack.add(piece) if piece else None
                                   for piece in (fresh, marks, counts, pending, drafted)]

    def load(self, data: torch.Tensor, device: torch.device) -> SamplingInputs:
        """The device side, from `data` (the step's Pack on the device) and one copy of the floats: the penalty
        table updated first (fresh rows zeroed, their prompt tokens marked, the new output tokens counted)."""
        if self._idx is not None:
            self.idx = data[self._idx]
        if self._drafts is not None:
            self.drafts = data[self._drafts]
        values = to_device(self.floats, torch.float32, device) if self.floats else None  # one copy of the floats
        if self._biases:
            values, biases = values[:-self._biases], values[-self._biases:]
        if self.masked:
            self.masks = [data[piece] if piece is not None else None for piece in self._masks]
            self.masks.append(biases if self._biases else None)
            self.grammar, self._ruled_rows = None, data[self._ruled] if self._ruled is not None else None
            if self._bitmask is not None:
                self.grammar = (self._ruled_rows, _bitmask_to(self._bitmask, device))
        if self.penalties:
            rows, fresh, marks, counts, pending, drafted = self._updates
            table = self.table.table
            flat = table.view(-1)
            if fresh is not None:
                table.index_fill_(0, data[fresh], 0)
            if marks is not None:
                flat.index_fill_(0, data[marks], PROMPT)
            adds = [data[counts]] if counts is not None else []
            if pending is not None:
                row, src = data[pending].view(-1, 2).unbind(1)
                adds.append(row * self.table.vocab + self._prev_tokens.index_select(0, src))
            if adds:
                where = adds[0] if len(adds) == 1 else torch.cat(adds)
                flat.index_add_(0, where, torch.ones(where.shape, dtype=torch.int32, device=device))
            self.penalty_counts = table.index_select(0, data[rows])
            if drafted is not None:  # the drafts before each verify row count as its output tokens
                where = data[drafted]
                self.penalty_counts.view(-1).index_add_(0, where, torch.ones(where.shape, dtype=torch.int32,
                                                                              device=device))
            self.penalty_values, values = values[:3 * self.n].view(self.n, 3), values[3 * self.n:]
        self.draw_values = values.view(-1, 4) if values is not None and values.numel() else None
        return self

    def settle(self, vocab: int, device: torch.device) -> None:
        """With `late` (a row whose grammar or bad word reads the token the step before sampled, still on the
        device when the step was prepared): fill those rows' bitmask now that the step before has completed (its
        tokens appended and accepted by the matchers: LLMEngine.step), while this step's forward runs, and queue
        its copy. The model runner calls it between the forward and the sampler."""
        if self._late_rows is not None:
            host = late_bitmask(self._late_rows, vocab, words=False)
            if any(s.grammar is not None and s.bad_words and s.params.logprobs is not None for s in self._late_rows):
                # the logprob records see the grammar's mask alone, as without overlap (bad words are masked after
                # them, as vLLM's sampler does): with the words, a banned token's mass went to the others
                self.logprob_grammar = (self._ruled_rows, _bitmask_to(host.clone(), device))
            self.grammar = (self._ruled_rows, _bitmask_to(clear_bad_words(host, self._late_rows), device))
            self._late_rows = None

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, device: torch.device) -> SamplingInputs:
        """Loaded with copies of their own and a penalty table of their own, filled from each row's whole history
        (a sampler used outside the model runner)."""
        pack = Pack()
        table = PenaltyTable(vocab, device)
        inputs = cls(seqs, vocab, pack, table, keys=list(range(len(seqs))))
        data = pack.to(device) if pack.values else torch.empty(0, dtype=torch.long, device=device)
        return inputs.load(data, device)


def _bitmask_to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A bitmask's copy to `device`, from pinned memory (a copy that does not wait)."""
    if device.type != "cpu":
        host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    return copy_to(host, device)


NOT_FINITE = -1  # the token id `packed` carries for a row whose logits were not finite (NaN or +inf)


@dataclass
class SampledBatch:
    """One step's sampled rows, on the device. `packed` is what is copied to the host (once): the token ids
    (int64 [n]), or with logprobs a float64 [n, 3 + 2k] of token, its logprob, its rank (vLLM's, `token_ranks`), k
    top ids, k top logprobs; a row whose logits held a NaN or +inf has the id NOT_FINITE there (`tokens`, the next
    step's input ids, keeps an id in the vocabulary)."""

    tokens: torch.Tensor  # [n] int64, on the device (the next step's input ids when steps overlap)
    packed: torch.Tensor
    logprobs: list[int | None]  # per row: the request's logprobs setting

    def decode(self, host: torch.Tensor) -> tuple[list[int], list[dict | None]]:
        """`packed` copied to the host -> (token ids, logprob records)."""
        if all(k is None for k in self.logprobs):
            return host.tolist(), [None] * len(self.logprobs)
        tokens, records, kmax = [], [], (host.shape[1] - 3) // 2
        for row, k in zip(host.tolist(), self.logprobs):
            token = int(row[0])
            tokens.append(token)
            rec = None if k is None else {"token_id": token, "logprob": row[1], "rank": int(row[2])}
            if k:
                rec["top_logprobs"] = [{"token_id": int(row[3 + j]), "logprob": row[3 + kmax + j]}
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
        x, tokens, finite = self._greedy(logits, seqs, inputs)
        if inputs.drawn:
            idx = inputs.idx
            every = idx is None
            drawn = [seqs[i] for i in inputs.drawn]
            probs = self.probs(x if every else x.index_select(0, idx), drawn, inputs.draw_values)
            picked = (probs / self._exponentials(drawn, x.shape[-1], x.device)).argmax(-1)
            tokens = picked if every else tokens.index_copy(0, idx, picked)
        return self._packed(logits, seqs, inputs, tokens, finite)

    def sample_speculative(self, logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs,
                           drafts: torch.Tensor) -> tuple[SampledBatch, torch.Tensor]:
        """Speculative decoding's verification: (the rows' tokens, whether each row accepted its draft). `drafts` [n]:
        each row's draft token (-1: none, the row of a sequence's last position). A greedy row accepts its draft when
        it is the argmax; a drawn row, as vLLM's rejection sampler for drafts of probability one (n-gram), with
        probability p(draft) under the row's distribution (temperature, top-k, top-p, min-p), else (and at a row
        without a draft) its token is drawn from p with the draft's probability set to 0 (renormalised), so that
        every token kept is distributed as without speculation. A row's token is its draft where accepted."""
        logits = logits.float()
        x, tokens, finite = self._greedy(logits, seqs, inputs)
        accepted = tokens == drafts
        if inputs.drawn:
            idx = inputs.idx
            every = idx is None
            drawn = [seqs[i] for i in inputs.drawn]
            p = self.probs(x if every else x.index_select(0, idx), drawn, inputs.draw_values)
            p = p / p.sum(-1, keepdim=True)
            d = drafts if every else drafts.index_select(0, idx)
            has = d >= 0
            at = d.clamp_min(0).unsqueeze(1)
            ok = has & (self._uniforms(drawn, x.device) < p.gather(1, at).squeeze(1))
            rest = torch.where(has.unsqueeze(1), p.scatter(1, at, 0.0), p)
            picked = torch.where(ok, d, (rest / self._exponentials(drawn, x.shape[-1], x.device)).argmax(-1))
            tokens = picked if every else tokens.index_copy(0, idx, picked)
            accepted = ok if every else accepted.index_copy(0, idx, ok)
        return self._packed(logits, seqs, inputs, tokens, finite), accepted

    def _greedy(self, logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs):
        """(the rows' scores: masks and penalties applied, their argmax, whether that argmax is finite)."""
        x = apply_masks(logits, *inputs.masks, grammar=inputs.grammar) if inputs.masked else logits
        x = self.penalised(x, seqs, inputs)
        tokens = x.argmax(-1)
        # argmax takes a NaN (or +inf) over every number: such a row's greedy pick is not below +inf
        finite = x.gather(1, tokens.unsqueeze(1)).squeeze(1) < math.inf
        return x, tokens, finite

    def _packed(self, logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs, tokens: torch.Tensor,
                finite: torch.Tensor) -> SampledBatch:
        ks = [s.params.logprobs for s in seqs]
        return self._pack(self._grammar_logits(logits, seqs, inputs, ks), tokens, ks, finite)

    def _uniforms(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """[len(seqs)] U[0, 1) draws: a seeded request's from its own generator (as `_exponentials`)."""
        return self._draws(seqs, (len(seqs),), device, lambda t, g: t.uniform_(generator=g))

    @staticmethod
    def _grammar_logits(logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs,
                        ks: list[int | None]) -> torch.Tensor:
        """The logits the logprob records describe: the raw ones, with the grammar's bitmask applied to the rows that
        have a grammar and ask for logprobs (vLLM applies it to the logits before its sampler computes them)."""
        rows = [i for i, (k, s) in enumerate(zip(ks, seqs)) if k is not None and s.grammar is not None]
        if inputs.grammar is None or not rows:
            return logits
        masked = apply_bitmask(logits, *(inputs.grammar if inputs.logprob_grammar is None else inputs.logprob_grammar))
        if len(rows) == len(seqs):
            return masked
        idx = torch.tensor(rows, device=logits.device)
        return logits.index_copy(0, idx, masked.index_select(0, idx))

    @staticmethod
    def penalised(logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs | None = None) -> torch.Tensor:
        """logits [n, V] (float) with each row's repetition, presence and frequency penalties applied."""
        if not (inputs.penalties if inputs is not None else any(s.params.needs_penalties for s in seqs)):
            return logits
        if inputs is None:
            inputs = SamplingInputs.build(seqs, logits.shape[-1], logits.device)
        entries = inputs.penalty_counts
        seen = entries != 0
        counts = (entries & (PROMPT - 1)).to(logits.dtype)
        values = inputs.penalty_values
        return apply_penalties(logits, seen, counts, values[:, 0], values[:, 1], values[:, 2])

    @staticmethod
    def probs(logits: torch.Tensor, seqs: list[Sequence], values: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution each (non-greedy) row draws from: temperature, top-k, top-p, softmax, min-p (the entries
        min-p drops are 0; the rest is not renormalised, which a draw does not need). `values`: the rows'
        temperature, 1 - top_p, top_k, min_p on the device [n, 4] (SamplingInputs.draw_values); None: copied
        here."""
        if values is None:
            values = to_device(_draw_values(seqs, logits.shape[-1]), torch.float32, logits.device)
        x = logits / values[:, 0:1]
        if any(s.params.top_k or s.params.top_p < 1.0 for s in seqs):
            x = filter_top_k_top_p(x, values[:, 2].long(), values[:, 1])
        p = x.softmax(-1)
        if any(s.params.min_p > 0 for s in seqs):  # transformers' MinPLogitsWarper: p < min_p * max(p) dropped
            p = p.masked_fill(p < values[:, 3:4] * p.amax(-1, keepdim=True), 0.0)
        return p

    def _exponentials(self, seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
        """[len(seqs), vocab] Exp(1) draws: a seeded request's row from its own generator."""
        q = self._draws(seqs, (len(seqs), vocab), device, lambda t, g: t.exponential_(generator=g))
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    def _draws(self, seqs: list[Sequence], shape: tuple, device: torch.device, draw) -> torch.Tensor:
        """A tensor of `shape` (a row per sequence) filled by `draw(tensor, generator)`: the engine's generator for
        every row, then a seeded request's row again from its own generator."""
        q = torch.empty(shape, device=device)
        if any(s.params.seed is None for s in seqs):
            draw(q, self._engine_generator(device))
        for j, s in enumerate(seqs):
            if s.params.seed is not None:
                if s.generator is None:
                    s.generator = torch.Generator(device=device).manual_seed(s.params.seed)
                draw(q[j:j + 1], s.generator)
        return q

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[key]

    @staticmethod
    def _pack(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int | None],
              finite: torch.Tensor | None = None) -> SampledBatch:
        ids = tokens if finite is None else torch.where(finite, tokens, NOT_FINITE)
        if all(k is None for k in ks):
            return SampledBatch(tokens, ids, ks)
        logp = logits.log_softmax(-1)
        lp = logp.gather(1, tokens.unsqueeze(1))
        cols = [ids.unsqueeze(1).double(), lp.double(), token_ranks(logp, lp).double()]
        kmax = max(k or 0 for k in ks)
        if kmax:
            vals, ids = logp.topk(kmax, -1)
            cols += [ids.double(), vals.double()]
        return SampledBatch(tokens, torch.cat(cols, 1), ks)
