"""EAGLE-3 speculative decoding (vLLM's "eagle3" method): a one-layer head (models.eagle) drafts each decoding
sequence's tokens from the target's own hidden states; the target verifies them as it verifies a draft model's
(ModelRunner.verify, the same rejection rule).

It runs as a draft model does (engine.draft.DraftRunner: its KV cache of one layer in the target's block layout,
Sequence.draft_computed / draft_fed, the scheduler's catch-up budget), with two differences:
- position p of the head's KV holds (token p + 1, the target's hidden state at p): the head is fed only the
  positions the target has computed (up to num_computed_tokens, each with its next token known), so draft 1 comes
  from the last computed position, and draft j + 1 from draft j with the head's own pre-norm output as its hidden
  state. Those later positions are speculative: draft_fed stops before them and the next step overwrites them with
  the target's states.
- the target's forward keeps its aux hidden states (LlamaForCausalLM.aux_layers) and `collect` stores each
  sequence's projected rows (fc) until the head is fed them (Sequence.draft_hidden: (first position, rows)).
  Positions the target never computed (a prefix-cache hit) have none: the head's KV there is what the cache held.
Drafts are greedy over the head's draft vocabulary, mapped to target ids through d2t.
"""

from __future__ import annotations

import torch

from .draft import DraftParts, DraftRunner
from .scheduler import ScheduledBatch


class EagleRunner(DraftRunner):
    """An EAGLE-3 head, its KV cache and its proposals."""

    def __init__(self, parts: DraftParts, kv_dtype: torch.dtype, num_blocks: int, block_size: int,
                 device: torch.device, target):
        super().__init__(parts, kv_dtype, num_blocks, block_size, device)
        self.vocab = self.target_vocab = target.config.vocab_size  # (drafts are target ids already)
        self.target = target
        # EAGLE-3: the target's forward keeps its aux states from now on; EAGLE-1 reads its output (verify's hidden)
        target.aux_layers = tuple(self.model.aux_layers)

    @staticmethod
    def _graph_class():
        """Its one-token forwards' graphs: a decode graph's, with the hidden state each is fed as one more input."""
        from .cuda_graphs import HeadGraphs
        return HeadGraphs

    def close(self) -> None:
        if self.target is not None:
            self.target.aux_layers = ()
            self.target.aux_hidden = None
        self.target = None
        super().close()

    @torch.inference_mode()
    def collect(self, batch: ScheduledBatch, order: list[int], aux: list[torch.Tensor]) -> None:
        """After the target's forward over the batch (its sequences' tokens in `order`): each sequence's rows of the
        projected aux states, kept after those of its earlier positions (a row past the step's first position is
        the last step's rejected draft's: replaced)."""
        rows = self.model.combine(aux)
        at = 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            c, new = seq.num_computed_tokens, rows[at:at + n]
            at += n
            old = seq.draft_hidden
            if old is not None and old[0] <= c <= old[0] + old[1].shape[0]:
                seq.draft_hidden = (old[0], torch.cat([old[1][:c - old[0]], new]))
            else:
                seq.draft_hidden = (c, new.clone())

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch) -> None:
        """Fill the drafts of the batch's sequences (as DraftRunner.propose): one batched forward of the head over
        each scheduled sequence's computed positions its KV lacks (with their stored hidden rows), then k - 1
        one-token forwards; a sequence with drafts but nothing to feed (no hidden rows) drafts none."""
        feeds, rows = [], []
        for j, seq in enumerate(batch.seqs):
            k = len(seq.draft_token_ids)
            start = min(seq.draft_computed, seq.num_computed_tokens)
            end = seq.draft_end(seq.num_computed_tokens, self.context)
            held = seq.draft_hidden
            first, kept = held if held is not None else (end, None)
            start, end = max(start, first), min(end, first + (kept.shape[0] if kept is not None else 0))
            end = max(start, end)
            seq.draft_fed = end
            hidden = kept[start - first:end - first] if end > start else None
            if kept is not None and end > first:  # (the rows fed, and any before them, are done with)
                rest = kept[end - first:]
                seq.draft_hidden = (end, rest) if rest.shape[0] else None
            if k and end == start:  # nothing to draft from: no drafts this step
                seq.draft_token_ids = []
                batch.num_new_tokens[j] -= k
                k = 0
            if k:
                rows.append(len(feeds))
            feeds.append((seq, start, seq.tokens(start + 1, end + 1) if end > start else [], hidden))
        self._zero = batch.zero
        out = self._eagle_forward(feeds, rows)
        if out is None:
            return
        ids, hidden = out
        seqs = [feeds[r][0] for r in rows]
        ks = [len(s.draft_token_ids) for s in seqs]
        drafts = [ids]
        for gather, positions, ctx in self._decode_inputs(seqs, ks):
            if gather is not None:
                ids, hidden = ids.index_select(0, gather), hidden.index_select(0, gather)
            normed, hidden = self._decode(ids, positions, ctx, hidden)
            ids = self.model.draft_tokens(normed)
            drafts.append(ids)
        host = (torch.cat(drafts) if len(drafts) > 1 else ids).tolist()
        drafted, at = [[] for _ in seqs], 0
        for j in range(len(drafts)):
            for i in [i for i, k in enumerate(ks) if k > j]:
                drafted[i].append(host[at])
                at += 1
        for seq, d in zip(seqs, drafted):
            seq.draft_token_ids = d  # (draft_fed stays: the drafts' positions hold the head's own states)
        self._cut(batch, self.target_vocab)

    def _eagle_forward(self, feeds, rows: list[int]):
        """The head's forward over `feeds` [(seq, first position, next tokens, hidden rows)] after zeroing the KV
        blocks self._zero: (the draft of each feed in `rows`, the pre-norm output of its last position), None
        without rows."""
        hidden = [rows_h for _, _, tokens, rows_h in feeds if tokens]
        fed = self._feed(feeds, rows)
        if fed is None:
            return None
        ids_, pos_, ctx, pick = fed
        self.eager_forwards += 1
        normed, pre = self.model(ids_, pos_, ctx, torch.cat(hidden) if len(hidden) > 1 else hidden[0])
        if not rows:
            return None
        return self.model.draft_tokens(normed.index_select(0, pick)), pre.index_select(0, pick)


