"""Quantization driver: run GPTQModel (the GPTQ solver, an optional extra) on a float model and write a standard GPTQ
checkpoint (format "gptq", v1 zero points) with a per-layer report of the quantization error.

infer writes no solver of its own: this file prepares calibration windows, configures GPTQModel, follows its
per-layer callbacks, keeps its console output and its `logs/` folder out of the user's terminal and working
directory, and checks what it saved.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from ..checks import processor_chat_template, tokenizer_problem
from ..errors import ConfigError, InferError, ModelLoadError, UnsupportedModelError
from .calibration import CalibrationSet, load_calibration
from .config import mxfp4_gpt_oss
from .convert import (TOKENIZER_FILES, check_inputs_kept, check_not_source, check_output, is_gptq, keep_source_config,
                      parse_shard_size, read_config_json, saved_dtype, staged_output, weight_files)

BITS = (4, 8)
GROUP_SIZES = (-1, 32, 64, 128)
REPORT_NAME = "quantization_report.csv"
EXTRA_HINT = "pip install 'infer[quantize]'"


@dataclass
class QuantizeOptions:
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    num_samples: int = 128
    seq_len: int = 512
    damp_percent: float = 0.05
    max_shard_size: str | int = "4GB"  # KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary, or bytes
    lm_head: bool = False  # quantize the output head too (GPTQModel's lm_head=True: 8 bits by its dynamic rule)

    def validate(self) -> None:
        parse_shard_size(self.max_shard_size)  # a bad size fails now, not after the whole quantization
        if self.bits not in BITS:
            raise ConfigError(f"--bits {self.bits} is not supported", "use 4 or 8")
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"--group-size {self.group_size} is not supported", "use -1, 32, 64 or 128")
        if self.num_samples < 1:
            raise ConfigError(f"--num-samples {self.num_samples} must be at least 1")
        if self.seq_len < 16:
            raise ConfigError(f"--seq-len {self.seq_len} is too short", "use at least 16 tokens (512 is typical)")
        if not 0 < self.damp_percent < 1:
            raise ConfigError(f"--damp {self.damp_percent} must be above 0 and below 1 (0 and 1 excluded)",
                              "0.01-0.1 is typical")

    def interop_notes(self) -> list[str]:
        """Known problems other tools have with the checkpoint these options write (infer itself runs them all)."""
        notes = []
        if self.bits == 4 and self.group_size == -1 and not self.sym:
            # transformers picks GPTQModel's torch_fused kernel on CPU for one group per row; its CPU path replaces
            # the zero points with zeros (GPTQModel 7.6.0), which only a symmetric checkpoint survives
            notes.append("transformers on CPU runs a 4-bit --group-size -1 --no-sym checkpoint through GPTQModel's "
                         "torch_fused kernel, which drops the zero points: its outputs there are wrong. Load it in "
                         "transformers with GPTQConfig(bits=4, group_size=-1, sym=False, backend=\"torch\"), or "
                         "quantize with --sym or a group size")
        if self.lm_head:
            # GPTQModel 7.6 + transformers 5: the head loads as a plain Linear whose weights were never read
            notes.append("transformers does not read a quantized lm_head (its head stays a float layer without the "
                         "checkpoint's weights: wrong outputs there); infer and vLLM run it")
        return notes


class QuantizeObserver:
    """Receives progress events; the CLI draws them, the Python API ignores them."""

    def start(self, num_layers: int, calibration: CalibrationSet) -> None: ...

    def subset(self, layer: int, modules: list[str], stage: str) -> None: ...

    def layer_done(self, layer: int) -> None: ...


@dataclass
class QuantizeResult:
    out: Path
    report: Any  # pandas.DataFrame: layer, module, loss, samples, damp, seconds
    calibration: CalibrationSet
    seconds: float
    notes: list[str] = field(default_factory=list)  # what this checkpoint's readers should know (a split Phi-3 MLP)


def require_gptqmodel():
    """Import GPTQModel, or say which extra to install."""
    if importlib.util.find_spec("gptqmodel") is None:
        raise InferError("infer quantize needs the quantize extra: pip install 'infer[quantize]'",
                         "it installs GPTQModel (the GPTQ solver) and optimum")
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(12, os.cpu_count() or 1))))
    try:
        import gptqmodel
    except Exception as e:  # broken install: name it instead of a traceback
        raise InferError(f"GPTQModel is installed but cannot be imported: {type(e).__name__}: {e}",
                         f"reinstall it: {EXTRA_HINT}") from e
    return gptqmodel


@contextlib.contextmanager
def captured_output(log_path: Path, enabled: bool = True):
    """Send everything printed while inside (Python streams and file descriptors 1 and 2, which catches
    native libraries too) to `log_path`. Yields a stream that still reaches the user's terminal."""
    if not enabled:
        yield sys.stderr
        return
    sys.stdout.flush()
    sys.stderr.flush()
    terminal, saved = _terminal_stream(), [os.dup(1), os.dup(2)]
    with open(log_path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield terminal
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            if terminal is not sys.stderr:
                terminal.flush()


def _terminal_stream() -> TextIO:
    """A stream to the current stderr that survives redirecting fd 2 (a duplicate of it when it is fd 2)."""
    try:
        if sys.stderr.fileno() == 2:
            return os.fdopen(os.dup(2), "w", buffering=1, closefd=True)
    except (AttributeError, OSError, ValueError):  # pytest / CliRunner streams have no descriptor
        pass
    return sys.stderr


@contextlib.contextmanager
def _log_dir(gptqmodel_mod, workdir: Path):
    """GPTQModel writes per-processor logs into ./logs; point that at our temporary folder instead."""
    from gptqmodel.looper import loop_processor
    if hasattr(loop_processor, "_PROJECT_LOG_DIR"):
        old = loop_processor._PROJECT_LOG_DIR
        loop_processor._PROJECT_LOG_DIR = workdir / "logs"
        try:
            yield
        finally:
            loop_processor._PROJECT_LOG_DIR = old
    else:  # a GPTQModel that moved the setting: run with the temporary folder as cwd (all our paths are absolute)
        cwd = os.getcwd()
        os.chdir(workdir)
        try:
            yield
        finally:
            os.chdir(cwd)


class _Callbacks:
    """Adapts GPTQModel's layer/subset callbacks (attributes `layer_callback`, `subset_callback` of the model)."""

    def __init__(self, observer: QuantizeObserver):
        self.observer = observer
        self.done: set[int] = set()

    def layer_complete(self, layer_idx: int, submodule_finalized: bool) -> None:
        if layer_idx not in self.done:  # called once before and once after the layer's finalizers
            self.done.add(layer_idx)
            self.observer.layer_done(layer_idx)

    def subset_event(self, *, stage, layer_idx, subset_index, subset_total, module_names, processor) -> None:
        self.observer.subset(layer_idx, list(module_names), stage)


def quantize_model(model: str | os.PathLike, out: str | os.PathLike, options: QuantizeOptions | None = None,
                   calibration: str | os.PathLike | None = None, observer: QuantizeObserver | None = None,
                   overwrite: bool = False, check_weights: Callable[[Path], None] | None = None,
                   source_name: str | None = None) -> QuantizeResult:
    """Quantize the float model in folder `model` (the CLI resolves built-in names with models.resolve) with
    GPTQModel into `out`; see the module docstring. `check_weights`: the engine loader's checks of the checkpoint
    against its config.json (models.loader.check_weights, which the CLI passes: quant sits below models).
    `source_name`: the name config.json's `_name_or_path` records as the model quantized (default: `model`'s path),
    which an adapter trained on it may name as its base (lora.validate.base_name_warning)."""
    opts = options or QuantizeOptions()
    opts.validate()
    src, out = Path(model).expanduser().resolve(), Path(out).expanduser().resolve()
    observer = observer or QuantizeObserver()
    check_not_source(src, out, "quantized")
    check_output(out, overwrite)
    check_inputs_kept(out, overwrite, {"--calibration": calibration})
    config = _check_source(src, opts.group_size, opts.bits)
    if opts.lm_head and _ties_head(src, config):  # GPTQModel: NotImplementedError, after loading
        why = "tie_word_embeddings: true" if "tie_word_embeddings" in config else \
            "no tie_word_embeddings: transformers ties them by default for this model"
        raise ConfigError(f"--lm-head: {src / 'config.json'} ties lm_head to the embeddings ({why}), and GPTQModel "
                          "quantizes only a head of its own", "quantize without --lm-head")
    if opts.lm_head:
        _check_head_widths(config)
    context, context_field = _context(config)
    if context is not None and context < opts.seq_len:
        raise ConfigError(f"--seq-len {opts.seq_len} is longer than the model's context ({context} tokens, "
                          f"{context_field} in config.json)", f"use --seq-len {context} or less")
    _check_tensors(src, check_weights)
    gptqmodel_mod = require_gptqmodel()
    tokenizer = _tokenizer(src)
    calib = load_calibration(Path(calibration) if calibration else None, tokenizer, opts.num_samples, opts.seq_len)
    observer.start(int(config.get("num_hidden_layers", 0)), calib)
    start = time.perf_counter()
    with staged_output(out, overwrite) as tmp, tempfile.TemporaryDirectory(prefix="infer-quantize-") as work:
        with _log_dir(gptqmodel_mod, Path(work)):
            log = _run_gptqmodel(src, tmp, opts, calib, Path(work), observer)
        rename = _EXPERT_NAMES.get(config.get("model_type"))
        if rename:  # the report and the notes name the modules as the checkpoint does
            log = {**log, "gptq": [{**r, "module": rename(str(r["module"]))} if "module" in r else r
                                   for r in log.get("gptq", [])]}
        num_layers = int(config.get("num_hidden_layers", 0))
        _check_losses(src, log, num_layers)
        report = report_frame(log, num_layers)
        _check_saved(tmp)
        _drop_work_paths(tmp)
        notes = fuse_gate_up(tmp, config, opts) + mixtral_names(tmp, config, opts)
        notes += moe_notes(config, log, num_layers, tmp)
        if config.get("model_type") == "bamba":
            notes.append(BAMBA_NOTE)
        keep_source_config(src, tmp, {"dtype": saved_dtype(tmp), "_name_or_path": source_name or str(src),
                                      "quantization_config": read_config_json(tmp)["quantization_config"]})
        _restore_source_files(src, tmp)
        report.to_csv(tmp / REPORT_NAME, index=False)
    return QuantizeResult(out, report, calib, time.perf_counter() - start, notes)


def _context(config: dict) -> tuple[int | None, str]:
    """(the longest calibration window the model runs as infer serves it, the config field that sets it). A longrope
    model's context is original_max_position_embeddings (engine/setup.context_limit): past it transformers rotates
    the whole sequence with the long factors, so calibrating a longer window would fit the weights to activations of
    a rope infer never runs."""
    positions = config.get("max_position_embeddings")
    positions = positions if isinstance(positions, int) and positions > 0 else None
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "longrope":
        # transformers moves a top-level original_max_position_embeddings (where Phi-3 writes it) into the rope
        # parameters, over the one they have (PreTrainedConfig.standardize_rope_params): the engine's cap reads that
        top = "original_max_position_embeddings" in config
        original = (config if top else rope).get("original_max_position_embeddings")
        if isinstance(original, int) and 0 < original and (positions is None or original < positions):
            return original, ("original_max_position_embeddings (read with its longrope rope_scaling)" if top else
                              "original_max_position_embeddings of its longrope rope_parameters")
    return positions, "max_position_embeddings"


def _check_source(src: Path, group_size: int, bits: int = 4) -> dict:
    if not (src / "config.json").is_file():
        raise ModelLoadError(f"{src} is not a model folder (no config.json)",
                             "pass a Hugging Face model folder (config.json and *.safetensors weights)")
    config = read_config_json(src)
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in (None, "gptq"):
        raise ConfigError(f"{src} is already quantized (quant_method {method!r})",
                          "quantize the float model it came from" + (
                              f", or rewrite it as GPTQ with `infer convert {src} -o OUT --to gptq`"
                              if method == "awq" else
                              f", or write that float model with `infer convert {src} -o FLOAT` (gpt-oss's MXFP4 "
                              "experts dequantized) and quantize FLOAT" if mxfp4_gpt_oss(config) else
                              f", or write that float model with `infer convert {src} -o FLOAT` (its FP8 weights "
                              "dequantized) and quantize FLOAT" if method == "fp8" else ""))
    if is_gptq(src):
        raise ConfigError(f"{src} is already a GPTQ checkpoint", "quantize the float model it came from")
    if not qc and (src / "quant_config.json").is_file():  # older AutoAWQ's file (GPTQConfig.from_model_dir reads it)
        raise ConfigError(f"{src} is already an AWQ checkpoint (quant_config.json)",
                          "quantize the float model it came from, or rewrite it as GPTQ with "
                          f"`infer convert {src} -o OUT --to gptq`")
    config = _text_model_config(config)
    _check_moe_layers(src, config)
    _check_widths(_with_head_dim(src, config), group_size, bits)
    _check_weights(src)
    return config


def _text_model_config(config: dict) -> dict:
    """A multimodal checkpoint's config.json (a text_config: Gemma 3's Gemma3ForConditionalGeneration, whose
    language model GPTQModel quantizes, its vision tower left in float) as its text model's fields, the top level's
    tie_word_embeddings over them (transformers ties the head by it), as the widths, the context and --lm-head's
    checks read them; another config as it is."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    return {**text, **{k: config[k] for k in ("tie_word_embeddings",) if k in config}}


def _check_moe_layers(src: Path, config: dict) -> None:
    """GPTQModel 7.6's Qwen3-MoE and Qwen2-MoE definitions give every decoder layer the experts: a layer
    mlp_only_layers or decoder_sparse_step leaves dense (its MLP Llama's: mlp.gate_proj) fails there after loading
    and calibration ("layer module item `mlp.experts.0.gate_proj` not found in model"), as does a Qwen2-MoE without a
    shared expert (shared_expert_intermediate_size 0: GPTQModel cannot quantize its 0-wide projections). Refused
    before: infer runs both, float. (Llama 4's dense layers: _llama4_view.)"""
    if config.get("model_type") not in ("qwen3_moe", "qwen2_moe"):
        return
    layers = config.get("num_hidden_layers")
    step = config.get("decoder_sparse_step", 1) or 1
    only = config.get("mlp_only_layers") or []
    # (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, Mixtral's name)
    field = next((k for k in ("num_experts", "num_local_experts") if k in config), "num_experts")
    if isinstance(layers, int) and isinstance(step, int) and step > 0 and isinstance(only, list):
        dense = [i for i in range(layers) if i in only or (i + 1) % step or config.get(field) == 0]
        if dense:
            listed = ", ".join(map(str, dense[:8])) + (f" and {len(dense) - 8} more" if len(dense) > 8 else "")
            raise UnsupportedModelError(
                f"{src}: layer{'s' if len(dense) > 1 else ''} {listed} of this {config['model_type']} model "
                f"{'are' if len(dense) > 1 else 'is'} dense (mlp_only_layers {only}, decoder_sparse_step {step}, "
                f"{field} {config.get(field)} in config.json), and GPTQModel quantizes a mixture of "
                "experts only where every layer has the experts",
                "serve the float checkpoint (infer runs it)")
    shared = config.get("shared_expert_intermediate_size")
    if config["model_type"] == "qwen2_moe" and isinstance(shared, int) and shared <= 0:
        raise UnsupportedModelError(
            f"{src}: this qwen2_moe model has no shared expert (shared_expert_intermediate_size {shared} in "
            "config.json), and GPTQModel cannot quantize its 0-wide shared_expert projections",
            "serve the float checkpoint (infer runs it)")


def _with_head_dim(src: Path, config: dict) -> dict:
    """`config` with the head_dim transformers' config class gives a config.json that leaves it out (Qwen3's is 128,
    not hidden_size / heads), as infer's models read it (models.shapes); `config` itself where that cannot be read."""
    if config.get("head_dim"):
        return config
    from transformers import AutoConfig
    try:
        head_dim = getattr(AutoConfig.from_pretrained(src), "head_dim", None)
    except Exception:  # an unknown model_type, ...: refused later, with its own words
        return config
    return {**config, "head_dim": head_dim} if isinstance(head_dim, int) and head_dim > 0 else config


def _widths(config: dict) -> tuple[dict[str, int], dict[str, int]]:
    """({what: width} of the quantized projections' inputs, the same of their outputs), from config.json as infer's
    models derive them (head_dim apart from hidden_size / heads where the config sets it); what it lacks is left out."""
    dims = {k: config[k] for k in ("hidden_size", "intermediate_size") if isinstance(config.get(k), int)}
    if config.get("model_type") in ("qwen3_moe", "qwen2_moe"):  # Qwen's experts and shared expert have widths of
        # their own; intermediate_size is only its dense layers' (none: _check_moe_layers), no projection's here
        dims.pop("intermediate_size", None)
        dims.update({k: config[k] for k in ("moe_intermediate_size", "shared_expert_intermediate_size")
                     if isinstance(config.get(k), int) and config[k] > 0})
    if config.get("model_type") == "lfm2_moe":  # (its experts' width; intermediate_size its dense layers' alone)
        if not config.get("num_dense_layers"):
            dims.pop("intermediate_size", None)
        if isinstance(config.get("moe_intermediate_size"), int):
            dims["moe_intermediate_size"] = config["moe_intermediate_size"]
    if config.get("model_type") == "lfm2" and "intermediate_size" in dims:  # (its MLP's width: models.lfm2)
        from types import SimpleNamespace

        from ..quant.config import ffn_width
        width = ffn_width(SimpleNamespace(**config))
        dims.pop("intermediate_size")
        dims[f"MLP width (intermediate_size {config['intermediate_size']} adjusted as transformers does: "
             f"{width})"] = width
    inputs, outputs = dict(dims), dict(dims)
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
        head_dim = config.get("head_dim") or hidden // heads
        kv_heads = config.get("num_key_value_heads") or heads
        if isinstance(head_dim, int) and isinstance(kv_heads, int):  # (widths equal to hidden_size: said there)
            q = f"num_attention_heads x head_dim ({heads} x {head_dim})"
            if heads * head_dim != hidden:
                inputs[f"o_proj's input, {q}"] = outputs[f"q_proj's output, {q}"] = heads * head_dim
            if kv_heads * head_dim != hidden:
                kv = f"k_proj's and v_proj's output, num_key_value_heads x head_dim ({kv_heads} x {head_dim})"
                outputs[kv] = kv_heads * head_dim
    return inputs, outputs


def _check_widths(config: dict, group_size: int, bits: int) -> None:
    """Every projection GPTQ quantizes splits into whole groups along its input and packs into int32 words along its
    input and output: GPTQModel writes a checkpoint whose widths do not, which infer and vLLM then refuse to load."""
    inputs, outputs = _widths(config)
    bad = {k: v for k, v in inputs.items() if group_size > 0 and v % group_size}
    if bad:
        sizes = " or ".join(f"{k} ({v})" if "(" not in k else f"{k} = {v}" for k, v in bad.items())
        fits = [g for g in GROUP_SIZES if g > 0 and all(v % g == 0 for v in inputs.values())]
        raise ConfigError(f"--group-size {group_size} does not divide the model's {sizes}",
                          f"use --group-size {fits[-1]}, the largest that divides every layer's input size (or -1 "
                          "for one group per row)" if fits else
                          "use --group-size -1 (one group per row): no other group size divides every layer's input "
                          "size")
    pack = 32 // bits
    bad = {k: v for k, v in {**inputs, **outputs}.items() if v % pack}
    if bad:
        sizes = " or ".join(f"{k} ({v})" if "(" not in k else f"{k} = {v}" for k, v in bad.items())
        fits = [b for b in BITS if b != bits and all(v % (32 // b) == 0 for v in bad.values())]
        raise ConfigError(f"the model's {sizes} does not pack into int32 words of {pack} {bits}-bit values: its GPTQ "
                          "checkpoint would load in neither infer nor vLLM",
                          f"quantize with --bits {fits[0]}" if fits else "this model cannot be quantized to GPTQ here")


# GPTQModel 7.6 quantizes the output head (lm_head=True) by its own rule, whatever --bits and --group-size say:
# {"lm_head": {"bits": 8, "group_size": 32, "sym": true, ...}} in `dynamic` (looper/module_looper.py)
HEAD_BITS, HEAD_GROUP = 8, 32


def _check_head_widths(config: dict) -> None:
    """--lm-head: the head's input (hidden_size) splits into GPTQModel's groups of 32 and its output (vocab_size)
    packs into int32 words of 8-bit zero points; GPTQModel writes a head that does not, which infer and vLLM then
    refuse to load (a vocabulary of 32001: one added token)."""
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    bad = [f"{what} ({v}) is not a multiple of {n}" for what, v, n in
           (("vocab_size", vocab, 32 // HEAD_BITS), ("hidden_size", hidden, HEAD_GROUP))
           if isinstance(v, int) and v % n]
    if bad:
        raise ConfigError(f"--lm-head: the model's {' and its '.join(bad)}: GPTQModel's {HEAD_BITS}-bit head in "
                          f"groups of {HEAD_GROUP} would load in neither infer nor vLLM",
                          "quantize without --lm-head (the head stays in float)")


def _check_tensors(src: Path, check_weights: Callable[[Path], None] | None) -> None:
    """What `infer run` checks of the weights (names and shapes against config.json, none missing or left over:
    GPTQModel loads through transformers, which fills missing weights at random and drops extra layers), then that
    every weight is finite: GPTQ on an inf or NaN reports a loss of 0 and writes non-finite scales."""
    from .convert import load_weight_file, nonfinite_tensors
    if check_weights is not None:
        check_weights(src)
    tied, heads = _ties_head(src, read_config_json(src)), {}
    for f in weight_files(src):  # one file at a time: the model is never held twice
        tensors = load_weight_file(f)
        bad = nonfinite_tensors(tensors.items())
        if bad:
            raise ModelLoadError(f"{src} has non-finite weights (inf or NaN) in {bad[0]}",
                                 "GPTQ cannot quantize them: fix or replace the checkpoint (a float model that runs)")
        if tied:
            heads.update({_HEADS[k]: v for k, v in tensors.items() if k in _HEADS})
    _check_tied_head(src, heads)


# the output head's and the embeddings' tensors as _check_tied_head names them: a text model's, and a multimodal
# checkpoint's language model's (the hub's language_model.*, transformers 5's model.language_model.*)
_HEADS = {"lm_head.weight": "lm_head.weight", "model.embed_tokens.weight": "model.embed_tokens.weight",
          "embed_tokens.weight": "embed_tokens.weight", "language_model.lm_head.weight": "lm_head.weight",
          "language_model.model.embed_tokens.weight": "model.embed_tokens.weight",
          "model.language_model.embed_tokens.weight": "model.embed_tokens.weight"}


def _ties_head(src: Path, config: dict) -> bool:
    """Whether transformers ties the model's output head to its embeddings: config.json's tie_word_embeddings (the
    top level's of a multimodal one), or where it is not set, its config class's default, as transformers reads it
    (Gemma's and Gemma 3's: true; the hub's Gemma 3 multimodal configs set none)."""
    if "tie_word_embeddings" in config or not (src / "config.json").is_file():
        return bool(config.get("tie_word_embeddings", False))
    from transformers import AutoConfig
    try:
        return bool(getattr(AutoConfig.from_pretrained(src, local_files_only=True), "tie_word_embeddings", False))
    except Exception:  # (a config transformers cannot read: the checks of the weights name what is wrong)
        return False


def _check_tied_head(src: Path, heads: dict) -> None:
    """config.json ties lm_head to the embeddings but the checkpoint stores another lm_head.weight: transformers and
    `infer run` use the stored head, while GPTQModel ties it and writes no head, so the quantized model would answer
    through the embeddings instead (another model)."""
    import torch
    head, emb = heads.get("lm_head.weight"), heads.get("model.embed_tokens.weight")
    if head is not None and emb is None and not any(k.startswith("embed_tokens") for k in heads):
        # the tied matrix stored as lm_head.weight alone (safetensors' save_model): transformers and `infer run`
        # tie the embeddings to it, GPTQModel leaves them unset (a meta tensor it fails on after calibrating)
        raise ConfigError(f"{src} stores the tied output head and embeddings only as lm_head.weight (no "
                          "model.embed_tokens.weight), which GPTQModel cannot load",
                          f"`infer convert {src} -o FOLDER` writes it as model.embed_tokens.weight: quantize FOLDER")
    if head is None or emb is None:  # untied (nothing kept), or tied with no stored head
        return
    if head.shape != emb.shape or not torch.equal(head, emb.to(head.dtype)):
        raise ConfigError(f"{src / 'config.json'} ties lm_head to embed_tokens (tie_word_embeddings: true), but the "
                          "checkpoint stores a different lm_head.weight, which transformers and infer use: GPTQModel "
                          "would tie it and drop the stored head",
                          'set "tie_word_embeddings": false in config.json (a copy of the folder), then quantize')


def _check_weights(src: Path) -> None:
    """Weight files present and readable before calibration starts (GPTQModel fails late, and on something else):
    each safetensors file's header and size are checked without reading its tensors."""
    for f in weight_files(src):  # none at all: a ModelLoadError naming the folder
        if f.suffix != ".safetensors":
            continue
        try:
            end = _safetensors_end(f)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            end = None
        if end is None or f.stat().st_size < end:
            why = "its header cannot be read" if end is None else \
                f"it has {f.stat().st_size:,} bytes, its header describes {end:,}"
            raise ModelLoadError(f"cannot read weight file {f}: {why}", "the file is corrupted or truncated")


def _safetensors_end(f: Path) -> int:
    """Where a safetensors file's data ends according to its header (8-byte length, JSON header, then data)."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > 100 << 20:  # safetensors' own limit: a larger length is a corrupted file
            raise ValueError(f"a header length of {n:,} bytes")
        header = json.loads(fh.read(n))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)


def _tokenizer(src: Path):
    """The source's tokenizer, its chat template the processor's (chat_template.json) where it has none of its own
    (a multimodal folder's), as the engine reads it: the calibration chats rendered as the model will see them."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception as e:  # transformers raises KeyError, TypeError... for a broken file too
        message, hint = tokenizer_problem(src, e)
        raise ModelLoadError(message, f"calibration text must be tokenized: {hint}") from e
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = processor_chat_template(src) or tokenizer.chat_template
    return tokenizer


def _run_gptqmodel(src: Path, out: Path, opts: QuantizeOptions, calib: CalibrationSet, work: Path,
                   observer: QuantizeObserver) -> dict:
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import FORMAT
    qcfg = QuantizeConfig(bits=opts.bits, group_size=opts.group_size, desc_act=opts.desc_act, sym=opts.sym,
                          damp_percent=opts.damp_percent, format=FORMAT.GPTQ, offload_to_disk_path=str(work / "off"),
                          lm_head=opts.lm_head,
                          act_group_aware=False if opts.desc_act or opts.group_size == -1 else None)  # -1: no groups
    dtype = source_half_dtype(src)
    try:
        return _solve_and_save(GPTQModel, src, out, opts, calib, qcfg, dtype, observer)
    except BaseException:  # Ctrl-C, SIGTERM (cli.entry.Terminated), an error: GPTQModel's workers may still solve
        _drain_gptqmodel_workers()
        raise


def _drain_gptqmodel_workers() -> None:
    """Wait for the tasks GPTQModel's worker threads run (a module's GPTQ solve, its packing) to finish. They are
    daemon threads: one inside a torch call when the interpreter exits (after Ctrl-C or an error) is ended as it
    takes the GIL back, which unwinds through torch's C++ and aborts the process (std::terminate: exit 134, "terminate
    called without an active exception") instead of exiting 130, 143 or 1 with infer's message."""
    try:
        import gptqmodel
        pool = getattr(gptqmodel, "_DEVICE_THREAD_POOL", None)  # built on first use: None if nothing ran
        if pool is not None:
            pool.wait()
    except Exception:  # a GPTQModel that moved its pool: nothing to wait for here
        pass


def _solve_and_save(GPTQModel, src: Path, out: Path, opts: QuantizeOptions, calib: CalibrationSet, qcfg, dtype,
                    observer: QuantizeObserver) -> dict:
    try:
        # GPTQModel's automatic dtype is bfloat16 on a CPU (and for a float32 source): a float16 model's embeddings,
        # norms and head would be rounded to bfloat16 and config.json would say bfloat16
        with _mistral3_names(src), _lfm2_moe_view(src), _falcon_h1_view(src), _flex_olmo_view(src), \
                _granite_view(src), _nemotron_h_view(src), _bamba_view(src), _glm4_moe_view(src), \
                _ernie45_moe_view(src), _minimax_m2_view(src), _llama4_view(src):
            qmodel = GPTQModel.load(str(src), qcfg, **({"dtype": dtype} if dtype is not None else {}))
        callbacks = _Callbacks(observer)
        qmodel.layer_callback = callbacks
        qmodel.subset_callback = callbacks
        log = qmodel.quantize(calib.samples, batch_size=1)
        qmodel.save(str(out), max_shard_size=parse_shard_size(opts.max_shard_size))
    except InferError:
        raise
    except Exception as e:
        raise InferError(f"GPTQModel failed to quantize {src}: {type(e).__name__}: {e}",
                         "rerun with --verbose to see GPTQModel's output, or `infer --debug quantize ...` for the "
                         "traceback") from e
    return log or {}


# GPTQModel 7.6's Mistral 3 definition (Mistral3GPTQ) names no map from its modules (transformers 5's
# model.language_model.*, model.vision_tower.*) to the hub's tensors (language_model.model.*, vision_tower.*), and
# infers none: its lazy load finds no tensor for the language model, whose embedding stays on the meta device, and the
# calibration pass stops at "Tensor.item() cannot be called on meta tensors". The map its Gemma 3 definition gives
# (without its hop into SigLIP's vision_model: Pixtral has none), and the final norm named where it is.
_MISTRAL3_NAMES = ((r"model\.language_model", r"^language_model.model"), (r"lm_head", r"^language_model.lm_head"),
                   (r"model\.vision_tower", r"^vision_tower"),
                   (r"model\.multi_modal_projector", r"^multi_modal_projector"))


@contextlib.contextmanager
def _mistral3_names(src: Path):
    """GPTQModel's Mistral 3 definition, while a Mistral3ForConditionalGeneration loads, given the names of the hub's
    tensors (_MISTRAL3_NAMES); any other model's as it is."""
    if "Mistral3ForConditionalGeneration" not in (read_config_json(src).get("architectures") or []):
        yield
        return
    from types import SimpleNamespace

    from gptqmodel.models import auto
    base = auto.MODEL_MAP["mistral3"]
    named = type("Mistral3NamedGPTQ", (base,), {
        "pre_lm_head_norm_module": "model.language_model.norm",
        "HF_CONVERSION_MAP_REVERSED": tuple(SimpleNamespace(source_patterns=[a], target_patterns=[b], operations=[])
                                            for a, b in _MISTRAL3_NAMES)})
    auto.MODEL_MAP["mistral3"] = named
    try:
        yield
    finally:
        auto.MODEL_MAP["mistral3"] = base


# GPTQModel 7.6's LFM2-MoE definition (LFM2MoeQModel) names its attention's out_proj o_proj, its experts' projections
# w1, w3, w2 (its defuser splits transformers 5's stacked experts into gate_proj, up_proj and down_proj) and the final
# norm model.norm (transformers 5's embedding_norm): it quantizes the short convs, q, k, v and the dense MLPs alone and
# saves the attention's out_proj and every expert float. Its module tree under the names transformers 5's model has.
_LFM2_MOE_TREE = ["model", "layers", "#", {
    "operator_norm": ("operator_norm:!",), "conv": ("in_proj", "out_proj"),
    "self_attn": ("q_proj:0", "k_proj:0", "v_proj:0", "out_proj:1"), "ffn_norm": ("ffn_norm:!",),
    "feed_forward:moe": {"gate": ("gate:!",), "": ("w1:0", "w3:0", "w2:1"),
                         "experts": {"#": ("gate_proj:0", "up_proj:0", "down_proj:1")}}}]


@contextlib.contextmanager
def _lfm2_moe_view(src: Path):
    """GPTQModel's LFM2-MoE definition, while an Lfm2MoeForCausalLM is quantized, given the modules' names
    (_LFM2_MOE_TREE), its experts' hooks those names and its final norm embedding_norm; any other model's as it is."""
    if read_config_json(src).get("model_type") != "lfm2_moe":
        yield
        return
    from gptqmodel.models import auto
    from gptqmodel.models.moe_lifecycle import GateUpDownMoELifecycleHooks
    base = auto.MODEL_MAP["lfm2_moe"]
    auto.MODEL_MAP["lfm2_moe"] = type("Lfm2MoeNamedGPTQ", (base,), {
        "pre_lm_head_norm_module": "model.embedding_norm", "module_tree": _LFM2_MOE_TREE,
        "moe_lifecycle_hooks": GateUpDownMoELifecycleHooks()})
    try:
        yield
    finally:
        auto.MODEL_MAP["lfm2_moe"] = base


@contextlib.contextmanager
def _falcon_h1_view(src: Path):
    """GPTQModel's Falcon-H1 definition, while a FalconH1ForCausalLM is quantized, with each mixer's mup_vector (a
    buffer transformers computes from the config, in no checkpoint) made after the load: GPTQModel's lazy load leaves
    it on the meta device, where the first layer's forward fails; any other model's as it is."""
    if read_config_json(src).get("model_type") != "falcon_h1":
        yield
        return
    from gptqmodel.models import auto
    base = auto.MODEL_MAP["falcon_h1"]

    def after_model_load(self, model, load_quantized_model):
        from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector
        model = base.after_model_load(self, model, load_quantized_model)
        mup = compute_mup_vector(model.config)
        for layer in model.model.layers:
            dtype = next((p.dtype for p in layer.mamba.parameters()), mup.dtype)
            layer.mamba.register_buffer("mup_vector", mup.to(dtype), persistent=False)
        return model
    auto.MODEL_MAP["falcon_h1"] = type("FalconH1MupGPTQ", (base,), {"after_model_load": after_model_load})
    try:
        yield
    finally:
        auto.MODEL_MAP["falcon_h1"] = base


GLM4_MOE_NOTE = ("GPTQModel.load of this checkpoint fails on transformers 5 (\"'tuple' object has no attribute "
                 "'sigmoid'\": its GLM MoE block takes the router's (logits, weights, experts) for logits, seen on "
                 "the CPU), as its quantization did: infer quantized it with each block routed by the router's own "
                 "choice; infer reads it")


def _routed_by_the_router(self, hidden_states):
    """The forward of GPTQModel's GLM-4.5 / GLM-4.7-Flash MoE block (defuser's LinearGlm4MoeMoE,
    LinearGlm4MoeLiteMoE: one module an expert) on transformers 5, whose router returns (logits, top k weights, top k
    experts) where the block expects the logits: each token's experts and weights as the router chose them
    (transformers' own routing), the experts run on their tokens, the shared experts added."""
    residuals, shape = hidden_states, hidden_states.shape
    routed = self.gate(hidden_states)
    if isinstance(routed, tuple):
        _, weights, experts = routed
    else:  # (a transformers whose router returns the logits: the block's own routing)
        experts, weights = self.route_tokens_to_experts(routed)
    run = self.moe if hasattr(self, "moe") else self.experts_forward  # (GLM-4.5's name, GLM-4.7-Flash's)
    out = run(hidden_states.view(-1, shape[-1]), experts, weights).view(*shape)
    return out + self.shared_experts(residuals)


@contextlib.contextmanager
def _glm4_moe_view(src: Path):
    """GPTQModel 7.6's GLM-4.5 or GLM-4.7-Flash (glm4_moe_lite) definition, while such a model is quantized (or
    GPTQModel loads its checkpoint), with each MoE block routed by the router's own choice (_routed_by_the_router:
    its block failed at "'tuple' object has no attribute 'sigmoid'" on transformers 5); any other model's as it is."""
    model_type = read_config_json(src).get("model_type")
    if model_type not in ("glm4_moe", "glm4_moe_lite"):
        yield
        return
    import types

    from gptqmodel.models import auto
    base = auto.MODEL_MAP[model_type]

    def after_model_load(self, model, load_quantized_model):
        model = base.after_model_load(self, model, load_quantized_model)
        for module in model.modules():
            if type(module).__name__ in ("LinearGlm4MoeMoE", "LinearGlm4MoeLiteMoE"):
                module.forward = types.MethodType(_routed_by_the_router, module)
        return model
    with _definition(model_type, type("Glm4MoeGPTQ", (base,), {"after_model_load": after_model_load})):
        yield


@contextlib.contextmanager
def _ernie45_moe_view(src: Path):
    """GPTQModel 7.6's ERNIE 4.5 MoE definition, while an Ernie4_5_MoeForCausalLM is quantized, without its remote
    code and its patch of the model's forward (written for the hub's remote code: it calls _update_causal_mask, gone
    in transformers 5, "'Ernie4_5_MoeModel' object has no attribute '_update_causal_mask'"); transformers' own
    model runs the calibration; any other model's as it is."""
    if read_config_json(src).get("model_type") != "ernie4_5_moe":
        yield
        return
    from gptqmodel.models import auto
    with _definition("ernie4_5_moe", type("Ernie45MoeGPTQ", (auto.MODEL_MAP["ernie4_5_moe"],), {
            "monkey_patch": lambda self: None, "require_trust_remote_code": False})):
        yield


LLAMA4_NOTE = ("GPTQModel 7.6's Llama 4 definition has no dense layer's MLP, and its defuser guesses the layout of the "
               "stacked experts from their shape (x @ W only where hidden_size < 2 x intermediate_size): infer "
               "quantized this Llama 4 through a tree of its own with the layout given; GPTQModel.load of it "
               "without them leaves the dense layers' MLP unread where interleave_moe_layer_step is above 1 "
               "(Maverick's: other tokens) and fails where the guess is wrong (both seen on the CPU); infer reads it")
# Llama 4's text layers as transformers 5 and GPTQModel's defuser name them: the attention, then a layer's
# feed_forward, either the experts (each expert's gate_proj, up_proj and down_proj, split from the stacks by the
# defuser; their input scaled by the router's score) and the shared expert, or a dense layer's own MLP
_LLAMA4_TREE = ["model", "layers", "#", {
    "input_layernorm": ("input_layernorm:!",),
    "self_attn": ("q_proj:0:in=x", "k_proj:0:in=x", "v_proj:0:in=x", "o_proj:1"),
    "post_attention_layernorm": ("post_attention_layernorm:!",),
    "feed_forward:moe": {"router": ("router:!",), "experts:0": {"#": ("gate_proj:0:in=x", "up_proj:0:in=x",
                                                                      "down_proj:1")},
                         "shared_expert:0": ("gate_proj:0:in=x", "up_proj:0:in=x", "down_proj:1"),
                         "": ("gate_proj:0:in=x", "up_proj:0:in=x", "down_proj:1")}}]


@contextlib.contextmanager
def _llama4_view(src: Path):
    """While a Llama 4 text model is quantized: GPTQModel 7.6's llama4_text definition given a dense layer's MLP
    (_LLAMA4_TREE: its own tree has none, "layer module item `feed_forward.experts.0.gate_proj` not found" on a
    layer interleave_moe_layer_step leaves dense), and transformers' Llama4TextExperts marked as stored x @ W
    (gate_up_proj [E, H, 2I], down_proj [E, I, H]), which GPTQModel's defuser otherwise guesses from the first
    stack's shape (transposed only where H < 2I) and splits wrongly where it guesses not; any other model's as it is."""
    model_type = read_config_json(src).get("model_type")
    if model_type not in ("llama4_text", "llama4"):
        yield
        return
    from gptqmodel.models import auto
    from transformers.models.llama4 import modeling_llama4
    experts = modeling_llama4.Llama4TextExperts
    had = "is_transposed" in experts.__dict__
    before = experts.__dict__.get("is_transposed")
    experts.is_transposed = True
    # (Llama4ForConditionalGeneration's language model: language_model.model.layers, the vision tower left float)
    tree = _LLAMA4_TREE if model_type == "llama4_text" else ["language_model", *_LLAMA4_TREE]
    try:
        with _definition(model_type, type("Llama4GPTQ", (auto.MODEL_MAP[model_type],),
                                          {"module_tree": tree, "layer_modules_strict": False})):
            yield
    finally:
        if had:
            experts.is_transposed = before
        else:
            del experts.is_transposed


@contextlib.contextmanager
def _minimax_m2_view(src: Path):
    """GPTQModel 7.6's MiniMax-M2 definition, while a MiniMaxM2ForCausalLM is quantized, given the experts where
    transformers 5 holds them (mlp, its defuser's experts.N.gate_proj, up_proj, down_proj: the definition looks
    under block_sparse_moe for w1, w3, w2, quantized the attention alone and saved the experts float) with the MoE
    hooks of those names; any other model's as it is. minimax_m2_name then writes the hub's names."""
    if read_config_json(src).get("model_type") != "minimax_m2":
        yield
        return
    from gptqmodel.models import auto
    from gptqmodel.models.moe_lifecycle import GateUpDownMoELifecycleHooks
    base = auto.MODEL_MAP["minimax_m2"]
    layer = {k: v for k, v in base.module_tree[3].items() if not k.startswith("block_sparse_moe")}
    layer["mlp:moe"] = {"experts": {"#": ("gate_proj:0", "up_proj:0", "down_proj:1")}}
    with _definition("minimax_m2", type("MiniMaxM2GPTQ", (base,), {
            "module_tree": [*base.module_tree[:3], layer], "moe_lifecycle_hooks": GateUpDownMoELifecycleHooks()})):
        yield


GRANITE_MOE_NOTE = ("GPTQModel 7.6's Granite definitions look for the experts under block_sparse_moe.input_linear.N "
                    "and output_linear.N, where transformers 5 stacks them and its defuser splits them into "
                    "block_sparse_moe.experts.N.gate_proj, up_proj and down_proj: infer quantized those through a "
                    "tree of its own; GPTQModel.load of this checkpoint without it leaves the experts unread (float "
                    "layers the checkpoint never fills, seen on the CPU); infer reads it")


def _granite_tree(model_type: str) -> list:
    """GPTQModel's module tree of a Granite MoE (granitemoe), GraniteMoeShared or Granite 4.0 (granitemoehybrid)
    layer as transformers 5 and GPTQModel's defuser name it: the Mamba-2 mixer's in_proj and out_proj (Granite 4.0),
    q, k, v and o, each expert's gate_proj, up_proj and down_proj (block_sparse_moe.experts.N, counted by
    num_local_experts; none in a Granite 4.0 without experts), and the shared MLP's fused input_linear and
    output_linear (GraniteMoeShared, Granite 4.0); the routers and norms float."""
    layer: dict = {"input_layernorm": ("input_layernorm:!",)}
    if model_type == "granitemoehybrid":
        layer["mamba"] = ("in_proj:0", "out_proj:1")
    layer.update({"self_attn": ("q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1"),
                  "post_attention_layernorm": ("post_attention_layernorm:!",),
                  "block_sparse_moe:moe:?": {"experts": {"#": ("gate_proj:2", "up_proj:2", "down_proj:3")}}})
    if model_type != "granitemoe":
        layer["shared_mlp"] = ("input_linear:2", "output_linear:3")
    return ["model", "layers", "#", layer]


@contextlib.contextmanager
def _granite_view(src: Path):
    """While a Granite MoE, GraniteMoeShared or Granite 4.0 is quantized, GPTQModel 7.6's definition of it given
    _granite_tree (its own looks for the experts where the defuser does not put them, and quantized none; it has no
    GraniteMoeShared definition at all, whose fallback quantized the attention and shared MLP alone: GPTQModel's
    Granite MoE one serves it); Granite 4.0's without its patch of the Mamba-2 mixer's forward (for its quantized
    layers' fast kernels: it reads a torch_forward signature that transformers 5's mixer no longer has, and a first
    layer of attention's mixer, None: "type object 'NoneType' has no attribute 'forward'"), transformers' own mixer
    running the calibration; any other model's as it is."""
    model_type = read_config_json(src).get("model_type")
    if model_type not in ("granitemoe", "granitemoeshared", "granitemoehybrid"):
        yield
        return
    from gptqmodel.models import auto
    base = auto.MODEL_MAP["granitemoehybrid" if model_type == "granitemoehybrid" else "granitemoe"]
    with _definition(model_type, type("GraniteGPTQ", (base,), {"module_tree": _granite_tree(model_type),
                                                               "monkey_patch": lambda self: None})):
        yield


# Nemotron-H's modules as transformers 5 names them (GPTQModel 7.6's definition looks under backbone.layers): each
# block's mixer (attention, Mamba-2's in_proj and out_proj, or the MLP), Nemotron 3's routed experts (GPTQModel's
# defuser splits transformers 5's stacked up_proj and down_proj; n_routed_experts of them), its shared experts and
# Nemotron 3 Super's latent projections int4, in the order a token meets them (fc1_latent_proj, the experts,
# fc2_latent_proj)
_NEMOTRON_H_TREE = ["model", "layers", "#", {"norm": ("norm:!",), "mixer": {
    "": ("q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1", "in_proj:2", "out_proj:2", "gate_proj:3", "up_proj:3",
         "down_proj:4", "fc1_latent_proj:5", "fc2_latent_proj:8"),
    "experts": {"#": ("up_proj:6", "down_proj:7")},
    "shared_experts": ("up_proj:9", "down_proj:10")}}]


@contextlib.contextmanager
def _nemotron_h_view(src: Path):
    """GPTQModel 7.6's Nemotron-H definition, while a NemotronHForCausalLM is quantized, given the layers where
    transformers 5 holds them (_NEMOTRON_H_TREE: it failed at "'NoneType' object is not subscriptable"), without its
    remote code and its patch of the mixer's forward (for its quantized layers' fast kernels), its routed experts
    counted by n_routed_experts (without a count it quantized none: saved float); any other model's as it is."""
    if read_config_json(src).get("model_type") != "nemotron_h":
        yield
        return
    from gptqmodel.models import auto
    with _definition("nemotron_h", type("NemotronHGPTQ", (auto.MODEL_MAP["nemotron_h"],), {
            "module_tree": _NEMOTRON_H_TREE, "monkey_patch": lambda self: None, "require_trust_remote_code": False,
            "dynamic_expert_index": "n_routed_experts"})):
        yield


BAMBA_NOTE = ("GPTQModel 7.6 has no Bamba definition: infer quantized it through one of its own; GPTQModel.load of "
              "this checkpoint, without it, computes garbage (its tokens all 0); infer reads it")
# Bamba's modules as transformers 5 names them: a Mamba-2 mixer (in_proj, out_proj) or attention a layer, then the
# SwiGLU feed_forward, each behind its norm
_BAMBA_TREE = ["model", "layers", "#", {
    "input_layernorm": ("input_layernorm:!",), "mamba": ("in_proj:0", "out_proj:1"),
    "self_attn": ("q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1"), "pre_ff_layernorm": ("pre_ff_layernorm:!",),
    "feed_forward": ("gate_proj:2", "up_proj:2", "down_proj:3")}]


@contextlib.contextmanager
def _bamba_view(src: Path):
    """GPTQModel 7.6 has no Bamba definition (its fallback read the first layer, a Mamba-2 one, for every layer's
    modules and quantized the feed_forward alone, its config.json saying every layer was): while a
    BambaForCausalLM is quantized, a definition of its layers (_BAMBA_TREE: the Mamba-2 mixers' and the attention's
    projections and the feed_forward int4); any other model's as it is."""
    if read_config_json(src).get("model_type") != "bamba":
        yield
        return
    from gptqmodel.models.base import BaseQModel
    with _definition("bamba", type("BambaGPTQ", (BaseQModel,), {
            "module_tree": _BAMBA_TREE, "layer_modules_strict": False,
            "pre_lm_head_norm_module": "model.final_layernorm"})):
        yield


@contextlib.contextmanager
def _definition(model_type: str, definition: type):
    """GPTQModel's definition of `model_type` (auto.MODEL_MAP) replaced by `definition` while the block runs, the
    model type listed as supported (a type not listed gets GPTQModel's fallback); both as they were after."""
    from gptqmodel.models import auto
    before = auto.MODEL_MAP.get(model_type)
    listed = model_type in auto.SUPPORTED_MODELS
    auto.MODEL_MAP[model_type] = definition
    if not listed:
        auto.SUPPORTED_MODELS.append(model_type)
    try:
        yield
    finally:
        if not listed:
            auto.SUPPORTED_MODELS.remove(model_type)
        if before is None:
            del auto.MODEL_MAP[model_type]
        else:
            auto.MODEL_MAP[model_type] = before


FLEX_OLMO_NOTE = ("GPTQModel 7.6 has no FlexOlmo definition: infer quantized it through GPTQModel's OLMoE definition "
                  "given FlexOlmo's norms, but GPTQModel.load of this checkpoint, without that definition, leaves "
                  "the experts unread (its tokens all 0); infer reads it")
# FlexOlmo's modules as transformers 5 names them: OLMo 2's layer (no input norm; norms after the attention and the
# MLP; q and k normed whole) with OLMoE's experts (GPTQModel's defuser splits them into gate_proj, up_proj, down_proj)
_FLEX_OLMO_TREE = ["model", "layers", "#", {
    "self_attn": ("q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1", "q_norm:!", "k_norm:!"),
    "post_attention_layernorm": ("post_attention_layernorm:!",),
    "mlp:moe": {"gate": ("gate:!",), "experts": {"#": ("gate_proj:0", "up_proj:0", "down_proj:1")}},
    "post_feedforward_layernorm": ("post_feedforward_layernorm:!",)}]


@contextlib.contextmanager
def _flex_olmo_view(src: Path):
    """GPTQModel 7.6 has no FlexOlmo definition (it took a FlexOlmo for OLMo 2 and failed: "layer module item
    `mlp.down_proj` not found"): while a FlexOlmoForCausalLM is quantized, its OLMoE definition (the same experts,
    router and attention) given FlexOlmo's layer of norms (_FLEX_OLMO_TREE); any other model's as it is."""
    if read_config_json(src).get("model_type") != "flex_olmo":
        yield
        return
    from gptqmodel.models import auto
    with _definition("flex_olmo", type("FlexOlmoGPTQ", (auto.MODEL_MAP["olmoe"],), {"module_tree": _FLEX_OLMO_TREE})):
        yield


def source_half_dtype(src: Path):
    """The source's dtype when it is float16 or bfloat16 (config.json's `dtype`/`torch_dtype`), which the
    checkpoint keeps for the tensors GPTQ leaves in float; None otherwise (float32: GPTQModel's bfloat16)."""
    import torch
    config = read_config_json(src)
    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str):
        name = name.removeprefix("torch.")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name)


def module_name(row: dict, num_layers: int | None = None) -> str:
    """A report row's module as a user reads it: "layer 3 mlp.down_proj", or "lm_head" for the head."""
    layer = report_layer(row, num_layers)
    return str(row["module"]) if layer == HEAD else f"layer {layer} {row['module']}"


def _check_losses(src: Path, log: dict, num_layers: int | None = None) -> None:
    """GPTQModel must have solved some modules, none with a loss of inf or NaN (a quantization of non-finite values,
    whose checkpoint computes garbage). A module it fell back on reports a text instead of a number: not refused."""
    rows = [r for r in log.get("gptq", []) if "layer" in r and "module" in r]
    if not rows:
        raise InferError(f"GPTQModel quantized no module of {src} (its report is empty)",
                         "rerun with --verbose to see GPTQModel's output")
    bad = [r for r in rows if not math.isfinite(_num(r.get("loss"), default=0.0))]
    if bad:
        more = f" (and {len(bad) - 1} more modules)" if len(bad) > 1 else ""
        raise InferError(f"GPTQModel's quantization of {src} has a non-finite error: {module_name(bad[0], num_layers)}"
                         f" (loss {bad[0].get('loss')}){more}",
                         "the checkpoint would compute garbage: check the source model's weights and the calibration "
                         "text, or quantize in float32")


def _check_saved(out: Path) -> None:
    """GPTQModel must have written the v1 "gptq" format that AutoGPTQ / optimum / vLLM read."""
    qc = json.loads((out / "config.json").read_text()).get("quantization_config") or {}
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if qc.get("quant_method") != "gptq" or fmt != "gptq" or not (out / "quantize_config.json").is_file():
        raise InferError(f"GPTQModel saved an unexpected checkpoint (quant_method={qc.get('quant_method')!r}, "
                         f"format={fmt!r})", f"install the tested GPTQModel version: {EXTRA_HINT}")


# GPTQModel records where it offloaded modules while quantizing: a temporary folder gone once quantize returns, and a
# local path that does not belong in a checkpoint others load.
WORK_PATH_KEYS = ("offload_to_disk_path",)


def _drop_work_paths(out: Path) -> None:
    """Remove the quantize run's temporary paths from the `meta` block of both quantization configs."""
    for name, key in (("quantize_config.json", None), ("config.json", "quantization_config")):
        path = out / name
        data = json.loads(path.read_text())
        qc = data.get(key) if key else data
        meta = qc.get("meta") if isinstance(qc, dict) else None
        if isinstance(meta, dict) and any(k in meta for k in WORK_PATH_KEYS):
            for k in WORK_PATH_KEYS:
                meta.pop(k, None)
            path.write_text(json.dumps(data, indent=2, sort_keys=key is not None) + "\n")


SOURCE_FILES = TOKENIZER_FILES + ("generation_config.json",)


def _restore_source_files(src: Path, out: Path) -> None:
    """Give the checkpoint the source's tokenizer files and generation_config.json unchanged. GPTQModel saves them as
    it loaded them, not as the source has them: it sets `do_sample: true` in generation_config.json (transformers'
    generate then samples where the source model decodes greedily) and rewrites tokenizer_config.json (its class
    name, loading flags, a pad token it picked). A generation_config.json the source lacks is removed: transformers
    and infer derive it from config.json, as they do for the source."""
    for name in SOURCE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if not (src / "generation_config.json").is_file():
        (out / "generation_config.json").unlink(missing_ok=True)


# Phi-3's MLP is one gate_up_proj (transformers' Phi3MLP, vLLM's Phi-3), and so is GLM-4's (Glm4MLP): GPTQModel
# unfuses it to quantize and saves gate_proj and up_proj apart, a layout only GPTQModel and infer read
FUSED_MLP = {"phi3": ("gate_proj", "up_proj", "gate_up_proj"), "glm4": ("gate_proj", "up_proj", "gate_up_proj"),
             "glm": ("gate_proj", "up_proj", "gate_up_proj")}
FUSED_MLP_ARCH = {"phi3": "Phi-3", "glm4": "GLM-4", "glm": "GLM-4 (glm-4-9b-chat-hf)"}
SPLIT_MLP_NOTE = ("--desc-act gives this {arch} checkpoint's mlp.gate_proj and mlp.up_proj different g_idx "
                  "permutations, which cannot share the one gate_up_proj module of transformers' and vLLM's {arch}: "
                  "it keeps GPTQModel's split layout, which infer and GPTQModel run but transformers (`infer bench "
                  "--baseline hf`) and vLLM cannot load; quantize with --no-desc-act for a checkpoint they load")
# GPTQModel's own Phi-3 definition names the MLP's gate_proj and up_proj (it unfuses Phi3MLP), and GPTQModel.load
# refuses a checkpoint without them ("Missing required quantized weights ... mlp.gate_proj.qweight", GPTQModel 7.6)
FUSED_MLP_NOTE = ("this {arch} checkpoint's MLP is one mlp.gate_up_proj, as transformers (`infer bench --baseline "
                  "hf`) and vLLM load it (and infer); GPTQModel.load reads only its own split layout (mlp.gate_proj "
                  "and mlp.up_proj apart) and refuses it, so load it with transformers, not GPTQModel.load")


def fuse_gate_up(out: Path, config: dict, opts: QuantizeOptions) -> list[str]:
    """Rewrite GPTQModel's saved Phi-3 (or GLM-4) checkpoint in `out` with each layer's mlp.gate_proj and mlp.up_proj
    as the one mlp.gate_up_proj that transformers and vLLM load: qweight, scales and qzeros (and biases) concatenated
    along the output, gate first (exact: each half's width packs into whole int32 words), g_idx kept once. Only where
    every pair shares its g_idx (no act-order); otherwise the split layout stays. The notes returned say which readers
    load the layout written (GPTQModel.load none but its split one)."""
    names = FUSED_MLP.get(str(config.get("model_type")))
    if names is None:
        return []
    gate, up, fused = names
    arch = FUSED_MLP_ARCH[str(config.get("model_type"))]
    if opts.desc_act:
        return [SPLIT_MLP_NOTE.format(arch=arch)]
    if opts.bits * int(config.get("intermediate_size") or 0) % 32:
        return []  # its zero points do not pack in whole words: infer reads either layout
    import torch
    state = _read_tensors(out)
    pairs = [k for k in state if f".mlp.{gate}." in k]
    if not pairs:
        return []
    for key in pairs:
        other = key.replace(f".mlp.{gate}.", f".mlp.{up}.")
        if other not in state:
            return []
        if key.endswith(".g_idx") and not (state[key].shape == state[other].shape and torch.equal(state[key],
                                                                                                  state[other])):
            return [SPLIT_MLP_NOTE.format(arch=arch)]
    for key in pairs:
        a, b = state.pop(key), state.pop(key.replace(f".mlp.{gate}.", f".mlp.{up}."))
        dim = 0 if key.endswith((".weight", ".bias")) else a.dim() - 1
        both = a if key.endswith(".g_idx") else torch.cat([a, b], dim=dim)
        state[key.replace(f".mlp.{gate}.", f".mlp.{fused}.")] = both.contiguous()
    _write_tensors(out, state, opts)
    _rename_in_quant_configs(out, gate, up, fused)
    return [FUSED_MLP_NOTE.format(arch=arch)]


def _rename_in_quant_configs(out: Path, gate: str, up: str, fused: str) -> None:
    """The quantization configs' module names (modules_in_block_to_quantize) with gate and up as the fused module."""
    for name, key in (("quantize_config.json", None), ("config.json", "quantization_config")):
        path = out / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        qc = data.get(key) if key else data
        blocks = qc.get("modules_in_block_to_quantize") if isinstance(qc, dict) else None
        if not isinstance(blocks, list):
            continue
        renamed = []
        for block in blocks:
            names = [n.rsplit(".", 1)[0] + "." + fused if isinstance(n, str) and n.split(".")[-2:] in
                     (["mlp", gate], ["mlp", up]) else n for n in block] if isinstance(block, list) else block
            renamed.append(list(dict.fromkeys(names)) if isinstance(names, list) else names)
        qc["modules_in_block_to_quantize"] = renamed
        path.write_text(json.dumps(data, indent=2, sort_keys=key is not None) + "\n")


# Mixtures of experts (infer's models.moe): GPTQModel quantizes each expert's gate, up and down projections as modules
# of their own (it unfuses transformers 5's stacked experts) and Qwen2-MoE's shared expert as a dense MLP; the router
# (mlp.gate) and the shared expert's gate (shared_expert_gate) stay float; Hunyuan MoE's shared_mlp is quantized as a
# dense MLP, its router (mlp.gate.wg) stays float
MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "hunyuan_v1_moe", "lfm2_moe", "phimoe", "flex_olmo",
             "nemotron_h", "granitemoe", "granitemoeshared", "granitemoehybrid", "glm4_moe", "ernie4_5_moe",
             "minimax_m2", "glm4_moe_lite", "llama4_text")
# (their GPTQ experts read by infer alone: GPTQModel.load needs infer's view of them, _nemotron_h_view, _granite_view,
# _glm4_moe_view, _llama4_view; MiniMax-M2's: MINIMAX_NOTE)
_INFER_READS = ("nemotron_h", "granitemoe", "granitemoeshared", "granitemoehybrid", "glm4_moe", "minimax_m2",
                "glm4_moe_lite", "llama4_text")
# GPTQModel 7.6 saves Mixtral's experts under its unfused names (mlp.experts.N.gate_proj, up_proj, down_proj; the router
# mlp.gate), which only GPTQModel.load reads: Mixtral's checkpoints, vLLM and infer name them
# block_sparse_moe.experts.N.w1, w3, w2 and block_sparse_moe.gate
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_GPTQMODEL_MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)?mlp\."
                                r"(?:(gate)|experts\.(\d+)\.(gate_proj|up_proj|down_proj))(?=\.|$)")
MIXTRAL_NOTE = ("this Mixtral checkpoint names its experts block_sparse_moe.experts.N.w1, w3, w2 (its router "
                "block_sparse_moe.gate), as Mixtral's own checkpoints do and vLLM and infer read them; GPTQModel.load "
                "reads only its own names (mlp.experts.N.gate_proj, up_proj, down_proj) and refuses it")
# MiniMax-M2's the same, its router's correction bias too (mlp.e_score_correction_bias): the hub's checkpoints, vLLM
# and infer name them block_sparse_moe.experts.N.w1, w3, w2, block_sparse_moe.gate, e_score_correction_bias
_GPTQMODEL_MINIMAX = re.compile(r"^(model\.layers\.\d+\.)?mlp\.(?:(gate|e_score_correction_bias)"
                                r"|experts\.(\d+)\.(gate_proj|up_proj|down_proj))(?=\.|$)")
MINIMAX_NOTE = ("this MiniMax-M2 checkpoint names its experts block_sparse_moe.experts.N.w1, w3, w2 (its router "
                "block_sparse_moe.gate and e_score_correction_bias), as MiniMax-M2's own checkpoints do and infer "
                "reads them; GPTQModel.load of it on transformers 5 leaves the experts unread (its definition looks "
                "for them where transformers 5 does not put them)")
MOE_TRANSFORMERS_NOTE = ("transformers does not read GPTQ experts: its {arch} experts stay float layers the "
                         "checkpoint's int4 tensors never fill (wrong outputs there, `infer bench --baseline hf` too); "
                         "{readers} read them")
FALLBACK_NOTE = ("calibration routed {few} to {n} module{s} ({none} got none), which GPTQModel quantized by "
                 "round-to-nearest instead of GPTQ (its fallback, without calibration: a larger error; no loss in "
                 "{report}): {names}. Calibrate on more or longer text (--num-samples, --seq-len, --calibration) for "
                 "GPTQ on every expert")


def mixtral_names(out: Path, config: dict, opts: QuantizeOptions) -> list[str]:
    """Rewrite GPTQModel's saved Mixtral checkpoint in `out` with Mixtral's own names of the experts and the router
    (MIXTRAL_NAMES: tensors renamed, not changed); the note returned says GPTQModel.load refuses them. An LFM2-MoE's
    experts renamed the same way (lfm2_moe_name), without a note."""
    mixtral_name = _EXPERT_NAMES.get(config.get("model_type"))
    if mixtral_name is None:
        return []
    log = out / "quant_log.csv"  # GPTQModel's own report (layer,module,...): its modules named as the checkpoint's
    if log.is_file():
        import csv
        with log.open(newline="") as f:
            rows = list(csv.reader(f))
        with log.open("w", newline="") as f:
            csv.writer(f).writerows([r[:1] + [mixtral_name(r[1])] + r[2:] if len(r) > 1 else r for r in rows])
    state = _read_tensors(out)
    if all(mixtral_name(k) == k for k in state):
        return []
    _write_tensors(out, {mixtral_name(k): v for k, v in state.items()}, opts)
    return {"mixtral": [MIXTRAL_NOTE], "phimoe": [PHIMOE_NOTE], "minimax_m2": [MINIMAX_NOTE]}.get(
        config.get("model_type"), [])


def mixtral_name(key: str) -> str:
    """GPTQModel's name of a Mixtral tensor (model.layers.N.mlp.experts.E.gate_proj.qweight) or of a module its report
    rows name (mlp.experts.E.gate_proj) as Mixtral names it (block_sparse_moe.experts.E.w1); any other unchanged."""
    m = _GPTQMODEL_MIXTRAL.match(key)
    if m is None or (m.group(1) is None and m.end() != len(key)):
        return key
    module = "gate" if m.group(2) else f"experts.{m.group(3)}.{MIXTRAL_NAMES[m.group(4)]}"
    return f"{m.group(1) or ''}block_sparse_moe.{module}" + key[m.end():]


# an LFM2-MoE expert's projections as GPTQModel saves them under _LFM2_MOE_TREE's names (transformers 5's defused
# experts: feed_forward.experts.N.gate_proj, up_proj, down_proj); LFM2-MoE's own checkpoints of transformers 4, vLLM
# and infer (models.moe) name them w1, w3, w2
_GPTQMODEL_LFM2_MOE = re.compile(r"^((?:model\.layers\.\d+\.)?feed_forward\.experts\.\d+\.)"
                                 r"(gate_proj|up_proj|down_proj)(?=\.|$)")


def minimax_m2_name(key: str) -> str:
    """GPTQModel's name of a MiniMax-M2 tensor under _minimax_m2_view's tree (model.layers.N.mlp.experts.E.gate_proj.
    qweight, mlp.gate.weight, mlp.e_score_correction_bias) or of a module its report rows name, as the hub's
    checkpoints name it (block_sparse_moe.experts.E.w1, block_sparse_moe.gate, ...); any other unchanged."""
    m = _GPTQMODEL_MINIMAX.match(key)
    if m is None or (m.group(1) is None and m.end() != len(key)):
        return key
    module = m.group(2) or f"experts.{m.group(3)}.{MIXTRAL_NAMES[m.group(4)]}"
    return f"{m.group(1) or ''}block_sparse_moe.{module}" + key[m.end():]


def lfm2_moe_name(key: str) -> str:
    """GPTQModel's name of an LFM2-MoE expert's tensor (model.layers.N.feed_forward.experts.E.gate_proj.qweight) or of
    a module its report rows name, as LFM2-MoE names it (...experts.E.w1); any other unchanged."""
    m = _GPTQMODEL_LFM2_MOE.match(key)
    return key if m is None else m.group(1) + MIXTRAL_NAMES[m.group(2)] + key[m.end():]


# a Phi-3.5-MoE's router and experts as GPTQModel saves them (transformers 5's names: mlp.router, the defused
# mlp.experts.N.gate_proj, up_proj, down_proj); Phi-3.5-MoE's own checkpoints, vLLM and infer name them
# block_sparse_moe.gate and block_sparse_moe.experts.N.w1, w3, w2
_GPTQMODEL_PHIMOE = re.compile(r"^(model\.layers\.\d+\.)?mlp\."
                               r"(?:(router)|experts\.(\d+)\.(gate_proj|up_proj|down_proj))(?=\.|$)")
PHIMOE_NOTE = ("this Phi-3.5-MoE checkpoint names its experts block_sparse_moe.experts.N.w1, w3, w2 (its router "
               "block_sparse_moe.gate), as Phi-3.5-MoE's own checkpoints do and vLLM and infer read them; "
               "GPTQModel.load reads only its own names (mlp.experts.N.gate_proj, up_proj, down_proj; mlp.router) and "
               "refuses it")


def phimoe_name(key: str) -> str:
    """GPTQModel's name of a Phi-3.5-MoE tensor (model.layers.N.mlp.experts.E.gate_proj.qweight, mlp.router.weight)
    or of a module its report rows name, as Phi-3.5-MoE names it (block_sparse_moe.experts.E.w1,
    block_sparse_moe.gate); any other unchanged."""
    m = _GPTQMODEL_PHIMOE.match(key)
    if m is None or (m.group(1) is None and m.end() != len(key)):
        return key
    module = "gate" if m.group(2) else f"experts.{m.group(3)}.{MIXTRAL_NAMES[m.group(4)]}"
    return f"{m.group(1) or ''}block_sparse_moe.{module}" + key[m.end():]


_EXPERT_NAMES = {"mixtral": mixtral_name, "lfm2_moe": lfm2_moe_name, "phimoe": phimoe_name,
                 "minimax_m2": minimax_m2_name}


def moe_notes(config: dict, log: dict, num_layers: int | None = None, out: Path | None = None) -> list[str]:
    """What a mixture of experts' checkpoint's readers should know: transformers runs its experts float, unread; the
    expert projections calibration routed too few tokens to (GPTQModel's fallback: round-to-nearest; its threshold
    as the quantize_config.json in `out` records it)."""
    model_type = config.get("model_type")
    if model_type not in MOE_TYPES or model_type == "nemotron_h" and not _nemotron_experts(config) \
            or model_type == "granitemoehybrid" and not config.get("num_local_experts"):  # (none: dense)
        return []
    arch = {"qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "olmoe": "OLMoE",
            "hunyuan_v1_moe": "Hunyuan MoE", "lfm2_moe": "LFM2-MoE", "phimoe": "Phi-3.5-MoE",
            "flex_olmo": "FlexOlmo", "nemotron_h": "Nemotron 3", "granitemoe": "Granite MoE",
            "granitemoeshared": "GraniteMoeShared", "granitemoehybrid": "Granite 4.0",
            "glm4_moe": "GLM-4.5", "ernie4_5_moe": "ERNIE 4.5 MoE", "minimax_m2": "MiniMax-M2",
            "glm4_moe_lite": "GLM-4.7-Flash", "llama4_text": "Llama 4"}[model_type]
    # (their experts renamed: GPTQModel.load reads its own names alone; Nemotron 3's only given infer's view of its
    # layers, _nemotron_h_view: without it, "No compatible quant linear was found"; Granite's: GRANITE_MOE_NOTE)
    own = model_type in ("mixtral", "lfm2_moe", "phimoe", "flex_olmo")
    readers = "infer" if model_type in _INFER_READS else "infer and vLLM" if own else \
        "infer and GPTQModel.load" if model_type == "ernie4_5_moe" else "infer, GPTQModel.load and vLLM"
    notes = [MOE_TRANSFORMERS_NOTE.format(arch=arch, readers=readers)]
    if model_type == "flex_olmo":
        notes.append(FLEX_OLMO_NOTE)
    if model_type.startswith("granitemoe"):
        notes.append(GRANITE_MOE_NOTE)
    if model_type in ("glm4_moe", "glm4_moe_lite"):
        notes.append(GLM4_MOE_NOTE)
    if model_type == "llama4_text":
        notes.append(LLAMA4_NOTE)
    rows = [r for r in log.get("gptq", []) if "layer" in r and "module" in r
            and str(r.get("loss", "")).startswith("fallback")]  # "fallback(rtn): 0.0126" (GPTQModel 7.6)
    if rows:
        none = sum(1 for r in rows if _int(r.get("samples")) == 0)
        threshold = _fallback_threshold(out) if out is not None else ""
        few = (f"fewer than {threshold} of its tokens" if threshold.endswith("%") else
               f"fewer than {threshold} tokens" if threshold else "too few tokens")  # GPTQModel's threshold
        names = ", ".join(module_name(r, num_layers) for r in rows[:3]) + (
            f" and {len(rows) - 3} more" if len(rows) > 3 else "")
        notes.append(FALLBACK_NOTE.format(few=few, n=len(rows), s="" if len(rows) == 1 else "s", none=none,
                                          report=REPORT_NAME, names=names))
    return notes


def _nemotron_experts(config: dict) -> bool:
    """Whether a Nemotron-H's config.json has layers of experts (Nemotron 3): "moe" in layers_block_type, as
    transformers 5 writes it, or "E" in the hub's hybrid_override_pattern."""
    kinds = config.get("layers_block_type")
    return "moe" in kinds if isinstance(kinds, list) else "E" in str(config.get("hybrid_override_pattern", ""))


def _fallback_threshold(out: Path) -> str:
    """GPTQModel's fallback threshold as its quantize_config.json records it (meta.fallback.threshold: "0.5%", a share
    of the calibration tokens, or a count); "" where it records none."""
    try:
        threshold = json.loads((out / "quantize_config.json").read_text())["meta"]["fallback"]["threshold"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return str(threshold) if isinstance(threshold, (str, int, float)) else ""


def _read_tensors(out: Path) -> dict:
    from .convert import load_weight_file
    state: dict = {}
    for f in weight_files(out):
        state.update(load_weight_file(f))
    return state


def _write_tensors(out: Path, state: dict, opts: QuantizeOptions) -> None:
    """Replace the checkpoint's weight files in `out` with `state`, sharded at --max-shard-size."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    for f in weight_files(out):
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    split = split_torch_state_dict_into_shards(state, max_shard_size=parse_shard_size(opts.max_shard_size))
    for filename, tensors in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in tensors}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


HEAD = "lm_head"  # the report's `layer` of the output head's row (--lm-head): no decoder layer


def report_layer(row: dict, num_layers: int | None = None) -> int | str:
    """A GPTQModel log row's `layer` as the report keys it: the decoder layer's index, or HEAD for the output head,
    which GPTQModel solves as one more layer numbered after the decoder's (layer num_hidden_layers). A report's own
    row (its layer already keyed) reads as it is."""
    if row["layer"] == HEAD:
        return HEAD
    layer = int(row["layer"])
    head = str(row["module"]) == HEAD or (num_layers is not None and num_layers > 0 and layer >= num_layers)
    return HEAD if head else layer


def report_frame(log: dict, num_layers: int | None = None):
    """GPTQModel's per-module log ({"gptq": [{layer, module, loss, samples, damp, time, ...}]}) as a table; the
    head's row (--lm-head) is keyed `lm_head`, not a decoder layer's index (`num_layers`: the decoder's)."""
    import pandas as pd
    rows = [{"layer": report_layer(r, num_layers), "module": str(r["module"]), "loss": _num(r.get("loss")),
             "samples": _int(r.get("samples")), "damp": _num(r.get("damp")), "seconds": _num(r.get("time"))}
            for r in log.get("gptq", []) if "layer" in r and "module" in r]
    # in the order GPTQModel ran them: by decoder layer (stable within one), the head last
    rows.sort(key=lambda r: (r["layer"] == HEAD, r["layer"] if r["layer"] != HEAD else 0))
    return pd.DataFrame(rows, columns=["layer", "module", "loss", "samples", "damp", "seconds"])


def _num(value, default: float = float("nan")) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _int(value) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return 0
