"""The server's engine over N replicas, with serve.AsyncEngine's interface (add, abort, stats, shutdown), so the
HTTP app is the same one. A router over Ray actors rather than Ray Serve: the app, its streaming, auth and metrics
stay as they are, and one driver thread decides where each request runs.

The driver thread sends a new request to the replica with the fewest in flight and asks every busy replica for one
engine step at a time (two calls queued, so a replica never waits for the driver); every output goes to its
request's asyncio queue. A replica that dies: requests that had no output yet run again on the others (unless one was on
pool.MAX_LOST replicas that stopped: it may be what stops them), those already streaming end with an error; a fresh
replica is started in its place in the background (max_restarts times at most: --max-replica-restarts), and serves
once Ray has placed it (within placement_timeout: --replica-placement-timeout), it has loaded the model (after the
process of the one it replaces has ended), compiled its kernels and loaded the adapters the server has now.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..engine.block_manager import BlockManager
from ..engine.llm_engine import LLMEngine, LoRAHold
from ..engine.sampling_params import SamplingParams
from ..engine.structured import GrammarBackend
from ..errors import LoRAError, LoRANameError
from ..serve.async_engine import NO_ENGINE, AsyncEngine, NoEngineError
from .pool import MAX_LOST, MAX_RESTARTS
from .runtime import PLACEMENT_TIMEOUT_S, _last_line, stop_replicas, unplaced

log = logging.getLogger("infer.serve")
DEPTH = 2  # step calls queued per replica
POLL_S = 0.02  # how long the driver waits for a replica before it looks for new requests again
PING_S = 5.0  # an idle driver checks its replicas this often: one that died between requests is noticed
SUMMED = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_used", "num_preemptions", "lora_swaps",
          "num_steps", "cuda_graph_replays", "piecewise_graph_steps", "prefix_cache_queries", "prefix_cache_hits")
# what only grows (the /metrics counters): a dead replica's last figures stay in the sums, so they never go back
CUMULATIVE = ("num_preemptions", "lora_swaps", "num_steps", "cuda_graph_replays", "piecewise_graph_steps",
              "prefix_cache_queries", "prefix_cache_hits", "kv_blocks_freed_window")
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
# a draft model's forwards, and the decodes its context left without drafts
DRAFT_COUNTERS = ("draft_cuda_graph_replays", "draft_eager_forwards", "draft_context_skipped_steps")
_STOPPED = object()  # no call: the replica had stopped (_on_replicas_after_sent)
# what a dead replica shows as 0 in its own /metrics series (it runs and holds nothing); its counters stay
GAUGES = ("num_running", "num_waiting", "kv_usage", "kv_blocks_used", "kv_blocks_total", "num_in_flight")


class _Adapters:
    """The adapter names requests may use on every replica (the driver checks requests against it)."""

    def __init__(self, names: list[str], paths: dict[str, str] | None = None):
        self._names = list(names)
        self._paths = dict(paths or {})  # name -> the folder it was loaded from (/v1/models' root)

    def has(self, name: str) -> bool:
        return name in self._names

    def names(self) -> list[str]:
        return list(self._names)

    def path_of(self, name: str) -> str | None:
        return self._paths.get(name)

    def add(self, name: str, path: str | None = None) -> None:
        if name not in self._names:
            self._names.append(name)
        if path is not None:
            self._paths[name] = path

    def discard(self, name: str) -> None:
        if name in self._names:
            self._names.remove(name)
        self._paths.pop(name, None)


@dataclass(eq=False)
class ReplicaHold(LoRAHold):
    """RayAsyncEngine.hold_lora's hold (a served beam search's adapter): the `lora` its requests travel with; each
    live replica holds the adapter under `token` (Replica.serve_step's `holds`) and runs them with that hold, or
    with the name once it is released there."""
    token: str = ""


class _Blocks:
    """A replica's block manager as validate reads it: its pool (a sliding window's placeholder not in it) and
    the most blocks a sequence holds (window_cap)."""

    def __init__(self, num_blocks: int, block_size: int, window: int = 0, step_tokens: int = 0,
                 groups: list[int] | None = None):
        """`groups`: a model of mixed layers' KV groups, each group's window (engine.hybrid_blocks)."""
        self.num_blocks, self.block_size = num_blocks - (1 if window else 0), block_size
        self.window, self.step_tokens = window, step_tokens
        self.groups = groups

    blocks_needed = BlockManager.blocks_needed

    def window_cap(self, num_tokens: int) -> int:
        held = BlockManager.window_cap(self, num_tokens)
        if not self.groups:
            return held
        return sum(held if w else self.blocks_needed(num_tokens) for w in self.groups)


class ReplicaView:
    """What the server reads from its engine (tokenizer, config, model path, limits, adapter names), and
    `validate`: LLMEngine's own checks, run in the driver against the limits a replica reported."""

    def __init__(self, config, model_path, tokenizer, info: dict):
        self.config, self.model_path, self.tokenizer = config, model_path, tokenizer
        self.max_model_len = info["max_model_len"]
        self.model_limit = info.get("model_limit", self.max_model_len)  # what validate's hints name
        self.model_limit_reason = info.get("model_limit_reason", "")
        self.eos_token_ids = set(info.get("eos_token_ids", ()))  # what min_tokens bans (validate)
        self.model_config = type("ModelLimits", (), {"vocab_size": info["vocab_size"]})()
        self.block_manager = _Blocks(info["num_blocks"], config.block_size, info.get("kv_window", 0),
                                     info.get("kv_step_tokens", 0), info.get("kv_groups"))
        self.lora_manager = (_Adapters(info["adapters"], info.get("adapter_paths"))
                             if info["adapters"] or info.get("lora_enabled") else None)
        # structured outputs compiled in the driver too (checked before a request travels; the stop ids matter only
        # to a replica's matchers)
        self.grammars = GrammarBackend(tokenizer, info["vocab_size"], [])
        self._lora_holds: list[LoRAHold] = []  # RayAsyncEngine.hold_lora's (validate takes a request holding one)
        self.pooler = info.get("pooler")  # --runner pooling: how the replicas pool (validate's PoolingParams checks)

    # LLMEngine's checks and what they call (a method validate reaches that is missing here was a 500)
    validate = LLMEngine.validate
    _check_logprobs = LLMEngine._check_logprobs
    lora_slots = LLMEngine.lora_slots
    bad_word_ids = LLMEngine.bad_word_ids
    _min_tokens_ban = LLMEngine._min_tokens_ban
    _longer_hint = LLMEngine._longer_hint
    _pooling_params = LLMEngine._pooling_params

    def stats(self) -> dict:
        return {k: 0 for k in SUMMED} | {"kv_usage": 0.0, "prefix_cache_hit_rate": 0.0}

    def _check_open(self) -> None:
        """What LLMEngine's methods above call first: a view is open while its driver runs (the replicas' engines
        say themselves when they were closed)."""


