"""Session 61 (fam): the dense families whose MLP has no gate, as vLLM runs them: Arcee's AFM (ArceeForCausalLM:
Llama with down(relu(up(x))²)), NVIDIA's Nemotron-4 / Minitron (NemotronForCausalLM: LayerNorm1P with biases, weighting
by 1 + w, the relu² MLP without gate, a partial rotary) and Swiss AI's Apertus (ApertusForCausalLM: the xIELU
activation of learned per-layer parameters, q and k RMSNorms per head, Llama's norms under its own names), one
UngatedMLP with StarCoder2's, end to end on tiny random models built from their configs (float32), each against the
real thing: greedy tokens and logprobs equal transformers' (GQA and MHA, biases, tied and untied heads), the GPU code
path (Triton interpreted, emulated CUDA graphs and piecewise graphs), chunked prefill and prefix caching; GPTQ
checkpoints from `infer quantize`; peft adapters on up_proj/down_proj equal to peft (alone and mixed);
--lora-target-modules up_proj,down_proj; serve, warmup --estimate, run, bench, the built-in tiny-arcee,
tiny-nemotron and tiny-apertus; what their configs ask that infer cannot do refused up front, and their near
neighbours (Nemotron-H, Llama-Nemotron's NAS, Arcee's Trinity, Apertus 1.5) refused naming what they are."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.errors import UnsupportedModelError

from helpers import (builtin_model_tests, check_chunked_prefill_and_prefix_caching, family_builder, family_small_config,
                     greedy_and_logprobs_test, greedy_each, greedy_tokens, norms_and_biases_shifted, random_prompts)
from lora_helpers import (check_lora_validate_ok_and_non_linear_regexes,  # noqa: F401 (its tests)
                          check_mixed_adapters_gpu_path_equal_peft, family_lora_fixture,
                          test_adapter_without_target_modules_is_refused_as_peft_does,
                          test_peft_adapters_equal_peft_alone_and_mixed, test_serve_completions)
from quant_helpers import (check_gpu_path_interpreted, check_infer_quantize_and_convert,
                           check_int4_kernels_with_mixed_adapters, needs_gptqmodel)

SMALL = family_small_config(num_hidden_layers=2)
FAMILIES = {"arcee": ("arcee", "ArceeForCausalLM", dict()),
            "nemotron": ("nemotron", "NemotronForCausalLM", dict()),
            "apertus": ("apertus", "ApertusForCausalLM", dict())}


def _perturbed(name, p):
    """norms_and_biases_shifted, and Apertus's xIELU parameters (alpha_p, alpha_n: the same in every layer at their
    init) drawn apart per layer, so that a layer read with another's changes the tokens."""
    norms_and_biases_shifted(name, p)
    if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
        p.add_(torch.randn_like(p) * 0.5)


build = family_builder(SMALL, FAMILIES, _perturbed)


CONFIGS = {
    "arcee-gqa": ("arcee", dict()),
    "arcee-mha-tied-biases": ("arcee", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                            mlp_bias=True)),
    # a quarter of each head rotated (Nemotron's default: half)
    "nemotron-gqa-partial-quarter": ("nemotron", dict(partial_rotary_factor=0.25)),
    "nemotron-mha-tied-biases": ("nemotron", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                  attention_bias=True, mlp_bias=True)),
    "apertus-gqa": ("apertus", dict()),
    # (mlp_bias set: Apertus's MLP has no biases whatever its config says)
    "apertus-mha-tied-bias": ("apertus", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                              mlp_bias=True)),
}


def _check_model(model, hf, family: str, config: dict) -> None:
    """infer's model of a config of CONFIGS as it loaded it (test_greedy_tokens_and_logprobs_equal_transformers;
    hf: transformers' model)."""
    mlp, attn = model.layers[0].mlp, model.layers[0].self_attn
    assert mlp.proj_names == ("up_proj", "down_proj") and not hasattr(mlp, "gate_up_proj")
    assert (mlp.up_proj.bias is not None) == (family != "apertus" and bool(config.get("mlp_bias")))
    assert attn.qk_norm == (family == "apertus")
    if family == "nemotron":  # the rotary over a part of each head
        assert attn.rot_dim == int(attn.head_dim * config.get("partial_rotary_factor", 0.5))
    if family == "apertus":  # each layer's own xIELU parameters
        assert model.layers[0].mlp.act_fn.alpha_p != model.layers[1].mlp.act_fn.alpha_p


