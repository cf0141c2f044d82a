"""Session 59: Granite (GraniteForCausalLM: Llama with embedding_multiplier, residual_multiplier, attention_multiplier
as the attention's scale, logits_scaling), OLMo 2 (Olmo2ForCausalLM: norms after the attention and the MLP, none
before, q and k normed over their whole projections) and OLMo 3 (Olmo3ForCausalLM: OLMo 2's layers, sliding windows
on the layers layer_types names, a rope per layer type) and GLM-4 (Glm4ForCausalLM: four norms a layer, gate|up
stored fused, a partial rotary of interleaved pairs), end to end on tiny random models built from their configs
(float32), each against the real thing: greedy tokens and logprobs equal transformers' (GQA and MHA, biases, tied
heads), the GPU code path (Triton interpreted, emulated CUDA graphs and piecewise graphs), chunked prefill and prefix
caching; GPTQ checkpoints from `infer quantize` equal to GPTQModel's own load (and convert); peft adapters equal to
peft (alone and mixed, on the CPU and through the kernels); lora-validate, serve, warmup --estimate, run, bench, the
built-in tiny-granite, tiny-olmo2, tiny-olmo3 and tiny-glm4; what their configs ask that infer cannot do refused
up front."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner
from transformers import AutoConfig

from infer import LLM
from infer.cli.main import app
from infer.errors import UnsupportedModelError

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_greedy_and_logprobs_equal_transformers, check_run_and_bench_builtin,
                     check_served_completion_equals_transformers, family_builder, greedy_each, random_prompts)
from lora_helpers import (check_lora_validate_ok, check_mixed_adapters_equal_peft,
                          check_mixed_adapters_gpu_path_equal_peft, check_no_target_modules_refused_as_peft,
                          family_base_and_adapters)
from quant_helpers import (check_gpu_path_interpreted, check_infer_quantize_and_convert,
                           check_int4_kernels_with_mixed_adapters, needs_gptqmodel, split_gate_up)

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
# Granite-3's shape of scalars (its embeddings by 12, residual adds by 0.22), an attention scale other than
# head_dim ** -0.5 (0.25 here), the logits divided by 4
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.07, logits_scaling=4.0)
FAMILIES = {"granite": ("granite", "GraniteForCausalLM", GRANITE), "olmo2": ("olmo2", "Olmo2ForCausalLM", {}),
            # 3 sliding layers (a window of 8: prompts pass it) and a full one, transformers' default pattern
            "olmo3": ("olmo3", "Olmo3ForCausalLM", dict(num_hidden_layers=4, sliding_window=8)),
            # head_dim set (GLM-4's config defaults to 128); half of each head rotated (partial_rotary_factor 0.5)
            "glm4": ("glm4", "Glm4ForCausalLM", dict(head_dim=16))}
SL, FULL = "sliding_attention", "full_attention"
# OLMo-3's long-context rope: yarn on the full layers only
YARN = {FULL: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 5e5,
               "attention_factor": 1.2, "beta_fast": 32, "beta_slow": 1},
        SL: {"rope_type": "default", "rope_theta": 5e5}}


build = family_builder(SMALL, FAMILIES)


CONFIGS = {
    "granite-gqa-bias": ("granite", dict(attention_bias=True, mlp_bias=True)),
    "granite-mha-tied": ("granite", dict(num_key_value_heads=4, tie_word_embeddings=True, logits_scaling=0.5)),
    "olmo2-gqa": ("olmo2", dict()),
    "olmo2-mha-tied-bias": ("olmo2", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                          num_hidden_layers=3)),
    "olmo3-gqa-window8": ("olmo3", dict()),
    "olmo3-mha-yarn-alternating": ("olmo3", dict(num_key_value_heads=4, rope_parameters=YARN, attention_bias=True,
                                                 layer_types=[SL, FULL, SL, FULL])),
    "glm4-gqa-qkv-bias": ("glm4", dict()),
    "glm4-mha-tied-no-bias-wide-heads": ("glm4", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                      attention_bias=False, head_dim=32)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4."""
    family, config = CONFIGS[name]
    hf = build(tmp_path, family, **config)

    def check_model(model):
        attn = model.layers[0].self_attn
        if family == "granite":
            assert attn.scale == 0.07
        elif family == "glm4":  # half of each head rotated, the pairs interleaved
            assert attn.rot_dim == attn.head_dim // 2 and attn.rope_interleaved
        else:  # OLMo's q and k norms: over the whole projection
            assert attn.q_norm.weight.shape == (attn.q_size,) and attn.k_norm.weight.shape == (attn.kv_size,)
        if family == "olmo3":  # each layer's window and rope table as its layer type says
            types = hf.config.layer_types
            assert [layer.self_attn.window for layer in model.layers] == [8 if t == SL else 0 for t in types]
            assert [model._rope(i) is model.local_cos_sin for i in range(len(types))] == [t == SL for t in types]
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, name, check_model)


