"""Engine options are declared once (EngineConfig) and reach the engine by name from every command."""

from __future__ import annotations

import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from infer.cli.main import app
from infer.engine.config import EngineConfig, cli_fields, flag_of
from infer.errors import ConfigError

from helpers import Stopped, stub_calls

ENGINE_COMMANDS = {"run": (), "serve": (), "warmup": ("max_num_seqs", "max_model_len", "chat_template"),
                   "bench": ("max_num_seqs", "seed", "loras", "max_loras")}


def _click_params(command: str) -> dict:
    cmd = typer.main.get_command(app).commands[command]
    return {p.name: p for p in cmd.params}


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_every_engine_option_is_on_every_engine_command_with_the_dataclass_default(command):
    params = _click_params(command)
    by_flag = {flag: p for p in params.values() for flag in p.opts}
    for f in cli_fields():
        if f.name in ENGINE_COMMANDS[command]:
            # the command declares its own meaning, or derives it from its own options (documented in its help)
            # (warmup renders no chat: --chat-template would do nothing there)
            assert f.name in ("max_num_seqs", "max_model_len", "chat_template") or flag_of(f.name) in by_flag, \
                (command, f.name)
            continue
        assert f.name in params and flag_of(f.name) in params[f.name].opts, f"{command} lacks {flag_of(f.name)}"
        default = None if f.default is dataclasses.MISSING else f.default
        assert params[f.name].default == default, (command, f.name)


def _distinct_values(tmp_path):
    """A value for every CLI engine option that differs from its default, as (argv, expected field values)."""
    lora = tmp_path / "adapter"
    lora.mkdir()
    values = {"dtype": "bfloat16", "device": "cpu", "max_num_seqs": 7, "max_num_batched_tokens": 333,
              "block_size": 8, "max_model_len": 99, "seed": 5, "enable_prefix_caching": False,
              "scheduling_policy": "priority", "kv_cache_dtype": "fp8_e5m2",
              "memory_limit": ("3MB", 3 * 2**20), "gpu_memory_utilization": 0.5, "enforce_eager": True,
              "cuda_graph_max_tokens": 64, "max_logprobs": 5, "enable_sleep_mode": True,
              "state_snapshots": 3,
              "loras": (f"a={lora}", {"a": str(lora)}), "enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 3,
              "lora_target_modules": ("o_proj,qkv_proj", ["o_proj", "qkv_proj"]),
              "chat_template": "{{ messages[0]['content'] }}",
              "runner": "pooling", "pooler_config": ('{"pooling_type": "mean"}', {"pooling_type": "MEAN"}),
              "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
                                     {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                      "prompt_lookup_min": 3})}
    assert set(values) == {f.name for f in cli_fields()}, "a new option needs a value in this test"
    argv, expected = [], {}
    for name, v in values.items():
        given, want = v if isinstance(v, tuple) else (v, v)
        flag = flag_of(name)
        if isinstance(want, bool):
            argv.append(flag if want else "--no-" + flag[2:])
        else:
            argv += [flag, str(given)]
        expected[name] = want
    return argv, expected


def test_run_passes_every_option_by_name(tmp_path, monkeypatch):
    seen = stub_calls(monkeypatch, "infer.engine.llm_engine.LLMEngine")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv, expected = _distinct_values(tmp_path)
    result = CliRunner().invoke(app, ["run", "tiny-llama", str(prompts), *argv])
    assert isinstance(result.exception, Stopped), result.output
    [config] = seen["args"]
    assert config.model == "tiny-llama"
    for name, want in expected.items():
        assert getattr(config, name) == want, name


