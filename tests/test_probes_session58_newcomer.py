"""Session 58 probes: a newcomer's first minutes with README.md, and the obvious mistakes (`python -m infer`, a model
page's URL or a bare model name for MODEL, a 3-bit GPTQ checkpoint, a JSON array of prompt strings, `"model"` to
pick an adapter); each error must say what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.errors import ModelLoadError, RequestError, UnsupportedModelError
from infer.models.resolve import resolve_model

from helpers import in_empty_hub_cache

ROOT = Path(__file__).resolve().parents[1]


def _hint(name: str) -> str:
    with pytest.raises(ModelLoadError) as e:
        resolve_model(name)
    assert "neither a local model folder nor a built-in model" in e.value.message
    return e.value.hint


def _cached(tmp_path, repo: str) -> None:
    """The empty hub cache of `in_empty_hub_cache` holding a snapshot of `repo` (its config.json is enough)."""
    snap = tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")


def test_python_dash_m_infer_is_the_console_script(tmp_path):
    """`python -m infer run ...` (the reflex of a newcomer without the venv's bin/ on PATH) failed with Python's
    "No module named infer.__main__; 'infer' is a package and cannot be directly executed"."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "infer", "run", "tiny-llama", "absent.jsonl"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: input file absent.jsonl does not exist" in done.stderr and "Traceback" not in done.stderr


def test_a_model_pages_url_is_told_the_hub_id_to_pass(tmp_path, monkeypatch):
    """`infer run https://huggingface.co/ORG/NAME ...` (copied from the browser) was told only "pass a folder with
    config.json and weights; nothing is downloaded": now the hub id it names, and how to fetch it or that the cache
    holds it; another URL is told that infer reads local folders only."""
    in_empty_hub_cache(tmp_path, monkeypatch)
    hint = _hint("https://huggingface.co/org/Some-Model/tree/main")
    assert "infer takes no URL" in hint and "`hf download org/Some-Model` (then pass org/Some-Model)" in hint
    _cached(tmp_path, "org/Some-Model")
    assert "pass the hub id org/Some-Model, which the local hub cache holds" in _hint("huggingface.co/org/Some-Model")
    assert "never a URL" in _hint("https://example.com/models/llama.tar")
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", "https://hf.co/org/Other", "in.jsonl", "-o", "o.jsonl", "-q"])
    assert res.exit_code == 2 and "hf download org/Other" in " ".join(res.output.split()), res.output


def test_a_bare_model_name_is_told_its_cached_hub_id_or_the_org_it_needs(tmp_path, monkeypatch):
    """`infer run Llama-2-7b-chat-hf ...` (a hub model's name without its ORG/) was told only to pass a folder: a
    model the hub cache holds under that name is named by its id, any other is told the ORG/NAME form to fetch."""
    in_empty_hub_cache(tmp_path, monkeypatch)
    hint = _hint("Llama-2-7b-chat-hf")
    assert "ORG/Llama-2-7b-chat-hf" in hint and "`hf download ORG/Llama-2-7b-chat-hf`" in hint
    assert "nothing is downloaded" in hint
    _cached(tmp_path, "meta-llama/Llama-2-7b-chat-hf")
    _cached(tmp_path, "someone/llama-2-7b-chat-hf")
    _cached(tmp_path, "meta-llama/Llama-2-13b-chat-hf")
    assert _hint("llama-2-7b-chat-hf") == ("did you mean the hub id meta-llama/Llama-2-7b-chat-hf or "
                                           "someone/llama-2-7b-chat-hf, which the local hub cache holds? Pass it "
                                           "as ORG/NAME")


def test_a_path_under_a_missing_folder_names_the_first_missing_folder(tmp_path, monkeypatch):
    """`infer run /models/llama ...` or `../nope/model` was told "pass a folder with config.json and weights;
    nothing is downloaded", as if a download had been wanted: the folder that is not there is named."""
    in_empty_hub_cache(tmp_path, monkeypatch)
    assert _hint(str(tmp_path / "models" / "llama" / "7b")).startswith(
        f"there is no folder {str(tmp_path / 'models')!r} (check the path)")
    assert "there is no folder 'nope'" in _hint("nope/deeper/model")


@pytest.mark.parametrize("config", [{"bits": 3}, {"bits": 4, "dynamic": {r"+:.*down_proj": {"bits": 2}}}],
                         ids=["bits", "dynamic"])
def test_an_unsupported_bit_width_is_told_what_to_use_instead(config):
    """A 2/3-bit GPTQ checkpoint was told only "only 4-bit and 8-bit GPTQ are supported"."""
    from infer.quant.config import GPTQConfig
    with pytest.raises(UnsupportedModelError) as e:
        GPTQConfig.from_dict({"quant_method": "gptq", **config}, "m/config.json")
    assert "only 4-bit and 8-bit GPTQ are supported" in e.value.hint
    assert "4-bit (or 8-bit) GPTQ release" in e.value.hint and "`infer quantize FLOAT_MODEL -o OUT --bits 4`" in \
        e.value.hint


@pytest.mark.parametrize("text, command", [
    ('["The weather today is", "Trains leave"]\n', "jq -c '.[] | {prompt: .}' IN > prompts.jsonl"),
    ('[\n  "The weather today is",\n  "Trains leave"\n]\n', "jq -c '.[] | {prompt: .}' IN > prompts.jsonl"),
    ('"The weather today is"\n"Trains leave"\n', "jq -c '{prompt: .}' IN > prompts.jsonl"),
    ('[{"prompt": "a"}]\n', "jq -c '.[]' IN > prompts.jsonl"),
    ("The weather today is\n", "jq -R -c '{prompt: .}' IN > prompts.jsonl"),
], ids=["array", "pretty-array", "string-lines", "array-of-objects", "text"])
def test_prompt_strings_are_told_a_command_that_makes_requests_of_them(tmp_path, monkeypatch, text, command):
    """A JSON array of prompt strings was told `jq -c '.[]' IN > prompts.jsonl`, which makes a JSON string a line,
    and that file was told `jq -R -c '{prompt: .}'`, which keeps each string's quotes in its prompt."""
    from infer.cli import run as run_module
    monkeypatch.setattr(run_module, "_start_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    inp = tmp_path / "in.json"
    inp.write_text(text)
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"), "-q"])
    assert res.exit_code == 2, res.output
    assert command.replace("IN", str(inp)) in " ".join(res.output.split()), res.output


def test_a_line_naming_its_adapter_as_model_is_told_to_use_lora():
    """`{"prompt": ..., "model": "support"}` (vLLM's and OpenAI's way to pick an adapter) was told only the list of
    allowed fields."""
    from infer.engine.inputs import parse_request
    with pytest.raises(RequestError) as e:
        parse_request({"prompt": "hi", "model": "support"}, None, "0")
    assert "unknown field(s) ['model']" in e.value.message
    assert e.value.hint.startswith("a line picks its adapter with 'lora', e.g. \"lora\": \"support\" (a --lora NAME")
    with pytest.raises(RequestError) as e:
        parse_request({"prompt": "hi", "model": ["x"]}, None, "0")
    assert "e.g. \"lora\": \"NAME\"" in e.value.hint


@pytest.fixture(scope="module")
def tiny_engine():
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=8, block_size=4))


