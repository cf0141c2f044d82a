"""Session 56 probes: a newcomer follows README.md top to bottom on the built-in models and types the obvious
mistakes (a misspelt prompts file, Ctrl-C while the model loads); each error must say what to do."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli import run as run_module
from infer.cli.main import app

from helpers import in_empty_hub_cache


def _no_model(monkeypatch):
    monkeypatch.setattr(run_module, "_start_engine", lambda *a, **k: pytest.fail("the model was loaded"))


def _prompts(folder):
    folder.mkdir(exist_ok=True)
    path = folder / "prompts.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 2}) + "\n")
    return path


def test_a_misspelt_input_file_is_told_the_folders_closest_file(tmp_path, monkeypatch):
    """`infer run tiny-llama examples/prompt.jsonl` (the README's `examples/prompts.jsonl` one letter short) said
    only "give a JSONL file with one request per line", where a misspelt MODEL path is told its folder's closest
    entry; a folder that is not there is named as such."""
    _no_model(monkeypatch)
    monkeypatch.chdir(tmp_path)
    _prompts(tmp_path / "examples")
    res = CliRunner().invoke(app, ["run", "tiny-llama", "examples/prompt.jsonl", "-o", "out.jsonl", "-q"])
    assert res.exit_code == 2, res.output
    assert "input file examples/prompt.jsonl does not exist" in res.output
    assert "did you mean 'examples/prompts.jsonl'?" in res.output
    res = CliRunner().invoke(app, ["run", "tiny-llama", "exmaples/prompts.jsonl", "-o", "out.jsonl", "-q"])
    assert res.exit_code == 2 and "the folder 'exmaples' does not exist" in res.output, res.output
    res = CliRunner().invoke(app, ["run", "tiny-llama", "zzz.jsonl", "-o", "out.jsonl", "-q"])
    assert res.exit_code == 2 and "give a JSONL file with one request per line" in res.output, res.output


def test_a_misspelt_bench_dataset_file_is_told_the_folders_closest_file(tmp_path, monkeypatch):
    """`infer bench M --dataset jsonl:examples/repat.jsonl` said only "pass an existing file: jsonl:PATH"."""
    from infer.cli.bench import check_dataset
    from infer.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "repeat.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        check_dataset("jsonl:examples/repat.jsonl")
    assert "did you mean 'examples/repeat.jsonl'?" in e.value.hint and "jsonl:PATH" in e.value.hint


def test_ctrl_c_while_the_model_loads_says_nothing_was_written_and_what_to_do(tmp_path, monkeypatch):
    """Ctrl-C during `infer run`'s model load (the first tens of seconds of a real model) printed a bare
    `interrupted`, where one during generation says how many records are on disk and what to run: now it says that
    nothing was written (a resumed output is as it was) and to run the same command again."""
    prompts = _prompts(tmp_path)
    out = tmp_path / "out.jsonl"

    def loading(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(run_module, "_start_engine", loading)
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(prompts), "-o", str(out)])
    assert res.exit_code == 130, res.output
    assert f"interrupted while loading the model, before generating: nothing was written to {out}; run the same " \
           "command again" in res.output
    assert not out.exists()
    out.write_text(json.dumps({"id": "a", "text": "x", "finish_reason": "length"}) + "\n")
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(prompts), "-o", str(out), "--resume", "--force-resume"])
    assert res.exit_code == 130, res.output
    assert f"{out} is as it was; run the same command with --resume again" in res.output


def test_the_example_prompts_run_on_any_model_with_adapters_registered():
    """examples/prompts.jsonl's OpenAI batch line named `"model": "tiny-llama"`: `infer run tiny-qwen2
    examples/prompts.jsonl --lora support=...` (the README's LoRA command on another model) failed that line ("is
    neither the base model nor a registered adapter") and exited 1. Its body names no model now: the base, on any."""
    from pathlib import Path

    from infer.engine.inputs import ModelNames
    names = ModelNames(base=frozenset({"tiny-qwen2"}), adapters=frozenset({"support"}))
    lines = [json.loads(t) for t in (Path(__file__).parents[1] / "examples" / "prompts.jsonl").read_text().splitlines()]
    bodies = [line["body"] for line in lines if "body" in line]
    assert bodies, "the example keeps its OpenAI batch line"
    for body in bodies:
        assert names.lora_for(body.get("model")) is None


@pytest.mark.parametrize("typed, meant", [("mixtral", "'tiny-mixtral'"), ("gemma3", "'tiny-gemma3'"),
                                          ("phi4", "'tiny-phi4'"),
                                          ("tiny-gemma4", "'tiny-gemma', 'tiny-gemma3' or 'tiny-gemma2'")])
def test_a_builtin_name_without_its_prefix_or_with_another_version_names_the_builtins(tmp_path, monkeypatch, typed,
                                                                                      meant):
    """`infer run mixtral ...` (`gemma3`, `phi4`: the README's new built-ins typed without `tiny-`) was told only
    "pass a folder with config.json and weights"; `tiny-gemma4` was offered `tiny-gemma` alone, not the Gemma 2
    and Gemma 3 built-ins it more likely meant."""
    from infer.errors import ModelLoadError
    from infer.models.resolve import resolve_model
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(typed)
    assert f"did you mean the built-in model {meant}" in e.value.hint


def test_a_hub_id_is_not_taken_for_a_builtin_without_its_prefix(tmp_path, monkeypatch):
    """`Qwen/Qwen2` (a hub id the cache lacks) keeps its `hf download` hint: the `tiny-` prefix is tried on bare
    names only (tiny-qwen/qwen2 reads close to tiny-qwen2)."""
    from infer.errors import ModelLoadError
    from infer.models.resolve import resolve_model
    in_empty_hub_cache(tmp_path, monkeypatch)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("Qwen/Qwen2")
    assert "hf download Qwen/Qwen2" in e.value.hint and "built-in" not in e.value.hint


@pytest.mark.parametrize("model", ["tiny-llama4-mm", "tiny-qwen3_5-moe-mm"])
def test_the_demo_refuses_a_mixture_of_experts_before_any_step(tmp_path, monkeypatch, model):
    """`infer demo --model tiny-qwen3-moe` (the README's `--model` another built-in, one of the new MoE ones) built
    the model, then failed a step: it was refused up front until the seventy-third session, which runs the chain on
    the mixtures of experts (on all of them since the seventy-fourth: gpt-oss, Llama 4 and DeepSeek too); a
    multimodal folder's mixture of experts is still refused up front, naming the built-ins the chain runs on and the
    command that runs the model."""
    from infer.cli import demo as demo_module
    monkeypatch.setattr(demo_module, "_model_steps", lambda *a, **k: pytest.fail("a step ran"))
    res = CliRunner().invoke(app, ["demo", "--model", model, "--out", str(tmp_path / "d")])
    assert res.exit_code == 2, res.output
    assert f"--model {model} is a" in res.output and "tiny-llama" in res.output
    assert f"infer run {model} examples/prompts.jsonl" in res.output and not (tmp_path / "d").exists()


def test_a_completion_while_asleep_names_the_sleep_level_not_a_python_call():
    """`curl /v1/completions` after `POST /sleep?level=1` got "the engine is asleep (kv_cache and weights freed by
    sleep(level=1)) (POST /wake_up, then retry)": a Python call in an HTTP client's message, where the 400 of a bad
    level names the route. It says "freed by a level 1 sleep" now, to the server's clients and Python's alike."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.errors import SleepModeError
    from infer.models.tiny import ensure_builtin
    engine = LLMEngine(EngineConfig(str(ensure_builtin("tiny-llama")), block_size=4, max_model_len=64,
                                    max_num_seqs=2, enable_sleep_mode=True))
    engine.sleep(level=1)
    with pytest.raises(SleepModeError) as e:
        engine.check_awake()
    assert "freed by a level 1 sleep" in e.value.message and "sleep(level" not in e.value.message
    engine.wake_up()
    engine.check_awake()


def test_a_lora_folder_without_its_name_is_told_the_option_with_a_name_for_it():
    """`infer run M P --lora ./infer-demo/adapters/support` (the folder alone, as peft and transformers take it) was
    told `e.g. --lora support=./adapters/support`, a folder that is not there: the hint now names the folder given,
    under its own name, and a NAME= without a folder is asked for the folder."""
    from infer.engine.config import parse_loras
    from infer.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        parse_loras(["./infer-demo/adapters/support"])
    assert "--lora support=./infer-demo/adapters/support" in e.value.hint and "give the adapter a name" in e.value.hint
    with pytest.raises(ConfigError) as e:
        parse_loras(["legal="])
    assert "give the adapter's folder, e.g. --lora legal=" in e.value.hint


def test_a_pool_too_small_for_a_windowed_sequence_says_how_many_blocks_it_needs(tmp_path):
    """A sliding-window model with num_kv_blocks below one sequence's window and step was told "num_kv_blocks=7
    holds 24 tokens (one block is the sliding window's placeholder), less than one sequence of 120 tokens (the
    context, --max-model-len) holds at once (7 blocks: ...)", which reads as if the sequence held the tokens: it
    says now how many blocks are left for sequences and how many one sequence holds at once."""
    from infer import LLM
    from infer.errors import ConfigError
    from test_probes_session55_swblocks import CHUNK, build
    build(tmp_path, "mistral", seed=4)
    with pytest.raises(ConfigError) as e:
        LLM(str(tmp_path), block_size=4, max_num_batched_tokens=CHUNK, max_num_seqs=1, num_kv_blocks=7,
            max_model_len=120)
    assert ("num_kv_blocks=7 leaves 6 blocks for sequences (one is the sliding window's placeholder), fewer than "
            "the 7 one sequence of 120 tokens (--max-model-len) holds at once") in e.value.message
    assert "num_kv_blocks=8 or more" in e.value.hint


def test_warmups_table_says_a_block_holds_one_layer_group(monkeypatch):
    """With KV layer groups (Gemma 3: 6 groups of one layer) `infer warmup`'s table showed "3,072 B / 8,192 B" per
    token / per block and "5,635 x 16 tokens" of blocks, as if a block held every layer's 16 tokens: it says a block
    holds one of the groups."""
    monkeypatch.setenv("COLUMNS", "250")  # (rich's table on one line a row)
    res = CliRunner().invoke(app, ["warmup", "tiny-gemma3", "--estimate", "--max-length", "512", "--concurrency", "2",
                                   "--max-num-batched-tokens", "128", "--block-size", "16", "--memory-limit", "60MB"])
    assert res.exit_code == 0, res.output
    assert "(a block: 16 tokens of one of 6 layer groups)" in res.output
    assert "tokens of one layer group (1 of 6 groups attend fully, the others slide)" in res.output
