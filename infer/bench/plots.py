"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed).

Each `*_figure` function builds the figure (tests read its axes); each `plot_*` saves it. Concurrency ticks are the
measured levels as plain numbers; one level draws bars (ours beside the baseline) instead of lone dots; memory
axes start at zero, so a few MiB never look like a cliff.
"""

from __future__ import annotations

from pathlib import Path

from .metrics import LATENCY_METRICS

STYLE = {"font.size": 10, "legend.fontsize": 9, "axes.titlesize": 11, "axes.labelsize": 10}
STATS = ("median", "p90", "p99")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update(STYLE)
    return plt


def _series(results: list[dict], key: str, baseline: bool = False):
    rows = [(r["concurrency"], (r.get("baseline") if baseline else r)) for r in results]
    rows = sorted((c, d[key]) for c, d in rows if d is not None and d.get(key) is not None)
    return [c for c, _ in rows], [v for _, v in rows]


def _levels(results: list[dict]) -> list[int]:
    return sorted({r["concurrency"] for r in results})


def _base_name(base: dict) -> str:
    """The baseline's legend: "hf (baseline)", or its own label when it says more ("hf (base, no adapters)")."""
    label = base.get("label")
    return label if label and label != base["backend"] else f"{base['backend']} (baseline)"


def _names(results: list[dict]) -> tuple[str, str]:
    ours = results[0]["backend"] if results else "infer"
    base = next((_base_name(r["baseline"]) for r in results if r.get("baseline")), "baseline")
    return ours, base


def _concurrency_axis(ax, levels: list[int]) -> None:
    """A log2 axis whose ticks are the measured levels, labelled 1, 2, 4 ... (not 2^0, 2^1, 2^2)."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(levels))
    ax.xaxis.set_major_formatter(FixedFormatter([str(c) for c in levels]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlim(levels[0] / 1.3, levels[-1] * 1.3)
    ax.set_xlabel("concurrency")


def _bars(ax, groups: list[str], series: list[tuple[str, list]]) -> None:
    """Grouped bars: one group per label in `groups`, one bar per (name, values) in `series`, values written on."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name)
        ax.bar_label(bars, labels=[f"{v:.3g}" if v is not None else "-" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the value labels and the legend above the bars
    ax.legend(loc="upper center", ncol=len(series))


def _pooling(results: list[dict]) -> bool:
    """Whether these are a pooling run's levels (--runner pooling: embeddings, no token generated)."""
    return any("embedding_throughput" in r for r in results)


def throughput_figure(results: list[dict]):
    """Output tokens/s and reply characters/s against concurrency, ours and the baseline (a pooling run's:
    embeddings/s and input tokens/s, as it generates no token)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    levels = _levels(results)
    ours, base = _names(results)
    keys = (("embedding_throughput", "embeddings / s"), ("input_throughput", "input tokens / s")) \
        if _pooling(results) else (("output_throughput", "output tokens / s"), ("chars_per_s", "chars / s"))
    for ax, (key, label) in zip(axes, keys):
        if len(levels) == 1:
            series = [(name, _series(results, key, is_base)[1]) for is_base, name in ((False, ours), (True, base))]
            _bars(ax, [f"concurrency {levels[0]}"], [(n, v) for n, v in series if v])
        else:
            for is_base, name, style in ((False, ours, "o-"), (True, base, "s--")):
                x, y = _series(results, key, is_base)
                if x:
                    ax.plot(x, y, style, label=name)
            if levels:
                _concurrency_axis(ax, levels)
            ax.set_ylim(bottom=0)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0] and ax.get_legend() is None:
            ax.legend()
    fig.suptitle("Throughput vs concurrency")
    fig.tight_layout()
    return fig


def latency_figure(results: list[dict]):
    """Median / p90 / p99 of TTFT, TPOT, ITL and E2EL against concurrency (ours solid, baseline dotted); a pooling
    run's E2EL only (an embedding has no token times)."""
    plt = _plt()
    pooling = _pooling(results)
    fig, axes = plt.subplots(1, 1, figsize=(6, 4), squeeze=False) if pooling else plt.subplots(2, 2, figsize=(11, 7))
    levels = _levels(results)
    ours, base = _names(results)
    for ax, name in zip(axes.flat, ("e2el",) if pooling else LATENCY_METRICS):
        if len(levels) == 1:
            series = [(who, [(_series(results, f"{s}_{name}_ms", is_base)[1] or [None])[0] for s in STATS])
                      for is_base, who in ((False, ours), (True, base))]
            _bars(ax, list(STATS), [(who, v) for who, v in series if any(x is not None for x in v)])
            ax.set_xlabel(f"concurrency {levels[0]}")
        else:
            for stat, style in zip(STATS, ("o-", "s-", "^-")):
                x, y = _series(results, f"{stat}_{name}_ms")
                if x:
                    ax.plot(x, y, style, label=f"{ours} {stat}")
                bx, by = _series(results, f"{stat}_{name}_ms", baseline=True)
                if bx:
                    ax.plot(bx, by, style.replace("-", ":"), alpha=0.6, label=f"{base} {stat}")
            if levels:
                _concurrency_axis(ax, levels)
            ax.set_ylim(bottom=0)
        ax.set_title(f"{name.upper()} (ms)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0] and ax.get_legend() is None:
            ax.legend()
    fig.tight_layout()
    return fig


def timeline_figure(runs):
    """Memory (GPU bytes if sampled, else RSS) and KV cache utilization over time, one line per run."""
    plt = _plt()
    fig, (mem_ax, kv_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=False)
    top = 0.0
    for run in runs:
        tl = run.timeline
        if not tl:
            continue
        label = f"{getattr(run, 'label', None) or run.backend} c={run.concurrency}"
        key = "gpu_bytes" if any("gpu_bytes" in s for s in tl) else "rss_bytes"
        pts = [(s["t"], s[key] / 2**30) for s in tl if key in s]
        what = key[:-6].upper() if run.backend != "http" else "this client's RSS, not the server's"
        mem_ax.plot([t for t, _ in pts], [v for _, v in pts], label=f"{label} ({what})")
        top = max([top] + [v for _, v in pts])
        kv = [(s["t"], 100 * s["kv_usage"]) for s in tl if "kv_usage" in s]
        if kv:
            kv_ax.plot([t for t, _ in kv], [v for _, v in kv], label=label)
    mem_ax.set_ylabel("memory (GiB)")
    mem_ax.set_ylim(0, top * 1.1 if top > 0 else 1)  # from zero: a few MiB of change is not a cliff
    kv_ax.set_ylabel("KV cache used (%)")
    kv_ax.set_ylim(0, 105)
    if not kv_ax.get_lines():  # a server driven over HTTP, or transformers: nothing to draw, say why
        kv_ax.text(0.5, 0.5, "no KV cache samples (only the in-process engine reports its KV cache)",
                   ha="center", va="center", transform=kv_ax.transAxes)
    for ax in (mem_ax, kv_ax):
        ax.set_xlabel("seconds since the run started")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    try:
        fig.savefig(path, dpi=100)
    finally:  # a file that cannot be written leaves no figure open
        plt.close(fig)
    return path


def plot_throughput(results: list[dict], path: Path) -> Path:
    return _save(throughput_figure(results), path)


def plot_latency(results: list[dict], path: Path) -> Path:
    return _save(latency_figure(results), path)


def plot_timeline(runs, path: Path) -> Path:
    return _save(timeline_figure(runs), path)
