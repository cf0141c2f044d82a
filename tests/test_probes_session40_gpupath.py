"""Session 40 probes of the engine's GPU code path, run on CPU (Triton interpreted, CUDA graphs emulated): what one
step combines there (int4 GPTQ weights in the kernel layout, mixed adapters of different ranks beside base-only
rows, prefix-cache hits, prefill chunks beside decodes, preemption and recompute, the overlapped step, logprobs,
prompt logprobs, seeded n > 1 sampling) gives the torch reference path's tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from quant_helpers import int4_kernel_path, make_gptqmodel_checkpoint, needs_gptqmodel
from test_lora_engine import SPECS, hf_float, save_adapter


@pytest.fixture(scope="module")
def llama_int4(tmp_path_factory):
    base = ensure_builtin("tiny-llama")
    root = tmp_path_factory.mktemp("gpupath")
    qdir = make_gptqmodel_checkpoint(base, root / "q", bits=4, group_size=32)
    hf = hf_float(base)
    adapters = {n: str(save_adapter(hf, root / n, seed=i + 1, **SPECS[n])) for i, n in enumerate(("all8", "qv4"))}
    return qdir, adapters


def _records(outs) -> list:
    """Every completion's tokens and (token, logprob, top tokens and logprobs), and every prompt's logprobs."""
    def rec(r):
        return r and (r["token_id"], r["logprob"], sorted((t["token_id"], t["logprob"]) for t in r["top_logprobs"]))
    got = []
    for o in outs:
        got += [(list(c.token_ids), [rec(r) for r in c.logprobs or []]) for c in o.outputs]
        got.append([rec(r) for r in o.prompt_logprobs or []])
    return got


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(g, tuple):  # a completion: tokens equal, then its records
            assert g[0] == w[0]
            g, w = g[1], w[1]
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert (a is None) == (b is None)
            if a is not None:
                assert a[0] == b[0] and [t for t, _ in a[2]] == [t for t, _ in b[2]]
                assert a[1] == pytest.approx(b[1], abs=1e-3)
                assert [p for _, p in a[2]] == pytest.approx([p for _, p in b[2]], abs=1e-3)


@needs_gptqmodel
def test_int4_lora_prefix_chunked_preempted_overlapped_step_equals_cpu_path(llama_int4, monkeypatch):
    """Adapters of ranks 8 and 4 beside a base-only row, a 5-token prefix shared by three prompts (cache hits), 8
    tokens a step (prompts cut into chunks beside the others' decodes), 4 blocks of 4 for 4 sequences (n = 2 forks
    one) of up to 14 tokens (sequences preempted and recomputed): through the int4 kernels, Triton ops, emulated
    decode and piecewise graphs and the overlapped step, the tokens and logprobs of the torch CPU path."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    qdir, adapters = llama_int4
    opts = dict(loras=adapters, max_loras=2, max_lora_rank=8, max_num_seqs=4, block_size=4, num_kv_blocks=4,
                max_model_len=16, max_num_batched_tokens=8, cuda_graph_max_tokens=8)
    vocab = 256
    shared = random_prompts(vocab, (5,), seed=3)[0]
    prompts = [shared + t for t in random_prompts(vocab, (3, 1, 4), seed=4)]
    names = ["all8", None, "qv4"]
    params = [SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1 if i % 2 else None,
                             n=2 if i == 2 else 1, temperature=0.8 if i == 2 else 0.0, seed=7) for i in range(3)]

    def run(llm):
        got = _records(llm.generate(prompts, params, lora=names))
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        return got

    cpu_llm = LLM(str(qdir), **opts)
    want = run(cpu_llm)
    cpu_llm.close()
    int4_kernel_path(monkeypatch)
    llm = LLM(str(qdir), overlap=True, **opts)
    assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.weight is None  # really the packed int4 path
    llm.engine.runner.capture_graphs(16, emulate=True)
    got = run(llm)
    # (graphs of up to 8 tokens, so that mixed steps of this workload replay piecewise graphs whatever its schedule)
    assert sum(llm.engine.runner.graphs.replays.values()) > 0 and llm.engine.stats()["piecewise_graph_steps"] > 0
    _assert_same(got, want)
    llm.close()
