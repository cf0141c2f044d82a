"""The batched sampler (engine.sampler) against transformers' logits processors on random logits, penalties against
the OpenAI formula, the exponential race against the distribution it samples, seeds and the packed logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from infer.engine.sampler import PenaltyTable, Sampler, SamplingInputs
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence
from infer.engine.transfer import Pack

V = 64


def _seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence("r", list(prompt), params)
    seq.output_token_ids = list(output)
    return seq


def _random_batch(n: int, seed: int, **fixed):
    """n rows of random logits, each with its own random sampling parameters and token history."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * rng.choice([1.0, 3.0])
    seqs = []
    for _ in range(n):
        kw = dict(temperature=rng.choice([0.3, 0.7, 1.0, 1.6]), top_k=rng.choice([0, 1, 3, 10, 40, 64, 500]),
                  top_p=rng.choice([1.0, 0.95, 0.8, 0.5, 0.2, 0.05]),
                  repetition_penalty=rng.choice([1.0, 1.3, 0.7, 2.0]),
                  presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
                  frequency_penalty=rng.choice([0.0, 0.3, -0.4, 1.5]))
        kw.update(fixed)
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 20))]
        seqs.append(_seq(SamplingParams(**kw), prompt, output))
    return logits, seqs


def _hf_probs(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """transformers' processors in generate()'s order, for one row: repetition penalty, temperature, top-k, top-p."""
    p, scores = seq.params, row.unsqueeze(0).clone()
    ids = torch.tensor([seq.prompt_token_ids + seq.output_token_ids])
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return scores[0].softmax(-1)


@pytest.mark.parametrize("seed", range(6))
def test_filtered_distribution_matches_transformers(seed):
    logits, seqs = _random_batch(48, seed, presence_penalty=0.0, frequency_penalty=0.0)
    sampler = Sampler(0)
    mine = sampler.probs(sampler.penalised(logits, seqs), seqs)
    cuts = 0
    for i, seq in enumerate(seqs):
        ref = _hf_probs(logits[i], seq)
        kept, ref_kept = mine[i] > 0, ref > 0
        assert torch.equal(kept, ref_kept), f"row {i} ({seq.params}): kept {kept.sum()} tokens, HF {ref_kept.sum()}"
        torch.testing.assert_close(mine[i], ref, atol=1e-6, rtol=1e-5)
        cuts += int(ref_kept.sum()) < V
    assert cuts > 10  # the parameters really filter


def test_top_p_boundaries_match_transformers():
    """Rows built so that the cumulative mass crosses top_p right at a token: keep exactly the tokens HF keeps."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (V - 4)) + 1e-9
    logits = probs.log().expand(5, V).clone()
    seqs = [_seq(SamplingParams(temperature=1.0, top_p=p), [1], []) for p in (0.35, 0.45, 0.65, 0.75, 0.95)]
    mine = Sampler(0).probs(logits, seqs)
    for i, seq in enumerate(seqs):
        assert torch.equal(mine[i] > 0, _hf_probs(logits[i], seq) > 0)
    assert [(mine[i] > 0).sum().item() for i in range(5)] == [1, 2, 2, 3, 4]  # the smallest set whose mass reaches top_p


def _openai_penalised(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c over output tokens."""
    out = row.clone()
    for j in range(V):
        c = seq.output_token_ids.count(j)
        out[j] = row[j] - c * seq.params.frequency_penalty - float(c > 0) * seq.params.presence_penalty
    return out


@pytest.mark.parametrize("seed", range(3))
def test_presence_and_frequency_penalties_follow_openai(seed):
    logits, seqs = _random_batch(24, seed, repetition_penalty=1.0)
    mine = Sampler.penalised(logits, seqs)
    changed = 0
    for i, seq in enumerate(seqs):
        ref = _openai_penalised(logits[i], seq)
        torch.testing.assert_close(mine[i], ref, atol=1e-5, rtol=1e-6)
        changed += not torch.equal(ref, logits[i])
    assert changed > 5


def test_prompt_tokens_get_the_repetition_penalty_but_not_presence():
    seq = _seq(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), [3], [5])
    logits = torch.full((1, V), 4.0)
    logits[0, 7] = -4.0
    seq.output_token_ids.append(7)
    out = Sampler.penalised(logits, [seq])[0]
    assert out[3] == 2.0  # prompt token: repetition only
    assert out[5] == 2.0 - 1.0 and out[7] == -8.0 - 1.0  # output tokens: both (negative logits multiplied)
    assert out[9] == 4.0


