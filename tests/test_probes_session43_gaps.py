"""Probes of session 43 (gaps): option pairs vLLM refuses, /detokenize's bound, errors that name the flag typed, the
order of the context check and generation_config's cap, request ids that are not strings."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.engine.config import EngineConfig
from infer.errors import ConfigError

runner = CliRunner()


def _said(res) -> str:
    return " ".join(res.output.split())


# ------------------------------------------------------------------ --max-num-batched-tokens below --max-num-seqs
def test_fewer_batched_tokens_than_sequences_is_refused_naming_both():
    """vLLM's SchedulerConfig refuses max_num_batched_tokens < max_num_seqs (infer always chunks prefills, so that is
    its only bound); infer took it, and a step could not give every running sequence its decode token."""
    with pytest.raises(ConfigError, match=r"--max-num-batched-tokens \(4\) is below --max-num-seqs \(8\)") as e:
        EngineConfig("tiny-llama", max_num_batched_tokens=4, max_num_seqs=8)
    assert "raise --max-num-batched-tokens to 8 or more, or lower --max-num-seqs to 4" in e.value.hint
    assert EngineConfig("tiny-llama", max_num_batched_tokens=8, max_num_seqs=8).max_num_seqs == 8


@pytest.mark.parametrize("command", ["run", "serve"])
def test_run_and_serve_refuse_fewer_batched_tokens_than_sequences(tmp_path, command, monkeypatch):
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **kw: pytest.fail("the server started"))
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    argv = ["run", "tiny-llama", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")] \
        if command == "run" else ["serve", "tiny-llama", "--port", "0"]
    res = runner.invoke(app, [*argv, "--max-num-batched-tokens", "4", "--max-num-seqs", "8"])
    assert res.exit_code != 0 and "--max-num-batched-tokens (4) is below --max-num-seqs (8)" in _said(res), res.output


def test_warmup_names_its_concurrency_and_takes_a_budget_of_its_own_size():
    res = runner.invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-num-batched-tokens", "8",
                              "--concurrency", "16"])
    assert res.exit_code == 2 and "is below --concurrency (16)" in _said(res), res.output
    # --max-num-batched-tokens below the engine's default --max-num-seqs (64), which warmup does not use: fits, and
    # the room figures above the asked concurrency (engines of more sequences than 32 tokens) are still worked out
    res = runner.invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-num-batched-tokens", "32",
                              "--concurrency", "4", "--max-length", "256", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output.strip().splitlines()[-1])
    assert plan["fits"] and plan["max_concurrency_at_max_length"] >= 4


def test_warmups_fitting_token_budget_is_never_below_its_concurrency():
    res = runner.invoke(app, ["warmup", "tiny-llama", "--estimate", "--memory-limit", "13MiB", "--concurrency", "2",
                              "--json"])
    assert res.exit_code == 1, res.output
    tokens = json.loads(res.output.strip().splitlines()[-1])["fitting_batched_tokens"]
    assert tokens is None or tokens >= 2


def test_bench_names_the_largest_concurrency_that_set_the_sequences():
    res = runner.invoke(app, ["bench", "tiny-llama", "-c", "8", "--max-num-batched-tokens", "4", "--num-prompts",
                              "2"])
    assert res.exit_code == 2, res.output
    assert "--max-num-batched-tokens (4) is below the largest --concurrency (8)" in _said(res), res.output


# ------------------------------------------------------------------------ /detokenize of the padded vocab's ids
@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    """tiny-llama's 512 embedding rows under a tokenizer of 300 tokens (as a model whose vocab_size is padded past
    its tokenizer's length, e.g. Qwen's)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from infer.models.tiny import ensure_builtin
    path = tmp_path_factory.mktemp("padded") / "tiny-padded"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    for f in list(path.glob("tokenizer*")) + list(path.glob("special_tokens_map.json")):
        f.unlink()
    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, 300)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(path)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**cfg, "eos_token_id": 0}))
    return str(path)


