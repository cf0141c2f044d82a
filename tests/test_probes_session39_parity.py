"""Probes of vLLM parity, session 39: a tool whose function.parameters is null (a function without parameters,
which vLLM and OpenAI's SDK accept) was a 400; a forced tool call or response_format combined with min_tokens (or
another field a constraint cannot run with) was refused in the words of structured_outputs, a field the client never
sent."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
NAMED = {"type": "function", "function": {"name": "ping"}}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=256, block_size=4, max_num_seqs=4))


@pytest.fixture(scope="module")
def base(engine):
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=64), "tiny")) as url:
        yield url


@pytest.mark.parametrize("tool_choice", ["none", "required", NAMED])
def test_a_tool_whose_parameters_are_null_is_a_function_without_parameters(base, tool_choice):
    tools = [{"type": "function", "function": {"name": "ping", "description": "no arguments", "parameters": None}}]
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 24, "tools": tools,
                                                         "tool_choice": tool_choice}, timeout=60)
    assert r.status_code == 200, r.text
    if tool_choice == NAMED:
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "ping" and call["arguments"].startswith("{")


@pytest.mark.parametrize("tool_choice, words", [(NAMED, "tool_choice (function 'ping')"),
                                                 ("required", "tool_choice 'required'")])
@pytest.mark.parametrize("field, value", [("min_tokens", 4), ("ignore_eos", True)])
def test_a_forced_tool_call_that_conflicts_names_tool_choice(base, tool_choice, words, field, value):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "tools": tools,
                                                         "tool_choice": tool_choice, field: value}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice"
    assert "structured_outputs" not in error["message"]
    assert error["message"].startswith(f"{words} cannot be combined with {field}")


def test_response_format_that_conflicts_names_response_format(base):
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "min_tokens": 2,
                                                         "response_format": {"type": "json_object"}}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"].startswith("response_format cannot be combined with min_tokens"), error["message"]


# ----------------------------------------------------------------------------- --served-model-name A B (vLLM nargs +)
@pytest.mark.parametrize("args, names", [
    (["tiny-llama", "--served-model-name", "a", "b"], ["a", "b"]),
    (["tiny-llama", "--served-model-name", "a", "b", "--port", "0"], ["a", "b"]),
    (["--served-model-name", "a", "b", "tiny-llama", "--port", "0"], ["a", "b"]),
    (["--served-model-name", "a", "tiny-llama"], ["a"]),
    (["tiny-llama", "--served-model-name", "a", "--served-model-name", "b", "--served-model-name", "a"], ["a", "b"]),
    (["tiny-llama"], ["tiny-llama"]),
])
def test_serve_takes_several_served_model_names(monkeypatch, args, names):
    from typer.testing import CliRunner

    from infer.cli.main import app
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda cfg, sock, host, ids, *a, **k: seen.update(ids=ids,
                                                                                                   model=cfg.model))
    if "--port" not in args:
        args = [*args, "--port", "0"]
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 0, result.output
    assert seen == {"ids": names, "model": "tiny-llama"}


def test_a_server_with_several_ids_answers_to_each_and_lists_them(engine):
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=8), ["first", "second"])) as url:
        cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [c["id"] for c in cards] == ["first", "second"]
        for model, reported in (("second", "second"), ("first", "first"), (None, "first")):
            body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == reported
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "third"}, timeout=60)
        assert r.status_code == 404 and "first, second" in r.json()["error"]["message"], r.text
