"""Session 67, Llama 4 follow-ups: checkpoints of the hub's Llama-4-Scout-17B-16E-Instruct and
Llama-4-Maverick-17B-128E-Instruct shapes (Llama4ForConditionalGeneration, the hub's config.json fields: rope_scaling
llama3 or none, no_rope_layers [] derived, attn_temperature_tuning left out) read and planned on an 80 GB GPU; an
integer attn_temperature_tuning (transformers 4.51's 4) refused naming the fix; a GPTQ checkpoint's int4 experts (the
router's score scaling their input) through the Triton kernels (interpreted) giving the CPU path's tokens, top 1 and
top 2; an adapter of the router refused naming Llama 4."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer.cli.main import app

from test_probes_session67_llama4 import _gptq_checkpoint, build

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


# ------------------------------------------------------------------------------------------------------------ GPTQ
@interpreted
@pytest.mark.parametrize("top_k", [1, 2])
def test_int4_experts_through_the_triton_kernels_equal_the_cpu_path(tmp_path, monkeypatch, top_k):
    """A GPTQ Llama 4 in GPTQModel's layout (each expert's projections apart, 4-bit; 2 layers, the second's 4
    experts routed top `top_k`, their inputs scaled by the router's sigmoid) through every op's Triton kernel
    (interpreted), the experts int4 in the fused MoE kernel's layout: the CPU path's tokens."""
    from helpers import random_prompts
    from infer import LLM, SamplingParams, kernels
    from quant_helpers import int4_kernel_path
    build(tmp_path / "f", seed=5, num_hidden_layers=2, intermediate_size_mlp=64, num_experts_per_tok=top_k,
          no_rope_layers=[1, 0])
    out = _gptq_checkpoint(tmp_path / "f", tmp_path / "q")
    prompts, params = random_prompts(512, (5, 9), seed=4), SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(str(out), block_size=4) as llm:
        assert llm.engine.runner.model.layers[1].feed_forward.int4 is None  # (the CPU's: dequantized at load)
        cpu = [o.token_ids for o in llm.generate(prompts, params)]
    int4_kernel_path(monkeypatch)
    calls, real = [], kernels.fused_moe_int4
    monkeypatch.setattr(kernels, "fused_moe_int4", lambda *a, **k: calls.append(1) or real(*a, **k))
    with LLM(str(out), block_size=4, max_model_len=32) as llm:
        block = llm.engine.runner.model.layers[1].feed_forward
        assert block.int4 is not None and block.top_k == top_k and block.llama4
        assert [o.token_ids for o in llm.generate(prompts, params)] == cpu
    assert calls  # (the experts ran int4, in the fused MoE kernel)
    assert len({t for tokens in cpu for t in tokens}) > 3


# ------------------------------------------------------------------------------------------------------ adapters
def test_an_adapter_of_the_router_is_refused_naming_llama4(tmp_path):
    """peft adapts Llama 4's router (feed_forward.router, a Linear) where target_modules names it; infer's routers
    take no adapter: refused naming Llama 4's router and what to train instead, before anything loads: by its
    tensors, and by its target_modules where the router's tensors are not in the file."""
    from safetensors.torch import load_file, save_file

    from infer import LLM
    from infer.errors import LoRAError
    from lora_helpers import save_adapter
    hf = build(tmp_path / "base", seed=3)
    router = save_adapter(hf, tmp_path / "r", 1, r=4, lora_alpha=8, target_modules=["q_proj", "router"],
                          lora_dropout=0.0)
    with pytest.raises(LoRAError, match=r"adapts model\.layers\.\d+\.feed_forward\.router: infer does not adapt "
                       r"Llama 4's experts or router"):
        LLM(str(tmp_path / "base"), loras={"x": str(router)}, max_lora_rank=8)
    file = router / "adapter_model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if ".router." not in k}, file)
    assert len(load_file(file)) < len(tensors)
    with pytest.raises(LoRAError, match=r"targets \['router'\] \(feed_forward\.router\): infer does not adapt "
                       r"Llama 4's experts or router"):
        LLM(str(tmp_path / "base"), loras={"x": str(router)}, max_lora_rank=8)


