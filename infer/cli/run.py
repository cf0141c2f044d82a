"""`infer run MODEL INPUT.jsonl -o OUTPUT.jsonl`: batched generation for every line of a JSONL file."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ConfigError, RequestError
from . import options as o
from .batch_io import RecordWriter, done_ids, error_record, output_record, read_inputs


def run(
    model: o.Model,
    input: Annotated[Path, typer.Argument(help="JSONL file: one request per line (prompt | messages | "
                                               "prompt_token_ids, or an OpenAI batch line).", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Output JSONL (default: stdout).")] = None,
    resume: Annotated[bool, typer.Option(help="Skip ids already in OUTPUT and complete the rest.")] = False,
    strict: Annotated[bool, typer.Option(help="Check every line first; exit 2 before generating if one is bad.")]
    = False,
    max_new_tokens: Annotated[int, typer.Option(help="Default for lines without max_new_tokens.")] = 256,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or summary.")] = False,
    dtype: o.Dtype = "auto", device: o.Device = "auto", max_num_seqs: o.MaxNumSeqs = 64,
    max_num_batched_tokens: o.MaxBatchedTokens = 4096, block_size: o.BlockSize = 16,
    max_model_len: o.MaxModelLen = None, seed: o.Seed = 0, prefix_caching: o.PrefixCaching = True,
    memory_limit: o.MemoryLimit = None, gpu_memory_utilization: o.GpuUtil = 0.9,
    lora: o.Lora = None, max_loras: o.MaxLoras = 4, max_lora_rank: o.MaxLoraRank = 64,
    max_cpu_loras: o.MaxCpuLoras = None,
    eager: o.Eager = False,
) -> None:
    """Generate a reply for every line of INPUT; records are appended to OUTPUT as requests finish.

    Example: [bold]infer run tiny-llama prompts.jsonl -o out.jsonl --max-new-tokens 64[/bold]

    Exit status: 0 all lines ok, 1 some lines failed (each has an error record), 2 the run could not start.
    """
    if resume and output is None:
        raise ConfigError("--resume needs -o OUTPUT", "resume reads the ids already written to OUTPUT")
    if not input.is_file():
        raise ConfigError(f"input file {input} does not exist", "give a JSONL file with one request per line")
    cfg = o.engine_config(model, dtype, device, max_num_seqs, max_num_batched_tokens, block_size, max_model_len, seed,
                          prefix_caching, memory_limit, gpu_memory_utilization, lora, max_loras, max_lora_rank,
                          max_cpu_loras, eager)
    from ..engine.llm_engine import LLMEngine
    engine = LLMEngine(cfg)
    if not quiet:
        p = engine.memory_plan
        typer.echo(f"infer: {engine.model_path.name} on {engine.device.type}, {engine.dtype}, KV cache "
                   f"{p.num_blocks} blocks x {cfg.block_size} tokens, max length {engine.max_model_len}", err=True)
    lines = read_inputs(input, engine.tokenizer, {"max_new_tokens": max_new_tokens})
    for item in lines:  # requests that can never run are errors now, not in the middle of the run
        if item.request is not None:
            try:
                engine.validate(item.request.prompt_token_ids, item.request.params, item.request.lora)
            except RequestError as e:
                item.request, item.error = None, f"line {item.line_no}: {e}"
    bad = [item for item in lines if item.error]
    if strict and bad:
        for item in bad:
            typer.echo(f"error: {item.error}", err=True)
        raise ConfigError(f"{len(bad)} of {len(lines)} input lines are invalid (--strict)", "fix them and run again")
    skip = done_ids(output) if resume and output is not None else set()
    todo = [item for item in lines if item.id not in skip]
    writer = RecordWriter(output, append=resume)
    try:
        failed = _generate(engine, todo, writer, quiet)
    finally:
        writer.close()
    if failed:
        raise typer.Exit(1)


def _generate(engine, todo, writer: RecordWriter, quiet: bool) -> int:
    failed = 0
    pending = {}
    for item in todo:
        if item.error:
            writer.write(error_record(item.id, item.error))
            failed += 1
            continue
        r = item.request
        engine.add_request(item.id, r.prompt_token_ids, r.params, r.lora)
        pending[item.id] = item
    start, tokens = time.monotonic(), 0
    progress = _progress(len(todo), quiet)
    with progress:
        task = progress.add_task("requests", total=len(todo), completed=failed, tokens="0 tok/s")
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += len(out.new_token_ids)
                if out.finished:
                    writer.write(output_record(out.request_id, out, engine.tokenizer))
                    pending.pop(out.request_id, None)
                    progress.advance(task)
            rate = tokens / max(time.monotonic() - start, 1e-9)
            progress.update(task, tokens=f"{rate:,.0f} tok/s")
    if not quiet:
        elapsed = time.monotonic() - start
        typer.echo(f"infer: {len(todo) - failed} ok, {failed} failed, {tokens} tokens in {elapsed:.1f} s "
                   f"({tokens / max(elapsed, 1e-9):,.1f} tok/s)", err=True)
    return failed


def _progress(total: int, quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    console = Console(stderr=True)
    disable = quiet or not sys.stderr.isatty()
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[tokens]}"), TimeElapsedColumn(), console=console, disable=disable,
                    transient=False)
