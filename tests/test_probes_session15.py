"""Fixes from the fifteenth session's probes (model configs against transformers, generation semantics against
vLLM), each with the input that showed the bug."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from infer.engine.setup import eos_ids


@pytest.mark.parametrize("config_eos, generation, want", [
    (271, {"eos_token_id": [72, 73]}, {2, 72, 73}),  # generation_config.json wins over config.json, as in generate
    (271, {"eos_token_id": None}, {2, 271}),  # a null there leaves config.json's
    (271, None, {2, 271}),  # no generation_config.json: config.json's (vLLM builds the generation config from it)
    ([5, 6], {"temperature": 0.7}, {2, 5, 6}),
])
def test_eos_ids_follow_the_generation_config(tmp_path, config_eos, generation, want):
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    got = eos_ids(tmp_path, SimpleNamespace(eos_token_id=config_eos), SimpleNamespace(eos_token_id=2))
    assert got == want
