"""Every command, every option with a bad value: one `error:` line naming the option, one `hint:` line, exit 2, no
traceback, and no model loaded (the check happens before any weights are read)."""

import json

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()
COMMANDS = get_command(app).commands

# A value each string option can never accept (options whose every string is valid — paths to create, names,
# keys — are not here; their bad paths have tests of their own).
BAD_STRINGS = {
    "--dtype": "float7", "--device": "tpu", "--lora": "no-equals-sign", "--memory-limit": "lots",
    "--dataset": "nosuch", "--url": "ftp://x", "--lora-policy": "random", "--baseline": "vllm", "--to": "gguf",
    "--concurrency": "1,x", "--request-rate": "fast", "--log-level": "loud", "--max-shard-size": "big",
}


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    d = tmp_path_factory.mktemp("walk")
    inp = d / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return {"run": ["tiny-llama", str(inp)], "serve": ["tiny-llama"], "bench": ["tiny-llama"],
            "warmup": ["tiny-llama"], "quantize": ["tiny-llama", "-o", str(d / "q")],
            "convert": ["tiny-llama", "-o", str(d / "c")], "lora-validate": ["tiny-llama", str(d)],
            "demo": ["--out", str(d / "demo")]}


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    from infer.engine import llm_engine, setup
    from infer.models import loader

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", refuse)
    monkeypatch.setattr(setup, "load_engine_parts", refuse)
    monkeypatch.setattr(loader, "load_model", refuse)


def _cases():
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            if p.param_type_name != "option" or p.is_flag or p.name == "help":
                continue
            flag = next(o for o in p.opts if o.startswith("--"))
            kind = getattr(p.type_descriptor.annotation, "__name__", str(p.type_descriptor.annotation))
            if kind in ("int", "float") or "int" in kind or "float" in kind:
                yield name, flag, "-5"
                yield name, flag, "x"
            elif flag in BAD_STRINGS:
                yield name, flag, BAD_STRINGS[flag]


CASES = list(_cases())


def test_the_walk_covers_every_command():
    assert {c[0] for c in CASES} >= {"run", "serve", "bench", "warmup", "quantize", "convert", "lora-validate"}
    assert len(CASES) > 80


@pytest.mark.parametrize("command,flag,value", CASES, ids=[f"{c}{f}={v}" for c, f, v in CASES])
def test_bad_option_value(args, command, flag, value):
    res = runner.invoke(app, [command, *args[command], flag, value])
    assert res.exit_code == 2, res.output
    assert not (res.exception and not isinstance(res.exception, SystemExit)), res.exception
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines[0].startswith("error: ") and flag in lines[0], res.output
    assert lines[1].strip().startswith("hint: "), res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("argv,message", [
    (["run", "tiny-llama"], "Missing argument"),
    (["run", "tiny-llama", "x.jsonl", "--no-such-option"], "No such option"),
    (["bench", "tiny-llama", "-c", "16", "--max-num-seqs", "4"], "below the largest concurrency 16"),
    (["warmup", "tiny-llama", "--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_usage_mistakes(argv, message):
    res = runner.invoke(app, argv)
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and message in res.output and "hint: " in res.output


def test_help_reads_at_80_columns():
    for name in COMMANDS:
        res = runner.invoke(app, [name, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert res.exit_code == 0, res.output
        assert "…" not in res.output and "[bold]" not in res.output, name
        assert max(len(line) for line in res.output.splitlines()) <= 80, name
    assert "pip install 'infer[quantize]'" in " ".join(runner.invoke(app, ["quantize", "--help"]).output.split())


def test_warmup_takes_the_engine_spellings():
    from infer.cli.warmup import warmup  # noqa: F401 - the command module imports
    names = {o for p in COMMANDS["warmup"].params for o in p.opts}
    assert {"--max-model-len", "--max-num-seqs", "--prefix-caching", "--max-cpu-loras"} <= names
