"""AsyncLLM: vLLM's asyncio engine API, for a program that runs its own event loop (a web app, an agent loop).

    llm = AsyncLLM("tiny-llama", max_model_len=512)
    async for out in llm.generate("Hello", SamplingParams(max_new_tokens=16), request_id="r1"):
        print(out.delta_text, end="")
    llm.shutdown()

One background thread owns the LLMEngine (serve.async_engine.AsyncEngine, the same loop `infer serve` runs), so
many `generate` calls of one event loop batch together; each yields the request's RequestOutput as its tokens arrive
(`text` the reply so far, `delta_text` the new text, `finished` on the last). Leaving the `async for` early (break,
an exception, the task cancelled) aborts the request and frees its KV blocks, as vLLM's does.
"""

from __future__ import annotations

import asyncio
import copy
import numbers
from collections.abc import Iterable
from dataclasses import fields, replace
from typing import AsyncIterator

from ..engine.config import EngineConfig
from ..engine.inputs import encode_prompt
from ..engine.llm_engine import LLMEngine, _check_request_id, prompt_dict, request_inputs, salted_params
from ..engine.outputs import CompletionOutput, RequestOutput, as_delta
from ..engine.pooling import PoolingParams
from ..engine.sampling_params import RequestOutputKind, SamplingParams
from ..engine.sleep import PAUSED
from ..errors import ClosedError, LoRANameError, RequestError, RequestIdTypeError
from .async_engine import AsyncEngine, RequestIdInUseError, ShuttingDownError


