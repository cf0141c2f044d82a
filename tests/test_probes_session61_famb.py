"""Session 61 (famb): Shanghai AI Lab's InternLM3 (InternLM3ForCausalLM: Llama's layers, which transformers runs as
LlamaForCausalLM, its qkv_bias and bias read as attention_bias and mlp_bias, head_dim set apart, a dynamic NTK rope),
Kyutai's Helium (HeliumForCausalLM: Llama's layers with a rotary of interleaved pairs, RMSNorms weighting in float32,
q/k/v biases and none on o), Tencent's Hunyuan dense (HunYuanDenseV1ForCausalLM: q and k normed per head after the
rotary, its rope's NTK alpha) and IBM's Granite SWA (GraniteSWAForCausalLM: Granite's scalars, sliding windows on the
layers layer_types names, attention sinks, NoPE where layer_rope_theta gives 0), end to end on tiny random models built
from their configs (float32), each against the real thing: greedy tokens and logprobs equal transformers' (GQA and MHA,
biases, tied heads), the GPU code path (Triton interpreted, emulated CUDA graphs and piecewise graphs: Hunyuan's q and
k rotated, normed, then through the fused kernels by an identity table), chunked prefill and prefix caching; GPTQ
checkpoints from `infer quantize` equal to GPTQModel's own load (and convert); peft adapters equal to peft (alone and
mixed, on the CPU and through the kernels); lora-validate, serve, warmup --estimate, run, bench, the built-in tiny
models; what their configs ask that infer cannot do refused up front; their near neighbours (InternLM2, Moshi,
Hunyuan-Large) refused naming what they are (Hunyuan MoE, once refused here: test_probes_session66_hunyuanmoe)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner
from transformers import AutoConfig

from infer import LLM
from infer.cli.main import app
from infer.errors import UnsupportedModelError

from helpers import (builtin_model_tests, check_chunked_prefill_and_prefix_caching, family_builder, family_small_config,
                     greedy_and_logprobs_test, greedy_each, norms_and_biases_shifted, random_prompts, save_random_model)
from lora_helpers import (check_mixed_adapters_gpu_path_equal_peft, family_lora_fixture,  # noqa: F401 (its tests)
                          test_an_adapter_without_target_modules_is_refused_as_peft_refuses_it,
                          test_int4_kernels_with_mixed_adapters_equal_the_cpu_path,
                          test_lora_validate_accepts_an_adapter_of_every_projection,
                          test_peft_adapters_equal_peft_alone_and_mixed, test_serve_completions)
from quant_helpers import check_gpu_path_interpreted, check_infer_quantize_and_convert, needs_gptqmodel

SMALL = family_small_config(num_hidden_layers=3)
FAMILIES = {"internlm3": ("internlm3", "InternLM3ForCausalLM", dict(head_dim=32)),  # (its default: 128)
            "helium": ("helium", "HeliumForCausalLM", dict(head_dim=16)),  # (heads * head_dim: hidden_size)
            "hunyuan": ("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", dict(head_dim=32)),  # (its configs set it)
            # Granite's scalars, a window of 8 (prompts pass it) on the layers transformers' default layer_types
            # names (3 of 4), layer 0 without rotary (layer_rope_theta 0)
            "granite_swa": ("granite_swa", "GraniteSWAForCausalLM", dict(
                num_hidden_layers=4, sliding_window=8, embedding_multiplier=12.0, residual_multiplier=0.22,
                attention_multiplier=0.0625, logits_scaling=4.0, layer_rope_theta=[0, 10000.0, 10000.0, 10000.0]))}
# internlm3-8b-instruct's rope: dynamic NTK of factor 6 (transformers rescales only past max_position_embeddings,
# which infer's context never passes)
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 50000000.0, "factor": 6.0}
# Hunyuan-7B-Instruct's rope_scaling (transformers: rope_type "ntk_alpha", a static base of rope_theta * alpha ** (d /
# (d - 2)))
ALPHA = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _shifted(name, p):
    """norms_and_biases_shifted, and Granite SWA's attention sinks (initialized 0) moved to N(2, 1): large enough
    to weigh against a softmax over a few dozen keys."""
    norms_and_biases_shifted(name, p)
    if name.endswith(".sinks"):
        p.add_(torch.randn_like(p) + 2.0)


_build = family_builder(SMALL, FAMILIES, _shifted)


def build(folder, family: str, seed: int = 0, **config):
    """family_builder's model (its norms, biases and sinks moved off their constant init), its config.json naming
    the architecture as the family's checkpoints do (transformers saves an InternLM3 as the LlamaForCausalLM it runs
    it as)."""
    hf = _build(folder, family, seed, **config)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "architectures": [FAMILIES[family][1]]}))
    return hf


CONFIGS = {
    "internlm3-gqa-dynamic-rope": ("internlm3", dict(rope_parameters=DYNAMIC)),
    # qkv_bias and bias (InternLM3's own names) both true: q, k, v and o biased, and the MLP
    "internlm3-mha-tied-biases": ("internlm3", dict(num_key_value_heads=4, tie_word_embeddings=True, qkv_bias=True,
                                                    bias=True, head_dim=8)),
    "helium-gqa-biases": ("helium", dict(attention_bias=True, mlp_bias=True)),
    "helium-mha-tied-wide-heads": ("helium", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                                  num_attention_heads=2, head_dim=32)),
    "hunyuan-gqa-alpha-rope-tied": ("hunyuan", dict(rope_parameters=ALPHA, tie_word_embeddings=True,
                                                    use_qk_norm=True, use_cla=False)),
    "hunyuan-mha-attention-bias-default-rope": ("hunyuan", dict(num_key_value_heads=4, attention_bias=True,
                                                                head_dim=16)),
    "granite_swa-gqa-default-layers": ("granite_swa", dict()),
    "granite_swa-mha-tied-biases-alternate": ("granite_swa", dict(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        layer_types=["sliding_attention", "full_attention"] * 2, layer_rope_theta=[10000.0, 0, 10000.0, 0])),
}


def _check_model(model, hf, family: str, config: dict) -> None:
    """infer's model of a config of CONFIGS as it loaded it (test_greedy_tokens_and_logprobs_equal_transformers;
    hf: transformers' model)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    biased = bool(hf.config.attention_bias)
    assert (attn.qkv_proj.bias is not None) == biased
    assert (mlp.gate_up_proj.bias is not None) == (mlp.down_proj.bias is not None) == \
        bool(getattr(hf.config, "mlp_bias", False))
    if family == "internlm3":  # Llama's attention: o biased with q, k and v
        assert (attn.o_proj.bias is not None) == biased
        assert attn.head_dim == hf.config.head_dim != hf.config.hidden_size // hf.config.num_attention_heads
    elif family == "granite_swa":  # sinks, the windows and NoPE layers as transformers' layer types say
        assert [layer.self_attn.window for layer in model.layers] == \
            [8 if t == "sliding_attention" else 0 for t in hf.config.layer_types]
        assert model.nope == [t == 0 for t in hf.config.layer_rope_theta] and any(model.nope)
        assert attn.sinks is not None and attn.scale == hf.config.attention_multiplier
        assert (attn.o_proj.bias is not None) == biased
    elif family == "hunyuan":  # q and k normed after the rotary, the fused kernels handed the identity table
        assert attn.norm_after_rope and attn.rot_dim == 2 and model._rope(0)[1] is model.nope_cos_sin
        assert (attn.o_proj.bias is not None) == biased
    else:  # Helium: no o bias, the whole head rotated in interleaved pairs, norms weighting in float32
        assert attn.o_proj.bias is None and attn.rope_interleaved and attn.rot_dim == attn.head_dim
        assert model.norm.float_weight and model.layers[0].input_layernorm.float_weight


