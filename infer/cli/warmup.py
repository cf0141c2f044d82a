"""`infer warmup MODEL --max-length N --concurrency C`: prove the model fits before it serves."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated

import typer

from ..engine.config import EngineConfig, batched_tokens_below_seqs
from ..errors import ConfigError
from . import options as o


@o.engine_options(exclude=("max_num_seqs", "max_model_len", "chat_template"))
def warmup(
    model: o.Model,
    max_length: Annotated[int | None, typer.Option("--max-length", parser=o.human_int(2),
                                                   metavar="INTEGER", show_default=False,
                                                   help="Longest request (prompt + output) to prove; the engine's "
                                                        "--max-model-len, taken as well (default: 4096, or the "
                                                        "model's context where that is shorter).")] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, max=65536,
                                             help="Sequences of max_length that must fit at once; the engine's "
                                                  "--max-num-seqs, taken as well.")] = 16,
    # the engine's spellings, each its own option so that an error names the one typed
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", parser=o.human_int(2), metavar="INTEGER",
                                                      hidden=True)] = None,
    max_num_seqs: Annotated[int | None, typer.Option("--max-num-seqs", min=1, max=65536, hidden=True)] = None,
    estimate: Annotated[bool, typer.Option("--estimate", help="No weights loaded: figures from config.json and the checkpoint's "
                                                "tensor headers, activations from the formula.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout instead of the table.")] = False,
    engine: EngineConfig = None,
) -> None:
    """Load the model, run the worst case (a prefill of the token budget, or of CONCURRENCY x MAX_LENGTH tokens when
    that is less, and a decode of CONCURRENCY sequences at MAX_LENGTH), and report whether it fits: exit 0 fits, 1
    does not fit. The model's tokenizer is loaded too (with --estimate as well): a folder `infer run` and `infer
    serve` refuse (no tokenizer files, a damaged one) is refused with their words, exit 2.

    Example: infer warmup ./Qwen1.5-14B-Chat-GPTQ-Int4 --max-length 4096 --concurrency 16
    """
    from .warmup_plan import check_length, default_length, estimate_plan, measured_plan
    max_length, length_flag = _one_of("--max-length", max_length, "--max-model-len", max_model_len)
    concurrency, seqs_flag = _one_of("--concurrency", concurrency if o._given("concurrency") else None,
                                     "--max-num-seqs", max_num_seqs, concurrency)
    if max_length is None:  # a model of a shorter context was refused for a --max-length it was not given
        max_length = default_length(engine)
    else:
        check_length(engine, max_length, length_flag)
    if engine.max_num_batched_tokens < concurrency:
        raise ConfigError(*batched_tokens_below_seqs(engine.max_num_batched_tokens, concurrency, seqs_flag))
    engine_config = replace(engine, max_num_seqs=concurrency, max_model_len=max_length)
    plan, extra = (estimate_plan if estimate else measured_plan)(engine_config, max_length, concurrency)
    from ..models.resolve import typed_name  # a built-in or hub id as typed, not its cache folder or snapshot
    extra = {**extra, "model": typed_name(engine.model) or extra["model"]}
    if as_json:
        typer.echo(json.dumps({**plan.to_dict(), **extra}))
    else:
        print_plan(plan, extra, engine_config.max_num_batched_tokens)
    if not plan.fits:
        raise typer.Exit(1)


def _one_of(ours: str, value, engines: str, engines_value, default=None):
    """(value, the flag that gave it) of an option warmup takes under its own name and the engine's (--max-length
    and --max-model-len): both given with different values is refused, naming both."""
    if value is not None and engines_value is not None and value != engines_value:
        raise ConfigError(f"{ours} {value} and {engines} {engines_value} are the same option with different values",
                          "give one of them")
    if engines_value is not None:
        return engines_value, engines
    return (default if value is None else value), ours


def advice(plan, tokens: int | None = None, fitting_tokens: int | None = None) -> str:
    """What to change when `plan` does not fit; when the activations take most of the budget, the batch sizes that
    make them come first (as an engine start says), `tokens` being --max-num-batched-tokens and `fitting_tokens`
    the value of it with which the plan fits (warmup_plan), if one does."""
    fits = "" if fitting_tokens is None else f". With --max-num-batched-tokens {fitting_tokens:,} it fits " \
        "by the formula (smaller steps: longer prompts prefill in more chunks; warm up with it to measure it)"
    if tokens is None or plan.activation_peak_bytes <= plan.budget_bytes // 2 or plan.weights_exceed_budget:
        return plan.advice() + fits
    sizes = f"--max-num-batched-tokens ({tokens:,})" + \
        (f" or --concurrency ({plan.concurrency:,})" if plan.concurrency > 1 else "")
    return f"lower {sizes}, whose activations take most of the budget, or {plan.advice()}{fits}"


def print_plan(plan, extra: dict, tokens: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..memory.sizes import gib
    t = Table(title=f"infer warmup: {extra['model']}  ({'estimate' if extra['estimate'] else 'measured'})")
    t.add_column("figure")
    t.add_column("value", justify="right")
    rows = [
        ("device / total memory", f"{plan.device} / {gib(plan.total_bytes)}"),
        ("budget", gib(plan.budget_bytes)),
        ("weights", gib(plan.weights_bytes)),
        ("peak activations" + (" (measured)" if plan.measured else " (estimated)"), gib(plan.activation_peak_bytes)),
    ]
    if extra.get("kernel_tuning_s") is not None:
        rows.append(("int4 kernel tuning at start (s)", f"{extra['kernel_tuning_s']:.1f}"))
    if extra.get("moe_kernel_tuning_s") is not None:
        rows.append(("fused MoE kernel tuning at start (s)", f"{extra['moe_kernel_tuning_s']:.1f}"))
    if extra.get("kernel_compile_s") is not None:
        rows.append(("int4 kernel compiles at start (s)", f"{extra['kernel_compile_s']:.1f}"))
    if extra.get("pdl") is not None:
        rows.append(("kernels launched with programmatic dependent launch", "yes" if extra["pdl"] else "no"))
    if extra.get("int4_byte_fields") is not None:
        rows.append(("int4 fields unpacked by byte permute (else shifted: the start-up check failed)",
                     "yes" if extra["int4_byte_fields"] else "no"))
    if extra.get("int4_loads_ahead") is not None:
        rows.append(("int4 loads one K step ahead (INFER_INT4_LOADS)",
                     "yes" if extra["int4_loads_ahead"] else "no"))
    if extra.get("lora_expand_gather") is not None:
        n = extra["lora_expand_gather"]
        rows.append(("LoRA expands gathered (INFER_LORA_EXPAND)", f"up to {n} tokens a step" if n else "no"))
    if extra.get("cuda_graphs_s") is not None:
        rows.append((f"CUDA graph capture at start ({extra['cuda_graphs']:,} graphs, s)",
                     f"{extra['cuda_graphs_s']:.1f}"))
    if extra.get("cuda_graph_bytes_measured") is not None:
        rows.append(("CUDA graph memory (measured / formula)",
                     f"{gib(extra['cuda_graph_bytes_measured'])} / {gib(extra['cuda_graph_bytes_formula'])}"))
        if extra.get("cuda_graph_bytes_measured_draft") is not None:  # a draft model's decode graphs, and the rest
            rows.append(("  the target's (measured / formula)", f"{gib(extra['cuda_graph_bytes_measured_target'])} / "
                         f"{gib(extra['cuda_graph_bytes_formula_target'])}"))
            rows.append((f"  the draft model's, {extra['cuda_graphs_draft']:,} graphs (measured / formula)",
                         f"{gib(extra['cuda_graph_bytes_measured_draft'])} / "
                         f"{gib(extra['cuda_graph_bytes_formula_draft'])}"))
    if extra.get("activation_estimate_bytes") is not None:
        rows.append(("peak activations (formula; an engine start reserves it)",
                     gib(extra["activation_estimate_bytes"])))
    if plan.lora_bytes:
        rows.append(("LoRA slots" + (" and the adapters' CPU copies" if plan.device == "cpu" else ""),
                     gib(plan.lora_bytes)))
    if plan.state_bytes:
        rows.append(("linear-attention states (a slot per sequence, --max-num-seqs)", gib(plan.state_bytes)))
    if plan.snapshot_bytes:
        rows.append(("linear-attention state snapshots (prefix cache, --state-snapshots)", gib(plan.snapshot_bytes)))
    rows.append(("runtime reserve (1% of budget, at least 4 MiB)", gib(plan.reserve_bytes)))
    rows += [
        ("KV cache dtype (--kv-cache-dtype)", plan.kv_cache_dtype),
        ("KV cache per token / per block", f"{plan.kv_bytes_per_token:,} B / {plan.kv_block_bytes:,} B"
         + (f" (a block: {plan.block_size} tokens of one of {plan.kv_groups} layer groups)" if plan.kv_groups else "")),
        ("KV blocks under the budget (after the larger activations)", f"{plan.kv_blocks:,} x {plan.block_size} tokens"
         + (f" of one layer group ({plan.full_groups} of {plan.kv_groups} groups attend fully, the others slide)"
            if plan.kv_groups else "")),
        (f"sequences of {plan.max_length} tokens at once", f"{plan.max_concurrency_at_max_length:,}"),
        (f"largest max_length at concurrency {plan.concurrency}", f"{plan.max_length_at_concurrency:,}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console = Console()
    console.print(t)
    if plan.fits:
        console.print(f"[green]fits[/green]: {plan.concurrency} x {plan.max_length} tokens "
                      f"(room for {plan.max_concurrency_at_max_length} at once)")
    else:
        console.print(f"[red]does not fit[/red]: {plan.concurrency} x {plan.max_length} tokens needs "
                      f"{plan.concurrency * plan.blocks_for(plan.max_length):,} KV blocks, the budget leaves "
                      f"{plan.usable_blocks:,}"
                      + (" (and the sliding window's placeholder)" if plan.usable_blocks < plan.kv_blocks else "")
                      + f"; estimated maximum length at this concurrency is "
                      f"{plan.max_length_at_concurrency}. "
                      f"{_capital(advice(plan, tokens, extra.get('fitting_batched_tokens')))}.")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]  # str.capitalize() would lower the rest
