"""Session 59 review of the new families (Granite, OLMo 2, OLMo 3, GLM-4): what the tiny float32 tests of
test_probes_session59_families.py do not reach. OLMo 2's and 3's RMSNorm weights the normed row in float32 and rounds
once (transformers' Olmo2RMSNorm, Olmo3RMSNorm), where Llama's rounds the normed row first: in bfloat16 and float16
infer's norms give transformers' bits, on the CPU path and through the Triton kernel."""

from __future__ import annotations

import pytest
import torch

from infer import LLM

from test_probes_session59_families import build


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
# the Triton kernel interpreted in float16 only: the interpreter truncates float32 to bfloat16 (a GPU rounds it)
@pytest.mark.parametrize("dtype,triton", [("bfloat16", False), ("float16", False), ("float16", True)])
def test_olmo_norms_in_16_bits_equal_transformers_bits(tmp_path, monkeypatch, family, dtype, triton):
    """Every norm of an OLMo layer (q and k over their whole projections, after the attention, after the MLP) and
    the final norm, on 16-bit rows: transformers' 16-bit module's output, bit for bit."""
    if triton and torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    dt = getattr(torch, dtype)
    hf = build(tmp_path, family, num_hidden_layers=1).to(dt)
    if triton:
        from infer import kernels
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    with LLM(str(tmp_path), block_size=4, dtype=dtype) as llm:
        model = llm.engine.runner.model
        ours, theirs = model.layers[0], hf.model.layers[0]
        pairs = [(ours.self_attn.q_norm, theirs.self_attn.q_norm), (ours.self_attn.k_norm, theirs.self_attn.k_norm),
                 (ours.post_attention_layernorm, theirs.post_attention_layernorm),
                 (ours.post_feedforward_layernorm, theirs.post_feedforward_layernorm), (model.norm, hf.model.norm)]
        g = torch.Generator().manual_seed(0)
        for i, (a, b) in enumerate(pairs):
            assert torch.equal(a.weight, b.weight), i
            x = (torch.randn(9, a.weight.shape[0], generator=g) * 3).to(dt)
            with torch.no_grad():
                want = b(x)
            got = a(x)
            assert got.dtype == want.dtype and torch.equal(got, want), (i, (got.float() - want.float()).abs().max())
