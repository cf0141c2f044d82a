"""The driver loop: keep every replica's slots full, hand back outputs as requests finish, re-run a dead
replica's unfinished requests on the others. Every request is handed back exactly once."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .replica import ENGINE_FAILURE
from .runtime import ReplicaError, _last_line, stop_replicas

DEPTH = 2  # calls queued per replica: while the driver reads one result the replica already runs the next
MAX_LOST = 2  # a request in flight on this many replicas that stopped is not run again: it may be what stops them


@dataclass
class Work:
    id: str
    line_no: int
    prompt_token_ids: list[int]
    params: object
    lora: str | None
    lost: int = 0  # replicas that stopped while this request was in flight on them

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

    def rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.start, 1e-9)


class ReplicaPool:
    """`run(work, on_output, on_rejected)` sends requests to the replica with the most free slots (`capacity`
    in flight each: the engine's batch plus a few waiting, so a freed slot is refilled at once)."""

    def __init__(self, ray, handles: list, capacity: int, budget_s: float = 0.5,
                 notify: Callable[[str], None] = print):
        self.ray, self.capacity, self.budget_s, self.notify = ray, capacity, budget_s, notify
        self.replicas = [ReplicaState(i, h) for i, h in enumerate(handles)]
        self._calls: dict = {}  # object ref -> ReplicaState

    def live(self) -> list[ReplicaState]:
        return [r for r in self.replicas if r.alive]

    def run(self, work: list[Work], on_output: Callable, on_rejected: Callable,
            on_tick: Callable[[], None] = lambda: None) -> None:
        """on_output(work, RequestOutput, replica index) and on_rejected(work, reason) once per request."""
        queue = deque(work)
        for r in self.replicas:
            r.start = time.monotonic()
        while queue or any(r.inflight for r in self.live()):
            self._dispatch(queue)
            ready, _ = self.ray.wait(list(self._calls), num_returns=1)
            r = self._calls.pop(ready[0])
            r.calls -= 1
            if not r.alive:
                continue
            try:
                result = self.ray.get(ready[0])
            except self.ray.exceptions.RayError as e:
                self._lost(r, queue, e, on_rejected)
                continue
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
            on_tick()

    def _dispatch(self, queue: deque) -> None:
        ready = [r for r in sorted(self.live(), key=lambda r: len(r.inflight)) if r.calls < DEPTH]
        for k, r in enumerate(ready):
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
        if not self._calls:
            raise ReplicaError("no engine replica is left to run the remaining requests",
                               "the records written so far are kept: run again with --resume")

    def _lost(self, r: ReplicaState, queue: deque, error: Exception, on_rejected: Callable) -> None:
        """A replica died (or its engine raised): its unfinished requests go back to the front of the queue. While
        other replicas live, a request that was in flight on MAX_LOST replicas that stopped is handed back as
        failed instead (on_rejected): one that crashes the process it runs in would otherwise take every replica
        down in turn. When none is left nothing is failed: the records missing run again with --resume."""
        r.alive = False
        stop_replicas(self.ray, [r.handle])
        for ref in [ref for ref, owner in self._calls.items() if owner is r]:
            self._calls.pop(ref)
        items = list(r.inflight.values())
        r.inflight.clear()
        left = len(self.live())
        for item in items:
            item.lost += 1
        suspects = [item for item in items if item.lost >= MAX_LOST] if left else []
        again = [item for item in items if not (left and item.lost >= MAX_LOST)]
        queue.extendleft(reversed(again))
        self.notify(f"warning: replica {r.index} stopped ({_last_line(error)}); its {len(again)} unfinished "
                    f"request(s) run again on the {left} other replica(s)"
                    + (f"; {len(suspects)} in flight on {MAX_LOST} replicas that stopped are written as errors"
                       if suspects else ""))
        for item in suspects:
            on_rejected(item, f"{ENGINE_FAILURE}: the request was in flight on {MAX_LOST} engine replicas that "
                              f"stopped (the last: {_last_line(error)}); it is not run again, as it may be what "
                              "stops them")
        if not left:
            raise ReplicaError("every engine replica has stopped", "the records written so far are kept: check the "
                                                                   "warnings above, then run again with --resume")

    def close(self) -> None:
        stop_replicas(self.ray, [r.handle for r in self.replicas])
