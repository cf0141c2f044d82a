"""The driver loop: keep every replica's slots full, hand back outputs as requests finish, re-run a dead
replica's unfinished requests on the others (and start a fresh replica in its place, `max_restarts` times at most:
--max-replica-restarts, MAX_RESTARTS by default).
Every request is handed back exactly once."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .replica import ENGINE_FAILURE
from .runtime import PLACEMENT_TIMEOUT_S, ReplicaError, _last_line, stop_replicas, unplaced

DEPTH = 2  # calls queued per replica: while the driver reads one result the replica already runs the next
MAX_LOST = 2  # a request in flight on this many replicas that stopped is not run again: it may be what stops them
MAX_RESTARTS = 2  # the default of --max-replica-restarts: how many times a stopped replica is replaced at most


@dataclass
class Work:
    id: str
    line_no: int
    prompt_token_ids: list[int]
    params: object
    lora: str | None
    lost: int = 0  # replicas that stopped while this request was in flight on them
    alone: bool = False  # it runs alone on a replica (ReplicaPool._lost: to tell whether it is what stops them)

    def wire(self) -> tuple:
        return self.id, self.prompt_token_ids, self.params, self.lora


@dataclass
class ReplicaState:
    index: int
    handle: object
    alive: bool = True
    inflight: dict = field(default_factory=dict)  # request id -> Work handed to this replica, not finished yet
    calls: int = 0  # step calls sent and not answered
    done: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.monotonic)
    restarts: int = 0  # fresh replicas started in place of this one
    starting: object = None  # while a fresh one starts: its `where` call (Ray places it), then its `load` call
    place_by: float | None = None  # while Ray places a fresh one: when it counts as failed (placement_timeout)
    where: dict | None = None  # its actor's process ({"host", "pid"}: Replica.where)
    gone: dict | None = None  # while a fresh one starts: the process of the one it replaces (its `load` waits for it)

    def rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.start, 1e-9)


class ReplicaPool:
    """`run(work, on_output, on_rejected)` sends requests to the replica with the most free slots (`capacity`
    in flight each: the engine's batch plus a few waiting, so a freed slot is refilled at once)."""

    def __init__(self, ray, handles: list, capacity: int, budget_s: float = 0.5,
                 notify: Callable[[str], None] = print, restart: Callable[[int], object] | None = None,
                 max_restarts: int = MAX_RESTARTS, placement_timeout: float = PLACEMENT_TIMEOUT_S):
        """`restart(index)`: a fresh actor for replica `index`, started as the first one was (runtime.start_replicas'
        ReplicaHandles.restart), `max_restarts` times per replica at most (0: never); None: a replica that stops is
        not replaced. A fresh replica Ray has not placed after `placement_timeout` seconds (no node has the resources
        it asks for free: Ray keeps it pending for ever) counts as failed to start."""
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, got {max_restarts}")
        self.ray, self.capacity, self.budget_s, self.notify = ray, capacity, budget_s, notify
        self.max_restarts, self.placement_timeout = max_restarts, placement_timeout
        self.resources = getattr(handles, "resources", "") or "the resources it asks for"
        wheres = list(getattr(handles, "wheres", None) or [])
        self.replicas = [ReplicaState(i, h, where=wheres[i] if i < len(wheres) else None)
                         for i, h in enumerate(handles)]
        self._calls: dict = {}  # object ref -> ReplicaState
        self._starting: dict = {}  # a fresh replica's `where`, then `load` call -> its ReplicaState (alive once loaded)
        self.restart = restart
        self.restarted = 0  # fresh replicas started in place of ones that stopped
        # requests that were in flight on MAX_LOST replicas that stopped along with others that were too: each runs
        # again alone on a replica, to tell which of them stops the replicas (only that one is failed)
        self._retry: deque = deque()

    def live(self) -> list[ReplicaState]:
        return [r for r in self.replicas if r.alive]

    def run(self, work: list[Work], on_output: Callable, on_rejected: Callable,
            on_tick: Callable[[], None] = lambda: None) -> None:
        """on_output(work, RequestOutput, replica index) and on_rejected(work, reason) once per request."""
        queue = deque(work)
        for r in self.replicas:
            r.start = time.monotonic()
        while queue or self._retry or any(r.inflight for r in self.live()):
            self._unplaced()
            self._dispatch(queue)
            ready, _ = self.ray.wait(list(self._calls) + list(self._starting), num_returns=1,
                                     timeout=self._until_placed())
            if not ready:  # a fresh replica's placement deadline passed
                continue
            if ready[0] in self._starting:
                self._started(self._starting.pop(ready[0]), ready[0])
                continue
            # ray.wait answers any ready call, not the oldest: the replica's earlier calls (it ran them first) are
            # read before this one, or a failed later call (the actor died after an earlier one answered) dropped the
            # outputs of the earlier one: finished requests ran again, or were written as errors (MAX_LOST)
            r = self._calls[ready[0]]
            for earlier in [c for c, owner in self._calls.items() if owner is r]:  # (in the order they were sent)
                self._answer(earlier, queue, on_output, on_rejected)
                if earlier == ready[0]:
                    break
            on_tick()

    def _answer(self, ref, queue: deque, on_output: Callable, on_rejected: Callable) -> None:
        """Read step call `ref` (waiting for it) and hand back what it finished or rejected."""
        if ref not in self._calls:  # (its replica was lost while an earlier call was read)
            return
        r = self._calls.pop(ref)
        r.calls -= 1
        if not r.alive:
            return
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            self._lost(r, queue, e, on_rejected)
            return
        for rid, reason in result.rejected:
            item = r.inflight.pop(rid, None)
            if item is not None:
                on_rejected(item, reason)
        for out in result.finished:
            item = r.inflight.pop(out.request_id, None)
            if item is not None:
                r.done += 1
                on_output(item, out, r.index)
        r.tokens += result.tokens

    def _dispatch(self, queue: deque) -> None:
        ready = [r for r in sorted(self.live(), key=lambda r: len(r.inflight)) if r.calls < DEPTH]
        # while requests wait to run alone, the least loaded replica that runs none gets no new work, so that it is
        # soon free to take one (the others go on with the queue)
        drain = next((r for r in ready if not self._runs_retry(r)), None) if self._retry else None
        for k, r in enumerate(ready):
            if self._runs_retry(r):
                new = []
            elif self._retry and not r.inflight:
                new = [self._retry.popleft()]
            elif r is drain:
                new = []
            else:
                share = -(-len(queue) // (len(ready) - k))  # a short queue is split evenly, least loaded first
                new = [queue.popleft() for _ in range(min(self.capacity - len(r.inflight), share))]
            if not new and not r.inflight:
                continue
            if r.calls and not new:
                continue  # a queued call already keeps this replica stepping
            for item in new:
                r.inflight[item.id] = item
            self._calls[r.handle.step.remote([w.wire() for w in new], self.budget_s)] = r
            r.calls += 1
        if not self._calls and not self._starting:
            raise ReplicaError("no engine replica is left to run the remaining requests",
                               "the records written so far are kept: run again with --resume")

    @staticmethod
    def _runs_retry(r: ReplicaState) -> bool:
        return any(item.alone for item in r.inflight.values())

    def _lost(self, r: ReplicaState, queue: deque, error: Exception, on_rejected: Callable) -> None:
        """A replica died (or its engine raised): its unfinished requests go back to the front of the queue, and a
        fresh replica is started in its place (max_restarts times at most). While other replicas live (or one is
        being started), a request that was in flight on MAX_LOST replicas that stopped is handed back as failed
        instead (on_rejected): one that crashes the process it runs in would otherwise take every replica down in
        turn. Where several were (each time together) and replicas are replaced, each runs again alone first
        (_retry): the one that stops a replica alone is the one failed. When none is left nothing is failed: the
        records missing run again with --resume."""
        r.alive = False
        stop_replicas(self.ray, [r.handle])
        for ref in [ref for ref, owner in self._calls.items() if owner is r]:
            self._calls.pop(ref)
        r.calls = 0
        items = list(r.inflight.values())
        r.inflight.clear()
        replaced = self._replace(r)
        live = len(self.live())
        left = live + len(self._starting)
        for item in items:
            item.lost += 1
        twice = [item for item in items if item.lost >= MAX_LOST] if left else []
        isolate = [] if len(items) == 1 or len(twice) == 1 or self.restart is None else twice
        suspects = [item for item in twice if item not in isolate]
        again = [item for item in items if item not in twice]
        for item in isolate:
            item.alone = True
        queue.extendleft(reversed(again))
        self._retry.extend(isolate)
        self.notify(f"warning: replica {r.index} stopped ({_last_line(error)}); its {len(again)} unfinished "
                    f"request(s) run again on the {live} other replica(s)"
                    + (" and the fresh one" if replaced else "")
                    + (f"; {len(suspects)} in flight on {MAX_LOST} replicas that stopped are written as errors"
                       if suspects else "")
                    + (f"; {len(isolate)} in flight on {MAX_LOST} replicas that stopped run again one at a time"
                       if isolate else "")
                    + (f"; a fresh replica {r.index} is starting (restart {r.restarts} of {self.max_restarts})"
                       if replaced else ""))
        for item in suspects:
            on_rejected(item, f"{ENGINE_FAILURE}: the request was in flight on {item.lost} engine replicas that "
                              f"stopped (the last: {_last_line(error)}); it is not run again, as it may be what "
                              "stops them")
        if not left:
            raise ReplicaError("every engine replica has stopped", "the records written so far are kept: check the "
                                                                   "warnings above, then run again with --resume")

    def _replace(self, r: ReplicaState) -> bool:
        """Start a fresh actor in place of stopped replica `r`, if it has restarts left: it serves once Ray has placed
        it and its `load` call answers (_started); meanwhile the other replicas go on."""
        if self.restart is None or r.restarts >= self.max_restarts:
            return False
        r.restarts += 1
        self.restarted += 1
        r.gone = r.where  # (the actor stopped: the fresh one loads once its process has ended)
        try:
            r.handle = self.restart(r.index)
            r.starting = r.handle.where.remote()
        except Exception as e:  # noqa: BLE001 - the runtime refused a new actor: the replica stays stopped
            self.notify(f"warning: a fresh replica {r.index} could not be started ({_last_line(e)})")
            return False
        r.place_by = time.monotonic() + self.placement_timeout
        self._starting[r.starting] = r
        return True

    def _until_placed(self) -> float | None:
        """How long ray.wait may wait: until the first placement deadline of a fresh replica (None: none is placed)."""
        deadlines = [r.place_by for r in self._starting.values() if r.place_by is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _unplaced(self) -> None:
        """A fresh replica Ray has not placed by its deadline (no node has the resources it asks for free) failed
        to start: it is stopped and, with restarts left, started once more; the others go on meanwhile."""
        now = time.monotonic()
        for ref, r in list(self._starting.items()):
            if r.place_by is None or now < r.place_by:
                continue
            self._starting.pop(ref)
            if self.ray.wait([ref], num_returns=1, timeout=0)[0]:  # placed, its answer not read yet: it loads
                self._started(r, ref)
                continue
            r.starting = r.place_by = None
            stop_replicas(self.ray, [r.handle])
            message, hint = unplaced(f"the fresh replica {r.index} was", self.resources, self.placement_timeout)
            again = self._replace(r)
            self.notify(f"warning: {message}" + (f"; starting another (restart {r.restarts} of {self.max_restarts})"
                                                 if again else f"; it stays stopped: {hint}"))

    def _started(self, r: ReplicaState, ref) -> None:
        """A fresh replica answered: its `where` call (Ray placed it: it loads the model now), or its `load` call:
        it takes work from now on, or (it could not load the model) it is stopped and, with restarts left, started
        once more."""
        r.starting, placing, r.place_by = None, r.place_by is not None, None  # (placing: `where` answered)
        try:
            result = self.ray.get(ref) or {}
            error = None if placing else result.get("error")
        except self.ray.exceptions.RayError as e:
            error = {"message": _last_line(e)}
        if placing and not error:
            r.where = result
            r.starting = r.handle.load.remote(r.gone)
            self._starting[r.starting] = r
            return
        if error:
            stop_replicas(self.ray, [r.handle])
            again = self._replace(r)
            self.notify(f"warning: the fresh replica {r.index} failed to start ({error['message']})"
                        + (f"; starting another (restart {r.restarts} of {self.max_restarts})" if again else
                           "; it stays stopped"))
            return
        r.alive, r.calls = True, 0
        self.notify(f"infer: replica {r.index} restarted; it takes requests again")

    def close(self) -> None:
        stop_replicas(self.ray, [r.handle for r in self.replicas])  # (a fresh one still loading too)
