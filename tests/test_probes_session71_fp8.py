"""Session 71: block-scaled FP8 checkpoints (transformers' FineGrainedFP8Config, quant_method "fp8": the hub's
DeepSeek-V3/R1, Qwen3 -FP8, MiniMax-M2, GLM-4.5-FP8), which infer refused ("quant_method 'fp8' is not supported")
and `infer convert` copied with their FP8 quantization_config over float weights. infer now dequantizes each FP8
weight at load (quant.fp8: fp8 x its block's weight_scale_inv, in float32, rounded to the model's dtype; partial
edge blocks as vLLM reads them), so `infer run`/`serve`/`warmup` take such a folder as its float model, and `infer
convert SRC -o FLOAT` writes that float model a weight file at a time (then `infer quantize FLOAT` makes it int4).
Checked against transformers' own dequantization where every dimension is a whole number of blocks, and against
a block-by-block reference where a block is partial (DeepSeek-V3's q_a_proj here, its kv_a_proj_with_mqa on the
hub), which transformers dequantizes with the wrong block size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import LLM
from infer.errors import ConfigError, ModelLoadError, UnsupportedModelError
from infer.models.tiny import ensure_builtin

from helpers import greedy_each, greedy_tokens, random_prompts

PROMPTS = random_prompts(512, (4, 11, 23), seed=11)


def fp8_checkpoint(src, dst, block=(32, 32), static: bool = False) -> Path:
    """A copy of the float model `src` in `dst` with every decoder layer's projection (the experts' too, each apart,
    as the hub stores them) stored float8_e4m3fn beside a float32 weight_scale_inv per block of `block` (the
    block's largest magnitude over 448, e4m3's largest), the rest as it was; config.json's quantization_config the
    one transformers' FineGrainedFP8Config writes (`static`: its static activation scheme, an activation_scale
    beside each weight)."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
        (dst / f.name).unlink()
    out = {}
    for name, w in tensors.items():
        if not (name.endswith("_proj.weight") and w.dim() == 2 and ".layers." in name):
            out[name] = w
            continue
        rows, cols = w.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        scale = torch.empty(grid)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(grid[0]):
            for j in range(grid[1]):
                part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
                scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
                q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                    (part / scale[i, j]).to(torch.float8_e4m3fn)
        out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
        if static:
            out[name.removesuffix("weight") + "activation_scale"] = torch.tensor(0.05)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "static" if static else "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def reference_dequantized(folder, block) -> dict[str, torch.Tensor]:
    """Every FP8 weight of `folder` dequantized block by block (element (r, c) times scale [r // rows, c // cols]),
    a loop apart from infer's code."""
    tensors = load_file(Path(folder) / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        scale = tensors[name.removesuffix("weight") + "weight_scale_inv"]
        w = t.float()
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j]
        out[name] = w
    return out


@pytest.mark.parametrize("name, static", [("tiny-llama", True), ("tiny-qwen3-moe", False)])
def test_an_fp8_checkpoint_gives_transformers_tokens_on_the_same_checkpoint(tmp_path, name, static):
    """Whole blocks (every dimension a multiple of 32): infer's greedy tokens (float32) of the FP8 folder equal
    transformers' loading the same folder (its own dequantization on a CPU), the experts' too, and with the static
    activation scheme's activation scales (read by neither); `warmup --estimate` counts the weights as loaded
    (dequantized, the scales dropped); the tokens are not the float source's."""
    from helpers import estimated_plan
    from transformers import AutoModelForCausalLM

    from infer.memory.sizes import weights_bytes
    folder = fp8_checkpoint(ensure_builtin(name), tmp_path / "fp8", static=static)
    plan = estimated_plan(str(folder), "--dtype", "float32")
    with LLM(str(folder), block_size=4, dtype="float32") as llm:
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)
        got = greedy_tokens(llm, PROMPTS, 8)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    assert got == greedy_each(hf, PROMPTS, 8)
    assert len({t for tokens in got for t in tokens}) > 6
    with LLM(name, block_size=4, dtype="float32") as llm:
        assert greedy_tokens(llm, PROMPTS, 8) != got


