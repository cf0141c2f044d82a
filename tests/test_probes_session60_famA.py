"""Session 60 (famA): SmolLM3 (SmolLM3ForCausalLM: Llama with no rotary on the layers no_rope_layers marks 0, NoPE;
a sliding window on those layers where use_sliding_window is set), ByteDance Seed-OSS (SeedOssForCausalLM: Llama
with q, k and v biases from attention_bias, o's from attention_out_bias, mlp_bias, head_dim set apart) and Baidu's
ERNIE 4.5 dense (Ernie4_5ForCausalLM: Llama rotating the whole head in interleaved pairs, use_bias on every layer),
end to end on tiny random models built from their configs (float32), each against the real thing: greedy tokens and
logprobs equal transformers' (GQA and MHA, biases, tied heads), the GPU code path (Triton interpreted, emulated CUDA
graphs and piecewise graphs: a NoPE layer rotates nothing in the fused kernels either), chunked prefill and prefix
caching; GPTQ checkpoints from `infer quantize` equal to GPTQModel's own load (and convert); peft adapters equal to
peft (alone and mixed, on the CPU and through the kernels); lora-validate, serve, warmup --estimate, run, bench, the
built-in tiny-smollm3, tiny-seed-oss and tiny-ernie4_5; what their configs ask that infer cannot do refused up front;
their near neighbours (ERNIE 4.5's mixtures of experts) refused naming what they are."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.errors import UnsupportedModelError

from helpers import (builtin_model_tests, check_chunked_prefill_and_prefix_caching, family_builder, family_small_config,
                     greedy_and_logprobs_test, greedy_each, random_prompts)
from lora_helpers import (check_mixed_adapters_gpu_path_equal_peft, family_lora_fixture,  # noqa: F401 (its tests)
                          test_an_adapter_without_target_modules_is_refused_as_peft_refuses_it,
                          test_int4_kernels_with_mixed_adapters_equal_the_cpu_path,
                          test_lora_validate_accepts_an_adapter_of_every_projection,
                          test_peft_adapters_equal_peft_alone_and_mixed, test_serve_completions)
from quant_helpers import check_gpu_path_interpreted, check_infer_quantize_and_convert, needs_gptqmodel

SMALL = family_small_config(num_hidden_layers=4)
FAMILIES = {"smollm3": ("smollm3", "SmolLM3ForCausalLM", {}),  # layer 3 NoPE (transformers' interval of 4)
            # head_dim set apart from hidden_size / heads (Seed-OSS's config defaults to 128)
            "seed_oss": ("seed_oss", "SeedOssForCausalLM", dict(head_dim=32)),
            "ernie4_5": ("ernie4_5", "Ernie4_5ForCausalLM", dict(head_dim=16))}  # (its default: 128)
SL, FULL = "sliding_attention", "full_attention"


build = family_builder(SMALL, FAMILIES)


CONFIGS = {
    "smollm3-gqa-nope-every-4th": ("smollm3", dict()),
    "smollm3-mha-tied-bias-nope-alternate": ("smollm3", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                             attention_bias=True, mlp_bias=True,
                                                             no_rope_layers=[0, 1, 0, 1])),
    # a window of 8 (prompts pass it) on the NoPE layers, as transformers' SmolLM3Config lists them in layer_types
    "smollm3-sliding-nope-layers": ("smollm3", dict(use_sliding_window=True, sliding_window=8,
                                                    no_rope_layer_interval=2)),
    "seed_oss-gqa-qkv-bias": ("seed_oss", dict()),
    "seed_oss-mha-tied-all-biases": ("seed_oss", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                      attention_out_bias=True, mlp_bias=True, num_hidden_layers=3)),
    "seed_oss-no-bias-wide-heads": ("seed_oss", dict(attention_bias=False, head_dim=64, num_hidden_layers=2)),
    "ernie4_5-gqa": ("ernie4_5", dict()),
    "ernie4_5-mha-tied-bias-wide-heads": ("ernie4_5", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                          use_bias=True, head_dim=32, num_hidden_layers=2)),
}


def _check_model(model, hf, family: str, config: dict) -> None:
    """infer's model of a config of CONFIGS as it loaded it (test_greedy_tokens_and_logprobs_equal_transformers;
    hf: transformers' model)."""
    if family == "smollm3":  # the NoPE layers rotate by the identity table, the others by the rope's
        nope = [not f for f in hf.config.no_rope_layers]
        assert [model._rope(i) is model.nope_cos_sin for i in range(len(nope))] == nope and any(nope)
        assert [layer.self_attn.window for layer in model.layers] == \
            [8 if t == SL else 0 for t in hf.config.layer_types]
    elif family == "seed_oss":
        attn = model.layers[0].self_attn
        assert (attn.qkv_proj.bias is not None) == hf.config.attention_bias
        assert (attn.o_proj.bias is not None) == hf.config.attention_out_bias
    else:  # the whole head rotated, the pairs interleaved
        attn = model.layers[0].self_attn
        assert attn.rot_dim == attn.head_dim and attn.rope_interleaved
        assert (attn.o_proj.bias is not None) == (model.layers[0].mlp.down_proj.bias is not None) == \
            hf.config.use_bias


test_greedy_tokens_and_logprobs_equal_transformers = greedy_and_logprobs_test(CONFIGS, build, _check_model)


