"""`infer run --data-parallel 2` on a local Ray runtime (started once for the module) with CPU replicas: the same
records as one engine id for id, error records for bad lines, a replica killed mid-run loses nothing, and a driver
killed mid-run is completed by --resume with exactly one record per id."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()
BAD = ["this is not json", {"id": "noprompt", "max_new_tokens": 3}, {"id": "topp", "prompt": "x", "top_p": 2.0},
       {"id": "ctx", "prompt": "word " * 600}, {"id": "lora", "prompt": "x", "lora": "nope"}]
STARTED = len(BAD) + 2  # error records are written first: two more lines mean generation is under way


def _lines(n: int, tokens: int = 24) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"request number {i} about the weather", "max_new_tokens": tokens + i % 7,
             "ignore_eos": True} for i in range(n)]


def _write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def _records(path) -> dict:
    recs = [json.loads(l) for l in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in recs}
    assert len(by_id) == len(recs), "an id was written twice"
    return by_id


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'infer[ray]')")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2 ** 20, logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _run(inp, out, *extra):
    return runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--max-num-seqs", "4",
                               "--max-model-len", "512", *extra])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One input for every test (good lines of different lengths and bad lines), and its single-engine records:
    the oracle."""
    d = tmp_path_factory.mktemp("job")
    inp = _write(d / "in.jsonl", _lines(24, tokens=40) + BAD)
    res = _run(inp, d / "single.jsonl")
    assert res.exit_code == 1, res.output
    return inp, _records(d / "single.jsonl")


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for rid, rec in want.items():
        assert got[rid]["token_ids"] == rec["token_ids"], rid
        assert (got[rid]["text"], got[rid]["finish_reason"], got[rid]["error"]) == \
            (rec["text"], rec["finish_reason"], rec["error"]), rid


def test_same_records_as_one_engine_and_error_records(tmp_path, ray_cluster, job):
    inp, want = job
    out = tmp_path / "dp.jsonl"
    res = _run(inp, out, "--data-parallel", "2")
    assert res.exit_code == 1, res.output  # some lines failed, each has its error record
    got = _records(out)
    _assert_same(got, want)
    errors = {k for k, v in got.items() if v["finish_reason"] == "error"}
    assert errors == {"line25", "noprompt", "topp", "ctx", "lora"}
    assert "max-model-len" in got["ctx"]["error"] or "context" in got["ctx"]["error"]
    assert "nope" in got["lora"]["error"] and "JSON" in got["line25"]["error"]


def _kill_replica_when(out, ray, at_least: int, killed: list) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        names = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors()]
        mine = [n for n in names if n.startswith("infer-") and n.endswith("-replica-0")]
        if mine and out.exists() and len(out.read_text().splitlines()) >= at_least:
            killed.append(len(out.read_text().splitlines()))
            ray.kill(ray.get_actor(mine[0]), no_restart=True)
            return
        time.sleep(0.02)


def test_killed_replica_loses_nothing(tmp_path, ray_cluster, job):
    import ray
    inp, want = job
    out, killed = tmp_path / "dp.jsonl", []
    killer = threading.Thread(target=_kill_replica_when, args=(out, ray, STARTED, killed), daemon=True)
    killer.start()
    res = _run(inp, out, "--data-parallel", "2")
    killer.join(timeout=5)
    assert res.exit_code == 1, res.output
    assert killed and killed[0] < len(want) - 3, "the replica should be killed mid-run"
    assert "replica 0 stopped" in res.output
    _assert_same(_records(out), want)


def test_resume_after_driver_kill(tmp_path, ray_cluster, job):
    inp, want = job
    n, out = len(want), tmp_path / "dp.jsonl"
    cmd = [sys.executable, "-m", "infer.cli", "run", "tiny-llama", str(inp), "-o", str(out), "-q",
           "--max-num-seqs", "4", "--max-model-len", "512", "--data-parallel", "2", "--ray-address", ray_cluster]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None and \
            (not out.exists() or len(out.read_text().splitlines()) < STARTED):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = len(out.read_text().splitlines())
    assert STARTED <= first < n, "the kill should land midway"
    with open(out, "a") as f:
        f.write('{"id": "r99", "text": "torn')  # a torn last line, as a kill mid-write leaves
    res = _run(inp, out, "--data-parallel", "2", "--resume")
    # the bad lines' error records were written before the kill: the resumed run has failed lines too (exit 1, as
    # the run in one go), and says the records are from before
    assert res.exit_code == 1 and "error record(s) from before this resume" in res.output, res.output
    _assert_same(_records(out), want)  # one record per id, none lost or doubled, each as one engine writes it


def test_without_ray_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    inp = _write(tmp_path / "in.jsonl", _lines(1))
    res = _run(inp, tmp_path / "out.jsonl", "--data-parallel", "2")
    assert res.exit_code == 2
    assert "error: --data-parallel and --ray-address need Ray" in res.output
    assert "hint: pip install 'infer[ray]'" in res.output and "Traceback" not in res.output
