"""Session 54: the Gemma family (GemmaForCausalLM: Gemma 2B/7B, CodeGemma; Gemma2ForCausalLM), end to end on tiny
random models built from GemmaConfig / Gemma2Config (float32), each against the real thing: greedy tokens and
logprobs equal transformers' (GQA and MHA, tied and untied head, head_dim 256 and head_dim apart from hidden / heads),
Gemma 2's soft-capped attention and logits and its sliding window (the context capped there), the GPU code path
(Triton interpreted) equal to the CPU path, the kernels' Gemma variants (norm by 1 + w, GeGLU, soft-capped attention
in the paged prefill/mixed and decode kernels), GPTQ checkpoints from `infer quantize` and GPTQModel equal to
GPTQModel's own load, peft adapters equal to peft (alone and mixed), lora-validate, serve, warmup, the built-in
tiny-gemma and tiny-gemma2; what infer cannot run refused up front."""

from __future__ import annotations

import pytest
import torch


def test_kernels_gemma_variants_equal_the_reference():
    """The Triton kernels (interpreted) of Gemma's ops equal their references, which equal transformers' math:
    rms_norm by 1 + w (with and without a residual), gelu_tanh_and_mul, and paged attention (a prefill, a chunk
    after a context, decodes: the unified and decode kernels) and decode_attention with soft-capped scores."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.kernels import attention, fused, reference
    g = torch.Generator().manual_seed(0)
    x, w, r = torch.randn(5, 64, generator=g), torch.randn(64, generator=g), torch.randn(5, 64, generator=g)
    h = (x + r).float()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)
    assert torch.allclose(reference.rms_norm(x, w, 1e-6, r, unit_offset=True)[0], want, atol=1e-6)
    assert torch.allclose(fused.rms_norm(x, w, 1e-6, r, unit_offset=True)[0], want, atol=1e-5)
    assert torch.allclose(fused.rms_norm(x + r, w, 1e-6, unit_offset=True), want, atol=1e-5)
    gu = torch.randn(7, 96, generator=g) * 3
    act = torch.nn.functional.gelu(gu[:, :48], approximate="tanh") * gu[:, 48:]
    assert torch.allclose(reference.gelu_tanh_and_mul(gu), act)
    assert torch.allclose(fused.gelu_tanh_and_mul(gu), act, atol=1e-5)
    hq, hk, d, bs = 4, 2, 32, 4
    kc, vc = torch.randn(32, bs, hk, d, generator=g), torch.randn(32, bs, hk, d, generator=g)
    tables = torch.randperm(32, generator=g)[:24].view(3, 8).int()
    lens, qsl = torch.tensor([13, 7, 20], dtype=torch.int32), torch.tensor([0, 13, 14, 19], dtype=torch.int32)
    q = torch.randn(19, hq, d, generator=g) * 2

    def naive(b, rows, cap):  # transformers' eager attention with softcap, of sequence b's last `rows` queries
        n = int(lens[b])
        k = kc[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(2, 1)
        v = vc[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", rows, k) * 0.3
        s = torch.tanh(s / cap) * cap
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril()[n - rows.shape[0]:], float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    for kernel in (reference.paged_attention, attention.paged_attention):
        out = kernel(q, kc, vc, tables, lens, qsl, 0.3, 13, softcap=5.0)
        for b in range(3):
            rows = slice(int(qsl[b]), int(qsl[b + 1]))
            assert torch.allclose(out[rows], naive(b, q[rows], 5.0), atol=1e-5), (kernel.__module__, b)
        dec = kernel(q[:3].contiguous(), kc, vc, tables, lens, torch.arange(4, dtype=torch.int32), 0.3, 1,
                     softcap=5.0)
        for b in range(3):
            assert torch.allclose(dec[b:b + 1], naive(b, q[b:b + 1], 5.0), atol=1e-5), (kernel.__module__, b)
    pos = lens.long() - 1
    qq, kk, vv = (torch.randn(3, n * d, generator=g) for n in (hq, hk, hk))
    cos_sin = torch.randn(64, d, generator=g)
    slots = tables[torch.arange(3), pos // bs].long() * bs + pos % bs
    want = reference.decode_attention(pos, qq, kk, vv, cos_sin, d, kc.clone(), vc.clone(), slots, tables, lens,
                                      torch.arange(4, dtype=torch.int32), 0.3, softcap=5.0)
    plain = reference.decode_attention(pos, qq, kk, vv, cos_sin, d, kc.clone(), vc.clone(), slots, tables, lens,
                                       torch.arange(4, dtype=torch.int32), 0.3)
    assert not torch.allclose(want, plain, atol=1e-2)
    for parts in (1, 2):
        got = attention.decode_attention(pos, qq, kk, vv, cos_sin, d, kc.clone(), vc.clone(), slots, tables, lens,
                                         torch.arange(4, dtype=torch.int32), 0.3, softcap=5.0, parts=parts)
        assert torch.allclose(got, want, atol=1e-5), parts
