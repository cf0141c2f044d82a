"""`infer serve` against hostile bodies (issue 16): oversized bodies get 413 before they are parsed, deep nesting,
lone surrogates, non-finite and huge numbers get 400 naming the field, a 500 is an OpenAI body and is counted, and
a large body is parsed and tokenized off the event loop (/health answers meanwhile)."""

from __future__ import annotations

import re
import threading

import pytest

httpx = pytest.importorskip("httpx")  # the serve extra
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine
from infer.serve.body import DEFAULT_MAX_BODY_SIZE, BodyLimits, json_depth

LIMIT = 64 * 1024  # a small --max-body-size keeps the oversized bodies fast
DEPTH = 16


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=256, max_num_seqs=8))


@pytest.fixture(scope="module")
def server(engine):
    return Server(AsyncEngine(engine), "tiny-llama", limits=BodyLimits(LIMIT, DEPTH))


@pytest.fixture(scope="module")
def url(server):
    with serve_in_thread(server) as base:
        yield base


def _post(url: str, raw: bytes | str, path: str = "/v1/completions", timeout: float = 60) -> httpx.Response:
    data = raw.encode() if isinstance(raw, str) else raw
    return httpx.post(f"{url}{path}", content=data, headers={"content-type": "application/json"}, timeout=timeout)


def _error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _metric(url: str, route: str, status: int) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf'infer:http_requests_total\{{route="{re.escape(route)}",status="{status}"\}} ([\d.]+)', text)
    return float(m.group(1)) if m else 0.0


# ---------------------------------------------------------------------------------------------- size
def test_default_body_limit_is_8_mib():
    assert BodyLimits().max_body_size == DEFAULT_MAX_BODY_SIZE == 8 * 2**20


def test_body_over_the_limit_is_413_from_content_length(url):
    big = '{"prompt": "' + "a" * LIMIT + '"}'
    err = _error(_post(url, big), 413, code="request_too_large")
    assert f"{LIMIT:,} bytes" in err["message"]
    assert _post(url, '{"prompt": "' + "a " * 100 + '", "max_tokens": 2}').status_code == 200  # still serving


