"""Session 41, `infer run --output-format openai`: OpenAI's batch output line (as `vllm run-batch` writes it), the
response body being what `infer serve` answers the same body with; resume, --strict, error records and the
summary as in infer's own format."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()
CHAT = [{"role": "user", "content": "tell me about the weather"}]
# bodies that exercise what a response carries: logprobs (both kinds), prompt_logprobs, return_token_ids, a stop
# string, a seed, the model's name and a request_id
BODIES = [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 2,
                              "temperature": 0.8, "seed": 7, "model": "tiny-llama", "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 4, "prompt_logprobs": 1, "seed": 3,
                              "request_id": "mine"}),
    ("/v1/completions", {"prompt": "The rain in Spain", "max_tokens": 6, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stop": ["e"],
                         "prompt_logprobs": 0, "return_token_ids": True}),
    ("/v1/completions", {"prompt": [5, 9, 11, 20], "max_tokens": 3, "seed": 11, "top_k": 5}),
]


def _run(*args):
    return runner.invoke(app, ["run", "tiny-llama", *map(str, args), "-q"])


def _batch(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _write(path, lines) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _records(path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.split(b"\n")[:-1]]


def _without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _same(a, b, where="body") -> None:
    """a == b, but floats (logprobs) within 1e-4: a batch of other requests beside a request moves them in the last
    digits. Tokens, texts and counts are compared exactly."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) < 1e-4, (where, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The input of BODIES as batch lines, and its openai-format output."""
    tmp = tmp_path_factory.mktemp("batchout")
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    _write(inp, [_batch(f"r{i}", url, body) for i, (url, body) in enumerate(BODIES)])
    res = _run(inp, "-o", out, "--output-format", "openai")
    assert res.exit_code == 0, res.output
    return inp, out


def test_each_record_is_an_openai_batch_output_line(batch):
    """{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}, one per line."""
    _, out = batch
    recs = _records(out)
    assert sorted(r["custom_id"] for r in recs) == [f"r{i}" for i in range(len(BODIES))]
    for r in recs:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
        assert set(r["response"]) == {"status_code", "request_id", "body"} and r["response"]["status_code"] == 200
        i = int(r["custom_id"][1:])
        chat = BODIES[i][0] == "/v1/chat/completions"
        assert r["response"]["body"]["object"] == ("chat.completion" if chat else "text_completion")
    assert len({r["id"] for r in recs}) == len(recs) and len({r["response"]["request_id"] for r in recs}) == len(recs)
    by_id = {r["custom_id"]: r for r in recs}
    assert by_id["r2"]["response"]["body"]["id"] == "chatcmpl-mine"  # the body's request_id, as the server's


def test_the_body_is_what_the_server_answers(batch):
    """Each response body equals `infer serve`'s answer to the same body (the FastAPI app itself), ids and
    timestamps aside: the same reply tokens, text, logprobs, usage, finish and stop reasons."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    _, out = batch
    by_id = {r["custom_id"]: r["response"]["body"] for r in _records(out)}
    engine = LLMEngine(EngineConfig("tiny-llama"))
    with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama"))) as client:
        for i, (url, body) in enumerate(BODIES):
            r = client.post(url, json=body)
            assert r.status_code == 200, r.text
            _same(_without_ids(by_id[f"r{i}"]), _without_ids(r.json()))


def test_resume_after_a_cut_ends_with_one_record_per_custom_id(batch, tmp_path):
    """An output cut after two records (with a torn third) and resumed: the records written before are kept as
    they were, each custom_id has exactly one record, and the resumed ones have the uninterrupted run's replies."""
    inp, full = batch
    lines = full.read_bytes().split(b"\n")[:-1]
    out = tmp_path / "out.jsonl"
    out.write_bytes(lines[0] + b"\n" + lines[1] + b"\n" + lines[2][:40])
    fingerprint = json.loads((full.parent / "out.jsonl.resume.json").read_text())
    (tmp_path / "out.jsonl.resume.json").write_text(json.dumps({**fingerprint, "complete": False}))
    res = _run(inp, "-o", out, "--output-format", "openai")  # not without --resume: it would start over
    assert res.exit_code == 2 and "did not finish" in res.output
    res = _run(inp, "-o", out, "--output-format", "openai", "--resume")
    assert res.exit_code == 0, res.output
    got = out.read_bytes().split(b"\n")[:-1]
    assert got[:2] == lines[:2]
    recs = [json.loads(line) for line in got]
    assert sorted(r["custom_id"] for r in recs) == [f"r{i}" for i in range(len(BODIES))]
    want = {r["custom_id"]: _without_ids(r["response"]["body"]) for r in _records(full)}
    _same({r["custom_id"]: _without_ids(r["response"]["body"]) for r in recs}, want)


