"""Benchmark plots read from their matplotlib objects: plain concurrency ticks, bars for a single level, memory from
zero, legends at a readable size, and PNG files written."""

from types import SimpleNamespace

import pytest

from infer.bench import plots
from infer.bench.metrics import LATENCY_METRICS


def result(c: int, scale: float = 1.0, baseline: bool = True) -> dict:
    r = {"backend": "infer", "concurrency": c, "output_throughput": 100.0 * c * scale, "chars_per_s": 300.0 * c}
    for i, m in enumerate(LATENCY_METRICS):
        for j, s in enumerate(plots.STATS):
            r[f"{s}_{m}_ms"] = 10.0 * (i + 1) + j + c
    if baseline:
        r["baseline"] = {**result(c, 0.5, baseline=False), "backend": "hf"}
    return r


def drawn(fig):
    fig.canvas.draw()
    return fig.axes


def tick_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels()]


def legend_sizes(ax) -> list[float]:
    legend = ax.get_legend()
    return [t.get_fontsize() for t in legend.get_texts()] if legend else []


def test_several_levels_plain_ticks_lines_and_readable_legends():
    levels = [1, 2, 4, 8, 16]
    fig = plots.throughput_figure([result(c) for c in levels])
    for ax in drawn(fig):
        assert tick_texts(ax) == ["1", "2", "4", "8", "16"]  # not 2^0 .. 2^4
        assert len(ax.get_lines()) == 2 and ax.get_ylim()[0] == 0
        assert min(legend_sizes(ax)) >= 9
    ours, base = drawn(fig)[0].get_lines()
    assert list(ours.get_ydata()) == [100.0 * c for c in levels]
    assert list(base.get_ydata()) == [50.0 * c for c in levels]
    assert [t.get_text() for t in drawn(fig)[0].get_legend().get_texts()] == ["infer", "hf (baseline)"]
    fig = plots.latency_figure([result(c) for c in levels])
    for ax in drawn(fig):
        assert tick_texts(ax) == ["1", "2", "4", "8", "16"] and len(ax.get_lines()) == 6
        assert min(legend_sizes(ax)) >= 9 and not any("$" in t for t in tick_texts(ax))


def test_a_single_level_draws_labelled_bars():
    fig = plots.throughput_figure([result(8)])
    tput, chars = drawn(fig)
    assert [p.get_height() for p in tput.patches] == [800.0, 400.0]  # ours, baseline
    assert tick_texts(tput) == ["concurrency 8"] and len(tput.get_lines()) == 0
    assert [t.get_text() for t in tput.texts] == ["800", "400"]  # the values written on the bars
    assert [p.get_height() for p in chars.patches] == [2400.0, 2400.0]
    fig = plots.latency_figure([result(8)])
    ttft = drawn(fig)[0]
    assert tick_texts(ttft) == list(plots.STATS)
    assert [p.get_height() for p in ttft.patches] == [18.0, 19.0, 20.0] * 2
    assert ttft.get_xlabel() == "concurrency 8" and min(legend_sizes(ttft)) >= 9


def test_a_single_level_without_baseline():
    fig = plots.throughput_figure([result(4, baseline=False)])
    assert [p.get_height() for p in drawn(fig)[0].patches] == [400.0]


def test_memory_axis_starts_at_zero():
    tl = [{"t": i / 10, "rss_bytes": int((0.610 + 0.001 * i) * 2**30), "kv_usage": i / 10} for i in range(7)]
    fig = plots.timeline_figure([SimpleNamespace(backend="infer", concurrency=8, timeline=tl),
                                 SimpleNamespace(backend="hf", concurrency=8, timeline=[])])
    mem, kv = drawn(fig)
    low, high = mem.get_ylim()
    assert low == 0 and high == pytest.approx(0.616 * 1.1)
    assert kv.get_ylim() == (0, 105) and list(kv.get_lines()[0].get_ydata()) == [10 * i for i in range(7)]
    assert [t.get_text() for t in mem.get_legend().get_texts()] == ["infer c=8 (RSS)"]
    assert min(legend_sizes(mem)) >= 9


def test_png_files_written(tmp_path):
    results = [result(c) for c in (1, 4)]
    run = SimpleNamespace(backend="infer", concurrency=1, timeline=[{"t": 0.0, "rss_bytes": 2**30}])
    paths = [plots.plot_throughput(results, tmp_path / "t.png"), plots.plot_latency(results, tmp_path / "l.png"),
             plots.plot_timeline([run], tmp_path / "m.png")]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
