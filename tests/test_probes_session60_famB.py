"""Session 60 (famB): Cohere's Command R and R+ (CohereForCausalLM: one LayerNorm a layer whose output the attention
and the MLP both read, the logits scaled by logit_scale, a rotary of interleaved pairs, R+'s q and k LayerNorms per
head) and Command R7B and A (Cohere2ForCausalLM: sliding windows on 3 layers of 4, no rotary on the full layers), LG's
EXAONE 4 (Exaone4ForCausalLM: OLMo 2's post-norms, q and k normed per head, sliding windows and NoPE full layers as
Cohere 2's where sliding_window is set) and BigCode's StarCoder2 (Starcoder2ForCausalLM: LayerNorms with biases,
biases everywhere, a gelu MLP c_fc/c_proj without gate, a sliding window; LoRA on c_fc and c_proj too), end to end on
tiny random models built from their configs (float32), each against the real thing: greedy tokens and logprobs equal
transformers' (GQA and MHA, biases, tied and untied heads), the GPU code path (Triton interpreted, emulated CUDA
graphs and piecewise graphs), chunked prefill and prefix caching; GPTQ checkpoints from `infer quantize` equal to
GPTQModel's own load (and convert); peft adapters equal to peft (alone and mixed, on the CPU and through the
kernels); serve, warmup --estimate, run, bench, the built-in tiny-cohere, tiny-cohere2, tiny-exaone4 and
tiny-starcoder2; what their configs ask that infer cannot do refused up front."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.errors import UnsupportedModelError

from helpers import (builtin_model_tests, check_chunked_prefill_and_prefix_caching, family_builder, family_small_config,
                     greedy_and_logprobs_test, greedy_each, interpreted_module, random_prompts)
from lora_helpers import (check_lora_validate_ok_and_non_linear_regexes,  # noqa: F401 (its tests)
                          check_mixed_adapters_gpu_path_equal_peft, family_base_and_adapters,
                          test_adapter_without_target_modules_is_refused_as_peft_does,
                          test_peft_adapters_equal_peft_alone_and_mixed, test_serve_completions)
from quant_helpers import (check_gpu_path_interpreted, check_infer_quantize_and_convert,
                           check_int4_kernels_with_mixed_adapters, needs_gptqmodel)

SMALL = family_small_config(num_hidden_layers=2)
SL, FULL = "sliding_attention", "full_attention"
FAMILIES = {"cohere": ("cohere", "CohereForCausalLM", dict(logit_scale=0.5)),
            # 3 sliding layers (a window of 8: prompts pass it) and a full one, transformers' default pattern
            "cohere2": ("cohere2", "Cohere2ForCausalLM", dict(num_hidden_layers=4, sliding_window=8,
                                                              logit_scale=0.5)),
            # likewise (EXAONE-4.0-32B's pattern); the full layer without rotary
            "exaone4": ("exaone4", "Exaone4ForCausalLM", dict(num_hidden_layers=4, sliding_window=8)),
            # a window of 8 on every layer
            "starcoder2": ("starcoder2", "Starcoder2ForCausalLM", dict(sliding_window=8))}
COHERES = ("cohere", "cohere2")


@pytest.fixture(scope="module")
def fused():
    yield from interpreted_module("infer.kernels.fused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [0, 3])
def test_layer_norm_kernel_equals_cohere_layer_norm(fused, dtype, heads):
    """The LayerNorm (reference and Triton) equals transformers' CohereLayerNorm bit for bit: over a whole row of 80
    (a width short of its block), and per head (Command R+'s q and k norms: [t, 3 * 24] by weights [3, 24]); with a
    bias, the reference's and the kernel's agree and equal nn.functional.layer_norm in float32."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from infer.kernels import reference
    g = torch.Generator().manual_seed(0)
    shape = (heads, 24) if heads else (80,)
    x = (torch.randn(5, heads * 24 if heads else 80, generator=g) * 3 + 1).to(dtype)
    hf = CohereLayerNorm(shape, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape, generator=g) + 1)
        hf.to(dtype)  # (its weights in the model's dtype, as a loaded model's)
        want = hf(x.reshape(5, *shape[:-1], shape[-1])).reshape(x.shape)
    w = hf.weight.detach().to(dtype)
    assert torch.equal(reference.layer_norm(x, w, 1e-5), want)
    torch.testing.assert_close(fused.layer_norm(x, w, 1e-5), want)  # (float32 sums in another order: to a rounding)
    bias = torch.randn(shape, generator=g).to(dtype)
    ref = reference.layer_norm(x, w, 1e-5, bias)
    torch.testing.assert_close(fused.layer_norm(x, w, 1e-5, bias), ref)
    if dtype == torch.float32 and not heads:
        torch.testing.assert_close(ref, torch.nn.functional.layer_norm(x, (80,), w, bias, 1e-5))