def test_bench_and_warmup_derive_their_own_options(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("infer.bench.plan.run_plan", lambda plan, **kw: (seen.append(plan.engine), (None, False))[1])
    result = CliRunner().invoke(app, ["bench", "tiny-llama", "-c", "3,12", "--seed", "9", "--block-size", "8",
                                      "--quiet", "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert (seen[0].max_num_seqs, seen[0].seed, seen[0].block_size, seen[0].max_loras) == (12, 9, 8, 4)

    plans = []
    monkeypatch.setattr("infer.cli.warmup_plan.estimate_plan",
                        lambda cfg, n, c: (plans.append(cfg), (_ for _ in ()).throw(ConfigError("stop")))[1])
    result = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-length", "300",
                                      "--concurrency", "5", "--no-prefix-caching"])
    assert result.exit_code == 2 and "stop" in result.output
    assert (plans[0].max_num_seqs, plans[0].max_model_len, plans[0].enable_prefix_caching) == (5, 300, False)


@pytest.mark.parametrize("field, value, words", [
    ("max_num_seqs", -4, "--max-num-seqs must be in 1..65536, got -4"),
    ("block_size", 512, "--block-size must be in 1..256"),
    ("max_loras", 0, "--max-loras must be at least 1"),
    ("gpu_memory_utilization", float("nan"), "--gpu-memory-utilization"),
    ("memory_limit", "lots", "--memory-limit 'lots' is not a size"),
    ("memory_limit", "0GB", "not a positive number"),
    ("loras", ["noequals"], "is not NAME=PATH"),
    ("device", "tpu", "--device 'tpu'"),
])
def test_bad_values_name_the_option(field, value, words):
    with pytest.raises(ConfigError) as e:
        EngineConfig("tiny-llama", **{field: value})
    assert words in str(e.value.message)


def test_sizes_and_adapters_are_normalised(tmp_path):
    cfg = EngineConfig("m", memory_limit="1.5GiB", loras={"x": str(tmp_path)})
    assert cfg.memory_limit == int(1.5 * 2**30) and cfg.loras == {"x": str(tmp_path)}
    assert dataclasses.replace(cfg, seed=3).memory_limit == cfg.memory_limit


# options of the data-parallel drivers (not EngineConfig's): flag, a value other than the default, the keyword it
# reaches run_data_parallel and serve_data_parallel with, and the value there
REPLICA_OPTIONS = [("--max-replica-restarts", "0", "max_restarts", 0),
                   ("--replica-placement-timeout", "12.5", "placement_timeout", 12.5)]


@pytest.mark.parametrize("command", ["run", "serve"])
def test_replica_options_reach_the_data_parallel_drivers(command, tmp_path, monkeypatch):
    seen = stub_calls(monkeypatch, "infer.cli.run_parallel.run_data_parallel",
                      "infer.cli.serve_parallel.serve_data_parallel", "infer.cli.serve._serve")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    where = [str(prompts), "-o", str(tmp_path / "o.jsonl")] if command == "run" else ["--port", "0"]
    argv = [a for flag, value, _, _ in REPLICA_OPTIONS for a in (flag, value)]
    result = CliRunner().invoke(app, [command, "tiny-llama", *where, "--data-parallel", "2",
                                      "--ray-address", "127.0.0.1:1", *argv])
    assert isinstance(result.exception, Stopped), result.output
    for _, _, keyword, want in REPLICA_OPTIONS:
        assert seen[keyword] == want, (command, keyword)


@pytest.mark.parametrize("parallel", [[], ["--data-parallel", "2", "--ray-address", "127.0.0.1:1"]])
def test_run_passes_retry_failed_to_either_driver(parallel, tmp_path, monkeypatch):
    """`infer run`'s own --retry-failed (with --resume) reaches the in-process run and run_data_parallel."""
    seen = stub_calls(monkeypatch, "infer.cli.run_parallel.run_data_parallel", "infer.cli.run._run_in_process")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["run", "tiny-llama", str(prompts), "-o", str(tmp_path / "o.jsonl"),
                                      "--resume", "--retry-failed", *parallel])
    assert isinstance(result.exception, Stopped), result.output
    assert seen["retry_failed"] is True
