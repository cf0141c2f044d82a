"""infer: deploy GPTQ int4 language models with batched multi-LoRA, and measure them.

Public API: `LLM`, `AsyncLLM` (vLLM's asyncio engine; `AsyncLLMEngine` too), `BeamSearchParams` (LLM.beam_search),
`LoRARequest` (vLLM's adapter by request), `SamplingParams` (and its `StructuredOutputsParams` and
`RequestOutputKind`), `EngineArgs` / `AsyncEngineArgs` (vLLM's, for LLMEngine.from_engine_args /
AsyncLLM.from_engine_args), `EngineConfig` (imported lazily so `import infer` stays light), and the errors a user
can cause (`InferError` and its subclasses, from `infer.errors`).
"""

from __future__ import annotations

__version__ = "0.1.0"
_ERRORS = ("InferError", "ConfigError", "ModelLoadError", "UnsupportedModelError", "OutputError", "RequestError",
           "LoRAError", "LoRANameError", "OutOfMemoryError", "ClosedError", "UnknownOptionError", "RequestIdTypeError",
           "UnknownAdapterError", "UnknownModelError", "SleepModeError", "SleepTimeoutError",
           "PauseError", "PauseTimeoutError")
__all__ = ["LLM", "AsyncLLM", "BeamSearchParams", "LoRARequest", "SamplingParams", "PoolingParams", "RequestOutputKind",
           "StructuredOutputsParams",
           "EngineConfig", "EngineArgs", "AsyncEngineArgs", "AsyncLLMEngine", "RequestOutput", "CompletionOutput",
           "LLMEngine", *_ERRORS]


def __getattr__(name: str):
    if name == "LLM":
        from .engine.llm import LLM
        return LLM
    if name in ("AsyncLLM", "AsyncLLMEngine"):
        from .serve import async_llm
        return getattr(async_llm, name)
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from .engine import arg_utils
        return getattr(arg_utils, name)
    if name == "BeamSearchParams":
        from .engine.beam import BeamSearchParams
        return BeamSearchParams
    if name == "LoRARequest":
        from .lora.request import LoRARequest
        return LoRARequest
    if name == "PoolingParams":
        from .engine.pooling import PoolingParams
        return PoolingParams
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "RequestOutputKind":
        from .engine.sampling_params import RequestOutputKind
        return RequestOutputKind
    if name == "StructuredOutputsParams":
        from .engine.structured import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "EngineConfig":
        from .engine.config import EngineConfig
        return EngineConfig
    if name == "RequestOutput":
        from .engine.outputs import RequestOutput
        return RequestOutput
    if name == "CompletionOutput":
        from .engine.outputs import CompletionOutput
        return CompletionOutput
    if name == "LLMEngine":
        from .engine.llm_engine import LLMEngine
        return LLMEngine
    if name in _ERRORS:
        from . import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