def test_nope_layers_and_seed_oss_biases_change_the_tokens(tmp_path):
    """The checks above mean something: in transformers, the same weights with every layer rotated (no_rope_layers
    all 1) give other logits than SmolLM3's one NoPE layer of 4, and other tokens than NoPE on alternate layers;
    Seed-OSS's o bias (attention_out_bias) changes its tokens."""
    prompts = random_prompts(512, (30,), seed=3)
    rotated = build(tmp_path / "r", "smollm3", no_rope_layers=[1, 1, 1, 1])
    with torch.no_grad():
        ids = torch.tensor(prompts)
        assert not torch.allclose(build(tmp_path / "a", "smollm3")(ids).logits, rotated(ids).logits, atol=1e-3)
    assert greedy_each(build(tmp_path / "b", "smollm3", no_rope_layers=[0, 1, 0, 1]), prompts, 8) != \
        greedy_each(rotated, prompts, 8)
    want = greedy_each(build(tmp_path / "c", "seed_oss", attention_out_bias=True), prompts, 8)
    assert greedy_each(build(tmp_path / "d", "seed_oss"), prompts, 8) != want


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, family):
    """Steps of 12 tokens (prompts cut into chunks) and a prompt whose first blocks another prompt cached:
    transformers' tokens."""
    hf = build(tmp_path, family, seed=1)
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


@pytest.mark.parametrize("family, config", [("smollm3", dict(no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
                                                             sliding_window=8)),
                                            ("seed_oss", dict(attention_out_bias=True, mlp_bias=True)),
                                            ("ernie4_5", dict(use_bias=True))])
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, family, config):
    """Every op through its Triton kernel (interpreted on CPU): SmolLM3's NoPE layers (sliding over a window of 8
    here) through the fused rotary/KV-store and decode-attention kernels with their table of one unrotated pair,
    Seed-OSS's biases, ERNIE 4.5's interleaved pairs; decodes through emulated CUDA graphs, the others through
    emulated piecewise graphs (whose start checks the family's piece() against its forward): transformers'
    tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    hf = build(tmp_path, family, attention_bias=True, **config)
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    assert check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0


@pytest.mark.parametrize("flags", [[1, 1, 0], [1, 2, 1, 0]])
def test_a_no_rope_layers_infer_cannot_read_is_refused(tmp_path, flags):
    """SmolLM3's no_rope_layers shorter than the layers (transformers fails building the model) or of values other
    than 0 and 1 is refused when the config is read (`infer warmup --estimate` too), naming it."""
    build(tmp_path, "smollm3")
    config = json.loads((tmp_path / "config.json").read_text())
    config["no_rope_layers"] = flags
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="no_rope_layers .* is not a list of 0 and 1 for each of the 4"):
        LLM(str(tmp_path))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and "no_rope_layers" in res.output


# ------------------------------------------------------------------------------------------------------- GPTQ
@needs_gptqmodel
@pytest.mark.parametrize("family", FAMILIES)
def test_infer_quantize_writes_a_gptq_checkpoint_equal_to_gptqmodels_load_and_convert_takes_it(tmp_path, family):
    """GPTQModel quantizes each as Llama (its smollm3 and seed_oss map to LlamaQModel, its Ernie4_5QModel is one):
    infer's tokens of the checkpoint equal GPTQModel's own load of it, and `infer convert`'s output gives them too."""
    build(tmp_path / "f", family, **BIASES[family])
    tensors = check_infer_quantize_and_convert(tmp_path / "f", tmp_path)
    assert "model.layers.0.self_attn.q_proj.bias" in tensors


# ------------------------------------------------------------------------------------------------------- LoRA
BIASES = {"smollm3": dict(attention_bias=True), "seed_oss": dict(attention_bias=True, attention_out_bias=True),
          "ernie4_5": dict(use_bias=True)}
family_lora = family_lora_fixture(build, BIASES)


def test_gpu_code_path_with_mixed_adapters_interpreted_equals_peft(family_lora, monkeypatch):
    """Adapters beside a base-only row through the Triton kernels (interpreted) and emulated decode graphs, the qkv
    delta of a decode step left to decode_attention (which rotates a NoPE layer's q and k by nothing; not ERNIE
    4.5's, whose interleaved pairs are reordered first): peft's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    family, base, hf, paths = family_lora

    def check_model(model):
        for layer in model.layers:
            assert (layer.self_attn.qkv_proj.lora_consumer is None) == (family == "ernie4_5")
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, check_model)


# ---------------------------------------------------------------------------------------- serve, warmup, tiny
TINY = {"tiny-smollm3": "SmolLM3ForCausalLM", "tiny-seed-oss": "SeedOssForCausalLM",
        "tiny-ernie4_5": "Ernie4_5ForCausalLM"}
test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests(TINY, ("tiny-smollm3",))


@pytest.mark.parametrize("model_type, arch, what", [
    ("ernie4_5_vl_moe", "Ernie4_5_VLMoeForConditionalGeneration", "ERNIE 4.5's vision-language mixture of experts"),
    ("ernie", "ErnieForMaskedLM", "the first ERNIE")])
def test_ernies_near_neighbours_are_refused_naming_what_they_are(tmp_path, model_type, arch, what):
    """A config of ERNIE 4.5's vision-language mixture of experts or the first ERNIE (an encoder) is refused naming
    what it is and the ERNIE 4.5 infer runs, by the engine and by `infer warmup --estimate`."""
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "model_type": model_type, "architectures": [arch]}))
    with pytest.raises(UnsupportedModelError, match=f"is {what}.*which infer does not run") as e:
        LLM(str(tmp_path))
    assert "Ernie4_5ForCausalLM" in e.value.hint
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and what in res.output
