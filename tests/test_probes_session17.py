"""Fixes from the seventeenth session's probes, each with the input that showed the bug."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin
from quant_helpers import needs_gptqmodel
from test_lora_adapter import make_adapter, tiny_config, tiny_llama
from test_probes_session5 import _ctrl_c_when


def _lines(*objs) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def test_run_records_carry_stop_reason(tmp_path):
    """A record said finish_reason "stop" but not what stopped it (the server and the Python API say, as vLLM's
    stop_reason: the stop string or token id, None for EOS)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # the first two tokens of a greedy reply, then the same request stopped on its second token's text and id
    inp.write_bytes(_lines({"id": "probe", "prompt": "hello", "max_new_tokens": 2, "ignore_eos": True}))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    probe = json.loads(out.read_text())
    assert probe["finish_reason"] == "length" and probe["stop_reason"] is None
    second = probe["token_ids"][1]
    inp.write_bytes(_lines({"id": "tok", "prompt": "hello", "max_new_tokens": 8, "stop_token_ids": [second],
                            "ignore_eos": True},
                           {"id": "bad", "prompt": "hello", "max_new_tokens": -1}))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--quiet"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["tok"]["finish_reason"] == "stop" and recs["tok"]["stop_reason"] == second
    assert recs["tok"]["token_ids"][-1] == second
    assert recs["bad"]["finish_reason"] == "error" and recs["bad"]["stop_reason"] is None


def test_sigterm_stops_between_records_says_the_count_and_resume_completes(tmp_path):
    """SIGTERM (a scheduler stopping the job) ended `infer run` without a word: no count of the records on disk and
    no hint to resume. It now stops as Ctrl-C does (exit 143), and --resume completes the rest without duplicates."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines(*({"id": f"r{i}", "prompt": "hello", "max_new_tokens": 150, "ignore_eos": True}
                             for i in range(12))))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "infer.cli", "run", "tiny-llama", str(inp), "-o", str(out), "--max-num-seqs", "1"]

    def records() -> int:
        return out.read_bytes().count(b"\n") if out.exists() else 0

    err = _ctrl_c_when(cmd, lambda _: records() >= 2, sig=signal.SIGTERM, code=143)
    written = records()
    assert written < 12 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"terminated: {written} of 12 records written to {out}; run the same " \
        "command with --resume to complete the rest"
    res = subprocess.run(cmd[:-2] + ["--resume", "--quiet"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(12))


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), device="cpu", max_model_len=32) as llm:
        yield llm


@pytest.mark.parametrize("prompt", [b"hello", bytearray(b"hi"), memoryview(b"hi"), [memoryview(b"hi")]])
def test_a_bytes_prompt_is_refused_not_read_as_token_ids(llm, prompt):
    """generate(b"hello") ran the token ids [104, 101, 108, 108, 111] (bytes iterate as ints, and a memoryview has
    tolist() and a shape like an array), while [b"hello"] was refused: both are refused now, nothing queued."""
    with pytest.raises(RequestError, match="bytes|memoryview"):
        llm.generate(prompt, SamplingParams(max_new_tokens=2))
    with pytest.raises(RequestError):
        llm.stream(prompt, SamplingParams(max_new_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    # token ids as an array, a range or a generator of prompts still work
    assert llm.generate(np.array([5, 6, 7]), SamplingParams(max_new_tokens=1))[0].prompt_token_ids == [5, 6, 7]
    assert llm.generate(range(5, 8), SamplingParams(max_new_tokens=1))[0].prompt_token_ids == [5, 6, 7]
    assert llm.generate((p for p in [[5, 6]]), SamplingParams(max_new_tokens=1))[0].prompt_token_ids == [5, 6]


@pytest.mark.parametrize("kwargs, hint", [({"use_beam_search": True}, "does not support"),
                                          ({"best_of": 2}, "does not support"),
                                          ({"max_completion_tokens": 3}, "spells it max_new_tokens"),
                                          ({"tempature": 0.5}, "temperature")])
def test_an_unknown_sampling_field_is_a_request_error_naming_it(kwargs, hint):
    """SamplingParams(best_of=2) or a typo was a bare TypeError from the dataclass __init__, with no word on what to write
    instead; it is a RequestError (a ValueError, as vLLM's) naming the field and what to do, as other bad fields."""
    (name,) = kwargs
    with pytest.raises(RequestError, match=f"no field '{name}'.*{hint}"):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
    assert SamplingParams(7, temperature=0.5).checked().max_new_tokens == 7  # positional and replace() still work


def test_vllm_max_tokens_is_max_new_tokens(llm):
    """vLLM's SamplingParams(max_tokens=4) was a TypeError: it is the same field as max_new_tokens now."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert params.max_new_tokens == 4 and params.max_tokens == 4
    assert len(llm.generate("hello", params)[0].token_ids) == 4
    with pytest.raises(RequestError, match="both max_tokens and max_new_tokens"):
        SamplingParams(max_tokens=4, max_new_tokens=5)
    with pytest.raises(RequestError, match="max_new_tokens must be in"):
        SamplingParams(max_tokens=0)


@needs_gptqmodel
def test_quantize_keeps_a_float16_models_dtype(tmp_path):
    """GPTQModel's automatic dtype is bfloat16 on a CPU: a float16 model's embeddings, norms and head were written
    as bfloat16 (rounded to 8 mantissa bits) and config.json said "dtype": "bfloat16", so transformers and
    `infer run --dtype auto` on a GPU ran it in bfloat16. The float tensors now keep the source's float16."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from infer.models.resolve import resolve_model
    from infer.quant.quantize import QuantizeOptions, quantize_model
    src = tmp_path / "fp16"
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama"), dtype=torch.float16)
    model.save_pretrained(src)
    for f in resolve_model("tiny-llama").glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    quantize_model(src, tmp_path / "q", QuantizeOptions(group_size=32, num_samples=4, seq_len=32))
    assert json.loads((tmp_path / "q" / "config.json").read_text())["dtype"] == "float16"
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        floats = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(("qweight", "qzeros", "g_idx"))}
        source = safe_open(src / "model.safetensors", "pt")
        assert {str(t.dtype) for t in floats.values()} == {"torch.float16"}
        for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            assert torch.equal(floats[k], source.get_tensor(k)), k  # not rounded through bfloat16


