"""Data parallelism, the forty-ninth session's probes.

A request that crashes the process it runs in (a "poison" request) stopped both replicas of `--data-parallel 2`:
the pool re-ran it on the other one, and the run ended with "every engine replica has stopped". A replica that
stops is now replaced by a fresh one (runtime.ReplicaHandles.restart, the same config), pool.MAX_RESTARTS times at
most, so the run completes with the poison request as an error record. Replicas are real engines in this process
behind the stand-in for Ray's calls (tests/fakeray.py); the stand-in kills a replica whenever the poison request is
on it."""

from __future__ import annotations

import pytest

from infer.engine.config import EngineConfig
from infer.engine.sampling_params import SamplingParams
from infer.parallel.pool import MAX_LOST, MAX_RESTARTS, ReplicaPool, Work
from infer.parallel.replica import ENGINE_FAILURE, Replica
from infer.parallel.runtime import ReplicaError

from fakeray import FakeRay, Handle
from test_probes_session43_poison import _serve

POISON = "poison"
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


class _Ray(FakeRay):
    """A replica handed the poison request dies (and stays dead); with `always`, every replica dies at its first
    step call."""

    def __init__(self, always: bool = False):
        super().__init__()
        self.always = always

    def before(self, ref):
        h = ref.handle
        if ref.method in ("step", "serve_step"):
            h.ran.update(w[0] for w in (ref.args[0] if ref.args else []))
            if POISON in h.ran or (self.always and h.ran):
                h.alive = False


def _config() -> EngineConfig:
    return EngineConfig("tiny-llama", max_model_len=128, max_num_seqs=3, memory_limit=2 ** 29)


@pytest.fixture(scope="module")
def engines():
    return [Replica(_config()) for _ in range(4)]


class _Restarts:
    """What ReplicaHandles.restart does, over replicas built beforehand: a fresh handle for replica `index`."""

    def __init__(self, spares: list):
        self.spares, self.asked = list(spares), []

    def __call__(self, index: int) -> Handle:
        self.asked.append(index)
        return Handle(self.spares.pop(0), ran=set())


def _work() -> list[Work]:
    work = [Work(f"r{i}", i + 1, [5 + i, 17, 99, 230 + i], PARAMS, None) for i in range(6)]
    work.insert(1, Work(POISON, 99, [7, 8, 9], PARAMS, None))
    return work


def test_run_replaces_a_replica_that_stopped_so_two_replicas_finish_the_run(engines):
    notes, done, failed = [], [], []
    restarts = _Restarts(engines[2:])
    pool = ReplicaPool(_Ray(), [Handle(r, ran=set()) for r in engines[:2]], capacity=3, notify=notes.append,
                       restart=restarts)
    pool.run(_work(), lambda w, out, i: done.append(w.id), lambda w, reason: failed.append((w.id, reason)))
    assert sorted(done) == [f"r{i}" for i in range(6)], "every other request completes, once"
    assert [f[0] for f in failed] == [POISON] and failed[0][1].startswith(ENGINE_FAILURE), failed
    assert "engine replicas that stopped" in failed[0][1], failed
    assert pool.restarted == len(restarts.asked) >= 1 and restarts.asked[0] in (0, 1)
    assert any("restart 1 of" in n for n in notes) and any("restarted" in n for n in notes), notes
    assert all(r.restarts <= MAX_RESTARTS for r in pool.replicas)


def test_restarts_are_bounded_per_replica():
    """Replicas that die at every step are replaced MAX_RESTARTS times each, then the run stops as before."""
    cfg = _config()
    made = []

    def restart(index: int) -> Handle:
        made.append(index)
        return Handle(_Stub(), ran=set())

    pool = ReplicaPool(_Ray(always=True), [Handle(_Stub(), ran=set()) for _ in range(2)], capacity=3,
                       notify=lambda m: None, restart=restart)
    with pytest.raises(ReplicaError):
        pool.run([Work(f"r{i}", i + 1, [5, 6], PARAMS, None) for i in range(4)], lambda *a: None, lambda *a: None)
    assert sorted(made) == [0] * MAX_RESTARTS + [1] * MAX_RESTARTS
    assert pool.restarted == 2 * MAX_RESTARTS and cfg is not None