@pytest.mark.parametrize("runtime, says", [(False, "an adapter is served when the server starts with --lora "
                                                   "NAME=PATH"),
                                           (True, "load an adapter with POST /v1/load_lora_adapter first")])
def test_the_server_tells_an_unknown_adapter_how_adapters_are_served(tiny_engine, runtime, says):
    """`"model": "support"` to a server started without `--lora support=PATH` got "the model 'support' does not
    exist; available: tiny-llama" and no word of how an adapter gets served."""
    pytest.importorskip("fastapi")
    from infer.serve.app import Server
    from infer.serve.async_engine import AsyncEngine
    from infer.serve.protocol import ApiError
    server = Server(AsyncEngine(tiny_engine), "tiny-llama", runtime_lora=runtime)
    with pytest.raises(ApiError) as e:
        server.lora_for("support")
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    assert e.value.message == f"the model 'support' does not exist; available: tiny-llama ({says})"
    assert server.lora_for("tiny-llama") is None


def test_a_missing_sharegpt_file_is_told_where_vllms_comes_from(tmp_path, monkeypatch):
    """`infer bench M --dataset sharegpt:./sharegpt.json` (README's example) without the file was told only "pass an
    existing file": a newcomer does not know which ShareGPT file vLLM's benchmarks read, nor where it is."""
    from infer.cli.bench import check_dataset
    from infer.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    fetch = ("`hf download anon8231489123/ShareGPT_Vicuna_unfiltered ShareGPT_V3_unfiltered_cleaned_split.json "
             "--repo-type dataset --local-dir .`")
    with pytest.raises(ConfigError) as e:
        check_dataset("sharegpt:./sharegpt.json")
    assert e.value.hint == f"pass an existing file: sharegpt:PATH; the ShareGPT file vLLM's benchmarks use is " \
                           f"fetched with {fetch}, then pass --dataset " \
                           "sharegpt:ShareGPT_V3_unfiltered_cleaned_split.json"
    with pytest.raises(ConfigError) as e:
        check_dataset("jsonl:./prompts.jsonl")
    assert "ShareGPT" not in e.value.hint


