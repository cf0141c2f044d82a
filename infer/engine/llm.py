"""LLM: the Python API. `LLM(path).generate(prompts, params)` and `LLM(path).stream(prompts, params)`.

One engine serves every call: calls from several threads, or a generate() while a stream() is paused, share its
steps (one at a time, under a lock), and each step's outputs go to the mailbox of the call that made the request,
so no call consumes another's outputs."""

from __future__ import annotations

import functools
import numbers
import threading
import time
import weakref
from dataclasses import fields as dataclass_fields, replace
from typing import Iterator, Sequence as Seq

from ..errors import ClosedError, PauseError, RequestError, SleepModeError, UnknownOptionError
from ..models.classifier import CONVERT_CLASSIFY
from .config import EngineConfig, load_chat_template
from .inputs import chat_template_options, encode_prompt
from .llm_engine import LLMEngine, LoRAHold, interrupts_held, salted_params, text_only
from .outputs import CompletionOutput, RequestOutput, as_delta
from .pooling import EMBED_ONLY, EmbeddingRequestOutput, PoolingParams
from .sampling_params import RequestOutputKind, SamplingParams
from .sleep import PAUSED, SLEPT

Prompt = str | list[int] | list[dict] | dict  # text, token ids, chat messages, or vLLM's {"prompt": ...} dict


