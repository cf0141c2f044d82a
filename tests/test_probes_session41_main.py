"""Session 41: the main thread's own probes (the helpers' are in test_probes_session41_AREA.py)."""
from __future__ import annotations

import json

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


def _hub_cache(tmp_path, monkeypatch, repo: str, revisions: list[str], main: str | None):
    """A local Hugging Face hub cache holding `repo` at `revisions` (copies of tiny-llama), refs/main -> `main`."""
    import os
    import shutil

    from infer.models.tiny import ensure_builtin
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = tmp_path / "hub" / ("models--" + repo.replace("/", "--"))
    snaps = []
    for i, rev in enumerate(revisions):
        snap = folder / "snapshots" / rev
        shutil.copytree(ensure_builtin("tiny-llama"), snap)
        os.utime(snap, (1_000_000 + i, 1_000_000 + i))  # later revisions are newer
        snaps.append(snap)
    if main is not None:
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(main)
    return snaps


def test_a_hub_id_downloaded_before_runs_from_the_local_hub_cache(tmp_path, monkeypatch):
    """`infer run org/tiny` on a model the hub cache holds (huggingface-cli download, or transformers/vLLM before)
    was refused with a hint to pass the snapshot folder; DESIGN says models come from local folders or the local
    hub cache, as vLLM and transformers read them offline. Same tokens as the folder itself."""
    from infer.cli.options import base_model_id
    from infer.models.resolve import resolve_model
    a, b = "a" * 40, "b" * 40
    snaps = _hub_cache(tmp_path, monkeypatch, "org/tiny", [a, b], main=a)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == snaps[0]  # refs/main, though b is newer
    assert base_model_id("org/tiny") == "org/tiny"  # served and listed under the id as given, as vLLM does
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": "x", "prompt": "hello there", "max_new_tokens": 6}\n')
    outs = {}
    for name, model in (("hub", "org/tiny"), ("folder", str(snaps[0]))):
        result = CliRunner().invoke(app, ["run", model, str(prompts), "-o", str(tmp_path / f"{name}.jsonl")])
        assert result.exit_code == 0, result.output
        record = json.loads((tmp_path / f"{name}.jsonl").read_text())
        outs[name] = record["token_ids"] if "token_ids" in record else record["text"]
    assert outs["hub"] == outs["folder"]


def test_a_hub_id_without_refs_main_takes_its_newest_snapshot_and_an_uncached_one_says_how_to_fetch(tmp_path,
                                                                                                    monkeypatch):
    from infer.errors import ModelLoadError
    from infer.models.resolve import resolve_model
    snaps = _hub_cache(tmp_path, monkeypatch, "org/pinned", ["c" * 40, "d" * 40], main=None)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/pinned") == snaps[1]
    with pytest.raises(ModelLoadError) as e:
        resolve_model("org/absent")
    assert str(tmp_path / "hub") in e.value.hint and "huggingface-cli download org/absent" in e.value.hint
