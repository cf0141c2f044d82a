"""Ray for the data-parallel paths: import it (or say what to install), start or join a runtime, start replicas."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
import time
import uuid
from collections import Counter
from pathlib import Path

from .. import errors
from ..errors import ConfigError, InferError

RAY_HINT = "pip install 'infer[ray]'"
LOCAL_OBJECT_STORE = 256 * 2 ** 20  # replicas exchange token ids and small records, never tensors


class ReplicaError(InferError):
    """The engine replicas could not start, or every one of them died."""


def require_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--data-parallel and --ray-address need Ray, which is not installed", RAY_HINT) from None
    return ray


@contextlib.contextmanager
def ray_runtime(address: str | None, num_cpus: int):
    """Join the cluster at `address` (or at $RAY_ADDRESS, as ray.init reads it), or start a local runtime of
    `num_cpus` CPUs; leave it at the end. A runtime the calling program already started (ray.init before us) is
    used as it is and left running."""
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
    # Ray's own variable, as ray.init() and vLLM read it: `ray job submit` sets it for the job's command, which
    # should run on that cluster, not start a runtime of its own on the head node
    source = ""
    if not address and os.environ.get("RAY_ADDRESS", "").strip():
        address, source = os.environ["RAY_ADDRESS"].strip(), " (the RAY_ADDRESS variable; unset it for a local one)"
    if address:
        check_reachable(address, source)
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE, **quiet)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:
        where = f"the Ray cluster at {address}{source}" if address else "a local Ray runtime"
        raise ConfigError(f"cannot start or join {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                          "on the head node run `ray start --head`, then pass --ray-address HOST:6379 (or "
                          "ray://HOST:10001)" if address else "check `ray status`, or pass --ray-address") from None
    reaper = None if address else start_reaper()
    try:
        yield ray
    finally:
        ray.shutdown()
        stop_reaper(reaper)


def start_reaper():
    """The process that stops what a local runtime started if this driver dies without ray.shutdown() (reaper.py);
    None where it cannot start (the runtime works as before)."""
    import subprocess
    import sys
    try:
        return subprocess.Popen([sys.executable, str(Path(__file__).with_name("reaper.py")), str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        return None


def stop_reaper(reaper) -> None:
    """A clean exit: the runtime is shut down, the reaper leaves everything as it is."""
    if reaper is None:
        return
    with contextlib.suppress(OSError, ValueError):
        reaper.stdin.write(b"done")
        reaper.stdin.close()
    with contextlib.suppress(Exception):
        reaper.wait(timeout=5)


def check_reachable(address: str, source: str = "", timeout: float = 5.0) -> None:
    """Fail at once when nothing listens at HOST:PORT (or ray://HOST:PORT): ray.init retries a silent address
    for many minutes (20 tries of about 35 s) before it gives up. Other forms ("auto") are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    host = host.strip("[]")  # [IPv6]:port
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConfigError(f"cannot join the Ray cluster at {address}{source}: nothing answers there "
                          f"({e.strerror or type(e).__name__})",
                          "on the head node run `ray start --head --port 6379`, then pass --ray-address HOST:6379 "
                          "(or ray://HOST:10001 for Ray Client)") from None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (taskset, a Slurm job's cores, a container's cpuset), not
    every core of the machine as os.cpu_count() says."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def local_cpus(num_replicas: int) -> int:
    """The CPUs of a local runtime: the usable ones (each CPU replica gets an even share as its torch threads; the
    machine's whole count put, e.g., 64 threads in each of 2 replicas of an 8-core job)."""
    return max(usable_cpus(), num_replicas)


def local_replica_limit(device: str) -> tuple[int, str]:
    """How many replicas a local runtime can hold, and of what: one per GPU (CUDA replicas: --device cuda, or auto
    where a GPU is visible), else one per usable CPU."""
    import torch
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    if device.startswith("cuda") or (device == "auto" and gpus):
        return gpus, "GPU(s), one per replica"
    return usable_cpus(), "usable CPU(s), at least one per replica"


def check_local_replicas(n: int, address: str | None, device: str) -> None:
    """Refuse more replicas than this machine holds when they would run here (no --ray-address, no $RAY_ADDRESS):
    each loads the model, so `--data-parallel 1000` started 1000 engines on a 2-core machine (the local runtime is
    given one CPU per replica); on a cluster its own resources decide (replica_device, check_cpu_room)."""
    if address or os.environ.get("RAY_ADDRESS", "").strip():
        return
    limit, what = local_replica_limit(device)
    if n > limit:
        raise ConfigError(f"--data-parallel {n} is more replicas than this machine holds: it has {limit} {what}",
                          (f"use --data-parallel {limit} or fewer, " if limit > 1 else "run without --data-parallel, ")
                          + "or pass --ray-address HOST:6379 to spread the replicas over a Ray cluster")


def _alive_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def replica_device(ray, engine_config, n: int) -> str:
    """'cuda' (one GPU per replica) or 'cpu', from --device and the GPUs the cluster has."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if engine_config.device == "cpu" or (engine_config.device == "auto" and gpus == 0):
        return "cpu"
    if gpus < n:
        raise ConfigError(f"--data-parallel {n} needs {n} GPUs (one per replica) but the Ray cluster has {gpus}",
                          f"use --data-parallel {gpus}" if gpus else "use --device cpu for CPU replicas")
    free = _free(ray, "GPU", n)
    if free < n:  # the replicas past the free ones would wait for a GPU for ever: the run would hang
        raise ConfigError(f"--data-parallel {n} needs {n} GPUs (one per replica) but only {free} of the Ray "
                          f"cluster's {gpus} are free: other jobs or actors hold the rest",
                          f"use --data-parallel {free}" if free else
                          "wait for the cluster's other work to end (`ray status`)")
    return "cuda"


FREE_WAIT_S = 10.0  # how long replicas just stopped (a run before, in this process) may take to free their CPUs


def _free(ray, resource: str, need: int = 0) -> int:
    """How many of `resource` no actor or task of the cluster holds (other jobs' replicas hold theirs); with `need`,
    waits a little for that many, as the replicas of a run that just ended free theirs after they are killed (not
    when the whole cluster has fewer: no wait frees what it does not have)."""
    deadline = time.monotonic() + FREE_WAIT_S
    while True:
        free = int(ray.available_resources().get(resource, 0))
        if free >= need or time.monotonic() > deadline or int(ray.cluster_resources().get(resource, 0)) < need:
            return free
        time.sleep(0.2)


def cpu_threads(ray, n: int) -> int:
    """Threads per CPU replica: an even share of the cluster's free CPUs that still fits on one node."""
    nodes = _alive_nodes(ray)
    per_node = max((int(node["Resources"].get("CPU", 0)) for node in nodes), default=1)
    return max(1, min(per_node, _free(ray, "CPU", n) // n))


def check_cpu_room(ray, n: int, threads: int) -> None:
    """Each CPU replica holds `threads` CPUs of one node: when the cluster's nodes cannot hold `n` of them, or the
    CPUs other jobs hold leave too few free, the ones left over would wait for CPUs for ever (Ray keeps such actors
    pending), and the run would hang."""
    room = sum(int(node["Resources"].get("CPU", 0)) // threads for node in _alive_nodes(ray))
    total, free = int(ray.cluster_resources().get("CPU", 0)), _free(ray, "CPU", n * threads)
    held = free < total and free // threads < room  # (free CPUs are counted over the cluster, not per node)
    room = min(room, free // threads)
    if room < n:
        raise ConfigError(f"--data-parallel {n} needs {n} CPU replicas of {threads} CPU(s) each, but the Ray cluster "
                          f"({total} CPUs" + (f", {free} free: other jobs or actors hold the rest" if held else "")
                          + f") has room for {room}",
                          f"use --data-parallel {room}" if room else
                          "wait for the cluster's other work to end (`ray status`), or add CPUs to the cluster")


def replica_config(engine_config, model_path: Path, device: str, n: int, single_node: bool):
    """The engine config a replica builds from: absolute paths (a worker's directory is not the driver's), the
    device Ray gives it, and on one machine of CPU replicas, an equal share of the default memory budget."""
    # not dataclasses.replace: a driver without a GPU must not check --device cuda itself
    replica_engine_config = copy.copy(engine_config)
    replica_engine_config.model = str(Path(model_path).resolve())
    replica_engine_config.loras = {name: str(Path(p).resolve()) for name, p in engine_config.loras.items()}
    spec = engine_config.speculative_config  # each replica loads its own draft model: from its folder's full path
    if spec and spec.get("method") in ("draft_model", "eagle3", "eagle") and Path(spec["model"]).expanduser().exists():
        replica_engine_config.speculative_config = {**spec, "model": str(Path(spec["model"]).expanduser().resolve())}
    replica_engine_config.device = device
    if device == "cpu" and single_node and replica_engine_config.memory_limit is None:
        from ..memory.plan import available_cpu_memory
        replica_engine_config.memory_limit = int(available_cpu_memory() * 0.5 / n)
    return replica_engine_config


def replica_seeded(replica_engine_config, index: int):
    """Replica `index`'s config: the seed of requests without their own is seed + index, so that replicas do not
    draw the same random numbers (two samples of one prompt, n=2, run on two replicas at once were the same text);
    replica 0 draws as one engine does."""
    if not index or replica_engine_config.seed is None:
        return replica_engine_config
    seeded = copy.copy(replica_engine_config)
    seeded.seed = (replica_engine_config.seed + index) % 2 ** 63
    return seeded


PLACEMENT_TIMEOUT_S = 300.0  # --replica-placement-timeout's default: long enough for an autoscaler to add a node


def unplaced(what: str, resources: str, timeout: float) -> tuple[str, str]:
    """The message and hint of replicas Ray did not place within `timeout` seconds (no node had `resources` free:
    Ray keeps such an actor pending for ever)."""
    return (f"{what} not placed by Ray within {timeout:g} s: no node of the cluster had {resources} free (what a "
            "replica asks for)",
            "use fewer replicas (--data-parallel), pass --ray-address of a cluster with room for them, or wait "
            "longer with --replica-placement-timeout SECONDS (`ray status` shows what the cluster holds)")


class ReplicaHandles(list):
    """start_replicas' actor handles, and `restart(index)`: a fresh actor for replica `index` (after that one
    stopped), started as the first one was: the same config, seed, device and resources. Its `where` call answers
    once Ray has placed it; its `load` call loads the model and answers with its `info` (with the error, as
    start_replicas reads it, if it could not). `resources`: what each replica asks Ray for, in words; `wheres`: each
    replica's `where` (its host and process)."""

    def __init__(self, handles: list, start, resources: str = "", wheres: list | None = None):
        super().__init__(handles)
        self._start, self._restarts = start, 0
        self.resources, self.wheres = resources, list(wheres or [])

    def restart(self, index: int):
        self._restarts += 1
        return self._start(index, f"-restart-{self._restarts}")  # (a new name: the stopped one may hold its own)


def start_replicas(ray, engine_config, model_path: Path, n: int, threads: int | None = None,
                   placement_timeout: float = PLACEMENT_TIMEOUT_S) -> tuple[list, list[dict]]:
    """Start `n` replica actors, wait until each has loaded the model, and return (handles, infos); the handles
    are a ReplicaHandles, which can start a replica again. CPU replicas use `threads` torch threads each (default:
    an even share of the cores). A replica Ray has not placed after `placement_timeout` seconds (no node has the
    resources it asks for free) fails the start: Ray would keep it pending for ever."""
    from .replica import Replica
    device = replica_device(ray, engine_config, n)
    threads = (threads or cpu_threads(ray, n)) if device == "cpu" else None
    replica_engine_config = replica_config(engine_config, model_path, device, n,
                                           single_node=len(_alive_nodes(ray)) == 1)
    if device == "cpu":
        check_cpu_room(ray, n, threads)
    options = {"num_cpus": threads, "num_gpus": 0} if device == "cpu" else {"num_cpus": 1, "num_gpus": 1}
    resources = f"{threads} CPU(s)" if device == "cpu" else "1 GPU and 1 CPU"
    actor = ray.remote(Replica)
    tag = uuid.uuid4().hex[:8]

    def start(i: int, suffix: str = ""):  # (the model loads in its `load` call: `where` answers once it is placed)
        return actor.options(name=f"infer-{tag}-replica-{i}{suffix}", **options).remote(
            replica_seeded(replica_engine_config, i), threads, False)
    handles = ReplicaHandles([start(i) for i in range(n)], start, resources)
    try:
        wheres = [h.where.remote() for h in handles]
        _, pending = ray.wait(wheres, num_returns=len(wheres), timeout=placement_timeout)
        if pending:
            stop_replicas(ray, handles)
            left = [k for k, ref in enumerate(wheres) if ref in pending]
            raise ReplicaError(*unplaced(f"engine replica(s) {', '.join(map(str, left))} of {n} were", resources,
                                         placement_timeout))
        handles.wheres = ray.get(wheres)
        infos = ray.get([h.load.remote() for h in handles])
    except ray.exceptions.RayError as e:
        stop_replicas(ray, handles)
        raise ReplicaError(f"an engine replica failed while loading the model: {_last_line(e)}",
                           "run without --data-parallel to see the error, or run `infer --debug ...` for the "
                           "traceback") from None
    failed = next((k for k, i in enumerate(infos) if i["error"]), None)
    if failed is not None:  # named with its replica and host: a cluster's node may lack a folder the driver has
        stop_replicas(ray, handles)
        error, host = infos[failed]["error"], infos[failed]["host"]
        cls = getattr(errors, error["type"], ReplicaError)
        raise (cls if isinstance(cls, type) and issubclass(cls, InferError) else ReplicaError)(
            f"engine replica {failed} (on {host}): {error['message']}", error["hint"])
    return handles, infos


def placement(infos: list[dict]) -> str:
    """'2 on gpu-node-1 (cuda:0), 1 on gpu-node-2 (cuda:0)': where the replicas run, grouped by host."""
    groups = Counter((i["host"], i["device"]) for i in infos)
    return ", ".join(f"{n} on {host} ({device})" for (host, device), n in groups.items())


def stop_replicas(ray, handles: list) -> None:
    for h in handles:
        with contextlib.suppress(Exception):
            ray.kill(h, no_restart=True)


def _last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
