"""Probes of `infer bench` (session 38): its numbers against vLLM's benchmark_serving definitions."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infer.bench.datasets import BenchRequest
from infer.bench.http_driver import run_http

from helpers import ModelsHandler


def _sse_server(chunks_for):
    """A loopback OpenAI completions server streaming `chunks_for(body)` (a list of JSON objects), then [DONE]."""

    class Handler(ModelsHandler, BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in chunks_for(body):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return httpd


def _choice(text, reason=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": reason}], "usage": None}


def _usage(n):
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}


@pytest.fixture
def eos_server():
    """What `infer serve` (and vLLM) stream: a request whose first token is EOS gets one chunk with no text and
    finish_reason stop (completion_tokens 1); one that stops after text gets its EOS step as a chunk with no text."""
    def chunks(body):
        if body["prompt"] == [1]:
            return [_choice("", "stop"), _usage(1)]
        return [_choice("a"), _choice("b"), _choice("", "stop"), _usage(3)]
    httpd = _sse_server(chunks)
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_reply_of_only_eos_is_a_completed_request_over_http(eos_server):
    """The in-process driver and vLLM count it completed (one output token, a TTFT); the HTTP driver failed it
    with 'the stream ended without any text', and `infer bench --url` exited 1."""
    res = run_http(eos_server, "m", [BenchRequest(None, [1], 4)], concurrency=1, progress=False)
    (rec,) = res.records
    assert rec.success, rec.error
    assert rec.output_tokens == 1 and rec.finish_reason == "stop" and len(rec.chunk_times) == 1
    m = res.metrics()
    assert m["completed"] == 1 and m["failed"] == 0 and m["mean_ttft_ms"] > 0


def test_the_eos_step_after_text_is_timed_over_http(eos_server):
    """Its EOS chunk (no text) ends the request: E2EL and ITL count it, as vLLM's and the in-process driver do, so
    TPOT = (E2EL - TTFT) / (3 - 1) spans the three tokens the usage counts."""
    res = run_http(eos_server, "m", [BenchRequest(None, [2], 4)], concurrency=1, progress=False)
    (rec,) = res.records
    assert rec.success and rec.output_tokens == 3 and rec.text == "ab"
    assert len(rec.chunk_times) == 3 and len(rec.itl) == 2
    assert rec.e2el == pytest.approx(rec.chunk_times[2] - rec.send_time)


def test_the_hf_baseline_is_warmed_before_it_is_measured(tmp_path, monkeypatch):
    """The engine runs warm_kernels() before its first level; the baseline's first level timed transformers' very
    first generate (CUDA's lazy loading, library handles), which inflated the x columns of that level."""
    import infer.bench.hf_baseline as H
    from infer.bench.plan import BenchPlan, run_plan
    from infer.engine.config import EngineConfig
    batches, real = [], H._run_batch

    def spy(model, tok, device, batch, sampler, *a):
        batches.append(([r.output_len for _, r in batch], sampler is not None))
        return real(model, tok, device, batch, sampler, *a)
    monkeypatch.setattr(H, "_run_batch", spy)
    plan = BenchPlan(model="tiny-llama", levels=[2], out=tmp_path / "out", num_prompts=3, input_len=4,
                     output_len=5, baseline="hf", quiet=True, engine=EngineConfig("tiny-llama", max_num_seqs=2))
    [r] = run_plan(plan)[0]
    assert batches == [([2, 2], False), ([5, 5], True), ([5], True)]  # a short unmeasured batch first
    assert r["baseline"]["completed"] == 3 and r["baseline"]["total_output_tokens"] == 15  # the warmup not counted


class _Clock:
    """A fake time module for the driver: the engine's step moves it on by one second."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now

    def sleep(self, s):
        self.now += max(s, 1e-3)


class _OneTokenASecond:
    """An engine whose every step takes one second and gives each request one token."""

    class _Out:
        def __init__(self, rid, n, finished):
            self.request_id, self.new_token_ids, self.token_ids = rid, [7], [7] * n
            self.num_cached_tokens = 0
            self.finished, self.finish_reason, self.error, self.text = finished, "length" if finished else None, \
                None, "x" * n

    def __init__(self, clock):
        self.clock, self.reqs = clock, {}

    def add_request(self, rid, ids, params, lora=None):
        self.reqs[rid] = [0, params.max_new_tokens]

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        self.clock.now += 1.0
        outs = []
        for rid, st in list(self.reqs.items()):
            st[0] += 1
            outs.append(self._Out(rid, st[0], st[0] == st[1]))
            if st[0] == st[1]:
                del self.reqs[rid]
        return outs

    def stats(self):
        return {}


@pytest.mark.parametrize("concurrency, ttft1", [(2, 1.5), (1, 1.0)])
def test_a_request_arriving_during_a_step_counts_from_its_arrival(monkeypatch, concurrency, ttft1):
    """--request-rate in-process: request 1 arrives at 0.5 s, in the middle of the step that runs request 0 (0 to 1
    s); a server would take it in its next step and its TTFT (token at 2 s) is 1.5 s, as vLLM's client measures it.
    The driver counted from when that step returned (1.0 s). With one slot, it waits for request 0 to finish (at
    2 s): that wait is not latency (vLLM starts the clock after its semaphore), its TTFT is 3 - 2 = 1 s."""
    import infer.bench.driver as D
    clock = _Clock()
    monkeypatch.setattr(D, "time", clock)
    monkeypatch.setattr(D, "arrival_offsets", lambda n, rate, seed: [0.0, 0.5])
    reqs = [BenchRequest(None, [1, 2], 2, ignore_eos=True), BenchRequest(None, [3, 4], 2, ignore_eos=True)]
    run = D.run_in_process(_OneTokenASecond(clock), reqs, concurrency, request_rate=2.0, progress=False)
    r0, r1 = run.records
    assert r0.ttft == pytest.approx(1.0) and r0.e2el == pytest.approx(2.0)
    assert r1.ttft == pytest.approx(ttft1) and r1.e2el == pytest.approx(ttft1 + 1.0)


def test_the_hf_baseline_generates_the_tokens_ours_could(tmp_path):
    """--max-model-len 32 with jsonl lines asking 60 tokens past EOS: the engine stops each at 32 tokens in all
    (about 20 new), transformers generate knows no such cap and made all 60: the x columns compared 41 output
    tokens with 120, and the replies' characters too."""
    from infer.bench.plan import BenchPlan, run_plan
    from infer.engine.config import EngineConfig
    data = tmp_path / "w.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"hello world number {i} is", "max_tokens": 60,
                                        "ignore_eos": True}) + "\n" for i in range(2)))
    plan = BenchPlan(model="tiny-llama", levels=[2], out=tmp_path / "out", dataset=f"jsonl:{data}",
                     baseline="hf", quiet=True, engine=EngineConfig("tiny-llama", max_num_seqs=2, max_model_len=32))
    [r] = run_plan(plan)[0]
    base = r["baseline"]
    assert r["completed"] == base["completed"] == 2
    assert r["total_output_tokens"] == base["total_output_tokens"] == 2 * 32 - r["total_input_tokens"]
    assert r["mean_reply_chars"] == base["mean_reply_chars"]


def test_a_server_run_shows_no_peak_memory_of_the_client(eos_server):
    """`infer bench --url` put the bench client's own resident memory (0.3 GiB) in the "peak GiB" column, where
    the in-process run shows the engine's: a GPU server's memory read as a third of a GiB."""
    from infer.bench.report import build_results, table_rows
    res = run_http(eos_server, "m", [BenchRequest(None, [2], 4)], concurrency=1, progress=False)
    assert res.peak_rss_bytes  # measured, and kept as the client's
    [entry] = build_results([res], env={"versions": {}, "device": "cpu", "git_commit": None})
    assert entry["peak_memory_bytes"] is None and entry["peak_memory_gib"] is None
    titles, [row] = table_rows([entry])
    assert row[titles.index("peak GiB")] == "-"
    from infer.bench.report import _markdown
    assert "- device: cpu (the client's: the server's is not seen from here)" in _markdown([entry], {}, {})
