"""Session 51: README examples followed by a newcomer, where the code broke a README promise."""
import pytest

from infer.errors import ModelLoadError
from infer.models.resolve import resolve_model


def _refusal(name):
    with pytest.raises(ModelLoadError) as info:
        resolve_model(name)
    return info.value


def test_a_mistyped_path_under_an_existing_folder_names_its_closest_entry_not_a_builtin(tmp_path, monkeypatch):
    # README: "a mistyped path under an existing folder [is answered] with that folder's closest entry";
    # `./tiny-llama-gpt` (meant: the `./tiny-llama-gptq` that `infer quantize tiny-llama -o ./tiny-llama-gptq`
    # wrote) was answered with the built-in `tiny-llama` instead, a model the user did not mean.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama-gptq").mkdir()
    (tmp_path / "sub" / "tiny-llama-gptq").mkdir(parents=True)
    for typed, meant in [("./tiny-llama-gpt", "tiny-llama-gptq"), ("sub/tiny-llama-gpt", "sub/tiny-llama-gptq")]:
        hint = _refusal(typed).hint
        assert f"did you mean {meant!r}" in hint, hint
        assert "built-in" not in hint


def test_a_misspelt_bare_builtin_name_still_suggests_the_builtin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama-gptq").mkdir()
    assert "did you mean the built-in model 'tiny-llama'" in _refusal("tiny-lama").hint
