"""`infer convert`: rewrite a model folder as safetensors, optionally in another dtype or with a LoRA merged in."""

from __future__ import annotations

import json

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ..errors import ConfigError
from . import options as o


def convert(
    model: Annotated[str, typer.Argument(help="A Hugging Face model folder (.bin, sharded or safetensors; float, "
                                              "GPTQ or AWQ), or a built-in model name.", show_default=False)],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write the converted model into.",
                                         show_default=False, parser=o.folder_path, metavar="<path>")],
    to: Annotated[str, typer.Option("--to", help="Target format: safetensors (a quantized checkpoint's tensors "
                                                 "kept as they are), or gptq (an AWQ 'gemm' checkpoint rewritten as "
                                                 "the GPTQ checkpoint of the same int4 weights).")] = "safetensors",
    dtype: Annotated[Optional[str], typer.Option(help="float16 | bfloat16 | float32 (default: keep the "
                                                      "checkpoint's dtype). Float models only.",
                                                 show_default=False)] = None,
    merge_lora: Annotated[Optional[list[Path]], typer.Option(help="A PEFT LoRA adapter folder to fold into the "
                                                                  "weights (merge_and_unload). Float models only.",
                                                             show_default=False,
                                                             parser=o.given_path("a PEFT adapter folder"),
                                                             metavar="<path>")] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors file; bigger models are sharded. "
                                                     "KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024, a "
                                                     "plain number is bytes.")] = "4GB",
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it already holds a model.")] = False,
) -> None:
    """Convert a model folder to (sharded-when-large) safetensors, copying its tokenizer files.

    A float model is loaded with transformers and saved again, optionally cast to --dtype and with a LoRA adapter
    merged in. With --to gptq an AWQ 'gemm' checkpoint is rewritten as the GPTQ checkpoint of the same int4
    weights (asymmetric, v1 zero points: what transformers, GPTQModel and vLLM load as GPTQ), other tensors and the
    tokenizer copied. A GPTQ (or, to safetensors, AWQ) checkpoint is copied tensor by tensor unchanged (its int4
    weights are repacked for the kernel at load time, never on disk), so --dtype and --merge-lora are refused for
    it: merge into the float model first, then `infer quantize` it, or serve the adapter on top of the GPTQ model
    with --lora.

    Example: infer convert ./my-model-bin -o ./my-model --dtype bfloat16 --merge-lora ./adapters/support
    """
    from ..models.loader import check_weights
    from ..models.resolve import resolve_model, source_name, typed_name
    from ..quant.convert import convert_model, parse_shard_size
    from .entry import terminate_as_interrupt
    from .quiet import library_output
    from ..engine.config import DTYPE_ALIASES
    dtype = DTYPE_ALIASES.get(dtype, dtype)  # vLLM's half and float, as the engine options take them
    shard_bytes = parse_shard_size(max_shard_size)  # a bad size fails now, not after loading the model
    from ..quant.convert import TARGETS
    if to not in TARGETS:
        raise ConfigError(f"--to {to!r} is not supported", f"use one of {', '.join(TARGETS)}")
    merge_lora = o.one_path("--merge-lora", merge_lora, lambda given: (
        f"merge one, then the next into its output: infer convert MODEL -o merged1 --merge-lora {given[0]}; "
        f"infer convert merged1 -o merged2 --merge-lora {given[1]}"))
    src = resolve_model(model)
    if merge_lora is not None:
        _check_adapter(merge_lora, src)  # first: "its sizes may fit" would be wrong beside an error that they don't
        _warn_other_base(merge_lora, src, model)
    # SIGTERM stops it as Ctrl-C does: the staging folder beside OUTPUT (a whole model) is removed, not left behind
    with terminate_as_interrupt(), library_output():  # transformers' and peft's bars; errors reach handle_errors
        out = convert_model(src, output, dtype=dtype, merge_lora=merge_lora, max_shard_size=shard_bytes,
                            overwrite=overwrite, check_weights=check_weights, source_name=source_name(model), to=to,
                            shown=typed_name(model))  # a built-in or hub id as typed, not its cache folder
    files = sorted(p.name for p in Path(out).iterdir())
    from ..quant.convert import read_config_json
    from ..quant.fp8 import fp8_config
    fp8 = fp8_config(read_config_json(src)) is not None and "FP8 weights dequantized"  # (quant.fp8)
    what = ", ".join(x for x in (fp8, dtype, merge_lora and f"merged {merge_lora}", to == "gptq" and "GPTQ") if x) \
        or "same dtype"
    Console().print(f"Wrote {out} ({what}): {', '.join(files)}", soft_wrap=True)  # the path on one line, as written


def _check_adapter(adapter: Path, src: Path) -> None:
    """The checks `--lora` and `infer lora-validate` make (files present and readable, finite weights and scaling,
    every tensor's shape and layer against the base), before peft sees the folder: peft takes a folder without
    weights for a Hub id and would try to download it, and merges NaN weights or another model's layers silently.
    A GPTQ or AWQ base is left to convert_model, which refuses any merge into it."""
    from ..errors import LoRAError
    from ..lora.adapter import load_adapter
    from ..models.loader import load_config
    from ..quant.convert import is_awq, is_gptq
    if not (Path(src) / "config.json").is_file() or is_gptq(src) or is_awq(src):
        return
    base_config = load_config(src)
    try:
        spelled = load_adapter("--merge-lora", adapter, base_config, merging=True).config.get("peft_type")
    except LoRAError as e:  # worded for --lora NAME=PATH (serve, run): speak of the flag this command has
        prefix = f"LoRA adapter '--merge-lora' ({Path(adapter).expanduser()}): "
        hint = (e.hint or "").replace("--lora NAME=PATH", "--merge-lora PATH").replace(
            "pass the folder peft's", "pass --merge-lora PATH with the folder peft's") or None
        raise LoRAError(f"--merge-lora {adapter}: {e.message.removeprefix(prefix)}", hint) from e
    if spelled != "LORA":  # `--lora` reads "lora" too; peft, which merges, only "LORA" (a KeyError: 'lora')
        raise LoRAError(f"--merge-lora {adapter}: peft_type is {json.dumps(spelled)}: peft reads only \"LORA\" and "
                        "cannot load it", 'write "peft_type": "LORA" in adapter_config.json')


def _warn_other_base(adapter: Path, src: Path, given: str) -> None:
    """The warning `infer lora-validate` gives for an adapter whose config names another base model: merging it
    succeeds when the sizes happen to fit, and writes a model nobody trained."""
    import json
    from types import SimpleNamespace

    from ..lora.validate import base_name_warning
    try:
        cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return  # convert_model names a missing or unreadable adapter config
    if isinstance(cfg, dict):
        warning = base_name_warning(Path(adapter).name, cfg, SimpleNamespace(path=Path(src)), given)
        if warning:
            typer.echo(f"warning: {warning}", err=True)