test_greedy_tokens_and_logprobs_equal_transformers = greedy_and_logprobs_test(CONFIGS, build, _check_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, family):
    """Steps of 12 tokens (prompts cut into chunks) and a prompt whose first blocks another prompt cached:
    transformers' tokens."""
    hf = build(tmp_path, family, seed=1)
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


GPU_CONFIGS = {"internlm3": dict(qkv_bias=True, bias=True, rope_parameters=DYNAMIC),
               "helium": dict(attention_bias=True, mlp_bias=True),
               "hunyuan": dict(attention_bias=True, rope_parameters=ALPHA),
               "granite_swa": dict(attention_bias=True, mlp_bias=True)}


@pytest.mark.parametrize("family", GPU_CONFIGS)
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, family):
    """Every op through its Triton kernel (interpreted on CPU), decodes through emulated CUDA graphs, the others
    through emulated piecewise graphs (whose start checks the family's piece() against its forward): transformers'
    tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    hf = build(tmp_path, family, **GPU_CONFIGS[family])
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    assert check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0


def test_internlm3_biases_apart_are_refused(tmp_path):
    """InternLM3's qkv_bias and bias unequal (its remote code's q/k/v biases apart from o's and the MLP's), which
    transformers refuses: refused when the config is read (`infer warmup --estimate` too), naming both."""
    build(tmp_path, "internlm3")
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("attention_bias", None), config.pop("mlp_bias", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "qkv_bias": True, "bias": False}))
    with pytest.raises(UnsupportedModelError, match="qkv_bias true and bias false") as e:
        LLM(str(tmp_path))
    assert "both false" in e.value.hint
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and "qkv_bias true and bias false" in res.output


def test_helium_heads_narrower_than_hidden_size_are_refused(tmp_path):
    """Helium's o projection is hidden_size square: heads * head_dim of another width (transformers fails loading
    such weights) is refused when the config is read (`infer warmup --estimate` too), naming the widths."""
    build(tmp_path, "helium")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "head_dim": 8}))
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \* head_dim \(4 \* 8 = 32\) other than "
                                                    r"hidden_size \(64\)"):
        LLM(str(tmp_path))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and "other than hidden_size" in res.output


def test_hunyuans_alpha_rope_and_norms_after_the_rotary_change_the_tokens(tmp_path):
    """The checks above mean something: in transformers, the same weights with Hunyuan's alpha rope give other tokens
    than with its rope_theta alone; and Hunyuan's norms after the rotary give other tokens than the same weights as
    Qwen3 (q and k normed per head before it: its q_norm and k_norm)."""
    prompts = random_prompts(512, (30,), seed=3)
    hf = build(tmp_path / "a", "hunyuan", rope_parameters=ALPHA)
    want = greedy_each(hf, prompts, 8)
    assert greedy_each(build(tmp_path / "b", "hunyuan"), prompts, 8) != want
    qwen3 = save_random_model(tmp_path / "c", "qwen3", "Qwen3ForCausalLM", {**SMALL, "head_dim": 32})
    qwen3.load_state_dict({k.replace("query_layernorm", "q_norm").replace("key_layernorm", "k_norm"): v
                           for k, v in hf.state_dict().items()})
    qwen3.model.rotary_emb.inv_freq.copy_(hf.model.rotary_emb.inv_freq)  # (the alpha rope's frequencies)
    assert greedy_each(qwen3, prompts, 8) != want


@pytest.mark.parametrize("field, value", [("use_cla", True), ("use_qk_norm", False), ("use_rotary_pos_emb", False)])
def test_hunyuan_remote_code_fields_transformers_ignores_are_refused(tmp_path, field, value):
    """Hunyuan's remote-code fields asking another layer (cross-layer attention, no q/k norms, no rotary), which
    transformers' HunYuanDenseV1 never reads: refused by the engine and `infer warmup --estimate`, naming the field."""
    build(tmp_path, "hunyuan")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(UnsupportedModelError, match=f"hunyuan_v1_dense with {field} {json.dumps(value)}"):
        LLM(str(tmp_path))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and field in res.output


