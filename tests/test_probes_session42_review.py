"""Session 42, review of session 41's code: `infer run --output-format openai`, generation_config caps, hub ids
from the local cache, convert/quantize output folders."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


def _write(path, lines) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _records(path) -> dict:
    return {r["custom_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_a_batch_lines_max_tokens_past_the_context_is_a_400_as_the_server_answers_it(tmp_path):
    """vllm run-batch (and infer serve) answer a body whose max_tokens the context cannot hold with a 400
    (context_length_exceeded); `infer run` generated up to the context and wrote a 200 with a shorter reply."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, [{"custom_id": "big", "url": "/v1/completions",
                  "body": {"prompt": "hello there", "max_tokens": 200, "temperature": 0, "ignore_eos": True}},
                 {"custom_id": "ok", "url": "/v1/completions",
                  "body": {"prompt": "hello there", "max_tokens": 3, "temperature": 0}},
                 {"custom_id": "default", "url": "/v1/completions",  # no max_tokens: --max-new-tokens, cut
                  "body": {"prompt": "hello there", "temperature": 0}}])
    res = runner.invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "--output-format", "openai",
                              "--max-model-len", "32", "--max-new-tokens", "40", "-q"])
    recs = _records(out)
    assert res.exit_code == 1, res.output
    assert recs["big"]["response"]["status_code"] == 400
    assert "body.max_tokens asks for 200" in recs["big"]["error"]["message"]
    assert recs["ok"]["response"]["status_code"] == 200
    assert recs["default"]["response"]["status_code"] == 200


def test_convert_into_a_mounted_volumes_root_leaves_its_lost_found_and_fills_it(tmp_path):
    """An ext4 volume mounted as -o (the case filling an existing folder in place is for) holds lost+found, owned by
    root: the folder was 'not empty', and with --overwrite 'holds no model'; it could never be written to."""
    vol = tmp_path / "vol"
    (vol / "lost+found").mkdir(parents=True)
    res = runner.invoke(app, ["convert", "tiny-llama", "-o", str(vol)])
    assert res.exit_code == 0, res.output
    assert (vol / "config.json").is_file() and (vol / "lost+found").is_dir()
    res = runner.invoke(app, ["convert", "tiny-llama", "-o", str(vol), "--overwrite"])  # replaced, lost+found kept
    assert res.exit_code == 0, res.output
    assert (vol / "config.json").is_file() and (vol / "lost+found").is_dir()


def test_a_chat_without_max_tokens_is_capped_by_generation_config_not_refused_past_the_context(tmp_path):
    """generation_config.json's max_new_tokens caps a chat that gives no max_tokens, as vLLM's get_max_tokens takes
    the least of the cap and the context's room; the server read the cap as if the client had asked for it and
    answered 400 'max_tokens asks for 50 more' to a request that sent no max_tokens."""
    import shutil

    import pytest
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.models.tiny import ensure_builtin
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    model = tmp_path / "m"
    shutil.copytree(ensure_builtin("tiny-llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 50, "temperature": 0}))
    engine = LLMEngine(EngineConfig(str(model), max_model_len=64))
    chat = [{"role": "user", "content": "tell me a long story about the weather in spain please"}]
    with TestClient(create_app(Server(AsyncEngine(engine), "m"))) as client:
        r = client.post("/v1/chat/completions", json={"messages": chat, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + 50 > 64 and usage["completion_tokens"] <= 64 - usage["prompt_tokens"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 60})  # asked: still a 400
        assert r.status_code == 400 and "max_tokens" in r.text


def test_a_batch_lines_min_tokens_past_the_context_is_a_400_as_the_server_answers_it(tmp_path):
    """A chat line without max_tokens whose min_tokens the context cannot hold: the server answers 400 naming
    min_tokens; `infer run` wrote a 200 whose reply fell short of the min_tokens it asked for."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = [{"role": "user", "content": "hi"}]
    _write(src, [{"custom_id": "least", "url": "/v1/chat/completions",
                  "body": {"messages": chat, "min_tokens": 40, "temperature": 0}}])
    res = runner.invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "--output-format", "openai",
                              "--max-model-len", "32", "--max-new-tokens", "48", "-q"])
    rec = _records(out)["least"]
    assert res.exit_code == 1, res.output
    assert rec["response"]["status_code"] == 400 and "body.min_tokens (40)" in rec["error"]["message"]
