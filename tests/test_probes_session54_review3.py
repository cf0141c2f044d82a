"""Session 54, third review of the Gemma family: config variants real checkpoints and transformers allow, each
against transformers on tiny random models (tests/test_probes_session54_gemma.py builds them)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams

from helpers import random_prompts
from test_probes_session54_gemma import GEMMA2, build, hf_greedy


@pytest.mark.parametrize("model_type", ["gemma", "gemma2"])
def test_gemma_attention_bias_loads_its_biases_as_transformers(tmp_path, model_type):
    """transformers' Gemma and Gemma 2 give q, k, v and o biases where config.json says attention_bias: true, as
    Llama's do; infer refused the checkpoint ('unexpected bias ... config.json says this layer has no bias')."""
    hf = build(tmp_path, model_type, attention_bias=True, **(GEMMA2 if model_type == "gemma2" else dict(head_dim=16)))
    assert any(n.endswith("o_proj.bias") for n, _ in hf.named_parameters())
    prompts = random_prompts(512, (5, 13), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 6)
    with torch.no_grad():
        logp = hf(torch.tensor([prompts[0] + outs[0].token_ids])).logits[0, len(prompts[0]) - 1:-1].log_softmax(-1)
    for i, rec in enumerate(outs[0].logprobs):
        assert abs(rec["logprob"] - float(logp[i, rec["token_id"]])) < 1e-4


def test_cpu_soft_capped_attention_never_copies_k_and_v_per_query_head():
    """The CPU path's soft-capped attention (Gemma 2) took a KV head's group of query heads over its keys by a
    broadcasting matmul ([Hk, group, 1, D] x [Hk, 1, D, L]), which torch runs by expanding K and V into a float
    copy for each query head of the group: a decode batch at a long context held group x its gathered K and V
    (tiny-gemma2's `infer warmup --max-length 4096 --concurrency 16` measured 2.6 x the activation estimate). No op
    of a decode batch or a prefill now makes a tensor larger than the gathered K (the result is unchanged)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from infer.kernels import reference

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.most = max(self.most, t.numel())
            return out

    g = torch.Generator().manual_seed(0)
    hq, hk, d, bs, lens = 8, 2, 16, 4, [40, 33, 40]
    kc, vc = torch.randn(32, bs, hk, d, generator=g), torch.randn(32, bs, hk, d, generator=g)
    tables = torch.randperm(32, generator=g)[:30].view(3, 10).int()
    q = torch.randn(3, hq, d, generator=g)
    seq_lens, starts = torch.tensor(lens, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    with Largest() as seen:
        got = reference.paged_attention(q, kc, vc, tables, seq_lens, starts, 0.3, 1, softcap=2.0)
    assert seen.most <= 3 * 40 * hk * d  # the batch's gathered K: 3 rows of 40 keys
    for b, n in enumerate(lens):  # transformers' eager soft-capped attention of each sequence's last query
        k = kc[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(hq // hk, 1)
        v = vc[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(hq // hk, 1)
        s = torch.tanh(torch.einsum("hd,khd->hk", q[b], k) * 0.3 / 2.0) * 2.0
        assert torch.allclose(got[b], torch.einsum("hk,khd->hd", s.softmax(-1), v), atol=1e-5)
    kk, vv, qq = torch.randn(50, hk, d, generator=g), torch.randn(50, hk, d, generator=g), torch.randn(50, hq, d)
    with Largest() as seen:
        reference._attend(qq, kk, vv, 0.3, 0, softcap=2.0)
    assert seen.most <= max(50 * hk * d, 50 * 50 * hq)  # K, or the scores of every head
