"""The GPU end-to-end benchmark's results: one row per engine run (throughput, TPOT and the roofline), what the
adapters cost against the same model without them, and the tables (DIR/results.csv, DIR/results.md)."""

from __future__ import annotations

from pathlib import Path

COLUMNS = ["model", "weights", "lora", "engine", "output_tok_s", "mean_tpot_ms", "mean_ttft_ms", "step_MB",
           "copy_GB_s", "roofline_tpot_ms", "roofline_tok_s", "fraction_of_roofline", "start_s", "lora_swaps",
           "compiles_on_requests", "piecewise_steps", "steps", "piecewise_check", "pdl"]
NO_PIECES = "mixed steps eager"  # gpu_e2e --compare-piecewise: steps that are not all decodes run without graphs
WITH_PDL = "with PDL"  # gpu_e2e --compare-pdl: kernels launched with programmatic dependent launch (off by default)
SILU_APART = "silu_and_mul launched apart"  # gpu_e2e --compare-silu: EngineConfig.silu_in_gate_up off
LOADS_LATE = "int4 loads in their step"  # gpu_e2e --compare-loads: INFER_INT4_LOADS=late
HIGH_PRIORITY = "graphs at high priority"  # gpu_e2e --compare-priority: EngineConfig.graph_priority True
LOW_PRIORITY = "graphs at default priority"  # and False (the default engine's is None: by the graph's tokens)
GATHERED = "expands gathered"  # gpu_e2e --compare-expand: INFER_LORA_EXPAND=gather
SEGMENTS = "expands by segments"  # and INFER_LORA_EXPAND=segments (the default engine's is auto: by the tokens)
VARIANTS = (NO_PIECES, WITH_PDL, SILU_APART, LOADS_LATE, HIGH_PRIORITY, LOW_PRIORITY, GATHERED,
            SEGMENTS)  # a mode label's variant suffix
ADAPTERS_ONLY = (GATHERED, SEGMENTS)  # variants of the adapters' kernels alone: run with adapters only, costed
# against "none"
DEFAULT_ENGINES = " of the default engine's"  # what a variant's speed ratio is against


def variant_of(lora: str) -> str | None:
    """The variant suffix a mode label ends with (None: the default engine)."""
    return next((v for v in VARIANTS if lora.endswith(v)), None)


def without_variant(lora: str) -> str:
    v = variant_of(lora)
    return lora if v is None else lora[:-len(v)].rstrip(", ")


def result_row(model: str, weights: str, lora: str, engine: str, metrics: dict, roof: dict, bw: float) -> dict:
    tpot_s = metrics["mean_tpot_ms"] / 1000.0
    return {"model": model, "weights": weights, "lora": lora, "engine": engine,
            "output_tok_s": round(metrics["output_throughput"], 1), "mean_tpot_ms": round(metrics["mean_tpot_ms"], 2),
            "mean_ttft_ms": round(metrics["mean_ttft_ms"], 1), "step_MB": round(roof["step_bytes"] / 1e6, 1),
            "copy_GB_s": round(bw / 1e9, 1), "roofline_tpot_ms": round(roof["step_s"] * 1000, 2),
            "roofline_tok_s": round(roof["tok_s"], 1),
            "fraction_of_roofline": float(f"{roof['step_s'] / tpot_s:.3g}") if tpot_s > 0 else float("nan")}


def adapter_costs(rows: list[dict]) -> list[str]:
    """For each engine row with adapters: its throughput cost against the same model without adapters, and the cost
    the adapters' own bytes explain (the same ratio of the two rooflines)."""
    lines = []
    for r in rows:
        v = variant_of(r["lora"])
        plain = f"none, {v}" if v and v not in ADAPTERS_ONLY else "none"  # like against like
        base = next((b for b in rows if b["model"] == r["model"] and b["engine"] == r["engine"]
                     and b["lora"] == plain), None)
        if base is None or r["lora"] == plain or not base["output_tok_s"]:
            continue
        cost = 1 - r["output_tok_s"] / base["output_tok_s"]
        explained = 1 - r["roofline_tok_s"] / base["roofline_tok_s"]
        lines.append(f"{r['model']} {r['engine']}, {r['lora']}: costs {cost:.0%} of the throughput without adapters; "
                     f"the adapters' bytes alone explain {explained:.0%}")
    return lines


def variant_pairs(rows: list[dict], variant: str, need: str) -> list[tuple[str, dict, dict]]:
    """(mode label without the variant, the default engine's row, the variant's row) for each row run as
    `variant`, where the default engine's row of the same model, engine and mode is there and both `need`
    figures are non-zero."""
    pairs = []
    for r in rows:
        if not r["lora"].endswith(variant):
            continue
        lora = without_variant(r["lora"])
        on = next((b for b in rows if b["model"] == r["model"] and b["engine"] == r["engine"]
                   and b["lora"] == lora), None)
        if on is not None and r["output_tok_s"] and on[need]:
            pairs.append((lora, on, r))
    return pairs