def test_draws_follow_the_distribution():
    """20000 rows of the same filtered distribution: the exponential race picks each token as often as its
    probability says, and never a filtered one; one seeded row in the batch leaves the others' draws to the
    engine's generator."""
    n, g = 20000, torch.Generator().manual_seed(3)
    row = torch.randn(V, generator=g) * 2
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.9)
    seqs = [_seq(params, [1], []) for _ in range(n)]
    seqs[0] = _seq(SamplingParams(temperature=0.9, top_k=12, top_p=0.9, seed=1), [1], [])  # its own generator
    sampler = Sampler(5)
    target = sampler.probs(row.expand(1, V), seqs[:1])[0]
    tokens = sampler.sample(row.expand(n, V).clone(), seqs).tokens
    freq = torch.bincount(tokens, minlength=V).float() / n
    assert (freq[target == 0] == 0).all()
    assert (freq - target).abs().sum() / 2 < 0.02  # total variation; ~0.01 expected from 20000 draws


def test_seeded_rows_do_not_depend_on_the_batch():
    logits, seqs = _random_batch(6, 9, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                 top_k=0, top_p=1.0, temperature=1.0)
    for i, s in enumerate(seqs):
        s.params = SamplingParams(temperature=1.0, seed=100 + i if i % 2 else None)

    def run(order):
        for s in seqs:
            s.generator = None
        sampler = Sampler(0)
        out = []
        for _ in range(4):
            toks = sampler.sample(logits[order], [seqs[i] for i in order]).tokens.tolist()
            out.append({order[j]: t for j, t in enumerate(toks)})
        return [[step[i] for step in out] for i in range(len(seqs))]

    a, b = run([0, 1, 2, 3, 4, 5]), run([5, 3, 1, 0, 2, 4])
    assert [a[i] for i in (1, 3, 5)] == [b[i] for i in (1, 3, 5)]
    assert len({tuple(a[i]) for i in (1, 3, 5)}) == 3  # different seeds, different draws


def test_greedy_rows_take_the_penalised_argmax_and_logprobs_are_packed():
    logits, _ = _random_batch(5, 4)
    seqs = [_seq(SamplingParams(logprobs=k, repetition_penalty=rp), [int(logits[i].argmax())], [])
            for i, (k, rp) in enumerate([(None, 1.0), (0, 1.0), (3, 5.0), (None, 5.0), (2, 1.0)])]
    sampler = Sampler(0)
    out = sampler.sample(logits, seqs)
    tokens, records = out.decode(out.packed.cpu())
    assert tokens == Sampler.penalised(logits, seqs).argmax(-1).tolist()
    assert tokens[2] != int(logits[2].argmax())  # the penalty moved it
    logp = logits.log_softmax(-1)
    assert records[0] is None and records[3] is None
    assert records[1] == {"token_id": tokens[1], "logprob": float(logp[1, tokens[1]]), "rank": 1}
    top = logp[2].topk(3)
    assert records[2]["top_logprobs"] == [{"token_id": int(i), "logprob": float(v)}
                                          for v, i in zip(top.values, top.indices)]
    top = logp[4].topk(2)  # fewer than the batch's widest (3): read from their own columns
    assert records[4]["top_logprobs"] == [{"token_id": int(i), "logprob": float(v)}
                                          for v, i in zip(top.values, top.indices)]


def test_sampled_rows_among_greedy_rows_draw_from_their_own_logits():
    """A batch of greedy and sampled rows: each sampled row draws from its own row of logits (top_k=1 makes the
    draw its argmax), whatever its place in the batch."""
    logits, _ = _random_batch(7, 12)
    seqs = [_seq(SamplingParams() if i % 3 == 0 else SamplingParams(temperature=0.8, top_k=1, seed=i), [1], [])
            for i in range(7)]
    assert Sampler(0).sample(logits, seqs).tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.gpu
