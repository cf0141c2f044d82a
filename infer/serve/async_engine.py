"""AsyncEngine: one background thread owns the LLMEngine; asyncio handlers enqueue requests and await outputs.

Handlers call `add` / `abort` (thread-safe, never block on a step). The engine thread drains those queues, runs
`engine.step()`, and hands each RequestOutput to the asyncio queue of its request with `call_soon_threadsafe`.
`add_lora` / `remove_lora` (adapters while serving) read the adapter folder on a worker thread and change the
registry on the engine thread between two steps, after the requests queued before them were admitted.
When nothing is pending it sleeps on a condition. An exception inside a step fails the requests that were running
(each gets an output with finish_reason "error") and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..errors import (InferError, LoRAError, LoRANameError, PauseTimeoutError, RequestError, SleepModeError,
                      SleepTimeoutError)

log = logging.getLogger("infer.serve")


class QueueFullError(InferError):
    """Too many requests wait for the engine (--max-queue); the client should retry later."""

    exit_code = 1


class ShuttingDownError(InferError):
    """The server is shutting down and takes no new requests."""

    exit_code = 1


class RequestIdInUseError(InferError, ValueError):
    """A request id already names a request in flight: a ValueError too, as vLLM's ("Request id ... already
    running"), so that `except ValueError` catches it."""

    exit_code = 1


class NoEngineError(InferError):
    """No engine is left to run a request (every data-parallel replica has died)."""

    exit_code = 1


# the error of an accepted request that no engine is left to run (its replica died, and so did every other one):
# answered as NoEngineError is, a 503 no_engine_replica, not an engine failure
NO_ENGINE = "no engine replica is left (restart the server)"


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None
    sink: tuple  # (event loop, asyncio.Queue)
    arrival_time: float  # time.monotonic() when the server accepted it: its metrics count the wait for the loop
    lost: int = 0  # engine replicas (data parallel) that stopped while this request was on them