def test_each_granite_scalar_changes_its_tokens(tmp_path):
    """The checks above mean something: the same weights with any one of Granite's four scalars at 1 give other
    tokens (or logprobs, for logits_scaling, which keeps the greedy argmax) in transformers."""
    prompts = random_prompts(512, (30,), seed=3)
    hf = build(tmp_path / "a", "granite")
    want = greedy_each(hf, prompts, 8)
    for i, field in enumerate(("embedding_multiplier", "residual_multiplier", "attention_multiplier")):
        assert greedy_each(build(tmp_path / str(i), "granite", **{field: 1.0}), prompts, 8) != want, field
    with torch.no_grad():
        ids = torch.tensor(prompts)
        assert not torch.allclose(hf(ids).logits, build(tmp_path / "s", "granite", logits_scaling=1.0)(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, family):
    """Steps of 12 tokens (prompts cut into chunks) and a prompt whose first blocks another prompt cached:
    transformers' tokens."""
    hf = build(tmp_path, family, seed=1)
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, family):
    """Every op through its Triton kernel (interpreted on CPU): Granite's scale in the prefill and decode attention
    kernels, OLMo's whole-projection q/k norms and residual-free post-norms, OLMo 3's sliding layers and their own
    rope table; decodes through emulated CUDA graphs, the others through emulated piecewise graphs (whose start checks
    the family's piece() against its forward): transformers' tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    hf = build(tmp_path, family, attention_bias=True)
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    assert check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0


def test_what_infer_cannot_run_of_these_families_is_refused(tmp_path):
    """Another activation than silu, or a rope type infer has no table for, is refused when the config is read
    (`infer warmup --estimate` too), naming the field."""
    build(tmp_path / "a", "olmo2", num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu' is not supported"):
        LLM(str(tmp_path / "a"))
    build(tmp_path / "b", "granite", num_hidden_layers=1)
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 10000.0}
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path / "b"), "--estimate"])
    assert res.exit_code != 0 and "rope type 'mrope' is not supported" in res.output


# ------------------------------------------------------------------------------------------------------- GPTQ
@needs_gptqmodel
@pytest.mark.parametrize("family", FAMILIES)
def test_infer_quantize_writes_a_gptq_checkpoint_equal_to_gptqmodels_load_and_convert_takes_it(tmp_path, family):
    """GLM-4's checkpoint stores gate|up as the one mlp.gate_up_proj that transformers and vLLM load (GPTQModel
    quantizes them apart): infer's tokens equal transformers' load of it and GPTQModel's of its split layout."""
    build(tmp_path / "f", family)
    if family != "glm4":
        check_infer_quantize_and_convert(tmp_path / "f", tmp_path)
        return
    from test_gptq_engine import hf_gptq_greedy

    def also(out, prompts, got):
        assert got == hf_gptq_greedy(out, prompts, 8)
    check_infer_quantize_and_convert(tmp_path / "f", tmp_path, mlp="gate_up_proj", also=also,
                                     gptqmodel_view=lambda out: split_gate_up(out, tmp_path / "split"))


# ------------------------------------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_lora(request, tmp_path_factory):
    """(family, base folder, transformers' model, {name: adapter}) of FAMILY_ADAPTERS on a base of the family (GLM-4's:
    gate_up_proj where they name gate_proj or up_proj, the module peft adapts there)."""
    return family_base_and_adapters(tmp_path_factory, build, request.param, attention_bias=True)


def test_peft_adapters_equal_peft_alone_and_mixed(family_lora):
    _, base, hf, paths = family_lora
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (5, 20, 8), seed=6), ["all8", None, "qv4"])