def test_resume_after_an_interrupt_in_the_middle_of_the_run(tmp_path, monkeypatch):
    """A run interrupted (as by Ctrl-C or SIGTERM) after some records, then resumed: one record per custom_id, an
    error record's line kept as such (it is not run again), and exit 1 for it."""
    from infer.engine.llm_engine import LLMEngine
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [_batch(f"c{i}", "/v1/completions", {"prompt": f"request {i}", "max_tokens": 2 + i, "temperature": 0,
                                                 "ignore_eos": True}) for i in range(5)]
    lines.append(_batch("bad", "/v1/completions", {"prompt": "x", "n": 3}))
    _write(inp, lines)
    real_step, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real_step(self)
    monkeypatch.setattr(LLMEngine, "step", step)
    res = _run(inp, "-o", out, "--output-format", "openai", "--max-num-seqs", "2")
    assert res.exit_code == 130, res.output
    first = _records(out)
    assert 0 < len(first) < len(lines)
    monkeypatch.setattr(LLMEngine, "step", real_step)
    res = _run(inp, "-o", out, "--output-format", "openai", "--resume")
    assert res.exit_code == 1, res.output  # the bad line's error record, written by the first session
    recs = _records(out)
    assert recs[:len(first)] == first
    assert sorted(r["custom_id"] for r in recs) == sorted(line["custom_id"] for line in lines)
    bad = next(r for r in recs if r["custom_id"] == "bad")
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"] is None
    assert "only n=1 is supported" in bad["error"]["message"]
    for r in recs:
        if r["custom_id"] != "bad":
            i = int(r["custom_id"][1:])
            assert r["response"]["body"]["usage"]["completion_tokens"] == 2 + i


def test_switching_the_format_on_resume_is_refused_with_the_difference_named(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_batch("a", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                 _batch("b", "/v1/completions", {"prompt": "yo", "max_tokens": 2})])
    assert _run(inp, "-o", out).exit_code == 0
    out.write_bytes(out.read_bytes().split(b"\n")[0] + b"\n")
    res = _run(inp, "-o", out, "--resume", "--output-format", "openai")
    assert res.exit_code == 2 and "output_format 'infer' -> 'openai'" in res.output
    out2 = tmp_path / "out2.jsonl"
    assert _run(inp, "-o", out2, "--output-format", "openai").exit_code == 0
    out2.write_bytes(out2.read_bytes().split(b"\n")[0] + b"\n")
    res = _run(inp, "-o", out2, "--resume")
    assert res.exit_code == 2 and "output_format 'openai' -> 'infer'" in res.output


