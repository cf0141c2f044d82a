"""Baseline: Hugging Face transformers `generate` on static, left-padded batches of `batch_size` requests (a
pooling run's: AutoModel's last_hidden_state pooled, run_hf_embed).

    from infer.bench.hf_baseline import load_hf, run_hf_generate
    hf = load_hf("tiny-llama")                                   # once; a path or a name works too, below
    base = run_hf_generate(hf, workload.requests, batch_size=16)   # -> RunResult (backend "hf")

Each batch is sent at once (its requests' send time is the batch start) and runs greedy until its longest
request has `output_len` tokens; the next batch starts when it is done — what a static batch server does.
A streamer time-stamps every decoding step (it gets the tokens on the CPU, so the GPU has caught up), which gives
TTFT, ITL, TPOT and E2EL for each request, truncated at its own `output_len` (or at its EOS token when the
workload does not ignore EOS). Generation runs with no EOS token at all (transformers 5 fills an eos_token_id of
None back from the checkpoint, so an empty list switches it off): a request that ignores EOS gets the same greedy
tokens as the engine, past any EOS, even beside requests that stop at theirs in the same batch (a stopping criterion
ends those rows at their EOS). The baseline is plain greedy as the engine's requests are: the sampling and logits
processors a checkpoint's generation_config.json asks for (repetition_penalty, no_repeat_ngram_size, ...) are dropped
when the model is loaded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ModelLoadError
from .datasets import BenchRequest
from .driver import Progress
from .metrics import RequestRecord, RunResult, ended
from .monitor import ResourceSampler

WARMUP_TOKENS = 2  # tokens a warmup batch generates: a prefill and a decode step


class StepClock:
    """A transformers streamer that records when each generated token (one per step, whole batch) exists."""

    def __init__(self, sampler: ResourceSampler | None = None):
        self.times: list[float] = []
        self._seen_prompt = False
        self._sampler = sampler

    def put(self, value) -> None:
        if not self._seen_prompt:  # generate() hands the prompt to the streamer first
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())
        if self._sampler is not None:
            self._sampler.sample()

    def end(self) -> None:
        pass


class RowsAtEos:
    """A transformers stopping criterion: the rows in `stops` are done once they generate one of `eos_ids` (the
    other rows ignore EOS and run to max_new_tokens)."""

    def __init__(self, stops: list[bool], eos_ids: set[int]):
        self.stops, self.eos_ids = stops, sorted(eos_ids)

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        eos = torch.tensor(self.eos_ids, dtype=input_ids.dtype, device=input_ids.device)
        stops = torch.tensor(self.stops, dtype=torch.bool, device=input_ids.device)
        return torch.isin(input_ids[:, -1], eos) & stops


def plain_generation_config(source):
    """A GenerationConfig with only `source`'s special tokens: none of the checkpoint's sampling or logits
    processors (transformers fills every setting a generate call leaves unset from the model's config)."""
    from transformers import GenerationConfig
    return GenerationConfig(bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id,
                            pad_token_id=source.pad_token_id)


class HFModel(NamedTuple):
    model: Any  # AutoModelForCausalLM, eval mode, on `device`
    tokenizer: Any
    device: Any  # torch.device


def hf_auto_class(path):
    """transformers' auto class of the generative model folder `path`: AutoModelForImageTextToText for a multimodal
    checkpoint whose language model infer serves (models.multimodal: Mistral 3's has no causal LM class), else
    AutoModelForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from ..models.multimodal import wrapper_of
    multimodal = wrapper_of(AutoConfig.from_pretrained(path, local_files_only=True)) is not None
    return AutoModelForImageTextToText if multimodal else AutoModelForCausalLM


def gptq_cpu_options(path) -> dict:
    """from_pretrained options for a GPTQ checkpoint transformers runs on the CPU: GPTQModel's torch kernel where a
    quantized layer has a number of outputs that is not a multiple of 16 (the one GPTQModel picks by default,
    TorchAtenLinear, says it takes any shape but fails at the first forward on those: torch's int4 packing for the
    CPU needs N % 16 == 0; a Mamba-2 mixer's in_proj often has such a width); {} for every other model (GPTQModel's
    default kernel)."""
    from safetensors import safe_open
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    qc = config.get("quantization_config") or {}
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "gptq":
        return {}
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                narrow = any(sf.get_slice(k).get_shape()[-1] % 16 for k in sf.keys() if k.endswith(".qweight"))
        except Exception:  # (an unreadable file: transformers says what is wrong with it)
            return {}
        if narrow:
            from transformers import GPTQConfig
            return {"quantization_config": GPTQConfig(bits=int(qc.get("bits", 4)), backend="torch")}
    return {}


def load_hf(model_path: str, dtype: str = "auto", device: str = "auto") -> HFModel:
    """Load a model folder (or a built-in name) with transformers. dtype auto: float32 on CPU, the
    checkpoint's dtype on a GPU; device auto: cuda if there is one."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..models.resolve import resolve_model
    path = resolve_model(model_path)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dtype == "auto":
        torch_dtype = torch.float32 if dev.type == "cpu" else "auto"
    else:
        torch_dtype = getattr(torch, dtype)
    hf_logging.disable_progress_bar()
    try:
        from ..quant.config import hf_load_options  # (the hub's gpt-oss: its MXFP4 experts dequantized, as infer's)
        options = hf_load_options(path)
        if dev.type == "cpu" and not options:
            options = gptq_cpu_options(path)
        model, info = hf_auto_class(path).from_pretrained(path, dtype=torch_dtype, output_loading_info=True,
                                                          **options)
        model = model.to(dev).eval()
        model.generation_config = plain_generation_config(model.generation_config)  # greedy, as the engine
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"transformers cannot load {path} for the baseline: {e}",
                             "a GPTQ checkpoint needs gptqmodel/optimum installed for the HF baseline") from e
    # weights transformers found no tensors for are left uninitialized (garbage tokens from a model that is not the
    # checkpoint's; garbage g_idx: an IndexError), as GPTQModel's Phi-3 checkpoints (gate_proj and up_proj apart;
    # transformers' Phi3MLP has gate_up_proj: `infer quantize` fuses them, except with --desc-act) and any GPTQ
    # mixture of experts (transformers 5 stacks the experts into float mlp.experts.gate_up_proj and down_proj, and
    # has no place for the checkpoint's int4 experts.N.gate_proj.qweight ...): refused where int4 tensors are missing
    # or the checkpoint holds tensors transformers had no place for (a tensor a checkpoint may leave out, such as a
    # router's score-correction bias transformers starts at zeros, as infer does, is not refused alone)
    quantized = (".qweight", ".qzeros", ".scales", ".g_idx")
    missing, extra = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    unset = missing if extra else [k for k in missing if k.endswith(quantized)]
    if unset:
        raise ModelLoadError(f"transformers cannot load {path} for the baseline: its model has no tensor for "
                             f"{unset[0]} ({len(unset)} weights missing)"
                             + (f", and no place for the checkpoint's {extra[0]}" if extra else ""),
                             "this checkpoint's layout is not transformers' (infer reads it): give --baseline-model "
                             "the float checkpoint it was quantized from, or run without --baseline hf")
    return HFModel(model, tok, dev)


