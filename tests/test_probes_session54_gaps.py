"""Session 54: gaps left from the Phi-3 and AWQ work (Phi-3 adapters without target_modules, the demo's adapter
summary on tiny-phi3, split gate/up GPTQ checkpoints with `dynamic` rules naming one half, AWQ/GPTQ scales that do not
fit float16, ...), each against what peft, GPTQModel or transformers do."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli import demo as demo_module
from infer.cli.main import app
from infer.errors import LoRAError
from infer.lora.adapter import adapter_problems

from helpers import random_prompts
from lora_helpers import hf_float, save_adapter
from quant_helpers import gptqmodel_greedy, make_gptqmodel_checkpoint, needs_gptqmodel
from test_gptq_engine import hf_gptq_greedy
from test_probes_session53_phi3 import PHI3_ALL, build

QUANTIZE = ["--group-size", "32", "--num-samples", "8", "--seq-len", "32"]


# --------------------------------------------------------------------------- a Phi-3 adapter without target_modules
def test_a_phi3_adapter_without_target_modules_is_refused_naming_phi3s_modules_as_peft_refuses_it(tmp_path):
    """peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING has no phi3 entry: PeftModel.from_pretrained refuses
    a config without target_modules on a Phi-3 ("Please specify `target_modules`"). infer said peft adapts its
    default q_proj, v_proj (Llama's, which a Phi-3 does not have)."""
    build(tmp_path / "base", num_hidden_layers=1)
    path = save_adapter(hf_float(tmp_path / "base"), tmp_path / "a", seed=1, lora_dropout=0.0, r=4, lora_alpha=8,
                        target_modules=PHI3_ALL)
    cfg = json.loads((path / "adapter_config.json").read_text())
    del cfg["target_modules"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    problems = adapter_problems("a", path, AutoConfig.from_pretrained(tmp_path / "base"))
    assert len(problems) == 1, problems
    text = str(problems[0])
    assert "no target_modules" in text and "Please specify `target_modules`" in text
    assert "qkv_proj, o_proj, gate_up_proj, down_proj" in text and "q_proj" not in text.replace("qkv_proj", "")
    with pytest.raises(LoRAError, match="peft has no default for a phi3 base"):
        LLM(str(tmp_path / "base"), loras={"a": str(path)})


# --------------------------------------------------------------------------- the demo's adapter summary
class _Steps:
    def __init__(self):
        self.ran = []

    def run(self, title, args, summary, module="infer.cli"):
        self.ran.append((title, args, summary))


def test_the_demo_names_the_modules_its_adapters_target_on_tiny_phi3(tmp_path, capsys):
    """On tiny-phi3 the support adapter targets the fused qkv_proj (base_targets), not q/v."""
    for model, folder, want in (("tiny-phi3", "tiny-phi3-adapters", "support (rank 8, qkv_proj)"),
                                ("tiny-llama", "adapters", "support (rank 8, q/v)")):
        out = tmp_path / model
        for name in demo_module.ADAPTERS:
            (out / folder / name).mkdir(parents=True)
            (out / folder / name / "adapter_config.json").write_text("{}")
        demo_module._model_steps(_Steps(), out, model, demo_module.SIZES[True])
        err = capsys.readouterr().err
        assert f"adapters: reusing {want} and legal (rank 16, all projections)" in err, err
        (out / folder / "support" / "adapter_config.json").unlink()
        steps = _Steps()
        demo_module._model_steps(steps, out, model, demo_module.SIZES[True])
        summary = dict((t, s) for t, _, s in steps.ran)["adapters"]
        assert summary("").startswith(want), summary("")


# --------------------------------------------------------------------------- GPTQModel.load and infer's fused Phi-3
@needs_gptqmodel
def test_gptqmodel_load_refuses_the_fused_phi3_checkpoint_that_transformers_loads_and_quantize_says_so(tmp_path):
    """GPTQModel's Phi-3 definition names mlp.gate_proj and mlp.up_proj (it unfuses Phi3MLP) and its load requires
    their qweight: the fused gate_up_proj infer quantize writes (transformers' and vLLM's layout, which transformers
    loads: tests/test_probes_session53_phiquant.py) is GPTQModel's limitation. The closing note says so."""
    from gptqmodel import BACKEND, GPTQModel
    build(tmp_path / "f", num_hidden_layers=1)
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), *QUANTIZE])
    assert res.exit_code == 0, res.output
    assert "model.layers.0.mlp.gate_up_proj.qweight" in load_file(out / "model.safetensors")
    text = " ".join(res.output.split())
    assert "GPTQModel.load reads only its own split layout" in text and "vLLM" in text, text
    with pytest.raises(ValueError, match=r"Missing required quantized weights.*mlp\.gate_proj\.qweight"):
        GPTQModel.load(str(out), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    prompts = random_prompts(512, (5, 9), seed=3)
    with LLM(str(out), block_size=4) as llm:
        mine = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))]
    assert hf_gptq_greedy(out, prompts, 4) == mine


