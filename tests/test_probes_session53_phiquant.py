"""Session 53: `infer quantize` of a Phi-3 writes its MLP as one gate_up_proj (transformers' Phi3MLP, vLLM's Phi-3),
not GPTQModel's gate_proj and up_proj apart: transformers loads it with the tokens of infer's load and of GPTQModel's
own load of the split form. With --desc-act (gate and up with different g_idx) the split layout stays, with a note
naming --no-desc-act."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.quant.quantize import FUSED_MLP_NOTE, QuantizeOptions, fuse_gate_up

from helpers import random_prompts
from quant_helpers import gptqmodel_greedy, needs_gptqmodel, split_gate_up
from test_gptq_engine import hf_gptq_greedy
from test_probes_session53_phi3 import build

ARGS = ["--group-size", "32", "--num-samples", "8", "--seq-len", "32"]


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@needs_gptqmodel
def test_quantized_phi3_has_gate_up_proj_and_loads_in_transformers_as_in_infer_and_gptqmodel(tmp_path):
    build(tmp_path / "f")
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), *ARGS,
                                   "--max-shard-size", "100KB"])
    assert res.exit_code == 0, res.output
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]  # sharded: index rewritten
    names = _tensors(out).keys()
    assert set(index) == set(names)
    assert "model.layers.1.mlp.gate_up_proj.qweight" in names and "model.layers.1.mlp.gate_up_proj.g_idx" in names
    assert not [n for n in names if ".gate_proj." in n or ".up_proj." in n]
    prompts = random_prompts(512, (4, 11, 19), seed=7)
    with LLM(str(out), block_size=4) as llm:
        mine = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert hf_gptq_greedy(out, prompts, 6) == mine
    assert gptqmodel_greedy(split_gate_up(out, tmp_path / "split"), prompts, 6) == mine


@needs_gptqmodel
def test_act_order_phi3_keeps_the_split_layout_and_says_so(tmp_path):
    build(tmp_path / "f", num_hidden_layers=1)
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), *ARGS, "--desc-act"])
    assert res.exit_code == 0, res.output
    names = load_file(out / "model.safetensors").keys()
    assert "model.layers.0.mlp.gate_proj.g_idx" in names and "model.layers.0.mlp.up_proj.g_idx" in names
    text = " ".join(res.output.split())
    assert "--no-desc-act" in text and "vLLM" in text and "transformers" in text


def _fake_checkpoint(path, modules):
    """A one-layer Phi-3 GPTQ checkpoint's MLP tensors (4 bits, groups of 32, in 64, out 128 per half)."""
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name in ("gate_proj", "up_proj"):
        p = f"model.layers.0.mlp.{name}."
        tensors.update({p + "qweight": torch.randint(-2**31, 2**31 - 1, (8, 128), generator=g, dtype=torch.int32),
                        p + "qzeros": torch.randint(-2**31, 2**31 - 1, (2, 16), generator=g, dtype=torch.int32),
                        p + "scales": torch.rand(2, 128, generator=g).half(),
                        p + "g_idx": torch.arange(64, dtype=torch.int32) // 32})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    qc = {"bits": 4, "group_size": 32, "desc_act": False, "quant_method": "gptq", "modules_in_block_to_quantize":
          [modules]}
    (path / "quantize_config.json").write_text(json.dumps(qc))
    (path / "config.json").write_text(json.dumps({"model_type": "phi3", "intermediate_size": 128,
                                                  "quantization_config": qc}))
    return tensors


def test_fuse_concatenates_gate_first_and_renames_the_configs_modules(tmp_path):
    modules = ["self_attn.qkv_proj", "mlp.gate_proj", "mlp.up_proj"]
    before = _fake_checkpoint(tmp_path / "c", modules)
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    notes = fuse_gate_up(tmp_path / "c", config, QuantizeOptions(group_size=32))
    assert notes == [FUSED_MLP_NOTE.format(arch="Phi-3")]
    after = load_file(tmp_path / "c" / "model.safetensors")
    p = "model.layers.0.mlp."
    for t in ("qweight", "qzeros", "scales"):
        assert torch.equal(after[p + "gate_up_proj." + t], torch.cat([before[p + "gate_proj." + t],
                                                                      before[p + "up_proj." + t]], dim=-1))
    assert torch.equal(after[p + "gate_up_proj.g_idx"], before[p + "gate_proj.g_idx"]) and len(after) == 4
    for name, key in (("quantize_config.json", None), ("config.json", "quantization_config")):
        data = json.loads((tmp_path / "c" / name).read_text())
        qc = data[key] if key else data
        assert qc["modules_in_block_to_quantize"] == [["self_attn.qkv_proj", "mlp.gate_up_proj"]]


def test_fuse_keeps_gate_and_up_apart_when_their_g_idx_differ(tmp_path):
    before = _fake_checkpoint(tmp_path / "c", ["mlp.gate_proj", "mlp.up_proj"])
    before["model.layers.0.mlp.up_proj.g_idx"] = before["model.layers.0.mlp.up_proj.g_idx"].flip(0).contiguous()
    save_file(before, tmp_path / "c" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    notes = fuse_gate_up(tmp_path / "c", config, QuantizeOptions(group_size=32))
    assert len(notes) == 1 and "--no-desc-act" in notes[0]
    assert load_file(tmp_path / "c" / "model.safetensors").keys() == before.keys()
