"""Probes of the forty-eighth session's newcomer soak of the CLI: what a first user types and the bad inputs they
plausibly give, each answered with one clear paragraph."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def _model_without(tmp_path: Path, *drop: str) -> Path:
    """A copy of the built-in tiny-llama folder without the files named in `drop`."""
    from infer.models.resolve import resolve_model
    src = resolve_model("tiny-llama")
    out = tmp_path / "model"
    out.mkdir()
    for f in src.iterdir():
        if f.name not in drop:
            shutil.copy(f, out / f.name)
    return out


TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.mark.parametrize("broken", ["missing", "truncated", "binary"])
def test_a_model_folder_without_a_usable_tokenizer_is_one_paragraph_naming_the_file(tmp_path, broken):
    """A folder with config.json and weights but no tokenizer (a download of `*.safetensors config.json` only) got
    transformers' five-line "Couldn't instantiate the backend tokenizer from one of: (1) ... (2) ... (3) ..."; a
    truncated tokenizer.json got a bare JSON error naming no file, with a hint that the folder lacks tokenizer files.
    Now: the folder has no tokenizer files, or the file that cannot be read, in one line each."""
    from infer.engine.setup import load_tokenizer
    from infer.errors import ModelLoadError
    from infer.models.resolve import resolve_model
    path = _model_without(tmp_path, *TOKENIZER)
    if broken == "truncated":
        (path / "tokenizer.json").write_bytes((resolve_model("tiny-llama") / "tokenizer.json").read_bytes()[:300])
    elif broken == "binary":
        (path / "tokenizer.json").write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(path)
    text = f"{e.value.message} {e.value.hint}"
    assert "\n" not in text, text
    if broken == "missing":
        assert f"{path} has no tokenizer files" in e.value.message and "tokenizer.json" in e.value.hint
    else:
        assert f"tokenizer file {path / 'tokenizer.json'} cannot be read" in e.value.message
        assert "corrupted or truncated" in e.value.hint


def test_quantize_names_a_folder_without_tokenizer_files_in_one_paragraph(tmp_path):
    """`infer quantize` tokenizes its calibration text: a folder without tokenizer files got transformers'
    multi-line message inside parentheses."""
    from infer.errors import ModelLoadError
    from infer.quant.quantize import _tokenizer
    path = _model_without(tmp_path, *TOKENIZER)
    with pytest.raises(ModelLoadError) as e:
        _tokenizer(path)
    assert "\n" not in f"{e.value.message} {e.value.hint}"
    assert f"{path} has no tokenizer files" in e.value.message and "calibration" in e.value.hint


def test_a_quoted_tilde_input_file_is_read_from_home_as_dash_o_is(tmp_path, monkeypatch):
    """`infer run MODEL "~/my prompts.jsonl"` (quoted for the space, so the shell leaves `~` alone) was "input file
    ~/my prompts.jsonl does not exist", while -o ~/... was expanded."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "my prompts.jsonl").write_text("\n")  # no request: answered without loading the model
    result = CliRunner().invoke(app, ["run", "tiny-llama", "~/my prompts.jsonl", "-o", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 0, result.output
    assert "holds no requests" in result.output and (tmp_path / "out.jsonl").is_file()


def test_a_quoted_tilde_lora_path_is_read_from_home(tmp_path, monkeypatch):
    """`--lora "support=~/adapters/support"` was "~/adapters/support is not a folder", with a hint that the folder
    '~' had no such entry and "did you mean" the very folder given; lora-validate, --merge-lora and the model path
    expanded `~` already."""
    from infer.engine.config import EngineConfig
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "adapters" / "support").mkdir(parents=True)
    config = EngineConfig("tiny-llama", loras=["support=~/adapters/support"])
    assert config.loras == {"support": str(tmp_path / "adapters" / "support")}
    assert EngineConfig("tiny-llama", loras={"s": Path("~/adapters/support")}).loras == {
        "s": str(tmp_path / "adapters" / "support")}


def test_output_format_openai_with_an_input_of_infer_lines_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """`infer run MODEL prompts.jsonl -o out.jsonl --output-format openai` with plain `{"prompt": ...}` lines loaded
    the model (minutes for a large one) before saying that no line is an OpenAI batch line; an existing output
    stays as it was."""
    from typer.testing import CliRunner

    import infer.cli.run as run_mod
    from infer.cli.main import app

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(run_mod, "_start_engine", no_load)
    src = tmp_path / "prompts.jsonl"
    src.write_text('{"prompt": "hi"}\n{"prompt": [\n{"prompt": "there", "id": "b"}\n')
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    result = CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "--output-format", "openai"])
    assert result.exit_code == 2, result.output
    assert "no line of the input is an OpenAI batch line (line 1 is in infer's own format)" in result.output
    assert out.read_text() == "kept\n"


def test_quantize_errors_before_calibration_start_without_an_empty_line(tmp_path):
    """Every `infer quantize` refusal found before calibrating (a bad --calibration file, a GPTQ source...) printed
    an empty line before "error:" when stderr is not a terminal (a log, CI): the progress bar that never started was
    stopped, and rich prints a newline for that."""
    import io

    from rich.console import Console

    from infer.cli.quantize import RichObserver
    out = io.StringIO()
    RichObserver(Console(file=out)).stop()
    assert out.getvalue() == ""


def test_an_output_symlink_that_loops_is_one_line_not_a_traceback(tmp_path):
    """`-o` naming a symbolic link that leads back to itself ended in a RuntimeError traceback ("Symlink loop")
    from the resume file's path; it is now refused before the model loads."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    src = tmp_path / "prompts.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    result = CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(tmp_path / "a")])
    assert result.exit_code == 2, result.output
    assert "is a symbolic link that leads back to itself" in result.output, result.output


@pytest.mark.parametrize("command", [["convert", "tiny-llama"], ["quantize", "tiny-llama", "--group-size", "32"]])
def test_an_output_folder_symlink_that_loops_is_one_line_not_a_traceback(tmp_path, command):
    """`infer convert/quantize MODEL -o LINK` with a link that leads back to itself ended in a RuntimeError
    traceback ("Symlink loop") from the check that OUT is not the source folder."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    result = CliRunner().invoke(app, [*command, "-o", str(tmp_path / "a")])
    assert result.exit_code == 2, result.output
    assert "is a symbolic link that leads back to itself" in result.output, result.output
