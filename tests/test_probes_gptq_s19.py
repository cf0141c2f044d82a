"""GPTQ checkpoints as they exist in the wild, against transformers (+ optimum + gptqmodel) on the same weights:
- `modules_in_block_to_quantize` (transformers/optimum's GPTQConfig: the listed decoder-layer linears are int4, the
  others stay float) was ignored: every linear became a GPTQ layer and the float weights were refused ("unexpected
  tensor ...weight in a GPTQ layer"), where transformers runs the checkpoint;
- a quantization config whose bits or group_size is null or not a number crashed with a bare TypeError/ValueError
  (the CLI's handler lets it through as a traceback) instead of an infer error;
- AutoGPTQ's `is_marlin_format: true` and GPTQModel's `pack_dtype` other than int32 (weights in another layout) were
  accepted, and such a checkpoint then failed on a tensor shape with a hint about bits and group_size; a bitsandbytes
  config without quant_method (`load_in_4bit: true`, which transformers still reads as bitsandbytes) was read as
  4-bit GPTQ;
- shape errors said "config.json implies" when the settings came from quantize_config.json (AutoGPTQ-era folders
  have no quantization_config in config.json)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer.errors import ModelLoadError, UnsupportedModelError
from infer.models.tiny import ensure_builtin
from infer.quant import packing
from infer.quant.config import GPTQConfig

from quant_helpers import needs_gptqmodel

PROMPTS = [[5, 17, 99, 230, 41], [9, 8, 7, 6, 5, 4, 3, 2, 1], list(range(40, 73))]
N = 8


def rtn_checkpoint(dst, model="tiny-llama", float_modules=(), qc_extra=None, group=32, sym=False):
    """A GPTQ copy of a built-in model, quantized round-to-nearest (fast), with the decoder-layer linears whose name
    contains one of `float_modules` left in float."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(ensure_builtin(model), dst)
    out = {}
    for name, t in load_file(dst / "model.safetensors").items():
        module = name[: -len(".weight")]
        if ".layers." in name and name.endswith("_proj.weight") and not any(f in name for f in float_modules):
            qw, qz, s, gi = packing.quantize_rtn(t.float(), 4, group, sym)
            out.update({f"{module}.qweight": qw, f"{module}.qzeros": qz, f"{module}.scales": s, f"{module}.g_idx": gi})
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                  "sym": sym, "checkpoint_format": "gptq", **(qc_extra or {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def infer_greedy(path):
    from infer import LLM, SamplingParams
    llm = LLM(str(path), block_size=4)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=N, ignore_eos=True))]


def hf_greedy(path):
    """transformers with the checkpoint's own quantization_config (only the kernel chosen: GPTQModel's exact torch
    one)."""
    from transformers import AutoModelForCausalLM, GPTQConfig as HFGPTQConfig
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                             quantization_config=HFGPTQConfig(bits=4, backend="torch"))
    m.generation_config.eos_token_id = None
    with torch.no_grad():
        return [m.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]


