"""Review of the waves of a large /v1/embeddings body: every input is checked before the first wave (an input
refused in a later wave ran the earlier waves for nothing), and a client that leaves between two waves gets no
further wave (a wave shorter than the server's disconnect poll never saw it leave: the whole body ran)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infer.models.tiny import ensure_builtin

from helpers import ModelsHandler, random_prompts
from test_probes_session59_embed import _post


@pytest.fixture(scope="module")
def waves():
    """tiny-llama as a pooling server running 2 requests at once (a wave of 2 inputs): (URL, Server, engine)."""
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    ensure_builtin("tiny-llama")
    engine = LLMEngine(EngineConfig("tiny-llama", runner="pooling", pooler_config={"pooling_type": "MEAN"},
                                    max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8, block_size=4))
    server = Server(AsyncEngine(engine), "tiny-llama")
    with serve_in_thread(server) as base:
        yield base, server, engine


def _count_adds(monkeypatch, server, on_add=None) -> list:
    """The request ids the engine is given (each wave's inputs), recorded; on_add(count) runs before each add."""
    added: list = []
    add = server.aengine.add

    def counted(rid, *args, **kwargs):
        added.append(rid)
        if on_add is not None:
            on_add(len(added))
        return add(rid, *args, **kwargs)
    monkeypatch.setattr(server.aengine, "add", counted)
    return added


def _drained(engine) -> bool:
    """Whether the engine holds no request and no KV block, polled for at most 30 s (its aborts run on its thread)."""
    for _ in range(300):
        if not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0:
            return True
        time.sleep(0.1)
    return False


def test_an_input_refused_in_a_later_wave_is_refused_before_any_wave_runs(waves, monkeypatch):
    """The 6th of 6 inputs (3 waves) is outside the vocabulary: a 400 naming input[5], and no input ran (was: two
    waves embedded, then refused)."""
    base, server, engine = waves
    vocab = engine.model_config.vocab_size
    added = _count_adds(monkeypatch, server)
    prompts = random_prompts(vocab, (3,) * 5, seed=5) + [[3, vocab]]
    status, body = _post(base, "/v1/embeddings", {"input": prompts})
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "input" and error["message"].startswith("input[5]: "), error
    assert "outside the vocabulary" in error["message"], error
    assert added == []
    too_long = random_prompts(vocab, (3, 3, 3, 40), seed=6)  # (max_model_len 32)
    status, body = _post(base, "/v1/embeddings", {"input": too_long})
    assert status == 400 and body["error"]["message"].startswith("input[3]: the prompt has 40 tokens"), body
    assert added == []


def test_a_client_gone_between_waves_gets_no_further_wave(waves, monkeypatch):
    """40 inputs (20 waves of 2); the client closes its connection while the 2nd wave is submitted. The server
    stops after that wave (was: every wave ran, as each took less than the disconnect poll, made long here so that
    only the check between waves can see it), answers nothing, and the engine holds no request and no block."""
    from infer.serve import app, embeddings
    base, server, engine = waves
    monkeypatch.setattr(app, "DISCONNECT_POLL_S", 30.0)  # (server.outputs' own poll never fires within a wave)
    reached, closed, done = threading.Event(), threading.Event(), threading.Event()

    def on_add(count):  # the 2nd wave's 2nd input: hold the server until the client is gone
        if count == 4:
            reached.set()
            closed.wait(30)
    added = _count_adds(monkeypatch, server, on_add)
    create = embeddings.create

    async def create_then_done(*args):
        try:
            return await create(*args)
        finally:
            done.set()
    monkeypatch.setattr(embeddings, "create", create_then_done)
    prompts = random_prompts(engine.model_config.vocab_size, (3,) * 40, seed=7)
    raw = json.dumps({"input": prompts}).encode()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        assert reached.wait(30), "the server did not reach the 2nd wave"
    closed.set()
    assert done.wait(60), "the server never finished the body"
    assert len(added) < len(prompts), f"every wave ran after the client left ({len(added)} inputs)"
    assert _drained(engine)
    status, body = _post(base, "/v1/embeddings", {"input": prompts[:3]})  # the server still answers
    assert status == 200 and len(body["data"]) == 3, body


class _VllmCompletions(ModelsHandler, BaseHTTPRequestHandler):
    """vLLM's POST /v1/completions as the client sees it: the body is validated first (CompletionRequest: a
    missing or empty prompt is a 400), then a pooling model (`pooling`) answers that it does not do completions,
    a generating one the completion of max_tokens tokens (16 when not given). `asked`: the max_tokens asked."""

    pooling: bool
    asked: list

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not body.get("prompt"):
            status, message = 400, "Either prompt or prompt_embeds must be provided and non-empty."
        elif self.pooling:
            status, message = 400, "The model does not support Completions API"
        else:
            status, message = 200, None
            self.asked.append(body.get("max_tokens", 16))
        payload = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}} \
            if message else {"object": "text_completion", "choices": [{"index": 0, "text": "x" * self.asked[-1]}]}
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.mark.parametrize("pooling", [True, False])
def test_bench_urls_probe_tells_a_pooling_vllm_from_a_generating_one(pooling):
    """vLLM validates the body before it finds its model pools: the probe without a prompt got the prompt's 400
    from a pooling vLLM too, and `infer bench --url` ran it (every request failed). Refused now; a generating vLLM
    is not, and is asked for one token."""
    from infer.cli.bench import check_generates
    from infer.errors import ConfigError
    asked: list = []
    handler = type("H", (_VllmCompletions,), {"pooling": pooling, "asked": asked})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        if pooling:
            with pytest.raises(ConfigError, match="as a pooling model"):
                check_generates(base, "m", {})
        else:
            check_generates(base, "m", {})
            assert asked == [1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_chat_bodys_prompt_too_long_names_messages(waves):
    """The chat form (messages) rendered longer than the context: the engine's 400 names messages, the body's
    field (was input, a field the body has not)."""
    base, _, engine = waves
    status, body = _post(base, "/v1/embeddings", {"messages": [{"role": "user", "content": "hi " * 40}]})
    assert status == 400, body
    assert body["error"]["param"] == "messages" and "tokens, which is more than" in body["error"]["message"], body
    assert _drained(engine)


def test_other_clients_are_answered_while_a_large_bodys_inputs_are_checked(waves, monkeypatch):
    """The check of every input before the first wave runs off the event loop: held in it, the server still
    answers GET /v1/models (a check of a large body on the loop stalled every client), then the body's vectors."""
    import httpx
    base, _, engine = waves
    checking, answered = threading.Event(), threading.Event()
    validate = engine.validate

    def held(*args, **kwargs):
        if not checking.is_set():
            checking.set()
            answered.wait(30)
        return validate(*args, **kwargs)
    monkeypatch.setattr(engine, "validate", held)
    prompts = random_prompts(engine.model_config.vocab_size, (3,) * 6, seed=8)
    result: list = []
    body = threading.Thread(target=lambda: result.append(_post(base, "/v1/embeddings", {"input": prompts})))
    body.start()
    try:
        assert checking.wait(30), "the inputs were not checked"
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 200
    finally:
        answered.set()
        body.join(60)
    status, reply = result[0]
    assert status == 200 and len(reply["data"]) == 6, reply


def test_a_replica_stopped_mid_body_gives_smaller_waves_not_a_400():
    """--data-parallel-size 2 (in-process replicas behind tests/fakeray.py), 2 running slots each, --max-queue 1:
    waves of 4. Replica 1 stops with the first wave's requests on it (they run again on replica 0); the next waves
    are of the 2 slots left. Was: a 400 "this request has 4 prompts, more than the 3 requests the server can hold"
    after a wave had run. Every vector equals transformers'; replica 0 holds nothing after."""
    pytest.importorskip("fastapi")
    import torch

    from fakeray import FakeRay, Handle
    from infer.engine.config import EngineConfig
    from infer.parallel.replica import Replica
    from infer.parallel.serve_engine import RayAsyncEngine, ReplicaView
    from infer.serve.app import Server, serve_in_thread
    from lora_helpers import hf_float
    from test_probes_session59_embed import check_close, hf_hidden, pooled

    class _StopsWithWork(FakeRay):
        victim = None

        def before(self, ref):  # the victim's first step that is given requests: it stops
            if ref.handle is self.victim and ref.method == "serve_step" and ref.args[0]:
                ref.handle.alive = False
    cfg = EngineConfig("tiny-llama", runner="pooling", pooler_config={"pooling_type": "MEAN"}, max_model_len=32,
                       max_num_seqs=2, max_num_batched_tokens=8, block_size=4)
    replicas = [Replica(cfg) for _ in range(2)]
    engine = replicas[0].engine
    ray = _StopsWithWork()
    handles = [Handle(r) for r in replicas]
    ray.victim = handles[1]
    view = ReplicaView(engine.config, engine.model_path, engine.tokenizer, replicas[0].info())
    aengine = RayAsyncEngine(ray, handles, [r.info() for r in replicas], view, max_queue=1)
    prompts = random_prompts(engine.model_config.vocab_size, (3, 5, 4, 6, 2, 7, 3, 5, 4, 6), seed=9)
    with serve_in_thread(Server(aengine, "tiny-llama")) as base:
        status, body = _post(base, "/v1/embeddings", {"input": prompts})
    assert status == 200, body
    assert not handles[1].alive  # (the replica did stop mid-body)
    hf = hf_float(ensure_builtin("tiny-llama"))
    check_close([torch.tensor(d["embedding"]) for d in body["data"]],
                [pooled(hf_hidden(hf, p), "MEAN") for p in prompts])
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert _drained(engine)
