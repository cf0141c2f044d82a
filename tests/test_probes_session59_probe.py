"""Hostile-newcomer probes (session 59): each test fails without its fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import OutOfMemoryError

from helpers import tiny_llama_with_json


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory):
    """tiny-llama whose config.json claims a context of 4,000,000 tokens (a float32 rope table of 244 MiB)."""
    return tiny_llama_with_json(tmp_path_factory.mktemp("long") / "tiny", "config.json",
                                max_position_embeddings=4_000_000)


def test_a_rope_table_past_the_budget_is_refused_before_the_model_is_built(long_context_llama):
    """A config.json whose max_position_embeddings is in the billions (no --max-model-len) built its rope table in
    full before any memory check: 10**12 positions ended in torch's allocator traceback ("can't allocate 4 TB"),
    10**8 took 108 s and 16 GB of RAM before the plan refused it. Now the table's size is checked against the
    budget first, naming the field and the --max-model-len that fits; an explicit max_model_len still runs."""
    with pytest.raises(OutOfMemoryError) as err:
        LLM(str(long_context_llama), memory_limit="128MB")
    msg = str(err.value)
    assert "rotary (rope) table" in msg and "max_position_embeddings, 4,000,000" in msg, msg
    assert "--max-model-len" in err.value.hint
    fit = int(err.value.hint.split("at most ")[1].split(";")[0].replace(",", ""))
    assert 0 < fit < 4_000_000
    with pytest.raises(OutOfMemoryError, match=r"--max-model-len 4,000,000\)"):
        LLM(str(long_context_llama), memory_limit="128MB", max_model_len=4_000_000)
    # the same weights with a context that fits: the tokens of the unmodified model
    from infer.models.tiny import ensure_builtin
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    got = LLM(str(long_context_llama), memory_limit="128MB", max_model_len=256).generate([[5, 6, 7]], params)
    want = LLM(str(ensure_builtin("tiny-llama")), max_model_len=256).generate([[5, 6, 7]], params)
    assert got[0].token_ids == want[0].token_ids


def test_a_rope_table_the_allocator_refuses_is_named(monkeypatch):
    """Where the table passes the budget check but the device cannot allocate it (a draft model's, a reload's),
    torch's bare RuntimeError ("DefaultCPUAllocator: can't allocate memory") became a clear OutOfMemoryError."""
    from infer.models import rope
    from infer.models.loader import load_config
    from infer.models.tiny import ensure_builtin
    cfg = load_config(ensure_builtin("tiny-llama"))

    def refuse(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr(torch, "outer", refuse)
    with pytest.raises(OutOfMemoryError, match="rotary .rope. table for 1,000,000 positions") as err:
        rope.build_cos_sin_cache(cfg, 1_000_000)
    assert "--max-model-len" in err.value.hint


@pytest.mark.parametrize("command, flag", [("convert", "--merge-lora"), ("quantize", "--calibration")])
def test_a_file_option_given_twice_is_refused(tmp_path, monkeypatch, command, flag):
    """`infer convert tiny-llama -o out --merge-lora a --merge-lora b` merged only b (click's last value wins) and
    said "merged b": a's weights were silently missing; `infer quantize --calibration a.jsonl --calibration
    b.jsonl` calibrated on b alone. Now the repeat is refused before anything is loaded, naming both files and
    how to give them (two merges one after the other; one calibration file)."""
    from typer.testing import CliRunner

    from infer.cli import quantize as cquantize
    from infer.cli.main import app
    from infer.quant import convert as qconvert

    def never(*a, **k):
        raise AssertionError("the command ran")
    monkeypatch.setattr(qconvert, "convert_model", never)
    monkeypatch.setattr(cquantize, "run_quantization", never)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    res = CliRunner().invoke(app, [command, "tiny-llama", "-o", str(tmp_path / "out"), flag, str(first), flag,
                                   str(second)])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert f"{flag} is given 2 times ({first}, {second}); it takes one" in out, out
    assert (f"-o merged2 --merge-lora {second}" if command == "convert" else f"cat {first} {second} >") in out, out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value", [("dtype", "float99"), ("torch_dtype", "torch.float16"), ("dtype", 5)])
def test_a_config_dtype_that_names_no_torch_dtype_is_named(tmp_path, field, value):
    """config.json's "dtype": "float99" (or "torch.float16") was refused as transformers' AttributeError "cannot
    read config.json: module 'torch' has no attribute 'float99'", and a number was taken; now the field and its
    value are named, with the form transformers saves."""
    from infer.errors import ModelLoadError
    from infer.models.loader import load_config
    from infer.models.tiny import ensure_builtin
    shutil.copytree(ensure_builtin("tiny-llama"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ModelLoadError, match=f"config.json has {field} {json.dumps(value)}, which is not a torch "
                                             "dtype") as err:
        load_config(tmp_path / "m")
    assert f'"{field}": "bfloat16"' in err.value.hint
    cfg = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}  # (transformers 5 prefers dtype)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, field: "bfloat16"}))
    assert load_config(tmp_path / "m").dtype == torch.bfloat16


def test_a_line_whose_lora_is_a_folder_or_empty_is_told_what_to_write(tmp_path):
    """A newcomer's line `"lora": "./adapters/legal"` (the folder, as vLLM's LoRARequest takes a path) was told to
    start infer run with `--lora ./adapters/legal=PATH`, and `"lora": ""` with `--lora =PATH` (neither is a
    NAME=PATH infer run takes). Now the folder's line gets `--lora legal=./adapters/legal` and `"lora": "legal"`,
    the empty one to leave lora out for the base model; the other lines still run."""
    from helpers import infer_run_records
    folder = tmp_path / "adapters" / "legal"
    folder.mkdir(parents=True)
    records, _ = infer_run_records(tmp_path, [{"id": "dir", "prompt": "hi", "lora": str(folder)},
                                              {"id": "empty", "prompt": "hi", "lora": ""},
                                              {"id": "ok", "prompt": "hi", "max_new_tokens": 2}])
    assert f'--lora legal={folder} and write "lora": "legal"' in records["dir"]["error"], records["dir"]
    assert "=PATH" not in records["empty"]["error"] and "leave the line's lora out" in records["empty"]["error"]
    assert records["ok"]["error"] is None and len(records["ok"]["token_ids"]) == 2
