"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from .metrics import LATENCY_METRICS


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _series(results: list[dict], key: str, baseline: bool = False):
    rows = [(r["concurrency"], (r.get("baseline") if baseline else r)) for r in results]
    rows = sorted((c, d[key]) for c, d in rows if d is not None and d.get(key) is not None)
    return [c for c, _ in rows], [v for _, v in rows]


def plot_throughput(results: list[dict], path: Path) -> Path:
    """Output tokens/s and reply characters/s against concurrency, ours and the baseline."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "output_throughput", "output tokens / s"), (axes[1], "chars_per_s", "chars / s")):
        ours = results[0]["backend"] if results else "infer"
        base = next((f"{r['baseline']['backend']} (baseline)" for r in results if r.get("baseline")), "baseline")
        for is_base, name, style in ((False, ours, "o-"), (True, base, "s--")):
            x, y = _series(results, key, is_base)
            if x:
                ax.plot(x, y, style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Throughput vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_latency(results: list[dict], path: Path) -> Path:
    """Median / p90 / p99 of TTFT, TPOT, ITL and E2EL against concurrency."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, name in zip(axes.flat, LATENCY_METRICS):
        for stat, style in (("median", "o-"), ("p90", "s-"), ("p99", "^-")):
            x, y = _series(results, f"{stat}_{name}_ms")
            if x:
                ax.plot(x, y, style, label=stat)
            bx, by = _series(results, f"{stat}_{name}_ms", baseline=True)
            if bx:
                ax.plot(bx, by, style.replace("-", ":"), alpha=0.6, label=f"baseline {stat}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name.upper()} (ms)")
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(runs, path: Path) -> Path:
    """Memory (GPU bytes if sampled, else RSS) and KV cache utilization over time, one line per run."""
    plt = _plt()
    fig, (mem_ax, kv_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=False)
    for run in runs:
        tl = run.timeline
        if not tl:
            continue
        label = f"{run.backend} c={run.concurrency}"
        key = "gpu_bytes" if any("gpu_bytes" in s for s in tl) else "rss_bytes"
        pts = [(s["t"], s[key] / 2**30) for s in tl if key in s]
        mem_ax.plot([t for t, _ in pts], [v for _, v in pts], label=f"{label} ({key[:-6]})")
        kv = [(s["t"], 100 * s["kv_usage"]) for s in tl if "kv_usage" in s]
        if kv:
            kv_ax.plot([t for t, _ in kv], [v for _, v in kv], label=label)
    mem_ax.set_ylabel("memory (GiB)")
    kv_ax.set_ylabel("KV cache used (%)")
    kv_ax.set_ylim(0, 105)
    for ax in (mem_ax, kv_ax):
        ax.set_xlabel("seconds since the run started")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
