"""A stand-in for the few Ray calls infer's data-parallel drivers make (ray.wait / get / kill, and what
parallel.runtime.start_replicas calls: ray.remote, the cluster's resources and nodes), over replicas built in this
process, so a replica's death lands at an exact moment.

`handle.NAME.remote(*args)` is a call of the replica's NAME; it runs when the driver gets its result (an eager
FakeRay runs it at once, in the order the calls are made, as a Ray actor runs one caller's calls). A call on a
killed actor raises Died, the fake's ray.exceptions.RayError and ActorDiedError; an exception the replica raises
reaches the caller as it is. Hooks for a test's own failures: FakeRay.before (each call, before it runs) and
FakeRay.call (the call itself).

An actor Ray has not placed yet is a handle with `pending` true: its calls are never ready (ray.wait leaves them out,
waiting its timeout; a wait without one, or a get, that would wait for ever fails the test) until the test sets
`pending` false or kills it. A stand-in replica without `where` or `load` (Replica's first calls: the actor is
placed, then loads the model) is placed at once, and answers `load` with its `info`."""

from __future__ import annotations

import threading
import time

DIED = "The actor died unexpectedly before finishing this task."


class Died(Exception):
    """A call on a dead actor."""


class Ref:
    """One actor call: `method` of `handle`'s replica with `args`; run once (its result or Died kept)."""

    def __init__(self, handle, method: str, args: tuple):
        self.handle, self.method, self.args = handle, method, args
        self.done, self.result, self.error = False, None, None


class Method:
    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name

    def remote(self, *args) -> Ref:
        handle = self.handle
        handle.calls += 1
        ref = Ref(handle, self.name, args)
        if handle.ray is not None and handle.ray.eager and not handle.pending:
            handle.ray.run(ref)
        return ref


class Handle:
    """An actor handle over the in-process `replica`: `alive` until killed, `calls` made so far; `ray`: the FakeRay
    whose eagerness its calls follow (None: run when their result is read); `attrs`: a test's own fields."""

    def __init__(self, replica, ray: "FakeRay | None" = None, **attrs):
        self.replica, self.ray, self.alive, self.calls, self.pending = replica, ray, True, 0, False
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> Method:  # (called only for names the handle does not have)
        if name.startswith("__"):
            raise AttributeError(name)
        return Method(self, name)


class FakeRay:
    class exceptions:
        RayError = Died
        ActorDiedError = Died

    def __init__(self, eager: bool = False, cpus: int = 2):
        self.eager, self.cpus, self.lock = eager, cpus, threading.RLock()  # the driver's thread and the test's

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if not self.pending(r)][:num_returns]
        if len(ready) < num_returns:
            if timeout is None:
                raise AssertionError("ray.wait would wait for ever: an actor is never placed")
            time.sleep(min(timeout, 5.0))
        return ready, [r for r in refs if r not in ready]

    @staticmethod
    def pending(ref) -> bool:
        """A call of an actor not placed yet (not ready)."""
        return ref.handle.pending and ref.handle.alive

    def get(self, ref):
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        if self.pending(ref):
            raise AssertionError("ray.get would wait for ever: the actor is never placed")
        if not ref.done:
            self.run(ref)
        if ref.error is not None:
            raise ref.error
        return ref.result

    def run(self, ref: Ref) -> None:
        with self.lock:
            ref.done = True
            self.before(ref)
            if not ref.handle.alive:
                ref.error = Died(DIED)
                return
            ref.result = self.call(ref)

    def before(self, ref: Ref) -> None:
        """A test's hook: called with each call before it runs (it may kill the actor: handle.alive = False)."""

    def call(self, ref: Ref):
        replica = ref.handle.replica
        if ref.method == "where" and not hasattr(replica, "where"):
            return {}
        if ref.method == "load" and not hasattr(replica, "load"):
            return replica.info()
        return getattr(replica, ref.method)(*ref.args)

    def kill(self, handle, no_restart=True):
        handle.alive = False

    # ---- what start_replicas calls: actors built here, on a one-node cluster of `cpus` CPUs

    def cluster_resources(self) -> dict:
        return {"CPU": self.cpus}

    available_resources = cluster_resources

    def nodes(self) -> list[dict]:
        return [{"Alive": True, "Resources": {"CPU": self.cpus}}]

    def remote(self, cls):
        ray = self

        class Actor:
            def options(self, **_):
                return self

            def remote(self, *args):
                return Handle(cls(*args), ray)
        return Actor()