# --------------------------------------------------------------------------- split gate/up with `dynamic` rules
SERVED = {"both-8-bit": {r"+:.*\.gate_proj": {"bits": 8}, r"+:.*\.up_proj": {"bits": 8}},
          "both-float": {r"-:.*\.gate_proj": {}, r"-:.*\.up_proj": {}}}


@needs_gptqmodel
@pytest.mark.parametrize("case", SERVED)
def test_a_split_phi3_checkpoint_whose_dynamic_rules_name_gate_and_up_apart_loads_as_gptqmodel_loads_it(tmp_path,
                                                                                                       case):
    """GPTQModel matches `dynamic` against mlp.gate_proj and mlp.up_proj, which it writes apart: rules that treat
    the two alike (each named on its own: `.*\\.up_proj` does not match gate_up_proj) give the one gate_up_proj
    those settings. infer matched them against gate_up_proj and read the halves with the base settings."""
    build(tmp_path / "f", num_hidden_layers=1, seed=4)
    path = make_gptqmodel_checkpoint(tmp_path / "f", tmp_path / "q", bits=4, group_size=32, seq_len=32,
                                     dynamic=SERVED[case])
    assert "model.layers.0.mlp.up_proj." + ("qweight" if case == "both-8-bit" else "weight") in load_file(
        path / "model.safetensors")
    prompts = random_prompts(512, (4, 11, 17), seed=9)
    with LLM(str(path), block_size=4) as llm:
        gate_up = llm.engine.runner.model.layers[0].mlp.gate_up_proj
        assert (gate_up.method.config.bits == 8) if case == "both-8-bit" else not hasattr(gate_up.method, "config")
        mine = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert mine == gptqmodel_greedy(path, prompts, 6, every_float=True)


REFUSED = {"up-left-float": ({r"-:.*up_proj": {}}, r"quantizes model\.layers\.0\.mlp\.gate_proj but not "
                             r"model\.layers\.0\.mlp\.up_proj \(config\.json's dynamic rule '-:\.\*up_proj' "
                             r"leaves it in float\)"),
           "gate-8-bit": ({r"+:.*gate_proj": {"bits": 8}}, r"quantizes model\.layers\.0\.mlp\.gate_proj and "
                          r"model\.layers\.0\.mlp\.up_proj with different settings: bits 8 \(config\.json's "
                          r"dynamic rule '\+:\.\*gate_proj' sets \{\"bits\": 8\}\) and bits 4")}


@needs_gptqmodel
@pytest.mark.parametrize("case", REFUSED)
def test_a_split_phi3_checkpoint_whose_halves_differ_is_refused_naming_the_module_and_the_rule(tmp_path, case):
    """gate_proj and up_proj quantized differently (one in float, or another width) cannot be one gate_up_proj
    matmul: refused naming both modules and the rule, not a shape error about gate_up_proj."""
    from infer.errors import UnsupportedModelError
    build(tmp_path / "f", num_hidden_layers=1, seed=4)
    rules, message = REFUSED[case]
    path = make_gptqmodel_checkpoint(tmp_path / "f", tmp_path / "q", bits=4, group_size=32, seq_len=32,
                                     dynamic=rules)
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(str(path))
    res = CliRunner().invoke(app, ["warmup", str(path), "--estimate"])  # refused as a load refuses it (session 55)
    assert res.exit_code not in (0, 1) and re.search(message, " ".join(res.output.split())), res.output


