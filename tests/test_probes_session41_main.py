"""Session 41: the main thread's own probes (the helpers' are in test_probes_session41_AREA.py)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app


class _Stop(Exception):
    pass


def _serve_engine(monkeypatch, *argv: str):
    """The EngineConfig `infer serve tiny-llama ARGV` would serve with (nothing loads), or the CLI result."""
    seen = {}

    def fake_serve(engine, *a, **kw):
        seen["engine"] = engine
        raise _Stop

    monkeypatch.setattr("infer.cli.serve._serve", fake_serve)
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--host", "127.0.0.1", *argv])
    return seen.get("engine"), result


@pytest.mark.parametrize("given, expected", [("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("4096", 4096),
                                             (" 2k ", 2000), ("1m", 1000000), ("1M", 1048576)])
def test_max_model_len_takes_vllms_human_readable_sizes(monkeypatch, given, expected):
    engine, result = _serve_engine(monkeypatch, "--max-model-len", given)
    assert engine is not None, result.output
    assert engine.max_model_len == expected


def test_max_num_batched_tokens_takes_vllms_human_readable_sizes(monkeypatch):
    engine, result = _serve_engine(monkeypatch, "--max-num-batched-tokens", "8K")
    assert engine is not None, result.output
    assert engine.max_num_batched_tokens == 8192


@pytest.mark.parametrize("given, words", [("1.5K", ["whole number", "1.5k", "1,500"]),
                                          ("abc", ["whole number", "8k"]), ("1", ["range", "2<=x"]),
                                          ("8kb", ["whole number"]), ("-4k", ["whole number"])])
def test_a_bad_human_readable_size_is_refused_naming_the_fix(monkeypatch, given, words):
    engine, result = _serve_engine(monkeypatch, "--max-model-len", given)
    assert engine is None and result.exit_code == 2
    text = " ".join(result.output.split())
    for word in words:
        assert word in text, text


def test_warmup_max_length_takes_human_readable_sizes(monkeypatch):
    seen = {}

    def plan(engine_config, max_length, concurrency):
        seen.update(length=max_length, engine=engine_config)
        raise _Stop

    monkeypatch.setattr("infer.cli.warmup_plan.estimate_plan", plan)
    result = CliRunner().invoke(app, ["warmup", "tiny-llama", "--max-length", "2k", "--concurrency", "2",
                                      "--estimate"])
    assert isinstance(result.exception, _Stop), result.output
    assert seen["length"] == 2000 and seen["engine"].max_model_len == 2000
    refused = CliRunner().invoke(app, ["warmup", "tiny-llama", "--max-model-len", "1", "--estimate"])
    assert refused.exit_code == 2 and "2<=x" in refused.output


@pytest.mark.parametrize("command", [["run", "tiny-llama", "in.jsonl", "-o", "out.jsonl"], ["serve", "tiny-llama"]])
def test_vllms_lora_modules_spelling_a_b_says_to_repeat_lora(monkeypatch, command):
    """vLLM's --lora-modules takes several NAME=PATH after one flag; infer's --lora one each time. The stray
    pairs were called an output file (`infer run ... -o b=./y`) or left without a hint."""
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **kw: (_ for _ in ()).throw(_Stop()))
    result = CliRunner().invoke(app, [*command, "--lora", "a=./x", "b=./y", "c=./z"])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "repeat the option for each adapter" in text and "--lora b=./y --lora c=./z" in text, text
    assert "output file" not in text