class AsyncEngine:
    def __init__(self, engine, max_queue: int | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self._cond = threading.Condition()
        # held by `add` from its check to its enqueue (by `admitting` across every choice of one request), and by the
        # engine thread while it runs controls: a request accepted (its adapter checked) before an adapter's removal
        # or replacement runs is admitted before it, all its choices together
        self._admission = threading.RLock()
        self._adds: deque[_Pending] = deque()
        self._aborts: deque[str] = deque()
        self._controls: deque[tuple] = deque()  # (fn(engine), loop, future): run on the engine thread
        self._idle_controls: deque[tuple] = deque()  # the same, run once no request is left to step (a sleep "wait")
        self._draining = 0  # sleeps (mode "wait") waiting for the requests to end: new ones are refused meanwhile
        # pause(): from the call until resume(), new requests wait here (accepted, not admitted to the engine), and
        # are admitted, in order, after resume() once the engine is awake (_release_held)
        self._holding = False
        self._held: deque[_Pending] = deque()
        self._pauses = 0  # pause() and resume() calls so far: a "wait" pause's control runs only if none came since
        # what pause(mode="abort") calls at once (a served beam search's: its later steps are new requests, which
        # would wait for resume(), where the search must end as the requests the pause aborts)
        self._abort_pause_hooks: set = set()
        self._sinks: dict[str, tuple] = {}  # request id -> (loop, queue); owned under _cond
        self._num_waiting = 0  # engine's waiting queue after the last step
        self._num_running = 0  # and its running sequences
        self._stopping = False
        self._accepting = True
        self.stats: dict = dict(engine.stats())  # a snapshot, replaced (never mutated) by the engine thread
        self.num_step_errors = 0
        # steps that failed in a row (0 after a step that ran): a device that fails every step (a CUDA error poisons
        # its context) is a server to restart, which /health says; a one-off failure is not
        self.failing_steps, self.last_step_error = 0, ""
        # fn(tokens): called on the engine thread with each step's token count (the metrics); the data-parallel
        # driver calls fn(tokens, replica index)
        self.on_step = None
        # why the engine thread stopped when nobody stopped it (a bug past the loop's own handlers): "" while it runs.
        # Then /health says 503, requests are refused (503) and those in flight were ended, none left waiting for ever
        self.died = ""
        self._thread = threading.Thread(target=self._thread_main, name="infer-engine", daemon=True)

    # ------------------------------------------------------------------ called from the event loop
    def start(self) -> None:
        self._thread.start()

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora: str | None,
            queue: asyncio.Queue) -> None:
        """Enqueue one request; its outputs arrive on `queue`. Raises RequestError, QueueFullError."""
        with self._admission:
            self.engine.validate(prompt_token_ids, params, lora)  # read-only checks against fixed engine limits
            awake = getattr(self.engine, "check_awake", None)
            if awake is not None:  # SleepModeError while asleep (sleep mode: POST /wake_up first)
                awake()
            with self._cond:
                if self._draining:
                    raise SleepModeError("the engine is going to sleep (sleep mode \"wait\": the requests accepted "
                                         "before it finish first)", "retry once it was woken: wake_up()",
                                         "POST /wake_up once it sleeps, then retry")
                if self.died:
                    raise NoEngineError(f"the engine loop stopped ({self.died})", "restart the server")
                if not self._accepting:
                    raise ShuttingDownError("the server is shutting down", "retry against another replica")
                if self.max_queue is not None and self._would_wait() >= self.max_queue:
                    paused = "; generation is paused: they run after POST /resume" if self._holding else ""
                    raise QueueFullError(f"{self.max_queue} requests are already waiting (--max-queue{paused})",
                                         "retry after a moment")
                if request_id in self._sinks:
                    raise RequestIdInUseError(f"request id {request_id!r} is already in use",
                                              "give every request in flight its own id, e.g. str(uuid.uuid4())")
                sink = (asyncio.get_running_loop(), queue)
                self._sinks[request_id] = sink
                pending = _Pending(request_id, list(prompt_token_ids), params, lora, sink, time.monotonic())
                # (paused: it waits for resume(); after those that wait for the engine to wake, in order)
                (self._held if self._holding or self._held else self._adds).append(pending)
                self._cond.notify()

    def admitting(self):
        """Held around the `add`s of one request's choices (several prompts, n > 1): no adapter removal or in-place
        reload runs between two of them, so every choice is checked and runs with the same adapter weights."""
        return self._admission

    def capacity(self) -> int | None:
        """The most requests (choices) one body may hold: what could ever be accepted at once, the running slots
        and --max-queue waiting (None: no --max-queue). A body past it gets a 400, since retrying cannot help."""
        return None if self.max_queue is None else self.max_queue + self.engine.config.max_num_seqs

    def _would_wait(self) -> int:
        """Under _cond: how many of the requests accepted so far cannot start at once (--max-queue counts these).
        Requests not yet admitted and those in the engine's waiting queue take the free running slots first: a
        burst of requests at an idle engine is not a queue (it was counted as one, and refused with 503)."""
        free = max(0, self.engine.config.max_num_seqs - self._num_running)
        return len(self._adds) + len(self._held) + self._num_waiting - free

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its KV blocks are freed by the engine thread's next iteration."""
        with self._cond:
            if self._sinks.pop(request_id, None) is None:
                return
            self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        """Under _cond: take the request out of the adds not yet admitted, or have the engine abort it."""
        before = len(self._adds) + len(self._held)
        self._adds = deque(p for p in self._adds if p.request_id != request_id)
        self._held = deque(p for p in self._held if p.request_id != request_id)  # (one waiting for resume())
        if len(self._adds) + len(self._held) == before:
            self._aborts.append(request_id)
        self._cond.notify()

    # ------------------------------------------------------------------ adapters while serving
    async def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Read and validate the adapter on a worker thread (steps go on meanwhile), then register it on the engine
        thread; requests may name it once this returns. LoRAError when it cannot be served. `replace` (vLLM's
        load_inplace): the requests accepted before keep the weights they started with (LLMEngine.add_lora)."""
        manager = self.engine.lora_slots()

        def check():  # before the read, and again on the engine thread: another call may have added it meanwhile
            if manager.has(name) and not replace:
                raise LoRANameError(f"a LoRA adapter named {name!r} is already loaded",
                                    "remove it first, give this one another name, or replace it (load_inplace: true)")

        def add(engine):
            check()
            engine.add_lora(name, path, loaded=adapter, replace=replace)

        check()
        adapter = await asyncio.to_thread(manager.load, name, path)
        await self._call(add)

    async def remove_lora(self, name: str) -> int:
        """Refuse `name` to new requests; those admitted before finish with it. Returns how many still use it."""
        self.engine.lora_slots()
        return await self._call(lambda engine: engine.remove_lora(name))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's POST /reset_prefix_cache), on the engine thread between two steps:
        a benchmark's next level starts cold. Running requests keep their blocks."""
        return await self._call(lambda engine: engine.reset_prefix_cache())

    async def sleep(self, level: int = 1, mode: str = "abort", timeout: float | None = None) -> None:
        """vLLM's sleep (LLMEngine.sleep), on the engine thread between two steps: the requests accepted before it
        end with finish_reason "abort" (`mode` "abort"), or are paused and go on after wake_up ("keep"); with
        "wait", new requests are refused (SleepModeError) at once, the loop steps those accepted before to their
        end (streamed as ever), and the engine sleeps once none is left. New ones are refused until wake_up.
        `timeout` (seconds, mode "wait"): SleepTimeoutError if requests still run then; the engine goes on to
        sleep once they end (new requests refused meanwhile), as without it."""
        check = getattr(self.engine, "check_sleep", None)
        if check is not None:  # a bad level or mode, no sleep mode: refused before anything waits
            check(level, mode)
        _check_timeout(timeout, mode)
        if mode != "wait":
            return await self._call(lambda engine: engine.sleep(level, mode))
        ran = []

        def sleep(engine):
            ran.append(1)
            try:
                engine.sleep(level, mode)
            finally:
                with self._cond:
                    self._draining -= 1

        with self._cond:
            self._draining += 1
        try:
            await self._within(self._call(sleep, idle=True), timeout, "sleep")
        except SleepTimeoutError:
            raise  # (still queued: it sleeps once the requests end, refusing new ones until then)
        except BaseException:
            if not ran:  # never queued (shutting down), or failed by a shutdown before its turn
                with self._cond:
                    self._draining -= 1
            raise

    async def _within(self, call, timeout: float | None, what: str):
        """`await call` (a "wait" control), or its TimeoutError after `timeout` seconds: the control stays queued."""
        if timeout is None:
            return await call
        try:
            return await asyncio.wait_for(call, timeout)
        except asyncio.TimeoutError:
            with self._cond:
                left = self._num_running + self._num_waiting
        said = f"{what}(mode=\"wait\") timed out after {timeout:g} s with {left} request(s) still running"
        if what == "sleep":
            raise SleepTimeoutError(said, "the engine goes to sleep once they end (new requests are refused "
                                    "meanwhile): sleep again with mode=\"abort\" to end them now",
                                    "the engine goes to sleep once they end (new requests are refused meanwhile): "
                                    "POST /sleep?mode=abort ends them now") from None
        raise PauseTimeoutError(said, "generation stays paused (new requests wait) and they run on to their end: "
                                "pause again with mode=\"abort\" to end them, or resume", "generation stays paused "
                                "(new requests wait) and they run on to their end: POST /pause?mode=abort ends them, "
                                "POST /resume resumes") from None

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up (LLMEngine.wake_up), on the engine thread."""
        await self._call(lambda engine: engine.wake_up(tags))

    def is_sleeping(self) -> bool:
        return bool(getattr(self.engine, "is_sleeping", lambda: False)())

    async def pause(self, mode: str = "abort", clear_cache: bool = True, timeout: float | None = None) -> None:
        """vLLM's pause_generation (LLMEngine.pause_generation): from this call until resume(), new requests wait
        (accepted, queued here) instead of running; those accepted before end ("abort"), run to their end before
        this returns ("wait"), or are frozen and go on after resume() ("keep"). `timeout` (seconds, mode "wait"):
        PauseTimeoutError when requests still run then; generation stays paused and they run on to their end."""
        check = getattr(self.engine, "check_pause", None)
        if check is not None:  # a bad mode, a "wait" that cannot end: refused before anything waits
            check(mode, clear_cache)
        _check_timeout(timeout, mode)
        with self._cond:
            self._holding = True
            self._pauses += 1
            mine = self._pauses
            hooks = list(self._abort_pause_hooks) if mode == "abort" else []
        for hook in hooks:
            hook()

        def pause(engine):
            # a resume() while a "wait" drained the requests stands; and a "wait" whose timeout ran out, still queued
            # when a later pause() or resume() came, is over: that call said what holds now (its clear_cache, not
            # this one's, which would forget the prefix cache of a later clear_cache=False pause)
            with self._cond:
                current = self._holding and (mode != "wait" or self._pauses == mine)
            if current:
                engine.pause_generation(mode, clear_cache)

        await self._within(self._call(pause, idle=mode == "wait"), timeout, "pause")

    async def resume(self) -> None:
        """vLLM's resume_generation: the requests that waited since pause() are admitted, in order, and every
        request runs again (LLMEngine.resume_generation). Not paused: nothing changes."""
        with self._cond:
            self._holding = False
            self._pauses += 1
            self._cond.notify()
        await self._call(lambda engine: getattr(engine, "resume_generation", lambda: None)())  # (then _release_held)

    def _release_held(self) -> None:
        """On the engine thread, after controls (resume, wake_up, reload_weights): the requests that waited for
        resume() are admitted, in order, once it came and the engine is awake. Asleep (a sleep while paused, then
        a resume), they wait on for wake_up(): admitted then, the engine refused them (a 500 "the engine is
        asleep", where the server had accepted them)."""
        with self._cond:
            if self._holding or not self._held:
                return
        try:
            getattr(self.engine, "check_awake", lambda: None)()
        except SleepModeError:
            return
        with self._cond:
            if not self._holding:
                self._adds.extend(self._held)
                self._held.clear()
                self._cond.notify()

    def on_abort_pause(self, hook, remove: bool = False) -> None:
        """Have pause(mode="abort") call `hook()` (on the caller's thread) until it is removed (`remove`)."""
        if hook is None:
            return
        with self._cond:
            (self._abort_pause_hooks.discard if remove else self._abort_pause_hooks.add)(hook)

    def num_held(self) -> int:
        """The requests accepted since pause() that wait for resume() (or, resumed while asleep, for wake_up()): not
        in the engine yet, they wait all the same (/metrics' num_requests_waiting counts them)."""
        with self._cond:
            return len(self._held)

    def is_paused(self) -> bool:
        """vLLM's is_paused: from pause() until resume()."""
        with self._cond:
            return self._holding

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """vLLM's collective_rpc (LLMEngine.collective_rpc), on the engine thread between two steps."""
        return await self._call(lambda engine: engine.collective_rpc(method, timeout, args, kwargs))

    def hold_lora(self, name: str | None):
        """What a caller that adds requests one after another with adapter `name` passes as their `lora` (a served
        beam search's steps): the engine's hold (LLMEngine.hold_lora), so that an unload or in-place reload meanwhile
        leaves it the weights it began with, as a running request keeps them; the name itself where the engine has no
        holds (data parallel). RequestError for a name not served. release_lora(hold) when done."""
        hold = getattr(self.engine, "hold_lora", None)
        if name is None or hold is None:
            return name
        with self._admission:  # ordered with the removals and replacements the engine thread runs
            return hold(name)

    def release_lora(self, hold) -> None:
        """End hold_lora's hold, on the engine thread (an adapter removed meanwhile is freed there)."""
        if hold is None or isinstance(hold, str):
            return
        with self._cond:
            self._controls.append((lambda engine: engine.release_lora(hold), None, None))
            self._cond.notify()

    async def _call(self, fn, idle: bool = False):
        """fn(engine) on the engine thread, between two steps and after every request queued before this call;
        `idle`: once no request is left to step (those queued before it ended)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self.died:  # (not a shutdown: nothing runs any more)
                raise NoEngineError(f"the engine loop stopped ({self.died})", "restart the server")
            if self._stopping or not self._accepting:
                raise ShuttingDownError("the server is shutting down", "retry against another replica")
            (self._idle_controls if idle else self._controls).append((fn, loop, future))
            self._cond.notify()
        return await future

    def _busy(self) -> bool:
        """Whether the engine has requests a step would run (not those a sleep "keep" paused while it sleeps, nor
        those pause() froze)."""
        paused = getattr(self.engine, "stalled", None)
        return self.engine.has_unfinished_requests() and not (paused is not None and paused())

    def _run_controls(self, controls: list, target) -> None:
        for fn, loop, future in controls:
            try:
                result, error = fn(target), None
            except Exception as e:  # the caller's error (a bad adapter): it goes back to the caller
                result, error = None, e
            if future is not None:  # (none: nobody waits for it, release_lora)
                _settle(loop, future, result, error)
            elif error is not None:
                log.error("engine control failed: %s", error)

    def _fail_controls(self) -> None:
        with self._cond:
            controls, self._controls = list(self._controls) + list(self._idle_controls), deque()
            self._idle_controls = deque()
        for _, loop, future in controls:
            if future is not None:
                _settle(loop, future, None, ShuttingDownError("the server is shutting down", "retry later"))

    num_engines = 1  # the engines /metrics shows (label engine): the data-parallel driver's replicas

    def engine_of(self, request_id: str) -> int:
        """The index of the engine that runs `request_id` (/metrics' label engine)."""
        return 0

    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._sinks)

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def cut_off(self, message: str = "the server shut down before the request finished",
                paused_only: bool = False) -> int:
        """Stop taking requests and end every one in flight now: each gets a last output (finish_reason "abort",
        `message` as its error) and its KV blocks are freed. Returns how many there were. `paused_only`: those that
        cannot finish while generation is paused (pause()), no other: those waiting for resume() and, once the
        engine is paused, every one (a shutdown's wait for them to finish would last its whole timeout)."""
        with self._cond:
            if paused_only and not self._holding:
                return 0
            if not paused_only or getattr(self.engine, "is_paused", lambda: False)():
                left = list(self._sinks)
            else:  # (a pause mode "wait" still runs the requests accepted before it: those may finish)
                left = [p.request_id for p in self._held]
        self.stop_accepting()
        for rid in left:
            self._fail(rid, "abort", message)  # its last output, which also forgets its sink
            with self._cond:
                self._drop(rid)  # (abort() would do nothing now that the sink is gone)
        return len(left)

    def shutdown(self, timeout: float = 30.0, message: str | None = None) -> None:
        """Stop taking requests, let those in flight finish within `timeout`, abort the rest (`message` their error;
        by default the server's), stop the thread."""
        self.stop_accepting()
        self.cut_off(message or "the server shut down while generation was paused (before the request finished)",
                     paused_only=True)
        deadline = time.monotonic() + timeout
        while self.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.cut_off(*([message] if message else []))
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the engine thread
    def _thread_main(self) -> None:
        """The thread's body: _run (a subclass's too). Should it ever raise, the thread was gone without a word:
        /health said ok while every request in flight, and every new one, waited for ever."""
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 (whatever it is, the requests must not wait for a dead thread)
            log.critical("the engine loop stopped: %s: %s; restart the server", type(e).__name__, e, exc_info=True)
            with self._cond:
                self.died, self._accepting = f"{type(e).__name__}: {e}", False
                left = list(self._sinks)
            for rid in left:
                self._fail(rid, "error", f"the engine loop stopped ({self.died}); restart the server")
            self._fail_controls()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._adds or self._aborts or self._controls or self._busy()
                           or self._idle_controls):
                    self._cond.wait()
                if self._stopping and not self._aborts:
                    break
                adds, self._adds = list(self._adds), deque()
                aborts, self._aborts = list(self._aborts), deque()
                controls, self._controls = list(self._controls), deque()
                if self._idle_controls and not adds and not self._busy():  # (else the steps go on: their turn
                    controls += list(self._idle_controls)  # comes once the requests accepted before them ended)
                    self._idle_controls = deque()
            try:
                self._iteration(adds, aborts, controls)
            except Exception as e:  # never let the loop die: fail what was running, keep serving
                self._step_failed(e)
                log.exception("engine loop error")
                self._fail_running(f"internal engine error: {type(e).__name__}: {e}")
        self._fail_controls()

    def _iteration(self, adds: list[_Pending], aborts: list[str], controls: list = ()) -> None:
        for rid in aborts:
            self.engine.abort_request(rid)  # frees its KV blocks now
        for p in adds:
            self._admit(p)
        if controls:  # after the adds: a request accepted before a removal runs, also one accepted (its adapter
            with self._admission:  # checked) since this iteration took the control, which the next would admit
                with self._cond:  # after the removal ("unknown LoRA adapter", a 500)
                    late, self._adds = list(self._adds), deque()
                adds = adds + late
                for p in late:
                    self._admit(p)
                self._run_controls(controls, self.engine)
                self._release_held()
        if adds:
            with self._cond:  # the new requests wait in the engine now: count them before the step runs
                self._num_waiting = len(self.engine.scheduler.waiting)
                self._num_running = len(self.engine.scheduler.running)
        self._step()

    def _admit(self, p: _Pending) -> None:
        try:
            self.engine.add_request(p.request_id, p.prompt_token_ids, p.params, p.lora, arrival_time=p.arrival_time)
        except Exception as e:  # validated already; anything here is unexpected, but only this request fails
            log.exception("could not add request %s", p.request_id)
            self._fail(p.request_id, "error", str(e))

    def _step(self) -> None:
        stepping = self._busy()
        try:
            if stepping:  # another thread's pause, sleep... (LLMEngine's controls) first: the lock is not first come,
                yielding = getattr(self.engine, "yield_to_controls", None)  # first served, and this loop would take it
                if yielding is not None:  # again at once, the control waiting until every request ended
                    yielding()
            outputs = self.engine.step() if stepping else []
        except Exception as e:
            self._step_failed(e)
            log.exception("engine step failed; failing the running requests")
            self._fail_running(f"internal engine error: {type(e).__name__}: {e}")
            outputs = []
        else:
            if stepping:  # else the engine's last step is one already counted (an iteration for an abort, a control)
                tokens = getattr(self.engine, "last_step_tokens", 0)
                if tokens:  # the model ran (a step that only ended aborted requests proves nothing)
                    self.failing_steps = 0
                self._stepped(tokens)
        # the snapshot first: a client that has its last token and then reads /health or /metrics sees the step that
        # made it (its request no longer running, the step's preemptions, cache hits and drafts counted)
        stats = dict(self.engine.stats())
        with self._cond:
            self._num_waiting, self._num_running = stats["num_waiting"], stats["num_running"]
        self.stats = stats
        for out in outputs:
            self._deliver(out)

    def _step_failed(self, e: Exception) -> None:
        self.num_step_errors += 1
        self.failing_steps += 1
        self.last_step_error = f"{type(e).__name__}: {e}"

    def _stepped(self, tokens: int) -> None:
        if tokens and self.on_step is not None:
            self.on_step(tokens)

    def _fail_running(self, message: str) -> None:
        """After a failed step the running sequences' state is not trusted: abort them (frees their blocks)."""
        running = [s.request_id for s in self.engine.scheduler.running]
        victims = running or list(self.engine.requests)
        for rid in victims:
            seq = self.engine.requests.get(rid)
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("could not abort request %s", rid)
            self._fail(rid, "error", message, seq)

    def _fail(self, request_id: str, reason: str, message: str, seq=None) -> None:
        """End a request with `reason` and `message`; with its engine Sequence, its output keeps the prompt, the
        tokens and the times it had (the server's usage and metrics count them)."""
        if reason == "error":
            out = RequestOutput.failed(request_id, seq, message)
        else:
            out = RequestOutput(request_id=request_id, prompt_token_ids=[], token_ids=[], new_token_ids=[], text="",
                                delta_text="", finished=True, finish_reason=reason, error=message)
        self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._cond:
            sink = self._sinks.get(out.request_id)
            if sink is not None and out.finished:
                del self._sinks[out.request_id]
        if sink is None:
            return  # aborted by its client, or a request this server did not make
        loop, queue = sink
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass


def _check_timeout(timeout, mode: str) -> None:
    """A "wait" control's timeout: None, or seconds above 0 with mode "wait"."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise RequestError(f"the timeout must be a number of seconds above 0, got {timeout!r}"[:200],
                           "e.g. timeout=30, or none to wait for as long as the requests run")
    if mode != "wait":
        raise RequestError(f"a timeout is for mode \"wait\" (mode {mode!r} does not wait for the requests)"[:200],
                           "leave it out, or use mode=\"wait\"")


def _settle(loop, future, result, error) -> None:
    """Complete an asyncio future from another thread (nothing happens if its caller gave up)."""
    def done():
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)
    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # the event loop is closed
        pass
