"""Session 39 probes of `infer quantize` / `infer convert`: what the checkpoint carries over from the source model and
how it interoperates with transformers and vLLM."""

from __future__ import annotations

import json
import shutil

import pytest

from infer.quant.quantize import QuantizeOptions, quantize_model
from quant_helpers import needs_gptqmodel

SMALL = QuantizeOptions(group_size=32, num_samples=2, seq_len=32)


@pytest.fixture(scope="module")
def tiny_llama():
    from infer.models.resolve import resolve_model
    return resolve_model("tiny-llama")


def _source(tiny_llama, tmp_path, generation_config: dict | None):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    if generation_config is None:
        (src / "generation_config.json").unlink()
    else:
        (src / "generation_config.json").write_text(json.dumps(generation_config))
    return src


@needs_gptqmodel
def test_quantize_keeps_the_source_generation_config_and_tokenizer_files(tiny_llama, tmp_path):
    """GPTQModel saves generation_config.json with do_sample true (transformers' generate would sample where the
    source decodes greedily) and rewrites tokenizer_config.json: the checkpoint gets the source's files unchanged."""
    src = _source(tiny_llama, tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "top_p": 0.9})
    out = quantize_model(src, tmp_path / "q", SMALL).out
    for name in ("generation_config.json", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    from transformers import GenerationConfig
    assert not GenerationConfig.from_pretrained(out).do_sample


@needs_gptqmodel
def test_quantize_without_a_generation_config_writes_none(tiny_llama, tmp_path):
    """A source without generation_config.json: the checkpoint has none either (transformers derives a greedy one
    from config.json for both), not GPTQModel's with do_sample true."""
    src = _source(tiny_llama, tmp_path, None)
    out = quantize_model(src, tmp_path / "q", SMALL).out
    assert not (out / "generation_config.json").exists()