def _pad_left(prompts: list[list[int]], pad_id: int, device):
    import torch
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _run_batch(model, tok, device, batch: list[tuple[int, BenchRequest]], sampler,
               cache_implementation: str | None = None) -> list[RequestRecord]:
    import torch
    prompts = [r.prompt_token_ids or tok.encode(r.prompt, add_special_tokens=False) for _, r in batch]
    eos = model.generation_config.eos_token_id
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos if isinstance(eos, int) else 0)
    ids, mask = _pad_left(prompts, pad_id, device)
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    stops = [not r.ignore_eos for _, r in batch]
    gc = copy.deepcopy(model.generation_config)
    # eos_token_id=[]: no EOS for generate itself (None would be filled back from the model's config); the rows
    # that do not ignore EOS stop at theirs through RowsAtEos
    gc.update(max_new_tokens=max(r.output_len for _, r in batch), do_sample=False, num_beams=1,
              pad_token_id=pad_id, eos_token_id=[], temperature=None, top_p=None, top_k=None)
    criteria = None
    if any(stops) and eos_ids:
        from transformers import StoppingCriteriaList
        criteria = StoppingCriteriaList([RowsAtEos(stops, eos_ids)])
    if cache_implementation:  # "static": transformers compiles its decode step (its fastest generate)
        gc.update(cache_implementation=cache_implementation)
    clock = StepClock(sampler)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc, streamer=clock,
                             stopping_criteria=criteria)
    gen = out[:, ids.shape[1]:].tolist()
    records = []
    for row, (i, req), prompt in zip(gen, batch, prompts):
        toks = row[:req.output_len]
        if not req.ignore_eos:
            cut = next((k for k, t in enumerate(toks) if t in eos_ids), None)
            toks = toks if cut is None else toks[:cut + 1]
        rec = RequestRecord(i, len(prompt), send_time=start, chunk_times=clock.times[:len(toks)],
                            output_tokens=len(toks), text=tok.decode(toks, skip_special_tokens=True),
                            lora=req.lora, finish_reason="stop" if toks and toks[-1] in eos_ids else "length")
        rec.success = bool(toks) and len(rec.chunk_times) == len(toks)
        rec.error = None if rec.success else "generate produced fewer steps than tokens"
        rec.end_time = rec.chunk_times[-1] if rec.chunk_times else time.perf_counter()
        records.append(rec)
    return records