def _speed_note(r: dict, lora: str, what: str, a: dict, b: dict, against: str = "", extra: str = "") -> str:
    """One ratio line: `a`'s throughput and decode speed (1 / TPOT) against `b`'s, for the row `r`'s model and engine
    in mode `lora`; `against` names what `b` is, `extra` is added in the parentheses after the two TPOTs."""
    return (f"{r['model']} {r['engine']}, {lora}: {what} {a['output_tok_s'] / b['output_tok_s']:.3f}x the throughput "
            f"and {b['mean_tpot_ms'] / a['mean_tpot_ms']:.3f}x the decode speed{against} (TPOT {a['mean_tpot_ms']} vs "
            f"{b['mean_tpot_ms']} ms{extra})")


def piecewise_gains(rows: list[dict]) -> list[str]:
    """For each row run with mixed steps eager (--compare-piecewise): the throughput and TTFT of the same engine
    with the piecewise graphs, as ratios."""
    return [f"{r['model']} {r['engine']}, {lora}: piecewise graphs for prefills and mixed steps give "
            f"{on['output_tok_s'] / r['output_tok_s']:.2f}x the throughput of running them eagerly "
            f"({on['output_tok_s']:,.0f} vs {r['output_tok_s']:,.0f} tok/s; TTFT {on['mean_ttft_ms']:.1f} vs "
            f"{r['mean_ttft_ms']:.1f} ms; {on.get('piecewise_steps', '?')} of {on.get('steps', '?')} steps "
            f"through them)" for lora, on, r in variant_pairs(rows, NO_PIECES, "mean_ttft_ms")]


def pdl_gains(rows: list[dict]) -> list[str]:
    """For each row run with programmatic dependent launch (--compare-pdl): its throughput and TPOT against the
    same engine without it (the default), as ratios (what PDL gives; below 1, what it costs)."""
    return [_speed_note(r, lora, "programmatic dependent launch gives", r, plain, extra=f"; PDL used: {r.get('pdl')}")
            for lora, plain, r in variant_pairs(rows, WITH_PDL, "mean_tpot_ms")]


def silu_gains(rows: list[dict]) -> list[str]:
    """For each row run with silu_and_mul launched after the int4 gate_up matmul (--compare-silu): what the default
    engine, whose gate_up kernel applies it in its epilogue, gives against it, as ratios."""
    return [_speed_note(r, lora, "silu_and_mul in the int4 gate_up kernel's epilogue gives", on, r,
                        " of launching it apart")
            for lora, on, r in variant_pairs(rows, SILU_APART, "mean_tpot_ms")]


def loads_gains(rows: list[dict]) -> list[str]:
    """For each row whose int4 kernels issued each K step's loads in that step (--compare-loads): what the default,
    during the step before (gptq_gemm.loads_ahead), gives against it, as ratios."""
    return [_speed_note(r, lora, "the int4 kernels' loads one K step ahead give", on, r,
                        " of issuing them in their step")
            for lora, on, r in variant_pairs(rows, LOADS_LATE, "mean_tpot_ms")]


def priority_gains(rows: list[dict]) -> list[str]:
    """For each row whose CUDA graphs were all recorded on a high-priority stream, or all at the default priority
    (--compare-priority): what that gives against the default engine (by the graph's tokens), as ratios."""
    return [_speed_note(r, lora, f"CUDA graphs all recorded at {what} give", r, on, DEFAULT_ENGINES)
            for variant, what in ((HIGH_PRIORITY, "high priority (the main branch's programs first, the LoRA shrinks "
                                                  "beside in what is left)"), (LOW_PRIORITY, "the default priority"))
            for lora, on, r in variant_pairs(rows, variant, "mean_tpot_ms")]


def gather_gains(rows: list[dict]) -> list[str]:
    """For each row whose LoRA expands of decode steps were all gathers, or all by segments (--compare-expand): what
    that gives against the default engine (gathers up to lora_ops.GATHER_AUTO_TOKENS tokens), as ratios."""
    return [_speed_note(r, lora, f"the LoRA expands all {what} give", r, on, DEFAULT_ENGINES)
            for variant, what in ((GATHERED, "as gathers (lora_ops.expand_gather, partials by token)"),
                                  (SEGMENTS, "by segments (tiles of one adapter's tokens)"))
            for lora, on, r in variant_pairs(rows, variant, "mean_tpot_ms")]


def write_tables(rows: list[dict], out: Path, notes: list[str]) -> str:
    import csv
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    md = "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"
    (out / "results.md").write_text(md)
    return md


def run_notes(device_name: str, args, rows: list[dict]) -> list[str]:
    """The lines under the tables: the device and workload, how the roofline is computed, and each adapter row's
    cost against the same model without adapters."""
    outputs = f"{args.output_len // 2}-{args.output_len}" if getattr(args, "stagger", False) else args.output_len
    return [f"{device_name}; {args.num_prompts} requests at concurrency {args.concurrency}, "
            f"{args.input_len} prompt tokens, {outputs} output tokens (EOS ignored), random weights",
            "roofline: (decode-step weight bytes + KV bytes of the batch at the mean context + adapter bytes) / "
            "measured device-to-device copy bandwidth; fraction = roofline TPOT / measured mean TPOT",
            *adapter_costs(rows), *piecewise_gains(rows), *pdl_gains(rows), *silu_gains(rows),
            *loads_gains(rows), *priority_gains(rows), *gather_gains(rows)]
