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
    with pytest.raises(AssertionError, match="calibration started"):  # a typo: not "inside", named as missing later
        q.quantize_model(tiny_llama, out, q.QuantizeOptions(group_size=32), calibration=out / "typo.txt",
                         overwrite=True)
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
    (out / "adapter_config.json").write_text("{}")  # OUTPUT is the adapter's folder (one holding a config.json)
    with pytest.raises(ConfigError, match="--merge-lora .* is the output folder"):
        convert_model(tiny_llama, out, merge_lora=out, overwrite=True)


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


def test_a_fill_killed_between_renames_leaves_no_model_folder(tmp_path):
    """Filling an existing OUTPUT moved config.json in before the weights and tokenizer files: a run killed
    (SIGKILL: no cleanup) between two renames left a folder with config.json and files missing, which loads as a
    model (without its tokenizer_config.json: another end-of-sequence token, no chat template)."""
    import subprocess
    import sys
    import textwrap
    out = tmp_path / "out"
    out.mkdir()
    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from infer.quant.convert import staged_output
        real = Path.rename
        def rename(self, target):
            if Path(target).name == "tokenizer_config.json":
                os._exit(9)  # killed here: no finally runs
            return real(self, target)
        Path.rename = rename
        with staged_output(Path({str(out)!r}), overwrite=False) as tmp:
            for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
                (tmp / name).write_text("{{}}")
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    assert not (out / "config.json").exists(), sorted(p.name for p in out.iterdir())


def test_a_fill_killed_while_deleting_the_old_model_leaves_no_model_folder(tmp_path):
    """--overwrite deleted the old model's files in directory order: killed after its tokenizer_config.json (or a
    shard) went but before its config.json, the folder still looked like a model with files missing."""
    import subprocess
    import sys
    import textwrap
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text("{}")
    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from infer.quant.convert import staged_output
        real, seen, listing = Path.unlink, [], Path.iterdir
        Path.iterdir = lambda self: iter(sorted(listing(self), reverse=True))  # a directory order: config.json last
        def unlink(self, missing_ok=False):
            seen.append(self.name)
            if len(seen) == 2:
                os._exit(9)  # killed while deleting the old model
            return real(self, missing_ok=missing_ok)
        Path.unlink = unlink
        with staged_output(Path({str(out)!r}), overwrite=True) as tmp:
            (tmp / "config.json").write_text("{{}}")
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    assert not (out / "config.json").exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_or_failed_quantize_waits_for_gptqmodels_workers(tmp_path, tiny_llama, monkeypatch, raised):
    """Ctrl-C or SIGTERM while GPTQModel's daemon workers were inside a torch call (torch.linalg.cholesky of a
    module's solve) let the interpreter exit under them: the worker, ended as it took the GIL back, unwound through
    torch's C++ and aborted the process ("terminate called without an active exception", exit 134, not 130/143)."""
    gptqmodel = pytest.importorskip("gptqmodel")
    from infer.quant import quantize as q
    from infer.quant.calibration import CalibrationSet
    waited = []

    class Pool:
        def wait(self, *a, **k):
            waited.append(True)

    class FakeGPTQModel:
        @staticmethod
        def load(*a, **k):
            raise raised("stopped while the workers solve")
    monkeypatch.setattr(gptqmodel, "_DEVICE_THREAD_POOL", Pool(), raising=False)
    monkeypatch.setattr(gptqmodel, "GPTQModel", FakeGPTQModel)
    calib = CalibrationSet("built-in", [{"input_ids": [1] * 16, "attention_mask": [1] * 16}])
    with pytest.raises(KeyboardInterrupt if raised is KeyboardInterrupt else q.InferError):
        q._run_gptqmodel(tiny_llama, tmp_path / "o", q.QuantizeOptions(group_size=32), calib, tmp_path,
                         q.QuantizeObserver())
    assert waited == [True]


def _with_config(tiny: Path, dest: Path, **changes) -> Path:
    import json
    shutil.copytree(tiny, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dest


@pytest.mark.parametrize("changes, words", [({"vocab_size": 514}, "vocab_size (514) is not a multiple of 4"),
                                            ({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1,
                                              "head_dim": 16}, "hidden_size (48) is not a multiple of 32")])
def test_lm_head_whose_widths_gptqmodel_cannot_pack_is_refused_before_calibration(tmp_path, tiny_llama, monkeypatch,
                                                                                  changes, words):
    """--lm-head on a vocabulary of 514 (or a hidden size that GPTQModel's head groups of 32 do not divide) quantized
    for minutes and wrote a checkpoint infer refused to load ("lm_head (output 514): the width does not pack into
    int32 words of 4 8-bit values") and vLLM too. Refused up front now; without --lm-head the head stays float."""
    from infer.quant import quantize as q
    src = _with_config(tiny_llama, tmp_path / "m", **changes)

    def reached(*a, **k):
        raise AssertionError("calibration started")
    monkeypatch.setattr(q, "_check_tensors", reached)  # the step after the config checks
    with pytest.raises(ConfigError, match="--lm-head") as e:
        q.quantize_model(src, tmp_path / "o", q.QuantizeOptions(group_size=-1, lm_head=True))
    assert words in str(e.value) and "without --lm-head" in e.value.hint
    with pytest.raises(AssertionError, match="calibration started"):  # the body alone packs: not refused
        q.quantize_model(src, tmp_path / "o", q.QuantizeOptions(group_size=-1))


def test_an_output_folder_made_by_another_run_meanwhile_is_one_error_and_left_as_it_is(tmp_path):
    """Two runs to the same new -o: the second to finish renamed its staging folder onto the first's model, an
    OSError traceback ("Directory not empty") after all its work."""
    from infer.errors import OutputError
    from infer.quant.convert import staged_output
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="created and filled by something else") as e:
        with staged_output(out, overwrite=False) as tmp:
            (tmp / "config.json").write_text("mine")
            out.mkdir()
            (out / "config.json").write_text("theirs")  # the other run finished first
    assert "another -o" in e.value.hint
    assert (out / "config.json").read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