def test_detokenize_decodes_ids_of_the_models_padded_vocab(padded_model):
    """/detokenize refused an id inside the model's vocab_size (one /v1/completions takes in a prompt, and the model
    can produce) for being past the tokenizer's length; vLLM decodes what it can. Past vocab_size: still a 400."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(padded_model, max_model_len=64, max_num_seqs=2, block_size=4))
    assert engine.model_config.vocab_size == 512 and len(engine.tokenizer) == 300
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=8), "tiny")) as base:
        plain = httpx.post(f"{base}/detokenize", json={"tokens": [5, 6]})
        padded = httpx.post(f"{base}/detokenize", json={"tokens": [5, 400, 511, 6]})
        assert plain.status_code == 200 and padded.status_code == 200, padded.text
        assert padded.json()["prompt"] == plain.json()["prompt"] == "w5 w6"
        outside = httpx.post(f"{base}/detokenize", json={"tokens": [5, 512]})
        assert outside.status_code == 400 and "tokens[1] = 512 is outside the vocabulary (0..511)" in outside.text


# -------------------------------------------------------------------------- an error names the flag as typed
@pytest.mark.parametrize("typed", ["--max-length", "--max-model-len"])
def test_warmups_length_past_the_context_is_named_as_typed(typed):
    """`infer warmup --max-model-len 99999` was told "--max-length 99999 is above the model's context"."""
    res = runner.invoke(app, ["warmup", "tiny-llama", "--estimate", typed, "99999"])
    assert res.exit_code == 2, res.output
    other = {"--max-length", "--max-model-len"} - {typed}
    assert f"{typed} 99999 is above the model's context of 4096" in _said(res) and other.pop() not in res.output
    assert f"use {typed} 4096 or less" in _said(res)


def test_warmups_sequences_are_named_as_typed_and_both_spellings_must_agree():
    res = runner.invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-num-batched-tokens", "8",
                              "--max-num-seqs", "16"])
    assert res.exit_code == 2 and "is below --max-num-seqs (16)" in _said(res), res.output
    res = runner.invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-length", "100", "--max-model-len", "200"])
    assert res.exit_code == 2 and "--max-length 100 and --max-model-len 200" in _said(res), res.output  # was: 200
    res = runner.invoke(app, ["warmup", "tiny-llama", "--estimate", "--concurrency", "4", "--max-num-seqs", "3"])
    assert res.exit_code == 2 and "--concurrency 4 and --max-num-seqs 3" in _said(res), res.output
    res = runner.invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-model-len", "128", "--max-num-seqs", "3",
                              "--json"])
    plan = json.loads(res.output.strip().splitlines()[-1])
    assert res.exit_code == 0 and (plan["max_length"], plan["concurrency"]) == (128, 3), res.output


def test_serves_bad_log_level_names_vllms_spelling_too(monkeypatch):
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **kw: pytest.fail("the server started"))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", "--uvicorn-log-level", "loud"])
    assert res.exit_code == 2 and "--uvicorn-log-level 'loud' is not one of" in _said(res), res.output


@pytest.mark.parametrize("typed, words", [("-tp", "one GPU"), ("-pp", "one GPU"), ("-dp", "--data-parallel N")])
def test_vllms_short_parallel_options_are_named_as_typed(typed, words):
    """vLLM's -tp 2 was read as -t -p: "No such option: -t", hint "long options take two dashes: --tp"."""
    res = runner.invoke(app, ["serve", "tiny-llama", typed, "2"])
    assert res.exit_code == 2, res.output
    assert f"{typed} is vLLM's option, which `infer serve` does not take" in _said(res) and words in _said(res)
    assert "two dashes" not in res.output