test_greedy_tokens_and_logprobs_equal_transformers = greedy_and_logprobs_test(CONFIGS, build, _check_model)


def test_what_the_families_change_changes_transformers_logits(tmp_path):
    """The checks above mean something: relu² is not relu, an Apertus whose layer 1 xIELU parameters are moved and a
    Nemotron that rotates whole heads (the same weights) give other logits in transformers."""
    ids = torch.tensor(random_prompts(512, (30,), seed=3))
    with torch.no_grad():
        mlp = build(tmp_path / "a", "arcee").model.layers[0].mlp
        x = torch.randn(3, 64)
        assert not torch.allclose(mlp.act_fn(mlp.up_proj(x)), torch.relu(mlp.up_proj(x)))
        apertus = build(tmp_path / "b", "apertus")
        before = apertus(ids).logits
        apertus.model.layers[1].mlp.act_fn.alpha_n.add_(1.0)
        assert not torch.allclose(before, apertus(ids).logits)
        half = build(tmp_path / "c", "nemotron")(ids).logits
        assert not torch.allclose(half, build(tmp_path / "d", "nemotron", partial_rotary_factor=1.0)(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, family):
    """Steps of 12 tokens (prompts cut into chunks) and a prompt whose first blocks another prompt cached:
    transformers' tokens."""
    hf = build(tmp_path, family, seed=1, attention_bias=True)
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, family):
    """Every op through its Triton kernel (interpreted on CPU), the activations torch's: Nemotron's LayerNorm1P in
    the LayerNorm kernel (by 1 + w), its partial rotary, Apertus's q/k norms; decodes through emulated CUDA graphs,
    the others through emulated piecewise graphs (whose start checks the family's piece() against its forward):
    transformers' tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    hf = build(tmp_path, family, attention_bias=True, mlp_bias=True)
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    assert check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0


NEAR = {"nemotron_h_omni": ("NemotronHOmniForConditionalGeneration", "is Nemotron-H's multimodal model",
                             "infer runs NVIDIA's dense Nemotron-4"),
        "nemotron-nas": ("DeciLMForCausalLM", "is Llama-Nemotron's neural-architecture-searched layers",
                         "infer runs NVIDIA's dense Nemotron-4"),
        "afmoe": ("AfmoeForCausalLM", "is Arcee's Trinity, a mixture of experts", "infer runs Arcee's dense AFM"),
        "apertus1p5": ("Apertus1p5ForConditionalGeneration", "is Apertus 1.5's multimodal model",
                       "use an Apertus text checkpoint")}


@pytest.mark.parametrize("family", FAMILIES)
def test_another_activation_is_refused(tmp_path, family):
    """An activation the family's MLP does not use (transformers would run it: silu, relu) is refused when the config
    is read, naming the field and the one infer computes."""
    build(tmp_path, family, num_hidden_layers=1, hidden_act="silu")
    want = "xielu" if family == "apertus" else "relu2"
    with pytest.raises(UnsupportedModelError, match=f"hidden_act 'silu' is not supported for {family}") as e:
        LLM(str(tmp_path))
    assert want in e.value.hint


@pytest.mark.parametrize("model_type", NEAR)
def test_near_neighbours_are_refused_naming_what_they_are(tmp_path, model_type):
    """A neighbour of the families that infer does not run (Nemotron-H's multimodal model, Llama-Nemotron's NAS
    layers, Arcee's Trinity, Apertus 1.5's multimodal model) is refused by `infer warmup --estimate`, naming what it
    is and what infer runs."""
    build(tmp_path, "nemotron", num_hidden_layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    arch, what, hint = NEAR[model_type]
    config.update(model_type=model_type, architectures=[arch])
    (tmp_path / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and what in res.output and hint in res.output, res.output


def test_nemotron_rotary_past_the_head_is_refused(tmp_path):
    """A partial_rotary_factor above 1 (more rotary dims than the head has) is refused, naming Nemotron's partial
    rotary."""
    build(tmp_path, "nemotron", num_hidden_layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 1.5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 1.5") as e:
        LLM(str(tmp_path))
    assert "Nemotron rotate part of each head" in e.value.hint


# ------------------------------------------------------------------------------------------------------- GPTQ
@needs_gptqmodel
@pytest.mark.parametrize("family", FAMILIES)
def test_infer_quantize_writes_a_gptq_checkpoint_equal_to_gptqmodels_load_and_convert_takes_it(tmp_path, family):
    """GPTQModel quantizes Apertus by its own definition, Arcee and Nemotron by the module tree it detects: infer's
    tokens of the checkpoint (its up_proj and down_proj int4 layers) equal GPTQModel's load of it, and `infer convert`
    keeps them."""
    build(tmp_path / "f", family)
    check_infer_quantize_and_convert(tmp_path / "f", tmp_path, mlp="up_proj")


# ------------------------------------------------------------------------------------------------------- LoRA
# adapters on each family's modules (its MLP's up_proj and down_proj: base_targets), attention and MLP biases on
family_lora = family_lora_fixture(build, dict.fromkeys(FAMILIES, dict(attention_bias=True, mlp_bias=True)))


def test_gpu_code_path_with_mixed_adapters_interpreted_equals_peft(family_lora, monkeypatch):
    """Adapters beside a base-only row through the Triton kernels (interpreted) and emulated decode graphs: down's
    delta left to the rms_norm after it (Arcee, Apertus) or added in its layer (Nemotron: the residual adds its output,
    no norm with a residual after it), up's added in its layer (the activation is torch's): peft's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    family, base, hf, paths = family_lora

    def check_model(model):
        for layer in model.layers:
            assert layer.mlp.up_proj.lora_consumer is None
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                assert (proj.lora_consumer is None) == (family == "nemotron")
            assert (layer.self_attn.qkv_proj.lora_consumer is None) == (family == "apertus")  # (its q/k norms)
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, check_model)


