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


def _transformers4_config(folder):
    """Rewrite folder's config.json as transformers 4 writes it (rope_theta and rope_scaling, torch_dtype)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope.pop("rope_theta"), torch_dtype=cfg.pop("dtype"), transformers_version="4.46.0")
    cfg["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
    path.write_text(json.dumps(cfg, indent=2))
    return cfg


def _source_v4(tmp_path, name):
    from infer.models.resolve import resolve_model
    src = tmp_path / "src"
    shutil.copytree(resolve_model(name), src)
    return src, _transformers4_config(src)


def test_convert_keeps_the_source_config_layout(tmp_path):
    """A transformers-4 config.json (rope_theta, rope_scaling: llama3) comes out with the same fields, only the dtype
    changed: transformers 5 would save rope_parameters instead, which tools on transformers 4 (vLLM's config
    reading among them) take for the default rope."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    src, cfg = _source_v4(tmp_path, "tiny-llama3")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["convert", str(src), "-o", str(out), "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    # (and the source it copies: an adapter trained on it names it)
    assert json.loads((out / "config.json").read_text()) == {**cfg, "torch_dtype": "bfloat16",
                                                             "_name_or_path": str(src.resolve())}
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(out).rope_parameters["rope_theta"] == 500000.0


@needs_gptqmodel
def test_quantize_keeps_the_source_config_layout(tmp_path):
    """The quantized checkpoint's config.json is the source's with quantization_config and the dtype GPTQModel wrote
    its float tensors in (bfloat16 for a float32 source), not transformers 5's re-layout."""
    src, cfg = _source_v4(tmp_path, "tiny-llama3")
    out = quantize_model(src, tmp_path / "q", SMALL).out
    saved = json.loads((out / "config.json").read_text())
    qc = saved.pop("quantization_config")
    assert saved == {**cfg, "torch_dtype": "bfloat16", "_name_or_path": str(src.resolve())}  # (its source)
    assert qc == json.loads((out / "quantize_config.json").read_text()) and qc["bits"] == 4
    from infer import LLM, SamplingParams
    llm = LLM(str(out), block_size=4)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_convert_of_a_gptq_checkpoint_reads_only_its_model_file(tmp_path):
    """A file beside model.safetensors (an adapter_model.safetensors kept in the folder) is not part of the model
    for `infer run` or transformers: `infer convert` copied its tensors into the checkpoint, which `infer run` then
    refused."""
    import torch
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from infer.cli.main import app
    from test_probes_gptq_s19 import rtn_checkpoint
    src = tmp_path / "gptq"
    rtn_checkpoint(src)  # (a GPTQ checkpoint infer run loads: convert checks it so before copying it)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, src / "adapter_model.safetensors")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["convert", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert load_file(out / "model.safetensors").keys() == load_file(src / "model.safetensors").keys()


def test_calibration_txt_with_crlf_and_a_byte_order_mark_reads_as_its_lf_copy(tmp_path):
    """A .txt saved by a Windows editor (BOM, CRLF) holds the same paragraphs as its LF copy: it was read one
    sample per line, with carriage returns and the BOM in the texts."""
    from infer.quant.calibration import read_texts
    text = "First paragraph,\nits second line.\n\nSecond paragraph.\n"
    lf, crlf = tmp_path / "lf.txt", tmp_path / "crlf.txt"
    lf.write_text(text, encoding="utf-8")
    crlf.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert read_texts(crlf) == read_texts(lf) == ["First paragraph,\nits second line.", "Second paragraph."]
