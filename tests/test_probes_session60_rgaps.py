"""A review of the embeddings runner's bench and run lines: a pooling bench's plots draw its own figures
(embeddings/s, input tokens/s, E2EL), not a generation's zeros, and its table shows --goodput e2el:MS's goodput."""

from __future__ import annotations

import pytest

from infer.bench import plots
from infer.bench.report import table_rows

from test_probes_parallel_bench_s35 import local_ray  # noqa: F401  (--data-parallel 2 in this process)
from test_probes_session60_gaps import _bench


@pytest.fixture(scope="module")
def pooled_bench(tmp_path_factory):
    """`infer bench --runner pooling -c 1,2 --baseline hf --goodput e2el:600000 --random-range-ratio 0.5`: (its
    results, its folder)."""
    tmp = tmp_path_factory.mktemp("rgaps")
    code, output, results = _bench(tmp, "--runner", "pooling", "--block-size", "4", "-c", "1,2", "--num-prompts",
                                   "3", "--input-len", "6", "--random-range-ratio", "0.5", "--baseline", "hf",
                                   "--goodput", "e2el:600000")
    assert code == 0, output
    return results, tmp / "bench"


def test_pooling_bench_plots_its_own_figures(pooled_bench):
    """throughput.png: embeddings/s and input tokens/s, ours and the baseline's at each level (a pooling run's
    output tokens/s and characters/s are all zero); latency.png: E2EL alone (no TTFT, TPOT or ITL exists)."""
    results, _ = pooled_bench
    tput, inputs = plots.throughput_figure(results).axes
    for ax, key, label in ((tput, "embedding_throughput", "embeddings / s"),
                           (inputs, "input_throughput", "input tokens / s")):
        assert ax.get_ylabel() == label
        ours, base = ax.get_lines()
        assert list(ours.get_ydata()) == [r[key] for r in results] and all(r[key] > 0 for r in results)
        assert list(base.get_ydata()) == [r["baseline"][key] for r in results]
    (e2el,) = plots.latency_figure(results).axes
    assert e2el.get_title() == "E2EL (ms)"
    assert list(e2el.get_lines()[0].get_ydata()) == [r["median_e2el_ms"] for r in results]


def test_pooling_bench_table_shows_the_goodput(pooled_bench):
    """--goodput e2el:MS (the one objective a pooling run takes) adds its good req/s column, as a generation's."""
    results, out = pooled_bench
    titles, rows = table_rows(results)
    col = titles.index("good req/s")
    assert titles[col - 1] == "emb/s"
    assert [row[col] for row in rows] == [f"{r['request_goodput']:.2f}" for r in results]
    assert all(r["request_goodput"] == pytest.approx(r["embedding_throughput"]) for r in results)  # all within
    assert "good req/s" in (out / "report.md").read_text()


def test_pooling_bench_baseline_note_with_adapters_names_automodel(pooled_bench):
    """With adapters the baseline is labelled hf (base, no adapters): its note says what that baseline ran, the
    pooled AutoModel, not transformers generate (which a pooling run never runs)."""
    from infer.bench.plan import BASE_NO_ADAPTERS
    from infer.bench.report import baseline_note
    results, _ = pooled_bench
    labelled = [{**r, "baseline": {**r["baseline"], "label": BASE_NO_ADAPTERS}} for r in results]
    note = baseline_note(labelled)
    assert "AutoModel last_hidden_state pooled as ours on the base model" in note and "generate" not in note, note


def test_run_line_body_error_names_no_input(tmp_path):
    """A line of several inputs refused for its body (dimensions on a model without matryoshka: every input alike)
    is not blamed on body.input[0], as the server names the field; one bad input among good ones is still named."""
    from helpers import infer_run_records
    from test_probes_session59_embed import _line
    lines = [_line("dims", {"input": ["x", "y"], "dimensions": 3}), _line("mixed", {"input": ["x", [10 ** 6]]})]
    recs, _ = infer_run_records(tmp_path, lines, "--runner", "pooling", "--block-size", "4", "--output-format",
                                "openai", key="custom_id")
    dims = recs["dims"]["error"]["message"]
    assert "does not support matryoshka" in dims and "body.input" not in dims, dims
    assert "body.input[1]: a token id is outside the vocabulary" in recs["mixed"]["error"]["message"]