def test_gpu_sampler_filters_like_the_cpu_and_seeds_repeat():
    logits, seqs = _random_batch(32, 11)
    for i, s in enumerate(seqs):
        s.params.seed = i if i % 2 else None
    cpu = Sampler.probs(Sampler.penalised(logits, seqs), seqs)
    gpu = Sampler.probs(Sampler.penalised(logits.cuda(), seqs), seqs).cpu()
    torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-4)
    runs = []
    for _ in range(2):
        for s in seqs:
            s.generator = None
        out = Sampler(0).sample(logits.cuda(), seqs)
        runs.append(out.decode(out.packed.cpu())[0])
    assert runs[0] == runs[1]
    assert all(cpu[i, t] > 0 for i, t in enumerate(runs[0]))  # never a filtered token


def _table_step(table: PenaltyTable, logits: torch.Tensor, seqs: list[Sequence], keys: list, prev=None):
    """One step's penalties from `table`, as the model runner computes them (updates in the step's Pack)."""
    pack = Pack()
    inputs = SamplingInputs(seqs, V, pack, table, keys=keys, prev=prev)
    return Sampler.penalised(logits, seqs, inputs.load(pack.to(torch.device("cpu")), torch.device("cpu")))


def test_penalty_table_kept_step_by_step_equals_the_whole_history():
    """Requests come and go over 12 steps, in a different batch order each step, some without penalties, some
    sampling only every other step (several new tokens to count at once), a token sometimes still pending on the
    device: the penalties from the table updated step by step equal those computed from each row's whole history,
    rows of ended requests are reused (zeroed first), and the table grows past its first size."""
    rng = random.Random(0)
    table = PenaltyTable(V, torch.device("cpu"), max_rows=3)
    live, next_id = {}, 0
    for step in range(12):
        while len(live) < 5:
            logits, (seq,) = _random_batch(1, 100 + next_id)
            if next_id % 4 == 3:
                seq.params = SamplingParams()  # no penalties: reads the zero row
            live[f"r{next_id}"], next_id = seq, next_id + 1
        keys = [k for k in live if step % 2 or int(k[1:]) % 3]  # every third request sits out the even steps
        rng.shuffle(keys)
        seqs = [live[k] for k in keys]
        prev_tokens, row_of = [], {}
        for k, s in zip(keys, seqs):
            s.request_id, s.num_pending = k, 0
            if rng.random() < 0.5:  # its last token is still on the device, in the previous step's sampled tokens
                row_of[k] = len(prev_tokens)
                prev_tokens += [rng.randrange(V)] * (rng.randrange(2) + 1)
                s.num_pending = 1
        prev = type("Prev", (), {"row_of": row_of, "sampled": type("S", (), {"tokens": torch.tensor(prev_tokens)})})
        logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(step)) * 3
        mine = _table_step(table, logits, seqs, keys, prev)
        for k, s in zip(keys, seqs):  # the pending token arrives on the host; each request gets another token
            if s.num_pending:
                s.output_token_ids.append(prev_tokens[row_of[k]])
            s.num_pending = 0
        whole = Sampler.penalised(logits, seqs)  # from the histories, pending tokens now among them
        assert torch.equal(mine, whole), f"step {step}"
        for k in keys:
            live[k].output_token_ids.append(rng.randrange(V))
        for k in rng.sample(sorted(live), 2):  # two requests end
            table.release(k)
            del live[k]
    assert table.used <= 8 < next_id and table.table.shape[0] > 4  # rows handed on, and grown past max_rows + 1
    assert set(table.rows) <= set(live)


def test_a_temperature_too_small_to_divide_by_is_raised_to_vllms_floor():
    """logits / 1e-40 overflow to inf and the softmax to NaN (token 0 every step); a positive temperature below 0.01
    is raised to 0.01, as vLLM raises it (_MAX_TEMP), and samples there."""
    from infer import LLM
    llm = LLM("tiny-llama", max_num_seqs=4)
    try:
        prompts = [[5, 17, 29, 41], [7, 8, 9]]
        for t in (1e-40, 5e-324, 9e-6):
            params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=t, seed=1, logprobs=0)
            assert params.temperature == 0.01 and not params.greedy
            for out in llm.generate(prompts, params):
                assert out.finish_reason == "length" and len(out.token_ids) == 6, t  # (NaN: finish_reason error)
                assert all(math.isfinite(r["logprob"]) for r in out.logprobs), t
        assert SamplingParams(temperature=1e-5).greedy is False and SamplingParams().greedy
    finally:
        llm.close()