# ------------------------------------------------------------------------------------ the hub's Scout and Maverick
# config.json's text_config as the hub's Llama-4-Scout-17B-16E-Instruct has it (transformers 4.51's names:
# rope_scaling and rope_theta, no_rope_layers [] (transformers derives every 4th layer NoPE), attn_temperature_tuning,
# floor_scale and attn_scale left out: true, 8,192 and 0.1); Maverick's: 128 experts on alternate layers
# (interleave_moe_layer_step 2), no L2 norm, no rope scaling, a context of 1M
HUB_TEXT = {
    "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0, "bos_token_id": 200000,
    "eos_token_id": [200001, 200007, 200008], "for_llm_compressor": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "initializer_range": 0.02, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760, "model_type": "llama4_text",
    "no_rope_layers": [], "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
    "num_key_value_heads": 8, "num_local_experts": 16, "output_router_logits": False, "pad_token_id": 200018,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 202048}
HUB_VISION = {
    "attention_dropout": 0.0, "hidden_act": "gelu", "hidden_size": 1408, "image_size": 336, "initializer_range": 0.02,
    "intermediate_size": 5632, "model_type": "llama4_vision_model", "multi_modal_projector_bias": False,
    "norm_eps": 1e-05, "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 34, "patch_size": 14,
    "pixel_shuffle_ratio": 0.5, "projector_dropout": 0.0, "projector_input_dim": 4096, "projector_output_dim": 4096,
    "rope_theta": 10000, "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
    "vision_output_dim": 4096}
MAVERICK = dict(interleave_moe_layer_step=2, num_local_experts=128, use_qk_norm=False,
                max_position_embeddings=1048576, rope_scaling=None)


def hub_llama4(folder, text: dict, gptq_group: int = 0) -> int:
    """A Llama4ForConditionalGeneration folder of the hub's tensors (names language_model.model.*, the vision tower's
    too; no values: helpers.hub_shaped_folder) under the hub's config.json of `text`; returns the parameters'
    count (the vision tower's with them)."""
    from helpers import hub_shaped_folder
    rope = {**(text["rope_scaling"] or {"rope_type": "default"}), "rope_theta": text["rope_theta"]}
    shapes = {k: v for k, v in text.items() if k not in ("model_type", "torch_dtype", "rope_scaling", "rope_theta")}
    vision = {k: v for k, v in HUB_VISION.items() if k != "model_type"}
    count = hub_shaped_folder(folder, "llama4", "Llama4ForConditionalGeneration", dict(
        text_config={**shapes, "rope_parameters": rope}, vision_config=vision, tie_word_embeddings=False), gptq_group)
    config = {"architectures": ["Llama4ForConditionalGeneration"], "boi_token_index": 200080,
              "eoi_token_index": 200081, "image_token_index": 200092, "model_type": "llama4", "text_config": text,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0.dev0",
              "vision_config": HUB_VISION}
    if gptq_group:
        config["quantization_config"] = json.loads((folder / "config.json").read_text())["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return count


HUB = {"scout": (HUB_TEXT, 109e9), "maverick": ({**HUB_TEXT, **MAVERICK}, 400e9)}  # (the known totals)


def on_an_80_gb_gpu(monkeypatch) -> None:
    """torch.cuda as one GPU of 80 GiB, all free, would answer the memory plan."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)


@pytest.mark.parametrize("name", HUB)
def test_the_hubs_scout_and_maverick_read_and_plan_on_an_80_gb_gpu(tmp_path, monkeypatch, name):
    """The hub's config.json of Scout and of Maverick read as transformers reads them (the derived NoPE layers, the
    temperature on, the experts on every layer or alternate ones, llama3 rope or none), their parameters the models'
    known 109 and 400 billion within 3%, and `warmup --estimate` on an 80 GiB GPU in bfloat16: the text model's 2
    bytes a parameter (the vision tower's skipped), 215 and 801 GB, do not fit, no KV block left, refused."""
    from infer.models.loader import load_config
    text, known = HUB[name]
    params = hub_llama4(tmp_path, text)
    assert abs(params - known) < 0.03 * known, params
    cfg = load_config(tmp_path)
    layers, step = 48, text["interleave_moe_layer_step"]
    assert (cfg.model_type, cfg.multimodal_architecture) == ("llama4_text", "Llama4ForConditionalGeneration")
    assert list(cfg.no_rope_layers) == [int((i + 1) % 4 != 0) for i in range(layers)]
    assert list(cfg.moe_layers) == list(range(step - 1, layers, step))
    assert (cfg.attn_temperature_tuning, cfg.floor_scale, cfg.attn_scale) == (True, 8192, 0.1)
    assert cfg.use_qk_norm == text["use_qk_norm"] and cfg.intermediate_size_mlp == 16384
    assert cfg.rope_parameters["rope_type"] == ("llama3" if text["rope_scaling"] else "default")
    on_an_80_gb_gpu(monkeypatch)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--device", "cuda",
                                   "--max-length", "131072", "--concurrency", "2"])
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.exit_code != 0 and not plan["fits"] and plan["kv_blocks"] == 0, res.output
    assert plan["kv_bytes_per_token"] == 48 * 2 * 8 * 128 * 2 and (plan["window"], plan["kv_groups"]) == (8192, 4)
    assert 0.99 * 2 * params < plan["weights_bytes"] < 2 * params, (plan["weights_bytes"], params)


