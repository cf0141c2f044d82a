"""Probe round (session 18) of the Ray data parallelism: `run --data-parallel` stops on SIGTERM as one engine does,
--ray-address with nothing listening and more CPU replicas than the cluster holds fail at once instead of hanging,
a step failure's error record is one engine's, and `serve --data-parallel` checks an idle replica also while
another one is busy and answers 503 no_engine_replica to a request whose last replica died under it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import fail_steps_of, kill_actor

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'infer[ray]')")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_ray_run import BAD, STARTED, _lines, _write  # noqa: E402

CLI = [sys.executable, "-m", "infer.cli", "run", "tiny-llama"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2 ** 20, logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_ray_address_with_nothing_listening_fails_at_once(tmp_path):
    """ray.init retried the silent address for minutes (20 tries of ~35 s): the run hung."""
    inp = _write(tmp_path / "in.jsonl", _lines(1))
    with socket.socket() as s:  # bound, never listening: refused, and no other process can take the port meanwhile
        s.bind(("127.0.0.1", 0))
        res = subprocess.run(CLI + [str(inp), "-o", str(tmp_path / "out.jsonl"), "-q", "--ray-address",
                                    f"127.0.0.1:{s.getsockname()[1]}"], capture_output=True, text=True, timeout=90)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "nothing answers there" in res.stderr and "ray start --head" in res.stderr


def test_more_cpu_replicas_than_the_cluster_holds_is_an_error_not_a_hang(tmp_path, ray_cluster):
    """On a 2-CPU cluster the third replica waited for a CPU for ever (Ray keeps it pending): the run hung."""
    inp = _write(tmp_path / "in.jsonl", _lines(1))
    res = subprocess.run(CLI + [str(inp), "-o", str(tmp_path / "out.jsonl"), "-q", "--max-model-len", "128",
                                "--data-parallel", "3", "--ray-address", ray_cluster],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--data-parallel 3 needs 3 CPU replicas" in res.stderr and "use --data-parallel 2" in res.stderr


def test_sigterm_stops_a_data_parallel_run_as_one_engine(tmp_path, ray_cluster):
    """ray.init's own SIGTERM handler (sys.exit(15)) won: exit 15 and not a word, where one engine exits 143 and
    says how many records are on disk and to --resume."""
    inp = _write(tmp_path / "in.jsonl", _lines(24, tokens=40) + BAD)
    out = tmp_path / "dp.jsonl"
    cmd = CLI + [str(inp), "-o", str(out), "-q", "--max-num-seqs", "4", "--max-model-len", "512",
                 "--data-parallel", "2", "--ray-address", ray_cluster]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None and \
            (not out.exists() or len(out.read_text().splitlines()) < STARTED):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    written = len(out.read_text().splitlines())
    assert f"terminated: {written} of {len(_lines(24)) + len(BAD)} records written to {out}" in err
    assert "run the same command with --resume" in err


def test_a_step_failure_is_one_engines_error_record(monkeypatch, tmp_path):
    """One engine writes 'internal engine error: ...' for a request it failed on inside a step; the data-parallel
    driver wrote 'line N: internal engine error: ...', as if the line were bad."""
    from fakeray import FakeRay, Handle as _Handle

    from infer.cli import run as one, run_parallel
    from infer.cli.batch_io import RecordWriter, read_inputs
    from infer.engine.config import EngineConfig
    from infer.parallel.pool import ReplicaPool
    from infer.parallel.replica import Replica
    fail_steps_of(monkeypatch, "poison")
    inp = _write(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x", "max_new_tokens": 3},
                                         {"id": "poison", "prompt": "y", "max_new_tokens": 3}])
    cfg = EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=1, memory_limit=2 ** 29)
    replicas = [Replica(cfg) for _ in range(2)]
    tokenizer = replicas[0].engine.tokenizer
    records = []
    for path in (tmp_path / "one.jsonl", tmp_path / "dp.jsonl"):
        lines = read_inputs(inp, tokenizer, {"max_new_tokens": 3}, None, 64)
        writer = RecordWriter(path, append=False)
        if path.name == "one.jsonl":
            one._generate(replicas[0].engine, lines, writer, True)
        else:
            pool = ReplicaPool(FakeRay(), [_Handle(r) for r in replicas], capacity=2, notify=lambda m: None)
            run_parallel._generate(pool, lines, writer, tokenizer, True)
        writer.close()
        records.append({r["id"]: r for r in map(json.loads, path.read_text().splitlines())})
    want, got = records
    assert want["poison"]["error"].startswith("internal engine error: RuntimeError: simulated kernel failure")
    assert got == want


def test_a_data_parallel_summary_shows_the_first_error_as_one_engine(tmp_path, ray_cluster):
    """The summary on stderr ends with the first error record's id and error, with --data-parallel too."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = _write(tmp_path / "in.jsonl", _lines(3, tokens=4) + BAD[:2])
    out = tmp_path / "dp.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--max-model-len", "128",
                                   "--data-parallel", "2"])
    assert res.exit_code == 1, res.output
    first = json.loads(out.read_text().splitlines()[0])
    assert first["error"] and "3 ok, 2 failed" in res.stderr
    assert f"infer: first error (id {first['id']}): {first['error']} [every failed line has an error record in " \
        f"{out}]" in res.stderr