class AsyncLLM:
    """vLLM's AsyncLLM: `AsyncLLM(model, **options)` takes LLM's options (EngineConfig's fields); `generate` is an
    async generator of RequestOutputs, `abort`, `add_lora`, `remove_lora` and `list_loras` act between two steps of
    the engine thread, `shutdown()` (or `with` / `async with`) stops it and frees the engine's memory."""

    def __init__(self, model: str, **engine_options):
        from ..engine.llm import _check_options, _slots_within_cpu
        engine_options = _check_options(engine_options)
        self.engine = LLMEngine(EngineConfig(model=model, **_slots_within_cpu(engine_options)))
        self.tokenizer = self.engine.tokenizer
        self._loop = AsyncEngine(self.engine)
        self._loop.start()
        self._closed = False
        self._streams: dict[str, tuple] = {}  # request id -> (event loop, queue) of its generate, for abort()

    @classmethod
    def from_engine_args(cls, engine_args, start_engine_loop: bool = True, usage_context=None,
                         stat_loggers=None) -> "AsyncLLM":
        """vLLM's AsyncLLM.from_engine_args (and AsyncLLMEngine's): the AsyncLLM of an AsyncEngineArgs (or an
        EngineArgs); its engine thread starts at once (vLLM's start_engine_loop True); `usage_context`, vLLM's
        telemetry tag, is ignored."""
        from ..engine.arg_utils import engine_config_of
        config = engine_config_of(engine_args, f"{cls.__name__}.from_engine_args", stat_loggers)
        if start_engine_loop is not True:
            raise RequestError(f"{cls.__name__}.from_engine_args takes start_engine_loop only as True: infer's "
                               "engine thread starts with the engine", "drop the keyword")
        options = {f.name: getattr(config, f.name) for f in fields(EngineConfig) if f.name != "model"}
        return cls(config.model, **options)

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       *, lora: str | None = None, priority: int = 0, lora_request=None, **vllm
                       ) -> AsyncIterator[RequestOutput]:
        """Run one prompt (text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids} with an optional
        "cache_salt"), yielding its RequestOutput at every step that changed it; the last has `finished` set (an
        engine failure ends it with finish_reason "error" and `error`). vLLM's `sampling_params.output_kind`:
        RequestOutputKind.DELTA, each output's `outputs[0]` holds only what is new (text, token_ids, logprobs);
        FINAL_ONLY, only the finished output is yielded. `request_id` must be unique among the
        requests in flight (vLLM's third argument; a string). `lora`: a registered adapter's name (or vLLM's
        `lora_request`, a LoRARequest, registered under its lora_name on first use); `priority` needs
        scheduling_policy="priority" unless it is 0. With `n` > 1 the prompt's n samples run as requests
        "{j}_{request_id}" (vLLM's child ids; sample j draws with seed + j) and, as vLLM's, each output carries the
        sample that changed (`outputs[0].index` says which; `finished` once all are), or with FINAL_ONLY one output
        of all n. vLLM's other keywords are taken at the values that change nothing here (_VLLM_GENERATE: a bare
        TypeError before). A bad request raises RequestError before anything runs."""
        _check_vllm_keywords(vllm)
        self._check_open()
        if lora_request is not None:  # vLLM's: its folder registered under its lora_name on first use
            if lora is not None:
                raise RequestError("generate() got both lora and lora_request", "give one")
            lora = await self._lora_of(lora_request)
        if not isinstance(request_id, str):
            raise RequestIdTypeError(f"request_id must be a string, got {type(request_id).__name__}",
                                     "give every request its own id, e.g. str(uuid.uuid4())")
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise RequestError(f"priority must be an integer, got {priority!r}"[:200])
        ids, params = await asyncio.to_thread(self._inputs, prompt, sampling_params)
        if priority:
            params = replace(params, priority=int(priority))
        n, kind = params.n, params.output_kind
        rids = [request_id] if n == 1 else [f"{j}_{request_id}" for j in range(n)]
        if request_id in self._streams:  # (n > 1 runs child ids: the engine does not see the parent's in use)
            raise RequestIdInUseError(f"request id {request_id!r} is already in use",
                                      "give every request in flight its own id, e.g. str(uuid.uuid4())")
        queue: asyncio.Queue = asyncio.Queue()
        with self._loop.admitting():  # every sample with the same adapter weights: no reload between two of them
            for j, rid in enumerate(rids):
                try:
                    self._loop.add(rid, ids, params if n == 1 else params.sample(j), lora, queue)
                except BaseException as e:  # (the id in use, a full queue): none of the samples runs
                    for added in rids[:j]:
                        self._loop.abort(added)
                    self._closed_while(e)
                    raise
        stream = self._streams[request_id] = (asyncio.get_running_loop(), queue, rids)
        left = set(rids)  # the samples not finished yet
        sent = {rid: [0, 0, 0, 0.0, False] for rid in rids}  # (DELTA: as_delta)
        finals: dict[str, RequestOutput] = {}
        try:
            while left:
                out = await queue.get()
                if out is None:  # abort() from elsewhere: the request ends without a further output
                    left.clear()
                    break
                rid = out.request_id
                if out.finished:
                    left.discard(rid)
                    finals[rid] = out
                if kind == RequestOutputKind.FINAL_ONLY:
                    if left:
                        continue
                    out = out if n == 1 else RequestOutput.merged([finals[r] for r in rids])
                elif n > 1 or kind == RequestOutputKind.DELTA:
                    out = copy.copy(out)  # (the engine thread's object is left as it was)
                    j = rids.index(rid)
                    if kind == RequestOutputKind.DELTA:
                        as_delta(out, sent[rid], j)
                    else:
                        out._samples = [CompletionOutput.of(out, j)]
                    out.finished = not left
                out.request_id = request_id
                if not left and self._streams.get(request_id) is stream:  # the id is free again once all samples
                    del self._streams[request_id]  # finished, as the engine's is: not when the caller closes this
                yield out
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            for rid in left:  # the caller stopped reading (break, cancel, an error): free its requests now
                self._loop.abort(rid)

    async def encode(self, prompt, pooling_params: PoolingParams | None = None, request_id: str | None = None, *,
                     lora: str | None = None, priority: int = 0, lora_request=None,
                     truncate_prompt_tokens: int | None = None):
        """vLLM's AsyncLLM.encode on a pooling engine (AsyncLLM(model, runner="pooling")): yields the prompt's one
        finished EmbeddingRequestOutput (its vector in `.outputs.embedding`; PoolingParams(task="token_embed" or
        "token_classify"): a PoolingRequestOutput, a row per prompt token in `.outputs.data`); the prompt,
        request_id, adapters and priority as generate takes them; `truncate_prompt_tokens` (vLLM's argument: the
        prompt's last tokens kept, -1 the context's worth) overrides the params' own."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise RequestError(f"pooling_params must be a PoolingParams, got {type(params).__name__}",
                               "e.g. PoolingParams(dimensions=256)")
        if truncate_prompt_tokens is not None:  # (a copy: the caller's params are left as they were)
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens).checked()
        from ..engine.llm import embedded
        async for out in self.generate(prompt, params, request_id, lora=lora, priority=priority,
                                       lora_request=lora_request):
            yield embedded([out])[0] if out.finished else out  # (one a pause or sleep ended: raised, named)

    async def beam_search(self, prompt, request_id: str, params, lora_request=None, *, lora: str | None = None,
                          priority: int = 0) -> AsyncIterator[RequestOutput]:
        """vLLM's EngineClient.beam_search (what its server runs for use_beam_search): `params` a BeamSearchParams;
        the search runs one step at a time on the engine thread beside the other requests, and yields one finished
        RequestOutput whose `outputs` are the beam_width best beams, best first (each its own text and token_ids, a
        final EOS only with include_stop_str_in_output, and per token the logprobs of the candidates it was chosen
        from); finish_reason "error" or "abort" (with `error`) if the engine failed it or shut down. Leaving it
        early aborts the steps in flight. pause_generation(mode="abort") ends it at once: the beams it had,
        finish_reason "abort"; "keep" and "wait": it goes on after resume_generation()."""
        from ..engine.beam import BeamSearchParams
        from .beams import ServedBeamSearch
        self._check_open()
        if not isinstance(params, BeamSearchParams):
            raise RequestError(f"beam_search takes a BeamSearchParams, got {type(params).__name__}",
                               "e.g. BeamSearchParams(beam_width=4, max_tokens=32)")
        if lora_request is not None:
            if lora is not None:
                raise RequestError("beam_search() got both lora and lora_request", "give one")
            lora = await self._lora_of(lora_request)  # (registered on first use, as generate's)
        if not isinstance(request_id, str):
            raise RequestIdTypeError(f"request_id must be a string, got {type(request_id).__name__}",
                                     "give every request its own id, e.g. str(uuid.uuid4())")
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise RequestError(f"priority must be an integer, got {priority!r}"[:200])
        width = params.beam_width
        step = SamplingParams(max_new_tokens=params.max_tokens, logprobs=2 * width, priority=int(priority))
        ids, step = await asyncio.to_thread(self._inputs, prompt, step)
        search = ServedBeamSearch(self._loop, self.tokenizer, set(self.engine.eos_token_ids),
                                  self.engine.max_model_len, [ids] * width, width, params, step, lora, request_id)
        try:
            search.start()
        except BaseException as e:
            self._closed_while(e)
            raise
        outs: dict[str, RequestOutput] = {}
        try:
            while len(outs) < width:
                out = await search.queue.get()
                outs[out.request_id] = out
        finally:
            if len(outs) < width:  # the caller stopped waiting: the search's steps are aborted
                search.abort()
        beams = [outs[cid] for cid in search.ids]
        # (a pause_generation(mode="abort") ended it: every beam it had, finish_reason "abort", as the server's)
        failed = (o for o in beams if o.finish_reason == "error" or (o.finish_reason == "abort" and o.error != PAUSED))
        out = next(failed, None) or RequestOutput.merged(beams)
        out.request_id = request_id
        yield out

    def _inputs(self, prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the request's own checked params (off the event loop: tokenizing a long text
        takes a while)."""
        text = None
        if isinstance(prompt, dict):
            params = salted_params(prompt, params)
            key, prompt = prompt_dict(prompt)
            text = prompt if key == "prompt" else None
        elif isinstance(prompt, str):
            text = prompt
        if text is not None:  # tokenized as LLM.generate tokenizes it; certainly too long: refused untokenized
            keep = isinstance(params, (SamplingParams, PoolingParams)) and params.truncate_prompt_tokens is not None
            prompt = encode_prompt(self.tokenizer, prompt=text, max_tokens=None if keep else
                                   self.engine.max_model_len)
        if isinstance(params, PoolingParams):  # (encode: the engine refuses it unless it pools)
            return request_inputs(prompt, None)[0], params.checked()
        ids, params = request_inputs(prompt, params)
        return ids, params.checked()

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests (vLLM's abort): each one's generate ends without a further output, its KV blocks freed.
        Every id is checked before any is stopped, as LLMEngine.abort_request checks them: abort(7) was a bare
        "'int' object is not iterable", and abort([7]) stopped nothing without a word. A sample's own id (n > 1:
        "{j}_{request_id}") ends its parent's generate as the parent's id does."""
        one = isinstance(request_id, (str, bytes)) or not isinstance(request_id, Iterable)
        ids = [request_id] if one else list(request_id)
        for rid in ids:
            _check_request_id(rid)
        for rid in ids:
            stream = self._streams.get(rid) or next(  # a sample's own id ("{j}_{id}") stops its parent's generate:
                (s for s in list(self._streams.values()) if len(s[2]) > 1 and rid in s[2]), None)  # (it hung)
            for request in stream[2] if stream is not None else [rid]:  # (each of its n samples)
                self._loop.abort(request)
            if stream is not None:  # wake its generate (maybe of another event loop), which awaits its queue
                loop, queue, _ = stream
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, None)
                except RuntimeError:  # that event loop is closed: nobody is reading
                    pass

    # ------------------------------------------------------------------ adapters
    async def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Register a PEFT adapter folder under `name` while requests run (read on a worker thread, added between
        two steps); `replace=True` (vLLM's load_inplace) swaps the weights of a loaded name for new requests."""
        self._check_open()
        await self._control(self._loop.add_lora(name, path, replace))

    async def _lora_of(self, request) -> str:
        from ..lora.request import to_register
        name, path = to_register(request, self.engine.lora_slots)
        if path is not None:
            try:
                await self.add_lora(name, path)
            except LoRANameError:  # another generate registered it meanwhile: fine if from the same folder (a
                if to_register(request, self.engine.lora_slots)[1] is not None:  # clash raises its own error),
                    raise  # else this one stands
        self.engine.note_lora_request(name, request)  # (RequestOutput.lora_request: this object)
        return name

    async def reset_prefix_cache(self) -> bool:
        """vLLM's AsyncLLM.reset_prefix_cache: forget every cached prefix, between two steps (running requests keep
        their blocks)."""
        self._check_open()
        return await self._control(self._loop.reset_prefix_cache())

    async def sleep(self, level: int = 1, mode: str = "abort", timeout: float | None = None) -> None:
        """vLLM's AsyncLLM.sleep (sleep mode: AsyncLLM(..., enable_sleep_mode=True)): level 1 moves the weights to
        host memory and frees the KV cache, level 2 frees both (LLMEngine.sleep). `mode` (vLLM's): the generates
        running end with finish_reason "abort" ("abort", the default), run to their end before the memory is freed
        ("wait": new ones are refused meanwhile), or are paused and go on after wake_up() ("keep"); new ones are
        refused (SleepModeError) until wake_up(). `timeout` (seconds, mode "wait"): SleepTimeoutError if generates
        still run then (the engine goes to sleep once they end, new generates refused meanwhile)."""
        self._check_open()
        await self._control(self._loop.sleep(level, mode, timeout))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's AsyncLLM.wake_up: the memory of `tags` ("weights", "kv_cache"; None: both) on the device again."""
        self._check_open()
        await self._control(self._loop.wake_up(tags))

    async def is_sleeping(self) -> bool:
        """vLLM's AsyncLLM.is_sleeping (a coroutine, as vLLM's)."""
        self._check_open()
        return self._loop.is_sleeping()

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool | None = None, timeout: float | None = None) -> None:
        """vLLM's AsyncLLM.pause_generation (an RL trainer's, around a weight update): from this call until
        resume_generation(), new generates wait (not refused) and then run. `mode`: the generates running end with
        finish_reason "abort" ("abort", the default), run to their end before this returns ("wait"), or are frozen
        and finish after resume_generation() with the greedy tokens of an uninterrupted run ("keep");
        `clear_cache` forgets the prefix cache. vLLM's older `wait_for_inflight_requests=True` is mode "wait".
        `timeout` (seconds, mode "wait"): PauseTimeoutError if generates still run then (generation stays paused,
        they run on). While asleep (sleep()) new generates are refused as ever; pause and sleep are independent
        (LLMEngine.pause_generation)."""
        self._check_open()
        if wait_for_inflight_requests is not None:  # (vLLM's older keyword)
            if not isinstance(wait_for_inflight_requests, bool):
                raise RequestError(f"wait_for_inflight_requests must be True or False, got "
                                   f"{wait_for_inflight_requests!r}"[:200])
            if wait_for_inflight_requests and mode not in ("abort", "wait"):
                raise RequestError(f"pause_generation got wait_for_inflight_requests=True and mode={mode!r}",
                                   "give mode alone: mode=\"wait\" is what wait_for_inflight_requests=True was")
            mode = "wait" if wait_for_inflight_requests else mode
        await self._control(self._loop.pause(mode, clear_cache, timeout))

    async def resume_generation(self) -> None:
        """vLLM's AsyncLLM.resume_generation: the generates that waited, and those "keep" froze, run again."""
        self._check_open()
        await self._control(self._loop.resume())

    async def is_paused(self) -> bool:
        """vLLM's AsyncLLM.is_paused (a coroutine, as vLLM's): from pause_generation() until resume_generation()."""
        self._check_open()
        return self._loop.is_paused()

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """vLLM's AsyncLLM.collective_rpc: `method` (a worker method's name, e.g. "reload_weights", or a function
        called with the worker) on infer's one worker, between two steps: [its result]."""
        self._check_open()
        return await self._control(self._loop.collective_rpc(method, timeout, args, kwargs))

    async def remove_lora(self, name: str) -> int:
        """Unregister an adapter: new requests naming it are refused at once; those running finish with it.
        Returns how many were still running."""
        self._check_open()
        return await self._control(self._loop.remove_lora(name))

    def list_loras(self) -> list[str]:
        self._check_open()  # (after shutdown it answered [] where LLM.list_loras raises ClosedError)
        lm = self.engine.lora_manager
        return sorted(lm.names()) if lm is not None else []

    # ------------------------------------------------------------------ state
    async def get_tokenizer(self, lora_request=None):
        """The model's tokenizer, as vLLM's AsyncLLM.get_tokenizer, a coroutine (`await llm.get_tokenizer()`; an
        adapter's requests use the model's tokenizer, whatever `lora_request` names); `llm.tokenizer` without await."""
        return self.tokenizer

    @property
    def errored(self) -> bool:
        """vLLM's: the engine no longer runs (its thread ended, or shut down); also `dead` and `is_stopped`."""
        return not self.is_running

    dead = is_stopped = errored

    async def do_log_stats(self, *args, **kwargs) -> None:
        """vLLM's AsyncLLM.do_log_stats: infer has no stat loggers to flush (the server's GET /metrics counts)."""

    @property
    def is_running(self) -> bool:
        """vLLM's: the engine thread is alive and taking requests."""
        return not self._closed and self._loop._thread.is_alive()

    async def check_health(self) -> None:
        """vLLM's: raises ClosedError once shut down (or if the engine thread is gone)."""
        if not self.is_running:
            raise ClosedError("this AsyncLLM is not running (shut down)", "create a new AsyncLLM")

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this AsyncLLM was shut down", "create a new AsyncLLM to generate again")

    def _closed_while(self, e: BaseException) -> None:
        """A call that passed _check_open and was then refused because shutdown() ran meanwhile (on another thread,
        while the prompt was tokenized) raises ClosedError, as a call after it does: it was the engine loop's
        ShuttingDownError, "the server is shutting down (retry against another replica)"."""
        if self._closed and isinstance(e, ShuttingDownError):
            raise ClosedError("this AsyncLLM was shut down", "create a new AsyncLLM to generate again") from None

    async def _control(self, call):
        """`await call` (an engine-loop control: add_lora, remove_lora, reset_prefix_cache), which shutdown() on
        another thread may refuse or end once it passed _check_open: ClosedError then, as generate raises."""
        try:
            return await call
        except ShuttingDownError as e:
            self._closed_while(e)
            raise

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop taking requests, give those in flight `timeout` seconds to finish (default: none; each ends with
        finish_reason "abort"), stop the engine thread and free the engine's memory."""
        if self._closed:
            return
        self._closed = True
        # (the engine loop's own message says "the server shut down": there is no server here)
        self._loop.shutdown(timeout, "this AsyncLLM was shut down (AsyncLLM.shutdown()) before the request finished")
        self.engine.close()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass


