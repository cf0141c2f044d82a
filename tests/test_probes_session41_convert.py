"""Session 41 probes of `infer convert` / `infer quantize` as a user runs them: what reaches the terminal when the
output cannot be written."""

from __future__ import annotations

import errno

from typer.testing import CliRunner

runner = CliRunner()


def _run_infer(*args):
    from infer.cli.main import app
    return runner.invoke(app, [*map(str, args)])


def _one_error(r, *words):
    assert r.exit_code == 2, (r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception  # no traceback reached the terminal
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.output
    for word in words:
        assert word in r.output, (word, r.output)


class _FullDisk(Exception):
    """What safetensors' writer raises on a full disk: not an OSError, only the OS's words."""


def test_convert_onto_a_full_disk_is_one_error_exit_2(tmp_path, monkeypatch):
    """safetensors' SafetensorError ("No space left on device (os error 28)") reached the terminal as a traceback,
    where README promises a one-line message and exit 2 for an output the disk cannot hold; nothing is left behind."""
    import transformers.modeling_utils as mu  # it holds safetensors' save_file under its own name

    def full(*args, **kwargs):
        raise _FullDisk("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(mu, "safe_save_file", full)
    out = tmp_path / "out"
    r = _run_infer("convert", "tiny-llama", "-o", out)
    _one_error(r, "no space left", str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no staging folder, no half-written model


def test_quantize_onto_a_full_disk_names_the_disk_not_gptqmodel(tmp_path, monkeypatch):
    """GPTQModel's save failing with ENOSPC was reported as "GPTQModel failed to quantize" with a hint to rerun with
    --verbose: the disk is full, which is what the message must say."""
    import pytest
    pytest.importorskip("gptqmodel")
    import infer.quant.quantize as q

    def run(src, out, *args, **kwargs):
        (out / "model.safetensors").write_bytes(b"partial")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise q.InferError(f"GPTQModel failed to quantize {src}: OSError: {e}", "rerun with --verbose") from e

    monkeypatch.setattr(q, "_run_gptqmodel", run)
    out = tmp_path / "out"
    r = _run_infer("quantize", "tiny-llama", "-o", out, "--group-size", "32", "--num-samples", "2", "--seq-len", "32")
    _one_error(r, "no space left", str(out))
    assert "GPTQModel failed" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_convert_into_an_existing_empty_folder_keeps_that_folder(tmp_path):
    """-o naming an existing empty folder (a container's mounted volume, a folder with its own permissions): the
    staged model was renamed over it after rmtree, which a mount point refuses (EBUSY, a traceback after all the
    work); the folder itself must stay and be filled."""
    from safetensors.torch import load_file
    out = tmp_path / "vol"
    out.mkdir()
    out.chmod(0o1777)
    inode = out.stat().st_ino
    r = _run_infer("convert", "tiny-llama", "-o", out)
    assert r.exit_code == 0, r.output
    assert out.stat().st_ino == inode and out.stat().st_mode & 0o7777 == 0o1777
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vol"]  # no staging folder left beside or inside
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert load_file(out / "model.safetensors")
    # --overwrite replaces the model in place too, and a staging folder a killed run left inside does not block it
    (out / ".infer-staging-old").mkdir()
    (out / "stale.bin").write_bytes(b"x")
    r = _run_infer("convert", "tiny-llama", "-o", out, "--overwrite", "--dtype", "float16")
    assert r.exit_code == 0, r.output
    assert out.stat().st_ino == inode and not (out / "stale.bin").exists()
    assert next(iter(load_file(out / "model.safetensors").values())).dtype.is_floating_point


def test_calibration_dataset_name_says_nothing_is_downloaded(tmp_path, monkeypatch):
    """--calibration wikitext2 / allenai/c4 (as GPTQModel's examples load them) said only "does not exist": a user
    expecting the dataset to be fetched learns that infer reads local files only."""
    from infer.errors import ConfigError
    from infer.quant.calibration import read_texts
    monkeypatch.chdir(tmp_path)
    for name in ("wikitext2", "allenai/c4"):
        try:
            read_texts(name)
        except ConfigError as e:
            assert "downloads nothing" in e.message and ".jsonl" in e.hint, e
        else:
            raise AssertionError("accepted")
    try:
        read_texts("missing.txt")
    except ConfigError as e:
        assert "does not exist" in e.message
