"""Draft-model speculative decoding (vLLM's "draft_model" method): a second, smaller decoder of the same vocabulary
proposes each decoding sequence's drafts greedily; the target verifies them (ModelRunner.verify).

The draft's KV cache is a tensor of its own with the target's block layout (the same number of blocks of the same
size), so a sequence's block table and the slots the scheduler allocated serve both models. Each speculative step,
after scheduling and before the target's verify, `DraftRunner.propose` feeds the draft every scheduled sequence's
tokens its KV lacks (Sequence.draft_computed up to the step's own tokens: a prefill chunk's, or the one or two of a
decode) in one batched forward, takes draft 1 from the last position of each sequence with drafts, and k - 1 more
one-token forwards give drafts 2..k. Greedy drafts are one-hot: the sampler's rejection rule keeps sampled output's
distribution exact, as vLLM's proposers do.

The draft's vocab_size may differ from the target's by padding only (Qwen2.5-0.5B's 151,936 drafting Qwen2.5-7B's
152,064: one tokenizer, the larger embedding padded): its drafts are the argmax over the ids the target has, and a
token of the target's it cannot embed (a padding id) is fed as a stand-in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, InferError
from ..models.context import ForwardContext
from .scheduler import ScheduledBatch
from .structured import draft_bitmask
from .transfer import Pack

log = logging.getLogger("infer")

@dataclass
class DraftParts:
    path: Path
    model: Any
    model_config: Any
    target_vocab: int | None = None  # the target's vocab_size where it differs from the draft's (padding)
    context: int | None = None  # the positions it sees (draft_context: its context, at most max_model_len)


def draft_config(engine_config, target_config, max_len: int) -> tuple[Path, Any] | None:
    """(folder, config) of the draft model of --speculative-config {"model": ...} (None for n-gram or no
    speculation); ConfigError when its vocabulary (its tokenizer's token ids, or its size otherwise than by padding
    beyond the tokenizer's ids) differs from the target's. A context shorter than the engine's max_model_len
    (`max_len`) is taken, as vLLM takes it: a sequence speculates only while its tokens and drafts fit the draft's
    context (draft_context), then goes on without drafts."""
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    spec = engine_config.speculative_config
    if not spec or spec.get("method") != "draft_model":
        return None
    name = spec["model"]
    try:
        path = resolve_model(name)
        config = load_config(path)
    except InferError as e:
        hint = e.hint
        folder = Path(name).expanduser()
        if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
            # (the model's own hint says to pass it with --lora: that applies it to the target, not the draft)
            hint = (f"a draft is a whole model: merge the adapter into its base first (infer convert BASE -o "
                    f"MERGED --merge-lora {name}) and pass MERGED as the draft's \"model\"")
        raise type(e)(f"--speculative-config model {name!r}: {e.message}", hint) from None
    vocab, want = getattr(config, "vocab_size", None), target_config.vocab_size
    target = resolve_model(engine_config.model)
    real = _check_tokenizer(name, path, target, padded=vocab != want)
    if vocab != want and (real is None or not isinstance(vocab, int) or real > min(vocab, want)):
        why = ("the draft's folder holds no tokenizer to show the difference is padding" if real is None else
               f"their tokenizers hold {real:,} token ids (added tokens too), more than the smaller takes")
        raise ConfigError(f"--speculative-config model {name!r} has a vocabulary of {vocab} tokens, the target "
                          f"model {want} ({target}): {why}; a draft must share the target's vocabulary (its token "
                          f"ids), its vocab_size differing only by padding beyond the tokenizer's ids",
                          "use a draft of the target's family (the same tokenizer; a vocab_size of at least its "
                          "tokens, as Qwen2.5-0.5B's 151,936 drafting Qwen2.5-7B's 152,064)")
    return path, config


def draft_context(draft_model_config, max_len: int) -> int:
    """The positions a draft model sees: its context limit (models.limits.context_limit), at most the engine's
    max_model_len (`max_len`). A sequence drafts only while its tokens and drafts fit them (vLLM's
    speculative_max_model_len): past them it goes on without drafts."""
    from ..models.limits import context_limit
    return min(context_limit(draft_model_config)[0], max_len)


def context_note(name, draft_model_config, max_len: int) -> str | None:
    """What a draft of a context shorter than max_len (`max_len`) means, said once when it is loaded; None where its
    context is no shorter."""
    from ..models.limits import context_limit
    limit, why = context_limit(draft_model_config)
    if limit >= max_len:
        return None
    return (f"the draft model {str(name)!r} holds a context of {limit} tokens{f' ({why})' if why else ''}, below the "
            f"engine's max length of {max_len}: a sequence speculates only while its tokens and drafts fit {limit} "
            f"tokens, then goes on without drafts (stats: draft_context_skipped_steps)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def _token_ids(folder: Path, parsed: bool) -> tuple[dict[str, int], set[int]] | None:
    """What each token id of the tokenizer in `folder` means ({token: id}, added tokens too), and the ids of its
    special tokens (added tokens marked special): from its tokenizer.json (`parsed`), else as transformers loads
    it; None where the folder holds no tokenizer."""
    if parsed:
        import json
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = (data.get("model") or {}).get("vocab") or {}
        ids = {t: i for i, (t, _) in enumerate(vocab)} if isinstance(vocab, list) else dict(vocab)  # (Unigram: a list)
        added = data.get("added_tokens") or []
        ids.update({t["content"]: t["id"] for t in added})
        return ids, {t["id"] for t in added if t.get("special")}
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from .setup import load_tokenizer
    tokenizer = load_tokenizer(folder)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return dict(tokenizer.get_vocab()), {i for i, t in added.items() if getattr(t, "special", False)}


def _check_tokenizer(name: str, draft: Path, target: Path, padded: bool = False) -> int | None:
    """ConfigError where the draft's tokenizer gives a token id another meaning than the target's (its drafts would
    be other tokens than it meant, nearly all rejected: the speculation slower than none); ids only one of them has
    (added tokens, in the other's padding) are no conflict, nor a special token of both named otherwise (said
    once). Two tokenizer.json are compared as files, then by their
    vocabularies; other formats as transformers loads them. A folder without a tokenizer is taken on its vocab_size
    alone. Returns, where the two models' vocab_size differ (`padded`), how many token ids the tokenizers hold (the
    largest id of either + 1: the rest of each embedding is padding); None without a tokenizer to tell, or when the
    sizes are the same."""
    a, b = draft / "tokenizer.json", target / "tokenizer.json"
    parsed = a.is_file() and b.is_file()
    same = parsed and a.read_bytes() == b.read_bytes()
    if same and not padded:
        return None
    theirs = _token_ids(draft, parsed)
    ours = None if theirs is None else theirs if same else _token_ids(target, parsed)
    if theirs is None or ours is None:
        return None
    (theirs, their_special), (ours, our_special) = theirs, ours
    if theirs != ours:
        by_id, their_by_id = {i: t for t, i in ours.items()}, {i: t for t, i in theirs.items()}
        differ = [i for i in set(by_id) & set(their_by_id) if by_id.get(i) != their_by_id.get(i)]
        # a special token of both named otherwise (a chat model's "<|eot_id|>" at a base model's
        # "<|reserved_special_token_4|>"): the same id to both models, which the target's tokenizer reads, as vLLM
        # takes such a draft (it compares no tokenizers); said once
        special = sorted(i for i in differ if i in their_special and i in our_special)
        differ = [i for i in differ if i not in their_special or i not in our_special]
        if special and not differ:
            at = special[0]
            log.warning("the draft model %r names %d special token id(s) otherwise than the target model (%s), e.g. "
                        "id %d: %r in the draft, %r in the target; taken: both models read the same ids, the "
                        "target's tokenizer their text", name, len(special), target, at, their_by_id[at], by_id[at])
        if differ:
            at = min(differ)
            mine, yours = their_by_id.get(at), by_id.get(at)
            raise ConfigError(f"--speculative-config model {name!r} has another tokenizer than the target model "
                              f"({target}): token id {at} is {mine!r} in the draft, {yours!r} in the target "
                              f"({len(theirs):,} and {len(ours):,} tokens); a draft must share the target's token ids",
                              "use a draft of the target's family (the same tokenizer; its vocab_size the target's, "
                              "or padded otherwise)")
    if not padded:
        return None
    return max(max(theirs.values(), default=-1), max(ours.values(), default=-1)) + 1


def load_draft(engine_config, target_config, dtype: torch.dtype, device: torch.device,
               max_len: int, target=None) -> DraftParts | None:
    """The draft model (draft_config's checks passed), loaded as the target is, in its dtype on its device; None
    without one. An EAGLE-3 head (method "eagle3") is checked against the target model `target` (whose embeddings
    it shares where it has none: models.eagle)."""
    from ..models.loader import load_model
    spec = engine_config.speculative_config
    if spec and spec.get("method") in ("eagle3", "eagle"):
        from ..models.eagle import load_eagle1, load_eagle3
        from ..models.resolve import resolve_model
        try:
            path = resolve_model(spec["model"])
        except InferError as e:
            raise type(e)(f"--speculative-config model {spec['model']!r}: {e.message}", e.hint) from None
        load = load_eagle3 if spec["method"] == "eagle3" else load_eagle1
        head, config = load(path, target, target_config, dtype, device, max_len)
        return DraftParts(path, head, config, target_config.vocab_size, None)
    found = draft_config(engine_config, target_config, max_len)
    if found is None:
        return None
    context = draft_context(found[1], max_len)
    note = context_note(engine_config.speculative_config["model"], found[1], max_len)
    if note:
        log.warning(note)
    model, config = load_model(found[0], dtype, device, max_positions=context)  # (its rope table: its positions)
    return DraftParts(found[0], model, config, target_config.vocab_size, context)


class DraftRunner:
    """The draft model, its KV cache (the target's block layout) and its proposals."""

    def __init__(self, parts: DraftParts, kv_dtype: torch.dtype, num_blocks: int, block_size: int,
                 device: torch.device):
        self.model, self.model_config, self.path = parts.model, parts.model_config, parts.path
        self.block_size, self.device = block_size, device
        # a vocab_size other than the target's (draft_config: only padding beyond the tokenizer's ids differs): a
        # token the draft cannot embed is fed as a stand-in (_forward), a draft the target cannot take never made
        self.vocab = parts.model_config.vocab_size
        self.target_vocab = parts.target_vocab or self.vocab
        # the positions it sees (draft_context): a sequence is fed up to them, and drafts only while its tokens and
        # drafts fit them (LLMEngine._propose); None: any the engine takes
        self.context = parts.context
        self.context_skips = 0  # sequence-steps decoded without drafts because their drafts would pass the context
        self._zero = []  # the KV blocks the next forward zeroes first (propose)
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs of the one-token forwards (drafts 2..k) once captured
        self.eager_forwards = 0  # forwards run eagerly (each step's first; drafts 2..k without a graph that fits)
        layers = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        a = layers[0]
        # uninitialised as the target's: every block is zeroed when a sequence gets it (zero)
        self.kv_cache = torch.empty(len(layers), getattr(a, "kv_copies", 2), num_blocks, block_size, a.num_kv_heads,
                                    a.head_dim, dtype=kv_dtype, device=device)  # (MLA's latent rows: one copy)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, -1]

    def zero(self, block_ids) -> None:
        if len(block_ids):
            cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
            cache.index_fill_(2, torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device), 0)

    def capture_graphs(self, max_num_seqs: int, max_blocks: int, emulate: bool = False, pool=None,
                       high_priority: bool | None = False) -> None:
        """Record the draft's one-token forwards (drafts 2..k: pure decodes of up to max_num_seqs sequences of up to
        max_blocks blocks) as CUDA graphs over static buffers of their own, in the memory pool `pool` (the
        target's: the two never run at once); `emulate` replays by re-running the model. The first forward of a
        step (the step's own tokens, a mixed prefill) stays eager. Called with the target's (ModelRunner)."""
        if self.context is not None:  # a sequence drafts only within the draft's context: no wider block tables
            max_blocks = min(max_blocks, -(-self.context // self.block_size))
        graphs = self._graph_class()(self.model, max_num_seqs, max_blocks, self.device, None, emulate,
                                     high_priority=high_priority)
        graphs.pool = pool
        graphs.capture()
        self.graphs = graphs

    @staticmethod
    def _graph_class():
        """The graphs its one-token forwards replay (engine.cuda_graphs; an EAGLE head's: HeadGraphs)."""
        from .cuda_graphs import DecodeGraphs
        return DecodeGraphs

    def stats(self) -> dict:
        """The draft's forwards so far, beside the target's graph counts in LLMEngine.stats(): its decode graphs'
        replays (drafts 2..k) and the forwards it ran eagerly."""
        return {"draft_cuda_graph_replays": sum(self.graphs.replays.values()) if self.graphs is not None else 0,
                "draft_eager_forwards": self.eager_forwards, "draft_context_skipped_steps": self.context_skips}

    def reset_stats(self) -> None:
        if self.graphs is not None:
            self.graphs.replays.clear()
        self.eager_forwards = self.context_skips = 0

    def fits(self, length: int, k: int) -> bool:
        """Whether a sequence of `length` tokens (its last the step's own) may get k drafts: its tokens and drafts
        within the draft's context (vLLM's speculative_max_model_len: seq_len + k past it drafts none)."""
        return self.context is None or length + k <= self.context

    def close(self) -> None:
        for m in self.model.modules():
            if hasattr(m, "k_cache"):
                m.k_cache = m.v_cache = None
        self.model = self.kv_cache = self.graphs = None

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch) -> None:
        """Fill the drafts of the batch's sequences (their placeholders, trimmed by the scheduler, say how many) with
        the draft model's greedy tokens, feeding it first what its KV lacks of every scheduled sequence; with a
        grammar the drafts are cut where it refuses one (batch.num_new_tokens shrinks with them). Sets each
        sequence's draft_fed: the positions whose draft KV this step wrote (engine: draft_computed after verify).

        The drafts stay on the device until the last forward: drafts 2..k feed the forward before's argmax (its
        live rows picked on the device), their positions, slots and block tables come from the host's bookkeeping
        (they do not depend on the tokens), and every drafted token is read back in one copy at the end (the
        grammar's cut and the target's verify need them on the host). The first forward's integer inputs and the
        blocks to zero travel to the device in one copy, those of all the later forwards in a second."""
        feeds, rows = [], []  # (seq, start, tokens) fed; index in feeds of each sequence with drafts
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            k = len(seq.draft_token_ids)
            end = seq.num_computed_tokens + n - k  # the step's own tokens end here
            start = min(seq.draft_computed, seq.num_computed_tokens)
            end = max(start, seq.draft_end(end, self.context))  # never past its context (Scheduler.lag counts so)
            seq.draft_fed = end
            if k:
                rows.append(len(feeds))
            feeds.append((seq, start, seq.tokens(start, end)))
        self._zero = batch.zero  # zeroed by the first forward, its block ids in that forward's copy
        ids = self._forward(feeds, rows)
        if not rows:
            return
        seqs = [feeds[r][0] for r in rows]
        ks = [len(s.draft_token_ids) for s in seqs]
        out = [ids]  # each forward's argmax: a token for each sequence with a draft still to make, in seqs' order
        for gather, positions, ctx in self._decode_inputs(seqs, ks):
            if gather is not None:  # the sequences whose drafts are done leave the batch
                ids = ids.index_select(0, gather)
            ids = self._argmax(self._decode(ids, positions, ctx))
            out.append(ids)
        host = (torch.cat(out) if len(out) > 1 else ids).tolist()  # the step's one read from the device
        drafted, at = [[] for _ in seqs], 0
        for j in range(len(out)):
            for i in [i for i, k in enumerate(ks) if k > j]:
                drafted[i].append(host[at])
                at += 1
        for seq, drafts in zip(seqs, drafted):
            seq.draft_fed += len(drafts) - 1  # drafts 1..k-1 were fed
            seq.draft_token_ids = drafts
        self._cut(batch, self.target_vocab)  # (the bitmask of the target's verify rows)

    @staticmethod
    def _cut(batch: ScheduledBatch, vocab: int) -> None:
        """Cut a structured output's drafts at the first its grammar refuses (and its verify rows' bitmask)."""
        for j, seq in enumerate(batch.seqs):
            if not seq.draft_token_ids or seq.grammar is None:
                continue
            k = len(seq.draft_token_ids)
            drafts, bits = draft_bitmask(seq.grammar, seq.draft_token_ids, vocab)
            seq.draft_token_ids, seq.draft_bitmask = drafts, (bits if drafts else None)
            batch.num_new_tokens[j] -= k - len(drafts)  # the verify never sees the cut ones

    def _forward(self, feeds, rows: list[int]) -> torch.Tensor | None:
        """One batched forward of the draft over `feeds` [(seq, first position, tokens)] (those without tokens
        skipped), after zeroing the KV blocks self._zero; the argmax (on the device) of the last position of each
        feed in `rows` (None without rows)."""
        fed = self._feed(feeds, rows)
        if fed is None:
            return None
        ids_, pos_, ctx, pick = fed
        if self.vocab < self.target_vocab:  # a padding id of the target's (beyond its tokenizer's: a prompt's, or a
            # random model's token) has no row in the draft's embedding: its last id stands in (the drafts after it
            # are guesses as any, the target verifies them)
            ids_ = ids_.clamp(max=self.vocab - 1)
        hidden = self.model(ids_, pos_, ctx)
        self.eager_forwards += 1
        return self._argmax(hidden, pick) if rows else None

    def _feed(self, feeds, rows: list[int]):
        """The inputs of a forward over `feeds` [(seq, first position, tokens, ...)] (those without tokens skipped):
        (token ids, positions, ForwardContext, the places of the last position of each feed in `rows`), on the
        device, every integer in one copy (a Pack), without a sync; the KV blocks self._zero zeroed first. None
        where no feed has tokens."""
        zero, self._zero = self._zero, []
        bs, ids, pos, slots, starts, lens, tables, last = self.block_size, [], [], [], [0], [], [], {}
        for r, (seq, start, tokens, *_) in enumerate(feeds):
            if not tokens:
                continue
            table = seq.block_table
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + len(tokens)))
            starts.append(len(ids))
            lens.append(start + len(tokens))
            tables.append(table)
            last[r] = len(ids) - 1
        pack = Pack()
        zeros = pack.add(zero)
        if ids:
            width = max(map(len, tables))
            pieces = [pack.add(x) for x in (ids, pos, slots, starts, lens)] + [pack.add_rows(tables, width)]
            idx = pack.add([last[r] for r in rows])
        if not ids and not zero:
            return None
        data = pack.to(self.device)
        if zero:  # index_fill_ takes the 0 as a scalar: no copy of its own
            cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
            cache.index_fill_(2, data[zeros], 0)
        if not ids:
            return None
        ids_, pos_, slots_, starts_, lens_, tables_ = (data[p] for p in pieces)
        ctx = ForwardContext(query_start_loc=starts_.int(), seq_lens=lens_.int(),
                             block_tables=tables_.view(len(tables), width).int(), slot_mapping=slots_,
                             max_query_len=max(b - a for a, b in zip(starts, starts[1:])))
        return ids_, pos_, ctx, data[idx]

    def _decode_inputs(self, seqs, ks: list[int]) -> list[tuple]:
        """(gather, positions, ctx) of each one-token forward of drafts 2..max(ks): `gather` picks, from the
        forward before's argmax, the rows of the sequences with a draft still to make (None: all of them). Their
        positions, slots, lengths and block tables follow from the host's bookkeeping, all forwards' in one copy."""
        bs, n = self.block_size, len(seqs)
        if max(ks) < 2:
            return []
        width = max(len(s.block_table) for s in seqs)
        pack = Pack()
        tables, starts = pack.add_rows([s.block_table for s in seqs], width), pack.add(range(n + 1))
        live, steps = list(range(n)), []
        for j in range(1, max(ks)):
            now = [i for i in live if ks[i] > j]
            gather = pack.add([p for p, i in enumerate(live) if ks[i] > j]) if len(now) < len(live) else None
            pos = [seqs[i].draft_fed + j - 1 for i in now]
            slots = [seqs[i].block_table[p // bs] * bs + p % bs for i, p in zip(now, pos)]
            pick = pack.add(now) if len(now) < n else None
            steps.append((gather, pack.add(pos), pack.add(slots), pack.add([p + 1 for p in pos]), pick, len(now)))
            live = now
        data = pack.to(self.device)
        all_tables, all_starts = data[tables].view(n, width).int(), data[starts].int()
        out = []
        for gather, pos, slots, lens, pick, m in steps:
            ctx = ForwardContext(query_start_loc=all_starts[:m + 1], seq_lens=data[lens].int(),
                                 block_tables=all_tables if pick is None else all_tables.index_select(0, data[pick]),
                                 slot_mapping=data[slots], max_query_len=1)
            out.append((None if gather is None else data[gather], data[pos], ctx))
        return out

    def _decode(self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, *fed) -> torch.Tensor:
        """The hidden states of a one-token forward of each sequence (drafts 2..k): a graph's replay once
        captured. `fed`: an EAGLE head's hidden-state input (its output: normed and pre-norm states)."""
        if self.graphs is not None and self.graphs.fits([1] * ids.shape[0], ctx):
            return self.graphs.run(ids, positions, ctx, *fed)
        self.eager_forwards += 1
        return self.model(ids, positions, ctx, *fed)

    def _argmax(self, hidden: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy token of each row of `hidden` (those `idx` picks), on the device: of the ids the target has
        (a draft of a larger vocab_size never proposes its padding)."""
        logits = self.model.compute_logits(hidden if idx is None else hidden.index_select(0, idx))
        return (logits[:, :self.target_vocab] if logits.shape[-1] > self.target_vocab else logits).argmax(-1)
