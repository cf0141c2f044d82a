"""vLLM's EngineArgs and AsyncEngineArgs, so that vLLM code that builds its engine from them runs unchanged:
`LLMEngine.from_engine_args(EngineArgs(model=PATH, max_model_len=512))`, `AsyncLLM.from_engine_args(
AsyncEngineArgs(...))` (also `AsyncLLMEngine`), and `LLM(**dataclasses.asdict(engine_args))`.

Their fields are EngineConfig's (the options infer has, under vLLM's names: model, dtype, max_model_len, max_num_seqs,
max_num_batched_tokens, gpu_memory_utilization, enable_lora, max_loras, max_lora_rank, enable_prefix_caching, seed,
kv_cache_dtype, block_size, enforce_eager, ...), with EngineConfig's defaults. A keyword infer lacks is refused as
LLM(...) refuses it (engine.llm._check_options): a vLLM option named with what to do instead, vLLM's options at
values that change nothing here taken and dropped, any other named with the nearest option infer has."""

from __future__ import annotations

from dataclasses import MISSING, field, fields, make_dataclass

from ..errors import ConfigError, UnknownOptionError
from .config import EngineConfig


def _field_specs() -> list[tuple]:
    specs = []
    for f in fields(EngineConfig):
        if f.default_factory is not MISSING:
            spec = field(default_factory=f.default_factory)
        else:
            spec = field(default=None if f.default is MISSING else f.default)
        specs.append((f.name, f.type, spec))
    return specs


_Fields = make_dataclass("EngineArgs", _field_specs(), init=False)


class EngineArgs(_Fields):
    """vLLM's EngineArgs: `EngineArgs(model, **options)`, a dataclass of EngineConfig's fields (dataclasses.asdict
    gives LLM's keywords). `create_engine_config()` is the EngineConfig they make."""

    def __init__(self, model: str, **options):
        from .llm import _check_options, _slots_within_cpu
        options = _slots_within_cpu(_check_options(options, f"{type(self).__name__}()"))
        for f in fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)
        self.model = model
        for name, value in options.items():
            setattr(self, name, value)

    def create_engine_config(self, usage_context=None) -> EngineConfig:
        """The EngineConfig of these options (vLLM's returns its VllmConfig; `usage_context` is vLLM's telemetry
        tag, ignored)."""
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"{type(self).__name__}.model must be the model's folder or a built-in model's name, "
                              f"got {self.model!r}"[:300])
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})


class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs (AsyncLLM.from_engine_args): EngineArgs' fields."""


def engine_config_of(engine_args, what: str, stat_loggers=None) -> EngineConfig:
    """The EngineConfig of `from_engine_args`'s argument (`what`: the method, for the errors): infer's EngineArgs
    only; vLLM's stat_loggers (its metric logger plugins) only as None."""
    if not isinstance(engine_args, EngineArgs):
        raise ConfigError(f"{what} takes an EngineArgs, got {type(engine_args).__name__}",
                          "from infer import EngineArgs; EngineArgs(model=PATH, max_model_len=...)")
    if stat_loggers is not None:
        raise UnknownOptionError(f"{what} takes vLLM's stat_loggers only as None: infer has no stat logger plugins",
                                 "drop the keyword (each RequestOutput.metrics has its request's times; `infer "
                                 "serve` has GET /metrics)")
    return engine_args.create_engine_config()