# --------------------------------------------------------------------------- AWQ (and GPTQ) bfloat16 scales
def _bf16_awq(tmp_path, tweak=None):
    """The session-53 reference AWQ checkpoint of a tiny Llama with every scales tensor stored as bfloat16 (as a
    checkpoint saved from a bfloat16 model has them); `tweak(tensors)` edits them before they are written."""
    from test_probes_session53_awq import float_model, write_awq
    out = tmp_path / "awq"
    write_awq(float_model(tmp_path), out)
    tensors = load_file(out / "model.safetensors")
    tensors = {k: v.bfloat16() if k.endswith(".scales") else v for k, v in tensors.items()}
    if tweak:
        tweak(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out, tensors


def test_bf16_awq_scales_are_kept_exactly_by_the_repack_and_convert(tmp_path):
    """bfloat16 scales of float16's normal range convert to the float16 scales a GPTQ layer holds exactly: every
    layer dequantizes to GPTQModel's AWQ dequantization (dequantize_gemm, float16 as its torch kernel computes for a
    float32 or float16 model), and `infer convert --to gptq` writes the bfloat16 scales unchanged."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from infer.models.layers import MergedLinear
    from infer.models.loader import load_model
    path, tensors = _bf16_awq(tmp_path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    seen = 0
    for layer in model.modules():
        if isinstance(layer, MergedLinear):
            want = torch.cat([dequantize_gemm(tensors[f"{n}.qweight"], tensors[f"{n}.qzeros"],
                                              tensors[f"{n}.scales"].half(), 4, 32).t() for n in layer.names])
            assert torch.equal(layer.weight, want.float()), layer.names
            seen += 1
    assert seen == 8  # two layers: qkv, o, gate_up, down
    res = CliRunner().invoke(app, ["convert", str(path), "-o", str(tmp_path / "gptq"), "--to", "gptq"])
    assert res.exit_code == 0, res.output
    out = load_file(tmp_path / "gptq" / "model.safetensors")
    for name in (k for k in tensors if k.endswith(".scales")):
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], tensors[name]), name


def test_bf16_scales_beyond_float16s_range_are_refused_naming_the_tensor(tmp_path):
    """A bfloat16 scale above 65504 became inf in the float16 scales infer holds (the layer's outputs inf or NaN,
    loaded without a word)."""
    def big(tensors):
        tensors["model.layers.1.mlp.up_proj.scales"][0, 3] = 1e5
    path, _ = _bf16_awq(tmp_path, big)
    from infer.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.scales holds scales up to 9\.98e\+04, "
                                             r"beyond float16's range"):
        LLM(str(path))


def test_bf16_scales_below_float16s_normal_range_are_named_in_a_warning(tmp_path, caplog):
    def tiny(tensors):
        tensors["model.layers.0.self_attn.k_proj.scales"][1, :5] = 3e-7
    path, _ = _bf16_awq(tmp_path, tiny)
    with caplog.at_level("WARNING", logger="infer"):
        LLM(str(path)).close()
    assert any("model.layers.0.self_attn.k_proj.scales: 5 bfloat16 scales below float16's normal range" in r.message
               for r in caplog.records), caplog.text


# --------------------------------------------------------------------------- split gate/up: messages name the file's
@pytest.fixture(scope="module")
def split_phi3(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    build(root / "f", num_hidden_layers=1, seed=5)
    return make_gptqmodel_checkpoint(root / "f", root / "q", bits=4, group_size=32, seq_len=32)


BROKEN = {
    "short-scales": (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.scales",
                                             t["model.layers.0.mlp.up_proj.scales"][:, :64].clone()),
                     r"^model\.layers\.0\.mlp\.up_proj\.scales has shape \(2, 64\)"),
    "no-qzeros": (lambda t: t.pop("model.layers.0.mlp.up_proj.qzeros"),
                  r"no tensor model\.layers\.0\.mlp\.up_proj\.qzeros"),
    "no-g_idx": (lambda t: t.pop("model.layers.0.mlp.up_proj.g_idx"),
                 r"no tensor model\.layers\.0\.mlp\.up_proj\.g_idx but has model\.layers\.0\.mlp\.gate_proj\.g_idx"),
    "float-half": (lambda t: [t.pop(k) for k in [k for k in t if ".up_proj." in k]]
                   + [t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64))],
                   r"unexpected tensor model\.layers\.0\.mlp\.up_proj\.weight in a GPTQ layer"),
}


@needs_gptqmodel
@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_split_phi3_checkpoint_is_named_by_the_tensors_its_files_hold(split_phi3, tmp_path, case):
    """GPTQModel's Phi-3 stores mlp.gate_proj and mlp.up_proj apart; a wrong or missing tensor of one was named as
    a tensor of mlp.gate_up_proj, which the files do not have ("no tensor ...gate_up_proj.g_idx but has
    ...gate_up_proj.g_idx")."""
    import shutil
    from infer.errors import ModelLoadError
    shutil.copytree(split_phi3, tmp_path / "q")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    edit, message = BROKEN[case]
    edit(tensors)
    save_file(tensors, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tmp_path / "q"))


@needs_gptqmodel
def test_a_split_phi3_checkpoints_modules_in_block_to_quantize_naming_gate_and_up_is_read_as_written(split_phi3,
                                                                                                     tmp_path):
    """modules_in_block_to_quantize (optimum's list) naming mlp.gate_proj and mlp.up_proj, the modules a split
    checkpoint stores: they are quantized (it took gate_up_proj, which the list does not name, for a float layer)."""
    import shutil
    shutil.copytree(split_phi3, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["modules_in_block_to_quantize"] = [
        ["self_attn.qkv_proj"], ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "q" / "quantize_config.json").unlink(missing_ok=True)
    prompts = random_prompts(512, (6, 13), seed=8)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    with LLM(str(tmp_path / "q"), block_size=4) as a, LLM(str(split_phi3), block_size=4) as b:
        assert [o.token_ids for o in a.generate(prompts, params)] == [o.token_ids for o in b.generate(prompts, params)]