class _Stub:
    """A replica that never gets to run anything (the stand-in kills it at its first step call)."""

    def info(self) -> dict:
        return {"error": None}


def test_a_fresh_replica_that_cannot_load_stays_stopped_after_its_restarts():
    notes = []

    class Broken(_Stub):
        def info(self) -> dict:
            return {"error": {"type": "ConfigError", "message": "the model does not fit", "hint": ""}}

    pool = ReplicaPool(_Ray(always=True), [Handle(_Stub(), ran=set())], capacity=3, notify=notes.append,
                       restart=lambda index: Handle(Broken(), ran=set()))
    with pytest.raises(ReplicaError):
        pool.run([Work("r0", 1, [5, 6], PARAMS, None)], lambda *a: None, lambda *a: None)
    assert pool.restarted == MAX_RESTARTS
    assert any("failed to start (the model does not fit); it stays stopped" in n for n in notes), notes


def test_start_replicas_handles_restart_a_replica_with_its_config(monkeypatch):
    """runtime.start_replicas' handles start a fresh replica as the first: its seed (seed + index) too."""
    import torch

    from infer.models.resolve import resolve_model
    from infer.parallel.runtime import start_replicas
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    cfg = EngineConfig("tiny-llama", device="cpu", max_model_len=64, max_num_seqs=2, memory_limit=2 ** 29)
    handles, _ = start_replicas(FakeRay(), cfg, resolve_model("tiny-llama"), 2)
    fresh = handles.restart(1)
    assert fresh is not handles[1] and fresh.alive
    assert fresh.replica.config.seed == handles[1].replica.engine.config.seed  # (it loads in its `load` call)
    assert fresh.info.remote() is not None



def test_serve_restarts_a_replica_that_stopped_in_the_background(engines):
    """`infer serve --data-parallel 2`: a poison request stopped both replicas for good (every later request was a
    503). Now each stopped replica is replaced by a fresh one, which serves once it has loaded."""
    import time

    from infer.parallel.serve_engine import RayAsyncEngine, ReplicaView

    first = engines[:2]
    restarts = _Restarts([Replica(_config()) for _ in range(2 * MAX_RESTARTS)])
    view = ReplicaView(first[0].engine.config, first[0].engine.model_path, first[0].engine.tokenizer,
                       first[0].info())
    aengine = RayAsyncEngine(_Ray(), [Handle(r, ran=set()) for r in first], [r.info() for r in first], view,
                             restart=restarts)
    aengine.start()
    try:
        outs = _serve(aengine, _work())
        assert outs[POISON].finish_reason == "error" and "engine replicas that stopped" in outs[POISON].error
        for i in range(6):  # one that had streamed on a replica when it stopped ends with that error (not re-run)
            o = outs[f"r{i}"]
            assert o.finish_reason == "length" or "stopped while this request ran" in o.error, (o.request_id, o.error)
        deadline = time.monotonic() + 60
        while not all(r.alive for r in aengine.replicas) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(r.alive for r in aengine.replicas), "both stopped replicas were replaced"
        stats = aengine.stats
        assert stats["num_replicas_alive"] == 2 and stats["replicas_restarted"] == len(restarts.asked) >= 2
        assert all(1 <= r["restarts"] <= MAX_RESTARTS for r in stats["replicas"])
        later = _serve(aengine, [Work("after", 1, [5, 6, 7], PARAMS, None)])  # served again
        assert later["after"].finish_reason == "length"
    finally:
        aengine.shutdown(timeout=5)