def _check_options(options: dict, what: str = "LLM()") -> dict:
    """Every keyword must be an EngineConfig field: an unknown one is named (with the nearest known one), not a
    bare TypeError from the dataclass. vLLM's keywords that change nothing here at the value given (_VLLM_NOOPS) are
    dropped: the options to make the EngineConfig of are returned."""
    import difflib
    from dataclasses import fields
    for name, (taken, hint) in _VLLM_NOOPS.items():
        if name in options:
            value = options[name]
            if not any(value is t or (type(value) is type(t) and value == t) for t in taken):
                raise UnknownOptionError(f"{what} takes vLLM's {name} only as {' or '.join(map(repr, taken))} (which "
                                         f"changes nothing here), got {value!r}"[:300], hint)
    if options.get("task") == "embed" or (options.get("convert") == "embed" and "runner" not in options):
        options = {**options, "runner": "pooling"}  # vLLM's older task="embed": the pooling runner
    options = {k: v for k, v in options.items() if k not in _VLLM_NOOPS}
    known = [f.name for f in fields(EngineConfig) if f.name != "model"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        vllm = next((name for name in unknown if name in _VLLM_OPTIONS), None)
        if vllm is not None:  # a vLLM program's keyword: what to do in infer, not 30 options to guess from
            raise UnknownOptionError(f"{what} has no option {vllm!r}: it is vLLM's keyword", _VLLM_OPTIONS[vllm])
        near = difflib.get_close_matches(unknown[0], known, n=1)
        raise UnknownOptionError(f"{what} has no option {', '.join(map(repr, unknown))}",
                                 (f"did you mean {near[0]!r}? " if near else "") +
                                 f"its options are EngineConfig's: {', '.join(known)}")
    return options


_LOCAL = ("model is a local folder (infer downloads nothing): fetch it first, e.g. `hf download ID "
          "--revision REV --local-dir DIR`, and pass DIR")
_ONE_GPU = "infer runs each model on one GPU (`infer run/serve --data-parallel N` runs replicas); drop the keyword"
# vLLM's LLM() keywords that infer does not take, and what to do instead (the command line's are in cli/vllm_flags)
_VLLM_OPTIONS = {
    "trust_remote_code": "infer runs its own Llama, Mistral and Qwen code, never a checkpoint's Python; drop the "
                         "keyword",
    "quantization": "the quantization is read from the model's config.json (GPTQ int4/int8, AWQ int4, or a float "
                    "model), quantization=\"awq\" or \"gptq\" included; drop the keyword (`infer quantize` makes a "
                    "GPTQ checkpoint)",
    "tokenizer": "the tokenizer is read from the model's folder; copy the tokenizer's files into it",
    "revision": _LOCAL,
    "tokenizer_revision": _LOCAL,
    "download_dir": _LOCAL,
    "load_format": "the model's safetensors or .bin weights are read as they are; drop the keyword",
    "calculate_kv_scales": "infer's fp8 KV cache (kv_cache_dtype=\"fp8\") stores K and V with scale 1.0, vLLM's "
                           "default; drop the keyword",
    "enable_chunked_prefill": "infer always splits long prefills into steps of max_num_batched_tokens tokens; drop "
                              "the keyword",
    "swap_space": "infer preempts a sequence by recomputing it, not by swapping its KV to the CPU; drop the keyword",
    "preemption_mode": "infer preempts a sequence by recomputing it (vLLM's recompute); drop the keyword",
    "num_gpu_blocks_override": "infer's keyword for the number of KV cache blocks is num_kv_blocks=N",
    "kv_cache_memory_bytes": "the KV cache gets what the memory budget (gpu_memory_utilization, or memory_limit on a "
                             "CPU) leaves after the weights and activations; num_kv_blocks=N sets its blocks",
    "max_num_partial_prefills": "infer splits long prefills into steps of max_num_batched_tokens tokens beside the "
                                "decodes; drop the keyword",
}

# vLLM's LLM() keywords that vLLM programs often spell out, at values that change nothing in infer (vLLM's default,
# or what infer always does): taken and dropped (they were refused as unknown, with infer's 30 options to guess
# from); any other value is refused with what to do instead
_VLLM_NOOPS = {
    "disable_log_stats": ((True,), "infer's LLM logs no periodic stats (each RequestOutput.metrics has its request's "
                                   "times; `infer serve` has GET /metrics); drop the keyword"),
    "tokenizer_mode": (("auto", "hf"), "infer reads the model folder's Hugging Face tokenizer (vLLM's auto); drop "
                                       "the keyword"),
    "skip_tokenizer_init": ((False,), "infer always loads the model's tokenizer (prompts may still be token ids); "
                                      "drop the keyword"),
    "task": (("auto", "generate", "embed"), "infer runs text generation (vLLM's generate) and embeddings (task="
                                            "\"embed\", now runner=\"pooling\") only; drop the keyword"),
    "convert": (("auto", "none", "embed"), "infer converts a decoder to an embedding model (convert=\"embed\", with "
                                           "runner=\"pooling\"); a classifier: " + CONVERT_CLASSIFY),
    "cpu_offload_gb": ((0, 0.0), "infer holds every weight on the device; run an int4 model (infer quantize) or a "
                                 "smaller one"),
    "hf_overrides": ((None,), "infer reads the model's config.json as it is; edit it in a copy of the folder"),
    # vLLM's quick start passes tensor_parallel_size=1: one GPU, what infer runs
    "tensor_parallel_size": ((1,), _ONE_GPU),
    "pipeline_parallel_size": ((1,), _ONE_GPU),
    "data_parallel_size": ((1,), _ONE_GPU),
    "distributed_executor_backend": ((None,), _ONE_GPU),
    "disable_custom_all_reduce": ((False, True), _ONE_GPU),
    "compilation_config": ((None,), "infer compiles its own kernels and captures CUDA graphs itself; "
                                    "enforce_eager=True runs without the graphs"),
    "logprobs_mode": (("raw_logprobs",), "infer's logprobs are the model's raw log-softmax (vLLM's default "
                                         "raw_logprobs); drop the keyword"),
    "limit_mm_per_prompt": ((None,), "infer runs text models; drop the keyword"),
}


# (priority, a SamplingParams field too, is also generate's own keyword, as vLLM's)
_SAMPLING_FIELDS = frozenset([*(f.name for f in dataclass_fields(SamplingParams)), "max_tokens"]) - {"priority"}


def _check_chat_keywords(kwargs: dict) -> None:
    """vLLM's LLM.chat keywords at the values infer's chat has: chat_template_content_format "auto" (infer reads a
    content's parts as vLLM's auto does) and mm_processor_kwargs None (text only). They were a bare TypeError."""
    fmt = kwargs.pop("chat_template_content_format", "auto")
    if fmt != "auto":
        raise RequestError(f"chat_template_content_format={fmt!r} is not supported: infer reads a content's parts as "
                           "vLLM's 'auto' does (joined for a template that expects text, kept for one that loops "
                           "over them)", "leave it out, or pass 'auto'")
    if kwargs.pop("mm_processor_kwargs", None) is not None:
        raise RequestError("mm_processor_kwargs is not supported: infer runs text models", "leave it out")


def _slots_within_cpu(options: dict) -> dict:
    """max_cpu_loras=N without max_loras: the default slots (4) no more than N, as the commands read --max-cpu-loras
    given alone (and as vLLM's default max_loras, 1, never exceeds it); it was refused as below max_loras 4."""
    cpu = options.get("max_cpu_loras")
    if "max_loras" in options or not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < 1:
        return options
    default = next(f.default for f in dataclass_fields(EngineConfig) if f.name == "max_loras")
    return {**options, "max_loras": min(default, cpu)}


def _vllm_keywords(method):
    """vLLM's keywords for generate / chat / stream: `sampling_params` is taken for params (both given: refused),
    `use_tqdm` is taken and ignored (infer shows no progress bar), and `lora_request` (vLLM's LoRARequest, or a list
    of one per prompt) registers each adapter on first use and runs it by its name (LLM._lora_of); `priority` (one
    int per prompt, or one for all) is checked here (_check_priority) and handed on. They were Python's bare
    TypeError. A tuple of params or of adapter names is a list of them, as vLLM reads a sequence (it was refused,
    or taken as one adapter name)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if "sampling_params" in kwargs:
            if "params" in kwargs or len(args) >= 2:
                raise RequestError(f"{method.__name__}() got both params and sampling_params",
                                   "they are the same argument (sampling_params is vLLM's name for it): give one")
            kwargs["params"] = kwargs.pop("sampling_params")
        kwargs.pop("use_tqdm", None)
        kwargs["priority"] = _check_priority(kwargs.pop("priority", None), method.__name__)
        if method.__name__ == "chat":
            _check_chat_keywords(kwargs)
        args = list(args)
        for at, name in ((1, "params"), (2, "lora")):  # vLLM takes any sequence of them, one per prompt: a tuple too
            if len(args) > at and isinstance(args[at], tuple):
                args[at] = list(args[at])
            elif isinstance(kwargs.get(name), tuple):
                kwargs[name] = list(kwargs[name])
        sampling = sorted(k for k in kwargs if k in _SAMPLING_FIELDS)
        if sampling:  # transformers' generate(prompt, max_new_tokens=32): a bare TypeError named no way out
            given = ", ".join(f"{k}={kwargs[k]!r}" for k in sampling)
            raise UnknownOptionError(f"{method.__name__}() has no keyword {sampling[0]!r}: sampling options go in a "
                                     "SamplingParams", f"llm.{method.__name__}(prompts, SamplingParams({given}))")
        if kwargs.get("lora_request") is not None:  # vLLM's way to name adapters: registered on first use
            if kwargs.get("lora") is not None or len(args) > 2:
                raise RequestError(f"{method.__name__}() got both lora and lora_request", "give one: lora=NAME for a "
                                   "registered adapter, or vLLM's lora_request=LoRARequest(NAME, ID, PATH)")
            kwargs["lora"] = _LoRARequests(kwargs["lora_request"])  # registered by _submit once the call is checked
        kwargs.pop("lora_request", None)
        return method(self, *args, **kwargs)
    return call


def _not_pooling(call: str) -> RequestError:
    """The refusal of a pooling call (`call`: the method the user called) on an LLM that generates text."""
    return RequestError(EMBED_ONLY.replace("/v1/embeddings", call).replace("server", "LLM"),
                        'create it with LLM(MODEL, runner="pooling")')


def _per_text(value, name: str, count: int):
    """LLM.score's `value` given one per pair (a list) as one per text of an embedding model's pairs (each pair's two
    texts run as two prompts: a list of one per pair was refused as "2N prompts but N"); anything else as it is."""
    if not isinstance(value, (list, tuple)):
        return value
    if len(value) != count:
        raise RequestError(f"{count} pair(s) but {len(value)} {name}", f"give one {name} per pair, or one for all")
    return [v for v in value for _ in (0, 1)]


class _LoRARequests:
    """vLLM's lora_request as given (one LoRARequest, or a list of one or None per prompt), carried to LLM._submit,
    which registers its adapters only once the prompts, and the list's length, are known to be good."""

    def __init__(self, value):
        self.value = list(value) if isinstance(value, (list, tuple)) else value


def _check_priority(priority, name: str) -> int | list[int] | None:
    """vLLM's `priority` keyword: one int per prompt (a list), or one int for every prompt; None: 0 for all. The
    engine refuses a value other than 0 unless it schedules by priority (LLM(..., scheduling_policy="priority")).
    Returned as ints (a numpy integer too); the list's length is checked against the prompts by _submit."""
    def integer(p) -> bool:
        return isinstance(p, numbers.Integral) and not isinstance(p, bool)
    if priority is None or integer(priority):
        return None if priority is None else int(priority)
    if isinstance(priority, (list, tuple)) and all(map(integer, priority)):
        return [int(p) for p in priority]
    raise RequestError(f"{name}() got priority={priority!r}: it must be an integer per prompt (a list), or one "
                       "for every prompt"[:300], "e.g. priority=[0, 1] (lower runs first under "
                       'scheduling_policy="priority")')


class LLM:
    """Example: `LLM("tiny-llama").generate(["Hello"], SamplingParams(max_new_tokens=16))[0].text`."""

    def __init__(self, model: str, **engine_options):
        engine_options = _check_options(engine_options)
        self.engine = LLMEngine(EngineConfig(model=model, **_slots_within_cpu(engine_options)))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0
        # one engine step (or add/abort) at a time: the engine's own lock, which its pause_generation(),
        # resume_generation(), sleep() and wake_up() hold, so another thread's llm.llm_engine.pause_generation()
        # waits for the step running and no step starts while it runs
        self._lock = self.engine.lock
        self._mail: dict[str, list[RequestOutput]] = {}  # request id -> outputs its call has not taken yet
        self._failed: set[str] = set()  # requests ended by a failed step (their later abort output is dropped)
        self._stepping = False  # inside an engine step (this thread holds the lock): _forget waits for its end
        self._deferred: list[str] = []  # requests to forget once the step is over
        self._texts: dict[str, str] = {}  # request id -> its prompt's text, when given as text (RequestOutput.prompt)
        self._searching = threading.local()  # .running: this thread's generate is a beam search's later step

    def close(self) -> None:
        """Free the engine's device memory (KV cache, CUDA graphs, weights) now rather than at garbage collection;
        `with LLM(...) as llm:` does it on leaving the block."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        with engine.turn():  # (before another thread's next step; a control of another thread waits for its end)
            if self.engine is engine:
                self.engine = None
                engine.close()

    def apply_model(self, func) -> list:
        """vLLM's LLM.apply_model: `func(model)` on every worker's model, their results in a list; infer runs the
        model in this process, so the list holds the one result (the torch module; between two engine steps)."""
        if not callable(func):
            raise RequestError(f"apply_model takes a function of the model, got {type(func).__name__}",
                               "e.g. llm.apply_model(lambda model: type(model).__name__)")
        with self._engine().turn():  # (between two steps of another thread's generate)
            return [func(self._engine().runner.model)]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's LLM.get_default_sampling_params: the sampling the model's generation_config.json asks for
        (temperature, top_p, top_k, min_p, repetition_penalty, and its max_new_tokens as max_tokens), the others at
        vLLM's defaults, temperature 1 included, as the server's requests get them (generate's own default,
        SamplingParams(), stays greedy)."""
        from .inputs import MAX_TOKENS_CAP, openai_sampling_defaults
        defaults = openai_sampling_defaults(self._engine().model_path)
        cap = defaults.pop(MAX_TOKENS_CAP, None)
        return SamplingParams(**defaults, **({} if cap is None else {"max_tokens": cap}))

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's LLM.get_tokenizer; also `llm.tokenizer`)."""
        return self.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's `LLM.llm_engine`: the LLMEngine this LLM drives (also `llm.engine`); ClosedError once closed."""
        return self._engine()

    def _engine(self):
        if self.engine is None:
            raise ClosedError("this LLM was closed (LLM.close())", "create a new LLM to generate again")
        return self.engine

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    # ------------------------------------------------------------------ adapters while running
    def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Load the PEFT adapter folder `path` under `name` (validated against the base first); later calls may
        pass `lora=name`. Needs an LLM made with `enable_lora=True` or with `loras=`. The folder is read without
        holding up other threads' steps. `replace=True` (vLLM's load_inplace): `name` may be loaded already; the
        requests added from now on get the new weights, those added before finish with the old ones."""
        adapter = self._engine().lora_slots().load(name, path)
        with self._engine().turn():
            self._engine().add_lora(name, path, loaded=adapter, replace=replace)

    def _lora_of(self, request):
        """The adapter name(s) of vLLM's lora_request (one LoRARequest, or a list with one or None per prompt),
        each folder registered under its lora_name on first use; a name registered from another folder is refused."""
        if isinstance(request, (list, tuple)):
            return [None if r is None else self._lora_of(r) for r in request]
        from ..lora.request import to_register
        name, path = to_register(request, self._engine().lora_slots)  # (LoRAError naming enable_lora: no slots)
        if path is not None:
            self.add_lora(name, path)
        with self._lock:  # (RequestOutput.lora_request: this object)
            self._engine().note_lora_request(name, request)
        return name

    def remove_lora(self, name: str) -> int:
        """Refuse `name` from now on; requests already running with it finish with it, and its memory is freed
        after them. Returns how many requests still use it."""
        with self._engine().turn():
            return self._engine().remove_lora(name)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's LLM.sleep (sleep mode: LLM(..., enable_sleep_mode=True)): give the engine's device memory back
        without closing it. Level 1 copies the weights to host memory and frees them and the KV cache on the device
        (wake_up() runs the same model again); level 2 frees both and keeps no copy (for new weights: wake_up(
        ["weights"]), collective_rpc("reload_weights"), wake_up(["kv_cache"])). The prefix cache is forgotten. A
        request still running (another thread's generate) ends with finish_reason "abort" (`mode` "abort", vLLM's
        default), runs to its end before the memory is freed ("wait"), or is paused and goes on after wake_up()
        ("keep"; LLMEngine.sleep); generate refuses new ones (SleepModeError) until wake_up()."""
        self._engine().sleep(level, mode)  # (under the engine's lock: a control)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up: the memory of `tags` ("weights", "kv_cache"; None: both) on the device again; generate
        runs once both are awake (after level 2, once the weights were loaded again)."""
        self._engine().wake_up(tags)  # (under the engine's lock: a control)

    def is_sleeping(self) -> bool:
        """vLLM's: whether sleep() freed memory that wake_up() has not given back yet."""
        return self._engine().is_sleeping()

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) \
            -> list:
        """vLLM's LLM.collective_rpc: `method` (a worker method's name, e.g. "reload_weights", or a function called
        with the worker: `worker.model_runner.model` is the model) on every worker, their results in a list; infer
        runs the model in this process, one worker, so the list holds one result (between two engine steps)."""
        return self._engine().collective_rpc(method, timeout, args, kwargs)  # (under the engine's lock: a control)

    def reset_prefix_cache(self) -> bool:
        """vLLM's LLM.reset_prefix_cache: forget every cached prefix (LLMEngine.reset_prefix_cache)."""
        return self._engine().reset_prefix_cache()  # (under the engine's lock: a control)

    def list_loras(self) -> list[str]:
        """The adapters requests may name, in the order they were added."""
        manager = self._engine().lora_manager
        return manager.names() if manager is not None else []

    def _encode(self, prompt: Prompt, i: int, truncated: bool = False, template: dict | None = None) -> list[int]:
        # a text certainly longer than the context is refused untokenized, unless the request keeps only its end
        most = None if truncated else self._engine().max_model_len
        ids = False
        if _is_prompt_dict(prompt):  # vLLM's {"prompt": text} or {"prompt_token_ids": ids}
            prompt, ids = _dict_prompt(prompt, i)
        if isinstance(prompt, str) and not ids:
            return encode_prompt(self.tokenizer, prompt=prompt, max_tokens=most)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt) and not ids:
            return encode_prompt(self.tokenizer, messages=list(prompt), max_tokens=most, template=template)
        if _is_array(prompt):  # a numpy array or torch tensor of token ids
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            ids = [_token_id(t) for t in prompt]  # numpy ints and 0-d tensors (list(array)) are token ids too
            if all(t is not None for t in ids):
                return ids
        if isinstance(prompt, dict):
            raise _bad_dict(prompt, f"prompt {i}")
        what = ("a list whose items are not all token ids (ints) nor all chat messages (dicts)"
                if isinstance(prompt, (list, tuple))
                else f"of type {type(prompt).__name__}, not text, token ids or chat messages")
        raise RequestError(f"prompt {i} is {what}",
                           "give text, a list of token ids, or a list of chat messages (dicts)")

    def _submit(self, prompts, params, lora, template: dict | None = None, priority=None) -> list[str]:
        """Queue every prompt, or none: a bad one raises with the ones before it taken back out of the engine.
        `template`: apply_chat_template's options for the chat prompts (LLM.chat). A prompt whose params have n > 1
        becomes n requests, one after another in the ids returned (SamplingParams.sample(j)). `priority`: an int
        for every prompt, or a list of one per prompt (each of a prompt's n samples has its priority). The next step
        of a beam search already running (this thread's, _beam_steps) is not refused while paused: it waits."""
        self._engine()
        if _is_array(prompts):  # token ids as a numpy array or torch tensor: 1-D is one prompt, 2-D a batch
            prompts = prompts.tolist()
        elif not isinstance(prompts, (str, list, tuple, dict, *_BYTES)) and hasattr(prompts, "__iter__"):
            prompts = list(prompts)  # a generator or another iterable of prompts (bytes iterate as ints: refused)
        if (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], dict)
                and not {"role", "content"} & prompts[0].keys() and not _is_prompt_dict(prompts[0])):
            # [{"text": ...}] (a dataset's rows) is no chat either: say what the dict is, not that messages need roles
            raise _bad_dict(prompts[0], "prompt 0")
        if isinstance(prompts, str) or _is_prompt_dict(prompts) or (
                prompts and isinstance(prompts, (list, tuple)) and not _is_prompt_dict(prompts[0])
                and (isinstance(prompts[0], dict) or _token_id(prompts[0]) is not None)):
            prompts = [prompts]
        if isinstance(prompts, dict):
            raise _bad_dict(prompts, "the prompt")
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a string, a list of token ids, chat messages, or a list of those; "
                               f"got {type(prompts).__name__}",
                               "decode bytes to text first" if isinstance(prompts, _BYTES) else None)
        n = len(prompts)
        requested = isinstance(lora, _LoRARequests)
        lora = lora.value if requested else lora
        params_list = list(params) if isinstance(params, list) else [params or SamplingParams()] * n
        loras = lora if isinstance(lora, list) else [lora] * n
        priorities = priority if isinstance(priority, list) else [priority or 0] * n
        for what, items in (("SamplingParams", params_list), ("lora", loras), ("priority", priorities)):
            if len(items) != n:
                raise RequestError(f"{n} prompts but {len(items)} {what}", f"give one {what} per prompt, or one "
                                                                          "for all")
        if not all(isinstance(sp, (SamplingParams, PoolingParams)) for sp in params_list):
            raise RequestError("params must be a SamplingParams or a list of them", "e.g. SamplingParams("
                                                                                     "max_new_tokens=32)")
        for i, lo in enumerate(loras):
            if lo is not None and not isinstance(lo, (str, LoRAHold)) and not requested:  # (a hold: beam_search)
                which = _of(i, n) if isinstance(lora, list) else ""
                raise RequestError(f"lora{which} must be an adapter name (a string) or None, got {lo!r}",
                                   "give one name for all prompts, or a list with one name (or None) per prompt")
        encoded = []
        for i, p in enumerate(prompts):
            try:  # a priority out of range is refused naming its prompt, as the engine's refusals are
                params_list[i] = replace(params_list[i], priority=priorities[i]) if priorities[i] else params_list[i]
                params_list[i] = salted_params(p, params_list[i])  # vLLM's {"prompt...": ..., "cache_salt": ...}
                encoded.append(self._encode(p, i, params_list[i].truncate_prompt_tokens is not None, template))
            except RequestError as e:
                if n > 1 and not e.message.startswith(f"prompt {i} "):  # which of the prompts it is
                    raise e.reworded(f"prompt {i}: {e.message}") from None
                raise
        if requested:  # vLLM's LoRARequests: registered now that the call is checked (a refused one registers none)
            loras = [None if lo is None else self._lora_of(lo) for lo in loras]
        requests = [(i, p, sp.sample(j) if sp.n > 1 else sp, lo)
                    for i, (p, sp, lo) in enumerate(zip(encoded, params_list, loras)) for j in range(sp.n)]
        ids: list[str] = []
        with self._lock:
            _check_unpaused(self._engine(), getattr(self._searching, "running", False))
            try:
                for i, p, sp, lo in requests:
                    self._counter += 1
                    rid = f"llm-{self._counter}"
                    try:
                        self._engine().add_request(rid, p, sp, lo)
                    except RequestError as e:
                        if n > 1:  # which of the prompts it is
                            raise e.reworded(f"prompt {i}: {e.message}") from None  # (its class kept)
                        raise
                    ids.append(rid)
                    self._mail[rid] = []
                    if _prompt_text(prompts[i]) is not None:
                        self._texts[rid] = _prompt_text(prompts[i])
            except BaseException:
                self._forget(ids)
                raise
        return ids

    def _forget(self, ids) -> None:
        """Stop these requests if still running (their KV blocks are freed) and drop their mailboxes."""
        with self._lock:
            if self._stepping:  # a stream collected by the GC in the middle of a step (the lock is reentrant):
                self._deferred.extend(ids)  # aborting now would change the batch the step is running
                return
            for rid in ids:
                self._texts.pop(rid, None)
                if self._mail.pop(rid, None) is not None and self.engine is not None:
                    self.engine.abort_request(rid)

    def _pump(self, ids) -> list[RequestOutput]:
        """The next outputs of these requests: those another call's steps left in their mailboxes, else one step."""
        while True:
            self._engine().yield_to_controls()  # (another thread's pause, sleep... first: it waits for this step)
            with self._lock:
                got = [out for rid in ids for out in self._mail.get(rid, [])]
                if got:
                    for out in got:  # vLLM's RequestOutput.prompt: the text, when the prompt was given as text
                        out.prompt = self._texts.get(out.request_id)
                    for rid in ids:
                        if rid in self._mail:
                            self._mail[rid] = []
                    return got
                engine = self._engine()
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine has no work left but requests {ids} did not finish")
                paused = engine.stalled()  # (sleep(mode="keep"), paused): they go on once another thread wakes it
                outs = [] if paused else self._step(engine)
                with interrupts_held():  # a Ctrl-C here would lose other calls' outputs of the step
                    for out in outs:
                        if out.request_id in self._mail:  # others are outputs of requests their call gave up
                            self._mail[out.request_id].append(out)
            if paused:  # (outside the lock: the thread that wakes the engine takes it)
                time.sleep(0.01)

    def _step(self, engine) -> list[RequestOutput]:
        """One engine step. When it raises, the requests it was running are not trusted: they end with
        finish_reason "error" and the error named (as in `infer run` and the server); the others go on."""
        try:
            self._stepping = True
            outputs = engine.step()
        except Exception as e:
            message = f"internal engine error: {type(e).__name__}: {e}"
            victims = [s.request_id for s in engine.scheduler.running] or list(engine.requests)
            outputs = []
            for rid in victims:
                seq = engine.requests.get(rid)
                engine.abort_request(rid)
                self._failed.add(rid)  # its abort output, handed out by a later step, is dropped
                # the prompt, the tokens and the times the request had before the failed step stay in its output
                outputs.append(RequestOutput.failed(rid, seq, message))
            return outputs
        finally:
            self._stepping = False
            deferred, self._deferred = self._deferred, []
            self._forget(deferred)
        dropped = {out.request_id for out in outputs} & self._failed
        self._failed -= dropped
        return [out for out in outputs if out.request_id not in dropped]

    @_vllm_keywords
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 lora: str | list[str | None] | None = None, *, priority: int | list[int] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion (batched together); outputs in the order of the prompts. With
        SamplingParams.n > 1 a prompt's output holds its n samples in `outputs` (as vLLM's). `priority` (vLLM's):
        one int per prompt, or one for all; lower runs first with LLM(..., scheduling_policy="priority")."""
        return self._samples(self._run(self._submit(prompts, params, lora, priority=priority)), params)

    def embed(self, prompts: Prompt | Seq[Prompt], pooling_params: PoolingParams | list[PoolingParams] | None = None,
              *, lora_request=None, lora: str | list[str | None] | None = None, use_tqdm=True,
              truncate_prompt_tokens: int | None = None, priority: int | list[int] | None = None) -> list:
        """vLLM's LLM.embed on an LLM(..., runner="pooling"): one EmbeddingRequestOutput per prompt, in order, its
        vector in `.outputs.embedding`. `pooling_params` (one, or one per prompt): dimensions, normalize,
        truncate_prompt_tokens; `lora_request` (vLLM's LoRARequest, or one per prompt) or `lora` (a registered
        adapter's name) runs the prompts with that adapter."""
        return self._pool("embed", prompts, pooling_params, lora_request, lora, truncate_prompt_tokens, priority)

    def classify(self, prompts: Prompt | Seq[Prompt],
                 pooling_params: PoolingParams | list[PoolingParams] | None = None, *, lora_request=None,
                 lora: str | list[str | None] | None = None, use_tqdm=True, truncate_prompt_tokens: int | None = None,
                 priority: int | list[int] | None = None) -> list:
        """vLLM's LLM.classify on a *ForSequenceClassification model: one ClassificationRequestOutput per prompt, in
        order, its class probabilities in `.outputs.probs` (PoolingParams(use_activation=False): the logits)."""
        return self._pool("classify", prompts, pooling_params, lora_request, lora, truncate_prompt_tokens, priority)

    def encode(self, prompts: Prompt | Seq[Prompt],
               pooling_params: PoolingParams | list[PoolingParams] | None = None, *, pooling_task: str | None = None,
               lora_request=None, lora: str | list[str | None] | None = None, use_tqdm=True,
               truncate_prompt_tokens: int | None = None, priority: int | list[int] | None = None) -> list:
        """vLLM's LLM.encode: one output per prompt, in order, its tensor in `.outputs.data`. `pooling_task` (vLLM's):
        embed or classify (a vector a prompt, as LLM.embed / LLM.classify), token_embed (an embedding model's
        hidden state of every prompt token, each normalized as its pooler normalizes) or token_classify (a
        classifier's class distribution of every prompt token: [prompt tokens, labels]); None: the model's own."""
        from .pooling import TASKS
        if pooling_task is not None and pooling_task not in TASKS:
            raise RequestError(f"pooling_task {pooling_task!r} is not one of {', '.join(TASKS)}"[:200],
                               "token_embed / token_classify: a row per prompt token; embed / classify: one vector")
        pooler = self._engine().pooler
        given = [p.task for p in (pooling_params if isinstance(pooling_params, (list, tuple)) else [pooling_params])
                 if isinstance(p, PoolingParams) and p.task is not None]  # (the params' own task, as vLLM reads it)
        task = pooling_task or (given[0] if given else pooler.task if pooler is not None else "embed")
        return self._pool(task, prompts, pooling_params, lora_request, lora, truncate_prompt_tokens, priority,
                          method="LLM.encode")

    def score(self, data_1, data_2, /, *, truncate_prompt_tokens: int | None = None, use_tqdm=True,
              pooling_params: PoolingParams | None = None, lora_request=None,
              lora: str | None = None, priority: int | None = None) -> list:
        """vLLM's LLM.score: one ScoringRequestOutput per pair (`data_1` one text against each of `data_2`, or as
        many texts as `data_2`, pairwise), its score in `.outputs.score`: a cross-encoder's (a classifier of one
        label) relevance of the pair joined by its tokenizer, or an embedding model's cosine similarity.
        `pooling_params`, `lora_request`, `lora` and `priority` may each be a list, one per pair."""
        from .classify import (ScoringRequestOutput, check_cross_encoder, check_texts, cosine, pair_ids, pair_labels,
                               score_pairs)
        engine = self._engine()
        if engine.pooler is None:  # (before the texts are read: LLM.score's refusal, not LLM.embed's)
            raise _not_pooling("LLM.score")
        if engine.pooler.task not in ("embed", "classify"):
            raise RequestError(f"this model does {engine.pooler.task} only (a *ForTokenClassification model): it "
                               "scores no pairs", "score with a cross-encoder or an embedding model; "
                               "LLM.encode(..., pooling_task=\"token_classify\") classifies each token")
        data_1, data_2 = _score_data(data_1, "data_1"), _score_data(data_2, "data_2")
        crossed = engine.pooler.task == "classify"
        pairs = score_pairs(data_1, data_2, "data_1", "data_2", empty=crossed)
        check_texts(zip((n for pair in pair_labels(data_1, data_2, "data_1", "data_2") for n in pair),
                        (t for pair in pairs for t in pair)), engine.model_config.vocab_size)
        if crossed:
            check_cross_encoder(engine.pooler)
            if truncate_prompt_tokens is None and isinstance(pooling_params, PoolingParams):  # (the pair cut by it)
                truncate_prompt_tokens = pooling_params.truncate_prompt_tokens
            PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens).checked()  # (checked before a pair is cut)
            prompts = [pair_ids(engine.tokenizer, a, b, engine.max_model_len, truncate_prompt_tokens,
                                engine.pooler.joins_pair_text) for a, b in pairs]
            outs = self._pool("classify", prompts, pooling_params, lora_request, lora, truncate_prompt_tokens,
                                priority)
            return [ScoringRequestOutput(o.request_id, o.outputs.probs[0], o.prompt_token_ids) for o in outs]
        twice = functools.partial(_per_text, count=len(pairs))  # (a list of one per pair: one per text, as a pair's)
        outs = self._pool("embed", [t for pair in pairs for t in pair], twice(pooling_params, "pooling_params"),
                          twice(lora_request, "lora_request"), twice(lora, "lora"), truncate_prompt_tokens,
                          twice(priority, "priority"))
        return [ScoringRequestOutput(a.request_id, cosine(a.outputs.data, b.outputs.data),
                                     a.prompt_token_ids + b.prompt_token_ids) for a, b in zip(outs[::2], outs[1::2])]

    def _pool(self, task: str, prompts, pooling_params, lora_request, lora, truncate_prompt_tokens, priority,
              method: str | None = None):
        """The outputs of embed (task "embed") or classify: the engine's pooler must do that task. `method`: the
        public method the user called, named in a refusal (LLM.encode of task embed is no call of LLM.embed)."""
        pooler = self._engine().pooler
        if pooler is None:
            raise _not_pooling(method or (f"LLM.{task}" if task in ("embed", "classify") else "LLM.encode"))
        if task not in pooler.tasks:
            from .pooling import task_refusal
            raise task_refusal(task, pooler)
        params = pooling_params if pooling_params is not None else PoolingParams()
        if isinstance(params, tuple):
            params = list(params)
        other = next((p.task for p in (params if isinstance(params, list) else [params])
                      if isinstance(p, PoolingParams) and p.task not in (None, task)), None)
        if other is not None:  # (vLLM's PoolingParams.verify: "You cannot overwrite")
            call = f"LLM.{task}()" if task in ("embed", "classify") else f"LLM.encode(pooling_task={task!r})"
            raise RequestError(f"pooling_params.task {other!r} differs from the task of {call}: one task a call",
                               f"leave the params' task out, or ask for {other!r} (LLM.encode(..., "
                               f"pooling_task={other!r}))")
        # the prompts' params with the task asked (and vLLM's truncate_prompt_tokens keyword)
        cut = {} if truncate_prompt_tokens is None else {"truncate_prompt_tokens": truncate_prompt_tokens}
        params = [replace(p, task=task, **cut) if isinstance(p, PoolingParams) else p
                  for p in (params if isinstance(params, list) else [params])]
        params = params if isinstance(pooling_params, (list, tuple)) else params[0]
        if lora_request is not None:
            if lora is not None:
                raise RequestError(f"{task}() got both lora and lora_request", "give one")
            lora = _LoRARequests(list(lora_request) if isinstance(lora_request, tuple) else lora_request)
        return embedded(self._run(self._submit(prompts, params, lora, priority=_check_priority(priority, task))))

    @staticmethod
    def _sizes(params, count: int) -> list[int]:
        """How many of `count` fanned-out requests (_submit) each prompt has: its params' n."""
        if isinstance(params, list):
            return [sp.n for sp in params]
        k = params.n if params is not None else 1
        return [k] * (count // k)

    @classmethod
    def _samples(cls, outs: list[RequestOutput], params) -> list[RequestOutput]:
        """The fanned-out requests' outputs (_submit) back as one output per prompt."""
        sizes = cls._sizes(params, len(outs))
        if all(k == 1 for k in sizes):
            return outs
        merged, at = [], 0
        for k in sizes:
            merged.append(outs[at] if k == 1 else RequestOutput.merged(outs[at:at + k]))
            at += k
        return merged

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done = {}
        try:
            while len(done) < len(ids):
                for out in self._pump([i for i in ids if i not in done]):
                    if out.finished:
                        done[out.request_id] = out
        finally:  # Ctrl-C or an engine error: leave no request of this call running
            self._forget(ids)
        return [done[i] for i in ids]

    def beam_search(self, prompts, params: "BeamSearchParams", lora: str | list[str | None] | None = None, *,
                    lora_request=None, use_tqdm: bool = False, concurrency_limit: int | None = None
                    ) -> list["BeamSearchOutput"]:
        """vLLM's LLM.beam_search: each prompt's `params.beam_width` best beams of up to `params.max_tokens` tokens
        (engine/beam.py), best first, as BeamSearchOutput(sequences=[BeamSearchSequence(tokens, text, cum_logprob,
        logprobs, ...)]). Prompts: text, token ids or vLLM's prompt dicts (not chat messages); `lora`: one adapter
        for all, or one per prompt; vLLM's `lora_request` (its third argument: a LoRARequest, or a list with one or
        None per prompt) registers each adapter on first use, as generate's does. vLLM's `concurrency_limit`: the
        prompts are searched that many at a time (the beams of a prompt do not depend on the others)."""
        from .beam import BeamSearchParams, beam_search
        if not isinstance(params, BeamSearchParams):
            raise RequestError(f"beam_search takes a BeamSearchParams, got {type(params).__name__}",
                               "e.g. BeamSearchParams(beam_width=4, max_tokens=32)")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(
                concurrency_limit, numbers.Integral) or concurrency_limit < 1):
            raise RequestError(f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}"[:200])
        if lora_request is not None:
            if lora is not None:
                raise RequestError("beam_search() got both lora and lora_request", "give one")
            lora = lora_request
        if isinstance(prompts, str) or _is_prompt_dict(prompts) or (
                isinstance(prompts, (list, tuple)) and prompts and _token_id(prompts[0]) is not None):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a prompt or a list of them, got {type(prompts).__name__}")
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(loras)} lora", "give one lora per prompt, or one "
                                                                                "for all")
        encoded = []
        for i, p in enumerate(prompts):
            if isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p):
                raise RequestError(f"prompt {i} is chat messages: beam_search takes text or token ids",
                                   "render the chat first: llm.get_tokenizer().apply_chat_template(messages, "
                                   "add_generation_prompt=True)")
            encoded.append(self._encode(p, i))
        # vLLM's third argument is lora_request: LoRARequests read by name, registered once the call is checked
        loras = [x if x is None or isinstance(x, str) else self._lora_of(x) for x in loras]
        salts = [p.get("cache_salt") if _is_prompt_dict(p) else None for p in prompts]  # (generate checks them)
        engine = self._engine()
        chunk = int(concurrency_limit or len(encoded) or 1)
        outputs = []
        with self._lock:  # its steps are requests added one after another: each adapter is held from the first to the
            manager = engine.lora_manager  # last, so a remove_lora or an in-place add_lora meanwhile leaves it to them
            holds = {lo: engine.hold_lora(lo) for lo in set(loras) if lo is not None and manager and manager.has(lo)}
        held = [holds.get(lo, lo) for lo in loras]
        try:
            for at in range(0, len(encoded), chunk):
                outputs += beam_search(self._beam_steps(engine), self.tokenizer,
                                       set(engine.eos_token_ids), encoded[at:at + chunk], params, held[at:at + chunk],
                                       engine.max_model_len, salts[at:at + chunk])
        finally:
            with self._lock:
                for hold in holds.values():
                    engine.release_lora(hold)
        return outputs

    def _beam_steps(self, engine):
        """beam_search's generate: its first step refused while paused (PauseError, as a generate), the later ones
        not: another thread's pause_generation() with mode "keep" or "wait" holds them until its
        resume_generation(), and the search goes on; one with mode "abort" ends it (PauseError)."""
        began = [engine.abort_pauses, False]

        def step(ids, params, loras):
            if engine.abort_pauses != began[0]:  # (between two steps: their requests are not in the engine)
                raise _aborted_search()
            self._searching.running = began[1]
            try:
                outs = self.generate(ids, params, loras)
            finally:
                self._searching.running = False
            began[1] = True
            if any(o.finish_reason == "abort" and o.error == PAUSED for o in outs):
                raise _aborted_search()
            return outs
        return step

    @_vllm_keywords
    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None,
             lora: str | list[str | None] | None = None, *, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             documents: list[dict] | None = None, tools: list[dict] | None = None,
             chat_template: str | None = None, priority: int | list[int] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, rendered by
        the model's chat template with these options (chat_template_kwargs: the template's own variables, e.g.
        Qwen3's enable_thinking; tools: OpenAI's function definitions, for a template that renders them), then run
        as generate() runs prompts. `chat_template`: this call's template instead of the model's (the one of
        `LLM(model, chat_template=...)`, else the tokenizer's): a Jinja file, or the template text itself."""
        if isinstance(messages, (list, tuple)) and not messages:  # no conversation: none to run, as generate([])
            self._engine()  # (and vLLM's chat([]), a list of no conversations)
            return []
        convs = [messages] if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict) \
            else messages
        if not isinstance(convs, (list, tuple)) or not convs or not all(
                isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c) for c in convs):
            raise RequestError("chat() takes a conversation (a list of message dicts) or a list of conversations",
                               'e.g. llm.chat([{"role": "user", "content": "Hi"}])')
        template = chat_template_options(dict(chat_template_kwargs=chat_template_kwargs, documents=documents,
                                              add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message))
        if chat_template is not None:
            template["chat_template"] = load_chat_template(chat_template, "chat_template", RequestError)
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
                raise RequestError("tools must be a list of function definitions (dicts)",
                                   'e.g. [{"type": "function", "function": {"name": "f", "parameters": {...}}}]')
            template["tools"] = list(tools)
        return self._samples(self._run(self._submit(list(convs), params, lora, template, priority)), params)

    @_vllm_keywords
    def stream(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
               lora: str | list[str | None] | None = None, *, priority: int | list[int] | None = None
               ) -> Iterator[tuple[int, str, RequestOutput]]:
        """Yield (prompt index, text delta, output) as tokens arrive; the last event of a prompt has finished set.
        The prompts are checked and queued at this call (a bad one raises here, not at the first next()).
        With SamplingParams.n > 1 each of a prompt's n samples streams on its own, as vLLM's streamed outputs
        carry the sample that changed: `output.outputs[0].index` says which (j < n), and each sample's last event
        has finished set. vLLM's SamplingParams.output_kind: DELTA, each output's `outputs[0]` holds only what is
        new (as AsyncLLM's); FINAL_ONLY, a sample's finished output alone, its whole text as the event's text."""
        ids = self._submit(prompts, params, lora, priority=priority)
        sizes = self._sizes(params, len(ids))
        kinds = [sp.output_kind for sp in params] if isinstance(params, list) else \
            [(params or SamplingParams()).output_kind] * len(sizes)
        events = self._events(ids, sizes, kinds)
        weakref.finalize(events, self._forget, ids)  # dropped without being read to the end: free its requests
        return events

    def _events(self, ids: list[str], sizes: list[int], kinds: list[RequestOutputKind]
                ) -> Iterator[tuple[int, str, RequestOutput]]:
        which = [(i, j, k) for i, k in enumerate(sizes) for j in range(k)]  # request -> (prompt, sample, n)
        index = dict(zip(ids, which))
        sent = {rid: [0, 0, 0, 0.0, False] for rid in ids}  # (DELTA: as_delta)
        left = list(ids)
        try:
            while left:
                for out in self._pump(left):
                    if out.finished:
                        left.remove(out.request_id)
                    i, j, k = index[out.request_id]
                    if kinds[i] == RequestOutputKind.FINAL_ONLY:
                        if out.finished:
                            if k > 1:
                                out._samples = [CompletionOutput.of(out, j)]
                            yield i, out.text, out  # (nothing of it was handed out before)
                        continue
                    if kinds[i] == RequestOutputKind.DELTA:
                        as_delta(out, sent[out.request_id], j)
                    elif k > 1:
                        out._samples = [CompletionOutput.of(out, j)]
                    yield i, out.delta_text, out
        finally:  # the caller stopped early: free what is still running
            self._forget(ids)


