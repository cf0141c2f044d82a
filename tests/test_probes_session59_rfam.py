"""Session 59 review of the new families (Granite, OLMo 2, OLMo 3, GLM-4): what the tiny float32 tests of
test_probes_session59_families.py do not reach. OLMo 2's and 3's RMSNorm weights the normed row in float32 and rounds
once (transformers' Olmo2RMSNorm, Olmo3RMSNorm), where Llama's rounds the normed row first: in bfloat16 and float16
infer's norms give transformers' bits, on the CPU path and through the Triton kernel. The first GLM-4
(GlmForCausalLM, model_type glm: glm-4-9b-chat-hf), GLM-4-0414's attention and MLP in Llama's layer of two norms,
runs (transformers' tokens and logprobs, the GPU code path, peft adapters); GraniteMoe, GraniteMoeHybrid, the first
OLMo, OLMoE and GLM-4.5 were refused naming what they are (session 62 runs OLMoE and GLM-4.5). The loops of GLM-4
(and Gemma 2's, which it shares) and OLMo no longer keep the old residual and the attention's output alive while
the MLP runs (warmup --estimate's activations were under the measured peak)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.lora.adapter import base_targets

from helpers import check_equal_transformers, greedy_each, norms_and_biases_shifted, random_prompts, save_random_model
from lora_helpers import FAMILY_ADAPTERS, base_and_adapters, check_lora_validate_ok, check_mixed_adapters_equal_peft
from quant_helpers import check_gpu_path_interpreted, gptqmodel_greedy, needs_gptqmodel, split_gate_up
from test_probes_session59_families import SMALL, build


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


NEAR = {"granitemoe_swa": ("GraniteMoeSWAForCausalLM", "with sliding-window layers", "GraniteForCausalLM"),
        "olmo": ("OlmoForCausalLM", "LayerNorms have no weights", "Olmo2ForCausalLM, Olmo3ForCausalLM")}


@pytest.mark.parametrize("model_type", NEAR)
def test_the_families_neighbours_are_refused_naming_what_they_are_and_what_infer_runs(tmp_path, model_type):
    """GraniteMoe SWA and the first OLMo: `infer warmup --estimate`
    refuses each saying what the model is and which of its family infer runs."""
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


# ----------------------------------------------------------------------------- the first GLM-4 (GlmForCausalLM)
GLM_CONFIGS = {"glm-gqa-qkv-bias": dict(),
               "glm-mha-tied-no-bias-wide-heads-prf0.75": dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                               attention_bias=False, head_dim=32,
                                                               partial_rotary_factor=0.75)}


def build_glm(folder, seed: int = 0, **config):
    """A random GlmForCausalLM folder (float32, head_dim 16: half of each head rotated, GLM's default factor 0.5);
    returns transformers' model."""
    return save_random_model(folder, "glm", "GlmForCausalLM", {**SMALL, "head_dim": 16, **config}, seed,
                             norms_and_biases_shifted)


@pytest.mark.parametrize("name", GLM_CONFIGS)
def test_glm_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """glm-4-9b-chat-hf's architecture (q/k/v biases, none on o, interleaved partial rotary, gate|up fused, Llama's
    two norms a layer): prompts of 5, 13 and 30 tokens, 10 generated, batched: transformers' tokens, logprobs within
    1e-4."""
    hf = build_glm(tmp_path, **GLM_CONFIGS[name])
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        attn = llm.engine.runner.model.layers[0].self_attn
        assert attn.rope_interleaved and attn.rot_dim == int(attn.head_dim * hf.config.rope_parameters.get(
            "partial_rotary_factor", 0.5))
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)


def test_glm_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch):
    """Every op through its Triton kernel (interpreted), decodes through emulated CUDA graphs, the others through
    emulated piecewise graphs: transformers' tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    hf = build_glm(tmp_path)
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)


def test_glm_peft_adapters_equal_peft_alone_and_mixed_and_lora_validate_accepts_them(tmp_path):
    """Adapters of every projection (gate_up_proj where they name gate_proj or up_proj: the module peft adapts on
    GLM) and of some, mixed with a base-only row: peft's tokens; lora-validate accepts them."""
    build_glm(tmp_path / "base")
    adapters = {name: {**kw, "target_modules": base_targets("glm", kw["target_modules"])}
                for name, kw in FAMILY_ADAPTERS.items()}
    assert "gate_up_proj" in adapters["all8"]["target_modules"]
    base, hf, paths = base_and_adapters(tmp_path, adapters)
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (5, 20, 8), seed=6), ["all8", None, "qv4"])
    check_lora_validate_ok(base, paths["all8"])


@needs_gptqmodel
def test_glm_infer_quantize_writes_gate_up_fused_and_transformers_loads_it_alike(tmp_path):
    """`infer quantize` of a GLM base stores gate|up as the one mlp.gate_up_proj that transformers loads: infer's
    tokens equal transformers' load of the checkpoint, and GPTQModel's of its split layout."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner
    from infer.cli.main import app
    from test_gptq_engine import hf_gptq_greedy
    build_glm(tmp_path / "f")
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.gate_up_proj.qweight" in tensors
    assert "model.layers.0.mlp.gate_proj.qweight" not in tensors
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]
    assert got == hf_gptq_greedy(out, prompts, 8)
    assert got == gptqmodel_greedy(split_gate_up(out, tmp_path / "split"), prompts, 8)
