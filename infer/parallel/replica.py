"""One engine replica, run inside a Ray actor: the driver hands it requests and collects what finished.

The class is plain Python (`ray.remote(Replica)` makes it an actor in runtime.py), so it can be read and tested
without Ray. Every call is short: `step` runs engine steps only until some request finishes or a time budget
passes, so the driver can refill free slots (load-based dispatch) and show progress.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

from ..errors import InferError, LoRANameError, RequestError

# (request id, prompt token ids, SamplingParams, lora name or None): what travels to a replica
Wire = tuple
ENGINE_FAILURE = "internal engine error"  # how the reason of a request failed inside an engine step begins
GONE_WAIT_S = 60.0  # how long a fresh replica waits for its predecessor's process to end before it loads anyway
GONE_POLL_S = 0.1


@dataclass
class StepResult:
    finished: list = field(default_factory=list)  # RequestOutput of every request that finished in this call
    rejected: list = field(default_factory=list)  # (request id, reason): requests this replica cannot run
    tokens: int = 0  # tokens generated during this call
    running: int = 0  # requests still on this replica


class Replica:
    def __init__(self, config, threads: int | None = None, load: bool = True):
        """Build the engine from `config` (model and adapter paths already absolute); with `load` False, only once
        `load()` is called (runtime.start_replicas: `where()` answers as soon as Ray has placed the actor). An
        InferError (a model that does not fit, a bad adapter) is kept and reported by `info()`, so the driver can
        say it in one line."""
        self.error: dict | None = None
        self.engine = None
        self.config = config
        self._failed: set[str] = set()  # requests reported as failed whose abort output is still to come
        self._holds: dict = {}  # the driver's adapter holds (serve_engine.ReplicaHold's token) -> this engine's
        if threads:
            import torch
            torch.set_num_threads(threads)
        if load:
            self.load()

    def where(self) -> dict:
        """Where this actor's process runs ({"host", "pid", "started": its start time}): the driver's first call,
        answered once Ray has placed the actor, before the model loads (`load`)."""
        import psutil
        return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}

    def load(self, after: dict | None = None) -> dict:
        """Build the engine (once: a replica made with `load` has already) and return `info()`. `after`: the
        `where` of the replica this one replaces: on its host, the model loads once that process has ended (its
        GPU memory is free), GONE_WAIT_S at most."""
        if self.engine is None and self.error is None:
            wait_gone(after)
            from ..engine.llm_engine import LLMEngine
            try:
                self.engine = LLMEngine(self.config)
            except InferError as e:
                self.error = {"type": type(e).__name__, "message": e.message, "hint": e.hint}
        return self.info()

    def info(self) -> dict:
        """Where this replica runs and what it holds (the driver prints it and checks requests against it)."""
        if self.engine is None:
            return {"error": self.error, "host": socket.gethostname(), "pid": os.getpid()}
        e = self.engine
        return {"error": None, "host": socket.gethostname(), "pid": os.getpid(), "device": str(e.device),
                "dtype": str(e.dtype).removeprefix("torch."), "num_blocks": e.memory_plan.num_blocks,
                "kv_cache_dtype": e.memory_plan.kv_cache_dtype,
                "kv_window": e.block_manager.window, "kv_step_tokens": e.block_manager.step_tokens,
                "kv_groups": getattr(e.block_manager, "windows", None),  # (a model of mixed layers' groups)
                "max_model_len": e.max_model_len, "model": e.model_path.name,
                "vocab_size": e.model_config.vocab_size, "model_limit": e.model_limit,
                "model_limit_reason": e.model_limit_reason,
                "eos_token_ids": sorted(e.eos_token_ids),
                "adapters": sorted(e.lora_manager.names()) if e.lora_manager is not None else [],
                "adapter_paths": {n: e.lora_manager.path_of(n) for n in e.lora_manager.names()}
                if e.lora_manager is not None else {},
                "lora_enabled": e.lora_manager is not None, "pooler": e.pooler}

    def add_lora(self, name: str, path: str, replace: bool = False) -> dict | None:
        """Register an adapter while serving (`replace`: in place of one of that name, LLMEngine.add_lora): None, or
        the error ({"message", "hint"}) the driver reports."""
        try:
            self.engine.add_lora(name, path, replace=replace)
        except InferError as e:
            return {"message": e.message, "hint": e.hint, "name": isinstance(e, LoRANameError)}
        return None

    def remove_lora(self, name: str) -> int | dict:
        """Retire an adapter: how many of this replica's requests still use it, or the error."""
        try:
            return self.engine.remove_lora(name)
        except InferError as e:
            return {"message": e.message, "hint": e.hint}

    def reset_prefix_cache(self) -> bool:
        """Forget this replica's cached prefixes (LLMEngine.reset_prefix_cache)."""
        return self.engine.reset_prefix_cache()

    def validate(self, requests: list[Wire]) -> dict[str, RequestError | str]:
        """{request id: why} for the requests this engine could never run (the others are not listed): the engine's
        RequestError itself, whose fields let the driver word it in its own terms (an unknown adapter's remedy is
        infer run's --lora NAME=PATH, not the API's LLM.add_lora), or the text of another failure."""
        bad = {}
        for rid, prompt_token_ids, params, lora in requests:
            try:
                self.engine.validate(prompt_token_ids, params, lora)
            except RequestError as e:
                bad[rid] = e
            except Exception as e:  # noqa: BLE001 - that line's error: the driver took the replica for dead
                bad[rid] = f"{ENGINE_FAILURE}: {type(e).__name__}: {e}"
        return bad

    def step(self, new: list[Wire], budget_s: float = 0.5) -> StepResult:
        """Add `new` requests, then run engine steps until at least one request finishes, nothing is left, or
        `budget_s` seconds pass."""
        from ..engine.pooling import output_tokens
        result = StepResult(rejected=self._add(new))
        deadline = time.monotonic() + budget_s
        while self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step()
            except Exception as e:  # as one engine does: fail the requests it was running, never the replica
                result.rejected += self._fail_running(e)
                break
            for out in outputs:
                if self._was_failed(out):
                    continue
                result.tokens += output_tokens(out)
                if out.finished:
                    result.finished.append(out)
            if result.finished or time.monotonic() > deadline:
                break
        result.running = len(self.engine.requests)
        return result

    def _add(self, new: list[Wire]) -> list[tuple[str, str]]:
        """Add `new` to the engine: (request id, reason) of those it refused. Any other exception while adding one
        fails that request alone (it escaped the call, and the driver took the replica for dead: a request that
        raised on every replica stopped the whole run)."""
        rejected = []
        for rid, prompt_token_ids, params, lora in new:
            if getattr(lora, "token", None) is not None:  # the driver's hold: this engine's, or the name once released
                lora = self._holds.get(lora.token, lora.name)
            try:
                self.engine.add_request(rid, prompt_token_ids, params, lora)
            except RequestError as e:
                rejected.append((rid, str(e)))
            except Exception as e:  # noqa: BLE001 - as a failed step: that request's error, the replica goes on
                if rid in self.engine.requests and not self.engine.requests[rid].finished:
                    self.engine.abort_request(rid)
                    self._failed.add(rid)
                rejected.append((rid, f"{ENGINE_FAILURE}: {type(e).__name__}: {e}"))
        return rejected

    def _fail_running(self, error: Exception) -> list[tuple[str, str]]:
        """After a failed step the running requests' state is not trusted: abort them (frees their KV blocks) and
        name them with the error; the driver writes their error records and the others go on."""
        message = f"{ENGINE_FAILURE}: {type(error).__name__}: {error}"
        victims = [s.request_id for s in self.engine.scheduler.running] or list(self.engine.requests)
        for rid in victims:
            self.engine.abort_request(rid)
        self._failed.update(victims)
        return [(rid, message) for rid in victims]

    def _was_failed(self, out) -> bool:
        """The abort output of a request already named as failed (dropped: it was reported once)."""
        if out.request_id in self._failed:
            self._failed.discard(out.request_id)
            return True
        return False

    def _hold(self, ops) -> None:
        """The driver's adapter holds, in order: ("hold", token, name) holds the adapter (LLMEngine.hold_lora),
        ("release", token) ends that hold."""
        for op in ops:
            if op[0] == "hold":
                try:
                    self._holds[op[1]] = self.engine.hold_lora(op[2])
                except InferError:  # not served here: the requests naming it are refused as any other's
                    pass
            else:
                self.engine.release_lora(self._holds.pop(op[1], None))

    def serve_step(self, new: list[Wire], aborts: list[str], holds=()) -> tuple[list, list, dict]:
        """For the server: adapter holds (`holds`, _hold), add, abort (a request may be aborted in the call that
        adds it), run one engine step.
        Returns (every output of the step, as streaming needs them; (request id, reason) of rejected requests;
        the engine's stats, with `step_tokens`: the tokens the step computed, for the server's
        infer:iteration_tokens_total)."""
        self._hold(holds)
        rejected = self._add(new)
        for rid in aborts:
            self.engine.abort_request(rid)
        outputs, stepped = [], 0
        if self.engine.has_unfinished_requests():
            try:
                outputs = [o for o in self.engine.step() if not self._was_failed(o)]  # (pickled with their lists)
                stepped = self.engine.last_step_tokens
            except Exception as e:  # as one engine's server does: fail the running requests, keep the replica
                rejected += self._fail_running(e)
        return outputs, rejected, {**self.engine.stats(), "step_tokens": stepped}

    def warm_kernels(self) -> None:
        self.engine.warm_kernels()


def wait_gone(where: dict | None, timeout: float = GONE_WAIT_S) -> bool:
    """Wait until the process `where` names ({"host", "pid", "started"}: Replica.where) has ended, when it ran on
    this host (a killed actor's process may still hold its GPU memory for a while; one on another host holds none
    of this one's), `timeout` seconds at most. True: it has ended (or is not this host's)."""
    if not where or where.get("host") != socket.gethostname() or not where.get("pid") or where["pid"] == os.getpid():
        return True
    import psutil
    try:
        process = psutil.Process(where["pid"])
        if where.get("started") is not None and abs(process.create_time() - where["started"]) > 1e-3:
            return True  # the pid was reused: that process ended
    except psutil.Error:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:  # (a zombie holds no memory)
                return True
        except psutil.Error:
            return True
        time.sleep(GONE_POLL_S)
    return False
