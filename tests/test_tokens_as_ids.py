"""vLLM's return_tokens_as_token_ids (a completions or chat body's field, the server's --return-tokens-as-token-ids,
an OpenAI batch line's body field): each logprobs token is "token_id:ID" instead of its text, so a client can map
logprobs back to ids (a token whose bytes are not UTF-8 alone decodes to U+FFFD otherwise)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, create_app  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

AS_ID = re.compile(r"token_id:(\d+)")
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, chat_template=TEMPLATE))
    yield e
    e.close()


def _ids(tokens: list[str]) -> list[int]:
    assert all(AS_ID.fullmatch(t) for t in tokens), tokens
    return [int(AS_ID.fullmatch(t).group(1)) for t in tokens]


def _client(engine, **kw) -> TestClient:
    return TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama", **kw)))


def test_completions_and_chat_name_tokens_by_id(engine):
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with _client(engine) as client:
        r = client.post("/v1/completions", json={**body, "prompt": "hello", "logprobs": 2,
                                                 "return_tokens_as_token_ids": True})
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert _ids(lp["tokens"]) == choice["token_ids"]
        assert all(_ids(list(top)) and tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
        offsets = [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(lp["tokens"]))]
        assert lp["text_offset"] == offsets  # counted in the token strings, as vLLM counts them
        plain = client.post("/v1/completions", json={**body, "prompt": "hello", "logprobs": 2}).json()
        assert plain["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]
        assert not any(AS_ID.fullmatch(t) for t in plain["choices"][0]["logprobs"]["tokens"])

        chat = {**body, "messages": [{"role": "user", "content": "hello"}], "logprobs": True, "top_logprobs": 2,
                "return_tokens_as_token_ids": True}
        choice = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert _ids([e["token"] for e in content]) == choice["token_ids"]
        assert all(e["bytes"] == list(e["token"].encode()) for e in content)
        assert all(_ids([t["token"] for t in e["top_logprobs"]]) for e in content)
        lines = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json={**chat, "stream": True})
                 .text.splitlines() if line.startswith("data: {")]
        streamed = [e["token"] for c in lines for ch in c["choices"] for e in (ch.get("logprobs") or {}).get(
            "content", [])]
        assert streamed == [e["token"] for e in content]
        r = client.post("/v1/completions", json={**body, "prompt": "hi", "return_tokens_as_token_ids": "yes"})
        assert r.status_code == 400 and "return_tokens_as_token_ids" in r.text


def test_the_servers_option_names_every_requests_tokens_by_id(engine):
    with _client(engine, tokens_as_ids=True) as client:
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "logprobs": 1,
                                                 "return_token_ids": True, "ignore_eos": True})
        choice = r.json()["choices"][0]
        assert _ids(choice["logprobs"]["tokens"]) == choice["token_ids"]


def test_infer_serve_passes_the_option(monkeypatch):
    from typer.testing import CliRunner

    from infer.cli.main import app
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **kw: seen.update(kw))
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--return-tokens-as-token-ids"])
    assert res.exit_code == 0, res.output
    assert seen["tokens_as_ids"] is True


def test_a_batch_lines_logprobs_name_tokens_by_id(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {
        "prompt": "hello", "max_tokens": 3, "logprobs": 1, "ignore_eos": True, "return_token_ids": True,
        "return_tokens_as_token_ids": True}}) + "\n")
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--output-format", "openai"])
    assert res.exit_code == 0, res.output
    choice = json.loads(out.read_text())["response"]["body"]["choices"][0]
    assert _ids(choice["logprobs"]["tokens"]) == choice["token_ids"]
