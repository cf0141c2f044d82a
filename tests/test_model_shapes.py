"""ModelShapes against transformers' own modules, and the loader's routing read from the model class."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from infer.models.llama import LlamaForCausalLM
from infer.models.loader import load_weights, packed_shards
from infer.models.shapes import ModelShapes
from infer.models.tiny import ensure_builtin


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_shapes_match_transformers(name):
    cfg = AutoConfig.from_pretrained(ensure_builtin(name))
    attn = AutoModelForCausalLM.from_config(cfg).model.layers[0].self_attn
    s = ModelShapes.from_config(cfg)
    assert (s.q_size, s.kv_size, s.head_dim) == (attn.q_proj.out_features, attn.k_proj.out_features, attn.head_dim)
    assert s.num_heads * s.head_dim == s.q_size and s.num_kv_heads < s.num_heads  # the tiny models use GQA


def test_shapes_default_kv_heads_and_head_dim():
    cfg = type("Cfg", (), dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=None, head_dim=None))()
    s = ModelShapes.from_config(cfg)
    assert (s.num_kv_heads, s.head_dim, s.q_size, s.kv_size) == (3, 32, 96, 96)


def test_loader_routes_by_the_model_class_mapping():
    assert packed_shards(LlamaForCausalLM) == {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                                               "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                                               "up_proj": ("gate_up_proj", 1)}

    class Swapped(LlamaForCausalLM):  # a model that stacks k before q gets k's tensor in shard 0
        packed_modules_mapping = {"qkv_proj": ["k_proj", "q_proj", "v_proj"]}

    assert packed_shards(Swapped)["k_proj"] == ("qkv_proj", 0)
    cfg = AutoConfig.from_pretrained(ensure_builtin("tiny-llama"))
    hf = AutoModelForCausalLM.from_config(cfg)
    ours = LlamaForCausalLM(cfg, torch.float32)
    load_weights(ours, hf.state_dict().items(), torch.float32)
    q = hf.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.weight[:q.shape[0]], q)