def test_chunked_body_over_the_limit_is_413(url):
    """No Content-Length: the bytes are counted as they arrive, and nothing past the limit is kept."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(2 * LIMIT // 4096):
            yield b"a" * 4096
        yield b'"}'
    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    _error(r, 413, code="request_too_large")
    before = _metric(url, "/v1/completions", 413)
    assert before >= 1  # counted like any other answer


# ---------------------------------------------------------------------------------------------- JSON
def test_json_depth_counts_only_brackets_outside_strings():
    assert json_depth(b'{"a": [[1], {"b": "[[[[{{{"}]}') == 3
    assert json_depth(b'"\\"[[["') == 0 and json_depth(b"[" * 5000) == 5000 and json_depth(b"") == 0


@pytest.mark.parametrize("depth", [DEPTH + 1, 5000, 30_000])
def test_deep_nesting_is_400(url, depth):
    for raw in ("[" * depth + "]" * depth, '{"prompt": "x", "stop": ' + "[" * depth + "]" * depth + "}",
                "[" * depth):  # unterminated too: refused for its depth, never parsed
        err = _error(_post(url, raw), 400, code="json_too_deep")
        assert f"the limit is {DEPTH}" in err["message"]


def test_nesting_at_the_limit_is_parsed(url):
    inner = "[" * (DEPTH - 1) + "]" * (DEPTH - 1)
    err = _error(_post(url, '{"prompt": "x", "stop": ' + inner + "}"), 400, param="stop")
    assert "stop" in err["message"]  # parsed, then refused by the stop check (not by depth)


@pytest.mark.parametrize("raw,param", [
    (r'{"prompt": "abc\ud800def"}', "prompt"),
    (r'{"prompt": ["ok", "x\udc80"]}', "prompt"),
    (r'{"prompt": "x", "model": "x\udc80"}', "model"),
    (r'{"prompt": "x", "stop": ["\udfff"]}', "stop"),
    (r'{"prompt": "x", "user": "\ud800"}', "user"),
])
def test_lone_surrogates_are_400_naming_the_field(url, raw, param):
    err = _error(_post(url, raw), 400, param=param)
    assert "surrogate" in err["message"] and param in err["message"]


def test_lone_surrogates_in_chat_messages(url):
    for raw in (r'{"messages": [{"role": "user", "content": "hi \ud83d"}]}',
                r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
                r'{"messages": [{"role": "us\udc00er", "content": "x"}]}'):
        err = _error(_post(url, raw, "/v1/chat/completions"), 400, param="messages")
        assert "surrogate" in err["message"]
    ok = r'{"messages": [{"role": "user", "content": "a pair is fine: \ud83d\ude00"}], "max_tokens": 2}'
    assert _post(url, ok, "/v1/chat/completions").status_code == 200


@pytest.mark.parametrize("field,value", [
    ("temperature", "Infinity"), ("temperature", "NaN"), ("temperature", "-Infinity"), ("temperature", "1e999"),
    ("repetition_penalty", "Infinity"), ("top_p", "NaN"), ("presence_penalty", "-1e400"),
    ("frequency_penalty", "Infinity"), ("n", "Infinity"), ("logit_bias", '{"5": NaN}'), ("user", "[1, NaN]"),
])
def test_non_finite_numbers_are_400_naming_the_field(url, field, value):
    err = _error(_post(url, f'{{"prompt": "x", "{field}": {value}}}'), 400, param=field)
    assert field in err["message"] and ("finite" in err["message"] or field in ("n", "logit_bias"))


@pytest.mark.parametrize("field,value", [("max_tokens", "9" * 5000), ("seed", str(2**70)), ("top_k", str(2**40)),
                                         ("max_tokens", "1e30"), ("logprobs", "-1")])
def test_huge_numbers_are_400(url, field, value):
    r = _post(url, f'{{"prompt": "x", "{field}": {value}}}')
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw", [b"", b"   ", b"\xff\xfe\x00garbage", b'{"prompt": "\xc3\x28"}', b"nul\x00l",
                                 b'{"prompt": "x"} trailing'])
def test_unreadable_bodies_are_400(url, raw):
    _error(_post(url, raw), 400)


# ---------------------------------------------------------------------------------------------- 500s
def test_an_unexpected_exception_is_a_500_body_and_counted(url, server, monkeypatch):
    def broken(model):
        raise KeyError("simulated bug")
    monkeypatch.setattr(server, "lora_for", broken)
    before = _metric(url, "/v1/completions", 500)
    r = _post(url, '{"prompt": "x", "max_tokens": 2}')
    err = r.json()["error"]
    assert r.status_code == 500 and err["type"] == "server_error" and "KeyError" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert _metric(url, "/v1/completions", 500) == before + 1
    monkeypatch.undo()
    assert _post(url, '{"prompt": "x", "max_tokens": 2}').status_code == 200


# ---------------------------------------------------------------------------------------------- the event loop
class _GatedTokenizer:
    """The real tokenizer, except that encoding waits until the test lets it go (and says when it started)."""

    def __init__(self, tokenizer):
        self._tok, self.entered, self.release = tokenizer, threading.Event(), threading.Event()

    def __call__(self, *a, **k):
        self.entered.set()
        assert self.release.wait(60), "the test never released the tokenizer"
        return self._tok(*a, **k)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_a_big_body_does_not_block_the_event_loop(engine):
    """A 5 MB body (under the default limit) is parsed, checked and tokenized on a worker thread: while it is held
    in the tokenizer, /health and a small completion are answered; then the big one gets its own answer."""
    server = Server(AsyncEngine(engine), "tiny-llama")
    gate = _GatedTokenizer(server.tokenizer)
    server.parser.tokenizer = gate
    filler = "lorem ipsum \u00e9 " * (5 * 2**20 // 14)  # carried in a field the server reads and checks
    big = f'{{"prompt": "the rain in spain", "max_tokens": 2, "user": "{filler}"}}'
    assert 5 * 2**20 <= len(big.encode()) < DEFAULT_MAX_BODY_SIZE
    result = {}
    with serve_in_thread(server) as url:
        t = threading.Thread(target=lambda: result.setdefault("r", _post(url, big)))
        t.start()
        try:
            assert gate.entered.wait(60), "the big request never reached the tokenizer"
            health = httpx.get(f"{url}/health", timeout=10)  # would time out if the loop were blocked
            assert health.status_code == 200 and "r" not in result
            small = _post(url, '{"prompt": [1, 2, 3], "max_tokens": 2}', timeout=10)  # token ids: no tokenizer
            assert small.status_code == 200 and "r" not in result
        finally:
            gate.release.set()
            t.join(120)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------------------- --max-model-len
def test_max_model_len_that_does_not_fit_names_the_largest_that_does():
    """Issue 16: `--memory-limit 16MB --max-model-len 1024` said 'estimated maximum model length is 0', though the
    same budget serves a shorter length (activations shrink with it). Now it names the largest that fits."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.errors import OutOfMemoryError
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--memory-limit", "16MB",
                                   "--max-model-len", "1024"])
    assert res.exit_code == 2, res.output
    m = re.search(r"estimated maximum model length is (\d+)", res.output)
    fit = int(m.group(1))
    assert 16 < fit < 1024 and f"--max-model-len {fit}" in res.output
    engine = LLMEngine(EngineConfig("tiny-llama", memory_limit="16MB", max_model_len=fit))
    assert engine.memory_plan.kv_blocks >= engine.memory_plan.blocks_for(fit)
    with pytest.raises(OutOfMemoryError, match=f"estimated maximum model length is {fit}"):
        LLMEngine(EngineConfig("tiny-llama", memory_limit="16MB", max_model_len=fit + 1))