def test_lines_that_are_not_batch_lines(tmp_path):
    """In openai format a plain line gets an error record (400) naming why, a bad JSON line one with its made-up
    id; --strict refuses both before generating; an input without any batch line is refused whole; the summary
    counts them."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(_batch("ok", "/v1/completions", {"prompt": "hi", "max_tokens": 2})) + "\n"
                   + json.dumps({"id": "plain", "prompt": "hello"}) + "\nnot json\n")
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--output-format", "openai"])
    assert res.exit_code == 1, res.output
    assert "1 ok, 2 failed" in res.output and "first error (id " in res.output
    by_id = {r["custom_id"]: r for r in _records(out)}
    assert set(by_id) == {"ok", "plain", "line3"}
    assert "infer's own format" in by_id["plain"]["error"]["message"]
    assert by_id["line3"]["error"]["message"].startswith("line 3: bad JSON")
    for cid in ("plain", "line3"):
        assert by_id[cid]["response"] == {"status_code": 400, "request_id": by_id[cid]["response"]["request_id"],
                                          "body": None}
    res = _run(inp, "-o", tmp_path / "strict.jsonl", "--output-format", "openai", "--strict")
    assert res.exit_code == 2 and "infer's own format" in res.output
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    res = _run(plain, "-o", tmp_path / "p.jsonl", "--output-format", "openai")
    assert res.exit_code == 2 and "no line of the input is an OpenAI batch line" in res.output


def test_an_engine_failure_is_a_500_record(tmp_path, monkeypatch):
    """A step that fails: the requests it ran get error records with status 500 and the server's error object."""
    from infer.engine.llm_engine import LLMEngine
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_batch("a", "/v1/completions", {"prompt": "hi", "max_tokens": 2})])

    def step(self):
        raise RuntimeError("boom")
    monkeypatch.setattr(LLMEngine, "step", step)
    res = _run(inp, "-o", out, "--output-format", "openai")
    assert res.exit_code == 1, res.output
    [rec] = _records(out)
    assert rec["custom_id"] == "a" and rec["response"]["status_code"] == 500 and rec["response"]["body"] is None
    assert rec["error"]["type"] == "server_error" and "boom" in rec["error"]["message"]


def test_help_and_unknown_format():
    res = runner.invoke(app, ["run", "--help"], terminal_width=200)
    assert "--output-format" in res.output
    res = runner.invoke(app, ["run", "tiny-llama", "in.jsonl", "--output-format", "vllm"])
    assert res.exit_code == 2 and "'vllm' is not one of infer, openai" in res.output


def test_the_data_parallel_driver_writes_the_same_openai_records(monkeypatch, tmp_path):
    """run_parallel's driver (replicas through a fake Ray) writes the records one engine writes in openai format: the
    same bodies, a bad line's 400 and a request the engine failed on as a 500 (not as a bad line)."""
    from helpers import fail_steps_of
    from fakeray import FakeRay, Handle as _Handle

    from infer.cli import run as one, run_parallel
    from infer.cli.batch_io import Records, RecordWriter, check_format, model_names, read_inputs
    from infer.engine.config import EngineConfig
    from infer.parallel.pool import ReplicaPool
    from infer.parallel.replica import Replica
    fail_steps_of(monkeypatch, "poison")
    inp = tmp_path / "in.jsonl"
    _write(inp, [_batch("a", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0}),
                 _batch("b", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 1}),
                 _batch("poison", "/v1/completions", {"prompt": "y", "max_tokens": 3}),
                 {"id": "plain", "prompt": "z"}])
    cfg = EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=1, memory_limit=2 ** 29)
    replicas = [Replica(cfg) for _ in range(2)]
    tokenizer = replicas[0].engine.tokenizer
    got = []
    for path in (tmp_path / "one.jsonl", tmp_path / "dp.jsonl"):
        lines = read_inputs(inp, tokenizer, {"max_new_tokens": 3}, model_names(cfg), 64)
        check_format(lines, "openai")
        records = Records("openai", tokenizer, lines, "tiny-llama")
        writer = RecordWriter(path, append=False)
        if path.name == "one.jsonl":
            one._generate(replicas[0].engine, lines, writer, True, records)
        else:
            pool = ReplicaPool(FakeRay(), [_Handle(r) for r in replicas], capacity=2, notify=lambda m: None)
            run_parallel._generate(pool, lines, writer, tokenizer, True, records)
        writer.close()
        got.append({r["custom_id"]: {"status": r["response"]["status_code"], "error": r["error"],
                                     "body": r["response"]["body"] and _without_ids(r["response"]["body"])}
                    for r in _records(path)})
    want, dp = got
    assert set(want) == {"a", "b", "poison", "plain"}
    assert want["poison"]["status"] == 500 and want["poison"]["error"]["code"] == "engine_error"
    assert want["plain"]["status"] == 400 and want["a"]["status"] == want["b"]["status"] == 200
    _same(dp, want)
