"""Session 43 probes of `infer quantize` / `infer convert` options and inputs (calibration files, GPTQ settings)."""

from __future__ import annotations

import pytest

from infer.errors import ConfigError
from infer.quant import calibration as calib_mod


def test_txt_blank_lines_holding_spaces_separate_paragraphs(tmp_path):
    """A line with only spaces or tabs is a blank line (as editors show it): it separates paragraphs, so the lines of
    one paragraph stay one sample instead of each line becoming a sample (an EOS between them)."""
    f = tmp_path / "c.txt"
    f.write_text("first para\nstill first\n  \nsecond para\nstill second\n\t\nthird\n")
    assert calib_mod.read_texts(f) == ["first para\nstill first", "second para\nstill second", "third"]
    f.write_text("a\nb\n\nc\nd\n \ne\n")  # mixed: an empty and a spaces-only blank line
    assert calib_mod.read_texts(f) == ["a\nb", "c\nd", "e"]


@pytest.mark.parametrize("name, body, want", [
    ("TEXTS.TXT", "one\n\ntwo\n", ["one", "two"]),
    ("Chats.JSONL", '{"text": "alpha"}\n{"prompt": "beta"}\n', ["alpha", "beta"]),
], ids=["txt", "jsonl"])
def test_calibration_suffix_in_capitals_is_read(tmp_path, name, body, want):
    f = tmp_path / name
    f.write_text(body)
    assert calib_mod.read_texts(f) == want


def test_calibration_other_suffix_still_refused(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"text": "x"}')
    with pytest.raises(ConfigError, match="neither .txt nor .jsonl"):
        calib_mod.read_texts(f)


@pytest.mark.parametrize("bits, where", [(8, "config.json"), (8, "quantize_config.json"), (4, "config.json")])
def test_convert_refusal_names_the_checkpoints_bit_width(tmp_path, bits, where):
    """--dtype on a GPTQ checkpoint is refused before any tensor is read; the reason names its real packing (an 8-bit
    checkpoint was said to hold "packed int4" weights)."""
    import json

    from infer.quant.convert import convert_model
    src = tmp_path / "gptq"
    src.mkdir()
    qc = {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": False, "sym": True}
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    if where == "config.json":
        config["quantization_config"] = qc
    else:
        (src / "quantize_config.json").write_text(json.dumps(qc))
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        convert_model(src, tmp_path / "out", dtype="float16")
    assert e.value.message.endswith(f"its weights are packed int{bits}")


def test_tilde_in_an_output_or_calibration_path_is_the_home_folder(tmp_path, monkeypatch):
    """`--output=~/x` (the shell expands no ~ after "=") wrote into a folder named `~` in the current one, and
    `--calibration=~/c.txt` was "not found", while MODEL's ~ was expanded; both now mean the home folder."""
    from pathlib import Path

    from typer.testing import CliRunner

    from infer.cli.main import app
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    (home / "c.txt").write_text("some calibration text\n\nand another paragraph\n")
    assert calib_mod.read_texts(Path("~/c.txt")) == ["some calibration text", "and another paragraph"]
    res = CliRunner().invoke(app, ["convert", "tiny-llama", "--output=~/conv"])
    assert res.exit_code == 0, res.output
    assert (home / "conv" / "config.json").is_file() and not (cwd / "~").exists()
    (home / "q").mkdir()
    (home / "q" / "notes.txt").write_text("x")
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "--output=~/q", "--group-size", "32"])
    assert res.exit_code == 2 and f"output folder {home / 'q'} is not empty" in " ".join(res.output.split())


def test_convert_into_a_git_clone_keeps_its_git_folder(tmp_path):
    """A Hugging Face repo cloned to push a model holds .git and .gitattributes: writing into it was refused ('not
    empty', then with --overwrite 'holds no model'), and --overwrite of a clone holding a model deleted its .git
    (the history, and the LFS settings). Hidden entries are now left as they are and do not count as content."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    repo = tmp_path / "repo"
    (repo / ".git" / "objects").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    res = CliRunner().invoke(app, ["convert", "tiny-llama", "-o", str(repo)])
    assert res.exit_code == 0, res.output
    assert (repo / "config.json").is_file() and (repo / "model.safetensors").is_file()
    (repo / "old-notes.txt").write_text("x")  # a model's folder: --overwrite replaces what is not hidden
    res = CliRunner().invoke(app, ["convert", "tiny-llama", "-o", str(repo), "--overwrite"])
    assert res.exit_code == 0, res.output
    assert (repo / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n" and (repo / ".gitattributes").is_file()
    assert not (repo / "old-notes.txt").exists() and (repo / "config.json").is_file()
    assert not [p for p in repo.iterdir() if p.name.startswith(".infer-staging-")]


def test_run_output_with_a_tilde_is_written_in_the_home_folder(tmp_path, monkeypatch):
    """`infer run ... --output=~/o.jsonl` (no shell expansion after "=") wrote ./~/o.jsonl, as quantize did."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    (cwd / "p.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", "p.jsonl", "--output=~/o.jsonl", "--max-new-tokens", "2"])
    assert res.exit_code == 0, res.output
    assert (home / "o.jsonl").is_file() and not (cwd / "~").exists()