_BYTES = (bytes, bytearray, memoryview)  # iterate (and tolist()) as ints, but are encoded text, not token ids


def _is_array(x) -> bool:
    """A numpy array or torch tensor (anything with tolist() and a shape), not a list (nor bytes: a memoryview
    has tolist() and a shape too)."""
    return not isinstance(x, (list, tuple, str, dict, *_BYTES)) and hasattr(x, "tolist") and hasattr(x, "shape")


def _token_id(x) -> int | None:
    """x as a token id (an int, a numpy integer, or a 0-d integer array or tensor), or None if it is not one."""
    if _is_array(x) and tuple(x.shape) == ():
        x = x.tolist()
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    return None


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _is_prompt_dict(x) -> bool:
    """vLLM's TextPrompt {"prompt": text} or TokensPrompt {"prompt_token_ids": ids}, not a chat message (a role)."""
    return isinstance(x, dict) and "role" not in x and any(k in x for k in _PROMPT_KEYS)


def _bad_dict(prompt: dict, what: str) -> RequestError:
    """A dict that is neither vLLM's prompt dict nor inside a list of chat messages: one chat message not put in a
    list, or a dict of other keys ({"text": ...})."""
    if "role" in prompt:
        return RequestError(f"{what} is one chat message, not a list of them",
                            'give the chat as a list: [{"role": "user", "content": ...}]')
    return RequestError(f"{what} is a dict of {', '.join(map(repr, sorted(prompt, key=str))) or 'no keys'}, which is "
                        "no prompt", 'give text, or vLLM\'s {"prompt": text} or {"prompt_token_ids": [ids]}')


