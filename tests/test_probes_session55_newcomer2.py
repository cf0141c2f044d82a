"""Session 55 probes (second newcomer pass): what infer's commands print names the model as the user typed it, says
what is on, and tells the truth about what to do next."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from infer.cli.main import app


def test_warmup_names_a_built_in_model_as_typed():
    """`infer warmup tiny-llama` titled its table and filled the --json `model` field with the cache folder
    (`/.../tiny-llama-v2`, which reads as Llama 2), where `infer run tiny-llama` names `tiny-llama`."""
    args = ["warmup", "tiny-llama", "--max-length", "64", "--concurrency", "2", "--estimate"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["model"] == "tiny-llama"
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "infer warmup: tiny-llama  (estimate)" in result.output and "-v2" not in result.output


def test_lora_validates_table_names_a_built_in_base_as_typed(tmp_path):
    """`infer lora-validate tiny-llama ADAPTER` titled its table `LoRA adapters on tiny-llama-v2 (float)`: the cache
    folder's name, not the base as typed (a local folder is still named by its folder's name)."""
    import torch
    from transformers import AutoModelForCausalLM

    from infer.models.tiny import ensure_builtin
    from lora_helpers import save_adapter
    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin("tiny-llama"), dtype=torch.float32)
    adapter = save_adapter(hf, tmp_path / "qv", 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    result = CliRunner().invoke(app, ["lora-validate", "tiny-llama", str(adapter), "--steps", "0"])
    assert result.exit_code == 0, result.output
    assert "LoRA adapters on tiny-llama (float)" in result.output and "-v2" not in result.output
    result = CliRunner().invoke(app, ["lora-validate", str(ensure_builtin("tiny-llama")), str(adapter), "--steps", "0"])
    assert result.exit_code == 0 and "LoRA adapters on tiny-llama-v2 (float)" in result.output, result.output


def test_convert_to_gptq_of_a_built_in_float_model_names_it_as_typed(tmp_path):
    """`infer convert tiny-llama --to gptq` was told to run `infer quantize /.../tiny-llama-v2 -o OUT` (the cache
    folder); the refusal and its hint name the model as typed."""
    result = CliRunner().invoke(app, ["convert", "tiny-llama", "--to", "gptq", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "--to gptq: tiny-llama is a float model" in result.output
    assert "`infer quantize tiny-llama -o OUT`" in result.output and "-v2" not in result.output


class _NoUvicorn:
    def run(self, sockets=None):  # the banner is printed before this: serving nothing, it returns at once
        return None


def test_serves_banner_says_sleep_mode_is_on_with_its_routes(monkeypatch):
    """`infer serve --enable-sleep-mode` said nothing of sleep mode (vLLM logs that it is on): the banner names it
    and its routes, and says nothing of it without the flag."""
    import infer.serve.app  # noqa: F401  (imported first: its own uvicorn_server stays the real one)
    from infer.serve import lifecycle
    monkeypatch.setattr(lifecycle, "uvicorn_server", lambda *a, **k: _NoUvicorn())  # what cli/serve.py calls
    args = ["serve", "tiny-llama", "--port", "0", "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "2"]
    res = CliRunner().invoke(app, [*args, "--enable-sleep-mode"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("infer: serving"))
    assert ("sleep mode: on (POST /sleep?level=1 or 2&mode=abort, wait or keep, POST /wake_up, GET /is_sleeping)"
            in line), line
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "sleep mode" not in next(x for x in res.output.splitlines() if x.startswith("infer: serving"))


def test_ctrl_c_before_any_record_says_a_plain_re_run_does(tmp_path, monkeypatch, capsys):
    """Ctrl-C of `infer run ... -o OUT` before its first record said `0 of 2 records written ...; run the same command
    with --resume to complete the rest`, as if --resume were needed: nothing was written, a plain re-run (which it
    now says) starts the same, and --resume works too. Once records are on disk, --resume is still what it says."""
    import infer.cli.run as run_module
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi", "max_new_tokens": 2}\n{"id": "b", "prompt": "yo", '
                       '"max_new_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    args = ["run", "tiny-llama", str(prompts), "-o", str(out), "--max-model-len", "64", "--max-num-seqs", "2"]

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(run_module, "_generate", interrupted)
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 130, result.output
    assert f"interrupted: 0 of 2 records written to {out}; run the same command again (with or without --resume: " \
           "nothing was written to keep)" in result.output
    assert "to complete the rest" not in result.output
    result = CliRunner().invoke(app, args)  # what it says: a plain re-run
    assert result.exit_code == 0 and out.read_text().count("\n") == 2, result.output
    capsys.readouterr()
    with pytest.raises(typer.Exit):  # one record on disk: --resume keeps it
        run_module.exit_interrupted(KeyboardInterrupt(), out, True, 2, 2, 1)
    assert capsys.readouterr().err.strip() == f"interrupted: 1 of 2 records written to {out}; run the same command " \
        "with --resume to complete the rest"


def test_bench_progress_bars_leave_no_blank_line_off_a_terminal(tmp_path, capsys):
    """`infer bench ... > log` (or `2>&1 | tee`) began its output with a blank line per level: rich's Progress, on a
    console that is no terminal, draws nothing but prints an empty line when it stops. Off a terminal there is no
    bar now; on a terminal it still draws (and clears itself: transient)."""
    import io

    from rich.console import Console

    from infer.bench.driver import Progress
    with Progress(True, 3, "infer c=1") as bar:  # rich's own console: sys.stdout, captured here
        bar.advance(3)
    file = io.StringIO()
    with Progress(True, 3, "hf generate b=1", Console(file=file)) as bar:
        bar.advance(3)
    assert capsys.readouterr().out == "" and file.getvalue() == ""
    term = io.StringIO()
    with Progress(True, 3, "infer c=1", Console(file=term, force_terminal=True)) as bar:
        bar.advance(3)
    assert "infer c=1" in term.getvalue()
    args = ["bench", "tiny-llama", "--num-prompts", "2", "--concurrency", "1,2", "--input-len", "4",
            "--output-len", "2", "--max-model-len", "64", "-o", str(tmp_path / "b")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.lstrip(" ").startswith("infer bench: throughput"), repr(result.stdout[:80])
