"""GPTQ checkpoints written by other tools (GPTQModel, AutoGPTQ, optimum, hand conversions), as users download them:
- a `desc_act: true` checkpoint without its `g_idx` tensors loaded with plain groups (i // group_size) and
  generated wrong tokens silently: act-order groups can only be read from g_idx (vLLM leaves the default too);
- GPTQModel's `dynamic` per-module rules (`-:regex` leaves modules in float, `+:regex` overrides group_size, sym,
  desc_act), which vLLM reads, were refused outright: they are applied now, first match wins as in GPTQModel and vLLM
  (another bit width per module is read too since session 43: tests/test_probes_session43_lmhead.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer.errors import ModelLoadError, UnsupportedModelError
from infer.models.tiny import ensure_builtin
from infer.quant import packing

from quant_helpers import needs_gptqmodel

PROMPTS = [[5, 17, 99, 230, 41], list(range(40, 73))]
N = 6


def crafted(dst, model="tiny-llama", group=32, desc_act=False, drop_g_idx=False, qc_extra=None, seed=0,
            per_module=None):
    """A round-to-nearest GPTQ copy of a built-in model; with desc_act, each input's rows are grouped in a random
    order shared by the projections that read the same input (as GPTQ's act-order gives them). `per_module`:
    module name -> None (left in float) or its (group_size, sym)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(ensure_builtin(model), dst)
    gen, perms, out = torch.Generator().manual_seed(seed), {}, {}
    for name, t in load_file(dst / "model.safetensors").items():
        module = name[: -len(".weight")]
        own = per_module(module) if per_module else (group, False)
        if ".layers." in name and name.endswith("_proj.weight") and own is not None:
            key = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            perm = perms.setdefault(key, torch.randperm(t.shape[1], generator=gen)) if desc_act else None
            qw, qz, s, gi = packing.quantize_rtn(t.float(), 4, own[0], own[1], perm=perm)
            out.update({f"{module}.qweight": qw, f"{module}.qzeros": qz, f"{module}.scales": s})
            if not drop_g_idx:
                out[f"{module}.g_idx"] = gi
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                                  "sym": False, "checkpoint_format": "gptq", **(qc_extra or {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def infer_greedy(path):
    from infer import LLM, SamplingParams
    llm = LLM(str(path), block_size=4)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=N, ignore_eos=True))]


def test_act_order_checkpoint_without_g_idx_is_refused_naming_the_tensor(tmp_path):
    path = crafted(tmp_path / "m", desc_act=True, drop_g_idx=True)
    with pytest.raises(ModelLoadError, match=r"no tensor model\.layers\.0\.self_attn\.q_proj\.g_idx.*desc_act"):
        infer_greedy(path)


@pytest.mark.parametrize("desc_act, group", [(False, 32), (True, -1)])
def test_g_idx_may_be_absent_where_the_groups_are_plain(tmp_path, desc_act, group):
    """Without act-order, or with one group per column (act-order then changes nothing), g_idx is i // group_size:
    the checkpoint without it generates what the one with it does."""
    full = crafted(tmp_path / "full", group=group, desc_act=desc_act)
    bare = crafted(tmp_path / "bare", group=group, desc_act=desc_act, drop_g_idx=True)
    assert infer_greedy(bare) == infer_greedy(full)


DYNAMIC = {"-:model\\.layers\\.1\\.mlp\\..*": {}, "+:.*o_proj": {"group_size": 64, "sym": True, "damp_percent": 0.1}}


def dynamic_module(module):
    """What DYNAMIC gives each module of tiny-llama (base: group 32, asym)."""
    if module.startswith("model.layers.1.mlp."):
        return None
    return (64, True) if module.endswith("o_proj") else (32, False)


