"""vLLM's worker as its collective_rpc reaches it: infer runs the model in the engine's own process, one worker."""

from __future__ import annotations

import inspect

from ..errors import RequestError


class Worker:
    """What `collective_rpc(method, args=..., kwargs=...)` calls `method` of (a function: `method(worker, *args,
    **kwargs)`, as vLLM's): `model_runner` (its `model`), `device`, `get_model()`, and the engine's `sleep`,
    `wake_up`, `is_sleeping` and `reload_weights` (vLLM's RLHF loop: collective_rpc("reload_weights") after
    sleep(level=2) and wake_up(["weights"]))."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def model_runner(self):
        return self.engine.runner

    @property
    def device(self):
        return self.engine.device

    def get_model(self):
        return self.engine.runner.model

    def reload_weights(self) -> None:
        self.engine.reload_weights()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()


METHODS = ("get_model", "reload_weights", "sleep", "wake_up", "is_sleeping")


def call_worker(engine, method, args=(), kwargs=None) -> list:
    """vLLM's collective_rpc on infer's one worker: [the result] of `method` (a Worker method's name, or a function
    called with the worker first)."""
    args = () if args is None else args
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise RequestError("collective_rpc takes args as a tuple (or list) and kwargs as a dict",
                           "e.g. collective_rpc(\"sleep\", kwargs={\"level\": 1})")
    worker = Worker(engine)
    if isinstance(method, str):
        fn = getattr(worker, method, None) if not method.startswith("_") else None
        if fn is None or not callable(fn):
            raise RequestError(f"collective_rpc: the worker has no method {method!r}"[:200],
                               f"its methods: {', '.join(METHODS)}; or pass a function, called with the worker "
                               "(worker.model_runner.model is the model)")
        try:  # arguments it does not take: the caller's mistake (POST /collective_rpc answered a 500)
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as e:
            raise RequestError(f"collective_rpc({method!r}): {e}"[:300],
                               f"{method}{inspect.signature(fn)} takes these arguments") from None
        return [fn(*args, **kwargs)]
    if not callable(method):
        raise RequestError(f"collective_rpc takes a method name or a function, got {type(method).__name__}",
                           "e.g. collective_rpc(\"reload_weights\")")
    return [method(worker, *args, **kwargs)]
