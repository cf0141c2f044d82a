"""Session 55 probes: a newcomer follows README.md top to bottom on the built-in models and types the obvious
mistakes; each error must name the problem and a command that works with what the project installs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from infer.errors import ModelLoadError
from infer.models.resolve import resolve_model

from helpers import in_empty_hub_cache


def test_an_uncached_hub_id_is_told_a_download_command_the_installed_huggingface_hub_has(tmp_path, monkeypatch):
    """`infer run meta-llama/Llama-2-7b-hf ...` was told to run `huggingface-cli download ...`, a command
    huggingface_hub 1.0 removed (transformers 5 needs it: `hf` is what .venv/bin holds); the hint names `hf download`,
    which every huggingface_hub transformers >= 4.56 takes has."""
    in_empty_hub_cache(tmp_path, monkeypatch)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("meta-llama/Llama-2-7b-hf")
    hint = e.value.hint
    assert "`hf download meta-llama/Llama-2-7b-hf`" in hint and "huggingface-cli" not in hint
    tool = hint.split("`")[1].split()[0]
    assert (Path(sys.executable).parent / tool).exists() or shutil.which(tool)


def test_the_sleep_routes_answer_in_http_terms_not_the_python_apis():
    """`curl -X POST /sleep?level=3` was told `e.g. sleep(level=1)`, `/wake_up?tags=foo` `(None: both)`, and a
    completion while asleep `wake_up() (infer serve: POST /wake_up)`: a client of the server gets the route to
    call, and a bad level or tag names the query parameter."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.models.tiny import ensure_builtin
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(str(ensure_builtin("tiny-llama")), block_size=4, max_model_len=64,
                                    max_num_seqs=2, enable_sleep_mode=True))
    body = {"prompt": [5, 9, 13], "max_tokens": 2}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as url:
        r = httpx.post(f"{url}/sleep?level=3", timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "level" and "POST /sleep?level=1" in err["message"]
        assert "sleep(level" not in err["message"]
        assert httpx.post(f"{url}/sleep?level=2", timeout=60).status_code == 200
        r = httpx.post(f"{url}/wake_up?tags=foo", timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tags" and "POST /wake_up?tags=weights" in err["message"]
        assert "None" not in err["message"] and httpx.get(f"{url}/is_sleeping", timeout=60).json()["is_sleeping"]
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and "wake_up()" not in message and "reload_weights()" not in message
        assert 'POST /wake_up?tags=weights, POST /collective_rpc {"method": "reload_weights"}' in message
        r = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=60)
        assert r.status_code == 400 and "POST /wake_up?tags=weights" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and "load them: reload_weights()" not in message
        assert 'load them: POST /collective_rpc {"method": "reload_weights"}, then retry' in message
        assert httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=60).status_code == 200
        assert httpx.post(f"{url}/sleep?level=1", timeout=60).status_code == 200
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and "(POST /wake_up, then retry)" in message and "wake_up()" not in message
        assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_infer_runs_banner_names_a_built_in_model_as_typed(capsys):
    """`infer run tiny-llama ...` announced `infer: tiny-llama-v2 on cpu, ...` (the cache folder's name, which reads
    as Llama 2), where `infer serve tiny-llama` says `serving tiny-llama` and lists that id."""
    from infer.cli.run import _start_engine
    from infer.engine.config import EngineConfig
    llm = _start_engine(EngineConfig("tiny-llama", block_size=4, max_model_len=64, max_num_seqs=2), quiet=False)
    try:
        banner = capsys.readouterr().err
    finally:
        llm.close()
    assert banner.startswith("infer: tiny-llama on cpu, ") and "-v2" not in banner


def test_resuming_a_finished_run_says_there_is_nothing_to_resume(tmp_path):
    """`infer run ... --resume` on an output that already holds every record said `infer: 0 ok, 0 failed, 0 tokens
    in 0.0 s (0.0 tok/s)`, which reads as a run that did nothing wrong or lost everything; it now says the output is
    already complete (and still exits 1 for the error records it holds, as before)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": [5, 9], "max_new_tokens": 2}\n{"id": "b", "promt": "x"}\n')
    out = tmp_path / "out.jsonl"
    args = ["run", "tiny-llama", str(prompts), "-o", str(out), "--max-model-len", "64", "--max-num-seqs", "2"]
    assert CliRunner().invoke(app, args).exit_code == 1
    before = out.read_bytes()
    result = CliRunner().invoke(app, [*args, "--resume"])
    assert result.exit_code == 1, result.output
    assert f"nothing to resume: {out} already holds a record for each of the 2 request(s)" in result.output
    assert "0 ok, 0 failed" not in result.output and out.read_bytes() == before


def test_a_missing_adapter_typed_with_dot_slash_is_no_hub_id(tmp_path, monkeypatch):
    """README's `--lora support=./adapters/support`, run where no `adapters` folder is, was told that
    'adapters/support' reads as a hub id and to `hf download adapters/support`: Path had dropped the `./` the user
    typed. A path written with `./` is local; ORG/NAME written bare is still a hub id."""
    from infer.engine.config import parse_loras
    from infer.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        parse_loras(["support=./adapters/support"])
    assert "hub id" not in e.value.hint and "download" not in e.value.hint
    assert str(tmp_path) in e.value.hint  # where a relative path is read from
    with pytest.raises(ConfigError) as e:
        parse_loras(["sql=org/sql-lora"])
    assert "hf download org/sql-lora" in e.value.hint


def test_bench_says_what_runs_when_its_progress_bars_cannot_draw(tmp_path):
    """README's first `infer bench llama-100m ... --baseline hf`, logged to a file (CI, `2>&1 | tee`), printed
    nothing for its 10 minutes on the 2-core machine: rich's bars draw only on a terminal. Each level (and each
    baseline level) now says what runs on a stderr that is no terminal; --quiet keeps it silent."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    args = ["bench", "tiny-llama", "--num-prompts", "2", "--concurrency", "1,2", "--input-len", "4",
            "--output-len", "2", "--max-model-len", "64"]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "infer bench: 2 requests at concurrency 1 ..." in result.output
    assert "infer bench: 2 requests at concurrency 2 ..." in result.output
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "q"), "--quiet"])
    assert result.exit_code == 0 and "requests at concurrency" not in result.output, result.output