@needs_gptqmodel
@pytest.mark.parametrize("model, float_part, quantized", [
    ("tiny-llama", "mlp", [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]]),
    ("tiny-qwen2", "self_attn", [["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]),
])
def test_modules_in_block_to_quantize_leaves_the_others_float_as_transformers_does(tmp_path, model, float_part,
                                                                                    quantized):
    path = rtn_checkpoint(tmp_path / "q", model, float_modules=(float_part,),
                          qc_extra={"modules_in_block_to_quantize": quantized})
    outs = infer_greedy(path)
    assert outs == hf_greedy(path)
    assert len({t for o in outs for t in o}) > 4  # the comparison is not idle (no one-token loop)


def test_modules_in_block_to_quantize_splitting_a_merged_layer_is_refused_naming_both(tmp_path):
    from infer.models.loader import load_model
    path = rtn_checkpoint(tmp_path / "q", float_modules=("k_proj", "v_proj", "o_proj", "mlp"),
                          qc_extra={"modules_in_block_to_quantize": [["self_attn.q_proj"]]})
    with pytest.raises(UnsupportedModelError, match=r"quantizes model\.layers\.0\.self_attn\.q_proj but not "
                                                     r"model\.layers\.0\.self_attn\.k_proj"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_modules_in_block_to_quantize_round_trips_and_must_be_lists_of_names():
    cfg = GPTQConfig.from_dict({"bits": 4, "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.up_proj"]]},
                               "config.json")
    assert cfg.quantizes("model.layers.3.mlp.up_proj") and not cfg.quantizes("model.layers.3.mlp.down_proj")
    assert GPTQConfig.from_dict(cfg.to_dict(), "x") == cfg
    assert GPTQConfig.from_dict({"bits": 4}, "x").quantizes("model.layers.0.mlp.down_proj")
    with pytest.raises(ModelLoadError, match="modules_in_block_to_quantize .* is not a list of lists"):
        GPTQConfig.from_dict({"bits": 4, "modules_in_block_to_quantize": ["self_attn.q_proj"]}, "config.json")


@pytest.mark.parametrize("d, message", [({"bits": None}, "bits null is not an integer"),
                                        ({"group_size": None}, "group_size null is not an integer"),
                                        ({"group_size": "abc"}, 'group_size "abc" is not an integer'),
                                        ({"bits": 4.5}, "bits 4.5 is not an integer")])
def test_a_damaged_bits_or_group_size_is_a_load_error_not_a_crash(tmp_path, d, message):
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, **d}))
    with pytest.raises(ModelLoadError, match=message):
        GPTQConfig.from_model_dir(tmp_path)


@pytest.mark.parametrize("d, message", [({"is_marlin_format": True}, "is_marlin_format"),
                                        ({"pack_dtype": "int16"}, "pack_dtype 'int16'"),
                                        ({"pack_dtype": "torch.int64"}, "pack_dtype 'int64'"),
                                        ({"quant_method": None, "load_in_4bit": True}, "'bitsandbytes'")])
def test_weights_in_another_packing_are_refused_by_name(d, message):
    with pytest.raises(UnsupportedModelError, match=message):
        GPTQConfig.from_dict({"quant_method": "gptq", "bits": 4, "group_size": 128, **d}, "quantize_config.json")
    assert GPTQConfig.from_dict({"bits": 4, "pack_dtype": "int32", "is_marlin_format": False}, "x").bits == 4


def test_errors_name_quantize_config_json_when_the_config_came_from_it(tmp_path):
    """An AutoGPTQ-era folder (TheBloke style: the settings only in quantize_config.json, config.json without
    quantization_config) whose group_size disagrees with its tensors, and a float folder with a stray
    quantize_config.json: the errors blamed config.json, which has no quantization settings at all."""
    from infer.models.loader import load_model
    path = rtn_checkpoint(tmp_path / "q", group=32)
    cfg = json.loads((path / "config.json").read_text())
    qc = {**cfg.pop("quantization_config"), "group_size": 64, "model_file_base_name": "gptq_model-4bit-64g"}
    qc.pop("quant_method")
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "quantize_config.json").write_text(json.dumps(qc))
    (path / "model.safetensors").rename(path / "gptq_model-4bit-64g.safetensors")
    with pytest.raises(ModelLoadError, match=r"qzeros has shape \(4, 8\) but quantize_config.json implies \(2, 8\)"
                                             r".*quantize_config.json: bits 4, group_size 64"):
        load_model(path, torch.float32, torch.device("cpu"))
    stray = tmp_path / "float"
    shutil.copytree(ensure_builtin("tiny-llama"), stray)
    (stray / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(ModelLoadError, match=r"weight in a GPTQ layer .*quantize_config.json"):
        load_model(stray, torch.float32, torch.device("cpu"))
