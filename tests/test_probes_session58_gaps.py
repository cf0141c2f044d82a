"""Session 58, hardening gaps the probes found: `infer warmup` said "fits" for a model folder that `infer run` and
`infer serve` refuse (no tokenizer, a damaged one); config.json's architectures given as a string was refused with
an error listing its characters, and a max_position_embeddings of 0 was read as absent (a context of 2048);
`infer convert` copied a float folder whose config.json claims a GPTQ quantization_config that `infer run` refuses;
`infer lora-validate --lora-target-modules o_proj qkv_proj` took qkv_proj for an adapter; `infer warmup --estimate`
ignored --lora-target-modules without adapters where an engine start warns."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from helpers import Stopped, stub_calls

WARMUP = ["--max-length", "64", "--concurrency", "2", "--device", "cpu"]


def _folder(tmp_path: Path, names=None, **config) -> Path:
    """A copy of tiny-llama's folder (only the files `names`, if given) whose config.json has `config` set."""
    src, folder = ensure_builtin("tiny-llama"), tmp_path / "model"
    folder.mkdir()
    for f in src.iterdir():
        if f.is_file() and (names is None or f.name in names):
            shutil.copy(f, folder / f.name)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def _error(res) -> str:
    """The CLI's one-line error (exit 2) and its hint."""
    assert res.exit_code == 2, res.output
    return res.output[res.output.index("error:"):].strip()


def _run_error(tmp_path: Path, folder: Path) -> str:
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    return _error(CliRunner().invoke(app, ["run", str(folder), str(tmp_path / "in.jsonl"), "-o",
                                           str(tmp_path / "out.jsonl"), "--device", "cpu", "-q"]))


@pytest.mark.parametrize("estimate", [[], ["--estimate"]])
def test_warmup_refuses_a_folder_without_a_tokenizer_as_run_does(tmp_path, estimate):
    """config.json and the weights alone: warmup measured (or estimated) "fits", exit 0, for a folder `infer run`
    and `infer serve` refuse; it now refuses it with run's words."""
    folder = _folder(tmp_path, names=("config.json", "model.safetensors"))
    said = _error(CliRunner().invoke(app, ["warmup", str(folder), *WARMUP, *estimate]))
    assert f"{folder} has no tokenizer files" in said and "hf download" in said
    assert said == _run_error(tmp_path, folder)


def test_warmup_refuses_a_damaged_tokenizer_as_run_does(tmp_path):
    folder = _folder(tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "mod')  # a truncated copy
    said = _error(CliRunner().invoke(app, ["warmup", str(folder), *WARMUP, "--estimate"]))
    assert f"tokenizer file {folder / 'tokenizer.json'} cannot be read" in said
    assert said == _run_error(tmp_path, folder)


def test_architectures_as_a_string_is_refused_naming_the_field_and_the_list_to_write(tmp_path):
    """transformers keeps "LlamaForCausalLM" as a string and iterates its characters where it looks for the class
    (so did infer's error: unsupported architecture ['L', 'l', ...]): refused, the fix spelt out."""
    folder = _folder(tmp_path, architectures="LlamaForCausalLM")
    said = _error(CliRunner().invoke(app, ["warmup", str(folder), *WARMUP, "--estimate"]))
    assert 'config.json\'s architectures must be a list of class names, got "LlamaForCausalLM"' in said
    assert '"architectures": ["LlamaForCausalLM"]' in said and "'L'" not in said
    assert said == _run_error(tmp_path, folder)


@pytest.mark.parametrize("value", [{"LlamaForCausalLM": 1}, ["LlamaForCausalLM", 3]])
def test_architectures_of_another_kind_are_refused_too(value):
    from infer.errors import ModelLoadError
    from infer.models.shapes import check_config_values
    with pytest.raises(ModelLoadError, match="architectures must be a list of class names") as e:
        check_config_values({"architectures": value})
    assert '["LlamaForCausalLM"]' in e.value.hint


def test_a_context_of_0_is_refused_and_an_absent_one_is_still_the_default(tmp_path):
    """max_position_embeddings 0 (no transformers config uses 0 for unset) became a context of 2048 silently."""
    from transformers import LlamaConfig

    from infer.models.limits import context_limit
    from infer.models.loader import load_config
    folder = _folder(tmp_path, max_position_embeddings=0)
    said = _error(CliRunner().invoke(app, ["warmup", str(folder), *WARMUP, "--estimate"]))
    assert "config.json has max_position_embeddings 0: it must be a whole number of at least 1" in said
    assert said == _run_error(tmp_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert context_limit(load_config(folder))[0] == LlamaConfig().max_position_embeddings  # as before


def test_convert_refuses_a_copy_run_would_refuse_before_writing(tmp_path):
    """A float folder whose config.json claims 3-bit GPTQ was copied "tensor by tensor" (exit 0), then refused by
    `infer run`; convert now refuses it with run's words, and writes nothing."""
    folder = _folder(tmp_path, quantization_config={"quant_method": "gptq", "bits": 3, "group_size": 32})
    out = tmp_path / "out"
    said = _error(CliRunner().invoke(app, ["convert", str(folder), "-o", str(out)]))
    assert "3-bit GPTQ is not supported" in said and not out.exists()
    assert said == _run_error(tmp_path, folder)


def test_convert_refuses_float_weights_under_a_4bit_gptq_config(tmp_path):
    folder = _folder(tmp_path, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32})
    out = tmp_path / "out"
    said = _error(CliRunner().invoke(app, ["convert", str(folder), "-o", str(out)]))
    assert "in a GPTQ layer" in said and not out.exists()


@pytest.mark.parametrize("where", ["after", "before"])
def test_lora_validate_takes_several_module_names_after_one_flag(monkeypatch, where):
    """`infer lora-validate BASE ADAPTER --lora-target-modules o_proj qkv_proj` took qkv_proj for a second adapter
    (as it did before ADAPTER too); it now reads both names, as the engine commands do."""
    seen = stub_calls(monkeypatch, "infer.cli.lora_check.run_checks")
    flag = ["--lora-target-modules", "o_proj", "qkv_proj"]
    args = ["tiny-llama", "ad=./ad", *flag] if where == "after" else ["tiny-llama", *flag, "ad=./ad"]
    res = CliRunner().invoke(app, ["lora-validate", *args])
    assert isinstance(res.exception, Stopped), res.output
    base, adapters, *_, targets = seen["args"]
    assert (base, adapters, targets) == ("tiny-llama", ["ad=./ad"], ["o_proj", "qkv_proj"])


def test_warmup_estimate_warns_of_target_modules_without_adapters(caplog):
    """The engine start's warning (engine.setup.check_lora_targets), which --estimate (and a measured warmup)
    skipped: no slots are reserved, so the option counts nothing."""
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig
    config = EngineConfig("tiny-llama", device="cpu", max_model_len=64, max_num_seqs=2,
                          lora_target_modules=["o_proj"])
    with caplog.at_level(logging.WARNING, logger="infer"):
        plan, _ = estimate_plan(config, 64, 2)
    said = [r.getMessage() for r in caplog.records if "--lora-target-modules" in r.getMessage()]
    assert len(said) == 1 and "--lora-target-modules o_proj does nothing without adapters" in said[0]
    assert plan.lora_bytes == 0