# ---------------------------------------------------------------------------------------------- serve


@pytest.fixture
def server(ray_cluster):
    """A server of each test's own (both kill replicas): under `--dist worksteal` a module's tests may run in
    another order, and one found the replicas the other killed."""
    from infer.engine.config import EngineConfig
    from infer.parallel.serve import build_server
    cfg = EngineConfig("tiny-llama", max_model_len=128, max_num_seqs=4)
    srv, _ = build_server(ray, cfg, 2, "tiny-llama", api_key=None, max_queue=64, shutdown_timeout=5,
                          max_restarts=0)  # (the tests below see dead replicas stay dead)
    yield srv
    for r in srv.aengine.replicas:  # (their CPUs are free before another test's replicas ask for them)
        kill_actor(ray, r.handle)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture
def url(server):
    from infer.serve.app import serve_in_thread
    with serve_in_thread(server) as base:
        yield base


def _complete(url):
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
                      timeout=60)


def _alive(url) -> list[bool]:
    return [r["alive"] for r in httpx.get(f"{url}/health").json()["engine"]["replicas"]]


def test_an_idle_replica_is_checked_while_another_is_busy(url, server, monkeypatch):
    """The driver pinged its replicas only once it had had nothing at all to do for PING_S: one request at a time
    always goes to replica 0, so replica 1 died unseen (/health and replica_up said alive) for as long as requests
    kept coming."""
    from infer.parallel import serve_engine
    monkeypatch.setattr(serve_engine, "PING_S", 1.0)
    assert _complete(url).status_code == 200  # the driver's wait now uses the short interval
    assert _alive(url) == [True, True]
    ray.kill(server.aengine.replicas[1].handle, no_restart=True)
    deadline = time.monotonic() + 30  # requests keep coming, never 1 s apart: the driver is never idle that long
    while _alive(url) != [True, False] and time.monotonic() < deadline:
        assert _complete(url).status_code == 200
        time.sleep(0.3)
    assert _alive(url) == [True, False]
    assert 'infer:replica_up{replica="1"} 0.0' in httpx.get(f"{url}/metrics").text


def test_a_request_whose_last_replica_died_under_it_is_a_503(url, server, monkeypatch):
    """Every replica dies while idle, before the driver's check notices: the next request is sent to a dead one
    and, with none left to re-run it on, was answered 500 engine_error; a request no replica is left for is a 503
    no_engine_replica with Retry-After, as /health says."""
    from infer.parallel import serve_engine
    monkeypatch.setattr(serve_engine, "PING_S", 1000.0)  # no idle check between the kill and the request
    assert _complete(url).status_code == 200
    for r in server.aengine.replicas:
        kill_actor(ray, r.handle)
    r = _complete(url)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_engine_replica" and "retry-after" in r.headers
    assert httpx.get(f"{url}/health").status_code == 503
