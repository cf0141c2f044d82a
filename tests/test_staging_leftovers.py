"""A run of `infer convert` / `infer quantize` killed outright (SIGKILL, a lost machine) leaves its staging folder, a
whole model's size, beside or inside OUT; nothing removed it. The staging folder's name now says which host and
process writes it, and the next run to that OUT removes the folders of processes that are gone, and only those."""

from __future__ import annotations

import os
import subprocess
import sys

from infer.quant.convert import STAGING_PREFIX, _host, staged_output


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _leftover(folder, name):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).mkdir()
    (folder / name / "model.safetensors").write_bytes(b"x" * 100)
    return folder / name


def test_a_new_output_removes_the_staging_folders_of_killed_runs_beside_it_and_keeps_the_others(tmp_path, capsys):
    out, host, dead = tmp_path / "out", _host(), _dead_pid()
    killed = _leftover(tmp_path, f".out.tmp-{host}-{dead}-abc")
    running = _leftover(tmp_path, f".out.tmp-{host}-{os.getppid()}-abc")  # a live process: still writing
    remote = _leftover(tmp_path, f".out.tmp-{host}x-{dead}-abc")  # another host's (a shared disk): not ours to judge
    older = _leftover(tmp_path, ".out.tmp-abc123")  # an older infer's: who wrote it is not known
    other = _leftover(tmp_path, f".other.tmp-{host}-{dead}-abc")  # another OUT's
    with staged_output(out, overwrite=False) as tmp:
        assert tmp.name.startswith(f".out.tmp-{host}-{os.getpid()}-")
        (tmp / "config.json").write_text("{}")
    assert (out / "config.json").is_file()
    assert not killed.exists()
    assert running.exists() and remote.exists() and older.exists() and other.exists()
    assert f"removed {killed}" in capsys.readouterr().err


def test_an_existing_output_removes_the_staging_folders_of_killed_runs_inside_it(tmp_path):
    out, host, dead = tmp_path / "out", _host(), _dead_pid()
    killed = _leftover(out, f"{STAGING_PREFIX}{host}-{dead}-abc")
    running = _leftover(out, f"{STAGING_PREFIX}{host}-{os.getppid()}-abc")
    with staged_output(out, overwrite=False) as tmp:
        assert tmp.parent == out and tmp.name.startswith(f"{STAGING_PREFIX}{host}-{os.getpid()}-")
        (tmp / "config.json").write_text("{}")
    assert (out / "config.json").is_file() and not killed.exists() and running.exists()
