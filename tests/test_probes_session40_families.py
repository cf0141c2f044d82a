"""Model families and config variants against transformers 5 (session 40): each test fails without its fix."""

from __future__ import annotations

import json

import pytest

from infer import LLM
from infer.errors import UnsupportedModelError

from test_model_variants import build


def _patch(folder, **fields):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_heads_not_a_multiple_of_the_kv_heads_are_refused_when_loading(tmp_path):
    """num_attention_heads 4 over num_key_value_heads 3 loaded, and every request then ended with finish_reason
    'error' (transformers fails at the first forward too): refused when config.json is read, naming both fields."""
    build(tmp_path, "llama")
    _patch(tmp_path, num_key_value_heads=3, head_dim=16)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads 4.*num_key_value_heads 3"):
        LLM(str(tmp_path), block_size=4)


def test_a_rope_parameter_transformers_cannot_compute_is_refused_naming_the_rope(tmp_path):
    """A linear rope whose factor is the string "2" (transformers only warns when it reads config.json) reached the
    user as a raw TypeError from transformers' rope function: refused now as an UnsupportedModelError naming the
    rope parameters."""
    build(tmp_path, "llama")
    _patch(tmp_path, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": "2"})
    with pytest.raises(UnsupportedModelError, match="linear rope parameters.*'factor': '2'"):
        LLM(str(tmp_path), block_size=4)
