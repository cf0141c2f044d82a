"""Benchmark reports: a rich table on the terminal and, in an output folder, results.json, results.csv,
report.md, timelines.json and PNG plots.

    from infer.bench.report import write_report
    results = write_report("bench-out", runs, baselines=hf_runs, config={"model": ..., "workload": ...})

`runs` are ours, one RunResult per concurrency level; `baselines` (optional) are matched to them by
concurrency (an HF run's batch size). results.json is a list with one object per run, with vLLM's key names
(completed, failed, total_input_tokens, ..., mean_ttft_ms, p99_itl_ms, ...) plus chars_per_s,
peak_memory_bytes, concurrency, partial, config, versions, device and git_commit; a matched baseline sits
in "baseline" (same keys) and the ours/baseline ratios of the throughput figures and of the mean, median and p99
TTFT, TPOT, ITL and E2EL in "ratio" (a latency ratio below 1: ours is faster); results.csv has one row per run,
ours' then its baseline's, with those ratios as ratio_<key> columns on ours' row. Every entry has a "label" (its
backend, or what the run says it is: "hf (base, no adapters)" for a baseline that ran the base model while ours ran
adapters, "infer (no speculation)" for ours' engine without speculative decoding), which the table titles,
report.md, results.csv and the plots show. With speculative decoding the throughput table also shows ours'
acceptance rate and mean acceptance length.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import subprocess
from pathlib import Path

from ..errors import OutputError
from .metrics import EMBED_KEYS, LATENCY_RATIO_KEYS, THROUGHPUT_KEYS, RunResult, latency_series
from .plots import plot_latency, plot_throughput, plot_timeline

# what write_report writes into the report folder
REPORT_FILES = ("results.json", "results.csv", "timelines.json", "throughput.png", "latency.png", "timeline.png",
                "report.md")
# (column title, results key, format); the throughput table, then the latency table
THROUGHPUT_COLUMNS = [
    ("conc", "concurrency", "{:d}"), ("done", "completed", "{:d}"), ("fail", "failed", "{:d}"),
    ("req/s", "request_throughput", "{:.2f}"), ("out tok/s", "output_throughput", "{:.1f}"),
    ("tok/s", "total_token_throughput", "{:.1f}"), ("chars/s", "chars_per_s", "{:.1f}"),
    ("peak GiB", "peak_memory_gib", "{:.2f}"),
]
GOODPUT_COLUMN = ("good req/s", "request_goodput", "{:.2f}")  # with --goodput: after req/s
RATIO_COLUMNS = [("base out tok/s", "base:output_throughput", ""), ("x out tok/s", "ratio:output_throughput", ""),
                 ("x chars/s", "ratio:chars_per_s", "")]
# with speculative decoding (ours): vLLM's acceptance figures, after peak GiB
SPEC_COLUMNS = [("accept rate", "spec_decode_acceptance_rate", "{:.2f}"),
                ("accept len", "spec_decode_mean_acceptance_length", "{:.2f}")]
LATENCY_COLUMNS = [("conc", "concurrency", "{:d}")] + [
    (f"{m.upper()} {s} ms", f"{'median' if s == 'p50' else s}_{m}_ms", "{:.2f}")
    for m in ("ttft", "tpot", "itl", "e2el") for s in ("p50", "p99")]
# with a baseline: ours / baseline of each median latency (below 1: ours is faster)
LATENCY_RATIO_COLUMNS = [(f"x {m.upper()} p50", f"ratio:median_{m}_ms", "") for m in ("ttft", "tpot", "itl", "e2el")]
# a pooling run's (embeddings, --runner pooling): vectors and prompt tokens per second, its latencies E2EL's only
EMBED_COLUMNS = [("conc", "concurrency", "{:d}"), ("done", "completed", "{:d}"), ("fail", "failed", "{:d}"),
                 ("emb/s", "embedding_throughput", "{:.2f}"), ("in tok/s", "input_throughput", "{:.1f}"),
                 ("peak GiB", "peak_memory_gib", "{:.2f}")]
EMBED_RATIO_COLUMNS = [("base emb/s", "base:embedding_throughput", ""), ("x emb/s", "ratio:embedding_throughput", ""),
                       ("x in tok/s", "ratio:input_throughput", "")]
EMBED_LATENCY_COLUMNS = [("conc", "concurrency", "{:d}")] + [
    (f"E2EL {s} ms", f"{s}_e2el_ms", "{:.2f}") for s in ("mean", "median", "p99")]
EMBED_LATENCY_RATIO_COLUMNS = [("x E2EL p50", "ratio:median_e2el_ms", "")]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Versions, device and git commit of this process (what a result was measured with)."""
    import torch
    import transformers

    from .. import __version__
    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)}"
    else:
        device = f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return {"versions": {"infer": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "device": device, "git_commit": _git_commit()}


def detailed_lists(run: RunResult) -> dict:
    """vLLM's --save-detailed lists, one item per request in workload order (a failed one has a TTFT of 0, no
    ITLs and 0 output tokens, as in vLLM): input_lens, output_lens, ttfts and itls (seconds), generated_texts,
    cached_tokens (the prompt tokens found in the prefix cache: the engine's in-process, the server's
    usage.prompt_tokens_details with --url; null where not reported) and request_errors (vLLM's "errors"; ours is
    the distinct reasons). Each request's E2EL is its TTFT plus the sum of its ITLs, and its TPOT that sum over
    output_lens - 1. A pooling run's (embeddings: no token, no TTFT) has each request's E2EL in e2els instead."""
    recs = run.records
    if run.pooling:
        return {"input_lens": [r.prompt_tokens for r in recs], "e2els": [r.e2el if r.success else 0.0 for r in recs],
                "cached_tokens": [r.cached_tokens for r in recs],
                "request_errors": [None if r.success else (r.error or "") for r in recs]}
    return {"input_lens": [r.prompt_tokens for r in recs],
            "output_lens": [r.output_tokens if r.success else 0 for r in recs],
            "ttfts": [r.ttft if r.success else 0.0 for r in recs],
            "itls": [r.itl if r.success else [] for r in recs],
            "generated_texts": [r.text for r in recs],
            "cached_tokens": [r.cached_tokens for r in recs],
            "request_errors": [None if r.success else (r.error or "") for r in recs]}


def spec_decode_figures(stats: dict) -> dict:
    """vLLM's speculative decoding figures of a run (its counters' growth over the run, else their totals): the
    acceptance rate (accepted draft tokens / draft tokens) and the mean acceptance length (tokens a verified draft
    step adds: 1 + accepted / drafts); {} without speculation."""
    pre = "run_" if "run_spec_decode_num_drafts" in stats else ""
    drafts = stats.get(pre + "spec_decode_num_drafts")
    if drafts is None:
        return {}
    tokens, accepted = stats[pre + "spec_decode_num_draft_tokens"], stats[pre + "spec_decode_num_accepted_tokens"]
    return {"spec_decode_acceptance_rate": accepted / tokens if tokens else 0.0,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0}


def prefix_cache_figures(stats: dict) -> dict:
    """The run's prefix cache hit rate (prompt tokens found cached / prompt tokens looked up) from the counters'
    growth over the run, else their totals; {} for a run without them (a baseline, a server that reports none).
    A --url run's prefix_cache_hit_rate of engine_stats is the server's since it started (its counters go on over
    POST /reset_prefix_cache), which took in every level before and any warm-up."""
    pre = "run_" if "run_prefix_cache_queries" in stats else ""
    queries, hits = stats.get(pre + "prefix_cache_queries"), stats.get(pre + "prefix_cache_hits")
    if queries is None or hits is None:
        return {}
    return {"prefix_cache_hit_rate": hits / queries if queries else 0.0}


def usage_prefix_cache_figures(records) -> dict:
    """A --url level's prefix cache hit rate from its requests' own usage.prompt_tokens_details.cached_tokens (vLLM's
    --enable-prompt-tokens-details, infer serve's): the completed requests' cached prompt tokens over their prompt
    tokens, vLLM's hit rate over prompt tokens; {} when no request reported them."""
    if not any(r.cached_tokens is not None for r in records):
        return {}
    done = [r for r in records if r.success]
    prompt = sum(r.prompt_tokens for r in done)
    return {"prefix_cache_hit_rate": sum(r.cached_tokens or 0 for r in done) / prompt if prompt else 0.0}


def run_prefix_cache(run: RunResult) -> dict:
    """The run's prefix_cache_hit_rate and prefix_cache_source, where it came from: "engine" (an in-process engine's
    counters over the run), "usage" (a --url level's requests' cached_tokens, which win where the server sends them:
    they are the level's own requests, whatever else the server ran meanwhile; the server's /health figure over
    the run is then kept as server_prefix_cache_hit_rate) or "server" (an infer server's /health counters, or a vLLM
    server's /metrics ones, over the run, where no usage details came back); {} without any (a baseline, a server
    that reports neither). A --url run also says what its usage details were, prefix_cache_usage_details
    (usage_details): a server without them is told from a level that found nothing cached where it can be."""
    server = prefix_cache_figures(run.engine_stats)
    if run.backend != "http":
        return {**server, "prefix_cache_source": "engine"} if server else {}
    usage = usage_prefix_cache_figures(run.records)
    details = {"prefix_cache_usage_details": usage_details(run, bool(usage))}
    if usage:
        extra = {"server_prefix_cache_hit_rate": server["prefix_cache_hit_rate"]} if server else {}
        return {**usage, "prefix_cache_source": "usage", **extra, **details}
    return {**server, "prefix_cache_source": "server", **details} if server else details


def usage_details(run: RunResult, reported: bool) -> str:
    """What a --url level's usage details say (a server sends usage.prompt_tokens_details.cached_tokens only with
    vLLM's --enable-prompt-tokens-details, and only for a prompt that found some cached, so no details at all is a
    server without the option or a level of nothing cached): "reported" (some request reported its cached tokens),
    "off" (none did, but the server's counters (an infer server's /health, vLLM's /metrics) found cached tokens over
    the level: the server sends no details), "cold" (none did, and the counters found nothing cached: whether it
    would send them makes no difference) or "unknown" (none did, and the server has no counters: either)."""
    if reported:
        return "reported"
    stats = run.engine_stats
    pre = "run_" if "run_prefix_cache_hits" in stats else ""
    hits = stats.get(pre + "prefix_cache_hits")
    if hits is None:
        return "unknown"
    return "off" if hits else "cold"


def run_entry(run: RunResult, detailed: bool = False) -> dict:
    """vLLM's metrics for one run plus our own figures (no config / environment); with `detailed`, also each
    request's (detailed_lists)."""
    d = {"backend": run.backend, "label": run.label or run.backend, "concurrency": run.concurrency,
         "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
         "num_requests": run.num_requests, "partial": run.partial, "aborted": run.aborted,
         "run_error": run.error,  # what stopped the run half way (then partial), else None
         # vLLM's --save-result names of the same figures (its max_concurrency is a level, its arrivals Poisson)
         "max_concurrency": run.concurrency, "num_prompts": run.num_requests, "burstiness": 1.0}
    d.update(run.metrics())
    peak = run.peak_memory_bytes
    d.update(peak_memory_bytes=peak, peak_memory_gib=None if peak is None else peak / 2**30,
             peak_rss_bytes=run.peak_rss_bytes, peak_gpu_bytes=run.peak_gpu_bytes, engine_stats=run.engine_stats)
    d.update(spec_decode_figures(run.engine_stats))
    d.update(run_prefix_cache(run))
    if run.timeline and "kv_usage" in run.timeline[0]:
        d["max_kv_usage"] = max(s.get("kv_usage", 0.0) for s in run.timeline)
    d["errors"] = list(dict.fromkeys(r.error for r in run.records if not r.success and r.error))[:5]  # distinct
    if detailed:
        d.update(detailed_lists(run))
    return d


def ratios(ours: dict, theirs: dict, run: RunResult, base: RunResult) -> dict:
    """ours / baseline of each throughput figure and each latency of LATENCY_RATIO_KEYS; None where the baseline's
    figure is 0, or where either side has no sample of the latency (no completed request, no request of more than
    one token, no second chunk): its 0 there stands for no figure, and 0 / x read as "infinitely faster"."""
    sampled = [{m for m, values in latency_series(r.records).items() if values} for r in (run, base)]
    out = {}
    for k in THROUGHPUT_KEYS + LATENCY_RATIO_KEYS + (EMBED_KEYS if run.pooling and base.pooling else ()):
        metric = k.rsplit("_", 2)[-2] if k.endswith("_ms") else None
        missing = metric is not None and not all(metric in s for s in sampled)
        out[k] = None if missing or not theirs[k] else ours[k] / theirs[k]
    return out


def build_results(runs: list[RunResult], baselines: list[RunResult] | None = None,
                  config: dict | None = None, env: dict | None = None, detailed: bool = False) -> list[dict]:
    env = env if env is not None else environment()
    by_conc = {b.concurrency: b for b in (baselines or [])}
    results = []
    for run in runs:
        entry = run_entry(run, detailed)
        base = by_conc.get(run.concurrency)
        if base is not None:
            entry["baseline"] = run_entry(base, detailed)
            entry["ratio"] = ratios(entry, entry["baseline"], run, base)
        entry.update(config=config or {}, **env)
        results.append(entry)
    return results


def _cell(entry: dict, key: str, fmt: str) -> str:
    if key.startswith("ratio:"):
        v = (entry.get("ratio") or {}).get(key[6:])
        return "-" if v is None else f"{v:.2f}x"
    if key.startswith("base:"):
        return _cell(entry.get("baseline") or {}, key[5:], "{:.1f}")
    v = entry.get(key)
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def table_rows(results: list[dict], which: str = "throughput") -> tuple[list[str], list[list[str]]]:
    """Column titles and formatted rows of the "throughput" table (with baseline and ratio columns when there
    is a baseline, and a partial flag) or of the "latency" table."""
    based = any("baseline" in r for r in results)
    goodput = any("request_goodput" in r for r in results)
    if any("embedding_throughput" in r for r in results):  # a pooling run: no token is generated
        if which == "latency":
            cols = EMBED_LATENCY_COLUMNS + (EMBED_LATENCY_RATIO_COLUMNS if based else [])
        else:  # (with --goodput e2el:MS: its completed requests within it per second, after emb/s)
            cols = EMBED_COLUMNS[:4] + [GOODPUT_COLUMN] * goodput + EMBED_COLUMNS[4:]
            cols += EMBED_RATIO_COLUMNS if based else []
    elif which == "latency":
        cols = LATENCY_COLUMNS + (LATENCY_RATIO_COLUMNS if based else [])
    else:
        cols = list(THROUGHPUT_COLUMNS)
        if goodput:
            cols.insert(4, GOODPUT_COLUMN)
        cols += SPEC_COLUMNS if any("spec_decode_acceptance_rate" in r for r in results) else []
        cols += RATIO_COLUMNS if based else []
    rows = [[_cell(r, k, f) for _, k, f in cols] for r in results]
    if which != "latency":
        cols = cols + [("partial", "partial", "")]
        rows = [row + [_partial(r)] for row, r in zip(rows, results)]
    return [t for t, _, _ in cols], rows


def _partial(entry: dict) -> str:
    """The partial column: "yes" when ours was cut short, "baseline" when only the baseline was (its ratios compare a
    whole run with part of one)."""
    if entry["partial"]:
        return "yes"
    return "baseline" if (entry.get("baseline") or {}).get("partial") else ""


def baseline_label(results: list[dict]) -> str | None:
    """The baseline's label when it says more than its backend ("hf (base, no adapters)", "infer (no speculation)",
    "hf (MODEL)" for --baseline-model), else None."""
    for r in results:
        base = r.get("baseline")
        if base and base.get("label") and base["label"] != base.get("backend"):
            return base["label"]
    return None


def baseline_note(results: list[dict]) -> str | None:
    """One line on what the baseline ran and which way round its x columns are, for the table and report.md; None
    without a baseline."""
    base = next((r["baseline"] for r in results if r.get("baseline")), None)
    if base is None:
        return None
    label = baseline_label(results)
    hf = "transformers AutoModel last_hidden_state pooled as ours" if "embedding_throughput" in base else \
        "transformers generate"
    if label is None:  # the x columns' direction was said nowhere on the terminal
        what = f": {hf} on static batches of size = concurrency;" if base.get("backend") == "hf" else ";"
        return (f"baseline = {base.get('label') or base.get('backend')}{what} x = ours / baseline: above 1 on a "
                "throughput, below 1 on a latency, ours is better")
    if base.get("backend") != "hf":  # ours' engine without speculative decoding
        return (f"baseline = {label}: the same engine and options without --speculative-config, run after ours "
                "with ours' engine freed first (one engine in memory at a time, so each peak is its own); "
                "x = ours (speculative) / baseline, a latency x below 1 is faster")
    if "base, no adapters" not in label:  # (--baseline-model: the model it ran, named in the label)
        return (f"baseline = {label}: {hf} on that model (--baseline-model), not on ours, on static batches of size "
                "= concurrency; x = ours / baseline: above 1 on a throughput, below 1 on a latency, ours is better")
    other = " (--baseline-model)" if label != "hf (base, no adapters)" else ""
    return (f"baseline = {label}: {hf} on the base model{other}, without the adapters ours ran; "
            "x = ours (with adapters) / baseline")


def _title(title: str, which: str, results: list[dict]) -> str:
    label = baseline_label(results) if which == "throughput" else None
    return f"{title}: {which}" + (f", baseline {label}" if label else "")


def print_table(results: list[dict], console=None, title: str = "infer bench") -> None:
    """The throughput table and the latency table, on the terminal."""
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    for which in ("throughput", "latency"):
        titles, rows = table_rows(results, which)
        table = Table(title=_title(title, which, results))
        for t in titles:
            table.add_column(t, justify="right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    note = baseline_note(results)
    if note:
        console.print(note, highlight=False, markup=False)


def _markdown(results: list[dict], plots: dict[str, Path], config: dict) -> str:
    env = results[0] if results else environment()
    device = env["device"] if env.get("backend") != "http" else f"{env['device']} (the client's: the server's is not " \
        "seen from here)"
    lines = ["# infer bench", "", f"- device: {device}", f"- git commit: {env['git_commit']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()), ""]
    if config:
        lines += ["## Configuration", "", "```json", json.dumps(config, indent=2, default=str), "```", ""]
    note = baseline_note(results)
    for which in ("throughput", "latency"):
        titles, rows = table_rows(results, which)
        lines += [f"## {which.capitalize()}", ""]
        if which == "throughput" and note:
            lines += [note[0].upper() + note[1:] + ".", ""]
        lines += ["| " + " | ".join(titles) + " |", "|" + "---:|" * len(titles)]
        lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    lines += _replica_lines(results)
    lines += _details_lines(results)
    if any("embedding_throughput" in r for r in results):  # (an embedding has no token times)
        lines += ["", "E2EL: from a request's send to its vector; emb/s: completed requests (one vector each) per "
                  "second; in tok/s: their prompt tokens per second; x = ours / baseline.", ""]
    else:
        lines += ["", "Latency figures follow vLLM's benchmark_serving definitions (TTFT, TPOT excluding the first "
                  "token, ITL between consecutive chunks, E2EL); x = ours / baseline.", ""]
    lines += [f"![{name}]({p.name})" for name, p in plots.items()]
    return "\n".join(lines) + "\n"


_DETAILS = {"reported": "the requests reported their cached prompt tokens (usage details): the hit rate is theirs",
            "off": "no request reported its cached prompt tokens, though the server's counters found some cached: the "
                   "server sends no usage details (vLLM's and infer serve's --enable-prompt-tokens-details); the hit "
                   "rate is the server's counters'",
            "cold": "no request reported cached prompt tokens, and the server's counters found none cached: a cold "
                    "level (hit rate 0), whether or not the server sends usage details",
            "unknown": "no request reported cached prompt tokens and the server has no prefix cache counters: either "
                       "the server sends no usage details (vLLM's --enable-prompt-tokens-details) or nothing was "
                       "cached; no hit rate"}


def _details_lines(results: list[dict]) -> list[str]:
    """With --url: what each level's usage details say of its prefix cache (report.usage_details)."""
    runs = [r for r in results if r.get("prefix_cache_usage_details")]
    if not runs:
        return []
    return ["## Prefix cache", ""] + [f"- {r['label']} at concurrency {r['concurrency']}: "
                                      f"{_DETAILS[r['prefix_cache_usage_details']]}." for r in runs] + [""]


def _replica_lines(results: list[dict]) -> list[str]:
    """A server with data-parallel replicas (infer serve --data-parallel): one line per replica, from /health."""
    replicas = next((r["engine_stats"]["replicas"] for r in results
                     if (r.get("engine_stats") or {}).get("replicas")), None)
    if not replicas:
        return []
    lines = ["## Replicas", "", f"The server ran {len(replicas)} engine replicas "
             f"({sum(bool(x.get('alive')) for x in replicas)} alive at the end):", ""]
    for x in replicas:
        where = ", ".join(str(x[k]) for k in ("host", "device") if x.get(k))
        lines.append(f"- replica {x.get('replica')}: {'alive' if x.get('alive') else 'dead'}" + (f" ({where})"
                                                                                           if where else ""))
    return lines + [""]


def _strict(obj):
    """NaN / inf (a run with no duration) become null, so results.json is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict(v) for v in obj]
    return obj


def write_report(out_dir, runs: list[RunResult], baselines: list[RunResult] | None = None,
                 config: dict | None = None, console=None, show: bool = True, detailed: bool = False) -> list[dict]:
    """Print the table when `show`, write every report file into `out_dir` (created), return the results list
    (with `detailed`, each entry also holds each request's figures, vLLM's --save-detailed).
    OutputError when a file cannot be written (the table, printed first, still shows what was measured)."""
    out = Path(out_dir)
    results = build_results(runs, baselines, config, detailed=detailed)
    if show:
        print_table(results, console)
    try:
        _write_files(out, results, runs, baselines, config)
    except OSError as e:
        where = e.filename or out
        raise OutputError(f"cannot write the benchmark report: {where}: {e.strerror or e}",
                          "free some disk space or fix the permissions, or pass another --out folder") from None
    return results


def _state(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _whole(path: Path, write):
    """write(path)'s result; a file it could not finish (a full disk) is removed rather than left half-written (a
    truncated results.json, a 0-byte plot), and the error names that file."""
    before = _state(path)
    try:
        return write(path)
    except OSError as e:
        if _state(path) == before:  # a file it could not even open (an earlier run's, left read-only) is kept
            e.filename = e.filename or str(path)
            raise
        with contextlib.suppress(OSError):
            path.unlink()
        if e.filename is None:
            e.filename = str(path)
        raise


def _write_files(out: Path, results: list[dict], runs: list[RunResult], baselines: list[RunResult] | None,
                 config: dict | None) -> None:
    import pandas as pd
    out.mkdir(parents=True, exist_ok=True)
    _whole(out / "results.json", lambda p: p.write_text(json.dumps(_strict(results), indent=2, default=str)))
    flat = []
    for r in results:
        for e in [r] + ([r["baseline"]] if "baseline" in r else []):
            row = {k: v for k, v in e.items() if not isinstance(v, (dict, list))}
            # the table's x columns (ours / baseline), on ours' row: results.json's "ratio", which a dict left out
            row.update({f"ratio_{k}": v for k, v in (e.get("ratio") or {}).items()})
            flat.append(row)
    _whole(out / "results.csv", lambda p: pd.DataFrame(flat).to_csv(p, index=False))
    timelines = [{"backend": r.backend, "label": r.label or r.backend, "concurrency": r.concurrency,
                  "timeline": r.timeline}
                 for r in list(runs) + list(baselines or [])]
    _whole(out / "timelines.json", lambda p: p.write_text(json.dumps(timelines)))
    plots = {"throughput": _whole(out / "throughput.png", lambda p: plot_throughput(results, p)),
             "latency": _whole(out / "latency.png", lambda p: plot_latency(results, p)),
             "memory and KV cache": _whole(out / "timeline.png",
                                           lambda p: plot_timeline(list(runs) + list(baselines or []), p))}
    _whole(out / "report.md", lambda p: p.write_text(_markdown(results, plots, config or {})))