def _dict_prompt(prompt: dict, i: int | str) -> tuple[object, bool]:
    """(the text or token ids of a prompt dict, whether they are token ids); RequestError for keys infer does not
    take (vLLM's multi_modal_data... holding data: text_only) or both keys. `i`: the prompt's index (or its name)."""
    prompt = text_only(prompt)
    other = sorted(set(prompt) - set(_PROMPT_KEYS) - {"cache_salt"}, key=str)
    if other:
        raise RequestError(f"{_label(i)} has {', '.join(map(repr, other))}, which infer does not take",
                           'give {"prompt": text} or {"prompt_token_ids": [ids]} (and "cache_salt", as vLLM)')
    prompt = {k: v for k, v in prompt.items() if k != "cache_salt"}  # (_submit puts it in the prompt's params)
    if len(prompt) != 1:
        raise RequestError(f"{_label(i)} has both prompt and prompt_token_ids", "give one of them")
    key, value = next(iter(prompt.items()))
    if key == "prompt" and not isinstance(value, str):
        raise RequestError(f"{_label(i)}'s \"prompt\" must be text, got {type(value).__name__}",
                           'give token ids as {"prompt_token_ids": [ids]}')
    if key == "prompt_token_ids" and isinstance(value, (str, dict)):
        raise RequestError(f"{_label(i)}'s \"prompt_token_ids\" must be a list of token ids, got "
                           f"{type(value).__name__}",
                           'give text as {"prompt": text}')
    return value, key == "prompt_token_ids"


