"""Session 53: the Phi-3 family (Phi3ForCausalLM: Phi-3-mini/medium, Phi-3.5-mini, Phi-4), end to end on tiny random
models built from a Phi3Config (float32), each against the real thing: greedy tokens equal transformers' generate
(GQA and MHA, tied and untied head, longrope as Phi-3-128k ships, a sliding window as Phi-3-mini-4k ships), the GPU
code path (Triton interpreted) equal to the CPU path, GPTQ checkpoints (qkv_proj quantized as one; GPTQModel writes
gate_proj and up_proj apart) equal to GPTQModel's own load of them, peft adapters on the fused modules equal to peft,
lora-validate, serve, warmup, the built-in tiny-phi3; partial_rotary_factor < 1 (Phi-4-mini) refused up front."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import ModelLoadError, UnsupportedModelError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from quant_helpers import int4_kernel_path, make_gptqmodel_checkpoint, needs_gptqmodel

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0)
HALF_HEAD = 8  # head_dim 16: the rope's frequencies


def build(folder, seed: int = 0, **config):
    """A random Phi-3 model folder (float32) with the tiny-llama tokenizer; returns transformers' model."""
    cfg = AutoConfig.for_model("phi3", initializer_range=0.15, bos_token_id=None, **{**SMALL, **config})
    cfg.architectures = ["Phi3ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_builtin("tiny-llama") / f, folder / f)
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(hf, prompts, n: int) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


LONGROPE = dict(original_max_position_embeddings=64, rope_scaling={
    "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(HALF_HEAD)],
    "long_factor": [2.0 + 0.5 * i for i in range(HALF_HEAD)]})
CONFIGS = {  # config, the context infer caps it at, prompt lengths, new tokens
    "gqa-untied": (dict(), 256, (5, 13, 30), 8),
    "mha-tied": (dict(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=0.25), 256, (7, 21), 8),
    "longrope-128k": (LONGROPE, 64, (6, 17, 40), 8),  # its short factors hold up to original_max_position_embeddings
    "sliding-window-4k": (dict(sliding_window=16), 16, (4, 10), 6),  # full attention = sliding up to the window
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_equal_transformers(tmp_path, name):
    config, limit, lengths, n = CONFIGS[name]
    hf = build(tmp_path, **config)
    llm = LLM(str(tmp_path), block_size=4)
    assert llm.engine.max_model_len == limit
    prompts = random_prompts(512, lengths, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, n), name
    llm.close()


def test_gpu_code_path_interpreted_equals_the_cpu_path(tmp_path, monkeypatch):
    """Every op through its Triton kernel (interpreted on CPU): the fused checkpoint's shards give the CPU path's
    tokens (which equal transformers', above)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    build(tmp_path, num_hidden_layers=1)
    prompts = random_prompts(512, (5, 9), seed=4)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path), block_size=4) as llm:
        cpu = [o.token_ids for o in llm.generate(prompts, params)]
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path), block_size=4, max_model_len=32) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == cpu


def test_partial_rotary_factor_is_refused_up_front(tmp_path):
    """Phi-4-mini rotates 3/4 of each head: infer's rotary kernels rotate whole heads, so it is refused when the
    config is read (naming the field), not run with the wrong rotation."""
    build(tmp_path, partial_rotary_factor=0.75)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        LLM(str(tmp_path))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and "partial_rotary_factor" in res.output


def test_a_fused_tensor_of_the_wrong_width_is_named(tmp_path):
    build(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].clone()  # one KV head's value rows short
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight has shape \(112, 64\)"):
        LLM(str(tmp_path))


# ------------------------------------------------------------------------------------------------------- GPTQ
def gptqmodel_greedy(path, prompts, n: int) -> list[list[int]]:
    """GPTQModel's own load of its Phi-3 checkpoint (its unfused MLP: gate_proj and up_proj apart, which
    transformers' Phi3MLP has no place for), its torch kernel computing in float32: loaded in float16 (the kernel's
    dtypes; the fp16 scales exactly), then cast, and the checkpoint's float tensors put back exactly."""
    from gptqmodel import BACKEND, GPTQModel
    model = GPTQModel.load(str(path), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16).model.float().eval()
    floats = {k: v for k, v in load_file(path / "model.safetensors").items() if v.dtype == torch.float32}
    assert not model.load_state_dict(floats, strict=False).unexpected_keys
    model.generation_config.eos_token_id = None
    return hf_greedy(model, prompts, n)


def _check_gptq(path):
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(path), block_size=4) as llm:
        layer = llm.engine.runner.model.layers[0].self_attn.qkv_proj
        assert layer.names == ["model.layers.0.self_attn.qkv_proj"] * 3 and layer.qweight is not None
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == gptqmodel_greedy(path, prompts, 8)


@needs_gptqmodel
def test_infer_quantize_writes_a_phi3_gptq_checkpoint_equal_to_gptqmodels_load_and_convert_takes_it(tmp_path):
    build(tmp_path / "f")
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    names = load_file(out / "model.safetensors").keys()
    assert "model.layers.0.self_attn.qkv_proj.qweight" in names  # quantized as one (its MLP GPTQModel unfuses)
    _check_gptq(out)
    res = CliRunner().invoke(app, ["convert", str(out), "-o", str(tmp_path / "c")])  # copied tensor by tensor
    assert res.exit_code == 0, res.output
    prompts = random_prompts(512, (6,), seed=2)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(str(tmp_path / "c")) as a, LLM(str(out)) as b:
        assert a.generate(prompts, params)[0].token_ids == b.generate(prompts, params)[0].token_ids


@needs_gptqmodel
def test_gptqmodel_act_order_asymmetric_phi3_checkpoint_equals_gptqmodels_load(tmp_path):
    build(tmp_path / "f", seed=1)
    path = make_gptqmodel_checkpoint(tmp_path / "f", tmp_path / "q", bits=4, group_size=32, desc_act=True, sym=False,
                                     seq_len=32)
    _check_gptq(path)
