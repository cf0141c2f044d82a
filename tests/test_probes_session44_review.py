"""Session 44 review probes: this session's commits read against vLLM's behaviour and against each other (Python API,
server, `infer run` lines, data-parallel paths)."""

from __future__ import annotations

import pytest

from infer import LLM
from infer.errors import ConfigError


def test_llm_max_cpu_loras_alone_lowers_the_default_slots_as_the_commands_do():
    """`infer serve --enable-lora --max-cpu-loras 2` runs with 2 slots, and so does vLLM's LLM(enable_lora=True,
    max_cpu_loras=2) (its default max_loras is 1); LLM(...) refused it as "below --max-loras 4", a value nobody
    gave."""
    opts = dict(enable_lora=True, max_lora_rank=8, max_model_len=64, block_size=4)
    with LLM("tiny-llama", max_cpu_loras=2, **opts) as llm:
        assert (llm.llm_engine.config.max_loras, llm.llm_engine.config.max_cpu_loras) == (2, 2)
    with LLM("tiny-llama", max_cpu_loras=8, **opts) as llm:
        assert (llm.llm_engine.config.max_loras, llm.llm_engine.config.max_cpu_loras) == (4, 8)
    with pytest.raises(ConfigError, match="--max-cpu-loras 2 is below --max-loras 3"):
        LLM("tiny-llama", max_loras=3, max_cpu_loras=2, **opts)  # both given: still refused, as vLLM does


def test_async_llm_max_cpu_loras_alone_lowers_the_default_slots_too():
    """vLLM's AsyncLLM takes LLM's options: AsyncLLM(enable_lora=True, max_cpu_loras=2) was refused as below the
    default max_loras (4), as LLM(...) was."""
    from infer import AsyncLLM
    with AsyncLLM("tiny-llama", enable_lora=True, max_lora_rank=8, max_model_len=64, block_size=4,
                  max_cpu_loras=2) as engine:
        assert (engine.engine.config.max_loras, engine.engine.config.max_cpu_loras) == (2, 2)


def test_bench_url_takes_seed_which_seeds_the_workload():
    """`infer bench --url URL --seed 3`: the seed draws the random prompts and the Poisson arrivals sent to the
    server (as vllm bench serve's --seed does); it was refused as an in-process engine option ("--seed set the
    in-process engine, which --url does not run"). An engine option proper is still refused."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    base = ["bench", "tiny-llama", "--url", "http://127.0.0.1:9", "-q"]
    res = CliRunner().invoke(app, [*base, "--seed", "3"])
    assert "in-process engine" not in res.output and "cannot reach http://127.0.0.1:9" in res.output, res.output
    res = CliRunner().invoke(app, [*base, "--block-size", "8"])
    assert "--block-size set the in-process engine" in res.output, res.output


def test_a_bodys_return_tokens_as_token_ids_false_overrides_the_servers_option():
    """vLLM reads a body's return_tokens_as_token_ids when it is sent (false too) and --return-tokens-as-token-ids
    only when it is not: a client of such a server that asks for false gets the tokens' text. infer ORed them, so
    the server's option could not be turned off by a request."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4))
    body = {"prompt": "hello", "max_tokens": 3, "logprobs": 1, "ignore_eos": True, "temperature": 0}
    try:
        with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama", tokens_as_ids=True))) as client:
            def tokens(**kw) -> list[str]:
                r = client.post("/v1/completions", json={**body, **kw})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["logprobs"]["tokens"]
            assert all(t.startswith("token_id:") for t in tokens())
            assert all(t.startswith("token_id:") for t in tokens(return_tokens_as_token_ids=None))
            text = tokens(return_tokens_as_token_ids=False)
            assert not any(t.startswith("token_id:") for t in text)
            assert text == [engine.tokenizer.decode([int(t[9:])]) for t in tokens()]
    finally:
        engine.close()


def test_responses_logprobs_follow_the_servers_return_tokens_as_token_ids():
    """vLLM's /v1/responses names its logprobs' tokens token_id:ID on a server started with
    --return-tokens-as-token-ids, as its chat and completions do; infer's /v1/responses gave their text."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, chat_template=template))
    body = {"input": "hi", "max_output_tokens": 3, "include": ["message.output_text.logprobs"], "top_logprobs": 1,
            "ignore_eos": True, "temperature": 0}
    try:
        for as_ids in (True, False):
            with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama", tokens_as_ids=as_ids))) as client:
                r = client.post("/v1/responses", json=body)
                assert r.status_code == 200, r.text
                lp = r.json()["output"][0]["content"][0]["logprobs"]
                assert len(lp) == 3
                tokens = [x["token"] for x in lp] + [t["token"] for x in lp for t in x["top_logprobs"]]
                assert all(t.startswith("token_id:") for t in tokens) == as_ids, tokens
                assert not as_ids or all(x["bytes"] == list(x["token"].encode()) for x in lp)
    finally:
        engine.close()


def test_responses_max_output_tokens_takes_a_whole_float_as_chats_max_tokens_does():
    """A whole float in an integer field is that integer (vLLM's pydantic models read them so; chat's max_tokens 3.0
    is taken): /v1/responses' max_output_tokens 3.0 was a 400 "must be integer, got float"; 3.5 stays a 400."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, chat_template=template))
    try:
        with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama"))) as client:
            r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["output_tokens"] == 3 and r.json()["max_output_tokens"] == 3
            r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3.5})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
    finally:
        engine.close()
