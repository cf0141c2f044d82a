"""Session 53: the Phi-3 family (Phi3ForCausalLM: Phi-3-mini/medium, Phi-3.5-mini, Phi-4), end to end on tiny random
models built from a Phi3Config (float32), each against the real thing: greedy tokens equal transformers' generate
(GQA and MHA, tied and untied head, longrope as Phi-3-128k ships, a sliding window as Phi-3-mini-4k ships), the GPU
code path (Triton interpreted) equal to the CPU path, GPTQ checkpoints (qkv_proj quantized as one; GPTQModel writes
gate_proj and up_proj apart) equal to GPTQModel's own load of them, peft adapters on the fused modules equal to peft,
lora-validate, serve, warmup, the built-in tiny-phi3; partial_rotary_factor above 1 refused up front (below 1,
Phi-4-mini's: tests/test_probes_session55_rotary.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner
from transformers import AutoConfig

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import ModelLoadError, UnsupportedModelError
from infer.models.tiny import BUILTIN_MODELS, ensure_builtin

from helpers import greedy_each, random_prompts, save_random_model, served_completion_text
from lora_helpers import (base_and_adapters, check_lora_validate_ok, check_mixed_adapters_equal_peft,
                          hf_float)
from quant_helpers import (check_int4_kernels_with_mixed_adapters, check_kernel_path_equals_cpu, gptqmodel_greedy,
                           make_gptqmodel_checkpoint, needs_gptqmodel, split_gate_up)

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0)
HALF_HEAD = 8  # head_dim 16: the rope's frequencies


def build(folder, seed: int = 0, **config):
    """A random Phi-3 model folder (float32) with the tiny-llama tokenizer; returns transformers' model."""
    return save_random_model(folder, "phi3", "Phi3ForCausalLM", {**SMALL, **config}, seed, eager=False)


hf_greedy = greedy_each


LONGROPE = dict(original_max_position_embeddings=64, rope_scaling={
    "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(HALF_HEAD)],
    "long_factor": [2.0 + 0.5 * i for i in range(HALF_HEAD)]})
CONFIGS = {  # config, the context infer caps it at, prompt lengths, new tokens
    "gqa-untied": (dict(), 256, (5, 13, 30), 8),
    "mha-tied": (dict(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=0.25), 256, (7, 21), 8),
    "longrope-128k": (LONGROPE, 64, (6, 17, 40), 8),  # its short factors hold up to original_max_position_embeddings
    "sliding-window-4k": (dict(sliding_window=16), 256, (4, 30), 20),  # sliding attention, run past the window
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
    check_kernel_path_equals_cpu(tmp_path, monkeypatch)


def test_partial_rotary_factor_above_1_is_refused_up_front(tmp_path):
    """A rotary wider than the head, which transformers' Phi-3 fails on (its cos wider than q), is refused when the
    config is read (naming the field). (Phi-4-mini's 0.75 runs: tests/test_probes_session55_rotary.py.)"""
    build(tmp_path, partial_rotary_factor=1.5)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 1.5"):
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
def _check_gptq(path, oracle=None):
    """infer's tokens on GPTQ checkpoint `path` equal GPTQModel's own load of `oracle` (default `path`; the split
    layout GPTQModel reads where `path` fuses gate_up_proj)."""
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(path), block_size=4) as llm:
        layer = llm.engine.runner.model.layers[0].self_attn.qkv_proj
        assert layer.names == ["model.layers.0.self_attn.qkv_proj"] * 3 and layer.qweight is not None
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == gptqmodel_greedy(oracle or path, prompts, 8)