@needs_gptqmodel
def test_int4_kernels_with_mixed_adapters_equal_the_cpu_path(family_lora, tmp_path, monkeypatch):
    """A GPTQ checkpoint of the base with the adapters mixed: the int4 kernels (interpreted) give the CPU path's
    tokens (no gate_up: nothing in its epilogue)."""
    family, base, _, paths = family_lora
    check_int4_kernels_with_mixed_adapters(base, paths, tmp_path, monkeypatch, ["all8", None, "qv4"], False)


def test_lora_validate_accepts_an_adapter_and_refuses_a_regex_selecting_a_non_linear(family_lora, tmp_path):
    """lora-validate accepts an adapter of every projection; a target_modules regex that selects the MLP's activation
    module act_fn (Apertus's holds parameters), a norm (Apertus's under its names attention_layernorm and
    feedforward_layernorm, its q_norm) is refused (not Linear layers: peft refuses such an adapter); one that names a
    norm the family's layers lack selects nothing more and is accepted."""
    family, base, _, paths = family_lora
    cases = [(r".*(up_proj|mlp\.act_fn)", "mlp.act_fn"), (r".*(v_proj|input_layernorm)", "input_layernorm"),
             (r".*\.(v_proj|attention_layernorm)", None), (r".*\.(q_proj|q_norm)", None)]
    if family == "apertus":
        cases = [(r".*(up_proj|mlp\.act_fn)", "mlp.act_fn"), (r".*(v_proj|input_layernorm)", None),
                 (r".*(v_proj|feedforward_layernorm)", "feedforward_layernorm"),
                 (r".*\.(q_proj|q_norm)", "self_attn.q_norm")]
    check_lora_validate_ok_and_non_linear_regexes(base, paths, tmp_path / "a", cases)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_target_modules_take_up_proj_and_down_proj_apart(family):
    """--lora-target-modules on a model whose MLP has no gate takes up_proj alone (a layer of its own, not half of a
    gate_up_proj) and refuses gate_proj and gate_up_proj, naming the ones it has; the memory plan counts the slots of
    up_proj, one shard (none when only the attention is chosen)."""
    from transformers import AutoConfig

    from infer.errors import ConfigError
    from infer.lora.targets import check_target_modules, model_target_names
    from infer.memory.sizes import lora_slot_bytes
    cfg = AutoConfig.for_model(FAMILIES[family][0], **SMALL)
    assert model_target_names(cfg)[-2:] == ["up_proj", "down_proj"] and "gate_up_proj" not in model_target_names(cfg)
    assert check_target_modules(["up_proj", "o_proj"], cfg) == {"up_proj", "o_proj"}
    for bad in ("gate_proj", "gate_up_proj"):
        with pytest.raises(ConfigError, match=f"{bad}: no layer of this model .*up_proj, down_proj"):
            check_target_modules([bad, "up_proj"], cfg)
    slots = {t: lora_slot_bytes(cfg, 1, 8, torch.float32, [t]) for t in ("o_proj", "up_proj", "down_proj")}
    h, inter = SMALL["hidden_size"], SMALL["intermediate_size"]
    assert slots["up_proj"] == 2 * 8 * 4 * (h + inter)  # (its A and B, one shard, on each of the 2 layers)
    assert slots["down_proj"] > slots["o_proj"]