@pytest.mark.parametrize("name", ["prompts.jsonl", "my prompts.jsonl"])
def test_a_missing_input_is_told_a_command_that_makes_one(tmp_path, monkeypatch, name):
    """`infer run tiny-llama prompts.jsonl -o out.jsonl` (the example of `infer --help` and `infer run --help`) in a
    folder without that file was told "give a JSONL file with one request per line", and no line's shape: the hint
    now carries a shell command that writes one, and the run takes what it writes."""
    in_empty_hub_cache(tmp_path, monkeypatch)
    args = ["run", "tiny-llama", name, "-o", "out.jsonl", "-q", "--max-new-tokens", "2"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    command = res.output.split("hint: give a JSONL file with one request per line, e.g. ")[1].strip()
    subprocess.run(command, shell=True, cwd=tmp_path, check=True)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out.jsonl").read_text())["usage"]["completion_tokens"] == 2


def _two_adapters(tmp_path) -> Path:
    """A folder holding the adapters `legal` and `support` in subfolders, as peft's save_pretrained writes adapters
    not named default (adapter_config.json is all these checks read)."""
    folder = tmp_path / "adapters"
    for name in ("legal", "support"):
        (folder / name).mkdir(parents=True)
        (folder / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        (folder / name / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_a_folder_of_adapters_is_told_the_subfolder_of_the_name_given(tmp_path):
    """`--lora support=./infer-demo/adapters` (the demo's folder of adapters, not the adapter's) was told "e.g.
    infer-demo/adapters/legal": the first subfolder, not the one named like the adapter."""
    from infer.errors import LoRAError
    from infer.lora.adapter import read_config
    folder = _two_adapters(tmp_path)
    for name in ("support", "legal", "other"):
        with pytest.raises(LoRAError) as e:
            read_config(name, folder)
        meant = name if name != "other" else "legal"
        assert e.value.hint.startswith(f"pass the adapter's own folder, e.g. {folder / meant} (peft's"), e.value.hint


def test_an_adapters_file_is_told_its_folder(tmp_path):
    """`--lora support=./adapters/support/adapter_model.safetensors` was told only "pass a PEFT adapter folder"."""
    from infer.engine.config import parse_loras
    from infer.errors import ConfigError, LoRAError
    from infer.lora.adapter import read_config
    weights = _two_adapters(tmp_path) / "support" / "adapter_model.safetensors"
    with pytest.raises(ConfigError) as e:
        parse_loras([f"support={weights}"])
    assert e.value.hint == f"pass the adapter's folder, {weights.parent}, not a file in it"
    with pytest.raises(LoRAError) as e:
        read_config("support", weights.parent / "adapter_config.json")
    assert e.value.hint == f"pass the adapter's folder, {weights.parent}, not a file in it"
    (tmp_path / "p.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        parse_loras([f"support={tmp_path / 'p.jsonl'}"])
    assert e.value.hint == "pass the folder save_pretrained wrote (the one that holds adapter_config.json), not a file"


@pytest.mark.parametrize("command, says", [
    ("generate", "infer run MODEL INPUT.jsonl -o OUT.jsonl generates a reply for each line of a JSONL file (e.g. "
                 "echo '{\"prompt\": \"Hello\"}' > prompts.jsonl)"),
    ("complete", "infer run MODEL INPUT.jsonl -o OUT.jsonl generates"),
    ("chat", "infer has no interactive chat: infer serve MODEL and an OpenAI client"),
    ("download", "infer downloads nothing: fetch a model with `hf download ORG/NAME`"),
    ("Pull", "infer downloads nothing"),
    ("version", "the version is an option: infer --version"),
])
def test_a_command_guessed_from_other_tools_is_told_what_does_it_here(command, says):
    """`infer generate M`, `infer chat M` (vLLM's client commands), `infer download ORG/NAME` (ollama's pull) were
    told only "No such command" and to see `infer --help`."""
    res = CliRunner().invoke(app, [command, "tiny-llama"])
    assert res.exit_code == 2 and f"No such command '{command}'" in res.output, res.output
    assert f"hint: {says}" in res.output, res.output
    res = CliRunner().invoke(app, ["servr", "tiny-llama"])
    assert "Did you mean 'serve'?" in res.output and "hint: see `infer --help`" in res.output, res.output


@pytest.mark.parametrize("device, says", [
    ("gpu", "an NVIDIA GPU is --device cuda (auto picks cuda whenever one is visible)"),
    ("GPU:1", "an NVIDIA GPU is --device cuda:1 (auto picks cuda whenever one is visible)"),
    ("mps", "infer runs on NVIDIA GPUs (cuda) and on CPUs (cpu); mps is not supported"),
    ("cuda:x", "auto picks cuda when an NVIDIA GPU is visible, else cpu"),
])
def test_a_device_spelt_as_other_tools_spell_it_is_told_infers_name(device, says):
    """`--device gpu` (or a Mac's `mps`) was told "is not one of auto, cpu, cuda, cuda:N" and to see --help."""
    from infer.engine.config import EngineConfig
    from infer.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        EngineConfig("tiny-llama", device=device)
    assert e.value.message == f"--device {device!r} is not one of auto, cpu, cuda, cuda:N" and e.value.hint == says


def test_a_folder_without_a_tokenizer_is_told_the_download_that_completes_it(tmp_path, monkeypatch):
    """`infer run ./weights-only` (config.json and safetensors, no tokenizer) was told `hf download ORG/NAME
    tokenizer.json tokenizer_config.json --local-dir FOLDER`: the folder is now named, and so is the hub model its
    config.json says it comes from (`_name_or_path`, as save_pretrained writes it)."""
    import shutil

    from infer.checks import tokenizer_problem
    from infer.models.tiny import ensure_builtin
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "my weights"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ensure_builtin("tiny-llama") / name, folder / name)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", "my weights", "in.jsonl", "-o", "o.jsonl", "-q"])
    assert res.exit_code == 2 and "my weights has no tokenizer files" in res.output, res.output
    assert "hf download ORG/NAME tokenizer.json tokenizer_config.json --local-dir 'my weights')" in res.output
    config = json.loads((folder / "config.json").read_text())
    for source, named in (("org/base-7b", "org/base-7b"), ("/ckpt/run-3", None), (str(folder), None)):
        (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": source}))
        hint = tokenizer_problem(folder, OSError("x"))[1]
        download = f"hf download {named or 'ORG/NAME'} tokenizer.json tokenizer_config.json --local-dir " \
                   f"'{folder}'"
        assert download in hint and (f"its config.json naming {named} as its source" in hint) == bool(named), hint


@pytest.mark.parametrize("argv, example", [
    (["serve"], "e.g. infer serve tiny-llama --port 8000 --lora support=./adapters/support (see `infer serve --help`)"),
    (["run", "tiny-llama"], "e.g. infer run tiny-llama prompts.jsonl -o out.jsonl --max-new-tokens 64"),
    (["convert", "tiny-llama"], "e.g. infer convert ./my-model-bin -o ./my-model --dtype bfloat16"),
    (["lora-validate", "tiny-llama"], "e.g. infer lora-validate ./llama-gptq support=./adapters/support"),
])
def test_a_missing_argument_or_option_is_shown_the_commands_example(argv, example):
    """`infer serve` (no MODEL), `infer convert M` (no -o) were told "Missing argument 'model'" and to see --help:
    the command's example (its --help's Example line, in one line) shows what goes where."""
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2 and "error: Missing " in res.output, res.output
    assert f"hint: {example}" in res.output, res.output
    res = CliRunner().invoke(app, ["run", "tiny-llama", "in.jsonl", "-o"])  # a value missing: click's own words
    assert "requires an argument" in res.output and "hint: see `infer run --help`" in res.output, res.output