@dataclass
class _Replica:
    index: int
    handle: object
    info: dict
    alive: bool = True
    calls: int = 0
    new: list = field(default_factory=list)  # assigned, not sent yet
    inflight: dict = field(default_factory=dict)  # request id -> _Pending, sent or assigned, not finished
    started: set = field(default_factory=set)  # ids that have had an output delivered
    aborts: list = field(default_factory=list)
    holds: list = field(default_factory=list)  # adapter holds and releases not sent yet (Replica.serve_step's)
    stats: dict = field(default_factory=dict)
    unseen: int = 0  # requests assigned to it that its latest stats do not count yet (not sent, or sent and unanswered)
    restarts: int = 0  # fresh replicas started in place of this one
    starting: bool = False  # a fresh one is starting in its place (Ray places it, it loads the model, warms up)
    place_by: float | None = None  # while Ray places the fresh one: when it counts as failed (placement_timeout)
    where: dict | None = None  # its actor's process ({"host", "pid"}: Replica.where)
    gone: dict | None = None  # while a fresh one starts: the process of the one it replaces (its `load` waits for it)
    error: str | None = None  # why it stopped, or why the fresh one in its place failed to start (/health)
    base: dict = field(default_factory=dict)  # the counters of the replicas it replaced (added to its own: never down)
    # (taken while the counters move from `stats` to `base`: /metrics, read in the server's thread, never sees a
    # counter in both or in neither)
    moving: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def figures(self) -> dict:
        """Its latest stats, with the counters of the replicas it replaced added."""
        with self.moving:
            base, stats = self.base, dict(self.stats)
        for k, v in base.items():
            if isinstance(v, list):  # spec_decode_num_accepted_tokens_per_pos
                mine = stats.get(k) or []
                stats[k] = [a + b for a, b in zip(v + [0] * (len(mine) - len(v)), mine + [0] * (len(v) - len(mine)))]
            else:
                stats[k] = stats.get(k, 0) + v
        return stats