def test_the_hubs_scout_in_int4_fits_an_80_gb_gpu_with_two_long_sequences(tmp_path):
    """A 4-bit GPTQ Scout of the hub's config and shapes (groups of 128, every projection's, each expert's apart):
    the weights a GPU holds (memory.checkpoint: about 0.54 bytes a parameter, 59 GB) with the KV cache of two
    sequences of 131,072 tokens (the 12 NoPE layers' whole context, the 36 chunked layers' one chunk of 8,192) fit
    an 80 GiB GPU at the default 0.9 of it."""
    from infer.memory.checkpoint import checkpoint_load_bytes
    from infer.memory.sizes import kv_bytes_per_token
    from infer.models.loader import load_config
    params = hub_llama4(tmp_path, HUB_TEXT, gptq_group=128)
    cfg = load_config(tmp_path)
    weights = checkpoint_load_bytes(tmp_path, cfg, torch.bfloat16, torch.device("cuda"))
    assert 0.5 * params < weights < 0.56 * params, (weights, params)
    per_layer = kv_bytes_per_token(cfg, torch.bfloat16) // 48
    assert weights + 2 * per_layer * (12 * 131072 + 36 * 8192) < 0.9 * (80 << 30)


@pytest.mark.parametrize("multimodal", [False, True])
def test_an_integer_attn_temperature_tuning_is_refused_naming_the_fix(tmp_path, multimodal):
    """attn_temperature_tuning 4 (transformers 4.51's default, which its model read as true; transformers 5 takes
    only a boolean): refused naming the field and the fix, at the top level and in a multimodal text_config."""
    from transformers import AutoConfig

    from test_probes_session67_llama4 import SMALL
    text = {**AutoConfig.for_model("llama4_text", **SMALL).to_dict(), "attn_temperature_tuning": 4}
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
              "vision_config": HUB_VISION} if multimodal else {**text, "architectures": ["Llama4ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"], env={"COLUMNS": "250"})
    where = "text_config's " if multimodal else ""
    words = " ".join(res.output.split())
    assert res.exit_code != 0 and f"config.json's {where}attn_temperature_tuning is 4: Llama 4's attention " \
        "temperature switch is true or false" in words and "set attn_temperature_tuning to true in config" in words, \
        words
