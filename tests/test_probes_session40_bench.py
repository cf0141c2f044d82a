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


def test_a_stream_cut_off_by_the_server_is_a_failed_request():
    """A server that dies mid-reply (two of eight tokens streamed, then the connection closes: no finish_reason, no
    [DONE]) was counted a completed request of two tokens, raising throughput and hiding the failure; vLLM's
    client waits for the end of the stream too. It is now failed, naming why."""
    httpd = _server(lambda h: h.wfile.write(_chunk("a") + _chunk("b")))
    try:
        res = run_http(f"http://127.0.0.1:{httpd.server_address[1]}", "m", [BenchRequest(None, [1, 2], 8)], 1,
                       progress=False)
    finally:
        httpd.shutdown()
        httpd.server_close()
    (rec,) = res.records
    assert not rec.success and "stream ended before the reply finished" in rec.error
    m = res.metrics()
    assert m["completed"] == 0 and m["failed"] == 1 and m["total_output_tokens"] == 0


def test_a_stream_that_ends_with_a_finish_reason_or_done_is_completed():
    """The other side: a finish_reason without [DONE], or [DONE] without a finish_reason, is a whole reply."""
    for reply in (_chunk("a") + _chunk("b", "length"), _chunk("a") + _chunk("b") + b"data: [DONE]\n\n"):
        httpd = _server(lambda h, reply=reply: h.wfile.write(reply))
        try:
            res = run_http(f"http://127.0.0.1:{httpd.server_address[1]}", "m", [BenchRequest(None, [1, 2], 2)], 1,
                           progress=False)
        finally:
            httpd.shutdown()
            httpd.server_close()
        (rec,) = res.records
        assert rec.success, rec.error