def test_pooling_bench_config_says_no_output_length(pooled_bench):
    """A pooling run generates no token: its workload and config name no output length (the plan's placeholder of
    1, or --random-range-ratio's range of it), only the prompts' lengths drawn."""
    results, out = pooled_bench
    for entry in results:
        assert entry["config"]["workload"] == "random: 3 prompts of 3-9 tokens (uniform, range ratio 0.5)"
        assert entry["config"]["output_len"] is None
    md = (out / "report.md").read_text()
    assert "output tokens" not in md and "TTFT" not in md and "E2EL: from a request's send to its vector" in md


def test_run_line_id_holding_nul_cannot_take_another_lines_input(tmp_path):
    """A line of several inputs runs them as id NUL inputI: a later line whose custom_id is one of those names
    (JSON carries \\u0000) stopped the whole run ("already running"), no record written; it is that line's error,
    and the other line's record holds every vector."""
    from helpers import infer_run_records
    from test_probes_session59_embed import _line
    lines = [_line("x", {"input": ["a b", "c d"]}), _line("x\0input1", {"input": "e f"})]
    recs, printed = infer_run_records(tmp_path, lines, "--runner", "pooling", "--block-size", "4", "--output-format",
                                      "openai", key="custom_id")
    assert recs["x"]["response"]["status_code"] == 200 and len(recs["x"]["response"]["body"]["data"]) == 2, printed
    assert "'custom_id' holds a NUL character" in recs["x\0input1"]["error"]["message"]


def test_pooling_bench_refuses_the_liteqwen_workload(tmp_path):
    """liteqwen's figure of merit is reply characters per second, which a pooling run never makes: refused before
    anything is measured, as --output-len is."""
    code, output, results = _bench(tmp_path, "--runner", "pooling", "-c", "1", "--num-prompts", "1", "--dataset",
                                   "liteqwen")
    assert code == 2 and "--dataset liteqwen measures replies" in output, output
    assert results is None


def test_strict_refuses_a_line_its_output_format_cannot_hold(tmp_path, monkeypatch):
    """--strict checks every line before the model loads: a line of several inputs with infer's own records (one
    vector a record) is refused then, as a bad line is, not written as an error record after the load."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.engine import llm_engine
    from test_probes_session59_embed import _line

    def no_load(*a, **k):
        raise AssertionError("the model must not load when --strict finds bad lines")
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in (_line("a", {"input": ["a b", "c"]}),
                                                                 _line("b", {"input": "d"}))))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "--runner", "pooling", "--strict"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "1 of 2 input lines are invalid (--strict)" in text, res.output
    assert "line 1: body.input holds 2 inputs, answered with one vector each" in text and not out.exists()


def test_data_parallel_strict_refuses_a_line_of_several_inputs(tmp_path, local_ray):  # noqa: F811
    """--data-parallel runs one line's requests on one replica each, so a line of several inputs is not run: its
    error record says so (the other lines run), and with --strict it is refused before anything is generated."""
    from helpers import infer_run_records
    from test_probes_session59_embed import _line
    lines = [_line("many", {"input": ["a b", "c"]}), _line("one", {"input": "d"})]
    args = ("--runner", "pooling", "--block-size", "4", "--output-format", "openai", "--data-parallel", "2")
    recs, printed = infer_run_records(tmp_path, lines, *args, key="custom_id")
    assert "inputs, which are not run with --data-parallel" in recs["many"]["error"]["message"], printed
    assert recs["one"]["response"]["status_code"] == 200
    (tmp_path / "out.jsonl").unlink()
    with pytest.raises(FileNotFoundError):
        infer_run_records(tmp_path, lines, *args, "--strict", key="custom_id")