# ------------------------------------------------- the context's check before generation_config's max_new_tokens cap
@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """tiny-llama with generation_config.json's max_new_tokens 5, its tokenizer and its OpenAI defaults."""
    from transformers import AutoTokenizer

    from helpers import tiny_llama_with_json
    from infer.engine.inputs import openai_sampling_defaults
    folder = tiny_llama_with_json(tmp_path_factory.mktemp("capped") / "capped", "generation_config.json",
                                  max_new_tokens=5)
    return AutoTokenizer.from_pretrained(folder), openai_sampling_defaults(folder)


@pytest.mark.parametrize("chat", [False, True])
def test_a_max_tokens_the_context_cannot_hold_is_refused_before_the_cap(capped, chat):
    """vLLM checks the request's own max_tokens against the context, then caps it at generation_config.json's
    max_new_tokens; infer capped first, so 40 prompt tokens + max_tokens 50 under a context of 64 ran (5 tokens)."""
    pytest.importorskip("fastapi")
    import infer.serve.protocol as p
    tok, defaults = capped
    if chat:
        body = {"messages": [{"role": "user", "content": "hi " * 10}], "max_completion_tokens": 50}
        req = p.parse_chat(body, tok, 64, defaults)
    else:
        req = p.parse_completion({"prompt": list(range(10, 50)), "max_tokens": 50}, tok, 64, defaults)
    assert req.params.max_new_tokens == 5  # what runs, once it is taken: the cap
    with pytest.raises(p.ApiError) as e:
        p.check_context(req, 64)
    assert e.value.code == "context_length_exceeded" and "asks for 50 more" in str(e.value), str(e.value)
    ok = p.parse_completion({"prompt": list(range(10, 50)), "max_tokens": 24}, tok, 64, defaults)
    p.check_context(ok, 64)


def test_a_prompt_past_the_context_is_said_before_a_min_tokens_past_the_cap(capped):
    pytest.importorskip("fastapi")
    import infer.serve.protocol as p
    tok, defaults = capped
    req = p.parse_completion({"prompt": list(range(10, 80)), "min_tokens": 8, "max_tokens": 8}, tok, 64, defaults)
    with pytest.raises(p.ApiError) as e:
        p.check_context(req, 64)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt", str(e.value)
    req = p.parse_completion({"prompt": list(range(10, 20)), "min_tokens": 8, "max_tokens": 8}, tok, 64, defaults)
    with pytest.raises(p.ApiError) as e:  # a prompt that fits: the cap's refusal is still said
        p.check_context(req, 64)
    assert e.value.param == "min_tokens" and "generation_config.json" in str(e.value)


def test_a_batch_lines_max_tokens_is_checked_against_the_context_before_the_cap(capped):
    from infer.engine.inputs import parse_request
    from infer.errors import RequestError
    tok, defaults = capped
    line = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hello world", "max_tokens": 60}}
    with pytest.raises(RequestError, match="body.max_tokens asks for 60 more"):
        parse_request(line, tok, "0", defaults, max_tokens=64)
    line["body"]["max_tokens"] = 40
    assert parse_request(line, tok, "0", defaults, max_tokens=64).params.max_new_tokens == 5


# ---------------------------------------------------------------------------------- request ids are strings
@pytest.fixture(scope="module")
def engine():
    from infer.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=4, block_size=4))


@pytest.mark.parametrize("bad", [7, b"7", ["a", 7]], ids=["int", "bytes", "list"])
def test_abort_request_refuses_an_id_that_is_not_a_string_as_add_request_does(engine, bad):
    """add_request(7, ...) is refused (vLLM's ids are strings), but abort_request(7) silently aborted request "7"."""
    from infer.engine.sampling_params import SamplingParams
    from infer.errors import RequestError
    engine.add_request("7", [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    with pytest.raises(TypeError, match="request_id must be a string, got"):
        engine.abort_request(bad)
    with pytest.raises(RequestError):
        engine.add_request(7, [5, 6], SamplingParams(max_new_tokens=2))
    assert not engine.requests["7"].finished and not engine.requests["a"].finished  # none aborted
    engine.abort_request(["7", "a"])
    while engine.has_unfinished_requests():
        engine.step()
