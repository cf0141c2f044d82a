"""Adapter configs that peft reads in its own way (probe session 18): each test fails without its fix.

- no target_modules: peft adapts only its per-architecture default (q_proj, v_proj), not every weight in the file;
- layers_to_transform=[] filters nothing in peft; layers_pattern must match the module path; a target string with
  layers_to_transform is refused by peft;
- a target regex that selects a non-Linear module (Qwen3's q_norm) is refused by peft;
- kasa_config / arrow_config change the math (KaSA truncates the base weights), even as {};
- BD-LoRA (use_bdlora, nblocks > 1) keeps block-diagonal factors as stacked blocks: expanded as peft multiplies;
- VeLoRA / MonteCLoRA keep training-only tensors; their eval forward is plain LoRA.
"""

from __future__ import annotations

import json

import pytest
import torch

from infer.errors import LoRAError
from infer.lora import load_adapter

from test_lora_adapter import ALL, _expect_error, make_adapter, tiny_config, tiny_llama


def _edit(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


@torch.no_grad()
def _peft_logits(path, x):
    from peft import PeftModel
    m = PeftModel.from_pretrained(tiny_llama(), str(path)).eval()
    return m(input_ids=x).logits


@torch.no_grad()
def _infer_logits(adapter, x):
    """The base with each module's delta applied as infer serves it: W + scaling * B @ A."""
    base = tiny_llama()
    for m in adapter.modules.values():
        lin = base.get_submodule(m.name)
        lin.weight += m.scaling * (m.lora_b.float() @ m.lora_a.float())
    return base(input_ids=x).logits


X = torch.tensor([[3, 17, 42, 99, 5, 64]])


@pytest.mark.parametrize("cfg_edit", [dict(target_modules=None), dict(target_modules=...)])
def test_no_target_modules_means_peft_defaults(tmp_path, cfg_edit):
    """With weights for all 7 projections and no target_modules, peft adapts only q_proj and v_proj: infer applied
    all 7 (other tokens). Now refused; a q/v adapter without target_modules is served as peft serves it."""
    path = _edit(make_adapter(tmp_path, "all", target_modules=ALL), **cfg_edit)
    _expect_error(path, "all", match="no target_modules, so peft adapts only its default q_proj, v_proj")
    qv = _edit(make_adapter(tmp_path, "qv", target_modules=["q_proj", "v_proj"]), **cfg_edit)
    ad = load_adapter("qv", qv, tiny_config())
    assert torch.allclose(_infer_logits(ad, X), _peft_logits(qv, X), atol=1e-4)


def test_empty_layers_to_transform_filters_nothing(tmp_path):
    path = make_adapter(tmp_path, "e", target_modules=ALL, layers_to_transform=[])
    ad = load_adapter("e", path, tiny_config())
    assert len(ad.modules) == 14
    assert torch.allclose(_infer_logits(ad, X), _peft_logits(path, X), atol=1e-4)


def test_layers_pattern_that_matches_nothing_is_refused(tmp_path):
    path = _edit(make_adapter(tmp_path, "h", target_modules=ALL, layers_to_transform=[1]), layers_pattern="h")
    with pytest.raises(Exception, match="not found in the base model"):
        _peft_logits(path, X)
    _expect_error(path, "h", match='layers_pattern "h"')


def test_full_path_target_ignores_layers_to_transform_as_peft(tmp_path):
    path = make_adapter(tmp_path, "f", target_modules=["model.layers.0.self_attn.q_proj", "v_proj"],
                        layers_to_transform=[1])
    ad = load_adapter("f", path, tiny_config())
    assert "model.layers.0.self_attn.q_proj" in ad.modules
    assert torch.allclose(_infer_logits(ad, X), _peft_logits(path, X), atol=1e-4)


@pytest.mark.parametrize("key", ["layers_to_transform", "layers_pattern"])
def test_string_target_with_layer_selection_is_refused(tmp_path, key):
    path = make_adapter(tmp_path, "s", target_modules=r".*\.1\..*(q|v)_proj")
    path = _edit(path, **{key: [1] if key == "layers_to_transform" else "layers"})
    _expect_error(path, "s", match=f"gives {key}")


def test_regex_selecting_qwen3_q_norm_is_refused(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    path = make_adapter(tmp_path, "qn", base=Qwen3ForCausalLM(cfg).eval(), target_modules=r".*\.(q|k)_proj")
    load_adapter("qn", path, cfg)
    _edit(path, target_modules=r".*\.(q|k)_(proj|norm)")
    _expect_error(path, "qn", config=cfg, match="q_norm, which is not a Linear layer")


@pytest.mark.parametrize("key, value, match", [("kasa_config", {}, "KaSA"), ("arrow_config", {"top_k": 1}, "Arrow")])
def test_variants_that_change_the_math_are_refused(tmp_path, key, value, match):
    path = _edit(make_adapter(tmp_path, "k"), **{key: value})
    _expect_error(path, "k", match=match)


def test_kasa_adapter_names_its_field(tmp_path):
    path = make_adapter(tmp_path, "kasa", kasa_config={})
    _expect_error(path, "kasa", match="kasa_config")


@pytest.mark.parametrize("nblocks, strict", [(2, True), (4, False)])
def test_bdlora_blocks_are_expanded_as_peft(tmp_path, nblocks, strict):
    bd_b = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] if strict else ["q_proj"]
    bd = {"target_modules_bd_a": ["o_proj", "down_proj"], "target_modules_bd_b": bd_b,
          "nblocks": nblocks, "match_strict": strict}
    targets = ALL if strict else ["q_proj", "k_proj", "o_proj", "down_proj"]  # k_proj: in neither list
    path = make_adapter(tmp_path, "bd", r=8, target_modules=targets, use_bdlora=bd)
    ad = load_adapter("bd", path, tiny_config())
    assert ad.modules["model.layers.0.self_attn.o_proj"].lora_a.shape == (8, 64)
    assert torch.allclose(_infer_logits(ad, X), _peft_logits(path, X), atol=1e-4)


def test_bdlora_module_in_neither_list_is_refused_with_match_strict(tmp_path):
    path = _edit(make_adapter(tmp_path, "bde"), use_bdlora={})
    _expect_error(path, "bde", match="use_bdlora (match_strict)")


@pytest.mark.parametrize("kw", [dict(velora_config={}), dict(monteclora_config={})])
def test_training_only_tensors_are_ignored_as_peft_does_at_eval(tmp_path, kw):
    path = make_adapter(tmp_path, "v", target_modules=ALL, **kw)
    ad = load_adapter("v", path, tiny_config())
    assert len(ad.modules) == 14
    assert torch.allclose(_infer_logits(ad, X), _peft_logits(path, X), atol=1e-4)
