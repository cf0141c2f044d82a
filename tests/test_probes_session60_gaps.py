"""The embeddings runner's gaps closed: an `infer run` line of url /v1/embeddings answers a list of inputs in one
record (the server's response), the body's request_id names the response (vLLM's embd-ID), the test extra pins
hypothesis, and `infer bench --runner pooling` measures embeddings against transformers on the same inputs."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from infer.models.tiny import ensure_builtin

from helpers import infer_run_records, random_prompts
from lora_helpers import hf_float
from test_probes_session59_embed import _line, _post, check_close, hf_hidden, pooled, served_pooling  # noqa: F401

POOLING = ("--runner", "pooling", "--block-size", "4")


@pytest.fixture(scope="module")
def llama():
    path = ensure_builtin("tiny-llama")
    return path, hf_float(path)


def test_run_line_of_many_inputs_is_answered_in_one_record(tmp_path, llama):
    """A line whose body.input is a list of token lists, or of strings, gets one OpenAI batch output line holding
    every vector in order (transformers' last_hidden_state pooled), the tokens of all of them counted, and the id
    its request_id names; infer's own records (one vector) refuse it, naming --output-format openai."""
    from transformers import AutoTokenizer
    path, hf = llama
    ids = random_prompts(hf.config.vocab_size, (6, 13, 3), seed=21)
    texts = ["hello world", "a b c"]
    tok = AutoTokenizer.from_pretrained(path)
    text_ids = [tok(t)["input_ids"] for t in texts]
    lines = [_line("ids", {"input": ids, "request_id": "job-7"}), _line("texts", {"input": texts})]
    recs, _ = infer_run_records(tmp_path, lines, *POOLING, "--output-format", "openai", key="custom_id")
    for key, prompts in (("ids", ids), ("texts", text_ids)):
        resp = recs[key]["response"]
        assert resp["status_code"] == 200 and recs[key]["error"] is None
        body = resp["body"]
        assert [d["index"] for d in body["data"]] == list(range(len(prompts)))
        n = sum(map(len, prompts))
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
        check_close([torch.tensor(d["embedding"]) for d in body["data"]],
                    [pooled(hf_hidden(hf, p), "LAST") for p in prompts])
    assert recs["ids"]["response"]["body"]["id"] == "embd-job-7"
    assert recs["texts"]["response"]["body"]["id"].startswith("embd-")
    own, _ = infer_run_records(tmp_path, lines, *POOLING)
    assert "body.input holds 3 inputs" in own["ids"]["error"] and "--output-format openai" in own["ids"]["error"]


def test_run_line_of_many_inputs_names_the_input_the_engine_refuses(tmp_path, llama):
    """An input longer than the context fails its whole line, naming that input; the other lines run."""
    _, hf = llama
    ids = random_prompts(hf.config.vocab_size, (4, 40), seed=22)
    lines = [_line("bad", {"input": ids}), _line("ok", {"input": ids[:1]})]
    recs, _ = infer_run_records(tmp_path, lines, *POOLING, "--max-model-len", "32", "--output-format", "openai",
                                key="custom_id")
    assert recs["bad"]["response"]["status_code"] == 400
    assert "body.input[1]: " in recs["bad"]["error"]["message"], recs["bad"]
    assert recs["ok"]["response"]["status_code"] == 200


def test_run_line_of_many_inputs_resumes(tmp_path, llama):
    """--resume keeps a many-input line's record and runs the lines not yet answered (one record each)."""
    _, hf = llama
    ids = random_prompts(hf.config.vocab_size, (5, 7, 2), seed=23)
    lines = [_line("first", {"input": ids[:2]}), _line("second", {"input": [ids[2], ids[0]]})]
    args = (*POOLING, "--output-format", "openai")
    recs, _ = infer_run_records(tmp_path, lines[:1], *args, key="custom_id")
    kept = recs["first"]
    recs, _ = infer_run_records(tmp_path, lines, *args, "--resume", key="custom_id")
    assert recs["first"] == kept and len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    check_close([torch.tensor(d["embedding"]) for d in recs["second"]["response"]["body"]["data"]],
                [pooled(hf_hidden(hf, p), "LAST") for p in (ids[2], ids[0])])


def test_server_response_id_is_the_request_id(served_pooling):
    """POST /v1/embeddings: the body's request_id names the response (embd-ID, as vLLM's), the X-Request-Id header
    before it; none given: a fresh embd- id; a request_id that is not a string is refused naming it."""
    import httpx
    base = served_pooling[0]
    status, body = _post(base, "/v1/embeddings", {"input": "hi", "request_id": "r-1"})
    assert status == 200 and body["id"] == "embd-r-1"
    r = httpx.post(base + "/v1/embeddings", json={"input": "hi", "request_id": "r-1"},
                   headers={"X-Request-Id": "hdr"}, timeout=60)
    assert r.json()["id"] == "embd-hdr" and r.headers["x-request-id"] == "hdr"
    status, one = _post(base, "/v1/embeddings", {"input": "hi"})
    status2, two = _post(base, "/v1/embeddings", {"input": "hi", "request_id": ""})
    assert one["id"].startswith("embd-") and two["id"].startswith("embd-") and one["id"] != two["id"]
    status, bad = _post(base, "/v1/embeddings", {"input": "hi", "request_id": 5})
    assert status == 400 and bad["error"]["param"] == "request_id"
    assert "request_id must be a string, got int" in bad["error"]["message"]


def test_hypothesis_is_pinned_to_a_tested_range():
    """The test extra bounds hypothesis on both sides (a new release once broke a fuzz test), and the range holds
    the installed (tested) version: scripts/setup installs .[test] from pyproject."""
    from importlib.metadata import version

    from packaging.requirements import Requirement
    root = Path(__file__).resolve().parents[1]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (req,) = [Requirement(r) for r in extra if Requirement(r).name == "hypothesis"]
    assert {s.operator for s in req.specifier} >= {">=", "<"}
    assert req.specifier.contains(version("hypothesis"))
    assert ".[test" in (root / "scripts" / "setup").read_text()


def _bench(tmp_path, *args: str):
    """`infer bench tiny-llama ARGS --out tmp_path/bench -q`: (exit code, output, results.json or None)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    out = tmp_path / "bench"
    res = CliRunner().invoke(app, ["bench", "tiny-llama", *args, "--out", str(out), "-q"])
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return res.exit_code, res.output, results


def _check_embedding_entry(entry: dict, n: int, backend: str) -> None:
    """A pooling run's figures: every request completed, no token generated, embeddings/s and input tokens/s as
    their own definitions (completed and input tokens over the duration), E2EL's percentiles, no TTFT sample."""
    assert entry["backend"] == backend and entry["completed"] == n and entry["failed"] == 0
    assert entry["total_output_tokens"] == 0 and entry["total_input_tokens"] > 0
    assert entry["embedding_throughput"] == pytest.approx(n / entry["duration"])
    assert entry["input_throughput"] == pytest.approx(entry["total_input_tokens"] / entry["duration"])
    assert 0 < entry["median_e2el_ms"] <= entry["p99_e2el_ms"]
    assert len(entry["e2els"]) == n and all(x > 0 for x in entry["e2els"])
    assert "ttfts" not in entry and "output_lens" not in entry


def test_bench_runner_pooling_against_the_hf_baseline(tmp_path):
    """`infer bench --runner pooling --baseline hf`: each level's embeddings/s, input tokens/s, E2EL and memory, ours
    and transformers' side by side on the same prompts (each request's length, in order), with ours / baseline;
    results.csv carries the same, a row per side."""
    import csv
    code, output, results = _bench(tmp_path, "--runner", "pooling", "-c", "1,3", "--num-prompts", "5",
                                   "--input-len", "9", "--random-range-ratio", "0.5", "--baseline", "hf",
                                   "--save-detailed")
    assert code == 0, output
    assert [r["concurrency"] for r in results] == [1, 3]
    for entry in results:
        base = entry["baseline"]
        _check_embedding_entry(entry, 5, "infer")
        _check_embedding_entry(base, 5, "hf")
        assert base["concurrency"] == entry["concurrency"]
        assert entry["input_lens"] == base["input_lens"] and len(set(entry["input_lens"])) > 1
        assert entry["peak_memory_bytes"] > 0 and base["peak_memory_bytes"] > 0
        for key in ("embedding_throughput", "input_throughput", "median_e2el_ms"):
            assert entry["ratio"][key] == pytest.approx(entry[key] / base[key])
        assert entry["config"]["pooling"] is True and "AutoModel" in entry["config"]["baseline_engine"]
    rows = list(csv.DictReader((tmp_path / "bench" / "results.csv").open()))
    assert [(r["backend"], r["concurrency"]) for r in rows] == [("infer", "1"), ("hf", "1"), ("infer", "3"),
                                                                ("hf", "3")]
    assert float(rows[0]["ratio_embedding_throughput"]) == pytest.approx(results[0]["ratio"]["embedding_throughput"])


def test_hf_baseline_pools_as_the_engine(llama):
    """The baseline's vectors (a right-padded batch of unequal prompts) are the engine's, for each pooling type."""
    from infer import LLM
    from infer.bench.hf_baseline import hf_embeddings
    from infer.engine.pooling import resolve_pooler
    path, hf = llama
    prompts = random_prompts(hf.config.vocab_size, (7, 2, 11), seed=24)
    for kind in ("LAST", "MEAN", "CLS"):
        cfg = {"pooling_type": kind, "normalize": kind != "MEAN"}
        with LLM(str(path), runner="pooling", pooler_config=cfg, block_size=4) as llm:
            want = [torch.tensor(o.outputs.embedding) for o in llm.embed(prompts)]
        pooler = resolve_pooler(path, hf.config.hidden_size, cfg)
        check_close(hf_embeddings(hf, prompts, pooler, torch.device("cpu")), want)


def test_bench_url_runner_pooling_posts_embeddings(tmp_path, served_pooling):  # noqa: F811
    """--url with --runner pooling drives the server's POST /v1/embeddings (its prompt tokens counted from the usage),
    and the HF baseline pools as --pooler-config says the server does."""
    base = served_pooling[0]
    code, output, results = _bench(tmp_path, "--url", base, "--runner", "pooling", "--pooler-config",
                                   '{"pooling_type": "MEAN"}', "-c", "2", "--num-prompts", "4", "--input-len", "6",
                                   "--baseline", "hf", "--save-detailed")
    assert code == 0, output
    (entry,) = results
    _check_embedding_entry(entry, 4, "http")
    _check_embedding_entry(entry["baseline"], 4, "hf")
    assert entry["input_lens"] == entry["baseline"]["input_lens"]


def test_bench_url_runner_pooling_refuses_a_generation_server(tmp_path):
    """A server that generates answers no embeddings: refused before the run, nothing measured."""
    from helpers import served_tiny_llama
    gen = served_tiny_llama()
    base = next(gen)
    try:
        code, output, results = _bench(tmp_path, "--url", base, "--runner", "pooling", "-c", "1", "--num-prompts",
                                       "1")
    finally:
        gen.close()
    assert code == 2 and "for text generation, and --runner pooling benches embeddings" in output, output
    assert results is None


@pytest.mark.parametrize("args, message", [
    (("--output-len", "5"), "--output-len: --runner pooling benches embeddings"),
    (("--goodput", "ttft:100"), "--goodput ttft: an embedding has no token times"),
])
def test_bench_runner_pooling_refuses_generation_options(tmp_path, args, message):
    code, output, results = _bench(tmp_path, "--runner", "pooling", "-c", "1", "--num-prompts", "1", *args)
    assert code == 2 and message in output, output
    assert results is None


def test_retry_failed_takes_served_model_names_added(tmp_path, llama):
    """A line whose body.model was no name of the run failed (404); --resume --retry-failed with that name added
    to --served-model-name (MODEL's name still first) runs it again, into one record with every input's vector, and
    keeps the others; without --retry-failed the hint says to add it; a new first name (the model of every record
    whose line names none) is still refused."""
    _, hf = llama
    ids = random_prompts(hf.config.vocab_size, (5, 3), seed=25)
    lines = [_line("plain", {"input": ids[0]}), _line("alias", {"model": "alias", "input": ids})]
    args = (*POOLING, "--output-format", "openai")
    recs, _ = infer_run_records(tmp_path, lines, *args, key="custom_id")
    kept = recs["plain"]
    assert recs["alias"]["response"]["status_code"] == 404
    recs, printed = infer_run_records(tmp_path, lines, *args, "--served-model-name", "tiny-llama", "alias",
                                      "--resume", key="custom_id")
    assert "add --retry-failed" in " ".join(printed.split()) and recs["alias"]["response"]["status_code"] == 404
    recs, printed = infer_run_records(tmp_path, lines, *args, "--served-model-name", "alias", "tiny-llama",
                                      "--resume", "--retry-failed", key="custom_id")
    assert "served_model_name" in " ".join(printed.split()) and recs["alias"]["response"]["status_code"] == 404
    recs, printed = infer_run_records(tmp_path, lines, *args, "--served-model-name", "tiny-llama", "alias",
                                      "--resume", "--retry-failed", key="custom_id")
    assert recs["plain"] == kept, printed
    body = recs["alias"]["response"]["body"]
    assert recs["alias"]["response"]["status_code"] == 200 and body["model"] == "alias"
    check_close([torch.tensor(d["embedding"]) for d in body["data"]], [pooled(hf_hidden(hf, p), "LAST") for p in ids])
