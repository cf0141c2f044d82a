"""Session 55: Gemma 3's text model (Gemma3ForCausalLM, model_type gemma3_text: Gemma-3-1B, Gemma-3-270M), end to
end on tiny random models built from Gemma3TextConfig (float32), each against the real thing: greedy tokens and
logprobs equal transformers' (GQA and MHA, head_dim apart from hidden / heads, prompts and generations past a small
window), its q/k norms by 1 + w, its two rope tables (the sliding layers' local base, the full layers' global base
with linear scaling), the GPU code path (Triton interpreted), chunked prefill across the window and prefix caching;
GPTQ checkpoints from `infer quantize` equal to GPTQModel's own load, peft adapters equal to peft (alone and mixed),
lora-validate, serve, warmup, the built-in tiny-gemma3; Gemma 3's multimodal model refused up front."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner
from transformers import AutoConfig

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import ModelLoadError, UnsupportedModelError
from infer.models.tiny import ensure_builtin

from helpers import (check_chunked_prefill_and_prefix_caching, check_equal_transformers, greedy_each,
                     norms_drawn, random_prompts, save_random_model, served_completion_text)
from lora_helpers import (base_and_adapters, check_lora_validate_ok, check_mixed_adapters_equal_peft,
                          check_mixed_adapters_gpu_path_equal_peft, hf_float)
from quant_helpers import check_gpu_path_interpreted, gptqmodel_greedy, needs_gptqmodel

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
             max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
# Gemma-3-4B's and larger's full-layer rope: base 1e6 scaled linearly by 8; the sliding layers' base 10000
SCALED = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
SL, FULL = "sliding_attention", "full_attention"


def build(folder, seed: int = 0, **config):
    """A random Gemma 3 text model folder (float32; norm weights random, not zero) with the tiny-llama tokenizer;
    returns transformers' model (eager attention)."""
    return save_random_model(folder, "gemma3_text", "Gemma3ForCausalLM", {**SMALL, **config}, seed, norms_drawn(0.0))


hf_greedy = greedy_each


def generate(llm, prompts, n: int) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))]


CONFIGS = {
    # 5 sliding layers and a full one (transformers' default pattern), the default ropes (bases 10000 and 1e6)
    "gqa-window16": dict(),
    # MHA, tied head, the larger models' scaled full-layer rope, layers alternating
    "mha-tied-scaled-rope": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_parameters=SCALED,
                                 num_hidden_layers=4, layer_types=[SL, FULL, SL, FULL]),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 12 generated (past the window of 16), batched: transformers' tokens, the
    logprobs within 1e-4; each layer's window and rope table as its layer type says."""
    hf = build(tmp_path, **CONFIGS[name])
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        model = llm.engine.runner.model
        types = hf.config.layer_types
        assert [layer.self_attn.window for layer in model.layers] == [16 if t == SL else 0 for t in types]
        assert [model._rope(i) is model.local_cos_sin for i in range(len(types))] == [t == SL for t in types]
        assert model.layers[0].self_attn.scale == 24 ** -0.5 and model.layers[0].self_attn.softcap == 0.0
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 12, name)


