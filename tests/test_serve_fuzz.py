"""Fuzz the server's request path (issue 16): random bytes, random JSON shaped like OpenAI bodies, deep nesting,
lone surrogates, NaN/Infinity and huge numbers. The parser either accepts a body or raises a 4xx ApiError with an
OpenAI-style body; over HTTP nothing is ever a 5xx and every error has the OpenAI shape."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")  # the serve extra
pytest.importorskip("fastapi")

from infer.serve.body import BodyLimits
from infer.serve.parse import parse_body
from infer.serve.protocol import ApiError, GenerationRequest

KEYS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stop",
        "seed", "logprobs", "top_logprobs", "stream", "stream_options", "model", "logit_bias", "user", "echo",
        "response_format", "repetition_penalty", "stop_token_ids", "ignore_eos", "return_token_ids", "role",
        "content", "type", "text", "include_usage", "max_length"]
LIMITS = BodyLimits(max_body_size=1 << 20, max_json_depth=32)

scalars = (st.none() | st.booleans() | st.floats() | st.integers() | st.integers(min_value=2**62)
           | st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "\U0001f600", "", "user", "text"]))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(KEYS), c,
                                                                                   max_size=5), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", 5]),
                                           "content": values}), max_size=3)
bodies = st.fixed_dictionaries({}, optional={k: (messages if k == "messages" else values) for k in KEYS[:20]})


def _dump(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=True).encode()  # lone surrogates travel as \\udxxx escapes


raw_bodies = st.one_of(
    bodies.map(_dump),
    values.map(_dump),
    st.binary(max_size=64),
    st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.integers(1, 3000).map(lambda n: b'{"prompt": "x", "stop": ' + b"[" * n + b"]" * n + b"}"),
    st.integers(1, 3000).map(lambda n: b"{\"a\":" * n + b"1" + b"}" * n),
    st.sampled_from([b"9" * 5000, b'{"max_tokens": 1' + b"0" * 4400 + b"}", b'{"temperature": 1e999}',
                     b'{"prompt": "x", "top_p": NaN}', b'{"prompt": "x", "seed": -Infinity}', b"\xef\xbb\xbf{}"]),
    bodies.map(_dump).flatmap(lambda b: st.integers(0, len(b)).map(lambda i: b[:i])),  # torn bodies
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from infer.models.tiny import ensure_builtin
    return AutoTokenizer.from_pretrained(ensure_builtin("tiny-llama"))


def _check_error(e: ApiError) -> None:
    assert 400 <= e.status < 500, (e.status, e.message)
    body = e.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and isinstance(body["message"], str) and body["message"]
    assert body["param"] is None or isinstance(body["param"], str)
    json.dumps(e.body(), ensure_ascii=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(raw=raw_bodies, chat=st.booleans())
def test_fuzz_parser_never_raises_anything_but_a_4xx(tokenizer, raw, chat):
    try:
        req = parse_body(raw, chat, tokenizer, LIMITS)
    except ApiError as e:
        _check_error(e)
    else:
        assert isinstance(req, GenerationRequest) and req.prompts
        assert all(isinstance(t, int) for p in req.prompts for t in p)


# ---------------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def url():
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, max_num_seqs=8))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama", limits=LIMITS)) as base:
        yield base


def _short(raw: bytes) -> bytes:
    """Keep generation short (the fuzz is about parsing): cap any integer max_tokens at 4."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    if isinstance(obj, dict):
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(obj.get(k), int) and not isinstance(obj[k], bool) and obj[k] > 4:
                obj[k] = 4
        obj.setdefault("max_tokens", 4)
        return _dump(obj)
    return raw


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(raw=raw_bodies.map(_short), chat=st.booleans())
def test_fuzz_http_never_5xx(url, raw, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, r.text
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
        return
    body = r.json()
    if r.status_code != 200:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


def test_fuzz_left_nothing_behind(url):
    async def idle():
        async with httpx.AsyncClient(base_url=url) as c:
            for _ in range(500):
                s = (await c.get("/health")).json()["engine"]
                if not (s["num_running"] or s["num_waiting"] or s["num_in_flight"]):
                    return s, (await c.get("/metrics")).text
                await asyncio.sleep(0.02)
            return s, ""
    stats, metrics = asyncio.run(idle())
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0, stats
    assert 'status="5' not in metrics
