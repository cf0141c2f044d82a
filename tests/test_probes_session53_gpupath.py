"""Session 53 probes of the engine's GPU code path, run on CPU (Triton interpreted, CUDA graphs emulated, the
overlapped step), for what the session added: AWQ checkpoints (repacked into GPTQ's kernel layout) with mixed
adapters, the Phi-3 architecture (longrope, adapters on its fused qkv_proj / gate_up_proj), logprob records with
vLLM's rank (prompt tokens tied with others among them), max_logprobs -1 with logprobs and prompt_logprobs -1 (a
whole-vocabulary record through the packed device-to-host transfer), a temperature of 1e-6 (sampled at 0.01) with a
seed, and beam search's Logprob ranks: the tokens, ranks and logprobs of the torch CPU path."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import LLM, BeamSearchParams, SamplingParams

from helpers import random_prompts
from lora_helpers import hf_float, save_adapter
from quant_helpers import int4_kernel_path

VOCAB = 512


def _rec(r):
    """A logprob record as compared: token, rank, logprob, and the top tokens with their logprobs."""
    return r and (r["token_id"], r["rank"], r["logprob"],
                  sorted((t["token_id"], t["logprob"]) for t in r.get("top_logprobs") or []))


def _records(llm, prompts, params, names, beams) -> list:
    got = []
    for o in llm.generate(prompts, params, lora=names):
        got += [(list(c.token_ids), [_rec(r) for r in c.logprobs or []]) for c in o.outputs]
        got.append([_rec(r) for r in o.prompt_logprobs or []])
    for out in llm.beam_search([prompts[i] for i in beams], BeamSearchParams(beam_width=2, max_tokens=3),
                               lora=[names[i] for i in beams]):
        for s in out.sequences:  # each candidate a Logprob: a float with its rank
            got.append((list(s.tokens), [[(t, lp.rank, float(lp), []) for t, lp in sorted(d.items())]
                                         for d in s.logprobs]))
    return got


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(g, tuple):  # a completion or a beam: tokens equal, then its records
            assert g[0] == w[0]
            g, w = g[1], w[1]
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert (a is None) == (b is None)
            if a is None:
                continue
            if isinstance(a, list):  # a beam step's candidates
                a, b = [x[:2] for x in a], [x[:2] for x in b]
                assert a == b
                continue
            assert a[:2] == b[:2] and a[2] == pytest.approx(b[2], abs=1e-3)
            assert [t for t, _ in a[3]] == [t for t, _ in b[3]]
            assert [p for _, p in a[3]] == pytest.approx([p for _, p in b[3]], abs=1e-3)


def _params():
    """Top 2 and prompt top 6; the whole vocabulary for both (-1); a seeded temperature 1e-6 (0.01), n = 2."""
    return [SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=6),
            SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=-1, prompt_logprobs=-1),
            SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1, temperature=1e-6, seed=5, n=2)]


def _compare(path, adapters, names, prompts, monkeypatch, check=None):
    opts = dict(loras=adapters, max_loras=2, max_lora_rank=8, max_num_seqs=4, block_size=4, max_model_len=32,
                max_logprobs=-1, cuda_graph_max_tokens=4)
    with LLM(str(path), **opts) as llm:
        want = _records(llm, prompts, _params(), names, (0, 2))
    assert len(want[2][1][0][3]) == VOCAB and len(want[3][1][3]) == VOCAB  # whole-vocabulary records
    int4_kernel_path(monkeypatch)
    with LLM(str(path), overlap=True, **opts) as llm:
        if check:
            check(llm.engine.runner.model)
        llm.engine.runner.capture_graphs(8, emulate=True)
        got = _records(llm, prompts, _params(), names, (0, 2))
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    _assert_same(got, want)
    return want


def test_awq_with_mixed_adapters_through_the_kernels_graphs_and_overlap_equals_the_cpu_path(tmp_path, monkeypatch):
    """An AWQ 'gemm' checkpoint (each layer repacked into GPTQ's int4 kernel layout) with adapters of ranks 8 and 4
    beside a base-only row, through the int4 Triton kernels, emulated graphs and the overlapped step."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from test_lora_engine import SPECS
    from test_probes_session53_awq import float_model, write_awq
    base = float_model(tmp_path)
    write_awq(base, tmp_path / "awq")
    hf = hf_float(base)
    adapters = {n: str(save_adapter(hf, tmp_path / n, seed=i + 1, **SPECS[n])) for i, n in enumerate(("all8", "qv4"))}
    prompts = random_prompts(VOCAB, (5, 3, 7), seed=4)

    def int4(model):
        assert model.layers[0].self_attn.qkv_proj.weight is None  # really the packed int4 path
    _compare(tmp_path / "awq", adapters, ["all8", None, "qv4"], prompts, monkeypatch, int4)


def test_phi3_longrope_with_fused_adapters_and_tied_logits_equals_the_cpu_path(tmp_path, monkeypatch):
    """A longrope Phi-3 (its short factors and attention scale in the rope table the rotary kernels read) with
    adapters on its fused qkv_proj / gate_up_proj beside a base-only row, its head rows 9..13 equal (tied logits:
    prompt tokens among them have the larger rank), through the Triton kernels, emulated graphs and overlap."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from test_probes_session53_phi3 import ADAPTERS, LONGROPE, build
    build(tmp_path / "base", num_hidden_layers=1, **LONGROPE)
    weights = tmp_path / "base" / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"][10:14] = tensors["lm_head.weight"][9]
    save_file(tensors, weights, metadata={"format": "pt"})
    hf = hf_float(tmp_path / "base")
    adapters = {n: str(save_adapter(hf, tmp_path / n, seed=i + 1, lora_dropout=0.0, **kw))
                for i, (n, kw) in enumerate(ADAPTERS.items())}
    prompts = random_prompts(VOCAB, (5, 3, 7), seed=4)
    prompts[0][2:4], prompts[1][1:3] = [9, 11], [12, 9]
    want = _compare(tmp_path / "base", adapters, ["all8", None, "qkv4"], prompts, monkeypatch)
    for r in want[3][1:]:  # prompt 1's whole-vocabulary records: the ties are really there, their rank the larger
        assert r[0] in (9, 12) and sum(p == r[2] for _, p in r[3]) == 5
        assert r[1] == sum(p >= r[2] for _, p in r[3])
