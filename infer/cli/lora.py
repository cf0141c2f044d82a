"""`infer lora-validate BASE ADAPTER...`: can these PEFT adapters be served on BASE, and do they compute what peft
computes? One table row per adapter; exit 1 if any adapter fails (each reason printed), 2 for a bad BASE."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from . import options as o


def lora_validate(
    base: Annotated[str, typer.Argument(help="The base model: a Hugging Face folder (float, GPTQ or AWQ) or a built-in "
                                             "model name.", show_default=False)],
    adapters: Annotated[list[str], typer.Argument(help="PEFT adapter folders, as NAME=PATH or PATH (the name is "
                                                       "the folder's name).", show_default=False)],
    quantized: Annotated[bool, typer.Option("--quantized", help="Require BASE to be a GPTQ or AWQ checkpoint (exit 2 "
                                                                "for a float model): check the adapters against "
                                                                "the int4 base you will serve.")] = False,
    max_lora_rank: o.MaxLoraRank = o.default("max_lora_rank"),
    lora_target_modules: o.LoraTargetModules = None,
    steps: Annotated[int, typer.Option(min=0, max=256, help="Greedy steps per prompt in the numeric check "
                                                            "(0 = static checks only).")] = 8,
    device: o.Device = o.default("device"),
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per adapter instead of a "
                                                         "table.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every module whose sizes do not fit BASE "
                                                                  "(by default one line per adapter).")] = False,
) -> None:
    """Check every ADAPTER against BASE: its config and weights, its shapes against the base's projections, and a
    numeric check — infer's logits with the adapter against peft's on the same base, over a few greedy steps of a
    few fixed prompts (for a GPTQ or AWQ base, peft runs on the dequantized int4 weights). The numeric check runs in
    float32 and only for adapters that pass the static checks.

    An adapter made for a base of other sizes fails with one line (e.g. "r=16 adapter expects hidden 2048, base
    has 64 (18 modules)"); --verbose lists every module. An adapter whose adapter_config.json names another base
    model (base_model_name_or_path) gets a warning, not a failure: its sizes may fit by chance. Other libraries'
    messages are hidden (shown with `infer --debug`).

    A GPTQ or AWQ base is recognised from quantization_config in BASE/config.json; --quantized only makes that a
    requirement, so a float folder passed by mistake is refused rather than silently checked.

    --lora-target-modules takes several names after one flag (o_proj qkv_proj, as the engine commands do) or names
    separated by commas; give it after the adapters: before them, every word up to the last ADAPTER is read as a
    module name.

    Example: infer lora-validate ./llama-gptq support=./adapters/support ./adapters/legal

    Exit status: 0 every adapter passes, 1 some adapter fails (the reasons are printed), 2 bad BASE or options.
    """
    from ..lora.targets import parse_target_modules
    from .lora_check import run_checks
    from .quiet import library_output
    with library_output():
        info, reports = run_checks(base, adapters, quantized, max_lora_rank, steps, device,
                                   parse_target_modules(lora_target_modules or None))
    print_reports(info, reports, as_json)
    exit_on_failures(reports, verbose)


def print_reports(info, reports, as_json: bool) -> None:
    """Each adapter's warnings on stderr, then the table (or one JSON object per adapter) on stdout."""
    for r in reports:
        for w in r.warnings:
            typer.echo(f"warning: {w}", err=True)
    if as_json:
        for r in reports:
            typer.echo(json.dumps({**r.to_dict(), "base": str(info.path), "base_quantization": info.gptq}))
    else:
        Console(width=max(Console().width, 160)).print(report_table(info, reports))


def exit_on_failures(reports, verbose: bool) -> None:
    """Every failed adapter's reasons on stderr, and exit 1 if any failed."""
    failed = [r for r in reports if not r.ok]
    for r in failed:
        for reason in r.reasons(verbose):
            typer.echo(f"error: adapter {r.name!r} ({r.path}): {reason}", err=True)
    if failed:
        typer.echo(f"{len(failed)} of {len(reports)} adapters failed", err=True)
        raise typer.Exit(1)


def report_table(info, reports) -> Table:
    base = info.gptq or "float"
    table = Table(title=f"LoRA adapters on {info.name or info.path.name} ({base})")
    for col in ("adapter", "rank", "alpha", "scaling", "rslora", "targets", "shapes", "base", "max |Δlogit|",
                "adapter effect", "tokens", "result"):
        table.add_column(col, justify="right" if col in ("rank", "alpha", "scaling") else "left")
    for r in reports:
        n = r.numeric
        numeric = [f"{n.max_abs_diff:.2e}", f"{n.adapter_effect:.2e}", "agree" if n.tokens_agree else "DIFFER"] \
            if n is not None else ["-", "-", "-"]
        if n is not None and n.non_finite:  # NaN differences would show as 0 and "agree"
            numeric = ["NaN/inf", "NaN/inf", "-"]
        table.add_row(r.name, _s(r.rank), _s(r.alpha), r.scaling, _s(r.rslora), _targets(r.targets),
                      r.shapes, info.gptq.split()[0] if info.gptq else "float", *numeric,  # GPTQ or AWQ
                      "[green]ok[/green]" if r.ok else "[red]FAIL[/red]")
    return table


def _targets(targets: list[str]) -> str:
    from ..lora.adapter import LLAMA_PROJECTIONS, PHI3_PROJECTIONS
    for every in (LLAMA_PROJECTIONS, PHI3_PROJECTIONS):
        if set(targets) == set(every):
            return f"all {len(every)}"
    return ",".join(t.removesuffix("_proj") for t in targets) or "-"


def _s(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:g}" if isinstance(value, float) else str(value)