def run_hf_generate(model: str | HFModel, requests: list[BenchRequest], batch_size: int, dtype: str = "auto",
                    device: str = "auto", progress: bool = True, cache_implementation: str | None = None,
                    console=None, warmup: bool = False) -> RunResult:
    """The transformers baseline at one batch size (reported as concurrency = batch_size); see module doc.
    `model` is a model folder / built-in name (loaded with `dtype`, `device`) or what load_hf returned.
    `warmup`: first generate one batch of `batch_size` requests a few tokens long, not measured (as the engine
    is warmed before it is measured: the first generate pays for CUDA's lazy loading and library handles).
    LoRA names in the workload are ignored (the baseline runs the base model). Ctrl-C returns the finished
    batches with `partial=True`; an error in a later batch is raised with them as its `bench_partial` (a RunResult,
    partial, its `error` set), as the in-process driver's is. The progress bar goes to `console` when given (a
    rich Console)."""
    model, tok, dev = load_hf(model, dtype, device) if isinstance(model, str) else model
    warm = [(i, replace(r, output_len=min(r.output_len, WARMUP_TOKENS)))
            for i, r in list(enumerate(requests))[:batch_size]] if warmup else []
    return _run_batches(requests, batch_size, lambda batch, sampler: _run_batch(
        model, tok, dev, batch, sampler, cache_implementation), warm, f"hf generate b={batch_size}", progress, console)


def run_hf_embed(model: str | HFModel, requests: list[BenchRequest], batch_size: int, pooler, dtype: str = "auto",
                 device: str = "auto", progress: bool = True, console=None, warmup: bool = False) -> RunResult:
    """The transformers baseline of a pooling run (--runner pooling) at one batch size: AutoModel's
    last_hidden_state (the CausalLM's base model, after its final norm) of each static, right-padded batch, pooled
    as the engine's `pooler` pools (LAST: each prompt's last token, MEAN, CLS; normalized where it normalizes) and
    brought to the host. As run_hf_generate otherwise (warmup: one batch first, not measured)."""
    model, tok, dev = load_hf(model, dtype, device) if isinstance(model, str) else model
    warm = list(enumerate(requests))[:batch_size] if warmup else []
    return _run_batches(requests, batch_size, lambda batch, sampler: _embed_batch(model, tok, dev, batch, pooler),
                        warm, f"hf embed b={batch_size}", progress, console, pooling=True)


def _embed_batch(model, tok, device, batch: list[tuple[int, BenchRequest]], pooler) -> list[RequestRecord]:
    prompts = [r.prompt_token_ids or tok.encode(r.prompt, add_special_tokens=False) for _, r in batch]
    start = time.perf_counter()
    hf_embeddings(model, prompts, pooler, device)  # (the vectors: timed, not kept)
    end = time.perf_counter()
    return [RequestRecord(i, len(prompt), send_time=start, lora=req.lora, finish_reason="stop", end_time=end,
                          success=True) for (i, req), prompt in zip(batch, prompts)]


def hf_embeddings(model, prompts: list[list[int]], pooler, device) -> list:
    """The float32 vectors (on the host) of one right-padded batch of `prompts` through a transformers CausalLM's
    base model (AutoModel's last_hidden_state), pooled as `pooler` (engine.pooling.Pooler) pools."""
    import torch
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # right-padded: a causal model's rows before the padding are the prompt's own
        ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p, dtype=torch.long), 1
    with torch.inference_mode():
        hidden = model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float()
        rows = [hidden[i, :len(p)] for i, p in enumerate(prompts)]
        vectors = [{"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooler.pooling_type] for h in rows]
        if pooler.normalize:
            vectors = [torch.nn.functional.normalize(v, p=2, dim=-1) for v in vectors]
        return [v.cpu() for v in vectors]  # (on the host: the GPU has caught up when the batch ends)


def _run_batches(requests: list[BenchRequest], batch_size: int, run_batch, warm: list, label: str, progress: bool,
                 console, pooling: bool = False) -> RunResult:
    """Every request through `run_batch(batch, sampler)` (its records), `batch_size` at a time, after the `warm`
    batch (not measured); see run_hf_generate."""
    if batch_size < 1:
        raise ModelLoadError(f"the baseline batch size must be at least 1, got {batch_size}")
    sampler = ResourceSampler()  # as ours: a sample (~0.1 ms) at every step slowed its steps, not ours
    records: list[RequestRecord] = []
    partial, aborted, failure = False, 0, None
    indexed = list(enumerate(requests))
    if warm:
        run_batch(warm, None)
    with Progress(progress, len(requests), label, console) as bar:
        t0 = end = time.perf_counter()
        sampler.start(t0)
        for s in range(0, len(indexed), batch_size):
            batch = indexed[s:s + batch_size]
            try:
                records += run_batch(batch, sampler)
            except KeyboardInterrupt:
                partial, aborted = True, len(batch)
                end = time.perf_counter()
                break
            except Exception as e:  # (a larger batch ran out of memory): the batches before it were measured
                failure, partial, aborted = e, True, len(batch)
                end = time.perf_counter()
                break
            end = max(r.end_time for r in records[-len(batch):])
            bar.advance(len(batch))
            if pooling:
                sampler.sample(0)
    with contextlib.suppress(Exception):
        sampler.sample(0, force=True)
    return ended(RunResult("hf", batch_size, records, duration_s=end - t0, num_requests=len(requests),
                           request_rate=math.inf, partial=partial, aborted=aborted,
                           peak_rss_bytes=sampler.peak_rss_bytes, peak_gpu_bytes=sampler.peak_gpu_bytes,
                           timeline=sampler.timeline, start_time=t0, pooling=pooling), failure)
