"""`infer` command line: one file per command; user errors become one line on stderr and an exit code."""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Annotated

import typer

from ..errors import InferError

app = typer.Typer(
    name="infer",
    help="Deploy GPTQ int4 language models with batched multi-LoRA, and measure them.\n\n"
         "Example: infer run tiny-llama prompts.jsonl -o out.jsonl",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
_state = {"debug": False}


def handle_errors(fn):
    """Map InferError to a one-line message and its exit code (traceback only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InferError as e:
            if _state["debug"] or os.environ.get("INFER_DEBUG"):
                raise
            typer.echo(f"error: {e.message}" + (f"\n  hint: {e.hint}" if e.hint else ""), err=True)
            raise typer.Exit(e.exit_code)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)

    return wrapper


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False) -> None:
    """Deploy GPTQ int4 language models with batched multi-LoRA, and measure them."""
    _state["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


def register(module: str, name: str, command: str | None = None, **kwargs) -> None:
    import importlib
    fn = getattr(importlib.import_module(f"infer.cli.{module}"), name)
    app.command(command or name.replace("_", "-"), **kwargs)(handle_errors(fn))


register("run", "run")
register("warmup", "warmup")
register("quantize", "quantize")
register("convert", "convert")
register("serve", "serve")
register("bench", "bench")
register("demo", "demo")
register("lora", "lora_validate", "lora-validate")
