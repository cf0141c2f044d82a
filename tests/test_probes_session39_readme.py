"""Session 39 probes of README.md's examples and claims, run as a newcomer runs them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app


class _Stop(Exception):
    pass


@pytest.fixture(autouse=True)
def _no_server(monkeypatch):
    """A refusal that did not come would start a real server: serving raises _Stop instead."""
    def never(*a, **kw):
        raise _Stop
    monkeypatch.setattr("infer.cli.serve._serve", never)


@pytest.mark.parametrize("argv, named", [
    (["--prefix-caching", "--no-enable-prefix-caching"], "--prefix-caching and --no-enable-prefix-caching"),
    (["--no-enable-prefix-caching", "--prefix-caching"], "--prefix-caching and --no-enable-prefix-caching"),
    (["--no-prefix-caching", "--enable-prefix-caching"], "--no-prefix-caching and --enable-prefix-caching"),
])
def test_infers_prefix_caching_spelling_at_its_default_against_vllms_opposite_is_refused(argv, named):
    """`--prefix-caching` (True, the default) with `--no-enable-prefix-caching` was taken as the latter, silently."""
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", *argv])
    assert result.exit_code == 2, result.output
    assert named in result.output and "opposite" in result.output


@pytest.mark.parametrize("flag", ["-o", "--output"])
def test_run_with_an_empty_output_is_refused_as_empty_not_as_a_directory(tmp_path, flag):
    """`infer run M in.jsonl -o "$UNSET"` said "-o . is a directory", naming a folder the user never gave."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["run", "tiny-llama", str(prompts), flag, ""])
    assert result.exit_code == 2, result.output
    assert "-o is empty" in result.output and "is a directory" not in result.output


def test_python_add_lora_of_a_loaded_name_names_replace_true(tmp_path):
    """The Python API's refusal pointed at `load_inplace`, the server's field, which add_lora does not take."""
    from infer import LLM
    from infer.errors import LoRANameError
    from lora_helpers import THREE, hf_float, save_adapter
    llm = LLM("tiny-llama", enable_lora=True, max_loras=1)
    save_adapter(hf_float(str(llm.engine.model_path)), tmp_path / "a", 0, **THREE["a"])
    llm.add_lora("sql", str(tmp_path / "a"))
    with pytest.raises(LoRANameError) as e:
        llm.add_lora("sql", str(tmp_path / "a"))
    assert "replace=True" in str(e.value)