build = family_builder(SMALL, FAMILIES)


CONFIGS = {
    "cohere-gqa-bias": ("cohere", dict(attention_bias=True)),
    "cohere-mha-tied-qk-norm": ("cohere", dict(num_key_value_heads=4, tie_word_embeddings=True, use_qk_norm=True,
                                               num_hidden_layers=3)),
    "cohere-gqa-qk-norm-bias": ("cohere", dict(use_qk_norm=True, attention_bias=True)),
    "cohere2-gqa-window8": ("cohere2", dict()),
    "cohere2-mha-tied-bias-alternating": ("cohere2", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                          attention_bias=True, layer_types=[SL, FULL, SL, FULL])),
    "exaone4-gqa-window8": ("exaone4", dict()),
    # EXAONE-4.0-1.2B's: no sliding window, every layer full and rotated
    "exaone4-mha-tied-no-window": ("exaone4", dict(num_key_value_heads=4, tie_word_embeddings=True, sliding_window=None,
                                                   num_hidden_layers=3, layer_types=[FULL] * 3)),
    "starcoder2-gqa-bias-window8": ("starcoder2", dict()),
    "starcoder2-mha-tied-no-bias-no-window": ("starcoder2", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                                 use_bias=False, sliding_window=None)),
}


def _check_model(model, hf, family: str, config: dict) -> None:
    """infer's model of a config of CONFIGS as it loaded it (test_greedy_tokens_and_logprobs_equal_transformers;
    hf: transformers' model)."""
    attn = model.layers[0].self_attn
    assert attn.rope_interleaved == (family in COHERES)
    if family in COHERES:
        assert model.logit_scale == 0.5
    if config.get("use_qk_norm"):  # a LayerNorm per head, each its own weights
        assert attn.q_norm.weight.shape == (attn.num_heads, attn.head_dim)
    if family == "exaone4":  # RMSNorm per head
        assert attn.q_norm.weight.shape == (attn.head_dim,)
    if family == "starcoder2":  # every layer's window, the norms' and projections' biases as use_bias says
        window, bias = hf.config.sliding_window or 0, hf.config.use_bias
        assert {layer.self_attn.window for layer in model.layers} == {window}
        assert (model.norm.bias is not None) and (attn.qkv_proj.bias is not None) == bias
    elif family != "cohere":  # each layer's window as its layer type says; the full layers without rotary where
        types, window = hf.config.layer_types, hf.config.sliding_window  # sliding_window is set
        assert [layer.self_attn.window for layer in model.layers] == [8 if t == SL else 0 for t in types]
        assert [model._rope(i) is model.nope_cos_sin for i in range(len(types))] == \
            [t == FULL and window is not None for t in types]


test_greedy_tokens_and_logprobs_equal_transformers = greedy_and_logprobs_test(CONFIGS, build, _check_model)