def test_quantize_passes_the_source_half_dtype_to_gptqmodel(tmp_path):
    from infer.quant.quantize import source_half_dtype
    for value, want in (("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", None), (None, None)):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": value} if value else {}))
        assert source_half_dtype(tmp_path) is want, value


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("key, value", [("target_modules", "(q_proj"), ("exclude_modules", "[v_proj")])
def test_a_module_regex_that_does_not_compile_is_refused(tmp_path, key, value):
    """peft refuses an adapter whose target_modules (or exclude_modules) regex does not compile (lora-validate said
    so through peft), but `infer run --lora`, `serve` and `LLM(loras=...)` served it, applying every weight."""
    from peft import PeftModel

    from infer.errors import LoRAError
    from infer.lora.adapter import load_adapter
    path = _edit_config(make_adapter(tmp_path, "re"), **{key: value})
    with pytest.raises(Exception):
        PeftModel.from_pretrained(tiny_llama(), str(path))
    with pytest.raises(LoRAError, match=f"{key} .* is not a valid regular expression") as e:
        load_adapter("re", path, tiny_config())
    assert "peft cannot load this adapter" in e.value.hint


def test_a_target_regex_is_matched_against_the_full_module_path_as_peft_does(tmp_path):
    """peft fullmatches a target_modules string against the module's full path (model.layers.0.self_attn.q_proj);
    infer also tried the path without "model.", so it served an adapter that peft refuses ("Target modules ... not
    found"). A regex that matches the full path still loads."""
    from peft import PeftModel

    from infer.errors import LoRAError
    from infer.lora.adapter import load_adapter
    short = _edit_config(make_adapter(tmp_path, "short"), target_modules=r"layers\.\d+\.self_attn\.(q|v)_proj")
    with pytest.raises(ValueError, match="not found in the base model"):
        PeftModel.from_pretrained(tiny_llama(), str(short))
    with pytest.raises(LoRAError, match="does not adapt"):
        load_adapter("short", short, tiny_config())
    full = _edit_config(make_adapter(tmp_path, "full"), target_modules=r"model\.layers\.\d+\.self_attn\.(q|v)_proj")
    PeftModel.from_pretrained(tiny_llama(), str(full))
    assert len(load_adapter("full", full, tiny_config()).modules) == 4


def test_sigterm_during_convert_removes_the_staging_folder(tmp_path):
    """`infer convert` killed by SIGTERM (a timeout, docker stop) left `.OUT.tmp-*` beside OUT, a whole model's
    size that no later run removes (exit 143); it now stops as Ctrl-C does, as `infer quantize` does."""
    import textwrap
    script = textwrap.dedent(f"""
        import os, signal, time
        import infer.quant.convert as c
        from infer.quant.convert import staged_output
        def fake(src, out, dtype=None, merge_lora=None, max_shard_size="4GB", overwrite=False, check_weights=None,
                 source_name=None, to="safetensors", shown=None):
            with staged_output(out, overwrite) as tmp:
                (tmp / "model.safetensors").write_bytes(b"x")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        c.convert_model = fake
        from infer.cli.main import app
        app(["convert", "tiny-llama", "-o", {str(tmp_path / "out")!r}], standalone_mode=True)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 143 and res.stderr.strip().splitlines()[-1] == "terminated", \
        (res.returncode, res.stderr[-2000:])
    assert list(tmp_path.iterdir()) == []  # no output, no hidden staging folder