def test_bench_url_with_a_wrong_served_model_name_is_told_the_servers_id(monkeypatch):
    """`infer bench ./model --url ... --served-model-name llama` against a server of another id was told `pass
    --served-model-name ID for the base`: the option it had just passed. The hint names the id the server lists
    for its base (its card without a parent)."""
    import httpx

    from infer.cli.bench import check_url
    from infer.errors import ConfigError
    cards = [{"id": "tiny-llama", "parent": None}, {"id": "support", "parent": "tiny-llama"}]
    monkeypatch.setattr(httpx, "get", lambda *a, **k: httpx.Response(200, json={"data": cards}))
    with pytest.raises(ConfigError) as e:
        check_url("http://127.0.0.1:8000", "llama", [], None)
    assert "does not serve 'llama'" in e.value.message
    assert e.value.hint.startswith("pass --served-model-name tiny-llama ")
    with pytest.raises(ConfigError) as e:
        check_url("http://127.0.0.1:8000", "tiny-llama", ["legal"], None)
    assert "--served-model-name" not in e.value.hint and "--lora" in e.value.hint
    assert check_url("http://127.0.0.1:8000", "tiny-llama", ["support"], None) == "http://127.0.0.1:8000"


def test_a_missing_adapter_loaded_at_runtime_with_dot_slash_is_no_hub_id(tmp_path, monkeypatch):
    """POST /v1/load_lora_adapter {"lora_path": "./adapters/nope"} (and LLM.add_lora) got the same 'reads as a
    Hugging Face hub id ... hf download adapters/nope' hint as --lora did."""
    from infer.errors import LoRAError
    from infer.lora.adapter import read_adapter
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LoRAError) as e:
        read_adapter("x", "./adapters/nope")
    assert "folder not found" in str(e.value) and "hub id" not in str(e.value) and "download" not in str(e.value)
    with pytest.raises(LoRAError) as e:
        read_adapter("x", "org/sql-lora")
    assert "hf download org/sql-lora" in str(e.value)


def test_lora_validate_of_a_missing_dot_slash_adapter_is_no_hub_id(tmp_path, monkeypatch):
    """README's `infer lora-validate BASE support=./adapters/support ./adapters/legal`, run where those folders are
    not, was told 'adapters/support' reads as a hub id, and to `hf download` it."""
    from infer.lora.validate import parse_adapter_args, static_report
    from infer.models.loader import load_config
    from infer.models.tiny import ensure_builtin
    monkeypatch.chdir(tmp_path)
    adapters = parse_adapter_args(["support=./adapters/support", "./adapters/legal"])
    assert sorted(adapters) == ["legal", "support"]
    config = load_config(ensure_builtin("tiny-llama"))
    for name, path in adapters.items():
        problem = static_report(name, path, config, None).problems[0]
        text = f"{problem.message} {problem.hint}"
        assert "folder not found" in text and "hub id" not in text and "download" not in text
        assert path == tmp_path / "adapters" / name  # (the error line names it so)


def test_bench_says_what_runs_when_stdout_is_piped_and_stderr_is_a_terminal(monkeypatch, capsys):
    """`infer bench ... | tee log`: stdout (where rich's bars draw) is a pipe, so no bar shows; stderr is the terminal,
    and the lines that say what runs went only where stderr was no terminal: nothing showed at all. The lines now
    follow the bars' console, not stderr."""
    import sys

    from rich import get_console

    from infer.bench.plan import _say
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert not get_console().is_terminal  # pytest captures stdout: no bar would draw
    _say(type("Plan", (), {"quiet": False})(), "2 requests at concurrency 1")
    assert "infer bench: 2 requests at concurrency 1 ..." in capsys.readouterr().err