def _label(i: int | str) -> str:
    return f"prompt {i}" if isinstance(i, int) else i


def _score_data(value, name: str):
    """LLM.score's data_1 / data_2 with vLLM's prompt dicts ({"prompt": text}, {"prompt_token_ids": ids}, alone or
    in a list) read as their text or token ids (they were refused: "must be a text or a non-empty list of texts");
    a flat list of ints stays one text of token ids, as infer reads it (vLLM takes token ids only in a dict)."""
    if isinstance(value, dict):  # (another dict, {} or {"text": ...}: named as a dict, not "got dict")
        return _dict_prompt(value, name)[0] if _is_prompt_dict(value) else _raise(_bad_dict(value, name))
    if isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value):
        return [(_dict_prompt(v, f"{name}[{i}]")[0] if _is_prompt_dict(v) else _raise(_bad_dict(v, f"{name}[{i}]")))
                if isinstance(v, dict) else v for i, v in enumerate(value)]
    return value


def _raise(error: Exception):
    raise error


def _check_unpaused(engine, running: bool = False) -> None:
    """LLM calls refuse new requests while generation is paused (llm.llm_engine.pause_generation()): they would wait
    for a resume_generation() that a single-threaded program never makes (it hung). Asleep: the engine's refusal.
    A call already running when another thread pauses (under the engine's lock, between two steps) follows the
    pause's mode: "abort" ends its requests (finish_reason "abort"), "wait" lets them finish, "keep" freezes them
    and the call waits for that thread's resume_generation() (`running`: a beam search's next step, which waits
    likewise; a pause with mode "abort" ended the search: LLM._beam_step)."""
    engine.check_awake()
    if engine.is_paused() and not running:
        raise PauseError("generation is paused (llm.llm_engine.pause_generation()): a new request would wait for "
                         "resume_generation()", "resume it first: llm.llm_engine.resume_generation()")


