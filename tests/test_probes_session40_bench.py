"""Probes of `infer bench` (session 40): its numbers and outputs against vLLM's `vllm bench serve`."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from infer.bench.datasets import BenchRequest
from infer.bench.http_driver import run_http

from helpers import ModelsHandler


def _server(write_reply):
    """A loopback OpenAI completions server (HTTP/1.0: the reply ends when the connection closes) whose POST
    handler streams what `write_reply(handler)` writes."""

    class Handler(ModelsHandler, BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            write_reply(self)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return httpd


def _chunk(text, reason=None):
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text, 'finish_reason': reason}]})}\n\n".encode()


def _drive_one(reply: bytes, max_tokens: int):
    """run_http of one request against a server that writes `reply` and closes the connection."""
    httpd = _server(lambda h: h.wfile.write(reply))
    try:
        return run_http(f"http://127.0.0.1:{httpd.server_address[1]}", "m", [BenchRequest(None, [1, 2], max_tokens)],
                        1, progress=False)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_stream_cut_off_by_the_server_is_a_failed_request():
    """A server that dies mid-reply (two of eight tokens streamed, then the connection closes: no finish_reason, no
    [DONE]) was counted a completed request of two tokens, raising throughput and hiding the failure; vLLM's
    client waits for the end of the stream too. It is now failed, naming why."""
    res = _drive_one(_chunk("a") + _chunk("b"), 8)
    (rec,) = res.records
    assert not rec.success and "stream ended before the reply finished" in rec.error
    m = res.metrics()
    assert m["completed"] == 0 and m["failed"] == 1 and m["total_output_tokens"] == 0


def test_a_stream_that_ends_with_a_finish_reason_or_done_is_completed():
    """The other side: a finish_reason without [DONE], or [DONE] without a finish_reason, is a whole reply."""
    for reply in (_chunk("a") + _chunk("b", "length"), _chunk("a") + _chunk("b") + b"data: [DONE]\n\n"):
        (rec,) = _drive_one(reply, 2).records
        assert rec.success, rec.error


def test_sigterm_writes_the_partial_report_and_exits_143(tmp_path, monkeypatch):
    """SIGTERM (`timeout`, a job scheduler, docker stop) ended `infer bench` on the spot: nothing measured reached
    --out, not even the levels already finished. It now stops as Ctrl-C does (the report written, the level it cut
    marked partial), says "terminated" and exits 143, as `infer run` does."""
    import os
    import signal

    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.engine.llm_engine import LLMEngine
    before = signal.getsignal(signal.SIGTERM)
    step, calls = LLMEngine.step, [0]

    def terminated(self):
        calls[0] += 1
        if calls[0] == 12:  # past the warmup, inside the measured run
            if signal.getsignal(signal.SIGTERM) == before:  # the signal would end pytest itself
                raise RuntimeError("no SIGTERM handler while the benchmark runs: the process would end here")
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self)
    monkeypatch.setattr(LLMEngine, "step", terminated)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(out), "-c", "2,4", "--num-prompts", "6",
                                   "--input-len", "8", "--output-len", "20", "-q"])
    assert res.exit_code == 143, (res.output, res.exception)
    assert "terminated" in res.output and "Traceback" not in res.output
    [r] = json.loads((out / "results.json").read_text())
    assert r["partial"] is True and r["completed"] < 6 and r["aborted"] > 0
    assert signal.getsignal(signal.SIGTERM) == before  # put back


def test_an_unexpected_error_at_a_later_level_keeps_the_levels_measured(tmp_path, monkeypatch):
    """`-c 1,2`: level 2 failed with an error that is not infer's own (the GPU ran out of memory at the larger
    batch, a bug): the report of level 1, measured and printed nowhere yet, was lost. It is now written before the
    error is raised (as it already was for infer's own errors, e.g. the server going away)."""
    from typer.testing import CliRunner

    import infer.bench.driver as driver
    from infer.cli.main import app
    real = driver.run_in_process

    def oom_at_two(engine, requests, concurrency, *a, **k):
        if concurrency == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(engine, requests, concurrency, *a, **k)
    monkeypatch.setattr(driver, "run_in_process", oom_at_two)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(out), "-c", "1,2", "--num-prompts", "2",
                                   "--input-len", "4", "--output-len", "3", "-q"])
    assert isinstance(res.exception, RuntimeError)
    [r] = json.loads((out / "results.json").read_text())
    assert r["concurrency"] == 1 and r["completed"] == 2 and not r["partial"]
    assert (out / "report.md").is_file()


