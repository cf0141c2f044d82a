"""Session 40 probes, data parallelism with Ray (infer/parallel, infer run/serve --data-parallel, dp_compare)."""

from __future__ import annotations

import os

import pytest

from infer.parallel import runtime


def test_a_local_runtime_counts_the_cpus_this_process_may_run_on(monkeypatch):
    """`infer run --data-parallel 2` in an 8-core Slurm job (or under taskset, or in a cpuset container) on a
    64-core machine: the local Ray runtime got os.cpu_count()'s 64 CPUs, and each CPU replica 32 torch threads on
    those 8 cores."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert runtime.local_cpus(2) == 8
    assert runtime.local_cpus(12) == 12  # more replicas than CPUs: one CPU each, as before


@pytest.mark.parametrize("argv", [["--replicas", "0"], ["--replicas", "2,"], ["--threads", "-1"]],
                         ids=["zero-replicas", "trailing-comma", "negative-threads"])
def test_dp_compare_refuses_a_bad_count_before_starting_ray(argv, capsys):
    """python -m infer.bench.dp_compare --replicas 0 was a ZeroDivisionError traceback (after starting Ray), `2,` a
    ValueError traceback and --threads -1 a ConfigError traceback about a replica of -1 CPUs."""
    from infer.bench.dp_compare import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and "Traceback" not in err


@pytest.mark.parametrize("option, says", [("--data-parallel-address", "--ray-address"),
                                          ("--data-parallel-backend", "Ray actors"),
                                          ("--data-parallel-size-local", "--data-parallel N"),
                                          ("--distributed-executor-backend", "--data-parallel N")])
def test_vllms_data_parallel_options_name_infers(option, says):
    """A vLLM user's `--data-parallel-address HEAD` (or the Ray backend options) got click's guess or nothing, not
    what infer takes instead."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["serve", "tiny-llama", option, "x"])
    assert res.exit_code == 2
    assert f"{option} is vLLM's option" in res.output and says in res.output


def test_ray_address_variable_is_the_cluster_to_join(monkeypatch):
    """`ray job submit -- infer run ... --data-parallel 4` (Ray sets RAY_ADDRESS for the job) started a runtime of
    its own on the head node instead of joining the cluster, as ray.init() and vLLM would; a RAY_ADDRESS where
    nothing answers is now named as such (port 1: refused at once)."""
    pytest.importorskip("ray")
    from infer.errors import ConfigError
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1:1 \(the RAY_ADDRESS variable"):
        with runtime.ray_runtime(None, 2):
            pass


class _BusyRay:
    """A cluster of one node with 2 CPUs and 2 GPUs, of which another job's actors hold one of each."""

    def nodes(self):
        return [{"Alive": True, "Resources": {"CPU": 2, "GPU": 2}}]

    def cluster_resources(self):
        return {"CPU": 2, "GPU": 2}

    def available_resources(self):
        return {"CPU": 1, "GPU": 1}


def test_replicas_that_other_jobs_leave_no_room_for_are_refused_not_left_waiting(monkeypatch):
    """`--data-parallel 2 --ray-address HEAD` on a cluster where another job holds one of its 2 CPUs (or GPUs): the
    room was counted from the cluster's totals, so the second replica waited for a CPU for ever and the run hung
    without a word."""
    from types import SimpleNamespace

    from infer.errors import ConfigError
    monkeypatch.setattr(runtime, "FREE_WAIT_S", 0.0)
    ray = _BusyRay()
    assert runtime.cpu_threads(ray, 2) == 1
    with pytest.raises(ConfigError, match=r"room for 1") as e:
        runtime.check_cpu_room(ray, 2, 1)
    assert "1 free" in e.value.message and e.value.hint == "use --data-parallel 1"
    runtime.check_cpu_room(ray, 1, 1)  # one fits
    with pytest.raises(ConfigError, match=r"only 1 of the Ray cluster's 2 are free"):
        runtime.replica_device(ray, SimpleNamespace(device="cuda"), 2)
    assert runtime.replica_device(ray, SimpleNamespace(device="auto"), 1) == "cuda"
