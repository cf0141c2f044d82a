"""HTTP benchmark driver against a small fake OpenAI SSE server on a free loopback port."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infer.bench.datasets import BenchRequest
from infer.bench.http_driver import base_url, run_http
from infer.errors import ConfigError

from helpers import ModelsHandler


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.bodies = []


class _Handler(ModelsHandler, BaseHTTPRequestHandler):
    state: _State

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        st = self.state
        with st.lock:
            st.bodies.append((body, self.headers.get("Authorization")))
            st.active += 1
            st.max_active = max(st.max_active, st.active)
        done = False

        def finish():  # before the last bytes go out: a client that has them may send its next request at once
            nonlocal done
            if not done:
                done = True
                with st.lock:
                    st.active -= 1
        try:
            if body["model"] == "missing":
                finish()
                self.send_response(404)
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "model not found"}}')
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(body["max_tokens"]):
                time.sleep(0.003)
                chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n')
            if "nousage" not in body["prompt"]:
                usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"], "total_tokens": 0}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            finish()
            self.wfile.write(b": keep-alive comment\n\ndata: [DONE]\n\n")
        finally:
            finish()


@pytest.fixture
def server():
    state = _State()
    handler = type("H", (_Handler,), {"state": state})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/", state
    httpd.shutdown()
    httpd.server_close()


def test_streams_are_timed_and_concurrency_bounded(server):
    url, state = server
    reqs = [BenchRequest(f"prompt {i}", [1, 2, 3], 3 + i % 4, lora="ad" if i % 2 else None, ignore_eos=True)
            for i in range(10)]
    res = run_http(url, "m", reqs, concurrency=3, api_key="sk-x", progress=False)
    assert state.max_active <= 3 and not res.partial
    assert [r.index for r in res.records] == list(range(10))
    for r in res.records:
        n = reqs[r.index].output_len
        assert r.success and r.output_tokens == n and len(r.chunk_times) == n and r.finish_reason == "length"
        assert r.text == "".join(f"t{i} " for i in range(n)) and r.prompt_tokens == 3
        assert r.send_time < r.chunk_times[0] <= r.chunk_times[-1]
    body, auth = state.bodies[0]
    assert body["prompt"] == [1, 2, 3]  # the token ids, not the text: the server runs the very prompt
    assert auth == "Bearer sk-x" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert sorted(b["model"] for b, _ in state.bodies) == ["ad"] * 5 + ["m"] * 5
    m = res.metrics()
    assert m["completed"] == 10 and m["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert m["mean_itl_ms"] > 0 and m["mean_ttft_ms"] > 0


def test_http_errors_fail_one_request_and_usage_fallback(server):
    url, state = server
    reqs = [BenchRequest("a", [1], 2, lora="missing"), BenchRequest("nousage b", None, 4)]  # text only: sent as text
    res = run_http(url, "m", reqs, concurrency=2, progress=False)
    bad, good = res.records
    assert not bad.success and "404" in bad.error
    assert good.success and good.output_tokens == 4  # counted from the chunks without a usage chunk
    assert res.metrics()["failed"] == 1
    assert sorted(map(str, (b["prompt"] for b, _ in state.bodies))) == ["[1]", "nousage b"]


def test_server_sees_exactly_the_prompt_tokens():
    """Random prompts of --input-len tokens reach `infer serve` as those very tokens: the text of random ids,
    tokenized again, was another length (4 prompts of 8 tokens came back as 38 prompt tokens, not 32)."""
    from infer.bench.datasets import load_workload
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128))
    reqs = load_workload("random", engine.tokenizer, num_prompts=4, input_len=8, output_len=3).requests
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as url:
        res = run_http(url, "tiny-llama", reqs, concurrency=2, progress=False)
    assert [r.prompt_tokens for r in res.records] == [8] * 4  # the server's usage.prompt_tokens
    assert res.metrics()["total_input_tokens"] == 32 and res.metrics()["total_output_tokens"] == 12


def test_unreachable_url_is_a_config_error():
    with socket.socket() as s:  # bound, never listening: refused, and no other process can take the port meanwhile
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot reach http://127.0.0.1:{port}"):
            run_http(f"http://127.0.0.1:{port}", "m", [BenchRequest("a", [1], 2)], concurrency=1, progress=False)
    with pytest.raises(ConfigError, match="not an http"):
        base_url("127.0.0.1:8000")


def test_ctrl_c_returns_partial(server):
    import os
    import signal
    url, state = server
    reqs = [BenchRequest("a", [1], 2)] * 2 + [BenchRequest("slow", [1], 2000)] * 2
    stop = threading.Event()

    def press_ctrl_c():  # once, a second in, while the slow streams run
        while not stop.wait(0.2):
            with state.lock:
                streaming = state.active > 0
            if streaming and stop.wait(1.0) is False:
                os.kill(os.getpid(), signal.SIGINT)
                return

    # Ctrl-C as a terminal delivers it: a process started in the background by a non-interactive shell (as CI may
    # start the tests) inherits SIGINT ignored, and Python then never turns it into KeyboardInterrupt.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    try:
        res = run_http(url, "m", reqs, concurrency=4, progress=False)
    finally:
        stop.set()
        presser.join()
        signal.signal(signal.SIGINT, old)
    assert res.partial and res.aborted == 2
    assert sorted(r.index for r in res.records) == [0, 1] and all(r.success for r in res.records)