def test_goodput_counts_the_completed_requests_within_every_objective():
    """vLLM's --goodput KEY:MS (ttft, tpot, e2el): request_goodput = completed requests meeting every objective
    named, per second of duration; a one-token request's TPOT is 0. `infer bench` had no such figure."""
    from infer.bench.metrics import RequestRecord, compute_metrics
    recs = [RequestRecord(0, 4, 0.0, [0.010, 0.012, 0.014], 3, "abc", True),  # TTFT 10, TPOT 2, E2EL 14 ms
            RequestRecord(1, 4, 0.0, [0.050, 0.051], 2, "ab", True),  # TTFT 50, TPOT 1, E2EL 51
            RequestRecord(2, 4, 0.0, [0.005], 1, "a", True),  # TTFT 5, (TPOT 0), E2EL 5
            RequestRecord(3, 4, 0.0, [0.001], 1, "", False, "HTTP 500")]  # failed: never good
    assert "request_goodput" not in compute_metrics(recs, 0.1)
    assert compute_metrics(recs, 0.1, goodput={"ttft": 20, "tpot": 1.5})["request_goodput"] == 10.0  # only #2
    assert compute_metrics(recs, 0.1, goodput={"e2el": 20})["request_goodput"] == 20.0  # #0 and #2
    assert compute_metrics(recs, 0.1, goodput={"tpot": 5})["request_goodput"] == 30.0


def test_goodput_option_reaches_every_report_file(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(out), "-c", "2", "--num-prompts", "2",
                                   "--input-len", "4", "--output-len", "3", "--goodput", "ttft:1e9 tpot:1e9",
                                   "--goodput", "e2el:1e9"])
    assert res.exit_code == 0, res.output
    [r] = json.loads((out / "results.json").read_text())
    assert r["request_goodput"] == r["request_throughput"] > 0
    assert r["config"]["goodput"] == {"ttft": 1e9, "tpot": 1e9, "e2el": 1e9}
    assert "request_goodput" in (out / "results.csv").read_text().splitlines()[0]
    assert "good req/s" in (out / "report.md").read_text() and "good req/s" in res.output


def test_bad_goodput_is_refused_naming_it(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    for value, message in (("ttft", "'ttft' is not a KEY:MS"), ("itl:5", "'itl:5' is not a KEY:MS"),
                           ("tpot:-1", "must be >= 0 ms"), ("e2el:1,e2el:2", "sets e2el twice")):
        res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(tmp_path / "o"), "--goodput", value])
        assert res.exit_code == 2 and message in res.output, res.output


def test_peak_rss_counts_a_peak_between_two_samples():
    """The sampler read the RSS only when a sample was due (every 50 ms): memory taken and given back between two
    samples (a large prefill's activations, on a CPU) was missing from the peak it reported, though its docstring
    said it always tracked the peak. It now reads the kernel's peak (VmHWM, reset at start)."""
    import sys

    import numpy as np
    import pytest

    from infer.bench.monitor import ResourceSampler
    if not sys.platform.startswith("linux"):
        pytest.skip("the kernel's peak RSS is read on Linux")
    sampler = ResourceSampler(interval_s=3600.0)
    sampler.start()
    sampler.sample(force=True)
    before = sampler.peak_rss_bytes
    big = np.ones(256 * 2**20, dtype=np.uint8)  # 256 MiB, touched, then given back to the OS
    sampler.sample()  # not due: no sample taken
    del big
    sampler.sample(force=True)
    assert sampler.peak_rss_bytes >= before + 200 * 2**20