def test_partial_blocks_and_the_converted_float_model(tmp_path):
    """DeepSeek-V3 (MLA, experts) in blocks of 32, its q_a_proj's 48 rows a block and a half: infer's tokens of the
    FP8 folder equal transformers' on the float model of the reference's dequantized weights; `infer convert`
    writes exactly those weights (in shards of 200 KB, an index), no quantization_config, the scales gone, and
    infer reads the copy as it read the FP8 folder."""
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from infer.cli.main import app
    src = ensure_builtin("tiny-deepseek-v3")
    folder = fp8_checkpoint(src, tmp_path / "fp8")
    ref = reference_dequantized(folder, (32, 32))
    assert ref["model.layers.0.self_attn.q_a_proj.weight"].shape[0] % 32
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.load_state_dict({**hf.state_dict(), **{k: v for k, v in ref.items() if k in hf.state_dict()}})
    with torch.no_grad():  # (the experts: stacked by transformers 5, apart in the checkpoint)
        for i, layer in enumerate(hf.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for e in range(experts.gate_up_proj.shape[0]):
                p = f"model.layers.{i}.mlp.experts.{e}."
                experts.gate_up_proj[e].copy_(torch.cat([ref[p + "gate_proj.weight"], ref[p + "up_proj.weight"]]))
                experts.down_proj[e].copy_(ref[p + "down_proj.weight"])
    with LLM(str(folder), block_size=4, dtype="float32") as llm:
        got = greedy_tokens(llm, PROMPTS, 8)
    assert got == greedy_each(hf, PROMPTS, 8)
    res = CliRunner().invoke(app, ["convert", str(folder), "-o", str(tmp_path / "float"), "--max-shard-size",
                                   "200KB"])
    assert res.exit_code == 0 and "FP8 weights dequantized" in res.output, res.output
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    index = json.loads((tmp_path / "float" / "model.safetensors.index.json").read_text())["weight_map"]
    written = {}
    for f in sorted(set(index.values())):
        written.update(load_file(tmp_path / "float" / f))
    assert not any(k.endswith("_scale_inv") for k in written)
    assert all(torch.equal(written[k], v) for k, v in ref.items())
    with LLM(str(tmp_path / "float"), block_size=4, dtype="float32") as llm:
        assert greedy_tokens(llm, PROMPTS, 8) == got


def test_one_scale_per_tensor(tmp_path):
    """weight_block_size null: one weight_scale_inv per weight (the tensor's largest magnitude over 448; a scalar or
    one element); infer's tokens equal transformers' on the float model of weight x scale."""
    from transformers import AutoModelForCausalLM
    src = ensure_builtin("tiny-llama")
    folder = fp8_checkpoint(src, tmp_path / "fp8", block=(256, 256))  # (one block covers every tiny weight)
    state = load_file(folder / "model.safetensors")
    for i, name in enumerate(sorted(n for n in state if n.endswith("_scale_inv"))):  # (stored [] or [1])
        state[name] = state[name].reshape(() if i % 2 else (1,))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _edited(folder, qc={"weight_block_size": None})
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.load_state_dict({**hf.state_dict(), **{n: t.float() * state[n + "_scale_inv"] for n, t in state.items()
                                               if t.dtype == torch.float8_e4m3fn}})
    with LLM(str(folder), block_size=4, dtype="float32") as llm:
        assert greedy_tokens(llm, PROMPTS, 8) == greedy_each(hf, PROMPTS, 8)


def test_e8m0_scales_are_powers_of_two():
    """Scales stored as E8M0 exponents (uint8 bytes, float8_e8m0fnu) dequantize as 2 ** (byte - 127) a block, the
    same weights as their float32 values; a partial edge block takes its own scale."""
    from infer.quant.fp8 import dequantize
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(5, 3, generator=g) * 100).to(torch.float8_e4m3fn)
    exps = torch.tensor([[120, 130], [127, 100], [140, 127]], dtype=torch.uint8)
    want = w.float() * (exps.float() - 127).exp2().repeat_interleave(2, 0)[:5].repeat_interleave(2, 1)[:, :3]
    assert torch.equal(dequantize(w, exps, (2, 2)), want)
    assert torch.equal(dequantize(w, (exps.float() - 127).exp2().to(torch.float8_e8m0fnu), (2, 2)), want)
    assert torch.equal(dequantize(w, (exps.float() - 127).exp2(), (2, 2)), want)


def _edited(folder, tensors=None, qc=None) -> Path:
    """`folder` with its weights edited by `tensors(dict)` and its quantization_config updated with `qc`."""
    if tensors is not None:
        state = load_file(folder / "model.safetensors")
        tensors(state)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if qc is not None:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(qc)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit, error, match", [
    (lambda s: s.pop(Q + "_scale_inv"), ModelLoadError,
     r"model\.layers\.0\.self_attn\.q_proj\.weight is FP8 but the checkpoint has no "
     r"model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv"),
    (lambda s: s.update({Q + "_scale_inv": torch.ones(2, 1)}), ModelLoadError,
     r"q_proj\.weight_scale_inv has shape \(2, 1\), but model\.layers\.0\.self_attn\.q_proj\.weight \(64, 64\) in "
     r"blocks of \[32, 32\] \(weight_block_size\) takes \(2, 2\)"),
    (lambda s: s.update({Q: s[Q].float()}), ModelLoadError,
     r"q_proj\.weight_scale_inv scales no FP8 weight"),
    ({"fmt": "e5m2"}, UnsupportedModelError, r"FP8 fmt \"e5m2\" is not supported"),
    ({"weight_block_size": [128]}, UnsupportedModelError, r"FP8 weight_block_size \[128\] is not two positive"),
], ids=["no-scale", "scale-shape", "scale-alone", "e5m2", "block"])
def test_a_damaged_fp8_checkpoint_is_refused_naming_the_tensor_or_field(tmp_path, edit, error, match):
    """A weight without its scale, a scale of the wrong grid or without its FP8 weight, an FP8 format or block size
    infer does not read: refused when the folder is read (by `infer run`'s load and the checks before it), naming
    the tensor or the field."""
    folder = fp8_checkpoint(ensure_builtin("tiny-llama"), tmp_path / "fp8")
    _edited(folder, **({"tensors": edit} if callable(edit) else {"qc": edit}))
    with pytest.raises(error, match=match):
        LLM(str(folder), block_size=4)


def test_quantize_and_merge_point_at_the_float_copy(tmp_path):
    """`infer quantize` of an FP8 folder is refused with the `infer convert` that writes its float model;
    `infer convert --merge-lora` into it too (merge into that float copy)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.quant.convert import convert_model
    folder = fp8_checkpoint(ensure_builtin("tiny-llama"), tmp_path / "fp8")
    res = CliRunner().invoke(app, ["quantize", str(folder), "-o", str(tmp_path / "q")])
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "is already quantized (quant_method 'fp8')" in text, res.output
    assert f"infer convert {folder} -o FLOAT` (its FP8 weights dequantized) and quantize FLOAT" in text
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"cannot merge a LoRA adapter into the FP8 checkpoint"):
        convert_model(folder, tmp_path / "m", merge_lora=tmp_path / "ad")