def test_hunyuans_alpha_rope_without_head_dim_is_refused(tmp_path):
    """Hunyuan's alpha rope reads config.head_dim (transformers fails without it): refused naming head_dim."""
    build(tmp_path, "hunyuan", rope_parameters=ALPHA)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("head_dim")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="alpha reads head_dim, which config.json does not set"):
        LLM(str(tmp_path))


def test_granite_swa_sinks_change_the_tokens(tmp_path):
    """The checks above mean something: in transformers, Granite SWA's sinks (moved off 0 here) give other logits
    than the same weights with sinks of 0."""
    ids = torch.tensor(random_prompts(512, (30,), seed=3))
    hf = build(tmp_path / "a", "granite_swa")
    with torch.no_grad():
        want = hf(ids).logits
        for layer in hf.model.layers:
            layer.self_attn.sinks.zero_()
        assert not torch.allclose(hf(ids).logits, want, atol=1e-3)


def test_granite_swa_sinks_counted_in_the_cpu_attentions_memory():
    """Granite SWA's sinks take kernels.reference's explicit attention on a CPU (gpt-oss's path: the scores' softmax
    in place), which the memory plan counts; the same shapes as Granite (no sinks) count none."""
    from infer.memory.sizes import softcap_cpu_position_bytes, softcap_cpu_prefill_bytes
    swa = AutoConfig.for_model("granite_swa", **{**SMALL, **FAMILIES["granite_swa"][2]})
    granite = AutoConfig.for_model("granite", **SMALL)
    assert softcap_cpu_position_bytes(swa, torch.float32, False) > 0 == softcap_cpu_position_bytes(
        granite, torch.float32, False)
    assert softcap_cpu_prefill_bytes(swa, torch.float32, 8, 64) > 0 == softcap_cpu_prefill_bytes(
        granite, torch.float32, 8, 64)