def is_eagle_head(parts) -> bool:
    """Whether a DraftParts' model is an EAGLE head (models.eagle), which EagleRunner runs, not DraftRunner."""
    from ..models.eagle import Eagle1Head, Eagle3Head
    return isinstance(getattr(parts, "model", None), (Eagle3Head, Eagle1Head))


def make_drafter(parts: DraftParts, kv_dtype: torch.dtype, num_blocks: int, block_size: int, device: torch.device,
                 target) -> DraftRunner:
    """The runner of `parts` as an engine makes it: an EagleRunner over `target` for an EAGLE head, else a
    DraftRunner (warmup's profile and graph capture)."""
    if is_eagle_head(parts):
        return EagleRunner(parts, kv_dtype, num_blocks, block_size, device, target)
    return DraftRunner(parts, kv_dtype, num_blocks, block_size, device)


def feed_rows(runner: DraftRunner, seqs) -> None:
    """Warmup's worst case for an EagleRunner: each sequence's head lags its target by at least one position (as
    after any verify step), with zero rows for the target's states there (their values change no peak)."""
    if not isinstance(runner, EagleRunner):
        return
    h = runner.model.config.hidden_size
    for seq in seqs:
        first = max(0, min(seq.draft_computed, seq.num_computed_tokens - 1))
        seq.draft_computed = min(seq.draft_computed, first)
        seq.draft_hidden = (first, torch.zeros(seq.num_computed_tokens - first, h, dtype=runner.model.fc.weight.dtype,
                                               device=runner.model.fc.weight.device))
