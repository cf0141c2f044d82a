"""Probes of vLLM's --enable-prompt-tokens-details (session 53): usage.prompt_tokens_details.cached_tokens in
completions and chat responses (whole and streamed) is the prompt tokens a real prefix-cache hit found, filled as
vLLM fills it (null without a hit, left out of a streamed usage chunk then; the last prompt's for a batch of
prompts), and only with the option."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers import Stopped, stub_calls  # noqa: E402

PROMPT = list(range(5, 45))  # 40 tokens, blocks of 4: a repeat finds 36 of them cached (the last is computed)


def _server(details: bool):
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=128))
    return Server(AsyncEngine(engine), "tiny", prompt_tokens_details=details)


@pytest.fixture(scope="module")
def url():
    from infer.serve.app import serve_in_thread
    with serve_in_thread(_server(True)) as base:
        yield base


def _post(base: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _completion(prompt, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "temperature": 0, **extra}


def test_a_repeated_prompt_reports_its_cached_tokens_and_a_cold_one_null(url):
    """The same prompt sent twice: the first found nothing in the cache (prompt_tokens_details null, as vLLM's
    whole response), the second 36 tokens (9 blocks of 4; the last token is always computed)."""
    cold = _post(url, "/v1/completions", _completion(PROMPT))["usage"]
    warm = _post(url, "/v1/completions", _completion(PROMPT))["usage"]
    assert cold["prompt_tokens_details"] is None and cold["prompt_tokens"] == 40
    assert warm["prompt_tokens_details"] == {"cached_tokens": 36}
    assert warm["prompt_tokens"] == 40 and warm["total_tokens"] == 43


def test_chat_reports_the_cached_tokens_of_a_repeated_conversation(url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a story about " + "a cat " * 12}],
            "max_tokens": 2, "temperature": 0}
    # (the chat template's first tokens, another test's chat may have cached: under --dist worksteal a module's
    # tests may run in another order)
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=60).status_code == 200
    first = _post(url, "/v1/chat/completions", body)["usage"]
    again = _post(url, "/v1/chat/completions", body)["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens_details"] is None
    assert cached == (again["prompt_tokens"] - 1) // 4 * 4 > 0


def test_a_streamed_usage_chunk_carries_the_cached_tokens_and_leaves_out_a_null(url):
    """stream_options.include_usage: the last chunk's usage has them (vLLM's); a cold prompt's chunk has no
    prompt_tokens_details (vLLM's final chunk drops its nulls); continuous usage chunks never carry them."""
    prompt = list(range(200, 240))
    opts = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    cold = _stream(url, "/v1/completions", _completion(prompt, **opts))
    warm = _stream(url, "/v1/completions", _completion(prompt, **opts))
    assert "prompt_tokens_details" not in cold[-1]["usage"] and cold[-1]["choices"] == []
    assert warm[-1]["choices"] == [] and warm[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 36}
    assert all("prompt_tokens_details" not in c["usage"] for c in warm[:-1])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a stream about " + "a dog " * 12}],
            "max_tokens": 2, "temperature": 0, "stream_options": {"include_usage": True}}
    _stream(url, "/v1/chat/completions", chat)
    again = _stream(url, "/v1/chat/completions", chat)[-1]["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == (again["prompt_tokens"] - 1) // 4 * 4 > 0


def test_a_batch_of_prompts_reports_the_last_prompts_cached_tokens(url):
    """As vLLM's completions: one usage for the batch, whose cached tokens are the last prompt's."""
    warm_first = list(range(300, 340))
    _post(url, "/v1/completions", _completion(warm_first))
    usage = _post(url, "/v1/completions", _completion([warm_first, list(range(400, 440))]))["usage"]
    assert usage["prompt_tokens"] == 80 and usage["prompt_tokens_details"] is None  # the last one was cold
    usage = _post(url, "/v1/completions", _completion([list(range(450, 490)), warm_first]))["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 36}


def test_n_choices_and_echo_report_the_prompts_cached_tokens_once(url):
    prompt = list(range(50, 90))
    _post(url, "/v1/completions", _completion(prompt))
    usage = _post(url, "/v1/completions", _completion(prompt, n=3, echo=True, temperature=1.0, seed=1))["usage"]
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 9
    assert usage["prompt_tokens_details"] == {"cached_tokens": 36}


def test_without_the_option_usage_has_no_prompt_tokens_details():
    from infer.serve.app import serve_in_thread
    with serve_in_thread(_server(False)) as base:
        _post(base, "/v1/completions", _completion(PROMPT))
        usage = _post(base, "/v1/completions", _completion(PROMPT))["usage"]
        streamed = _stream(base, "/v1/completions", _completion(PROMPT, stream_options={"include_usage": True}))
    assert "prompt_tokens_details" not in usage and "prompt_tokens_details" not in streamed[-1]["usage"]


@pytest.mark.parametrize("argv, env, want", [([], {}, False), (["--enable-prompt-tokens-details"], {}, True),
                                             ([], {"INFER_ENABLE_PROMPT_TOKENS_DETAILS": "1"}, True)])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_option_reaches_both_servers(argv, env, want, parallel, monkeypatch):
    from typer.testing import CliRunner

    from infer.cli.main import app
    seen = stub_calls(monkeypatch, "infer.cli.serve._serve", "infer.cli.serve_parallel.serve_data_parallel")
    monkeypatch.delenv("INFER_ENABLE_PROMPT_TOKENS_DETAILS", raising=False)
    dp = ["--data-parallel", "2", "--ray-address", "127.0.0.1:1"] if parallel else []
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", *dp, *argv], env=env)
    assert isinstance(result.exception, Stopped), result.output
    assert seen["prompt_tokens_details"] is want


def _batch(tmp_path, *extra) -> tuple:
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    inp.write_text("".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/completions", "body": body})
                           + "\n" for c in ("a", "b")))
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--block-size", "4",
                                   "--max-num-seqs", "1", *extra])
    return res, out


def test_an_openai_batch_runs_usage_reports_the_cached_tokens_as_the_server(tmp_path):
    """`infer run --output-format openai --enable-prompt-tokens-details` (vllm run-batch's option): the same prompt
    on two lines, one at a time: the second line's body reports the 36 tokens its prompt found cached."""
    res, out = _batch(tmp_path, "--output-format", "openai", "--enable-prompt-tokens-details")
    assert res.exit_code == 0, res.output
    usage = {r["custom_id"]: r["response"]["body"]["usage"] for r in map(json.loads, out.read_text().splitlines())}
    assert usage["a"]["prompt_tokens_details"] is None
    assert usage["b"]["prompt_tokens_details"] == {"cached_tokens": 36}
    res, out = _batch(tmp_path, "--output-format", "openai")  # without the option: no such field
    assert res.exit_code == 0, res.output
    assert all("prompt_tokens_details" not in json.loads(line)["response"]["body"]["usage"]
               for line in out.read_text().splitlines())


def test_the_batch_option_without_openai_output_is_refused(tmp_path):
    res, _ = _batch(tmp_path, "--enable-prompt-tokens-details")
    assert res.exit_code == 2 and "--output-format openai" in res.output