def test_serve_counters_of_a_replaced_replica_never_go_down():
    """A fresh replica's counters start at 0: those of the replica it replaced stay in the sums (a Prometheus
    counter that goes down reads as a reset)."""
    from infer.parallel.serve_engine import RayAsyncEngine, _Replica

    old = {"num_preemptions": 3, "num_steps": 100, "num_running": 2, "draft_eager_forwards": 7}
    r = _Replica(0, None, {}, stats=dict(old))
    engine = RayAsyncEngine.__new__(RayAsyncEngine)
    engine.ray, engine.replicas, engine._starting = FakeRay(), [r], {}
    engine._restart, engine.max_restarts = lambda index: Handle(_Stub()), MAX_RESTARTS
    before = RayAsyncEngine._aggregate(engine)
    engine._replace(r)
    r.stats = {"num_preemptions": 1, "num_steps": 5, "num_running": 1}  # the fresh replica's first figures
    r.alive = True
    after = RayAsyncEngine._aggregate(engine)
    assert (after["num_preemptions"], after["num_steps"]) == (4, 105) and after["num_running"] == 1
    assert after["engines"][0]["num_steps"] == 105 and before["num_steps"] == 100
    assert before["draft_eager_forwards"] == after["draft_eager_forwards"] == 7  # (the fresh one has run none)


# ------------------------------------------------------------------ more local replicas than the machine holds

class _Stop(Exception):
    pass