def embedded(outs: list) -> list:
    """LLM.embed's finished outputs (AsyncLLM.encode's one), each an EmbeddingRequestOutput. Requests another
    thread's pause_generation(mode="abort") or sleep() ended have no vector: raised, naming how many (their
    RequestOutput of a generation in its place made the caller's `.outputs.embedding` an AttributeError)."""
    ended = [o for o in outs if not isinstance(o, EmbeddingRequestOutput)]
    if not ended:
        return outs
    why = ended[0].error or f"finish_reason {ended[0].finish_reason!r}"
    what = (f"{len(ended)} of the {len(outs)} embeddings" if len(outs) > 1 else "the embedding") + \
        f" ended without {'their vector' if len(outs) > 1 else 'its vector'}: {why}"
    if why == PAUSED:
        raise PauseError(what, "embed them again after resume_generation() (a pause with mode \"keep\" or \"wait\" "
                               "lets an embed go on)")
    if why == SLEPT:
        raise SleepModeError(what, "embed them again after wake_up() (sleep(mode=\"keep\") lets an embed go on "
                                   "after the wake_up)")
    raise RequestError(what)


def _aborted_search() -> PauseError:
    return PauseError("pause_generation(mode=\"abort\") ended the beam search", "run it again after "
                      "resume_generation() (mode \"keep\" or \"wait\" pauses a running beam search: it goes on "
                      "after the resume)")


def _prompt_text(prompt) -> str | None:
    """The text of a prompt given as text (a string, or vLLM's {"prompt": text}); None for token ids and chats."""
    if isinstance(prompt, str):
        return prompt
    return prompt["prompt"] if _is_prompt_dict(prompt) and isinstance(prompt.get("prompt"), str) else None


def _of(i: int, n: int) -> str:
    return f" of prompt {i}" if n > 1 else ""