def test_an_adapter_outside_the_target_modules_names_up_proj(family_lora):
    """An adapter with weights on up_proj served under --lora-target-modules that leaves it out is refused, the hint
    naming up_proj (the layer's own name: there is no gate_up_proj to add)."""
    from infer.errors import LoRAError
    family, base, _, paths = family_lora
    with LLM(base, enable_lora=True, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
             block_size=4) as llm:
        with pytest.raises(LoRAError, match="has weights on up_proj") as e:
            llm.engine.add_lora("all8", paths["all8"])
    assert "add up_proj to --lora-target-modules" in e.value.hint


def test_convert_merge_lora_gives_the_served_adapters_tokens(family_lora, tmp_path):
    """`infer convert --merge-lora` of an adapter of every projection (up_proj and down_proj too: peft's merge) gives
    the tokens infer serves with that adapter, other than the base's."""
    _, base, _, paths = family_lora
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "m"), "--merge-lora", str(paths["all8"])])
    assert res.exit_code == 0, res.output
    prompts = random_prompts(512, (5, 20), seed=9)
    with LLM(str(tmp_path / "m"), block_size=4) as llm:
        merged = greedy_tokens(llm, prompts, 6)
    with LLM(str(base), loras={"a": str(paths["all8"])}, max_lora_rank=8, block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 6, lora=["a", "a"]) == merged
        assert greedy_tokens(llm, prompts, 6) != merged


# ---------------------------------------------------------------------------------------- serve, warmup, tiny
BUILTIN = {"tiny-arcee": "ArceeForCausalLM", "tiny-nemotron": "NemotronForCausalLM",
           "tiny-apertus": "ApertusForCausalLM"}
test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests(BUILTIN)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_equals_transformers_bit_for_bit(dtype):
    """Apertus's activation equals transformers' XIELUActivation (its Python path) bit for bit, over negative, zero and
    positive inputs and learned parameters other than their init, in float32 and bfloat16."""
    from transformers.activations import XIELUActivation

    from infer.models.llama import XIELU
    g = torch.Generator().manual_seed(0)
    hf = XIELUActivation(dtype=dtype)
    ours = XIELU(dtype)
    with torch.no_grad():
        hf.alpha_p.add_(0.3)
        hf.alpha_n.sub_(0.2)
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            getattr(ours, name).copy_(getattr(hf, name))
    x = (torch.randn(7, 96, generator=g) * 4).to(dtype)
    x[0, :3] = 0
    with torch.no_grad():
        assert torch.equal(ours(x), hf._xielu_python(x))
