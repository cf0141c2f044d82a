"""LLMEngine: add requests, step, get outputs. One step = schedule -> run the model once -> sample -> update."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from .. import kernels
from ..errors import (ClosedError, ConfigError, LoRAError, LoRANameError, ModelLoadError, OutOfMemoryError,
                      PauseError, RequestError, RequestIdTypeError, SleepModeError, UnknownAdapterError)
from ..memory.sizes import kv_groups, kv_window, snapshot_count
from ..models.classifier import is_classifier
from ..models.limits import layer_groups
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import Detokenizer
from .inputs import _field_error, encode_prompt
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .classify import check_activation, not_generating, pooled_output, pooled_prompt
from .pooling import (EMBED_INSTEAD, NOT_GENERATING, NOT_POOLING, PoolingParams, every_token, finish_vector,
                      resolve_pooler, task_refusal)
from .sampler import NOT_FINITE
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .setup import context_limit, load_engine_parts, model_max_len
from .sleep import MODES, PAUSED, SLEPT, TAGS, WEIGHTS, SleepState, module_tensors, object_tensors
from .speculative import SpecStats, SpeculativeConfig, propose_for
from .state_cache import StateSlots, StateSnapshots, prefix_caching_for, refuse_hybrid_options
from .structured import DEAD_HINT, GrammarBackend, allows_any, draft_bitmask

log = logging.getLogger("infer")
_REPLAY_KEYS = ("cuda_graph_replays", "piecewise_graph_steps", "draft_cuda_graph_replays")  # stats() counters of graphs
# requests whose bad_words stay tokenized (their ids are shared, read-only, by every choice that bans them)
BAD_WORDS_CACHE = 16


@contextlib.contextmanager
def interrupts_held():
    """Hold a Ctrl-C (SIGINT) back until the block is done, then act on it (Python's handler raises
    KeyboardInterrupt there): the host's bookkeeping of a step (tokens appended, outputs handed to their calls) is
    done whole or not at all, so an interrupt cannot leave another call's request with a token counted but never
    appended, or its output lost. Only in the main thread, under a Python handler (SIG_IGN / SIG_DFL are left)."""
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(previous):
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        previous(signal.SIGINT, held[0])


def serialized(method):
    """`method` (step) run holding the engine's lock (LLMEngine.lock, which LLM's calls hold too)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return locked


def control(method):
    """`method` (pause_generation, resume_generation, sleep, wake_up...) run holding the engine's lock, whichever
    thread calls it: it waits for the step running to end, and no step starts while it runs (it changed the
    scheduler's queues under a step's feet). It runs before the next step of a loop that calls
    yield_to_controls() (LLM's: another thread's pause is not held up until its generate ends)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.turn():
            return method(self, *args, **kwargs)
    return locked


def checked_arrival(arrival_time) -> float | None:
    """add_request's arrival_time: None, or a time.monotonic() reading not after now. RequestError otherwise:
    vLLM's engine reads time.time(), whose epoch seconds here would make every queue time negative."""
    if arrival_time is None:
        return None
    now = time.monotonic()
    if isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real) \
            or not math.isfinite(arrival_time) or arrival_time > now:
        raise RequestError(f"arrival_time={arrival_time!r} is not a time.monotonic() reading up to now ({now:.3f})",
                           "pass time.monotonic() taken when the request arrived, or leave it out (now)")
    return float(arrival_time)


def request_inputs(prompt_token_ids, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
    """add_request's prompt as a list of int token ids (a tuple, a 1-D numpy array or tensor, numpy integers taken
    too, or vLLM's {"prompt_token_ids": ...}) and its params (None: the defaults); RequestError for text, bools,
    floats or params of another type, which reached the checks below as a bare TypeError or as a token id "outside
    the vocabulary"."""
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}",
                           "e.g. SamplingParams(max_new_tokens=32)")
    if isinstance(prompt_token_ids, dict):  # vLLM's TokensPrompt: {"prompt_token_ids": [...]}
        params = salted_params(prompt_token_ids, params)
        key, prompt_token_ids = prompt_dict(prompt_token_ids)
        if key == "prompt":
            prompt_token_ids = str(prompt_token_ids)
    if isinstance(prompt_token_ids, str):  # LLMEngine.add_request has tokenized text before: here ids were expected
        raise RequestError("the prompt's token ids are text (a str), not a list of token ids",
                           "give token ids as a list of ints; LLMEngine.add_request takes text as the prompt "
                           "itself or as {\"prompt\": text} (validate takes token ids only)")
    if not isinstance(prompt_token_ids, (list, tuple)) and hasattr(prompt_token_ids, "tolist"):
        prompt_token_ids = prompt_token_ids.tolist()  # a numpy array or a torch tensor
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise RequestError(f"the prompt must be a list of token ids, got {type(prompt_token_ids).__name__}")
    if all(type(t) is int for t in prompt_token_ids):  # the usual case, without an ABC isinstance a token or a copy
        return prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids), params
    prompt_token_ids = [t.item() if _scalar(t) else t for t in prompt_token_ids]  # list(tensor): 0-d tensors
    bad = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise RequestError(f"the prompt's token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})",
                           "give a list of ints")
    return [int(t) for t in prompt_token_ids], params


# vLLM's prompt-dict keys for images and audio: infer runs text models, so only their empty values (None, {} or [],
# which vLLM code passes for a text prompt, and which change nothing) are taken; they were refused as unknown keys
MULTI_MODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def text_only(prompt: dict) -> dict:
    """vLLM's prompt dict without its empty multi-modal keys; RequestError naming a key that holds data."""
    given = [k for k in MULTI_MODAL_KEYS if k in prompt and prompt[k] is not None and prompt[k] != {}
             and prompt[k] != []]
    if given:
        raise RequestError(f"the prompt has {given[0]!r}, which infer does not take: it runs text models (no "
                           "images, audio or video)",
                           f"leave {given[0]!r} out (or None), and give the prompt's text or token ids")
    return {k: v for k, v in prompt.items() if k not in MULTI_MODAL_KEYS}


def prompt_dict(prompt: dict) -> tuple[str, object]:
    """vLLM's TextPrompt {"prompt": text} or TokensPrompt {"prompt_token_ids": ids} as (its key, its value);
    RequestError for other keys (vLLM's multi_modal_data, mm_processor_kwargs... were dropped without a word: the
    request ran without them; their empty values are taken, text_only), both keys or neither."""
    prompt = text_only(prompt)
    other = sorted((k for k in prompt if k not in ("prompt", "prompt_token_ids", "cache_salt")), key=str)
    if other:
        raise RequestError(f"the prompt dict has {', '.join(map(repr, other))}, which infer does not take",
                           'give {"prompt": text} or {"prompt_token_ids": [ids]} (and "cache_salt", as vLLM)')
    prompt = {k: v for k, v in prompt.items() if k != "cache_salt"}  # salted_params reads it
    if len(prompt) != 1:
        raise RequestError("the prompt dict needs one of 'prompt' (text) or 'prompt_token_ids'"
                           + (", not both" if prompt else ""), 'give {"prompt": text} or {"prompt_token_ids": [ids]}')
    key, value = next(iter(prompt.items()))
    if key == "prompt" and not isinstance(value, str):
        raise RequestError(f"the prompt dict's 'prompt' must be text, got {type(value).__name__}",
                           'give token ids as {"prompt_token_ids": [ids]}')
    return key, value


def salted_params(prompt, params: SamplingParams | None) -> SamplingParams | None:
    """`params` with the cache_salt of vLLM's prompt dict ({"prompt_token_ids": ..., "cache_salt": ...}), if it has
    one (RequestError for one that is not a non-empty string)."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None or not isinstance(params, (SamplingParams,
                                                                                                  type(None))):
        return params  # (params of another type: refused by the caller's own check)
    return replace(params if params is not None else SamplingParams(), cache_salt=prompt["cache_salt"])


def truncated(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (-1: the context's worth), as vLLM keeps them. A function, not
    a method: validate runs on views of an engine too (parallel.serve_engine.ReplicaView)."""
    if params.truncate_prompt_tokens is None:
        return prompt_token_ids
    keep = max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
    return prompt_token_ids[-keep:]


def _scalar(x) -> bool:
    """A 0-d numpy array or tensor (what list() of a tensor holds)."""
    return not isinstance(x, (int, float)) and hasattr(x, "item") and getattr(x, "shape", None) == ()


def _check_request_id(request_id) -> None:
    """Request ids are strings, as vLLM's (a TypeError there too): str() of another was the id, so its outputs'
    request_id (7 -> "7") was not the caller's, and 7 and "7" were one request."""
    if request_id is None:  # "pass str(None)" named the id "None"
        raise RequestIdTypeError("request_id must be a string, got None",
                                 "give every request its own id, e.g. str(uuid.uuid4())")
    if not isinstance(request_id, str):
        raise RequestIdTypeError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}",
                                 f"pass str({request_id!r}): outputs carry the id as it was given")


@dataclass(eq=False)
class LoRAHold:
    """A caller's hold on an adapter between its requests (a served beam search adds one request per beam and step):
    while held, removing the adapter or replacing it in place leaves its weights to the holder, as to a running
    request. Pass it as add_request's `lora`; `lora` here is the manager's key of the weights (the name, until a
    replacement moves them to a private key). LLMEngine.hold_lora / release_lora."""
    name: str
    lora: str
    key: object = None  # the weights' prefix-cache key (LoRAManager.cache_key), which a replacement does not change