class RayAsyncEngine(AsyncEngine):
    _restart = None  # (an engine made without __init__, as tests do: replicas are not restarted)
    _starting = MappingProxyType({})
    _retry = ()
    _isolated = frozenset()
    placement_timeout = PLACEMENT_TIMEOUT_S
    _resources = "the resources it asks for"

    def __init__(self, ray, handles: list, infos: list[dict], view: ReplicaView, max_queue: int | None = None,
                 restart=None, max_restarts: int = MAX_RESTARTS, placement_timeout: float = PLACEMENT_TIMEOUT_S):
        """`restart(index)`: a fresh actor for replica `index` (runtime.ReplicaHandles.restart), started in the
        background when one stops, `max_restarts` times per replica at most; None: replicas are not restarted. One
        Ray has not placed after `placement_timeout` seconds (no node has the resources it asks for free) counts as
        failed to start."""
        self.ray = ray
        self._restart, self.max_restarts, self.placement_timeout = restart, max_restarts, placement_timeout
        self._resources = getattr(handles, "resources", "") or self._resources
        # a fresh replica's pending call (its `where`, `load`, then its warm-up) -> _Replica, stage
        self._starting: dict = {}
        self._retry: deque = deque()  # requests to run again alone on a replica (_lost, _route; driver thread)
        self._isolated: set = set()  # the ids of those: each runs alone where it is sent
        wheres = list(getattr(handles, "wheres", None) or [None] * len(handles))
        self.replicas = [_Replica(i, h, info, where=where)
                         for i, h, info, where in zip(range(len(handles)), handles, infos, wheres)]
        self._calls: dict = {}  # object ref -> _Replica
        self._carried: dict = {}  # object ref -> the new requests its call carries
        self._owner: dict = {}  # request id -> _Replica (driver thread only)
        self._lora_changes: asyncio.Lock | None = None
        super().__init__(view, max_queue)
        self._thread.name = "infer-replicas"
        for r, (_, _, stats) in zip(self.replicas, ray.get([h.serve_step.remote([], []) for h in handles])):
            r.stats = stats

    @property
    def stats(self) -> dict:
        """What /health and /metrics read: the replicas' latest figures, with the requests accepted that no replica's
        figures count yet (not routed, not sent, or sent and not answered) as waiting, on the replica they go to."""
        return self._with_unseen(self._aggregate())

    @stats.setter
    def stats(self, value: dict) -> None:  # (AsyncEngine's snapshot: here every read is aggregated anew)
        pass

    @property
    def num_engines(self) -> int:
        return len(self.replicas)

    def engine_of(self, request_id: str) -> int:
        r = self._owner.get(request_id)  # (a dict read from the event loop: atomic)
        return r.index if r is not None else 0

    def hold_lora(self, name: str | None):
        """AsyncEngine.hold_lora over the replicas: every live replica holds the adapter (sent before any later
        unload or in-place reload, which the driver thread sends after it), so a search's steps keep its weights on
        whichever replica they run, also when a replica dies and they run again on another (a dead replica's holds
        go with it). RequestError for a name not served."""
        if name is None:
            return None
        with self._admission:  # ordered with the requests' checks
            self.engine.validate([0], SamplingParams(max_tokens=1), name)
            hold = ReplicaHold(name, name, token=uuid.uuid4().hex)
            self.engine._lora_holds.append(hold)
        self._control(lambda engine: engine._hold_on_replicas(("hold", hold.token, name)))
        return hold

    def release_lora(self, hold) -> None:
        """End hold_lora's hold: on every live replica, with its next step call."""
        if not isinstance(hold, ReplicaHold):
            return
        with self._admission:
            self.engine._lora_holds = [h for h in self.engine._lora_holds if h is not hold]
        self._control(lambda engine: engine._hold_on_replicas(("release", hold.token)))

    def _control(self, fn) -> None:
        with self._cond:
            self._controls.append((fn, None, None))
            self._cond.notify()

    def _hold_on_replicas(self, op: tuple) -> None:
        """Driver thread: `op` goes to every live replica with its next step call."""
        for r in self.replicas:
            if r.alive:
                r.holds.append(op)

    # ------------------------------------------------------------------ the driver thread
    def add(self, request_id: str, prompt_token_ids: list[int], params, lora, queue) -> None:
        if not any(r.alive or r.starting for r in self.replicas):
            raise NoEngineError("no engine replica is left", "restart the server")
        super().add(request_id, prompt_token_ids, params, lora, queue)

    def _run(self) -> None:
        pinged = time.monotonic()
        while True:
            with self._cond:
                while not (self._stopping or self._adds or self._aborts or self._controls or self._calls
                           or self._starting or self._retry or self._busy()):
                    left = pinged + PING_S - time.monotonic()
                    if left <= 0 or not self._cond.wait(timeout=left):
                        break
                if self._stopping:
                    break
                adds, self._adds = list(self._adds), deque()
                aborts, self._aborts = list(self._aborts), deque()
                controls, self._controls = list(self._controls), deque()
            try:
                # every PING_S, also while other replicas are busy: a steady trickle of requests all goes to the
                # least loaded replica, and the idle one is checked only here
                if time.monotonic() - pinged >= PING_S:
                    pinged = time.monotonic()
                    self._ping()
                if controls:  # as AsyncEngine._iteration: the requests accepted before the control ran (all the
                    with self._admission:  # choices of one, `admitting`) go to their replicas before it
                        with self._cond:
                            late, self._adds = list(self._adds), deque()
                    adds += late
                self._route(adds, aborts)
                self._send()
                self._run_controls(controls, self)
                self._collect()
            except Exception as e:  # never let the loop die
                self.num_step_errors += 1
                log.exception("replica driver error: %s", e)
        self._fail_controls()

    def capacity(self) -> int | None:
        """The most requests one body may hold: --max-queue and the running slots of the live replicas."""
        if self.max_queue is None:
            return None
        return self.max_queue + sum(r.alive for r in self.replicas) * self.engine.config.max_num_seqs

    def _would_wait(self) -> int:
        """Under _cond: the requests accepted that no live replica can start at once (for --max-queue): all those
        not finished, less the running slots of the live replicas."""
        live = [r for r in self.replicas if r.alive]
        outstanding = len(self._adds) + len(self._retry) + sum(len(r.inflight) for r in live)
        return outstanding - len(live) * self.engine.config.max_num_seqs

    def _ping(self) -> None:
        """An empty step call to every live replica with none queued: its answer refreshes the replica's figures,
        and a replica that died while idle fails the call (`_collect` marks it dead) instead of looking alive."""
        for r in self.replicas:
            if r.alive and r.calls == 0:
                self._calls[r.handle.serve_step.remote([], [])] = r
                r.calls += 1

    def _busy(self) -> bool:
        return any(r.alive and (r.inflight or r.new or r.aborts or r.holds) for r in self.replicas)

    def _route(self, adds: list, aborts: list) -> None:
        for rid in aborts:
            r = self._owner.get(rid)
            if r is not None and r.alive:
                r.aborts.append(rid)
        # an add aborted while the driver held it (taken from _adds: the abort found it in neither) is dropped here,
        # not run, nor put back to wait for a fresh replica, with no one to read it
        adds = [p for p in adds if p.request_id in self._sinks]
        live = [r for r in self.replicas if r.alive]
        # a request on MAX_LOST replicas that stopped along with others runs again alone on one (_retry, _lost)
        retry = [p for p in self._retry if p.request_id in self._sinks]  # (not those aborted meanwhile)
        if self._isolated:
            self._isolated.difference_update(p.request_id for p in self._retry if p.request_id not in self._sinks)
        self._retry.clear()
        if not live and any(r.starting for r in self.replicas):
            self._retry.extend(retry)
            with self._cond:  # they wait for the fresh replica (the driver looks again after POLL_S)
                self._adds.extendleft(reversed(adds))
            return
        if not live:
            if self._isolated:
                self._isolated.difference_update(p.request_id for p in retry)
            for p in retry + adds:
                self._fail(p.request_id, "error", NO_ENGINE)
            return
        for r in sorted(live, key=lambda r: len(r.inflight)):
            if retry and not r.inflight:
                self._assign(r, retry.pop(0))
        self._retry.extend(retry)
        # while some wait, the least loaded replica that runs none gets no new requests: it is soon free for one
        drain = min((r for r in live if not self._runs_retry(r)), key=lambda r: len(r.inflight),
                    default=None) if retry else None
        open_ = [r for r in live if not self._runs_retry(r) and r is not drain]
        if adds and not open_:
            with self._cond:  # they wait for a replica that takes new requests
                self._adds.extendleft(reversed(adds))
            return
        for p in adds:
            self._assign(min(open_, key=lambda r: len(r.inflight)), p)

    def _assign(self, r: _Replica, p) -> None:
        r.new.append(p)
        r.inflight[p.request_id] = p
        r.unseen += 1
        self._owner[p.request_id] = r

    def _runs_retry(self, r: _Replica) -> bool:
        return any(rid in self._isolated for rid in r.inflight)

    def _send(self, flush: bool = False) -> None:
        """A step call to every replica with work and fewer than DEPTH calls queued; `flush`: also to those with
        DEPTH queued that have requests not sent yet."""
        for r in self.replicas:
            full = r.calls >= DEPTH and not (flush and (r.new or r.holds))
            if not r.alive or full or not (r.new or r.aborts or r.inflight or r.holds):
                continue
            wires = [(p.request_id, p.prompt_token_ids, p.params, p.lora) for p in r.new]
            ref = r.handle.serve_step.remote(wires, r.aborts, *([r.holds] if r.holds else []))
            self._calls[ref], self._carried[ref] = r, len(wires)
            r.new, r.aborts, r.holds = [], [], []
            r.calls += 1

    def _collect(self) -> None:
        if not self._calls and not self._starting:
            return
        ready, _ = self.ray.wait(list(self._calls) + list(self._starting), num_returns=1, timeout=POLL_S)
        for ref in ready:
            if ref in self._starting:
                self._started(ref, *self._starting.pop(ref))
                continue
            # ray.wait answers any of the calls that are ready, not the oldest: a replica's earlier calls (it ran
            # them first, so they are answered) are read before this one, or a stream's tokens came out of order
            r = self._calls.get(ref)
            for earlier in [c for c, owner in self._calls.items() if owner is r]:  # (in the order they were sent)
                self._answer(earlier)
                if earlier == ref:
                    break
        self._unplaced()
        stats = self._aggregate()
        with self._cond:
            self._num_waiting = stats["num_waiting"]

    def _answer(self, ref) -> None:
        """Driver thread: read the result of step call `ref` (waiting for it) and deliver its outputs."""
        if ref not in self._calls:  # (the replica was lost while an earlier call was read)
            return
        r = self._calls.pop(ref)
        carried = self._carried.pop(ref, 0)
        r.calls -= 1
        if not r.alive:
            return
        try:
            outputs, rejected, r.stats = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            self._lost(r, e)
            return
        r.unseen -= carried  # its figures count them now (set first: a request is never out of both)
        tokens = r.stats.get("step_tokens", 0)
        if tokens and self.on_step is not None:  # the step's tokens, on the replica's own series
            self.on_step(tokens, r.index)
        for rid, reason in rejected:
            self._fail(rid, "error", reason)  # (while the request's replica is known: its engine label)
            self._done(r, rid)
        for out in outputs:
            if out.request_id in r.inflight:
                r.started.add(out.request_id)
                if out.finished:
                    self._done(r, out.request_id)
                out.engine_index = r.index
                self._deliver(out)

    def _deliver(self, out) -> None:
        r = self._owner.get(out.request_id)  # an output the driver made (an error): the replica it was on, if any
        if r is not None:
            out.engine_index = r.index
        super()._deliver(out)

    def _done(self, r: _Replica, rid: str) -> None:
        if rid in self._isolated:
            self._isolated.discard(rid)
        r.inflight.pop(rid, None)
        r.started.discard(rid)
        self._owner.pop(rid, None)

    def _lost(self, r: _Replica, error: Exception) -> None:
        """Requests with no output yet go back to the front of the queue; those already streaming fail. One on
        MAX_LOST replicas that stopped fails too, as it may be what stops them; where several were (each time
        together) and replicas are replaced, each runs again alone first (_retry): the one that stops a replica
        alone is the one failed."""
        r.alive, r.error = False, f"stopped: {_last_line(error)}"
        stop_replicas(self.ray, [r.handle])
        for ref in [ref for ref, owner in self._calls.items() if owner is r]:
            self._calls.pop(ref)
            self._carried.pop(ref, None)
        again = [p for rid, p in r.inflight.items() if rid not in r.started]
        for rid in [rid for rid in r.inflight if rid in r.started]:
            self._fail(rid, "error", f"engine replica {r.index} stopped while this request ran")
        self._replace(r)
        left = sum(x.alive or x.starting for x in self.replicas)
        unsent = {id(p) for p in r.new}  # assigned to the replica but never sent to it: not lost there
        sent = [p for p in r.inflight.values() if id(p) not in unsent]
        for p in again:
            if id(p) not in unsent:
                p.lost += 1
        # (with none left every request ends as NO_ENGINE anyway)
        twice = [p for p in again if p.lost >= MAX_LOST] if left else []
        isolate = [] if len(sent) == 1 or len(twice) == 1 or self._restart is None else twice
        for p in twice:
            if p not in isolate:
                self._fail(p.request_id, "error", f"the request was on {p.lost} engine replicas that stopped (the "
                                                  f"last: replica {r.index}); it is not run again, as it may be "
                                                  "what stops them")
        # its requests end here or run again: none is left named as running alone (a client's id is used again
        # later, and its replica took no new requests while it ran), but those to run alone once more
        if self._isolated:  # (an engine made without __init__ has none)
            self._isolated.difference_update(r.inflight)
        if isolate:
            kept = [p for p in isolate if p.request_id in self._sinks]
            self._retry.extend(kept)
            self._isolated.update(p.request_id for p in kept)
        again = [p for p in again if p not in twice]
        for rid in list(r.inflight):
            self._owner.pop(rid, None)
        # (its aborts too: kept, they went to the fresh replica in its place, and aborted there a request that reused
        # an aborted one's id, the client's X-Request-Id)
        r.inflight, r.new, r.started, r.unseen, r.holds, r.aborts = {}, [], set(), 0, [], []
        with self._cond:
            self._adds.extendleft(reversed([p for p in again if p.request_id in self._sinks]))
        log.warning("engine replica %d stopped (%s); %d request(s) run again on the %d other replica(s)%s", r.index,
                    _last_line(error), len(again), sum(x.alive for x in self.replicas),
                    f"; a fresh replica {r.index} is starting (restart {r.restarts} of {self.max_restarts})"
                    if r.starting else "")

    def _replace(self, r: _Replica) -> None:
        """Driver thread: start a fresh actor in place of stopped replica `r`, if it has restarts left; the others
        serve meanwhile (_started takes it on once it has loaded the model)."""
        if self._restart is None or r.restarts >= self.max_restarts:
            return
        r.restarts += 1
        base = {k: v for k, v in r.figures().items() if k in CUMULATIVE + SPEC_COUNTERS + DRAFT_COUNTERS
                or k == "spec_decode_num_accepted_tokens_per_pos"}
        with r.moving:
            r.base, r.stats = base, {k: v for k, v in r.stats.items() if k not in base}
        r.gone = r.where  # (the actor stopped: the fresh one loads once its process has ended)
        try:
            r.handle = self._restart(r.index)
            self._starting[r.handle.where.remote()] = (r, "where", [])
        except Exception as e:  # noqa: BLE001 - the runtime refused a new actor: the replica stays stopped
            log.warning("a fresh engine replica %d could not be started (%s)", r.index, _last_line(e))
            return
        r.starting, r.place_by = True, time.monotonic() + self.placement_timeout

    def _unplaced(self) -> None:
        """Driver thread: a fresh replica Ray has not placed by its deadline (no node has the resources it asks for
        free) failed to start: it is stopped and, with restarts left, started once more; the others serve."""
        now = time.monotonic()
        for ref, (r, stage, *_) in list(self._starting.items()):
            if stage != "where" or r.place_by is None or now < r.place_by:
                continue
            self._starting.pop(ref)
            if self.ray.wait([ref], num_returns=1, timeout=0)[0]:  # placed, its answer not read yet: it loads
                self._started(ref, r, stage, *_)
                continue
            stop_replicas(self.ray, [r.handle])
            r.starting, r.place_by = False, None
            message, hint = unplaced(f"the fresh engine replica {r.index} was", self._resources,
                                     self.placement_timeout)
            r.error = message
            self._replace(r)
            log.warning("%s; %s", message, f"starting another (restart {r.restarts} of {self.max_restarts})"
                        if r.starting else f"it stays stopped: {hint}")

    def _started(self, ref, r: _Replica, stage: str, syncs: list, synced: dict | None = None) -> None:
        """Driver thread: a fresh replica's call answered. After `info`: it loads the adapters the server has now
        (and drops those removed since it started) and compiles its kernels, as build_server's replicas did; after
        that warm-up it takes requests, once it has the adapters the server has then too (`synced`: those it was
        given; an adapter added, replaced or removed while it compiled is given, or dropped, first). One that fails
        is stopped, and with restarts left, started once more."""
        if stage == "where":
            r.place_by = None
        try:
            result = self.ray.get(ref)
            error = (result or {}).get("error") if stage == "info" else None
            error = error and error.get("message")
            for sync in syncs:  # (ran before the warm-up on the actor: answered)
                failed = self.ray.get(sync)
                if isinstance(failed, dict):
                    log.warning("fresh engine replica %d: %s", r.index, failed.get("message"))
        except self.ray.exceptions.RayError as e:
            error = _last_line(e)
        if error:
            stop_replicas(self.ray, [r.handle])
            r.starting, r.error = False, f"the fresh replica failed to start: {error}"
            log.warning("the fresh engine replica %d failed to start (%s)", r.index, error)
            self._replace(r)
            return
        if stage == "where":  # Ray placed it: it loads the model now
            r.where = result
            self._starting[r.handle.load.remote(r.gone)] = (r, "info", [])
            return
        if stage == "info":
            r.info = result
            adapters = self.engine.lora_manager  # (the view's: the names requests may use now)
            has = set(result.get("adapters", []))
            names = set(adapters.names()) if adapters is not None else set()
            syncs = [r.handle.add_lora.remote(n, adapters.path_of(n)) for n in sorted(names - has)
                     if adapters.path_of(n)]
            syncs += [r.handle.remove_lora.remote(n) for n in sorted(has - names)]
            self._starting[r.handle.warm_kernels.remote()] = (r, "warm", syncs, self._adapter_paths())
            return
        now = self._adapter_paths()
        if synced is not None and now != synced:  # (add_lora and remove_lora went to the live replicas only)
            syncs = [r.handle.add_lora.remote(n, path, *([True] if n in synced else []))
                     for n, path in sorted(now.items()) if path and synced.get(n) != path]
            syncs += [r.handle.remove_lora.remote(n) for n in sorted(set(synced) - set(now))]
            if syncs:
                self._starting[syncs[-1]] = (r, "warm", syncs[:-1], now)
                return
        r.starting, r.alive, r.calls, r.error = False, True, 1, None
        self._calls[r.handle.serve_step.remote([], [])] = r  # its first figures
        log.warning("engine replica %d restarted; it takes requests again", r.index)

    def _adapter_paths(self) -> dict:
        """The adapters requests may name now, with the folders they were loaded from (the view's)."""
        adapters = self.engine.lora_manager
        return {} if adapters is None else {n: adapters.path_of(n) for n in adapters.names()}

    # ------------------------------------------------------------------ adapters while serving
    async def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Load the adapter on every live replica (each reads `path` on its own host); the name is offered to
        requests only once all have it. If one cannot, the others drop it again and its error is raised. A replica
        found dead by this call (it died while idle, before the driver's check) is left out, as the driver leaves
        it out once it notices: the adapter was refused on every replica for it. `replace` (load_inplace): each
        replica gives the new weights to the requests it gets from now on (LLMEngine.add_lora); if one replica
        cannot, the name is removed from every replica, since the others no longer have the old weights for it."""
        adapters = self.engine.lora_slots()
        async with self._lora_lock():
            if adapters.has(name) and not replace:
                raise LoRANameError(f"a LoRA adapter named {name!r} is already loaded",
                                    "remove it first, give this one another name, or replace it (load_inplace: true)")
            path = str(Path(path).expanduser().absolute())  # the replicas may run in another directory
            live, had = [r for r in self.replicas if r.alive], adapters.has(name)
            asked = []  # the actors asked (a replica that stops meanwhile has a fresh actor, not asked, in its place)

            def load(r, *more):
                handle = r.handle  # (then `alive`: the driver thread marks a replica stopped before its fresh actor)
                if not r.alive:  # it stopped since `live` was read: the fresh actor in its place, loading, has no
                    return _STOPPED  # engine yet (_started gives it the adapters once it has)
                asked.append(handle)
                return handle.add_lora.remote(name, path, *more)
            if replace:  # the requests already routed reach their replica first: they keep the old weights
                refs = await self._call(lambda engine: engine._on_replicas_after_sent(lambda r: load(r, True), live))
            else:
                refs = [load(r) for r in live]
            errors = await self._on_replicas(refs)
            dead = [r for r, e in zip(live, errors) if isinstance(e, dict) and e.get("died")]
            if len(dead) == len(live):
                raise NoEngineError("no engine replica is left", "restart the server")
            live, errors = zip(*[(r, e) for r, e in zip(live, errors) if r not in dead])
            failed = [(r, e) for r, e in zip(live, errors) if e is not None]
            if failed:
                loaded = [r for r, e in zip(live, errors) if e is None]
                gone = ""
                if had and loaded:  # those have no old weights left under the name: no replica may serve it now
                    adapters.discard(name)
                    loaded = list(live)
                    gone = f"; {name!r} is no longer served, since the other replicas had taken the new weights"
                # (as remove_lora: behind the requests routed there, sent first by the driver thread; sent from here,
                # the removal overtook a request accepted while the name was served, refused as an unknown adapter)
                await self._on_replicas(await self._call(lambda engine: engine._on_replicas_after_sent(
                    lambda r: r.handle.remove_lora.remote(name), loaded)))
                r, e = failed[0]
                kind = LoRANameError if e.get("name") else LoRAError  # the name, or the folder, is the problem
                raise kind(f"replica {r.index} ({r.info.get('host')}): {e['message']}{gone}", e.get("hint"))
            adapters.add(name, path)
            # a fresh replica that began to serve meanwhile (after `live` was read, before the name was added: its
            # own check of the adapters, _started, did not see it) is given it too, also one in place of a replica
            # that stopped while it was asked (the same slot, another actor)
            # (through `load`: one that stops again meanwhile is left out, not its fresh actor, not placed yet)
            late = [r for r in self.replicas if r.alive and not any(r.handle is h for h in asked)]
            if late:
                await self._on_replicas([load(r, *([True] if replace else [])) for r in late])

    async def remove_lora(self, name: str) -> int:
        """Refuse `name` to new requests, then retire it on every replica behind the requests already sent there
        (the driver thread sends those first, so each replica admits them before the removal)."""
        adapters = self.engine.lora_slots()
        async with self._lora_lock():
            if not adapters.has(name):
                raise LoRAError(f"unknown LoRA adapter {name!r}",
                                f"loaded adapters: {', '.join(sorted(adapters.names())) or 'none'}")
            adapters.discard(name)
            refs = await self._call(lambda engine: engine._retire_on_replicas(name))
            results = await self._on_replicas(refs)
        return sum(n for n in results if isinstance(n, int))

    async def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes of every live replica; True when each of them did (one that died meanwhile
        has none left to forget)."""
        # each handle read before `alive` (as add_lora's): the driver thread marks a stopped replica dead before it puts
        # a fresh actor in its place, which has no engine until loaded (the call failed there, or waited for Ray to
        # place it)
        handles = [(r.handle, r.alive) for r in self.replicas]
        results = await self._on_replicas([handle.reset_prefix_cache.remote() for handle, alive in handles if alive])
        return all(r is True or (isinstance(r, dict) and r.get("died")) for r in results)

    def _on_replicas_after_sent(self, call, replicas: list) -> list:
        """Driver thread: send every routed request, then call(replica) on each of `replicas` (in this order) still
        live: one that stopped since the caller read them gets _STOPPED (_on_replicas: it died), not a call on the
        fresh actor loading in its place (it has no engine yet; _started gives it the adapters once loaded)."""
        self._send(flush=True)
        return [call(r) if r.alive else _STOPPED for r in replicas]

    def _retire_on_replicas(self, name: str) -> list:
        """Driver thread: send every routed request, then the removal, to every live replica (in this order)."""
        self._send(flush=True)
        return [r.handle.remove_lora.remote(name) for r in self.replicas if r.alive]

    async def _on_replicas(self, refs: list) -> list:
        """Each call's result, or {"message": ..., "died": True} for a replica that died (before or during the
        call), {"message": ...} for another failure of the call."""
        def get(ref):
            if ref is _STOPPED:  # (_on_replicas_after_sent: the replica had stopped)
                return {"message": "the replica stopped", "died": True}
            try:
                return self.ray.get(ref)
            except self.ray.exceptions.ActorDiedError as e:
                return {"message": f"the replica stopped: {_last_line(e)}", "died": True}
            except self.ray.exceptions.RayError as e:
                return {"message": f"the replica stopped: {_last_line(e)}"}
        return await asyncio.to_thread(lambda: [get(ref) for ref in refs])

    def _lora_lock(self) -> asyncio.Lock:
        """One adapter change at a time (made in the server's event loop, on first use)."""
        if self._lora_changes is None:
            self._lora_changes = asyncio.Lock()
        return self._lora_changes

    # ------------------------------------------------------------------ what /health and /metrics read
    def _aggregate(self) -> dict:
        live = [r for r in self.replicas if r.alive]
        # (keyed by the replica: tests' stand-ins share an index; a stand-in without figures() gives its stats)
        figures = {id(r): r.figures() if hasattr(r, "figures") else r.stats for r in self.replicas}
        total = {k: sum(figures[id(r)].get(k, 0) for r in (self.replicas if k in CUMULATIVE else live))
                 for k in SUMMED}
        total["kv_usage"] = total["kv_blocks_used"] / max(total["kv_blocks_total"], 1)
        # the cached tokens over the tokens looked up, over every replica (as one engine's): a mean of the replicas'
        # rates made a replica that looked up ten tokens weigh as much as one that looked up millions
        queries = total["prefix_cache_queries"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
        total["num_replicas_alive"] = len(live)
        if any("kv_blocks_freed_window" in figures[id(r)] for r in self.replicas):  # (a counter: dead ones too)
            total["kv_blocks_freed_window"] = sum(figures[id(r)].get("kv_blocks_freed_window", 0)
                                                  for r in self.replicas)
        if any(r.stats.get("lora_max") for r in live):  # vLLM's lora_requests_info over every replica
            total["lora_max"] = max(r.stats.get("lora_max", 0) for r in live)
            for k in ("lora_waiting", "lora_running"):
                total[k] = sorted({name for r in live for name in r.stats.get(k, [])})
        spec = [figures[id(r)] for r in self.replicas if "spec_decode_num_drafts" in figures[id(r)]]  # dead too
        if spec:  # speculative decoding's counters, summed (by position too)
            for k in SPEC_COUNTERS:
                total[k] = sum(s[k] for s in spec)
            per_pos = [s["spec_decode_num_accepted_tokens_per_pos"] for s in spec]
            total["spec_decode_num_accepted_tokens_per_pos"] = [sum(col) for col in zip(*per_pos)]
        for k in DRAFT_COUNTERS:  # (counters)
            if any(k in figures[id(r)] for r in self.replicas):
                total[k] = sum(figures[id(r)].get(k, 0) for r in self.replicas)
        # each replica's own figures, for /metrics' per-engine series (label engine, as vLLM's data-parallel engines)
        total["engines"] = [{**figures[id(r)], "num_in_flight": len(r.inflight)}
                            | ({} if r.alive else dict.fromkeys(GAUGES, 0)) for r in self.replicas]
        total["replicas_restarted"] = sum(getattr(r, "restarts", 0) for r in self.replicas)
        total["replicas_restarting"] = sum(getattr(r, "starting", False) for r in self.replicas)
        total["replicas"] = [{"replica": r.index, "alive": r.alive, "host": r.info.get("host"),
                              "device": r.info.get("device"), "num_in_flight": len(r.inflight),
                              "restarts": getattr(r, "restarts", 0), "restarting": getattr(r, "starting", False),
                              "error": None if r.alive else getattr(r, "error", None),
                              **{k: r.stats.get(k, 0) if r.alive else 0  # a dead replica runs nothing
                                 for k in ("num_running", "num_waiting", "kv_usage", "num_steps")}}
                             for r in self.replicas]
        return total

    def _with_unseen(self, total: dict) -> dict:
        """`total` (_aggregate's) with the requests no replica's figures count yet as waiting: those a replica was
        given and has not answered for (Replica.unseen), and the front's not yet routed (`_adds`) on the replica
        _route will give each (the live one with the fewest in flight), in flight there too."""
        load = {r.index: len(r.inflight) for r in self.replicas if r.alive}
        front = dict.fromkeys(load, 0)
        for _ in range(len(self._adds) if load else 0):
            i = min(load, key=load.get)
            load[i] += 1
            front[i] += 1
        for r, engine, replica in zip(self.replicas, total["engines"], total["replicas"]):
            if r.alive:
                more = r.unseen + front[r.index]
                engine["num_waiting"] = engine.get("num_waiting", 0) + more
                replica["num_waiting"] += more
                total["num_waiting"] += more
                engine["num_in_flight"] += front[r.index]
                replica["num_in_flight"] += front[r.index]
        return total

    def shutdown(self, timeout: float = 30.0) -> None:
        super().shutdown(timeout)
        stop_replicas(self.ray, [r.handle for r in self.replicas])
