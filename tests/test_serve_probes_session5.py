"""`infer serve` against requests found by probing as a hostile client (session 5): an explicit `max_tokens: null`,
a prompt list larger than --max-queue, vLLM's `top_k: -1`, and stop lists so long that checking them would stall
the engine thread for every other request."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine

MAX_LEN = 256
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=MAX_LEN))


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=MAX_QUEUE), "tiny-llama")) as base:
        yield base


def _error(r, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    return err["message"]


def _chat(content: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


def test_explicit_null_max_tokens_means_not_given(url):
    """OpenAI clients send `"max_tokens": null`: chat then runs up to the context (here ignore_eos makes it fill
    the context), completions take OpenAI's default of 16; neither is a 400."""
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat("hi", max_tokens=None, ignore_eos=True), timeout=60)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == MAX_LEN
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat("hi", max_completion_tokens=None, max_tokens=3))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


def test_max_completion_tokens_supersedes_max_tokens_in_either_order(url):
    """OpenAI deprecated max_tokens for max_completion_tokens: given both, the latter counts, wherever it sits in
    the body; a bad value is reported under the name the client sent."""
    for body in (_chat("hi", max_completion_tokens=2, max_tokens=5, ignore_eos=True),
                 _chat("hi", max_tokens=5, max_completion_tokens=2, ignore_eos=True)):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for key in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat("hi", **{key: 0}), timeout=60)
        message = _error(r, 400, key)
        assert message.startswith(f"{key} must be in 1..") and "max_new_tokens" not in message


@pytest.mark.parametrize("messages,says", [({"role": "user", "content": "hi"}, "got a dict"), ([], "got an empty list"),
                                            ("hi", "got a str")])
def test_messages_that_are_not_a_list_are_named_as_such(url, messages, says):
    """`"messages": {...}` (one message, not a list) was told "missing required field 'messages'"."""
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages}, timeout=60)
    msg = _error(r, 400, "messages")
    assert "must be a non-empty list of message objects" in msg and says in msg and "missing" not in msg
    assert "missing required field 'messages'" in _error(httpx.post(f"{url}/v1/chat/completions", json={}), 400,
                                                         "messages")


@pytest.mark.parametrize("logprobs", [21, 100, -1])
def test_completion_logprobs_out_of_range_says_one_range(url, logprobs):
    """logprobs 6..20 said "0..5" but 21 and up said "0..20" (the engine's own range, chat's top_logprobs); the range
    is vLLM's 0..20 now (session 43: OpenAI's legacy 0..5 refused a vLLM client's logprobs 10)."""
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": logprobs}, timeout=60)
    assert _error(r, 400, "logprobs").startswith(f"logprobs must be in 0..20, got {logprobs}")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 10}, timeout=60)
    assert r.status_code == 200, r.text  # (top tokens that decode to the same text share one key of OpenAI's dict)
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert 6 <= len(tops) <= 11, r.text  # the sampled one too; more than OpenAI's legacy 5 (+1)


def test_more_prompts_than_the_server_can_hold_is_400_not_a_retry(url, engine):
    """A 503 with Retry-After tells the client to retry, which can never succeed for this body: one of more prompts
    than the running slots and --max-queue together (session 41: the limit was --max-queue alone, though prompts
    the free slots start at once do not wait)."""
    most = MAX_QUEUE + engine.config.max_num_seqs
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a"] * (most + 1), "max_tokens": 2})
    message = _error(r, 400, "prompt")
    assert str(most + 1) in message and "--max-queue" in message and "--max-num-seqs" in message
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a"] * most, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == most, r.text


def test_top_k_minus_one_is_off_as_in_vllm(url):
    # sampled with one seed: top_k -1 gives what no top_k gives (and a top_k of 1, greedy, would differ)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8, "top_k": -1, "seed": 5})
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8, "seed": 5})
    one = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8, "seed": 5, "top_k": 1})
    assert one.json()["choices"][0]["text"] != plain.json()["choices"][0]["text"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert "top_k" in _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "top_k": -2}), 400, "top_k")


def test_stop_lists_are_bounded(url):
    """Every stop string is searched after every token on the one engine thread: 500,000 of them (6 MB, under the
    body limit) made each step of every request 0.25 s slower. The lists are capped and the cap is named."""
    many = ["zq%06d" % i for i in range(MAX_STOP_STRINGS + 1)]
    message = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop": many}), 400, "stop")
    assert str(MAX_STOP_STRINGS) in message
    ids = list(range(MAX_STOP_TOKEN_IDS + 1))
    message = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop_token_ids": ids}), 400,
                     "stop_token_ids")
    assert str(MAX_STOP_TOKEN_IDS) in message
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": many[:-1],
                                                  "stop_token_ids": ids[:-1]})
    assert r.status_code == 200, r.text
    health = httpx.get(f"{url}/health").json()["engine"]
    assert health["num_running"] == 0 and health["kv_blocks_used"] == 0


@pytest.mark.parametrize("args,message", [(["--api-key", ""], "--api-key is empty"),
                                          (["--api-key", "  "], "--api-key is empty"),
                                          (["--shutdown-timeout", "nan"], "--shutdown-timeout must be >= 0"),
                                          (["--host", ""], "--host is empty")])
def test_server_options_that_would_lock_out_clients_or_abort_on_sigterm(monkeypatch, args, message):
    """An empty key (an unset variable) left a server no client could use, an empty host listened on every
    interface, and a NaN timeout aborted everything on SIGTERM."""
    from typer.testing import CliRunner

    from infer.cli import serve as serve_cli
    from infer.cli.main import app
    monkeypatch.setattr(serve_cli, "_bind", lambda *a: (_ for _ in ()).throw(AssertionError("bound")))
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", *args])
    assert res.exit_code == 2 and message in res.output and "hint:" in res.output, res.output


@pytest.mark.parametrize("name,extra", [("tiny-llama", []), ("base", ["--served-model-name", "base"])])
def test_an_adapter_named_like_the_served_model_is_refused(tmp_path, monkeypatch, name, extra):
    """`--lora tiny-llama=...` served: every request naming tiny-llama ran the base, the adapter never."""
    from typer.testing import CliRunner

    from infer.cli import serve as serve_cli
    from infer.cli.main import app
    monkeypatch.setattr(serve_cli, "_bind", lambda *a: (_ for _ in ()).throw(AssertionError("bound")))
    adapter = tmp_path / "ad"
    adapter.mkdir()
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--lora", f"{name}={adapter}", *extra])
    assert res.exit_code == 2 and f"--lora name {name!r} is the served model's id" in res.output, res.output