@pytest.mark.parametrize("field, value, match", [
    ("layer_rope_theta", [0, 10000.0, 500000.0, 10000.0], r"layer_rope_theta with bases \[500000.0\] other than "
                                                          "rope_theta 10000.0"),
    ("layer_rope_theta", [0, 10000.0], r"layer_rope_theta \[0, 10000.0\] is not a number for each of the 4"),
    ("layer_types", ["full_attention", "chunked_attention"] * 2, r"layer_types \['chunked_attention'\]")])
def test_granite_swa_configs_infer_cannot_run_are_refused(tmp_path, field, value, match):
    """Granite SWA's layer_rope_theta of another base than rope_theta (transformers builds a rotary per base), one
    too short, or a layer type other than sliding and full attention: refused by the engine and `infer warmup
    --estimate`, naming the field."""
    build(tmp_path, "granite_swa")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(str(tmp_path))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and field in res.output


# ------------------------------------------------------------------------------------------------------- GPTQ
BIASES = {"internlm3": dict(qkv_bias=True, bias=True), "helium": dict(attention_bias=True, mlp_bias=True),
          "hunyuan": dict(attention_bias=True), "granite_swa": dict(attention_bias=True, mlp_bias=True)}


@needs_gptqmodel
@pytest.mark.parametrize("family", FAMILIES)
def test_infer_quantize_writes_a_gptq_checkpoint_equal_to_gptqmodels_load_and_convert_takes_it(tmp_path, family):
    """GPTQModel quantizes each (InternLM3: not in its model map, its BaseQModel finds Llama's module tree): infer's
    tokens of the checkpoint equal GPTQModel's own load of it, and `infer convert`'s output gives them too."""
    build(tmp_path / "f", family, **BIASES[family])
    tensors = check_infer_quantize_and_convert(tmp_path / "f", tmp_path)
    assert "model.layers.0.self_attn.q_proj.bias" in tensors


# ------------------------------------------------------------------------------------------------------- LoRA
family_lora = family_lora_fixture(build, BIASES)


def test_gpu_code_path_with_mixed_adapters_interpreted_equals_peft(family_lora, monkeypatch):
    """Adapters beside a base-only row through the Triton kernels (interpreted) and emulated decode graphs: peft's
    tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    _, base, hf, paths = family_lora
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, lambda model: None)


# ---------------------------------------------------------------------------------------- serve, warmup, tiny
TINY = {"tiny-internlm3": "InternLM3ForCausalLM", "tiny-helium": "HeliumForCausalLM",
        "tiny-hunyuan": "HunYuanDenseV1ForCausalLM", "tiny-granite-swa": "GraniteSWAForCausalLM"}
test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests(TINY, ("tiny-hunyuan", "tiny-granite-swa"))


@pytest.mark.parametrize("model_type, arch, what, runs", [
    ("internlm2", "InternLM2ForCausalLM", "InternLM2 and InternLM2.5", "InternLM3ForCausalLM"),
    ("internlm", "InternLMForCausalLM", "the first InternLM", "InternLM3ForCausalLM"),
    ("moshi", "MoshiForConditionalGeneration", "Kyutai's Moshi, a speech-text model", "HeliumForCausalLM"),
    ("hunyuan", "HunYuanForCausalLM", "Hunyuan-Large", "HunYuanDenseV1ForCausalLM")])
def test_near_neighbours_are_refused_naming_what_they_are(tmp_path, model_type, arch, what, runs):
    """A config of a near neighbour (remote code) is refused naming what it is and the family infer runs, by the
    engine and by `infer warmup --estimate`."""
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "model_type": model_type, "architectures": [arch]}))
    with pytest.raises(UnsupportedModelError, match=f"is {what}.*which infer does not run") as e:
        LLM(str(tmp_path))
    assert runs in e.value.hint
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and what in res.output