def _fuse_gate_up(src, dst):
    """A copy of GPTQ checkpoint `src` with each layer's gate_proj and up_proj stored as one mlp.gate_up_proj (their
    qweight, qzeros and scales side by side along the output; g_idx shared, act-order off)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for key in [k for k in tensors if ".mlp.gate_proj." in k]:
        up = key.replace("gate_proj", "up_proj")
        gate_t, up_t = tensors.pop(key), tensors.pop(up)
        both = gate_t if key.endswith("g_idx") else torch.cat([gate_t, up_t], dim=-1)
        tensors[key.replace("gate_proj", "gate_up_proj")] = both.contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@needs_gptqmodel
def test_infer_quantize_writes_a_phi3_gptq_checkpoint_equal_to_gptqmodels_load_and_convert_takes_it(tmp_path):
    build(tmp_path / "f")
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    names = load_file(out / "model.safetensors").keys()
    assert "model.layers.0.self_attn.qkv_proj.qweight" in names  # quantized as one
    assert "model.layers.0.mlp.gate_up_proj.qweight" in names  # GPTQModel unfuses the MLP; infer writes it fused
    split = split_gate_up(out, tmp_path / "split")  # the layout GPTQModel saves and reads
    _check_gptq(out, split)
    prompts = random_prompts(512, (9,), seed=5)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(str(split)) as a, LLM(str(out)) as b:
        assert a.generate(prompts, params)[0].token_ids == b.generate(prompts, params)[0].token_ids
    res = CliRunner().invoke(app, ["convert", str(out), "-o", str(tmp_path / "c")])  # copied tensor by tensor
    assert res.exit_code == 0, res.output
    prompts = random_prompts(512, (6,), seed=2)
    with LLM(str(tmp_path / "c")) as a, LLM(str(out)) as b:
        assert a.generate(prompts, params)[0].token_ids == b.generate(prompts, params)[0].token_ids


@needs_gptqmodel
def test_gptqmodel_act_order_asymmetric_phi3_checkpoint_equals_gptqmodels_load(tmp_path):
    build(tmp_path / "f", seed=1)
    path = make_gptqmodel_checkpoint(tmp_path / "f", tmp_path / "q", bits=4, group_size=32, desc_act=True, sym=False,
                                     seq_len=32)
    _check_gptq(path)


# ------------------------------------------------------------------------------------------------------- LoRA
PHI3_ALL = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=PHI3_ALL),
            "qkv4": dict(r=4, lora_alpha=4, target_modules=["qkv_proj", "gate_up_proj"])}


@pytest.fixture(scope="module")
def phi3_lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3lora")
    build(root / "base")
    return base_and_adapters(root, ADAPTERS)


def test_peft_adapters_on_the_fused_modules_equal_peft_alone_and_mixed(phi3_lora):
    base, hf, paths = phi3_lora
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (5, 12, 8), seed=6), ["all8", None, "qkv4"])


def test_lora_validate_accepts_a_phi3_adapter_and_names_wrong_shapes(phi3_lora, tmp_path):
    base, hf, paths = phi3_lora
    check_lora_validate_ok(base, paths["all8"])
    bad = tmp_path / "bad"
    shutil.copytree(paths["qkv4"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0.self_attn.qkv_proj.lora_B" in k)
    tensors[key] = tensors[key][:64].clone()  # q's rows only: an adapter of Llama's q_proj width
    save_file(tensors, bad / "adapter_model.safetensors")
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(bad), "--verbose"])
    assert res.exit_code != 0
    assert "qkv_proj" in res.output and "64 -> 64" in res.output and "64 -> 128" in res.output, res.output


def test_an_adapter_of_llama_projections_is_refused_on_a_phi3_base(phi3_lora, tmp_path):
    from infer.lora.adapter import adapter_problems
    base, hf, paths = phi3_lora
    src = load_file(paths["all8"] / "adapter_model.safetensors")
    renamed = {k.replace("qkv_proj", "q_proj"): v for k, v in src.items() if "qkv_proj" in k}
    (tmp_path / "a").mkdir()
    save_file(renamed, tmp_path / "a" / "adapter_model.safetensors")
    cfg = json.loads((paths["all8"] / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj"]
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    problems = adapter_problems("a", tmp_path / "a", AutoConfig.from_pretrained(base))
    assert [p.message for p in problems] == [
        "adapts model.layers.0.self_attn.q_proj (and 1 more modules), which the base model does not have (its phi3 "
        "layers have qkv_proj, o_proj, gate_up_proj, down_proj)"]
    for f in (tmp_path / "a").glob("*.safetensors"):  # target_modules alone, no tensors of it: named the same way
        save_file({k.replace("q_proj", "o_proj"): v for k, v in renamed.items()}, f)
    problems = adapter_problems("a", tmp_path / "a", AutoConfig.from_pretrained(base))
    assert any("targets ['q_proj'], which the base model does not have" in p.message for p in problems), problems


# ---------------------------------------------------------------------------------------------- serve, warmup
def test_serve_completions_on_phi3(phi3_lora):
    base, hf, _ = phi3_lora
    prompt = random_prompts(512, (7,), seed=8)[0]
    want = hf_greedy(hf, [prompt], 5)[0]
    assert served_completion_text(base, "phi3", prompt, 5) == hf_tokenizer(base).decode(want)


def hf_tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def test_builtin_tiny_phi3_runs_and_warmup_sizes_it_as_llama_of_its_shapes():
    """tiny-phi3 has tiny-llama's shapes: the fused checkpoint holds the same weights, and `infer warmup` counts
    them alike (the CPU prepacked copy of every fused projection too)."""
    assert BUILTIN_MODELS["tiny-phi3"].config == BUILTIN_MODELS["tiny-llama"].config
    path = ensure_builtin("tiny-phi3")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    sizes = {}
    for name in ("tiny-phi3", "tiny-llama"):
        res = CliRunner().invoke(app, ["warmup", name, "--estimate", "--json", "--max-length", "256"])
        assert res.exit_code == 0, res.output
        sizes[name] = json.loads(res.stdout.strip().splitlines()[-1])["weights_bytes"]
    assert sizes["tiny-phi3"] == sizes["tiny-llama"]
    hf = hf_float(path)
    prompt = random_prompts(512, (6,), seed=1)[0]
    with LLM("tiny-phi3") as llm:
        assert llm.generate([prompt], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].token_ids == \
            hf_greedy(hf, [prompt], 5)[0]


@needs_gptqmodel
def test_int4_kernel_path_with_mixed_adapters_interpreted_equals_the_cpu_path(phi3_lora, tmp_path, monkeypatch):
    """GPTQ Phi-3 (fused qkv_proj cut into the kernel's q|k|v columns, gate|up with silu_and_mul in the int4
    epilogue) with adapters on the fused modules beside a base-only row, through the Triton kernels (interpreted)
    and emulated decode graphs (decode_attention adds the qkv delta): the CPU path's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    base, _, paths = phi3_lora
    check_int4_kernels_with_mixed_adapters(base, paths, tmp_path, monkeypatch, ["all8", None, "qkv4"],
                                           act_in_gate_up=True)