# vLLM's AsyncLLM.generate keywords infer has no use for -> the values taken (they change nothing here), what to do
_VLLM_GENERATE = {
    "trace_headers": ((None,), "infer sends no OpenTelemetry traces; leave it out"),
    "data_parallel_rank": ((None, 0), "an AsyncLLM runs one engine (`infer serve --data-parallel N` runs "
                                      "replicas); leave it out"),
    "tokenization_kwargs": ((None,), "the prompt is tokenized as the model's tokenizer does by default (give "
                                     "token ids to tokenize it otherwise); leave it out"),
    "prompt_text": ((None,), "give the text as the prompt itself; leave it out"),
}


def _check_vllm_keywords(given: dict) -> None:
    """vLLM's generate keywords at their no-op values; any other keyword, or another value, is a RequestError naming
    it (it was Python's bare "unexpected keyword argument")."""
    for name, value in given.items():
        if name not in _VLLM_GENERATE:
            raise RequestError(f"generate() has no keyword {name!r}",
                               "its keywords are lora, lora_request, priority (and vLLM's "
                               f"{', '.join(_VLLM_GENERATE)} at None)")
        taken, hint = _VLLM_GENERATE[name]
        if not any(value is t or (type(value) is type(t) and value == t) for t in taken):
            raise RequestError(f"generate() takes vLLM's {name} only as {' or '.join(map(repr, taken))}, got "
                               f"{value!r}"[:300], hint)


AsyncLLMEngine = AsyncLLM  # vLLM's name for its asyncio engine (AsyncLLMEngine.from_engine_args), as in vLLM's V1
