"""Session 55 probes: a newcomer follows README.md top to bottom on the built-in models and types the obvious
mistakes; each error must name the problem and a command that works with what the project installs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from infer.errors import ModelLoadError
from infer.models.resolve import resolve_model


def test_an_uncached_hub_id_is_told_a_download_command_the_installed_huggingface_hub_has(tmp_path, monkeypatch):
    """`infer run meta-llama/Llama-2-7b-hf ...` was told to run `huggingface-cli download ...`, a command
    huggingface_hub 1.0 removed (transformers 5 needs it: `hf` is what .venv/bin holds); the hint names `hf download`,
    which every huggingface_hub transformers >= 4.56 takes has."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("meta-llama/Llama-2-7b-hf")
    hint = e.value.hint
    assert "`hf download meta-llama/Llama-2-7b-hf`" in hint and "huggingface-cli" not in hint
    tool = hint.split("`")[1].split()[0]
    assert (Path(sys.executable).parent / tool).exists() or shutil.which(tool)
