"""GPTQ checkpoints written by other tools (GPTQModel, AutoGPTQ, optimum, hand conversions), as users download them:
- a `desc_act: true` checkpoint without its `g_idx` tensors loaded with plain groups (i // group_size) and
  generated wrong tokens silently: act-order groups can only be read from g_idx (vLLM leaves the default too)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer.errors import ModelLoadError
from infer.models.tiny import ensure_builtin
from infer.quant import packing

PROMPTS = [[5, 17, 99, 230, 41], list(range(40, 73))]
N = 6


def crafted(dst, model="tiny-llama", group=32, desc_act=False, drop_g_idx=False, qc_extra=None, seed=0):
    """A round-to-nearest GPTQ copy of a built-in model; with desc_act, each input's rows are grouped in a random
    order shared by the projections that read the same input (as GPTQ's act-order gives them)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(ensure_builtin(model), dst)
    gen, perms, out = torch.Generator().manual_seed(seed), {}, {}
    for name, t in load_file(dst / "model.safetensors").items():
        module = name[: -len(".weight")]
        if ".layers." in name and name.endswith("_proj.weight"):
            key = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            perm = perms.setdefault(key, torch.randperm(t.shape[1], generator=gen)) if desc_act else None
            qw, qz, s, gi = packing.quantize_rtn(t.float(), 4, group, False, perm=perm)
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