def dequantized_greedy(float_dir, gptq_dir):
    """transformers on the float model with every GPTQ layer replaced by its dequantized weight (the test helpers'
    independent v1 dequantizer), the float layers as stored."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from quant_helpers import dequantize_v1
    tensors = load_file(gptq_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, t in tensors.items():
            if name.endswith(".qweight"):
                prefix = name[: -len(".qweight")]
                w = dequantize_v1(tensors, prefix, 4)
                state[prefix + ".weight"].copy_(w.half().float())  # rounded as the fp16 scales' product is
            elif name in state:
                state[name].copy_(t.float())
        model.generation_config.eos_token_id = None
        return [model.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(p):]
                .tolist() for p in PROMPTS]


def test_gptqmodel_dynamic_rules_leave_modules_float_and_override_groups_as_the_dequantized_model(tmp_path):
    path = crafted(tmp_path / "m", qc_extra={"dynamic": DYNAMIC}, per_module=dynamic_module)
    assert infer_greedy(path) == dequantized_greedy(ensure_builtin("tiny-llama"), path)


@pytest.mark.parametrize("dynamic, error, message", [
    ({"-:.*self_attn\\.k_proj": {}}, UnsupportedModelError, r"dynamic quantizes .*q_proj.* but not .*k_proj"),
    ({"+:.*\\.up_proj": {"group_size": 64}}, UnsupportedModelError, r"gate_proj and .*up_proj with different"),
    ({"+:.*down_proj": {"bits": 3}}, UnsupportedModelError, r"3 bits"),
    ({"+:.*down_proj": {"pack_dtype": "int16"}}, UnsupportedModelError, r"sets pack_dtype"),
    ({"-:model.layers.(0": {}}, ModelLoadError, r"not a valid regex"),
    ({"+:.*down_proj": 8}, ModelLoadError, r"is not a mapping"),
    (["-:.*down_proj"], ModelLoadError, r"not a mapping of module patterns"),
], ids=["splits-qkv", "splits-gate-up", "other-bits", "other-packing", "bad-regex", "bad-override", "not-a-dict"])
def test_dynamic_rules_infer_cannot_run_are_refused_naming_them(tmp_path, dynamic, error, message):
    path = crafted(tmp_path / "m", qc_extra={"dynamic": dynamic})
    with pytest.raises(error, match=message):
        infer_greedy(path)


def test_dynamic_overrides_that_repeat_the_base_format_are_read():
    from infer.quant.config import GPTQConfig
    cfg = GPTQConfig.from_dict({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {
        "+:.*o_proj": {"pack_dtype": "int32", "bits": 4, "group_size": 64}}}, "config.json")
    assert cfg.for_module("model.layers.0.self_attn.o_proj").group_size == 64
    assert cfg.for_module("model.layers.0.mlp.down_proj").group_size == 32


@pytest.mark.parametrize("qc, message", [
    ({"method": "awq", "format": "gemv"}, "AWQ format 'gemv' is not supported"),  # (AWQ 'gemm' is read)
    ({"quant_method": "gptq", "method": "fp8"}, "method 'fp8' is not supported"),
    ({"quant_method": "gptq", "method": "awq"}, "method 'awq' is not supported"),
    ({"load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
], ids=["method-only", "method-disagrees", "both", "bitsandbytes"])
def test_gptqmodels_method_field_naming_another_method_is_refused(tmp_path, qc, message):
    """GPTQModel reads `method` before its deprecated alias quant_method: a quantize_config.json with only
    `method: awq` was read as 4-bit GPTQ and failed on a tensor shape with a hint about bits and group_size."""
    from infer.quant.config import GPTQConfig
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, **qc}))
    with pytest.raises(UnsupportedModelError, match=message) as e:
        GPTQConfig.from_model_dir(tmp_path)
    assert "`infer quantize`" in e.value.hint


@pytest.mark.parametrize("qc_extra, which", [({"dynamic": {"-:.*down_proj": {}}}, "dynamic"), (
    {"modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                       "mlp.gate_proj", "mlp.up_proj"]]}, "modules_in_block_to_quantize")],
    ids=["dynamic", "modules_in_block_to_quantize"])
def test_a_quantized_layer_the_config_leaves_in_float_names_the_rule(tmp_path, qc_extra, which):
    """The message said "config.json has no quantization_config" for a checkpoint that has one, whose rule leaves
    down_proj in float while the weights hold it quantized."""
    path = crafted(tmp_path / "m", qc_extra=qc_extra)
    with pytest.raises(ModelLoadError, match=r"down_proj\.(qweight|qzeros|scales|g_idx) for a float linear") as e:
        infer_greedy(path)
    assert e.value.hint == f"the checkpoint has it quantized but config.json's {which} leaves it in float"


@needs_gptqmodel
def test_a_gptqmodel_checkpoint_with_dynamic_rules_runs_as_its_dequantized_weights(tmp_path):
    """GPTQModel's own `dynamic` (module names as it matches them: model.layers.N.mlp.down_proj): a layer left in float
    and another group size for o_proj, against transformers on the dequantized weights."""
    from quant_helpers import dequantized_float_model
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.looper import loop_processor
    from gptqmodel.quantization.config import FORMAT
    src = ensure_builtin("tiny-llama")
    gen = torch.Generator().manual_seed(0)
    calib = [{"input_ids": torch.randint(3, 512, (32,), generator=gen).tolist(), "attention_mask": [1] * 32}
             for _ in range(4)]
    qcfg = QuantizeConfig(bits=4, group_size=32, sym=False, format=FORMAT.GPTQ, dynamic={
        r"-:model\.layers\.1\.mlp\..*": {}, r"+:.*o_proj.*": {"group_size": 64, "sym": True}})
    old, loop_processor._PROJECT_LOG_DIR = loop_processor._PROJECT_LOG_DIR, tmp_path / "logs"
    try:
        model = GPTQModel.load(str(src), qcfg)
        model.quantize(calib, batch_size=1)
        model.save(str(tmp_path / "q"))
    finally:
        loop_processor._PROJECT_LOG_DIR = old
    ref = dequantized_float_model(src, tmp_path / "q")
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]
    assert infer_greedy(tmp_path / "q") == want
