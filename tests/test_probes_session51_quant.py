"""Session 51 probes of `infer quantize` and `infer convert`: inputs inside OUTPUT, ..."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from infer.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_llama():
    from infer.models.resolve import resolve_model
    return resolve_model("tiny-llama")


def _model_folder(tiny: Path, dest: Path) -> Path:
    """An existing output folder holding a model (what --overwrite replaces)."""
    shutil.copytree(tiny, dest)
    return dest


def test_overwrite_refuses_a_calibration_file_inside_the_output_folder(tmp_path, tiny_llama, monkeypatch):
    """--overwrite emptied OUTPUT after calibrating, deleting the --calibration file read from inside it."""
    from infer.quant import quantize as q
    out = _model_folder(tiny_llama, tmp_path / "out")
    calib = out / "texts" / "calib.txt"
    calib.parent.mkdir()
    calib.write_text("some calibration text " * 40)

    def reached(*a, **k):
        raise AssertionError("calibration started")
    monkeypatch.setattr(q, "require_gptqmodel", reached)
    with pytest.raises(ConfigError, match="--calibration .* inside the output folder"):
        q.quantize_model(tiny_llama, out, q.QuantizeOptions(group_size=32), calibration=calib, overwrite=True)
    assert calib.is_file()
    hidden = out / ".cache" / "calib.txt"  # a hidden entry --overwrite keeps: read from there, nothing is lost
    hidden.parent.mkdir()
    hidden.write_text("x")
    with pytest.raises(AssertionError, match="calibration started"):
        q.quantize_model(tiny_llama, out, q.QuantizeOptions(group_size=32), calibration=hidden, overwrite=True)


def test_overwrite_refuses_a_merge_lora_adapter_inside_the_output_folder(tmp_path, tiny_llama):
    """convert --merge-lora OUT/adapter -o OUT --overwrite deleted the adapter it had just merged."""
    from infer.quant.convert import convert_model
    out = _model_folder(tiny_llama, tmp_path / "out")
    adapter = out / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="--merge-lora .* inside the output folder"):
        convert_model(tiny_llama, out, merge_lora=adapter, overwrite=True)
    assert (adapter / "adapter_config.json").is_file() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("raised, outcome", [(KeyboardInterrupt, "interrupted"), (RuntimeError, "failed"),
                                             (None, "done")])
def test_the_progress_bar_ends_with_how_the_run_ended(tmp_path, monkeypatch, capsys, raised, outcome):
    """The bar's last frame said "saving" after an interrupt or an error (and after the save had finished)."""
    from infer.cli.quantize import run_quantization
    from infer.quant import quantize as q
    from infer.quant.calibration import CalibrationSet

    def fake(src, out, options, calibration, observer, **kw):
        observer.start(2, CalibrationSet("built-in", [{"input_ids": [1] * 16, "attention_mask": [1] * 16}]))
        observer.layer_done(0)
        if raised is not None:
            raise raised()
        observer.layer_done(1)
        assert observer.progress.tasks[0].fields["detail"] == "saving"  # after the last layer: GPTQModel saves
        return "result"
    monkeypatch.setattr(q, "quantize_model", fake)
    if raised is None:
        assert run_quantization(tmp_path, tmp_path / "o", q.QuantizeOptions(), None, overwrite=False,
                                verbose=True) == "result"
    else:
        with pytest.raises(raised):
            run_quantization(tmp_path, tmp_path / "o", q.QuantizeOptions(), None, overwrite=False, verbose=True)
    err = capsys.readouterr().err
    last = [line for line in err.splitlines() if "Quantizing layers" in line][-1]
    assert outcome in last and "saving" not in last, err
