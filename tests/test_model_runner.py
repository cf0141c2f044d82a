"""The model runner's step inputs (ModelRunner.prepare): the one packed int64 copy (engine.transfer.Pack) read back
piece by piece equals what the host knows of each step, and every piece a kernel reads is 16-byte aligned."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.model_runner import ModelRunner
from infer.engine.transfer import Pack
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import THREE, hf_float, save_adapter


def test_pack_pieces_come_back_in_place_and_aligned():
    pack = Pack()
    pieces = [[1, 2, 3], [], [4], [5, 6], [7, 8, 9], [10]]
    places = [pack.add(p) for p in pieces]
    rows = pack.add_rows([[1], [2, 3, 4], []], 3, pad=-1)
    data = pack.to(torch.device("cpu"))
    assert [data[at].tolist() for at in places] == pieces
    assert data[rows].view(3, 3).tolist() == [[1, -1, -1], [2, 3, 4], [-1, -1, -1]]
    assert all(at.start % 2 == 0 for at in places + [rows])  # int64: an even index is 16 bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    tmp = tmp_path_factory.mktemp("runner")
    return str(path), {n: str(save_adapter(hf, tmp / n, seed=i + 1, **kw)) for i, (n, kw) in enumerate(THREE.items())}


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_prepared_inputs_are_what_the_host_knows(tiny, monkeypatch, overlap):
    """Steps with chunked prefills, decodes, odd token counts, adapters (the run order sorted by slot), fresh blocks
    and, overlapped, input tokens still pending on the device: every piece read from the step's copy (token ids,
    positions, KV slots, adapter slots, query starts, lengths, block tables, the rows to sample and their tokens'
    flat indices) equals the host's view of the step, and each int64 piece a kernel reads is 16-byte aligned."""
    path, loras = tiny
    llm = LLM(path, loras=loras, block_size=4, num_kv_blocks=96, max_model_len=64, max_num_seqs=6, max_loras=2,
              max_lora_rank=8, max_num_batched_tokens=16, overlap=overlap)
    eng = llm.engine
    eng.runner.kv_cache.fill_(float("nan"))  # a fresh block not zeroed before its step would show
    seen, pending, real = [], [], ModelRunner.prepare

    def spy(self, batch, order=None, prev=None):
        order = list(range(len(batch.seqs))) if order is None else order
        before = [(s, s.num_computed_tokens, batch.num_new_tokens[i], len(s), self.lora_manager.slot_of(s.lora),
                   list(s.block_table)) for i, s in ((i, batch.seqs[i]) for i in order)]
        out = real(self, batch, order, prev)
        zero = list(batch.zero)
        seen.append((order, before, zero, out, self.kv_cache[:, :, zero].abs().sum().item() if zero else 0.0))
        pending.append(sum(s.num_pending for s in batch.seqs))
        return out
    monkeypatch.setattr(ModelRunner, "prepare", spy)
    prompts = random_prompts(eng.model_config.vocab_size, (7, 21, 5, 10, 3), seed=6)
    names = ["b", None, "a", "c", "a"]
    for i, (p, n) in enumerate(zip(prompts, names)):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=5 + i, ignore_eos=True), lora=n)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.scheduler.num_preemptions == 0
    assert len(seen) >= 10 and sum(1 for _, _, zero, _, _ in seen if zero) >= 3
    assert any(len(before) > 1 and sum(b[2] for b in before) % 2 for _, before, *_ in seen)  # an odd token count
    assert (sum(pending) >= 10) == overlap and sum(1 for *_, out, _ in seen if out[2].lora is not None) >= 5
    bs = 4
    for order, before, zero, (input_ids, positions, ctx, rows, idx, sampling, prompt), zeroed in seen:
        ids, pos, slots, adapters, starts, sample_rows, last = [], [], [], [], [0], [], []
        for i, (seq, start, n, length, slot, table) in zip(order, before):
            ids += seq.all_token_ids[start:start + n]  # at the end every input token is known on the host
            pos += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            adapters += [slot] * n
            starts.append(len(ids))
            if start + n == length:  # its prompt is complete: it samples
                sample_rows.append(i)
                last.append(len(ids) - 1)
        assert input_ids.tolist() == ids and positions.tolist() == pos and ctx.slot_mapping.tolist() == slots
        assert ctx.query_start_loc.tolist() == starts
        assert ctx.seq_lens.tolist() == [start + n for _, start, n, *_ in before]
        width = ctx.block_tables.shape[1]
        assert ctx.block_tables.tolist() == [table + [0] * (width - len(table)) for *_, table in before]
        assert rows == sample_rows and (sampling is None) == (not rows)
        # every token samples, in order (a decode step): the hidden states are taken as they are, no gather
        assert (idx is None) == (last == list(range(len(ids)))) and (idx is None or idx.tolist() == last)
        if ctx.lora is not None:
            assert ctx.lora.token_slots.tolist() == adapters and _aligned(ctx.lora.token_slots)
        assert zeroed == 0.0  # the step's fresh blocks were zeroed before its forward
        assert all(_aligned(t) for t in (input_ids, positions, ctx.slot_mapping, idx) if t is not None)


def test_decode_steps_attend_in_one_op_and_other_steps_rotate_first(monkeypatch):
    """A decode step's attention is kernels.decode_attention (on a GPU one launch: rotary, KV write, attention)
    once per layer; a step with a prompt rotates and writes its K/V first (rotary_store_kv), then attends."""
    from infer import kernels
    calls = []
    for name in ("decode_attention", "rotary_store_kv", "paged_attention"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    llm = LLM(str(ensure_builtin("tiny-llama")), block_size=4, num_kv_blocks=64, max_model_len=64)
    layers = llm.engine.model_config.num_hidden_layers
    prompts = random_prompts(llm.engine.model_config.vocab_size, (6, 3), seed=2)
    llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert calls[:2 * layers] == ["rotary_store_kv", "paged_attention"] * layers  # the prefill step
    assert calls[2 * layers:] == ["decode_attention"] * (3 * layers)  # three decode steps