@pytest.mark.parametrize("family", ["cohere2", "exaone4"])
def test_logit_scale_and_nope_change_transformers_tokens(tmp_path, family):
    """The checks above mean something: the same weights with logit_scale 1 give other logits, and a Cohere 2 or
    EXAONE 4 whose full layer rotates (no NoPE: every layer sliding over a window past the prompts) other logits,
    in transformers."""
    prompts = random_prompts(512, (30,), seed=3)
    with torch.no_grad():
        ids = torch.tensor(prompts)
        a = build(tmp_path / "a", "cohere")(ids).logits
        assert not torch.allclose(a, build(tmp_path / "b", "cohere", logit_scale=1.0)(ids).logits)
        want = build(tmp_path / "c", family, sliding_window=64)(ids).logits
        rotated = build(tmp_path / "d", family, sliding_window=64, layer_types=[SL] * 4)
        assert not torch.allclose(want, rotated(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, family):
    """Steps of 12 tokens (prompts cut into chunks) and a prompt whose first blocks another prompt cached:
    transformers' tokens."""
    hf = build(tmp_path, family, seed=1, use_qk_norm=family == "cohere")
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, family):
    """Every op through its Triton kernel (interpreted on CPU): the LayerNorm kernel (per head for R+'s q and k),
    the interleaved rotary, Cohere 2's sliding layers and its full layers' angle-0 table in the prefill and decode
    attention kernels; decodes through emulated CUDA graphs, the others through emulated piecewise graphs (whose
    start checks the family's piece() against its forward): transformers' tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    hf = build(tmp_path, family, attention_bias=True, use_qk_norm=family == "cohere")
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    assert check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0


def test_what_infer_cannot_run_of_these_families_is_refused(tmp_path):
    """Another activation than silu (StarCoder2: than gelu_pytorch_tanh), a Cohere 2 layer type infer has no attention
    for, or a neighbour of the families infer does not run (Cohere 2's mixture of experts, the first StarCoder) is
    refused when the config is read (`infer warmup
    --estimate` too), naming what it is."""
    build(tmp_path / "a", "cohere", num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu' is not supported"):
        LLM(str(tmp_path / "a"))
    build(tmp_path / "b", "cohere2", num_hidden_layers=2, layer_types=[SL, FULL])
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    config["layer_types"] = [SL, "chunked_attention"]
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path / "b"), "--estimate"])
    assert res.exit_code != 0 and "cohere2 layer_types ['chunked_attention'] are not supported" in res.output
    config.update(model_type="cohere2_moe", architectures=["Cohere2MoeForCausalLM"], layer_types=[SL, FULL])
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path / "b"), "--estimate"])
    assert res.exit_code != 0 and "is Cohere 2's mixture of experts" in res.output
    assert "infer runs Cohere's dense Command R" in res.output
    config.update(model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"])
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path / "b"), "--estimate"])
    assert res.exit_code != 0 and "is the first StarCoder and SantaCoder" in res.output and "StarCoder2" in res.output
    build(tmp_path / "c", "starcoder2", num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu' is not supported for starcoder2"):
        LLM(str(tmp_path / "c"))


# ------------------------------------------------------------------------------------------------------- GPTQ
@needs_gptqmodel
@pytest.mark.parametrize("family", FAMILIES)
def test_infer_quantize_writes_a_gptq_checkpoint_equal_to_gptqmodels_load_and_convert_takes_it(tmp_path, family):
    """GPTQModel quantizes Cohere and Cohere 2 by its Llama definition, EXAONE 4 and StarCoder2 by their own: infer's
    tokens of the checkpoint equal GPTQModel's load of it, and `infer convert` keeps them."""
    build(tmp_path / "f", family)
    check_infer_quantize_and_convert(tmp_path / "f", tmp_path, mlp="c_fc" if family == "starcoder2" else "gate_proj")


# ------------------------------------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_lora(request, tmp_path_factory):
    """(family, base folder, transformers' model, {name: adapter}) of FAMILY_ADAPTERS on a base of the family (Cohere's
    with q and k LayerNorms; StarCoder2's MLP modules c_fc and c_proj for gate/up and down: base_targets)."""
    return family_base_and_adapters(tmp_path_factory, build, request.param, attention_bias=True,
                                    use_qk_norm=request.param == "cohere")


def test_gpu_code_path_with_mixed_adapters_interpreted_equals_peft(family_lora, monkeypatch):
    """Adapters beside a base-only row through the Triton kernels (interpreted) and emulated decode graphs: the o
    and down deltas added in their layers (the residual adds those outputs, no norm after them to leave them to),
    the qkv delta before the q/k norms and the interleaved rotary: peft's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    family, base, hf, paths = family_lora

    def check_model(model):
        for layer in model.layers:
            for proj in (layer.self_attn.o_proj, getattr(layer.mlp, "c_proj", None) or layer.mlp.down_proj):
                if family in (*COHERES, "starcoder2"):
                    assert proj.lora_consumer is None
                else:  # EXAONE 4's: its residual-free post-norms (Llama's RMSNorm)
                    assert not proj.lora_consumer.residual and proj.lora_consumer.unit == {}
            # (StarCoder2's qkv delta left to decode_attention: no q/k norm, no interleaved pairs)
            assert (layer.self_attn.qkv_proj.lora_consumer is None) == (family != "starcoder2")
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, check_model)


@needs_gptqmodel
def test_int4_kernels_with_mixed_adapters_equal_the_cpu_path(family_lora, tmp_path, monkeypatch):
    """A GPTQ checkpoint of the base with the adapters mixed: the int4 kernels (interpreted), their silu in gate_up's
    epilogue, give the CPU path's tokens."""
    family, base, _, paths = family_lora
    check_int4_kernels_with_mixed_adapters(base, paths, tmp_path, monkeypatch, ["all8", None, "qv4"],
                                           family != "starcoder2")  # (StarCoder2: no gate_up, its gelu after c_fc)


def test_lora_validate_accepts_an_adapter_and_refuses_a_regex_selecting_a_norm(family_lora, tmp_path):
    """lora-validate accepts an adapter of every projection; a target_modules regex that selects a q_norm, Cohere's
    one input_layernorm a layer, EXAONE 4's post_attention_layernorm or StarCoder2's mlp.act (not Linear layers: peft
    refuses such an adapter) is refused; one that names a norm the family's layers lack selects nothing more and is
    accepted."""
    family, base, _, paths = family_lora
    cases = [(r".*(v_proj|input_layernorm)", "input_layernorm"), (r".*(v_proj|post_attention_layernorm)", None)]
    if family == "exaone4":  # OLMo 2's norms: after the attention and the MLP only
        cases = [(r".*(v_proj|input_layernorm)", None), (r".*(v_proj|post_attention_layernorm)",
                                                         "post_attention_layernorm")]
    if family == "starcoder2":  # Llama's two norms a layer, and the MLP's activation module act
        cases = [(r".*(v_proj|input_layernorm)", "input_layernorm"), (r".*(c_fc|mlp\.act)", "mlp.act"),
                 (r".*(v_proj|post_attention_layernorm)", "post_attention_layernorm")]
    if family not in ("cohere2", "starcoder2"):
        cases.append((r".*\.(q_proj|q_norm)", "self_attn.q_norm"))
    check_lora_validate_ok_and_non_linear_regexes(base, paths, tmp_path / "a", cases)


def test_starcoder2_lora_target_modules_are_its_own():
    """--lora-target-modules on a StarCoder2 takes its MLP's c_fc and c_proj (their adapter slots), and refuses
    Llama's gate_proj, which it has no layer of, naming the ones it has."""
    from transformers import Starcoder2Config

    from infer.errors import ConfigError
    from infer.lora.targets import check_target_modules, model_target_names
    cfg = Starcoder2Config(**SMALL, **FAMILIES["starcoder2"][2])
    assert model_target_names(cfg)[-2:] == ["c_fc", "c_proj"] and "down_proj" not in model_target_names(cfg)
    assert check_target_modules(["c_proj", "o_proj"], cfg) == {"c_proj", "o_proj"}
    with pytest.raises(ConfigError, match="gate_proj: no layer of this model .*c_fc, c_proj"):
        check_target_modules(["gate_proj", "c_fc"], cfg)


# ---------------------------------------------------------------------------------------- serve, warmup, tiny
BUILTIN = {"tiny-cohere": "CohereForCausalLM", "tiny-cohere2": "Cohere2ForCausalLM",
           "tiny-exaone4": "Exaone4ForCausalLM", "tiny-starcoder2": "Starcoder2ForCausalLM"}
test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests(BUILTIN, ("tiny-cohere2", "tiny-exaone4"))
