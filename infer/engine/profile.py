"""The profile run (vLLM's name): measure the worst case before serving, a prefill of the largest token budget and
a decode of a full batch at max_length, and with speculative decoding a verify step of that batch with every draft
it may have (with the largest-rank adapter active when adapters are given), on a ModelRunner of its own; with a draft
model, its steps over the same batches (a DraftRunner of its own). The meters are `infer.memory.meter`'s; the plan
the peaks go into is `infer.memory.plan`'s.
"""

from __future__ import annotations

import torch

from ..kernels.reference import longest_batched_decode
from ..memory.meter import PeakMeter
from ..memory.plan import (MemoryPlan, cuda_graph_bytes, draft_activation_bytes, draft_graph_bytes, make_plan,
                           speculative_logit_bytes, start_activation_bytes)
from ..memory.sizes import activation_bytes, penalty_table_bytes, prompt_logprob_rows, step_tokens, weights_bytes
from ..models.shapes import ModelShapes
from .config import EngineConfig
from .model_runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch
from .sequence import Sequence


# how the worst case's sequences sample: with what makes the sampler's largest temporaries (penalties, temperature,
# top-k and top-p: its float32 copies, the sort's values and int64 indices, memory.sizes.SAMPLER_BYTES_PER_LOGIT)
# and top logprobs, so that the measured peak holds them (a greedy row holds its logits only)
WORST_SAMPLING = dict(max_new_tokens=1, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                      presence_penalty=0.5, frequency_penalty=0.5, logprobs=20)


def _fake_seq(i: int, length: int, vocab: int, table: list[int], computed: int) -> Sequence:
    g = torch.Generator().manual_seed(i)
    s = Sequence(f"warmup-{i}", torch.randint(0, vocab, (length,), generator=g).tolist(),
                 SamplingParams(**WORST_SAMPLING), None)
    s.block_table, s.num_computed_tokens = table, computed
    s.draft_computed = computed  # (a draft model feeds what the target computes this step)
    return s