@pytest.fixture
def four_cpus_no_gpu(monkeypatch):
    """A machine of 4 usable CPUs and no GPU; starting a runtime, or serving, fails the test."""
    import torch

    from infer.parallel import runtime

    def never(*a, **kw):
        raise _Stop
    monkeypatch.setattr(runtime, "usable_cpus", lambda: 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("infer.cli.run_parallel.ray_runtime", never)  # (runtime's own is left: imported by name)
    monkeypatch.setattr("infer.cli.serve_parallel.serve_data_parallel", never)
    monkeypatch.setattr("infer.cli.serve._serve", never)


def test_run_refuses_more_local_replicas_than_cpus(tmp_path, four_cpus_no_gpu):
    """`infer run --data-parallel 1000` without --ray-address started a local runtime of 1000 CPUs and 1000
    replicas, each loading the model: one line now names the limit and what to do."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi", "max_new_tokens": 2}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "out.jsonl"), "-q",
                                   "--data-parallel", "1000"])
    assert not isinstance(res.exception, _Stop) and res.exit_code != 0, res.output
    assert "--data-parallel 1000 is more replicas than this machine holds: it has 4 usable CPU(s)" in res.output
    assert "use --data-parallel 4 or fewer" in res.output and "--ray-address" in res.output


def test_serve_refuses_more_local_replicas_than_cpus(four_cpus_no_gpu):
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--host", "127.0.0.1",
                                   "--data-parallel", "5"])
    assert not isinstance(res.exception, _Stop) and res.exit_code != 0, res.output
    assert "--data-parallel 5 is more replicas than this machine holds: it has 4 usable CPU(s)" in res.output


def test_local_replica_limits(monkeypatch):
    """CUDA replicas: one per GPU; a cluster (--ray-address or $RAY_ADDRESS) is not this machine; within the
    limit nothing is refused."""
    import torch

    from infer.errors import ConfigError
    from infer.parallel import runtime
    monkeypatch.setattr(runtime, "usable_cpus", lambda: 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="it has 2 GPU"):
        runtime.check_local_replicas(3, None, "auto")
    runtime.check_local_replicas(2, None, "cuda")
    runtime.check_local_replicas(4, None, "cpu")  # CPU replicas on a GPU machine: its CPUs
    with pytest.raises(ConfigError, match="it has 4 usable CPU"):
        runtime.check_local_replicas(5, None, "cpu")
    runtime.check_local_replicas(1000, "head:6379", "auto")
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    runtime.check_local_replicas(1000, None, "auto")


# ------------------------------------------------------------------ a driver killed with SIGKILL

_DRIVER = """
import os, sys, time
from infer.parallel.runtime import ray_runtime
with ray_runtime(None, 2) as ray:
    class A:
        def pid(self):
            return os.getpid()
    actor = ray.remote(A).options(num_cpus=1).remote()
    print("READY", ray.get(actor.pid.remote()), flush=True)
    time.sleep(600)
"""


def test_a_local_runtime_leaves_nothing_behind_a_driver_killed_with_sigkill(tmp_path):
    """`infer run --data-parallel 2` killed with SIGKILL left the local Ray runtime's agents (and anything else
    the raylet had started) running for ever, reparented to init: reaper.py stops them."""
    pytest.importorskip("ray")
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=env, cwd=tmp_path)
    try:
        line = driver.stdout.readline().decode()
        assert line.startswith("READY"), line
        time.sleep(1.5)  # (the reaper notes the driver's descendants twice a second)
        kids = [p for p in psutil.Process(driver.pid).children(recursive=True)]
        actor = psutil.Process(int(line.split()[1]))
        assert actor in kids and len(kids) > 2
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        _, left = psutil.wait_procs(kids, timeout=30)
        assert not left, [(p.pid, p.name()) for p in left]
    finally:
        if driver.poll() is None:
            driver.kill()
        for p in locals().get("kids", []):  # (what a failure left: not for the next tests)
            try:
                p.kill()
            except psutil.Error:
                pass


def test_the_reaper_leaves_everything_after_a_clean_exit(tmp_path):
    """The driver's "done" (ray_runtime's clean exit): nothing to stop; its stdin closed without it: what it noted."""
    import os
    import subprocess
    import sys

    from infer.parallel import reaper
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        noted = {}
        for word in (b"done", b""):
            r, w = os.pipe()
            os.write(w, word)
            os.close(w)
            with open(r, "rb") as stdin:
                noted[word] = [p.pid for p in reaper.watch(os.getpid(), stdin)]
        assert noted[b"done"] == [] and child.pid in noted[b""]
    finally:
        child.kill()
        child.wait()


def test_a_fresh_serving_replica_gets_the_adapters_the_server_has_now():
    """Adapters loaded (or unloaded) while serving were only on the replicas of that time: a fresh replica loads
    those and drops those, compiles its kernels, and only then takes requests."""
    from infer.parallel.serve_engine import RayAsyncEngine, _Adapters, _Replica

    class Fresh:
        def __init__(self):
            self.calls = []

        def info(self):
            self.calls.append(("info",))
            return {"error": None, "host": "h", "adapters": ["a", "gone"]}

        def add_lora(self, name, path, replace=False):
            self.calls.append(("add_lora", name, path))

        def remove_lora(self, name):
            self.calls.append(("remove_lora", name))
            return 0

        def warm_kernels(self):
            self.calls.append(("warm_kernels",))

        def serve_step(self, new, aborts, holds=()):
            self.calls.append(("serve_step",))
            return [], [], {}

    fresh = Fresh()
    r = _Replica(0, None, {}, alive=False)
    engine = RayAsyncEngine.__new__(RayAsyncEngine)
    engine.ray, engine.replicas, engine._starting, engine._calls = FakeRay(eager=True), [r], {}, {}
    engine._restart, engine.max_restarts = lambda index: Handle(fresh, engine.ray), MAX_RESTARTS
    from types import SimpleNamespace
    engine.engine = SimpleNamespace(lora_manager=_Adapters(["a", "b"], {"a": "/a", "b": "/b"}))
    engine._replace(r)
    while engine._starting:
        ref = next(iter(engine._starting))
        engine._started(ref, *engine._starting.pop(ref))
    assert fresh.calls == [("info",), ("add_lora", "b", "/b"), ("remove_lora", "gone"), ("warm_kernels",),
                           ("serve_step",)]
    assert r.alive and not r.starting and r.restarts == 1 and r.info["host"] == "h"


def test_health_says_replicas_are_being_restarted_when_none_is_up():
    """/health with every replica stopped said "restart the server" while fresh ones were loading."""
    import httpx

    from infer.engine.config import EngineConfig as Config
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    figures = {"num_replicas_alive": 0, "replicas_restarting": 1}

    class Down(AsyncEngine):  # RayAsyncEngine's figures with every replica stopped
        @property
        def stats(self):
            return {**self._snapshot, **figures}

        @stats.setter
        def stats(self, value):
            self._snapshot = value

    aengine = Down(LLMEngine(Config("tiny-llama", max_model_len=64)))
    with serve_in_thread(Server(aengine, "tiny-llama")) as base:
        r = httpx.get(f"{base}/health", timeout=30)
        assert r.status_code == 503 and r.json()["error"] == "every engine replica stopped; 1 being restarted"
        figures["replicas_restarting"] = 0
        assert "restart the server" in httpx.get(f"{base}/health", timeout=30).json()["error"]