class LLMEngine:
    def __init__(self, config: EngineConfig, parts=None):
        """`parts` (an engine.setup.EngineParts) serves an in-memory model; by default config.model is loaded."""
        if not isinstance(config, EngineConfig):  # LLMEngine("tiny-llama") was "'str' object has no attribute 'model'"
            raise ConfigError(f"LLMEngine takes an EngineConfig, got {type(config).__name__}",
                              "LLMEngine(EngineConfig(\"MODEL\", max_model_len=...)), or LLM(\"MODEL\", ...)")
        self.config = config
        if config.pooling() and config.speculative_config is not None:
            raise ConfigError("--speculative-config drafts generated tokens, which --runner pooling never makes",
                              "leave --speculative-config out")
        # one step, or one control (pause/resume, sleep/wake_up, collective_rpc), at a time whichever thread calls
        # it (`serialized`, `control`); LLM's calls hold it too (LLM._lock is this lock)
        self.lock = threading.RLock()
        self._turn = threading.Condition(threading.Lock())  # guards _controls_waiting (yield_to_controls)
        self._controls_waiting = 0  # controls that wait for the lock or hold it (`control`)
        parts = parts if parts is not None else load_engine_parts(config)
        self.model_path, self.model_config, self.tokenizer = parts.path, parts.model_config, parts.tokenizer
        self.dtype, self.device, self.max_model_len = parts.dtype, parts.device, parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        refuse_hybrid_options(config, self.model_config)  # (what a hybrid model's state cache cannot do)
        self.memory_plan = parts.memory_plan
        self.lora_manager = parts.lora_manager
        if self.lora_manager is not None:  # the expand in the int4 matmul's epilogue, or launched on its own
            for layer in self.lora_manager.layers:
                layer.epilogue = config.lora_epilogue
                layer.streams = config.lora_streams
                layer.expand_beside = config.lora_expand_beside
                layer.fused = config.lora_expand_fused
                layer.fused_norm = config.lora_expand_in_norm
        draft_model = parts.draft.model if getattr(parts, "draft", None) is not None else None
        for mod in [*parts.model.modules(), *(draft_model.modules() if draft_model is not None else ())]:
            if hasattr(mod, "act_in_gate_up"):  # silu_and_mul (gelu_tanh_and_mul) in the int4 gate_up epilogue
                mod.act_in_gate_up = config.silu_in_gate_up and mod.fuses_act()
            if hasattr(mod, "act_in_up"):  # an MLP without gate: its activation in the int4 up kernel's epilogue
                mod.act_in_up = config.silu_in_gate_up and mod.fuses_act()
        # a model whose every layer slides over one window frees each sequence's blocks behind it (kv_window)
        draft_parts = getattr(parts, "draft", None)
        window, step = kv_window(config, self.model_config, self.max_model_len,
                                 draft_parts.model_config if draft_parts is not None else None)
        # a model of mixed layers: a block table per layer group, the sliding groups' blocks behind their window freed
        # --runner pooling: embeddings; a prefix-cache hit skips tokens a MEAN or CLS pool needs (pooling.Pooler)
        self.pooler = resolve_pooler(parts.path, self.model_config.hidden_size, config.pooler_config,
                                     self.model_config) if config.pooling() else None
        if self.pooler is None and is_classifier(self.model_config):  # (a name config.py could not read as a folder)
            raise ConfigError(f"{config.model} is a classifier (a *ForSequenceClassification or "
                              "*ForTokenClassification model): it generates no text",
                              "start it with --runner pooling and classify or score with it")
        caching = config.enable_prefix_caching and (self.pooler is None or self.pooler.caches_prefixes)
        groups = kv_groups(config, self.model_config, self.max_model_len,
                           draft_parts.model_config if draft_parts is not None else None)
        # a hybrid model's prefix cache keeps its states in snapshot slots (off without: engine.state_cache)
        snapshots = snapshot_count(config, self.model_config) if caching and groups is None else 0
        caching = prefix_caching_for(self.model_config, caching, snapshots)
        if groups is not None:
            from .hybrid_blocks import HybridBlockManager
            self.block_manager = HybridBlockManager(parts.num_blocks, config.block_size, caching,
                                                    groups[1], step_tokens=groups[2])
        else:
            self.block_manager = BlockManager(parts.num_blocks, config.block_size, caching,
                                              window=window, step_tokens=step)
        self.block_manager.draft_reads = draft_parts is not None
        self.scheduler = Scheduler(config, self.block_manager, self.lora_manager)
        self.runner = ModelRunner(config, parts.model, dtype=self.dtype, device=self.device,
                                  num_blocks=parts.num_blocks, lora_manager=self.lora_manager,
                                  groups=layer_groups(self.model_config) if groups is not None else None)
        if self.runner.hybrid:  # a state slot per running sequence, taken and freed with its blocks
            self.block_manager.states = StateSlots(config.max_num_seqs)
            if caching:  # and the prefix cache's snapshots of them
                self.runner.snapshot_bytes = parts.model.allocate_snapshots(snapshots, self.device)
                self.block_manager.snapshots = StateSnapshots(snapshots, parts.model.copy_states)
        self.drafter = None  # draft-model speculative decoding: the draft model and its KV cache (engine.draft)
        self._past_draft_context: set = set()  # the step's decodes left without drafts by the draft's context
        method = (config.speculative_config or {}).get("method")
        if getattr(parts, "draft", None) is not None and method in ("eagle3", "eagle"):
            from .eagle import EagleRunner  # an EAGLE-3 head over the target's hidden states
            self.drafter = EagleRunner(parts.draft, config.kv_dtype(self.dtype), parts.num_blocks, config.block_size,
                                       self.device, parts.model)
            self.runner.draft = self.drafter
            self.scheduler.draft_context = self.drafter.context
            self.block_manager.eagle_reads_next = True  # (a prefix hit's last block computed again)
        elif getattr(parts, "draft", None) is not None:
            from .draft import DraftRunner
            self.drafter = DraftRunner(parts.draft, config.kv_dtype(self.dtype), parts.num_blocks, config.block_size,
                                       self.device)
            self.runner.draft = self.drafter  # zero_blocks zeroes both caches
            self.scheduler.draft_context = self.drafter.context  # (its catch-up stops there too)
        self.start_times: dict[str, float] = {}  # seconds spent getting the GPU ready, summed into start_s by gpu_e2e
        self.pdl = False  # whether the step's kernels launch with programmatic dependent launch (kernels.pdl)
        if self.device.type == "cuda":
            from ..kernels import gptq_gemm, pdl
            from ..kernels.gptq_tune import tune_model
            self.pdl = pdl.configure(self.device, config.pdl)  # before any compile: the variants depend on it
            gptq_gemm.configure_byte_fields(self.device)  # (the same)
            t0 = time.perf_counter()
            tune_model(parts.model, config.max_num_batched_tokens, self.device, log=log.info)
            if draft_model is not None:  # (an int4 draft's shapes too)
                tune_model(draft_model, config.max_num_batched_tokens, self.device, log=log.info)
            self.start_times["kernel_tuning_s"] = time.perf_counter() - t0
            from ..kernels import moe_tune  # the fused MoE's buckets no table holds (before anything compiles them)
            self.start_times["moe_tuning_s"] = sum(
                moe_tune.tune_model(m, config.max_num_batched_tokens, self.device, log=log.info)[1]
                for m in (parts.model, draft_model) if m is not None)
            t0 = time.perf_counter()  # every int4 and LoRA kernel the engine will launch, compiled in parallel
            self.compile_kernels()
            self.start_times["kernel_compile_s"] = time.perf_counter() - t0
        if config.use_cuda_graphs():
            t0 = time.perf_counter()
            self.runner.capture_graphs(self.max_model_len)
            self.start_times["cuda_graphs_s"] = time.perf_counter() - t0
        self.detokenizer = Detokenizer(self.tokenizer)
        self.tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)  # vLLM's EOS (stop_reason None)
        # structured outputs: xgrammar's compiler over the vocabulary the logits cover, made on first use
        self.grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._carried: list[RequestOutput] = []  # outputs of a step completed inside a launch that then failed
        self.overlap = config.use_overlap()
        # n-gram speculative decoding (vLLM's "ngram" method), or None; its steps run synchronously (no overlap)
        self.speculative = SpeculativeConfig(**config.speculative_config) if config.speculative_config else None
        self.spec_stats = SpecStats(self.speculative.num_speculative_tokens) if self.speculative else None
        if self.speculative is not None and self.speculative.uses_draft_model and self.drafter is None:
            raise ConfigError("--speculative-config names a draft model, but the engine was given its parts "
                              "without one", "load them with engine.setup.load_engine_parts (it loads the draft)")
        self._inflight = None  # (batch, StepHandle) launched and not yet completed (overlap only)
        self._unsettled = None  # the same, launched before _inflight: a step's wait for its tokens was interrupted
        self.num_steps = 0
        self.last_step_tokens = 0  # tokens the latest step computed (prompt chunks, decodes, accepted drafts), 0: none
        self._lora_holds: list[LoRAHold] = []  # hold_lora's, not released yet
        # RequestOutput.lora_request: adapter name -> (the folder it was read from, its LoRARequest), and the
        # lora_int_id of every adapter named so far (lora_request_of)
        self._lora_requests: dict[str, tuple[str, object]] = {}
        self._lora_int_ids: dict[str, int] = {}
        self._paused = False  # pause_generation() until resume_generation(): no step runs a request
        self.abort_pauses = 0  # pause_generation(mode="abort") calls so far (LLM.beam_search: one ended it)
        self._sleep = SleepState()  # sleep mode (config.enable_sleep_mode): what sleep() freed, until wake_up()
        self._graph_plan = None  # (max_len, emulate) of the CUDA graphs sleep() dropped, captured again on waking
        # the replays of graphs dropped since (sleep, reload_weights): stats()' counters carry on past them, as
        # vLLM's (monotonic, never reset by sleep or wake_up)
        self._dropped_replays = dict.fromkeys(_REPLAY_KEYS, 0)
        self._moe_warmed: set = set()  # the sparse layers' shapes whose fused MoE variants are compiled
        if self.device.type == "cuda":  # every kernel compiled now, never on a user's first request
            t0 = time.perf_counter()
            self.warm_kernels()
            self.num_steps = 0
            self.start_times["warm_kernels_s"] = time.perf_counter() - t0

    def _warm_grammar_mask(self) -> None:
        """The grammar mask's kernel (constrained rows: kernels.apply_bitmask) in both its variants, on the float32
        logits the sampler masks, so that a first constrained request compiles nothing."""
        vocab, device = self.model_config.vocab_size, self.device
        logits = torch.zeros(2, vocab, device=device)
        every = torch.full((2, -(-vocab // 32)), -1, dtype=torch.int32, device=device)
        kernels.apply_bitmask(logits, None, every)
        kernels.apply_bitmask(logits, torch.arange(2, device=device), every)

    @classmethod
    def from_engine_args(cls, engine_args, usage_context=None, stat_loggers=None) -> "LLMEngine":
        """vLLM's LLMEngine.from_engine_args: the engine of an EngineArgs (engine.arg_utils); `usage_context`, vLLM's
        telemetry tag, is ignored."""
        from .arg_utils import engine_config_of
        return cls(engine_config_of(engine_args, "LLMEngine.from_engine_args", stat_loggers))

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: list[int] | str | dict | None = None,
                    params: SamplingParams | None = None, lora: str | None = None,
                    arrival_time: float | None = None, priority: int = 0, lora_request=None, *,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Queue one request. The prompt (vLLM's keyword prompt=, or prompt_token_ids=) is token ids, text (tokenized
        as LLM.generate does: tokenizer(text)), or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
        `arrival_time` (vLLM's keyword): when it arrived, in time.monotonic() seconds, for a caller that held it
        before adding it (the server's queue); its RequestOutput.metrics count from it. Default: now. vLLM's
        `priority` (lower runs first) needs scheduling_policy="priority" unless it is 0, as in vLLM; it overrides
        params.priority where it is not 0. vLLM's `lora_request` (a LoRARequest) registers its folder under its
        lora_name on first use and runs the request with it, as `lora=NAME` does."""
        self._check_open()
        self.check_awake()
        if (prompt is None) == (prompt_token_ids is None):  # vLLM's keyword is prompt=; infer's was prompt_token_ids=
            raise RequestError("add_request needs one prompt: " + ("none was given" if prompt is None else
                                                                   "both prompt and prompt_token_ids were given"),
                               "pass it as the second argument, or as prompt= (text, token ids or a prompt dict)")
        prompt_token_ids = prompt if prompt_token_ids is None else prompt_token_ids
        if lora_request is not None:
            if lora is not None:
                raise RequestError("add_request got both lora and lora_request", "give one")
            lora = self._lora_of(lora_request)
        pooling, params = self._pooling_params(params)
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise _field_error("priority", f"priority must be an integer, got {priority!r}"[:200],
                               "lower values run first under scheduling_policy=\"priority\"")
        if isinstance(lora, numbers.Real) and not isinstance(lora, bool):  # vLLM's add_request(id, prompt, params,
            # arrival_time): its time was read as an adapter name ("lora must be an adapter name, got 25714.7")
            raise RequestError(f"lora={lora!r} is a number: add_request's fourth argument is lora (an adapter name), "
                               "where vLLM's is arrival_time", f"pass arrival_time={lora!r} by keyword")
        if arrival_time is not None and hasattr(arrival_time, "lora_name"):  # vLLM's fifth: lora_request
            raise RequestError("arrival_time is a LoRARequest: add_request's fifth argument is arrival_time, where "
                               "vLLM's is lora_request", "pass it by keyword: add_request(request_id, prompt, "
                               f"params, lora_request=LoRARequest({getattr(arrival_time, 'lora_name')!r}, ...))")
        arrival_time = checked_arrival(arrival_time)
        text = None
        if isinstance(prompt_token_ids, dict):
            params = salted_params(prompt_token_ids, params)
            key, value = prompt_dict(prompt_token_ids)
            prompt_token_ids = value
            text = value if key == "prompt" else None
        elif isinstance(prompt_token_ids, str):
            text = prompt_token_ids
        if text is not None:  # a text certainly longer than the context is refused untokenized, unless cut to fit
            keep = isinstance(params, SamplingParams) and params.truncate_prompt_tokens is not None
            prompt_token_ids = encode_prompt(self.tokenizer, prompt=text, max_tokens=None if keep else
                                             self.max_model_len)
        prompt_token_ids, params = request_inputs(prompt_token_ids, params)
        if priority:
            params = replace(params, priority=int(priority))
        _check_request_id(request_id)
        old = self.requests.get(request_id)
        if old is not None and not old.finished:
            raise RequestError(f"request id {request_id!r} is already running", "give every request its own id")
        params = params.checked()  # the request's own copy, checked again: the caller may have changed its object
        prompt_token_ids = truncated(prompt_token_ids, params, self.max_model_len)
        if isinstance(lora, LoRAHold) and not any(h is lora for h in self._lora_holds):
            lora = lora.name  # a hold released: its name, as any request's
        self.validate(prompt_token_ids, params if pooling is None else pooling, lora)
        params = self.whole_vocabulary(params)
        if isinstance(lora, LoRAHold):  # a held adapter: the weights of the hold (and their K/V), under its name
            name, lora, key = lora.name, lora.lora, lora.key
        else:
            name, key = lora, self.lora_manager.cache_key(lora) if self.lora_manager is not None else None
        cap = min(self.max_model_len, params.max_length or self.max_model_len)
        run_ids = prompt_token_ids if pooling is None else pooled_prompt(list(prompt_token_ids), self.pooler,
                                                                         pooling.task)
        seq = Sequence(request_id, list(run_ids), params, lora, max_total_len=cap, lora_key=key,
                       **({} if arrival_time is None else {"arrival_time": arrival_time}))
        seq.given_prompt_ids = list(prompt_token_ids)  # (what its output shows and counts: the prompt as given)
        seq.lora_name = name
        seq.lora_request = self.lora_request_of(name)
        seq.pooling = pooling
        # a per-token task needs every prompt token's row: never a prefix-cache hit's (BlockManager._reads_cache)
        seq.every_token = pooling is not None and every_token(seq, self.pooler)
        if params.min_tokens:
            seq.min_tokens_ban = self._min_tokens_ban(params)
        if params.structured_outputs is not None:  # compiled already by validate (xgrammar caches it)
            seq.grammar = self.grammars.matcher(params.structured_outputs, params.prefix_token_ids)
            seq.logit_masks = seq.reads_last_token = True
        if params.bad_words:
            seq.bad_words = self.bad_word_ids(params.bad_words)
            seq.reads_last_token = seq.reads_last_token or any(len(ids) > 1 for ids in seq.bad_words)
        if old is not None:  # aborted, its abort output not handed out yet: the id is free again, as in vLLM; that
            self._aborted = [s for s in self._aborted if s is not old]  # output is dropped, or the new request's
            self._forget(old)  # consumer would read it as its own end (and its penalty row would be the old one's)
        if self._carried:  # likewise the outputs of an earlier request of this id that a failed launch carried (its
            self._carried = [o for o in self._carried if o.request_id != request_id]  # end among them): dropped
        seq.prompt = text  # RequestOutput.prompt, as vLLM's: the text when the prompt was text
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _pooling_params(self, params) -> tuple[PoolingParams | None, SamplingParams | None]:
        """(the request's PoolingParams, the SamplingParams it runs with: its prompt, nothing generated) on a pooling
        engine; (None, params) on a generating one. Each refuses the other's params, as vLLM's runners do."""
        if getattr(self, "pooler", None) is None:  # (validate runs on a data-parallel replica's view too)
            if isinstance(params, PoolingParams):
                raise RequestError(NOT_POOLING, 'start the engine with --runner pooling (LLM(MODEL, runner="pooling"))')
            return None, params
        if params is not None and not isinstance(params, PoolingParams):
            if self.pooler.classifies:
                raise RequestError(*not_generating(self.pooler, server=False))
            raise RequestError(NOT_GENERATING, EMBED_INSTEAD)
        pooling = (params or PoolingParams()).checked()
        if pooling.task not in (None, *self.pooler.tasks):  # (an embeddings line of infer run on a classifier...)
            raise task_refusal(pooling.task, self.pooler)
        pooling.check_dimensions(self.pooler, str(self.config.model))
        check_activation(pooling, self.pooler)
        return pooling, SamplingParams(max_new_tokens=1, truncate_prompt_tokens=pooling.truncate_prompt_tokens,
                                       priority=pooling.priority)

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's reading of bad_words: each word's tokens as it is written alone, and also after a space when that
        gives as many tokens starting with another one (the word in the middle of a sentence), so both are
        banned. RequestError for a word whose tokens the model cannot produce. Cached: a request's words were
        tokenized again by every check and for every choice (n), on the server's event loop and engine thread."""
        cache = self.__dict__.get("_bad_words")  # this engine's (or ReplicaView's) own: its tokenizer goes with it
        if cache is None:
            cache = self._bad_words = functools.lru_cache(maxsize=BAD_WORDS_CACHE)(
                functools.partial(_bad_word_ids, self.tokenizer, self.model_config.vocab_size))
        return list(cache(tuple(words)))

    def _min_tokens_ban(self, params: SamplingParams) -> list[int]:
        """What min_tokens keeps from being sampled early: EOS (unless ignored) and the stop token ids (vLLM). A stop
        token id outside the vocabulary is never sampled: masking it would reach another row's logits, or past the
        batch's (the sampler masks flat indices row * vocab + token)."""
        eos = set() if params.ignore_eos else set(self.eos_token_ids)
        vocab = self.model_config.vocab_size
        return sorted(t for t in eos | set(params.stop_token_ids) if t < vocab)

    @property
    def model_limit(self) -> int:
        """The model's own context limit: what --max-model-len may go up to."""
        return model_max_len(self.model_config, replace(self.config, max_model_len=None))

    @property
    def model_limit_reason(self) -> str:
        """Why model_limit is below max_position_embeddings (its sliding_window, longrope), or "" where it is not."""
        return context_limit(self.model_config)[1]

    def _longer_hint(self, by_request: bool) -> str:
        """What can make room for a prompt that fills its cap: the request's max_length up to the engine's context,
        the engine's --max-model-len up to the model's limit, or only a shorter prompt."""
        if by_request:
            return f"shorten the prompt, or raise max_length (up to {self.max_model_len})"
        limit = self.model_limit
        if self.max_model_len < limit:
            return f"shorten the prompt, or start the engine with --max-model-len up to {limit}, the model's limit"
        why = self.model_limit_reason  # a cap below max_position_embeddings said, with its field
        return f"shorten the prompt: {limit} tokens is the model's limit" + (f" ({why})" if why else "")

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's max_logprobs (EngineConfig.max_logprobs, 20 by default; -1: the vocabulary's size): a request's
        logprobs and prompt_logprobs may ask for that many at most, -1 counting as the whole vocabulary."""
        vocab = self.model_config.vocab_size
        cap = getattr(self.config, "max_logprobs", 20)
        most = vocab if cap == -1 else min(cap, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and (vocab if asked == -1 else asked) > most:
                allowed = f"0..{most}" + (" or -1" if cap == -1 else "")
                raise _field_error(name, f"{name} must be in {allowed}, got {asked}",
                                   f"the model's vocabulary has {vocab} tokens" if most == vocab else
                                   f"the engine's max_logprobs is {cap}: start it with a larger one (max_logprobs=N, "
                                   "--max-logprobs N; -1: the whole vocabulary)")

    def whole_vocabulary(self, params: SamplingParams) -> SamplingParams:
        """`params` with vLLM's logprobs / prompt_logprobs -1 (the whole vocabulary, under max_logprobs -1) as the
        vocabulary's size."""
        vocab = self.model_config.vocab_size
        if params.logprobs == -1:
            params = replace(params, logprobs=vocab)
        if params.prompt_logprobs == -1:
            params = replace(params, prompt_logprobs=vocab)
        return params

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, lora: str | None = None) -> None:
        """Raise RequestError if this request can never run (add_request would refuse it)."""
        _, params = self._pooling_params(params)
        prompt_token_ids, params = request_inputs(prompt_token_ids, params)
        params = params.checked()  # fields set after construction are checked too
        # the prompt add_request keeps: a prompt longer than the context with truncate_prompt_tokens runs (the
        # checks of `infer run --strict` and of a data-parallel replica refused it for its whole length)
        prompt_token_ids = truncated(prompt_token_ids, params, self.max_model_len)
        if params.n > 1:
            raise RequestError(f"n={params.n}: an engine request is one sample",
                               "LLM.generate, LLM.chat and the server fan n out; with LLMEngine, add one request "
                               "per sample, each with params.sample(j)")
        if params.priority and self.config.scheduling_policy != "priority":  # vLLM refuses it so too
            raise _field_error("priority", f"priority={params.priority}, but this engine schedules first come, first "
                               "served", 'start it with --scheduling-policy priority (LLM(..., scheduling_policy='
                               '"priority")), or leave priority out (0)')
        n = len(prompt_token_ids) + len(params.prefix_token_ids)
        vocab = self.model_config.vocab_size
        self._check_logprobs(params)
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", "give a non-empty prompt")
        for where, ids in (("the prompt", prompt_token_ids), ("prefix_token_ids", params.prefix_token_ids)):
            bad = next((k for k, t in enumerate(ids) if not isinstance(t, int) or t < 0 or t >= vocab), None)
            if bad is not None:  # which one: a prompt of thousands of ids was told only that one was wrong
                raise RequestError(f"a token id is outside the vocabulary (0..{vocab - 1}): {where}'s token {bad} "
                                   f"is {ids[bad]!r}", "give token ids of this model's tokenizer")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(t >= vocab for t in ids):
                raise RequestError(f"{name} names a token id outside the vocabulary (0..{vocab - 1}): "
                                   f"{max(ids)}")
        if params.allowed_token_ids and params.min_tokens and set(params.allowed_token_ids) <= set(
                self._min_tokens_ban(params)):
            raise _field_error("allowed_token_ids", "every token in allowed_token_ids is an EOS or stop token, "
                               "which min_tokens forbids: nothing could be sampled",
                               "allow another token, or drop min_tokens")
        if params.bad_words:
            single = {ids[0] for ids in self.bad_word_ids(params.bad_words) if len(ids) == 1}
            first = single | set(self._min_tokens_ban(params) if params.min_tokens else ())
            if params.allowed_token_ids and set(params.allowed_token_ids) <= first:
                # the first token's row would be all -inf: the sampler would pick a token outside the allowed list
                raise RequestError("bad_words (with min_tokens' EOS and stop tokens) ban every token in "
                                   "allowed_token_ids: nothing could be sampled",
                                   "allow another token, or drop the words that ban the allowed ones")
        if params.structured_outputs is not None:  # compiles it (a server validates on its own thread)
            self.grammars.matcher(params.structured_outputs, params.prefix_token_ids)
        cap = min(self.max_model_len, params.max_length or self.max_model_len)
        pools = getattr(self, "pooler", None) is not None  # a pooling request generates nothing: the cap is its room
        if n >= cap + pools:
            by_request = bool(params.max_length and params.max_length < self.max_model_len)
            which = "max_length" if by_request else "the model's context (--max-model-len)"
            hint = self._longer_hint(by_request)
            room = cap - 1 + pools - len(params.prefix_token_ids)
            if params.truncate_prompt_tokens is not None and room > 0:  # the request's own cut left the prompt long
                hint = (f"lower truncate_prompt_tokens to {room} or less (-1 keeps the context's worth, which leaves "
                        "no room)" if params.truncate_prompt_tokens == -1 else
                        f"lower truncate_prompt_tokens ({params.truncate_prompt_tokens}) to {room} or less")
            what = f"the prompt has {n} tokens" if not params.prefix_token_ids else \
                f"the prompt ({n - len(params.prefix_token_ids)} tokens) and prefix_token_ids " \
                f"({len(params.prefix_token_ids)}) make {n} tokens"  # the prompt alone was said to have them all
            fits = "is more than" if pools else "leaves no room under"
            raise RequestError(f"{what}, which {fits} {which} of {cap}", hint)
        need = self.block_manager.window_cap(cap)  # (a window: the blocks it holds at once)
        if need > self.block_manager.num_blocks:
            raise RequestError(
                f"a request of {cap} tokens needs {need} KV blocks but the cache holds "
                f"{self.block_manager.num_blocks}", "lower max_length, or give the engine more memory")
        if isinstance(lora, LoRAHold):  # held (hold_lora): its weights run whether or not the name is still served
            if any(h is lora for h in self._lora_holds):
                return
            lora = lora.name  # released: the name, as any request's
        if lora is not None and not isinstance(lora, str):
            raise RequestError(f"lora must be an adapter name (a string) or None, got {lora!r}")
        if lora is not None and (self.lora_manager is None or not self.lora_manager.has(lora)):
            known = sorted(self.lora_manager.names()) if self.lora_manager else []
            # the API's remedy (a front end says its own from the error's fields: infer run's --lora NAME=PATH)
            if self.lora_manager is None:
                hint = ("registered adapters: none: start the engine with an adapter (LLM(..., loras={NAME: PATH})), "
                        "or with enable_lora=True to register them while it runs (LLM.add_lora(NAME, PATH), or a "
                        "request's lora_request=LoRARequest(NAME, 1, PATH))")
            else:
                hint = (f"registered adapters: {', '.join(known) or 'none'}; register another with "
                        "LLM.add_lora(NAME, PATH), or give a request lora_request=LoRARequest(NAME, 1, PATH)")
            raise UnknownAdapterError(f"unknown LoRA adapter {lora!r}", hint, name=lora, known=known,
                                      slots=self.lora_manager is not None)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop the request (or each of an iterable of ids, as vLLM's abort_request takes them; a list was read as
        one id, "['a', 'b']", and nothing was aborted); unknown or finished ids are ignored."""
        if not isinstance(request_id, (str, bytes)) and isinstance(request_id, Iterable):
            ids = list(request_id)
            for rid in ids:  # every id checked before any is aborted
                _check_request_id(rid)
            for rid in ids:
                self.abort_request(rid)
            return
        _check_request_id(request_id)  # 7 aborted request "7", which add_request(7, ...) refuses
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self._aborted.append(seq)

    def list_loras(self) -> list[str]:
        """vLLM's LLMEngine.list_loras(): the adapters requests may name, in the order they were added."""
        self._check_open()
        return self.lora_manager.names() if self.lora_manager is not None else []

    def get_tokenizer(self):
        """vLLM's LLMEngine.get_tokenizer(): the tokenizer text prompts are encoded with."""
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: how many requests were added and have not handed out their last output yet (0 exactly when
        has_unfinished_requests() is false, but for a step already on the device, whose outputs are of these)."""
        if getattr(self, "runner", None) is None:
            return 0
        return len({s.request_id for s in self.scheduler.waiting} | {s.request_id for s in self.scheduler.running}
                   | {s.request_id for s in self._aborted} | {o.request_id for o in self._carried if o.finished})

    @control
    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix, also those of running requests (they keep their blocks, unshared);
        the hit counters go on counting. True (vLLM returns False while requests run; infer resets anyway)."""
        self._check_open()
        self.block_manager.reset_prefix_cache(counters=False, in_use=True)
        return True

    def has_unfinished_requests(self) -> bool:
        # _carried: outputs of a step completed inside a launch that then failed (the last of a request that
        # finished there among them): the next step hands them out, so a caller stepping while this is true, or a
        # server's loop waiting on it, gets them without another request arriving
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._carried) \
            or self._inflight is not None or self._unsettled is not None

    # ------------------------------------------------------------------ adapters at run time
    def lora_slots(self):
        """The LoRAManager; LoRAError when the engine was started without adapter slots, ClosedError once it was
        closed (close() drops the manager: add_lora said to start the engine with --enable-lora)."""
        self._check_open()
        if self.lora_manager is None:
            raise LoRAError("this engine has no LoRA adapter slots, so adapters cannot be added while it runs",
                            "start it with --enable-lora (LLM(..., enable_lora=True)) or with a --lora")
        return self.lora_manager

    def add_lora(self, name: str, path, loaded=None, replace: bool = False) -> None:
        """Register the PEFT adapter folder `path` under `name`; requests may name it from the next step on.
        `loaded`: what `lora_slots().load(name, path)` already read (a server reads it off the engine thread).
        `replace` (vLLM's load_inplace): a name already loaded takes the new weights for the requests added from now
        on; the requests added before finish with the weights they started with (freed after the last of them). A name
        removed while requests still use it may be added again at once: those requests finish with the old weights."""
        manager = self.lora_slots()
        self._check_slots_awake("add_lora")
        self._reap_loras()
        if manager.has(name) and not replace:
            raise LoRANameError(f"a LoRA adapter named {name!r} is already loaded",
                                "remove it first, give this one another name, or replace it: "
                                "add_lora(name, path, replace=True)")
        adapter = loaded if loaded is not None else manager.load(name, path)
        if not replace and name not in manager.retired():
            manager.add(adapter)
            return
        # replaced, or removed while requests still use it (as vLLM, the name may be loaded again at once): the
        # requests that hold the old weights move to their private key and finish with them
        old = manager.replace(adapter, in_use=self._lora_in_use(name))  # unused: its old folder is not read again
        if old is not None:
            for seq in self.requests.values():
                if seq.lora == name and not seq.finished:
                    seq.lora = old  # the manager's key of the weights it started with; outputs keep the name
            for hold in self._lora_holds:
                if hold.lora == name:
                    hold.lora = old
            self._reap_loras()

    def hold_lora(self, name: str | None) -> LoRAHold | None:
        """Keep adapter `name` (None: no adapter, no hold) for a caller that adds its requests one after another (a
        served beam search's steps): requests added with `lora=hold` run with these weights even after the adapter
        is removed or replaced in place meanwhile, and they are freed only after release_lora(hold)."""
        if name is None:
            return None
        self.validate([0], SamplingParams(max_tokens=1), name)  # RequestError for a name not served
        hold = LoRAHold(name, name, self.lora_manager.cache_key(name))
        self._lora_holds.append(hold)
        return hold

    def release_lora(self, hold: LoRAHold | None) -> None:
        """End hold_lora's hold: an adapter removed meanwhile is freed once no request uses it either."""
        if hold is not None and any(h is hold for h in self._lora_holds):
            self._lora_holds = [h for h in self._lora_holds if h is not hold]
            self._reap_loras()

    def _lora_of(self, request) -> str:
        """The adapter name of vLLM's LoRARequest, its folder registered under its lora_name on first use."""
        from ..lora.request import to_register
        name, path = to_register(request, self.lora_slots)
        if path is not None:
            self.add_lora(name, path)
        self.note_lora_request(name, request)
        return name

    def note_lora_request(self, name: str, request) -> None:
        """vLLM's RequestOutput.lora_request: the requests run with adapter `name` (registered, or found registered
        from the same folder, by vLLM's LoRARequest `request`) report `request` itself, as vLLM's do."""
        manager = self.lora_manager
        if manager is not None and manager.has(name):
            self._lora_requests[name] = (manager.path_of(name), request)
            number = getattr(request, "lora_int_id", None)
            if isinstance(number, int) and not isinstance(number, bool):
                self._lora_int_ids[name] = number

    def lora_request_of(self, name: str | None):
        """vLLM's RequestOutput.lora_request of a request run with adapter `name` (None: the base model, None): the
        LoRARequest it was registered by (vLLM's lora_request=), else one of its name, its folder and a lora_int_id
        of its own (1, 2, ... in the order adapters were first named, past the ids vLLM's LoRARequests gave)."""
        if name is None:
            return None
        manager = self.lora_manager
        path = manager.path_of(name) if manager is not None and manager.has(name) else None
        known = self._lora_requests.get(name)
        if known is not None and (path is None or known[0] == path):
            return known[1]
        from ..lora.request import LoRARequest
        number = self._lora_int_ids.get(name) or max(self._lora_int_ids.values(), default=0) + 1
        self._lora_int_ids[name] = number
        request = LoRARequest(name, number, path or name)
        self._lora_requests[name] = (path, request)
        return request

    def remove_lora(self, name: str) -> int:
        """New requests may no longer name `name`; those that already do finish with it, and its memory is freed
        after the last of them. Returns how many requests still use it."""
        manager = self.lora_slots()
        self._check_slots_awake("remove_lora")
        if not manager.has(name):
            raise LoRAError(f"unknown LoRA adapter {name!r}",
                            f"loaded adapters: {', '.join(sorted(manager.names())) or 'none'}")
        manager.retire(name, in_use=self._lora_in_use(name))  # unused: freed now, its folder not read again for it
        return self._reap_loras().get(name, 0)

    def _lora_in_use(self, name: str) -> bool:
        """Whether a request (running or waiting) or a hold uses the weights registered under `name`."""
        return bool(self.lora_manager.pins(name)) \
            or any(seq.lora == name and not seq.finished for seq in self.requests.values()) \
            or any(hold.lora == name for hold in self._lora_holds)

    def _reap_loras(self) -> dict[str, int]:
        """Free every removed adapter no request uses any more; {name: requests still using it} of the others."""
        manager = self.lora_manager
        if manager is None or not manager.retired():
            return {}
        users: dict[str, int] = {}
        for seq in self.requests.values():
            if seq.lora is not None and not seq.finished:
                users[seq.lora] = users.get(seq.lora, 0) + 1
        for hold in self._lora_holds:  # a holder between two of its requests uses it too
            users[hold.lora] = users.get(hold.lora, 0) + 1
        for name in manager.retired():
            if not users.get(name) and not manager.pins(name):
                manager.unregister(name)
        return {name: users.get(name, 0) for name in manager.retired()}

    # ------------------------------------------------------------------ the step
    @serialized
    def step(self) -> list[RequestOutput]:
        """Schedule a batch, run it, sample, hand out outputs. With overlap (config.use_overlap()) the batch is only
        launched: the outputs returned are the previous batch's, handled on the host while this one runs on the
        device, and this batch's input ids for tokens the host has not seen yet come from the device. A step that
        raises (a failed launch, or Ctrl-C while it waits for the device) loses nothing: the outputs it had made
        are handed out by the next step, and a launched batch whose tokens it was waiting for is completed then."""
        self._check_open()
        outputs, self._carried = self._carried + self._take_aborted(), []
        if self._sleep.asleep or self._sleep.discarded:  # the requests sleep() aborted end; nothing runs (add_request
            if not self._sleep.paused:  # refuses new ones, and any other ends: none is left waiting for a step that
                for seq in [s for s in self.requests.values() if not s.finished]:  # never comes); those a
                    self.abort_request(seq.request_id)  # sleep(mode="keep") paused wait for the engine to wake
            return outputs + self._take_aborted()
        if self._paused:  # pause_generation(): the requests it froze, and those added since, wait for resume
            return outputs + self._take_aborted()
        try:
            self._advance(outputs)
        except BaseException:
            self._carried = outputs  # handed out by the next step: not lost
            raise
        if self.lora_manager is not None and self.lora_manager.retired() and any(o.finished for o in outputs):
            self._reap_loras()  # a removed adapter's last request ended: freed now, not at a next step an idle
        return outputs          # server never takes

    def _advance(self, outputs: list[RequestOutput]) -> None:
        """The body of step(), adding its outputs to `outputs` as they are made."""
        self.last_step_tokens = 0
        if self._unsettled is not None:  # its wait was interrupted: completed before anything else
            self._settle(outputs)
        self._reap_loras()  # adapters removed while requests still used them, now that those may have finished
        if self.speculative is not None:
            self._propose()
        batch = self.scheduler.schedule()
        try:
            outputs += self._take_failed()
        except BaseException:  # (Ctrl-C) the step never runs: the blocks registered for it hold no K/V
            self.block_manager.forget_scheduled(self.scheduler.running)
            raise
        if not batch:
            if self._inflight is not None:  # wait for the launched batch, and complete it
                self._unsettled, self._inflight = self._inflight, None
                self._settle(outputs)
            return
        batch.zero, self.block_manager.fresh = self.block_manager.fresh, []  # zeroed by the step (ModelRunner.prepare)
        self.num_steps += 1
        saves = self.block_manager.snapshot_points(batch)  # (a hybrid model's states at its sequences' block ends)
        try:
            if self.drafter is not None:  # the draft model's drafts, in the slots the scheduler gave their placeholders
                self.drafter.propose(batch)
                self.block_manager.drafts_written(batch.seqs)  # (the cached blocks whose draft KV it caught up)
            if self.speculative is not None:
                results = self.runner.verify(batch)
            elif self.pooler is not None:
                pooled = self.runner.pool(batch, self.pooler)
            elif not self.overlap:
                sampled = self.runner.run(batch)
        except BaseException:  # (Ctrl-C while the draft's tokens are read back) the step never completed: its blocks
            # are the next step's to zero, or the target's KV of the blocks it got held whatever their memory held
            # (a NaN read as attention's masked tail: the request ended "logits were not finite"); the blocks
            # registered for it hold no K/V: out of the prefix cache, and whoever took them computes them
            self.block_manager.fresh[:0] = batch.zero
            self.block_manager.forget_scheduled(self.scheduler.running)
            raise
        if any(saves) and (self.speculative is not None or self.pooler is not None or not self.overlap):
            self.block_manager.save_snapshots(saves)  # (the forward ran: the states are the step's)
        self.last_step_tokens = batch.num_tokens
        if self.speculative is not None:  # (never overlapped: EngineConfig.use_overlap)
            # as vLLM's iteration tokens: a row's accepted drafts and its own token, never the drafts it rejected
            self.last_step_tokens -= sum(len(batch.seqs[i].draft_token_ids) - r[2] for i, r in results.items())
            with interrupts_held():
                outputs += self._complete_speculative(batch, results)
            return
        if self.pooler is not None:
            with interrupts_held():
                self._launched(batch, [])
                outputs += self._complete_pooled(batch, pooled)
            return
        if not self.overlap:
            with interrupts_held():
                self._launched(batch, sampled)
                outputs += self._complete(batch, sampled)
            return
        prev = self._inflight  # taken only once the next batch is launched: a failed launch loses nothing
        settled = []

        def settle() -> None:  # a row's grammar or bad word reads prev's tokens: the runner completes it mid-launch
            # completed here: a launch that fails after this does not complete it again (interrupted while waiting,
            # it stays unsettled: the next step completes it)
            self._unsettled, self._inflight = prev, None
            self._settle(outputs)
            settled.append(True)
        try:
            handle = self.runner.launch(batch, prev[1] if prev else None, settle if prev else None)
        except BaseException:  # (a failed launch, or Ctrl-C before its forward) as above: the next step zeroes them
            self.block_manager.fresh[:0] = batch.zero
            self.block_manager.forget_scheduled(self.scheduler.running)
            raise
        if any(saves):  # (queued after the launched forward, before any later step's)
            self.block_manager.save_snapshots(saves)
        with interrupts_held():
            self._launched(batch, handle.rows)
            self._inflight = (batch, handle)
        if prev is not None and not settled:
            self._unsettled = prev  # before the batch just launched
            self._settle(outputs)

    def _settle(self, outputs: list[RequestOutput]) -> None:
        """Wait for the tokens of the launched batch `_unsettled` and complete it, adding its outputs to `outputs`.
        Interrupted while waiting (Ctrl-C: on a GPU most of a step is this wait), it stays, and the next step completes
        it first: its tokens were already the input of the batch launched after it."""
        try:
            sampled = self._unsettled[1].result()
        except Exception:  # a failure, not an interruption: the batch is dropped (its requests end with the error)
            self._unsettled = None
            raise
        with interrupts_held():  # once the tokens are here, completing the batch is not interrupted half way
            (batch, _), self._unsettled = self._unsettled, None
            outputs.extend(self._complete(batch, sampled))

    def _check_open(self) -> None:
        if getattr(self, "runner", None) is None:  # close() freed the model and the KV cache
            raise ClosedError("this engine was closed (LLMEngine.close())", "create a new engine to run requests")

    def _take_aborted(self) -> list[RequestOutput]:
        outputs = [self._output(s, []) for s in self._aborted]
        for s in self._aborted:
            self._forget(s)
        self._aborted = []
        return outputs

    def _take_failed(self) -> list[RequestOutput]:
        """Requests the scheduler could not start (an adapter that cannot be read any more): finished, error set."""
        failed, self.scheduler.failed = self.scheduler.failed, []
        for s in failed:
            self._forget(s)
        return [self._output(s, []) for s in failed]

    def _forget(self, seq: Sequence) -> None:
        """The request is over: drop it, and its row in the sampler's penalty table. A step already launched may
        still read the row; whoever gets it next resets it in a later step, after that one on the device."""
        self.requests.pop(seq.request_id, None)
        self.runner.penalties.release(seq.request_id)
        seq.grammar = seq.draft_bitmask = seq.ngram_ids = None  # (a finished output keeps its Sequence)
        seq.draft_hidden = None  # (EAGLE-3's target states not fed yet)

    @staticmethod
    def _launched(batch: ScheduledBatch, rows) -> None:
        """The batch's tokens are computed and its sampled tokens exist (on the device): count them."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        for i in rows:
            batch.seqs[i].num_pending += 1

    def _complete(self, batch: ScheduledBatch, sampled: dict) -> list[RequestOutput]:
        """The batch's sampled tokens are known on the host: append them, register full blocks, check stops.
        A sequence that finished (or was aborted) meanwhile drops its token: it was computed past its end."""
        outputs, now = [], time.monotonic()
        for i, seq in enumerate(batch.seqs):
            token, record = sampled.get(i, (None, None))
            if token is not None:
                seq.num_pending -= 1
            if seq.finished:
                continue
            if token is not None:
                seq.output_token_ids.append(token)
            self.block_manager.register_computed(seq)
            if token is not None:
                try:
                    outputs.append(self._append_token(seq, token, record, now))
                except Exception as e:  # this request's token could not be handled (its tokenizer's decode raised):
                    # it ends with the error; raised, the rest of the batch kept its tokens pending, and every
                    # later step raised "a pending token without the step that made it"
                    outputs.append(self._failed_token(seq, e))
        self.block_manager.name_snapshots()  # (a hybrid model's states past prompts whose tokens are known now)
        return outputs

    def _complete_pooled(self, batch: ScheduledBatch, pooled: dict) -> list:
        """A pooling step's results: each sequence whose prompt is complete ends with its vector (a non-finite one
        with an error, as a generation's non-finite logits)."""
        outputs = []
        for i, seq in enumerate(batch.seqs):
            if seq.finished:
                continue
            self.block_manager.register_computed(seq)
            if i not in pooled:
                continue
            vec = finish_vector(pooled[i], self.pooler, seq.pooling)
            if not bool(torch.isfinite(vec).all()):
                seq.error = ("the model's hidden states for this request were not finite (NaN or inf): the model "
                             "overflowed on it (run it in bfloat16 or float32 with --dtype)")
                self.scheduler.finish(seq, "error")
                outputs.append(self._output(seq, []))
            else:
                self.scheduler.finish(seq, "stop")
                outputs.append(pooled_output(seq, vec, seq.pooling.task or self.pooler.task))
            self._forget(seq)
        return outputs

    def _propose(self) -> None:
        """Speculative decoding: drafts for each running sequence that decodes, at most as many as its max_tokens
        and context leave room for after the token the step adds of its own (with a grammar, cut where it refuses
        one). A sequence still in its prompt gets none (as vLLM's, which drafts after a request's first token): the
        last chunk of a prompt prefilled in several steps drafted, so a seeded request drew from its generator for
        rows the same prompt prefilled in one step (a larger --max-num-batched-tokens, a prefix-cache hit) did not
        have, and sampled other tokens."""
        spec = self.speculative
        self._past_draft_context = set()
        for seq in self.scheduler.running:
            seq.draft_token_ids, seq.draft_bitmask = [], None
            if seq.num_uncomputed_tokens != 1 or seq.num_pending or seq.num_generated < 1:
                continue
            room = seq.max_total_len - len(seq) - 1
            if seq.params.max_new_tokens is not None:
                room = min(room, seq.params.max_new_tokens - seq.num_generated - 1)
            k = min(spec.num_speculative_tokens, room)
            if k > 0 and self.drafter is not None and not self.drafter.fits(len(seq), k):
                self._past_draft_context.add(seq)  # its drafts would pass the draft's context: none (counted
                # once it is scheduled: _complete_speculative)
            elif k > 0 and self.drafter is not None:  # placeholders: the draft model fills those scheduled
                seq.draft_token_ids = [0] * k
            elif k > 0:
                drafts = propose_for(seq, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
                if drafts and seq.grammar is not None:  # cut where the grammar refuses one; each row's mask
                    drafts, bits = draft_bitmask(seq.grammar, drafts, self.model_config.vocab_size)
                    seq.draft_bitmask = bits if drafts else None  # (none kept: no bitmask held)
                seq.draft_token_ids = drafts

    def _complete_speculative(self, batch: ScheduledBatch, results: dict) -> list[RequestOutput]:
        """`_complete` for a speculative step (ModelRunner.verify's results): each sequence's tokens appended one by
        one (stops checked after each; the rest dropped once it finishes), its KV counted up to its last accepted
        draft, the blocks only rejected drafts used freed, and one output per request with every token it got."""
        outputs, now = [], time.monotonic()
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            # the drafts and their bitmask are used up (a finished request's output keeps its Sequence)
            drafts, seq.draft_token_ids, seq.draft_bitmask = seq.draft_token_ids, [], None
            if seq.finished:
                continue
            tokens, records, accepted = results.get(i, ((), (), 0))
            base = seq.num_computed_tokens + n - len(drafts)  # computed once its first token is appended
            if drafts:
                self.spec_stats.count(len(drafts), accepted)
            elif seq in self._past_draft_context:  # a decode without drafts: they would pass its context
                self.drafter.context_skips += 1
            if not tokens:
                seq.num_computed_tokens = base
                self.block_manager.register_computed(seq)
                continue
            made = []
            for j, (token, record) in enumerate(zip(tokens, records)):
                seq.num_computed_tokens = base + j  # the KV of an accepted draft is the token's
                if self.drafter is not None:  # (a stop's free_seq then knows how far its blocks' draft KV is)
                    seq.draft_computed = min(seq.draft_fed, seq.num_computed_tokens)
                seq.output_token_ids.append(token)
                self.block_manager.register_computed(seq)
                try:
                    made.append(self._append_token(seq, token, record, now))
                except Exception as e:  # as in _complete
                    made.append(self._failed_token(seq, e))
                if seq.finished:
                    break
            # the accepted drafts after a stop were never handed out: no tokens of the step (as vLLM counts them)
            self.last_step_tokens -= len(tokens) - len(made)
            if (drafts or self.drafter is not None) and not seq.finished:  # (a grammar may cut every draft)
                self.block_manager.shrink(seq, len(seq))
            out = made[-1]
            if len(made) > 1:
                out.new_token_ids = [t for o in made for t in o.new_token_ids]
                out.delta_text = "".join(o.delta_text for o in made)
            outputs.append(out)
        if self.drafter is not None:  # the draft KV of the tokens that stay (accepted drafts, the step's own)
            for seq in batch.seqs:
                seq.draft_computed = min(seq.draft_fed, seq.num_computed_tokens)
        return outputs

    def _failed_token(self, seq: Sequence, e: Exception) -> RequestOutput:
        """The request whose newest token raised while handled (detokenized, checked): finished, error named."""
        if not seq.finished:
            seq.error = f"handling output token {seq.num_generated} raised {type(e).__name__}: {e}"
            self.scheduler.finish(seq, "error")
        out = self._output(seq, [])
        self._forget(seq)
        return out

    def _append_token(self, seq: Sequence, token: int, record: dict | None, now: float) -> RequestOutput:
        if token == NOT_FINITE:
            return self._not_finite(seq)
        if seq.bad_words and self._banned(seq, token):  # the row allowed nothing: every logit was -inf
            return self._no_token_left(seq, token)
        if seq.grammar is not None and not seq.grammar.accept_token(token):  # the mask allowed only what it accepts
            return self._off_grammar(seq, token)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if record is not None:
            seq.logprobs.append(record)
        p = seq.params
        if seq.min_tokens_ban and seq.num_generated >= p.min_tokens:
            seq.min_tokens_ban = []  # long enough: the sampler masks nothing more for it
            seq.logit_masks = bool(p.allowed_token_ids or p.logit_bias or seq.grammar is not None or seq.bad_words)
        eos = not p.ignore_eos and token in self.eos_token_ids
        is_stop_token = eos or token in p.stop_token_ids
        stop_string = self.detokenizer.update(seq, is_stop_token)
        if is_stop_token and not stop_string:  # as vLLM's stop_reason: None for the tokenizer's EOS, else the stop
            # token's id; vLLM stops at generation_config's other eos_token_ids as stop_token_ids, which report theirs.
            # A stop string found in the text with it (the stop token's own text, include_stop_str_in_output; or the
            # first text min_tokens lets it be found in) is the reason, as vLLM's (the text is cut at it)
            seq.stop_reason = None if token == self.tokenizer_eos and not p.ignore_eos else token
        if is_stop_token or stop_string:
            self.scheduler.finish(seq, "stop")
        elif (p.max_new_tokens is not None and seq.num_generated >= p.max_new_tokens) \
                or len(seq) - seq.num_pending >= seq.max_total_len:
            self.scheduler.finish(seq, "length")
        out = self._output(seq, [token])
        if seq.finished:
            self._forget(seq)
        return out

    @staticmethod
    def _banned(seq: Sequence, token: int) -> bool:
        """Whether the request's masks forbade `token` (already appended): it ends a bad word (the sampler's rule),
        or is not in allowed_token_ids. Sampled anyway, it came from a row the masks left empty, which happens when
        bad_words ban, after the reply so far, every allowed token (allowed_token_ids=[t], bad_words=["tt"])."""
        out, n = seq.output_token_ids, len(seq.output_token_ids) - 1  # n: the tokens before this one
        if seq.params.allowed_token_ids and token not in seq.params.allowed_token_ids:
            return True
        return any(ids[-1] == token and (len(ids) == 1 or (n >= len(ids) - 1 and out[n + 1 - len(ids):n] == ids[:-1]))
                   for ids in seq.bad_words)  # slices of a word's length: no copy of the reply per token

    def _no_token_left(self, seq: Sequence, token: int) -> RequestOutput:
        """A token sampled from a row bad_words left empty: the request ends with the error, the token (another
        than the request allows, or the rest of a bad word) left out of its reply."""
        seq.output_token_ids.pop()
        seq.error = (f"bad_words leave no token to sample after the reply so far (token {token} was drawn from a "
                     "row whose every token is banned or not allowed)")
        seq.bad_request = True
        self.scheduler.finish(seq, "error")
        out = self._output(seq, [])
        self._forget(seq)
        return out

    def _not_finite(self, seq: Sequence) -> RequestOutput:
        """The request's logits held a NaN or +inf (the model overflowed on it: float16 activations past 65,504, an
        adapter's weights): it ends with the error, not with a reply of whatever token argmax made of them; the
        other requests of the step go on."""
        seq.output_token_ids.pop()
        seq.error = (f"the model's logits for this request were not finite (NaN or inf) at output token "
                     f"{seq.num_generated + 1}: the model overflowed on it (run it in bfloat16 or float32 with "
                     "--dtype, or check its adapter and weights with infer lora-validate)")
        self.scheduler.finish(seq, "error")
        out = self._output(seq, [])
        self._forget(seq)
        return out

    def _off_grammar(self, seq: Sequence, token: int) -> RequestOutput:
        """A token the request's matcher refuses: the step sampled from a row that allowed nothing (a rule that
        never ends, reached mid-reply; every logit was -inf). The request ends with the error, the token left out
        of its reply."""
        seq.output_token_ids.pop()
        kind, dead = seq.params.structured_outputs.kind, not allows_any(seq.grammar, self.grammars.vocab_size)
        seq.bad_request = dead or bool(seq.bad_words)  # else a token the mask allowed: infer's fault, a 500
        seq.error = ((f"bad_words ban every token structured_outputs.{kind} allows after the reply so far "
                      f"(token {token} was drawn from a row left empty)" if seq.bad_words else
                      f"token {token} does not follow the request's structured_outputs.{kind}")
                     if not dead else
                     f"structured_outputs.{kind} allows no token after the reply so far: nothing can complete it "
                     f"({DEAD_HINT})")
        self.scheduler.finish(seq, "error")
        out = self._output(seq, [])
        self._forget(seq)
        return out

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput.snapshot(seq, new_token_ids=new_tokens, delta_text=Detokenizer.delta(seq))

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks,
            # a sliding window's model: the blocks freed behind running sequences' windows (BlockManager.free_behind)
            **({"kv_blocks_freed_window": bm.window_freed} if bm.window else {}),
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_usage": bm.num_used_blocks / bm.num_blocks,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate(), "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
            "lora_swaps": self.lora_manager.swaps if self.lora_manager else 0, "num_steps": self.num_steps,
            **self._graph_replays(),
            **self._lora_stats(), **(self.spec_stats.as_dict() if self.spec_stats is not None else {}),
        }

    def _graph_replays(self) -> dict:
        """The CUDA graph counters (and a draft model's stats): the graphs' own replays, plus those of graphs that
        sleep() or reload_weights() dropped (captured again on waking: the counters carry on, as vLLM's)."""
        runner, dropped = self.runner, getattr(self, "_dropped_replays", None) or dict.fromkeys(_REPLAY_KEYS, 0)
        out = {"cuda_graph_replays": dropped["cuda_graph_replays"]
               + (sum(runner.graphs.replays.values()) if runner and runner.graphs else 0),
               "piecewise_graph_steps": dropped["piecewise_graph_steps"]
               + (sum(runner.pieces.replays.values()) if runner and runner.pieces else 0)}
        if getattr(self, "drafter", None) is not None:
            out.update(self.drafter.stats())
            out["draft_cuda_graph_replays"] += dropped["draft_cuda_graph_replays"]
        return out

    def _lora_stats(self) -> dict:
        """vLLM's lora_requests_info: the slots, and the adapters of the waiting and of the running requests (by the
        name they were asked for, a replaced adapter's old weights too)."""
        if self.lora_manager is None:
            return {}
        return {"lora_max": self.lora_manager.max_loras,
                "lora_waiting": sorted({s.lora_name for s in self.scheduler.waiting if s.lora_name is not None}),
                "lora_running": sorted({s.lora_name for s in self.scheduler.running if s.lora_name is not None})}

    # ------------------------------------------------------------------ sleep mode (vLLM's)
    @control
    def sleep(self, level: int = 1, mode: str = "abort") -> int:
        """vLLM's sleep mode (the engine started with enable_sleep_mode=True): give the device memory back without
        closing the engine. Level 1 copies the weights to host memory and frees them and the KV cache on the device;
        level 2 frees both and keeps no copy (for new weights: wake_up(["weights"]), then reload_weights(), as
        vLLM's collective_rpc("reload_weights")). `mode` (vLLM's PauseMode) says what becomes of the requests the
        engine holds (running or waiting): "abort" (the default) aborts them (their last output: finish_reason
        "abort", handed out by the next step); "wait" runs them to their end first (their outputs handed out by the
        next step), then frees the memory; "keep" pauses them (preempted: their KV blocks freed, recomputed later):
        they go on once the engine is awake again (after level 2, with the weights reload_weights() loaded), greedy
        tokens as those of a run never put to sleep. The prefix cache is forgotten and the CUDA graphs dropped
        (captured again on waking). New requests are refused (SleepModeError) until wake_up(). Asleep already: a
        warning, the memory left as it is (vLLM's), but the requests an earlier sleep(mode="keep") paused take this
        call's mode: "abort" ends them (as above: finish_reason "abort", handed out by the next step), "keep" leaves
        them paused, and "wait" is refused (SleepModeError, from check_sleep: they cannot run to their end while
        the engine is asleep). Returns the bytes freed on the device."""
        self.check_sleep(level, mode)
        if self._sleep.asleep:
            log.warning("the engine is asleep already (tags %s): sleep() frees nothing more", sorted(self._sleep.tags))
            if mode == "abort":  # (a later abort-sleep ends the requests a sleep(mode="keep") paused, as vLLM's)
                self._abort_for_sleep()
                self._sleep.paused = False
            return 0
        self._hold_requests(mode, SLEPT)
        self.block_manager.reset_prefix_cache(counters=False, in_use=True)
        self._drop_graphs()
        runner, drafter = self.runner, self.drafter
        kept = []  # copied at both levels: adapter slots, a draft model (reload_weights reloads the base model's)
        if self.lora_manager is not None:
            kept += object_tensors(self.lora_manager)
            for layer in [*self.lora_manager.layers, *self.lora_manager.expert_layers]:  # (a13.. of the experts')
                kept += object_tensors(layer)
        kv = [runner.kv_cache]
        if runner.hybrid:  # the linear layers' states: of no use once every request is aborted or preempted (mode
            # "keep": recomputed from position 0): freed as the KV cache is, never copied, zeros on waking
            kv += [t for layer in runner.model.linear_layers() for t in (layer.conv_state, layer.rec_state)
                   if t is not None]  # (LFM2's short convs: a conv state alone)
            kv += [t for layer in runner.model.linear_layers() for t in (getattr(layer, "conv_snap", None),
                                                                          getattr(layer, "rec_snap", None)) if
                   t is not None]  # (the prefix cache's snapshots: forgotten, reset_prefix_cache above)
        if drafter is not None:
            kept += module_tensors(drafter.model.modules())
            kv.append(drafter.kv_cache)
        freed = self._sleep.sleep(level, self.device, module_tensors(runner.model.modules()), kept, kv)
        self._sleep.paused = self.scheduler.has_unfinished()  # (mode "keep"; "abort" and "wait" left none)
        self._free_device_cache()
        log.info("the engine is asleep (level %d): %.1f MiB freed on %s", level, freed / 2**20, self.device)
        return freed

    @control
    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up: the memory of `tags` ("weights", "kv_cache"; None: both) on the device again: the weights
        as they were (level 1) or as garbage until reload_weights() (level 2), the KV cache empty. Requests run once
        every tag is awake (and, after level 2, the weights loaded again); the CUDA graphs are captured again then.
        Not asleep: a warning, nothing done (vLLM's); a tag awake already: a warning, the others are woken."""
        self._check_open()
        if isinstance(tags, str):
            tags = [tags]
        if tags is not None and not tags:  # (an empty list: vLLM's server reads it as None, every tag)
            tags = None
        if tags is not None:
            if not isinstance(tags, (list, tuple, set, frozenset)) or not all(isinstance(t, str) for t in tags):
                raise RequestError(f"wake_up takes a list of tags, got {tags!r}"[:200],
                                   "e.g. wake_up([\"weights\"]), then wake_up([\"kv_cache\"]); None: both")
            unknown = sorted(set(tags) - set(TAGS))
            if unknown:
                raise RequestError(f"unknown wake_up tag {unknown[0]!r}"[:200],
                                   f"the tags are {', '.join(map(repr, TAGS))} (None: both)")
        if not self._sleep.asleep:
            log.warning("the engine is not asleep: wake_up() does nothing")
            return
        wanted = [t for t in TAGS if tags is None or t in tags]
        if tags and any(t not in self._sleep.tags for t in wanted):  # the others are woken (wake_up(["weights",
            log.warning("wake_up(%s): %s is awake already", list(tags),  # "kv_cache"]) after wake_up(["weights"]))
                        next(t for t in wanted if t not in self._sleep.tags))
        for tag in wanted:
            if tag in self._sleep.tags:
                self._sleep.wake(tag)
        if not self._sleep.asleep and not self._sleep.discarded:
            self._sleep.paused = False  # (the requests a sleep(mode="keep") paused run from the next step)
            self._recapture()

    def is_sleeping(self) -> bool:
        """vLLM's: whether sleep() freed memory that wake_up() has not given back yet."""
        return self._sleep.asleep

    def _abort_for_sleep(self, error: str = SLEPT) -> None:
        """End every request the engine holds, as sleep(mode="abort") ends them (finish_reason "abort"); `error`
        says why (SLEPT, PAUSED: a server's stream ends with finish_reason "abort", not as at its shutdown)."""
        for seq in list(self.requests.values()):
            if not seq.finished:
                self.abort_request(seq.request_id)
                seq.error = error

    def _hold_requests(self, mode: str, error: str) -> None:
        """What sleep() and pause_generation() do with the requests the engine holds (vLLM's PauseMode): "wait" runs
        them to their end, "abort" ends them (`error` their error), "keep" pauses them (preempted, not counted as a
        preemption: their KV blocks freed, recomputed once they run again). A step on the device (overlap) is
        completed first; the outputs of all this are handed out by the next step."""
        if mode == "wait":
            self._run_to_end()
        elif mode == "abort":
            self._abort_for_sleep(error)
        done: list[RequestOutput] = []  # a step on the device (overlap) completes first: its memory is freed next
        if self._unsettled is not None:
            self._settle(done)
        if self._inflight is not None:
            self._unsettled, self._inflight = self._inflight, None
            self._settle(done)
        self._carried += done
        if mode == "keep":  # the youngest first: each goes back to the head of the waiting queue, the oldest first
            for seq in reversed(list(self.scheduler.running)):
                self.scheduler.preempt(seq, counted=False)  # (a pause, not a preemption: stats and /metrics)

    # ------------------------------------------------------------------ pause / resume (vLLM's, for RL trainers)
    @control
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause_generation: no step runs a request until resume_generation(); requests added meanwhile wait
        (queued, not refused) and run after it. `mode` says what becomes of the requests the engine holds: "abort"
        (the default) ends them (finish_reason "abort", handed out by the next step), "wait" runs them to their end
        first (their outputs handed out by the next step), "keep" freezes them: their KV blocks are freed and they
        go on after resume_generation() with the greedy tokens of an uninterrupted run (recomputed: weights loaded
        meanwhile, reload_weights(), are the ones they go on with). `clear_cache` (vLLM's) forgets the prefix cache
        (for every mode: infer's "keep" recomputes the frozen requests). Paused already: their frozen requests take
        this call's mode ("abort" ends them, "keep" leaves them, "wait" is refused: PauseError). Pause and sleep are
        independent: either may come first, and requests run once the engine is awake and not paused. Another
        thread may call it while an LLM steps (`control`: it runs between two steps)."""
        self.check_pause(mode, clear_cache)
        self.abort_pauses += mode == "abort"
        if not (self._paused and mode == "keep"):
            self._hold_requests(mode, PAUSED)
        self._paused = True
        if clear_cache:
            self.block_manager.reset_prefix_cache(counters=False, in_use=True)

    @control
    def resume_generation(self) -> None:
        """vLLM's resume_generation: the requests paused or added since pause_generation() run from the next step
        (while asleep: once awake). Not paused: nothing to do."""
        self._check_open()
        self._paused = False

    @contextlib.contextmanager
    def turn(self):
        """Hold the engine's lock as a control (`control`) does: a loop stepping in another thread lets it in before
        its next step (yield_to_controls) rather than taking the lock again at once. LLM's calls other than its steps
        (close, add_lora, remove_lora, apply_model) take it so: they are not held up until another thread's generate
        ends (a lock is not first come, first served). Counted inside the try: a KeyboardInterrupt the moment the
        count went up (its `with` left) must not leave it up, or every later generate waited for ever."""
        counted = False
        try:
            with self._turn:
                self._controls_waiting += 1
                counted = True
            with self.lock:
                yield
        finally:
            if counted:
                with self._turn:
                    self._controls_waiting -= 1
                    self._turn.notify_all()

    def yield_to_controls(self) -> None:
        """Wait (outside the lock) while another thread's control (pause_generation, sleep...) waits for the lock or
        runs: a loop that steps calls it before each step, or it would take the lock again at once, and the pause
        would wait for its whole generate (a lock is not first come, first served). Not while this thread holds the
        lock (a generate inside collective_rpc's or apply_model's function): the control waits for it."""
        if self.lock._is_owned():
            return
        with self._turn:
            self._turn.wait_for(lambda: not self._controls_waiting)

    def is_paused(self) -> bool:
        """vLLM's is_paused: whether pause_generation() holds the engine (until resume_generation()), or a step would
        run nothing: requests sleep(mode="keep") paused wait for wake_up() (after level 2, and reload_weights())."""
        return self._paused or self.stalled()

    def stalled(self) -> bool:
        """Whether a step would run nothing: the engine is paused (pause_generation) or asleep with requests left
        waiting, and no output is left to hand out. A loop that steps while has_unfinished_requests() waits instead
        (another thread resumes or wakes the engine)."""
        return (self._paused or self._sleep.asleep or self._sleep.discarded) and not self._aborted \
            and not self._carried

    def check_pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """pause_generation()'s checks, made before anything is done (a server makes them before it waits)."""
        self._check_open()
        if not isinstance(mode, str) or mode not in MODES:
            raise RequestError(f"pause mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}"[:200],
                               "\"abort\" ends the requests running, \"wait\" lets them finish first, \"keep\" "
                               "freezes them until resume_generation() (e.g. pause_generation(mode=\"keep\"))")
        if not isinstance(clear_cache, bool):
            raise RequestError(f"clear_cache must be True or False, got {clear_cache!r}"[:200])
        if mode == "wait" and self._frozen():
            raise PauseError("pause_generation(mode=\"wait\") while requests are frozen (paused, or asleep): they "
                             "cannot run to their end", "resume_generation() (and wake_up()) first, or "
                             "pause_generation(mode=\"abort\") to end them", "POST /resume (and POST /wake_up) "
                             "first, or POST /pause?mode=abort to end them")

    def _steps_requests(self) -> bool:
        """Whether a step would run the model for a request: not while paused or asleep (the outputs left to hand
        out, of requests a pause or a sleep ended or settled, are not run again: reload_weights() may come first)."""
        held = self._paused or self._sleep.asleep or self._sleep.discarded
        return not held and (self.scheduler.has_unfinished() or self._inflight is not None
                             or self._unsettled is not None)

    def _frozen(self) -> bool:
        """Whether requests wait that no step runs now (paused, or asleep with requests a "keep" paused)."""
        return (self._paused or (self._sleep.asleep and self._sleep.paused)) and self.scheduler.has_unfinished()

    def check_sleep(self, level: int = 1, mode: str = "abort") -> None:
        """sleep()'s checks, made before anything is done (a server checks them before it waits for requests)."""
        self._check_open()
        if not self.config.enable_sleep_mode:
            raise SleepModeError("this engine was started without sleep mode",
                                 "start it with enable_sleep_mode=True (LLM(..., enable_sleep_mode=True); infer "
                                 "serve --enable-sleep-mode)")
        if isinstance(level, bool) or level not in (1, 2):
            raise RequestError(f"sleep level must be 1 (weights to host memory, KV cache freed) or 2 (both freed), "
                               f"got {level!r}"[:200], "e.g. sleep(level=1)")
        if not isinstance(mode, str) or mode not in MODES:
            raise RequestError(f"sleep mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}"[:200],
                               "\"abort\" ends the requests running, \"wait\" lets them finish first, \"keep\" pauses "
                               "them until wake_up() (e.g. sleep(level=1, mode=\"keep\"))")
        if mode == "wait" and self._sleep.asleep and self._sleep.paused and self.scheduler.has_unfinished():
            raise SleepModeError("sleep(mode=\"wait\") while the engine is asleep with requests an earlier "
                                 "sleep(mode=\"keep\") paused: they cannot run to their end while it sleeps",
                                 "wake_up() first and they run on, or sleep(mode=\"abort\") to end them "
                                 "(mode \"keep\" leaves them paused)")
        if mode == "wait" and self._frozen():
            raise PauseError("sleep(mode=\"wait\") while generation is paused with requests waiting: they cannot run "
                             "to their end", "resume_generation() first, or sleep(mode=\"abort\") to end them (mode "
                             "\"keep\" leaves them paused)", "POST /resume first, or POST /sleep?mode=abort to end "
                             "them")

    def _run_to_end(self) -> None:
        """Step until every request has ended (sleep(mode="wait")); their outputs are handed out by the next step."""
        outputs: list[RequestOutput] = []
        try:
            while self.has_unfinished_requests() and not self.stalled():  # (stalled: requests a "keep" paused
                # and the weights a level 2 discarded not loaded again: they wait for reload_weights(), not run)
                outputs += self.step()
        finally:
            self._carried = outputs + self._carried

    def reload_weights(self) -> None:
        """vLLM's reload_weights (collective_rpc("reload_weights")): the model's weights read again from its
        folder (the checkpoint there now: new weights written over it are taken), after sleep(level=2) and
        wake_up(["weights"]), or at any time while no request runs. The KV cache may still be asleep (vLLM's RLHF
        order: wake the weights, reload them, then wake the KV cache). On a GPU a new experts' layout (group size,
        act-order) has its fused MoE tuned (the buckets no table holds: kernels.moe_tune) and its variants compiled
        before requests run again, as the start does."""
        self._check_open()
        if WEIGHTS in self._sleep.tags:
            raise SleepModeError("the weights are asleep", "wake them first: wake_up([\"weights\"])",
                                 "wake them first: POST /wake_up?tags=weights")
        if self._steps_requests():  # (those paused, or a sleep(mode="keep") paused, hold no K/V: they go on with
            raise RequestError("reload_weights() while requests run",  # the new weights)
                               "wait for them to finish, or pause generation first: pause_generation() (mode "
                               "\"keep\" to go on with them after resume_generation()), or sleep(mode=\"keep\")")
        from ..models.loader import check_weights, load_model
        from .sleep import free
        # what a load refuses, and another model, refused from the files' headers before anything is freed (another
        # group size, act-order, sym or bits is taken: _adopt_weights)
        _check_reloadable(self.runner.model, check_weights(self.model_path, self.device), self.model_path)
        self._check_reload_fits()  # (a load that runs out of memory once the old weights are freed leaves none)
        self._drop_graphs()  # (their addresses are the old weights')
        # the old weights' memory first (one model's worth at a time); until the new ones are in (a load that fails
        # leaves none), requests are refused
        self._sleep.discarded = True
        free(module_tensors(self.runner.model.modules()), self.device)
        self._free_device_cache()
        fresh, _ = load_model(self.model_path, self.dtype, self.device, max_positions=self.max_model_len)
        _adopt_weights(self.runner.model, fresh)
        del fresh
        self._sleep.discarded = False
        if "moe_tuning_s" in self.start_times:  # (an engine that tuned the fused MoE at start: a GPU's) a new
            from ..kernels import moe_tune  # experts' layout's buckets no table holds, before its variants compile
            moe_tune.tune_model(self.runner.model, self.config.max_num_batched_tokens, self.device, log=log.info)
        if self._moe_warmed:  # (an engine that warmed its kernels at start: a GPU's) the fused
            self._warm_moe_blocks(decode=True)  # MoE's variants of a new experts' layout now, not on a user's request
        self.block_manager.reset_prefix_cache(counters=False, in_use=True)  # K/V of the old weights
        self._free_device_cache()
        if not self._sleep.asleep:
            self._sleep.paused = False
            self._recapture()

    def _check_reload_fits(self) -> None:
        """reload_weights()' memory check, from the new checkpoint's headers before the loaded weights are freed: its
        weights (their bytes once loaded, memory.checkpoint) must fit what the loaded ones free and the engine's
        memory plan leaves of its budget (--memory-limit, --gpu-memory-utilization), and on CUDA the device's free
        memory: an OutOfMemoryError naming both sizes, the engine serving on with the loaded weights."""
        from ..memory.checkpoint import checkpoint_load_bytes
        from ..memory.sizes import gib, weights_bytes
        from ..models.loader import load_config
        from ..models.rope import rope_table_bytes
        cfg = load_config(self.model_path)
        new = checkpoint_load_bytes(self.model_path, cfg, self.dtype, self.device)
        new += rope_table_bytes(cfg, self.max_model_len, self.dtype, self.device)  # (the table load_model builds)
        old = weights_bytes(self.runner.model)
        plan = self.memory_plan
        # what the plan holds besides the model's weights: activations, adapter slots, reserve, KV cache, a draft's
        draft = weights_bytes(self.drafter.model) if self.drafter is not None else 0
        others = (plan.activation_peak_bytes + plan.lora_bytes + plan.reserve_bytes
                  + plan.kv_blocks * plan.kv_block_bytes + draft)
        cuda = self.device.type == "cuda"
        more = "--gpu-memory-utilization" if cuda else "--memory-limit"
        sizes = (f"the new checkpoint's weights take {gib(new)} ({new:,} bytes) once loaded, the loaded ones "
                 f"{gib(old)} ({old:,} bytes)")  # (bytes too: a few bits more differ by less than a rounded size)
        if new + others > plan.budget_bytes:
            raise OutOfMemoryError(
                f"{self.model_path}: reload_weights() does not fit: {sizes}; with the KV cache, activations"
                + (", adapter slots" if plan.lora_bytes else "") + f" and reserve ({gib(others)}) they pass the "
                f"engine's budget of {gib(plan.budget_bytes)}",
                f"the engine serves on with the loaded weights; write a checkpoint whose weights take at most "
                f"{max(0, plan.budget_bytes - others):,} bytes (fewer bits, a smaller dtype), or start a new engine on "
                f"it with a larger budget ({more}: at least {new + others:,} bytes in all)")
        if cuda:  # the device's free memory (other processes' use included) and what torch holds unused
            free = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device) \
                - torch.cuda.memory_allocated(self.device)
            if new - old > free:
                raise OutOfMemoryError(
                    f"{self.model_path}: reload_weights() does not fit: {sizes}, {gib(new - old)} more than the "
                    f"{gib(free)} the GPU has free",
                    "the engine serves on with the loaded weights; free GPU memory (other processes), or write a "
                    "smaller checkpoint (fewer bits, a smaller dtype)")

    @control
    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's collective_rpc: `method` (a name, or a function of the worker) on every worker, their results in
        a list: infer runs one (engine.worker.Worker), so the list holds one result. `timeout` is taken, unused
        (the call runs here, between two steps)."""
        from .worker import call_worker
        self._check_open()
        return call_worker(self, method, args, kwargs)

    def check_awake(self) -> None:
        if self._sleep.asleep:
            raise SleepModeError(f"the engine is asleep ({' and '.join(sorted(self._sleep.tags))} freed by a "
                                 f"level {self._sleep.level} sleep)",  # (no Python call: servers' clients read it)
                                 "wake it first: wake_up() (infer serve: POST /wake_up)" if not self._sleep.discarded
                                 else "load new weights first: wake_up(tags=[\"weights\"]), "
                                 "collective_rpc(\"reload_weights\"), then wake_up()",
                                 "POST /wake_up, then retry" if not self._sleep.discarded else
                                 "POST /wake_up?tags=weights, POST /collective_rpc {\"method\": \"reload_weights\"}, "
                                 "then POST /wake_up, then retry")
        if self._sleep.discarded:
            raise SleepModeError("the engine's weights were discarded (by sleep(level=2), or a reload_weights() that "
                                 "failed) and not loaded again",
                                 "load them: reload_weights() (vLLM's collective_rpc(\"reload_weights\"); infer "
                                 "serve: POST /collective_rpc {\"method\": \"reload_weights\"})",
                                 "load them: POST /collective_rpc {\"method\": \"reload_weights\"}, then retry")

    def _check_slots_awake(self, what: str) -> None:
        """The adapter slots are device memory sleep() freed: changed only once awake (a removal clears its slot)."""
        if WEIGHTS in self._sleep.tags:
            raise SleepModeError(f"{what}() while the engine is asleep (its adapter slots are freed)",
                                 "wake it first: wake_up()", "POST /wake_up first, then retry")

    def _drop_graphs(self) -> None:
        """Drop the CUDA graphs (they hold the addresses of the memory sleep frees), noting how to capture them."""
        runner, dropped = self.runner, self._dropped_replays
        if runner.graphs is not None:
            self._graph_plan = (runner.graphs.max_blocks * self.config.block_size, runner.graphs.emulate)
            dropped["cuda_graph_replays"] += sum(runner.graphs.replays.values())
        if runner.pieces is not None:
            dropped["piecewise_graph_steps"] += sum(runner.pieces.replays.values())
        runner.graphs = runner.pieces = None
        if self.drafter is not None:
            if self.drafter.graphs is not None:
                dropped["draft_cuda_graph_replays"] += sum(self.drafter.graphs.replays.values())
            self.drafter.graphs = None
        if self.device.type == "cuda":
            from ..kernels import gptq_gemm
            gptq_gemm.release_scratch(self.device)  # (capture_graphs reserves it again)

    def _recapture(self) -> None:
        """The CUDA graphs sleep() dropped, captured again over the memory as it is now."""
        plan, self._graph_plan = self._graph_plan, None
        if plan is not None and self.runner.graphs is None:
            drafter = self.drafter
            counts = (drafter.eager_forwards, drafter.context_skips) if drafter is not None else None
            self.runner.capture_graphs(plan[0], emulate=plan[1])
            self.runner.graphs.replays.clear()  # (the capture's own runs: not a request's, as at the start)
            if drafter is not None:  # (the draft's the same; its eager forwards and skipped steps carry on)
                if drafter.graphs is not None:
                    drafter.graphs.replays.clear()
                drafter.eager_forwards, drafter.context_skips = counts

    def _free_device_cache(self) -> None:
        if self.device.type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Give the device memory back (KV cache, CUDA graphs and their pool, weights); the engine is unusable
        afterwards. LLM.close(), its context manager and the server's shutdown call it."""
        runner = getattr(self, "runner", None)
        if runner is None:
            return
        self._inflight = self._unsettled = None  # a step still on the device is dropped with everything else
        self._aborted, self._carried = [], []  # outputs no step will hand out: nothing is unfinished any more
        for s in list(self.requests.values()):
            self.scheduler.finish(s, "abort")
        self.requests.clear()
        for m in runner.model.modules():
            if hasattr(m, "k_cache"):
                m.k_cache = m.v_cache = None
        runner.graphs = runner.pieces = runner.kv_cache = runner.model = None
        if getattr(self, "drafter", None) is not None:
            self.drafter.close()
            self.drafter = None
        self.runner = None
        self.lora_manager = None
        self._sleep = SleepState()  # (the host copies of a sleep's weights)
        if self.device.type == "cuda":
            from ..kernels import gptq_gemm
            gptq_gemm.release_scratch(self.device)
            import gc
            gc.collect()
            torch.cuda.empty_cache()

    def compile_kernels(self) -> int:
        """Every int4 matmul and LoRA kernel variant the engine can launch for steps of up to max_num_batched_tokens
        tokens, compiled in parallel (a GPU engine's start, after tuning and before graph capture); returns the
        compile calls queued. `warm_kernels` then reaches the rest (attention, norms, rotary) with requests."""
        from ..kernels import moe_tune
        from ..kernels.gptq_tune import compile_model
        most = self.config.max_num_batched_tokens
        lora = [] if self.lora_manager is None else self.lora_manager.compile_calls(most)
        # the fused MoE's launch configs (tuned or heuristic) of every step size too
        extra = lora + [c for m in self._models() for c in moe_tune.compile_calls(m, most)]
        queued = compile_model(self.runner.model, most, self.dtype, extra=extra)
        if self.drafter is not None:  # the draft model's
            queued += compile_model(self.drafter.model, most, self.dtype)
        return queued

    def _models(self) -> list:
        """The model, and a draft model's (speculative decoding: a draft model, an EAGLE head) after it."""
        return [self.runner.model] + ([self.drafter.model] if getattr(self, "drafter", None) is not None else [])

    def _warm_decode_attention(self) -> None:
        """Compile both variants of the Triton decode attention (one partition a sequence, several) on one layer of
        each sliding window (0: full attention; the layers of one window launch the same), of the model and of a
        draft model (speculative decoding: its one-token forwards decode over its own cache, heads and window);
        without Triton (a CPU) there is nothing to compile."""
        from .. import kernels
        for model in self._models():
            windows = set()
            for mod in model.modules():
                if hasattr(mod, "compile_decode") and getattr(mod, "k_cache", None) is not None:
                    if not kernels.use_triton(mod.k_cache):
                        return
                    kind = (getattr(mod, "window", 0), getattr(mod, "chunked", False))  # (Llama 4's chunks: a
                    if kind not in windows:  # variant of their own)
                        windows.add(kind)
                        mod.compile_decode()

    def _warm_moe_blocks(self, decode: bool = False) -> None:
        """Compile the fused MoE's variants of the launch configs (BLOCK_M, and the tuned table's tiles, warps and
        stages: kernels.moe.config_steps) a step of up to max_num_batched_tokens tokens can choose
        (models.moe.SparseMoeBlock.warm_block_sizes), once per shape of sparse layer (with its experts'
        adapter slots or not), of the model and of a draft model (draft-model speculation: its prefills take as
        many tokens). The shapes warmed are kept (`_moe_warmed`): reload_weights warms those its new experts'
        layout (group size, act-order, zero points' format) adds (`decode`: with decode's BLOCK_M, which the start's
        warm-up requests reached), and skips those warmed before."""
        from ..models.moe import SparseMoeBlock
        for mod in (m for model in self._models() for m in model.modules()):
            if isinstance(mod, SparseMoeBlock):
                ex = mod.experts
                stacks = (ex.w13_int4, ex.w2_int4) if mod.int4 is not None else ()
                key = (ex.num_experts, ex.hidden, ex.inter, mod.top_k, mod.float_weights, mod.gate.weight.dtype,
                       tuple((s.group_size, s.perm is None, s.config.zeros_v1) for s in stacks),
                       None if mod.lora is None else tuple(mod.lora.a13.shape))
                if key not in self._moe_warmed:
                    self._moe_warmed.add(key)
                    mod.warm_block_sizes(self.config.max_num_batched_tokens, decode)

    @torch.inference_mode()
    def warm_kernels(self) -> None:
        """Not a measurement: requests through every path a first real step can take (a prefill, decodes, and a
        prefill whose prompt starts with cached blocks when prefix caching is on) so that no kernel is compiled on
        a user's first request; the decode attention's variants with one partition a sequence and with several
        (`kernels.attention.decode_parts` picks by the batch) are compiled directly. With piecewise graphs the
        prompts run eagerly first (the path of steps longer than the graphs take), then one through the graphs."""
        self._check_open()
        bs = self.config.block_size
        # at most max_model_len - 1 tokens: a prompt needs room for a token (--max-model-len 2 was refused at start,
        # "the prompt has 2 tokens", a prompt the user never sent)
        long_prompt = [i % 100 + 1 for i in range(2 * bs + 9)][:max(min(2, self.max_model_len - 1),
                                                                      self.max_model_len - 3)]
        prompts = [long_prompt, long_prompt[:9]]  # a long and a short query: both attention tile heights
        if self.config.enable_prefix_caching:
            prompts.append(long_prompt)  # its first blocks are cached: a short query over a cached prefix
        params = SamplingParams(max_new_tokens=2, ignore_eos=True) if self.pooler is None else PoolingParams()
        pieces, self.runner.pieces = self.runner.pieces, None  # eagerly first: the path of longer steps
        try:
            for i, prompt in enumerate(prompts):
                self.add_request(f"__warmup__{i}", prompt, params)
                while self.has_unfinished_requests():
                    self.step()
        finally:
            self.runner.pieces = pieces
        if pieces is not None:  # then a prefill through the piecewise graphs (no cached prefix: a whole prefill)
            self.add_request("__warmup__pieces", [(i + 7) % 100 + 1 for i in range(len(prompts[1]))], params)
            while self.has_unfinished_requests():
                self.step()
            pieces.replays.clear()
        self._warm_decode_attention()
        self._warm_moe_blocks()
        self._warm_grammar_mask()
        # a fresh engine to its users: no steps, no cached prefixes of made-up prompts, no hits, no replays
        self.num_steps = self.scheduler.num_preemptions = 0
        self.block_manager.reset_prefix_cache()
        if self.runner.graphs is not None:
            self.runner.graphs.replays.clear()
        if self.drafter is not None:  # (the draft's replays and eager forwards too)
            self.drafter.reset_stats()


# config.json's fields the model's layers are built from (not tensors reload_weights takes): another value is
# another model
_SAME_CONFIG = ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "sliding_window", "layer_types",
                "hidden_act", "hidden_activation", "num_attention_heads", "num_key_value_heads", "head_dim",
                "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "partial_rotary_factor",
                "use_sliding_window", "max_window_layers",
                # a mixture of experts' routing (top k, Qwen's renormalized weights) and gpt-oss's clamped SwiGLU
                "num_experts_per_tok", "norm_topk_prob", "swiglu_limit", "swiglu_alpha",
                # Granite's scalars (Granite SWA's too) and Granite SWA's bases by layer (0: no rotary)
                "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                "layer_rope_theta",
                # Granite 4.0's rope or none, Mamba-2's chunk and time step limits
                "position_embedding_type", "mamba_chunk_size", "time_step_limit")


def _check_reloadable(model, fresh, path) -> None:
    """reload_weights takes new weights of the loaded model: `fresh` (the new checkpoint's model, on the meta device)
    must have its float tensors' shapes and quantize the same layers (GPTQ or float); a ModelLoadError names the
    first that differs."""
    hint = ("reload_weights() takes new weights of the same model, its layers quantized as the loaded ones (their "
            "group size, act-order, sym and bits may change); for another model, or other layers quantized, start a "
            "new engine on it")
    new_modules = dict(fresh.named_modules())
    old_modules = dict(model.named_modules())
    head_follows = hasattr(model, "untie_head")  # (a tied config's head: untied by the load where the checkpoint
    # stores another lm_head, which the headers do not tell; _adopt_weights takes the load's)
    for name, mod in old_modules.items():  # a mixture of experts' stacks: float, int4 GPTQ or MXFP4 (their modules)
        was, now = (_experts_kind(m) for m in (mod, new_modules.get(name)))
        if was != now and None not in (was, now):
            raise ModelLoadError(f"{path}: {name} are {now} in the new checkpoint, {was} in the loaded one", hint)
    for names, there, has in ((old_modules, new_modules, "has no {} (the loaded model has it)"),
                              (new_modules, old_modules, "has {} (the loaded model has not)")):
        missing = next((n for n in names if n not in there and not (n == "lm_head" and head_follows)), None)
        if missing is not None:  # (another number of layers: a module the reload would leave freed, or not load)
            raise ModelLoadError(f"{path}: the new checkpoint {has.format(missing)}: its config.json builds another "
                                 "model (another number of layers?)", hint)
    for key in _SAME_CONFIG:  # what the layers computed from config.json at build (the rope table, an eps, a
        was, now = (getattr(getattr(m, "config", None), key, None) for m in (model, fresh))  # window): not reloaded
        if was != now:
            raise ModelLoadError(f"{path}: config.json's {key} is {str(now)[:80]} in the new checkpoint, "
                                 f"{str(was)[:80]} in the loaded one", hint)
    for name, mod in model.named_modules():
        new = new_modules.get(name)
        if new is None:  # (a head the load decides: head_follows)
            continue
        if hasattr(mod, "method") and hasattr(new, "method"):
            was, now = (getattr(m.method, "config", None) is not None for m in (mod, new))
            if was != now:
                what = {True: "quantized (GPTQ)", False: "float"}
                raise ModelLoadError(f"{path}: {getattr(mod, 'names', [name])[0]} is {what[now]} in the new "
                                     f"checkpoint, {what[was]} in the loaded one", hint)
        for key, old in mod._parameters.items():
            value = new._parameters.get(key)
            if old is not None and value is not None and old.shape != value.shape:
                raise ModelLoadError(f"{path}: {name}.{key} has shape {tuple(value.shape)} in the new checkpoint, "
                                     f"{tuple(old.shape)} in the loaded one", hint)


def _experts_kind(module) -> str | None:
    """How a mixture of experts' stacked experts (models.moe.Experts) hold their weights: "float", "int4 GPTQ"
    (Int4Stack) or "MXFP4" (Mxfp4Stack, gpt-oss's as the hub stores them); None for any other module."""
    if not (hasattr(module, "w13") and hasattr(module, "mxfp4") and hasattr(module, "int4")):
        return None
    return "MXFP4" if module.mxfp4 else "int4 GPTQ" if module.int4 else "float"


def _adopt_weights(model, fresh) -> None:
    """The tensors of `fresh` (the same checkpoint loaded again) in `model`, module by module: parameters keep their
    objects (a tied head stays the embeddings'), buffers and tensor attributes are taken as they are, and a module's
    ADOPTED_ATTRS (what its load computed from the tensors: an Int4Stack's group_size) with them; the KV cache's
    views and whatever else is not a tensor of `fresh` (adapter hooks, kernel choices) stay."""
    from .sleep import KV_ATTRS
    new_modules = dict(fresh.named_modules())
    for name, mod in model.named_modules():
        new = new_modules.get(name)
        if new is None:
            continue
        for key, value in new._parameters.items():
            old = mod._parameters.get(key)
            if old is not None and value is not None and old.shape == value.shape and old.dtype == value.dtype:
                old.data = value.data
            else:
                mod._parameters[key] = value
        for key, value in new._buffers.items():
            mod._buffers[key] = value
        for key, value in vars(new).items():
            if key not in KV_ATTRS and isinstance(value, torch.Tensor):
                setattr(mod, key, value)
        for key in getattr(new, "ADOPTED_ATTRS", ()):  # what a load computed from the tensors, held as no tensor
            if hasattr(new, key):  # (a float layer has no GPTQ layout)
                setattr(mod, key, getattr(new, key))
    if hasattr(model, "untie_head") and model.tie_word_embeddings != fresh.tie_word_embeddings:
        # a tied config's head, untied by one load and not the other (the checkpoint's lm_head differs from its
        # embeddings or not): the new load's, as a fresh engine's (the old head was freed, or never loaded)
        model.tie_word_embeddings = fresh.tie_word_embeddings
        if fresh.tie_word_embeddings:
            del model.lm_head
        else:
            model.lm_head = fresh.lm_head


def _bad_word_ids(tokenizer, vocab: int, words: tuple[str, ...]) -> list[list[int]]:
    """LLMEngine.bad_word_ids, uncached."""
    out: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(alone)
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
        if any(t >= vocab for t in alone + spaced):
            raise RequestError(f"bad_words: {word!r} has a token outside the model's vocabulary (0..{vocab - 1})",
                               "remove it: the model cannot generate it anyway")
    return [ids for ids in out if ids]