def test_a_config_in_the_hub_checkpoints_layout_equals_transformers(tmp_path):
    """The Gemma 3 checkpoints on the Hub write transformers 4's fields: rope_theta (the full layers' base),
    rope_local_base_freq (the sliding layers'), rope_scaling (the full layers' linear scaling), sliding_window_pattern
    (no layer_types). transformers 5 reads them into rope_parameters per layer type and layer_types, and so does
    infer: the same windows and tables, transformers' tokens."""
    build(tmp_path, num_hidden_layers=3, sliding_window=8)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"], config["layer_types"]
    config.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                  sliding_window_pattern=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = hf_float(tmp_path)
    assert hf.config.layer_types == [SL, FULL, SL]
    prompts = random_prompts(512, (5, 20), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert [layer.self_attn.window for layer in llm.engine.runner.model.layers] == [8, 0, 8]
        assert generate(llm, prompts, 8) == hf_greedy(hf, prompts, 8)


def test_what_these_models_test_changes_their_tokens(tmp_path):
    """The checks above mean something: the same weights with the sliding layers rotated by the full layers' rope,
    with the full layers' rope unscaled, or attending fully, give other tokens in transformers."""
    prompts = random_prompts(512, (30,), seed=3)
    cfg = CONFIGS["mha-tied-scaled-rope"]
    want = hf_greedy(build(tmp_path / "a", **cfg), prompts, 8)
    for i, change in enumerate((dict(rope_parameters={SL: SCALED[FULL], FULL: SCALED[FULL]}),
                                dict(rope_parameters={SL: SCALED[SL], FULL: {"rope_type": "default",
                                                                             "rope_theta": 1e6}}),
                                dict(sliding_window=256))):
        assert hf_greedy(build(tmp_path / str(i), **{**cfg, **change}), prompts, 8) != want, change


def test_chunked_prefill_across_the_window_and_prefix_caching_equal_transformers(tmp_path):
    """Steps of 12 tokens (chunk boundaries inside the window of 16) and a prompt whose first blocks another
    prompt cached: transformers' tokens."""
    hf = build(tmp_path, seed=1, num_hidden_layers=3, layer_types=[SL, SL, FULL])
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch):
    """Every op through its Triton kernel (interpreted on CPU): the q/k norms by 1 + w, the rotary of each layer's
    own table in the prefill (rotary_store_kv) and decode (decode_attention) kernels, the sliding and the full
    layers' attention, decodes through emulated CUDA graphs, the others through emulated piecewise graphs (whose
    start checks Gemma 3's piece() against its forward): transformers' tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    hf = build(tmp_path, num_hidden_layers=2, layer_types=[SL, FULL], sliding_window=8, rope_parameters=SCALED)
    prompts = random_prompts(512, (5, 13), seed=4)
    want = hf_greedy(hf, prompts, 6)
    assert check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0


def test_gemma3_multimodal_config_is_read_as_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration (Gemma-3-4B and larger: a vision tower and a language model, model_type
    gemma3) is read as its text model (session 61: models.multimodal): its text_config, as Gemma3ForCausalLM; a
    folder without weights is then refused as one, not as an architecture infer does not run."""
    from transformers import Gemma3Config
    from infer.models.loader import load_config
    cfg = Gemma3Config(text_config=dict(SMALL), vision_config=dict(hidden_size=32, num_hidden_layers=1,
                                                                   num_attention_heads=2, intermediate_size=64))
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    cfg.save_pretrained(tmp_path)
    text = load_config(tmp_path)
    assert text.model_type == "gemma3_text" and text.architectures == ["Gemma3ForCausalLM"]
    with pytest.raises(ModelLoadError, match="has no weights"):
        LLM(str(tmp_path))


def test_what_infer_cannot_run_of_gemma3_is_refused(tmp_path):
    """Bidirectional attention (EmbeddingGemma's), or another activation than GeGLU's gelu_pytorch_tanh in
    hidden_activation (the field Gemma 3 reads, as Gemma 2), is refused when the config is read."""
    build(tmp_path / "a", num_hidden_layers=1, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        LLM(str(tmp_path / "a"))
    build(tmp_path / "b", num_hidden_layers=1, hidden_activation="silu")
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'silu' is not supported for gemma3_text"):
        LLM(str(tmp_path / "b"))


# ------------------------------------------------------------------------------------------------------- GPTQ
@needs_gptqmodel
def test_infer_quantize_writes_a_gemma3_gptq_checkpoint_equal_to_gptqmodels_load(tmp_path):
    build(tmp_path / "f", num_hidden_layers=2, layer_types=[SL, FULL], rope_parameters=SCALED)
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.gate_proj.qweight" in tensors and "model.layers.1.self_attn.q_norm.weight" in tensors
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.qweight is not None
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == gptqmodel_greedy(out, prompts, 8)


# ------------------------------------------------------------------------------------------------------- LoRA
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=ALL),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def gemma3_lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    build(root / "base", num_hidden_layers=2, layer_types=[SL, FULL], rope_parameters=SCALED)
    return base_and_adapters(root, ADAPTERS)


