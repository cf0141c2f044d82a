"""Session 76: what a run waits for that can never come. `--data-parallel 3` on a cluster of 2 CPUs waited twice
runtime.FREE_WAIT_S (20 s) for CPUs the cluster does not have before it said so; the wait is for replicas a run
before just stopped, whose CPUs come back, and only those."""

from __future__ import annotations

import pytest

from infer.errors import ConfigError
from infer.parallel import runtime


class _Cluster:
    """One node of `total` CPUs, `held` of them held by replicas that free them after `frees_after` reads."""

    def __init__(self, total: int, held: int = 0, frees_after: int = 0):
        self.total, self.held, self.frees_after, self.reads = total, held, frees_after, 0

    def nodes(self):
        return [{"Alive": True, "Resources": {"CPU": self.total}}]

    def cluster_resources(self):
        return {"CPU": self.total}

    def available_resources(self):
        self.reads += 1
        if self.reads > self.frees_after:
            self.held = 0
        return {"CPU": self.total - self.held}


def test_more_replicas_than_the_cluster_has_cpus_is_refused_without_waiting(monkeypatch):
    monkeypatch.setattr(runtime.time, "sleep", lambda s: pytest.fail("waited for CPUs the cluster does not have"))
    ray = _Cluster(2)
    assert runtime.cpu_threads(ray, 3) == 1
    with pytest.raises(ConfigError, match=r"needs 3 CPU replicas of 1 CPU\(s\) each, but the Ray cluster \(2 CPUs\) "
                                          r"has room for 2") as e:
        runtime.check_cpu_room(ray, 3, 1)
    assert e.value.hint == "use --data-parallel 2" and ray.reads == 2


def test_cpus_that_a_stopped_run_still_holds_are_waited_for(monkeypatch):
    slept = []
    monkeypatch.setattr(runtime.time, "sleep", slept.append)
    ray = _Cluster(4, held=4, frees_after=3)  # the replicas of a run before, being killed
    runtime.check_cpu_room(ray, 2, 2)  # (all 4 of the cluster's CPUs)
    assert ray.reads == 4 and len(slept) == 3
    ray = _Cluster(4, held=4, frees_after=2)
    assert runtime.cpu_threads(ray, 2) == 2 and ray.reads == 3 and len(slept) == 5
    ray = _Cluster(4, held=2, frees_after=10 ** 9)  # another job's, for good: refused after the wait
    monkeypatch.setattr(runtime, "FREE_WAIT_S", 0.0)
    with pytest.raises(ConfigError, match="2 free: other jobs or actors hold the rest"):
        runtime.check_cpu_room(ray, 2, 2)


def test_a_step_that_waits_out_its_gate_fails_the_test():
    """Two pause tests passed after 30 s each: the pause (a control) waited for the step their StepGate held, and
    the gate let it go after its timeout. A gate waited out fails the test now; one opened in time does not."""
    from helpers import StepGate

    class Engine:
        steps = 0

        def step(self):
            Engine.steps += 1

    engine = Engine()
    with StepGate(engine, closed=True, timeout=0.05) as gate:
        gate.open.set()
        engine.step()
    with pytest.raises(AssertionError, match="waited 0.05 s for the gate"):
        with StepGate(engine, closed=True, timeout=0.05):
            engine.step()
    assert Engine.steps == 2 and "step" not in vars(engine)
