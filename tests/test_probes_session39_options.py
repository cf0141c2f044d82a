"""Session 39 probes of the command-line options, as a vLLM user types them: vLLM's spellings with infer's meaning
are taken, the others are refused with what to do instead, and empty values are refused rather than ignored."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer import __version__
from infer.cli.main import app
from infer.engine.config import EngineConfig, load_chat_template
from infer.errors import ConfigError


class _Stop(Exception):
    pass


@pytest.fixture(autouse=True)
def _no_server(monkeypatch):
    """A refusal these tests expect that did not come would start a real server (on port 8000) and hang the test:
    serving raises _Stop instead, so such a test fails at once (_serve_options patches it again to see the options)."""
    def never(*a, **kw):
        raise _Stop
    monkeypatch.setattr("infer.cli.serve._serve", never)


def _serve_options(monkeypatch, *argv: str):
    """The EngineConfig and log level `infer serve tiny-llama --port 0 ARGV` would serve with (nothing loads)."""
    seen = {}

    def fake_serve(engine, sock, host, model_id, api_key, max_queue, shutdown_timeout, log_level, *a, **kw):
        seen.update(engine=engine, log_level=log_level, model_id=model_id, api_key=api_key)
        raise _Stop

    monkeypatch.setattr("infer.cli.serve._serve", fake_serve)
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--host", "127.0.0.1", *argv])
    assert isinstance(result.exception, _Stop), result.output
    return seen


def test_version_prints_infers_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"infer {__version__}"


def test_vllm_enforce_eager_and_enable_prefix_caching_are_taken_with_their_meaning(monkeypatch):
    seen = _serve_options(monkeypatch, "--enforce-eager", "--no-enable-prefix-caching")
    assert seen["engine"].enforce_eager is True and seen["engine"].enable_prefix_caching is False
    seen = _serve_options(monkeypatch, "--enable-prefix-caching")
    assert seen["engine"].enable_prefix_caching is True and seen["engine"].enforce_eager is False


def test_vllm_spelling_against_infers_own_asking_the_opposite_is_refused_naming_both():
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--no-prefix-caching", "--enable-prefix-caching"])
    assert result.exit_code == 2, result.output
    assert "--no-prefix-caching and --enable-prefix-caching" in result.output


def test_vllm_spellings_keep_help_within_80_columns():
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0 and "--enforce-eager" in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80


@pytest.mark.parametrize("given, dtype", [("half", "float16"), ("float", "float32")])
def test_vllm_dtype_half_and_float_are_float16_and_float32(monkeypatch, given, dtype):
    assert EngineConfig("tiny-llama", dtype=given).dtype == dtype
    assert _serve_options(monkeypatch, "--dtype", given)["engine"].dtype == dtype


def test_serve_takes_vllms_uvicorn_log_level(monkeypatch):
    assert _serve_options(monkeypatch, "--uvicorn-log-level", "info")["log_level"] == "info"


@pytest.mark.parametrize("argv, words", [
    (["serve", "tiny-llama", "--trust-remote-code"], "never a checkpoint's Python"),
    (["serve", "tiny-llama", "--lora-modules", "sql=./sql"], "--lora NAME=PATH"),
    (["run", "tiny-llama", "in.jsonl", "--tensor-parallel-size=2"], "--data-parallel"),
    (["serve", "tiny-llama", "--revision", "main"], "local folder"),
    (["serve", "tiny-llama", "--ssl-keyfile", "k.pem"], "TLS"),
    (["serve", "tiny-llama", "--generation-config", "auto"], "generation_config.json"),
    (["bench", "tiny-llama", "--max-concurrency", "4"], "--concurrency"),
    (["serve", "tiny-llama", "--enable-chunked-prefill"], "--max-num-batched-tokens"),
    (["bench", "tiny-llama", "--random-input-len", "8"], "--input-len"),
    (["bench", "tiny-llama", "--base-url", "http://x"], "--url"),
])
def test_vllm_options_infer_lacks_say_what_to_use_instead(argv, words):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    option = next(a for a in argv if a.startswith("--")).split("=")[0]
    assert f"{option} is vLLM's option" in result.output
    assert words in result.output
    assert "Traceback" not in result.output


def test_an_unknown_option_that_is_not_vllms_still_gets_clicks_guesses():
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--max-num-seq", "4"])
    assert result.exit_code == 2
    assert "No such option: --max-num-seq" in result.output and "vLLM's option" not in result.output


def test_an_empty_chat_template_is_refused_as_empty_not_as_a_folder(monkeypatch):
    with pytest.raises(ConfigError, match="--chat-template is empty"):
        load_chat_template("")
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--chat-template", ""])
    assert result.exit_code == 2 and "--chat-template is empty" in result.output, result.output
    assert "is a folder" not in result.output


@pytest.mark.parametrize("name", ["", "  "])
def test_serve_refuses_an_empty_served_model_name(monkeypatch, name):
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **k: pytest.fail("served with an empty model id"))
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--served-model-name", name])
    assert result.exit_code == 2, result.output
    assert "--served-model-name is empty" in result.output


def test_bench_refuses_served_model_name_without_url(monkeypatch, tmp_path):
    monkeypatch.setattr("infer.bench.plan.run_plan", lambda plan, **kw: pytest.fail("benched without --url"))
    result = CliRunner().invoke(app, ["bench", "tiny-llama", "--served-model-name", "my-model", "--quiet",
                                      "--out", str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    assert "--served-model-name" in result.output and "--url" in result.output


@pytest.mark.parametrize("argv, command", [(["serve", "tiny-llama", "--port"], "serve"),
                                           (["--debug", "bench", "tiny-llama", "-c"], "bench")])
def test_an_option_missing_its_value_points_at_its_commands_help(argv, command):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2
    assert "requires an argument" in result.output and f"see `infer {command} --help`" in result.output


@pytest.mark.parametrize("value, traceback", [("0", False), ("false", False), ("", False), ("1", True)])
def test_infer_debug_0_does_not_turn_debugging_on(monkeypatch, value, traceback):
    monkeypatch.setenv("INFER_DEBUG", value)
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "99999"])
    assert isinstance(result.exception, ConfigError) is traceback, result.output
    assert result.exit_code == (1 if traceback else 2)


def test_a_mistyped_infer_tune_is_refused_not_a_quick_tuning(monkeypatch):
    from infer.kernels.gptq_tune import tune_model
    monkeypatch.setenv("INFER_TUNE", "ful")
    with pytest.raises(ConfigError, match="INFER_TUNE='ful'"):
        tune_model(None, 16, "cpu")


@pytest.mark.parametrize("command", ["run", "serve"])
def test_an_empty_ray_address_is_refused_not_a_local_run(monkeypatch, tmp_path, command):
    monkeypatch.setattr("infer.engine.llm_engine.LLMEngine", lambda *a, **k: pytest.fail("ran without the cluster"))
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **k: pytest.fail("served without the cluster"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv = [str(prompts), "-o", str(tmp_path / "o.jsonl")] if command == "run" else ["--port", "0"]
    result = CliRunner().invoke(app, [command, "tiny-llama", *argv, "--ray-address", ""])
    assert result.exit_code == 2, result.output
    assert "--ray-address" in result.output and "empty" in result.output


def test_serve_requires_vllms_api_key_variable_too(monkeypatch):
    monkeypatch.delenv("INFER_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")  # a vLLM deployment's key: it served without any, silently
    assert _serve_options(monkeypatch)["api_key"] == "s3cret"
    monkeypatch.setenv("INFER_API_KEY", "ours")
    assert _serve_options(monkeypatch)["api_key"] == "ours"


@pytest.mark.parametrize("argv", [["convert", "tiny-llama", "-o", ""], ["quantize", "tiny-llama", "-o", " "],
                                  ["demo", "--out", ""], ["bench", "tiny-llama", "-o", ""]])
def test_an_empty_output_folder_is_refused_not_the_current_folder(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert "it is empty" in result.output
    assert list(tmp_path.iterdir()) == []


def test_convert_takes_vllms_dtype_half(monkeypatch, tmp_path):
    seen = {}

    def fake_convert(src, out, dtype=None, **kw):
        seen["dtype"] = dtype
        raise _Stop

    monkeypatch.setattr("infer.quant.convert.convert_model", fake_convert)
    result = CliRunner().invoke(app, ["convert", "tiny-llama", "-o", str(tmp_path / "out"), "--dtype", "half"])
    assert isinstance(result.exception, _Stop), result.output
    assert seen["dtype"] == "float16"
