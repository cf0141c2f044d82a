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
