"""Probes of `infer bench --url`'s prefix cache hit rate (session 53): a server that is not infer (vLLM) has no
/health figures, but with --enable-prompt-tokens-details it reports each request's
usage.prompt_tokens_details.cached_tokens; a level's hit rate comes from those where they come back (its
`prefix_cache_source` says "usage"), from an infer server's /health counters where they do not ("server"), and
each request's cached tokens are in the --save-detailed lists."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import ModelsHandler

pytest.importorskip("httpx")

PROMPT = list(range(5, 45))  # 40 tokens, blocks of 4: a repeat finds 36 of them cached (the last is computed)


class _VllmLike(ModelsHandler, BaseHTTPRequestHandler):
    """A vLLM server with --enable-prompt-tokens-details, as the client sees it: no /health figures (GET answers
    /v1/models only), and a streamed usage chunk with prompt_tokens_details only when the prompt found something
    cached (vLLM leaves a null one out): here, every prompt it has seen before finds 32 of its tokens cached."""

    seen: set
    lock: threading.Lock

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = tuple(body["prompt"])
        with self.lock:
            warm = key in self.seen
            self.seen.add(key)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"], "total_tokens": 0}
        if warm:
            usage["prompt_tokens_details"] = {"cached_tokens": 32}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def vllm_like():
    handler = type("H", (_VllmLike,), {"seen": set(), "lock": threading.Lock()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_server_without_health_figures_gets_its_hit_rate_from_the_requests_cached_tokens(vllm_like):
    """vLLM has no /health figures: the level had no prefix cache hit rate at all, though each warm request's
    usage said how many of its prompt tokens were cached; a cold one, which says nothing (vLLM leaves the null
    out), had none cached."""
    from infer.bench.datasets import BenchRequest
    from infer.bench.http_driver import run_http
    from infer.bench.report import run_entry
    reqs = [BenchRequest(None, PROMPT, 2, ignore_eos=True) for _ in range(3)]
    reqs.append(BenchRequest(None, list(range(100, 140)), 2, ignore_eos=True))
    res = run_http(vllm_like, "m", reqs, concurrency=1, progress=False)
    assert res.engine_stats == {}  # nothing from /health
    assert [r.cached_tokens for r in res.records] == [0, 32, 32, 0]
    e = run_entry(res, detailed=True)
    assert e["prefix_cache_hit_rate"] == pytest.approx(64 / 160)
    assert e["prefix_cache_source"] == "usage" and "server_prefix_cache_hit_rate" not in e
    assert e["cached_tokens"] == [0, 32, 32, 0]


def test_a_server_reporting_neither_has_no_figure_and_no_source():
    """No usage details and no /health figures (the fake server of the HTTP tests): no rate, and no source."""
    from infer.bench.metrics import RequestRecord, RunResult
    from infer.bench.report import run_entry
    rec = RequestRecord(0, 3, 0.0, chunk_times=[0.1, 0.2], output_tokens=2, success=True)
    e = run_entry(RunResult("http", 1, [rec], duration_s=1.0, num_requests=1), detailed=True)
    assert "prefix_cache_hit_rate" not in e and "prefix_cache_source" not in e and e["cached_tokens"] == [None]


def _infer_server(details: bool):
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=128))
    return Server(AsyncEngine(engine), "tiny", prompt_tokens_details=details)


def test_usage_and_health_agree_on_a_single_replica_infer_server_and_usage_wins():
    """`infer serve --enable-prompt-tokens-details`: both sources exist; the requests' own cached tokens give the
    level's figure (source "usage") and the /health counters' figure over the level, kept beside it, is the same,
    for a level of repeats one at a time and for a mixed level run concurrently."""
    pytest.importorskip("fastapi")
    from infer.bench.datasets import BenchRequest
    from infer.bench.http_driver import reset_prefix_cache, run_http
    from infer.bench.report import run_entry
    from infer.serve.app import serve_in_thread
    repeats = [BenchRequest(None, PROMPT, 3, ignore_eos=True) for _ in range(3)]
    mixed = [BenchRequest(None, list(range(200 + 40 * (i % 3), 240 + 40 * (i % 3))), 3, ignore_eos=True)
             for i in range(7)]
    with serve_in_thread(_infer_server(True)) as base:
        first = run_http(base, "tiny", repeats, concurrency=1, progress=False)
        assert reset_prefix_cache(base)
        second = run_http(base, "tiny", mixed, concurrency=3, progress=False)
    e = run_entry(first, detailed=True)
    assert e["cached_tokens"] == [0, 36, 36]
    assert e["prefix_cache_source"] == "usage"
    assert e["prefix_cache_hit_rate"] == pytest.approx(72 / 120) == e["server_prefix_cache_hit_rate"]
    e2 = run_entry(second)
    assert e2["prefix_cache_source"] == "usage" and e2["completed"] == 7
    assert e2["prefix_cache_hit_rate"] == pytest.approx(e2["server_prefix_cache_hit_rate"])
    assert e2["prefix_cache_hit_rate"] > 0
    cached = sum(r.cached_tokens for r in second.records)
    assert cached == second.engine_stats["run_prefix_cache_hits"]


def test_an_infer_server_without_details_keeps_its_health_figure_named_as_such():
    pytest.importorskip("fastapi")
    from infer.bench.datasets import BenchRequest
    from infer.bench.http_driver import run_http
    from infer.bench.report import run_entry
    from infer.serve.app import serve_in_thread
    reqs = [BenchRequest(None, PROMPT, 3, ignore_eos=True) for _ in range(3)]
    with serve_in_thread(_infer_server(False)) as base:
        res = run_http(base, "tiny", reqs, concurrency=1, progress=False)
    e = run_entry(res, detailed=True)
    assert e["prefix_cache_source"] == "server" and e["prefix_cache_hit_rate"] == pytest.approx(72 / 120)
    assert e["cached_tokens"] == [None] * 3 and "server_prefix_cache_hit_rate" not in e


def test_an_in_process_levels_figure_is_the_engines_with_each_requests_cached_tokens(tmp_path):
    from infer.bench.datasets import BenchRequest
    from infer.bench.driver import run_in_process
    from infer.bench.report import write_report
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=128))
    reqs = [BenchRequest(None, PROMPT, 3, ignore_eos=True) for _ in range(3)]
    res = run_in_process(engine, reqs, concurrency=1, progress=False)
    (e,) = write_report(tmp_path, [res], show=False, detailed=True)
    assert e["prefix_cache_source"] == "engine" and e["prefix_cache_hit_rate"] == pytest.approx(72 / 120)
    assert e["cached_tokens"] == [0, 36, 36]
    assert json.loads((tmp_path / "results.json").read_text())[0]["cached_tokens"] == [0, 36, 36]
    import csv
    with open(tmp_path / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["prefix_cache_source"] == "engine"