def test_peft_adapters_equal_peft_alone_and_mixed(gemma3_lora):
    base, hf, paths = gemma3_lora
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (5, 20, 8), seed=6), ["all8", None, "qv4"])


def test_gpu_code_path_with_mixed_adapters_interpreted_equals_peft(gemma3_lora, monkeypatch):
    """Adapters beside a base-only row through the Triton kernels (interpreted) and emulated decode graphs: the qkv
    delta added before the q/k norms (never left to decode_attention, which rotates what it is given), the o and
    down deltas left to Gemma 3's residual-free post-attention and post-feedforward norms, gelu_tanh_and_mul's:
    peft's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    base, hf, paths = gemma3_lora

    def check_model(model):
        for layer in model.layers:  # the rms_norm variants an engine start compiles for the deltas left to the norms
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):  # after o and down: Gemma 3's, without a
                assert not proj.lora_consumer.residual and proj.lora_consumer.unit  # residual, by 1 + w
            assert layer.self_attn.qkv_proj.lora_consumer is None  # (the q/k norms come between qkv and attention)
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, check_model)


def test_lora_validate_accepts_a_gemma3_adapter_and_refuses_a_regex_selecting_its_norms(gemma3_lora, tmp_path):
    """lora-validate accepts a q/k/v/o/gate/up/down adapter; a target_modules regex that selects Gemma 3's q_norm
    or its post_feedforward_layernorm (not Linear layers: peft refuses such an adapter) is refused."""
    from infer.lora.adapter import adapter_problems
    base, _, paths = gemma3_lora
    check_lora_validate_ok(base, paths["all8"])
    adapter = shutil.copytree(paths["qv4"], tmp_path / "a")
    for regex, module in ((r".*\.(q_proj|q_norm)", "self_attn.q_norm"),
                          (r".*(v_proj|post_feedforward_layernorm)", "post_feedforward_layernorm")):
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        cfg["target_modules"] = regex
        (adapter / "adapter_config.json").write_text(json.dumps(cfg))
        problems = [p.message for p in adapter_problems("a", adapter, AutoConfig.from_pretrained(base))]
        assert any(f"selects model.layers.0.{module}, which is not a Linear layer" in m for m in problems), problems


# ---------------------------------------------------------------------------------------------- serve, warmup
def test_serve_completions_on_gemma3(gemma3_lora):
    from transformers import AutoTokenizer

    base, hf, _ = gemma3_lora
    prompt = random_prompts(512, (20,), seed=8)[0]
    assert served_completion_text(base, "gemma3", prompt, 5) == \
        AutoTokenizer.from_pretrained(base).decode(hf_greedy(hf, [prompt], 5)[0])


def test_builtin_tiny_gemma3_runs_and_warmup_sizes_it():
    """tiny-gemma3 equals transformers and writes varied tokens; `infer warmup --estimate` counts its weights as the
    loaded engine holds them: its two rope tables (the sliding layers' and the full layers') included, and the plan
    of a shorter context without either's rows past it."""
    path = ensure_builtin("tiny-gemma3")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    res = CliRunner().invoke(app, ["warmup", "tiny-gemma3", "--estimate", "--json", "--max-length", "256"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    with LLM("tiny-gemma3", max_model_len=256) as llm:
        from infer.memory.sizes import weights_bytes
        model = llm.engine.runner.model
        assert model.local_cos_sin.shape == model.cos_sin.shape == (256, 32)
        assert not torch.equal(model.local_cos_sin, model.cos_sin)
        assert plan["weights_bytes"] == weights_bytes(model)
        # the plan of a shorter context (largest_fitting_len) leaves out the rows of both tables past it
        from infer.memory.plan import _rope_rows_over
        assert _rope_rows_over(model, 200) == 2 * 56 * 32 * 4
        hf = hf_float(path)
        prompts = random_prompts(512, (6, 70), seed=1)  # (the second past the window of 64)
        got = generate(llm, prompts, 5)
    assert got == hf_greedy(hf, prompts, 5)
    assert all(len(set(tokens)) > 2 for tokens in got)