def test_the_demo_makes_its_adapters_for_tiny_phi3_on_the_fused_modules(tmp_path):
    """The demo's adapters name Llama's projections: on tiny-phi3 (whose q|k|v and gate|up are fused) peft found no
    such module; they now target the fused ones, and the adapter fits the base."""
    from infer.cli.demo import ALL_PROJECTIONS, make_random_adapter
    from infer.lora.adapter import adapter_problems
    base = ensure_builtin("tiny-phi3")
    make_random_adapter(base, tmp_path / "a", 4, ALL_PROJECTIONS, 1)
    targets = json.loads((tmp_path / "a" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == sorted(PHI3_ALL)
    assert adapter_problems("a", tmp_path / "a", AutoConfig.from_pretrained(base)) == []


def test_the_lora_benchmark_makes_adapters_of_every_phi3_projection(tmp_path):
    """infer.bench.lora_compare adapts every attention and MLP projection: on tiny-phi3 peft adapted only o_proj
    and down_proj of Llama's names (q/k/v and gate/up are fused there)."""
    from infer.bench.lora_compare import make_adapters
    path = make_adapters("tiny-phi3", tmp_path, num=1, rank=4)["lora0"]
    targets = json.loads((tmp_path / "lora0" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == sorted(PHI3_ALL) and path == str(tmp_path / "lora0")


def test_an_awq_phi3_checkpoint_loads_its_fused_modules_exactly(tmp_path):
    """AWQ packs qweight along the output too (8 columns a word): a fused qkv_proj / gate_up_proj of an AWQ 'gemm'
    checkpoint is cut at word boundaries into q|k|v and gate|up, and every layer dequantizes to the format's weight
    bit for bit (it was refused: the qweight's packed width was taken for the output width)."""
    from infer.models.loader import load_model
    from test_probes_session53_awq import GROUP, awq_dequantize, awq_pack, awq_quantize
    build(tmp_path / "f", seed=2)
    tensors, ref = {}, {}
    for name, t in load_file(tmp_path / "f" / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not module.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            tensors[name] = t
            continue
        q, z, s = awq_quantize(t)
        tensors.update({f"{module}.qweight": awq_pack(q), f"{module}.qzeros": awq_pack(z), f"{module}.scales": s})
        ref[module] = awq_dequantize(q, z, s).float()
    out = tmp_path / "awq"
    shutil.copytree(tmp_path / "f", out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                  "version": "gemm"}
    (out / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(out, torch.float32, torch.device("cpu"))
    for i, layer in enumerate(model.layers):
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert torch.equal(linear.weight, ref[linear.names[0]]), linear.names[0]
