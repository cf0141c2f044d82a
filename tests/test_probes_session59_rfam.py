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


NEAR = {"granitemoe": ("GraniteMoeForCausalLM", "Granite's mixture of experts", "GraniteForCausalLM"),
        "granitemoeshared": ("GraniteMoeSharedForCausalLM", "with a shared expert", "GraniteForCausalLM"),
        "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "Mamba-2", "GraniteForCausalLM"),
        "olmo": ("OlmoForCausalLM", "LayerNorms have no weights", "Olmo2ForCausalLM, Olmo3ForCausalLM"),
        "olmoe": ("OlmoeForCausalLM", "OLMoE", "Olmo2ForCausalLM, Olmo3ForCausalLM"),
        "glm": ("GlmForCausalLM", "the first GLM-4", "Glm4ForCausalLM"),
        "glm4_moe": ("Glm4MoeForCausalLM", "GLM-4.5", "Glm4ForCausalLM")}


@pytest.mark.parametrize("model_type", NEAR)
def test_the_families_neighbours_are_refused_naming_what_they_are_and_what_infer_runs(tmp_path, model_type):
    """GraniteMoe, GraniteMoeShared, GraniteMoeHybrid, the first OLMo, OLMoE, the first GLM-4 (glm-4-9b-chat-hf) and
    GLM-4.5: `infer warmup --estimate` refuses each saying what the model is and which of its family infer runs."""
    from transformers import AutoConfig
    from typer.testing import CliRunner
    from infer.cli.main import app
    arch, what, runs = NEAR[model_type]
    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    cfg.architectures = [arch]
    cfg.save_pretrained(tmp_path)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"], env={"COLUMNS": "250"})
    assert res.exit_code != 0, res.output
    text = " ".join(res.output.split())
    assert f"(model_type '{model_type}') is" in text and what in text and "which infer does not run" in text, text
    assert "infer runs" in text and runs in text, text


@pytest.mark.parametrize("family", ["glm4", "olmo2"])
def test_the_measured_cpu_peak_of_glm4_and_olmo2_is_under_the_estimate(tmp_path, family):
    """`infer warmup`'s measured activation peak against `--estimate`'s formula, as test_probes_session55_estimate
    measures Qwen3 (its shape: 4 layers, intermediate_size 200, a step of 1,020 tokens, float32). The loops of
    GLM-4 (Gemma 2's _mlp_block) and OLMo (_layer_rest) kept the attention's output and the old residual alive in
    the caller while the MLP ran: GLM-4 measured 4.2 to 4.4 MB against the formula's 3.95 MB, OLMo 2 up to 4.0."""
    from helpers import measured_warmup
    from test_probes_session55_estimate import SHAPE
    build(tmp_path, family, **SHAPE)
    args = [str(tmp_path), "--max-length", "256", "--concurrency", "4", "--max-num-batched-tokens", "1024"]
    measured = measured_warmup(args)
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert peak <= formula <= 1.3 * peak, (formula, peak)