def worst_case_batches(model_config, engine_config: EngineConfig, max_length: int, concurrency: int,
                       block_size: int):
    """(prefill batch, decode batches, blocks) over one shared set of blocks: all decode sequences point at the same
    max_length blocks, so the attention reads as much as a full batch does without the KV memory of one. Two decode
    batches: `concurrency` sequences at max_length, and, when it is shorter, at the longest length the CPU attention
    still gathers as one padded batch (kernels.reference.longest_batched_decode), which can hold more at once; with
    speculative decoding a third, the verify step (_verify_batch)."""
    vocab, tokens = model_config.vocab_size, engine_config.max_num_batched_tokens
    table = list(range(-(-max_length // block_size)))  # every sequence here is max_length tokens or fewer
    prefill, left, i = ScheduledBatch([], []), tokens, 0
    while left > 0 and len(prefill.seqs) < engine_config.max_num_seqs:
        n = min(left, max_length - 1)
        prefill.seqs.append(_fake_seq(i, n, vocab, table, 0))
        prefill.num_new_tokens.append(n)
        left, i = left - n, i + 1
    lengths = [max_length]
    batched = longest_batched_decode(concurrency, max_length, ModelShapes.from_config(model_config).num_kv_heads)
    if batched < max_length:
        lengths.append(batched)
    decodes = [ScheduledBatch([_fake_seq(100 + j, n, vocab, table, n - 1) for j in range(concurrency)],
                              [1] * concurrency) for n in lengths]
    verify = _verify_batch(engine_config, vocab, max_length, concurrency, table)
    return prefill, decodes + ([verify] if verify else []), len(table)


def _verify_batch(engine_config: EngineConfig, vocab: int, max_length: int, concurrency: int,
                  table: list[int]) -> ScheduledBatch | None:
    """With speculative decoding, a verify step of `concurrency` decoding sequences with drafts, as many as the
    scheduler gives them (num_speculative_tokens each, while the token budget left by every sequence's own token
    lasts; the scheduler's _with_drafts), near max_length (the drafts fit the context, as _propose leaves them):
    its logits have a row for every draft. None without speculative decoding."""
    spec = engine_config.speculative_config
    k = min(spec["num_speculative_tokens"], max_length - 2) if spec else 0
    if k < 1:
        return None
    n, budget, g = max_length - k - 1, engine_config.max_num_batched_tokens - concurrency, torch.Generator()
    batch = ScheduledBatch([], [])
    for j in range(concurrency):
        seq = _fake_seq(200 + j, n, vocab, table, n - 1)
        drafts = min(k, max(budget, 0))
        seq.draft_token_ids = torch.randint(0, vocab, (drafts,), generator=g.manual_seed(j)).tolist()
        budget -= drafts
        batch.seqs.append(seq)
        batch.num_new_tokens.append(1 + drafts)
    return batch


def ask_prompt_logprobs(prefill: ScheduledBatch, engine_config: EngineConfig, vocab: int) -> None:
    """The worst case's prefill asks for the prompt logprobs of a chunk of its positions (its first sequence's
    last ones) at the most top logprobs a request may ask for (max_logprobs; -1: the whole vocabulary), so that the
    measured peak holds their chunk (ModelRunner._prompt_logprobs: memory.sizes.prompt_logprob_rows positions at
    a time, whatever the prompt's length, which a chunk's worth of them shows without a long prompt's results)."""
    cap = getattr(engine_config, "max_logprobs", 20)
    k = vocab if cap == -1 else min(cap, vocab)
    seq = prefill.seqs[0]
    seq.params = SamplingParams(**WORST_SAMPLING, prompt_logprobs=k)
    seq.plp_from = max(1, len(seq) - prompt_logprob_rows(vocab, k, engine_config.max_num_seqs))
    seq.prompt_logprobs, seq.prompt_lp_next = [None], seq.plp_from


def _rearm(batch: ScheduledBatch) -> None:
    """Before a run of the worst case again: its prompt logprobs are asked for again (a step asks for a position
    once: Sequence.prompt_lp_next)."""
    for seq in batch.seqs:
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs, seq.prompt_lp_next = [None], getattr(seq, "plp_from", 1)


def _peak_activations(runner: ModelRunner, batches, device: torch.device) -> int:
    """The larger peak of the batches, each run twice: the first run of a shape also sets up the math libraries'
    own buffers, so the second is the one that counts."""
    runner.run(batches[0])  # first run: one-time allocations (kernels, thread pools) are not activations
    peaks = []
    for batch in batches:
        step = runner.verify if any(s.draft_token_ids for s in batch.seqs) else runner.run  # (a verify step's own)
        runs = []
        for _ in range(2):
            _rearm(batch)
            with PeakMeter(device) as meter:
                step(batch)
            runs.append(meter.peak)
        peaks.append(runs[-1])
    return max(peaks)


def _draft_peak(draft, engine_config: EngineConfig, batches, nblocks: int, dtype, device: torch.device,
                target=None) -> int:
    """A draft model's peak over the worst case's batches (draft-model speculation: it feeds each step's tokens, then
    drafts one token a sequence at a time), each run twice as _peak_activations does; its KV cache is not counted."""
    from .eagle import feed_rows, make_drafter
    runner = make_drafter(draft, engine_config.kv_dtype(dtype), nblocks, engine_config.block_size, device, target)
    runner.zero(list(range(nblocks)))
    peaks = []
    for batch in batches:
        k = [len(s.draft_token_ids) for s in batch.seqs]
        kept = [(list(s.draft_token_ids), s.draft_computed) for s in batch.seqs], list(batch.num_new_tokens)
        runs = []
        for _ in range(2):
            feed_rows(runner, batch.seqs)  # (an EAGLE head: the target's states it is fed)
            with PeakMeter(device) as meter:
                runner.propose(batch)
            runs.append(meter.peak)
            for s, (drafts, computed) in zip(batch.seqs, kept[0]):  # (an EAGLE head drops drafts it cannot feed)
                s.draft_token_ids, s.draft_computed, s.draft_hidden = list(drafts), computed, None
            batch.num_new_tokens[:] = kept[1]
        for s, n in zip(batch.seqs, k):  # (propose fills the drafts in place: the same number)
            assert len(s.draft_token_ids) == n
        peaks.append(runs[-1])
    runner.close()
    return max(peaks)


def profile_run(model, model_config, engine_config: EngineConfig, dtype, device, max_length: int,
                concurrency: int, max_length_limit: int, lora_manager=None, lora_name: str | None = None,
                budget: int | None = None, weights: int | None = None, draft=None) -> tuple[MemoryPlan, int]:
    """Run the worst case and return (measured plan, estimated activation bytes). `draft`: a draft model's
    engine.draft.DraftParts (its steps come before the target's verify: the peak is the larger)."""
    prefill, decodes, nblocks = worst_case_batches(model_config, engine_config, max_length, concurrency,
                                                  engine_config.block_size)
    ask_prompt_logprobs(prefill, engine_config, model_config.vocab_size)
    runner = ModelRunner(engine_config, model, dtype=dtype, device=device, num_blocks=nblocks,
                         lora_manager=lora_manager)
    runner.zero_blocks(list(range(nblocks)))
    if runner.hybrid:  # a state slot each (engine.state_cache), as the block manager gives a running sequence
        for batch in (prefill, *decodes):
            for i, s in enumerate(batch.seqs):
                s.state_slot = i % engine_config.max_num_seqs
    lora_bytes = lora_manager.budget_bytes() if lora_manager is not None else 0  # slots used or not, CPU copies
    if lora_manager is not None and lora_name is not None:
        lora_manager.acquire(lora_name)
        for s in prefill.seqs + [s for d in decodes for s in d.seqs]:
            s.lora = lora_name
    from .eagle import is_eagle_head
    eagle = draft is not None and is_eagle_head(draft)
    if eagle:  # an EAGLE-3 head: the target's steps keep its aux states (engine.eagle), counted in their peak
        model.aux_layers = tuple(draft.model.aux_layers)
    try:
        peak = _peak_activations(runner, (prefill, *decodes), device)
    finally:
        if eagle:
            model.aux_layers, model.aux_hidden = (), None
    if lora_manager is not None and lora_name is not None:
        lora_manager.release(lora_name)
    del runner
    if draft is not None:
        batches, blocks = (prefill, *decodes), nblocks
        if draft.context is not None and draft.context < max_length:  # its worst case is at its own context (past
            # it a sequence feeds the draft nothing and drafts nothing: engine.draft.DraftRunner.propose)
            prefill_d, decodes_d, blocks = worst_case_batches(model_config, engine_config, draft.context,
                                                              concurrency, engine_config.block_size)
            batches = (prefill_d, *decodes_d)
        peak = max(peak, _draft_peak(draft, engine_config, batches, blocks, dtype, device, model))
    rank = engine_config.max_lora_rank if lora_manager is not None else 0
    tokens = step_tokens(engine_config.max_num_batched_tokens, engine_config.max_num_seqs, max_length)
    if rank and lora_name is None:  # slots for adapters added later (--enable-lora): their path by the formula
        peak += activation_bytes(model_config, dtype, tokens, concurrency, max_length, rank,
                                 lora_targets=engine_config.lora_target_modules) \
            - activation_bytes(model_config, dtype, tokens, concurrency, max_length, 0)
    peak += penalty_table_bytes(model_config, concurrency)  # (filled before the measured runs, as an engine keeps it)
    spec = speculative_logit_bytes(engine_config, model_config, concurrency)  # the verify step's rows: measured
    draft_config = draft.model_config if draft is not None else None
    # the CUDA graphs keep a pool of their own (a draft model's decode graphs too, as an engine start reserves)
    graphs = cuda_graph_bytes(engine_config, model_config, dtype) \
        + draft_graph_bytes(engine_config, draft_config, dtype)
    estimate = activation_bytes(model_config, dtype, tokens, concurrency, max_length, rank,
                                kv_dtype=engine_config.kv_dtype(dtype), lora_targets=engine_config.lora_target_modules,
                                triton=device.type == "cuda") + graphs + spec \
        + draft_activation_bytes(engine_config, draft_config, dtype, max_length, concurrency)
    if weights is None:
        weights = weights_bytes(model) + (weights_bytes(draft.model) if draft is not None else 0)
    # the KV cache an engine start of this config allocates is what its own figure for activations leaves
    start = start_activation_bytes(engine_config, model_config, model, dtype, max_length, draft_config,
                                   draft.model if draft is not None else None)
    plan = make_plan(engine_config, model_config, dtype, device, weights, peak + graphs, max_length, concurrency,
                     max_length_limit, lora_bytes, measured=True, budget=budget, engine_activation=start,
                     draft_config=draft_config)
    return plan, estimate
