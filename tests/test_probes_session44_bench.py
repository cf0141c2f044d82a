"""Probes of `infer bench` as a `vllm bench serve` user runs it (session 44)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


def _sharegpt(tmp_path: Path) -> Path:
    conv = {"conversations": [{"from": "human", "value": "Tell me a story about a dragon and a knight please"},
                              {"from": "gpt", "value": "Once upon a time a dragon lived in a cave near the sea."}]}
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([conv] * 2))
    return path


def _jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there friend"}\n')
    return path


@pytest.mark.parametrize("kind, args, words", [
    ("sharegpt", ["--output-len", "4"], "--output-len applies to --dataset random and jsonl, not sharegpt"),
    ("sharegpt", ["--input-len", "8"], "--input-len applies to --dataset random, not sharegpt"),
    ("jsonl", ["--input-len", "8"], "--input-len applies to --dataset random, not jsonl"),
    ("liteqwen", ["--output-len", "4"], "--output-len applies to --dataset random and jsonl, not liteqwen"),
])
def test_a_length_the_dataset_ignores_is_refused_not_silently_dropped(tmp_path, kind, args, words):
    """--input-len / --output-len with a dataset whose requests carry their own lengths were ignored without a word
    (a sharegpt run asked for 4 output tokens generated 30, and results.json's config said output_len 4)."""
    spec = {"sharegpt": f"sharegpt:{_sharegpt(tmp_path)}", "jsonl": f"jsonl:{_jsonl(tmp_path)}",
            "liteqwen": "liteqwen"}[kind]
    out = tmp_path / "out"
    res = runner.invoke(app, ["bench", "tiny-llama", "--dataset", spec, *args, "-c", "1", "--num-prompts", "1", "-q",
                              "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert words in res.output
    assert not (out / "results.json").exists()


def test_output_len_is_still_the_default_of_jsonl_lines(tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["bench", "tiny-llama", "--dataset", f"jsonl:{_jsonl(tmp_path)}", "--output-len", "3",
                              "-c", "1", "-q", "--save-detailed", "--out", str(out)])
    assert res.exit_code == 0, res.output
    [r] = json.loads((out / "results.json").read_text())
    assert r["output_lens"] == [3]


@pytest.mark.parametrize("argv, words", [
    (["--result-filename", "r.json"], "-o/--out FOLDER"),
    (["--sharegpt-output-len", "8"], "length of each conversation's gpt reply"),
    (["--custom-output-len", "8"], "vLLM's custom dataset"),
    (["--random-prefix-len", "8"], "share no prefix"),
    (["--num-warmups", "2"], "warms its in-process engine"),
    (["--disable-tqdm"], "-q/--quiet"),
    (["--temperature", "0.5"], "greedy"),
    (["--top-p", "0.9"], "greedy"),
    (["--batch-size", "4"], "-c N --num-prompts N"),
    (["--output-json", "r.json"], "-o/--out FOLDER"),
    (["--num-iters", "3"], "--num-prompts requests at each -c level"),
])
def test_vllm_bench_serve_options_say_what_infer_bench_does(tmp_path, argv, words):
    """vllm bench serve's (and latency's) options infer bench lacks got click's guesses: --temperature "Possible
    options: --chat-template", --sharegpt-output-len "--output-len" (which sharegpt ignored), --batch-size
    "--block-size", --output-json "--output-len", --result-filename nothing."""
    res = runner.invoke(app, ["bench", "tiny-llama", *argv, "--out", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert words in res.output and "Possible options" not in res.output


def test_a_url_naming_the_completions_endpoint_is_the_server():
    """`--url http://HOST:PORT/v1/completions` (vLLM's --base-url and --endpoint in one) posted every request to
    /v1/completions/v1/completions: each failed with a 404 after the whole level ran."""
    from infer.bench.http_driver import base_url
    from infer.errors import ConfigError
    assert base_url("http://127.0.0.1:8000/v1/completions") == "http://127.0.0.1:8000"
    assert base_url("http://127.0.0.1:8000/v1/completions/") == "http://127.0.0.1:8000"
    assert base_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000"
    with pytest.raises(ConfigError, match="is a chat endpoint") as e:
        base_url("http://127.0.0.1:8000/v1/chat/completions")
    assert "--url http://127.0.0.1:8000" in e.value.hint


@pytest.mark.parametrize("argv, named", [
    (["--max-model-len", "64", "--block-size", "32"], "--block-size, --max-model-len"),
    (["--max-num-seqs", "4"], "--max-num-seqs"),
    (["--enforce-eager"], "--enforce-eager"),
])
def test_engine_options_with_url_are_refused_not_silently_ignored(tmp_path, argv, named):
    """With --url no engine runs here: --max-model-len 64 with 100-token prompts ran them on the server's 4096
    without a word. The check comes before the server is reached (an unreachable port here)."""
    out = tmp_path / "out"
    res = runner.invoke(app, ["bench", "tiny-llama", "--url", "http://127.0.0.1:9", *argv, "-q", "--out", str(out)])
    assert res.exit_code == 2
    assert f"{named} set the in-process engine, which --url does not run" in res.output
    assert "cannot reach" not in res.output


def test_url_keeps_the_options_the_baseline_and_the_dataset_use(tmp_path):
    res = runner.invoke(app, ["bench", "tiny-llama", "--url", "http://127.0.0.1:9", "--dtype", "float32", "--device",
                              "cpu", "--chat-template", "{{ messages[0]['content'] }}", "-q",
                              "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "cannot reach http://127.0.0.1:9" in res.output