def test_gpu_code_path_with_mixed_adapters_interpreted_equals_peft(family_lora, monkeypatch):
    """Adapters beside a base-only row through the Triton kernels (interpreted) and emulated decode graphs: Granite's
    o and down deltas added in their layers (before residual_multiplier scales the outputs: never left to the norm
    after them), OLMo's qkv delta added before its q/k norms and its o and down deltas left to its residual-free
    post-norms: peft's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    family, base, hf, paths = family_lora

    def check_model(model):
        for layer in model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                if family == "granite":
                    assert proj.lora_consumer is None
                else:
                    # (OLMo's norm weights in float32: the variant the norm runs, compiled for its delta)
                    assert not proj.lora_consumer.residual
                    assert proj.lora_consumer.unit == ({"float_weight": True} if "olmo" in family else {})
            assert (layer.self_attn.qkv_proj.lora_consumer is None) == (family != "granite")
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, check_model)


@needs_gptqmodel
def test_int4_kernels_with_mixed_adapters_equal_the_cpu_path(family_lora, tmp_path, monkeypatch):
    """A GPTQ checkpoint of the base with the adapters mixed: the int4 kernels (interpreted), their silu in gate_up's
    epilogue, give the CPU path's tokens."""
    _, base, _, paths = family_lora
    check_int4_kernels_with_mixed_adapters(base, paths, tmp_path, monkeypatch, ["all8", None, "qv4"], True)


NOT_LINEAR = {"olmo2": [(r".*\.(q_proj|q_norm)", "self_attn.q_norm"),
                         (r".*(v_proj|post_feedforward_layernorm)", "post_feedforward_layernorm")],
              "glm4": [(r".*(v_proj|post_mlp_layernorm)", "post_mlp_layernorm"),
                       (r".*(v_proj|post_self_attn_layernorm)", "post_self_attn_layernorm")]}
NOT_LINEAR["olmo3"] = NOT_LINEAR["olmo2"]


def test_lora_validate_accepts_an_adapter_and_refuses_a_regex_selecting_norms(family_lora, tmp_path):
    """lora-validate accepts an adapter of every projection; a target_modules regex that selects OLMo's q_norm or
    post_feedforward_layernorm, GLM-4's post_mlp_layernorm or post_self_attn_layernorm (not Linear layers: peft
    refuses such an adapter) is refused."""
    from infer.lora.adapter import adapter_problems
    family, base, _, paths = family_lora
    check_lora_validate_ok(base, paths["all8"])
    adapter = shutil.copytree(paths["qv4"], tmp_path / "a")
    for regex, module in NOT_LINEAR.get(family, ()):
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        cfg["target_modules"] = regex
        (adapter / "adapter_config.json").write_text(json.dumps(cfg))
        problems = [p.message for p in adapter_problems("a", adapter, AutoConfig.from_pretrained(base))]
        assert any(f"selects model.layers.0.{module}, which is not a Linear layer" in m for m in problems), problems


def test_an_adapter_without_target_modules_is_refused_as_peft_refuses_it(family_lora, tmp_path):
    """peft has no default target_modules for these bases (its mapping names none of granite, olmo2, olmo3, glm4):
    PeftModel.from_pretrained refuses a config without them ("Please specify `target_modules`"), and so do infer's
    engine and lora-validate, naming the base's modules (GLM-4's gate_up_proj)."""
    from infer.lora.adapter import adapter_problems
    family, base, _, paths = family_lora
    path = check_no_target_modules_refused_as_peft(base, paths["all8"], tmp_path / "a", family)
    [problem] = adapter_problems("a", path, AutoConfig.from_pretrained(base))
    assert f"peft has no default for a {family} base" in str(problem)
    assert ("gate_up_proj" in str(problem)) == (family == "glm4")


# ---------------------------------------------------------------------------------------- serve, warmup, tiny
def test_serve_completions(family_lora):
    family, base, hf, _ = family_lora
    check_served_completion_equals_transformers(base, family, hf)


@pytest.mark.parametrize("name, arch", [("tiny-granite", "GraniteForCausalLM"), ("tiny-olmo2", "Olmo2ForCausalLM"),
                                        ("tiny-olmo3", "Olmo3ForCausalLM"), ("tiny-glm4", "Glm4ForCausalLM")])
def test_builtin_tiny_model_runs_and_warmup_sizes_it(name, arch):
    """The built-in model equals transformers and writes varied tokens; `infer warmup --estimate` counts its weights
    as the loaded engine holds them."""
    check_builtin_runs_and_warmup_sizes_it(name, arch, False)


@pytest.mark.parametrize("name", ["tiny-granite", "tiny-olmo2", "tiny-olmo3", "tiny-glm4"])
def test_infer_run_and_bench_on_the_builtin_model(tmp_path, name):
    """`infer run` writes transformers' greedy tokens of a token prompt; `infer bench` completes its requests."""
    check_run_and_bench_builtin(tmp_path, name)
