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
                                          ("8kb", ["whole number"]), ("-4k", ["range", "2<=x"])])
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
    """`infer run org/tiny` on a model the hub cache holds (hf download, or transformers/vLLM before)
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
    assert str(tmp_path / "hub") in e.value.hint and "hf download org/absent" in e.value.hint


def _capped_model(tmp_path, cap):
    """tiny-llama with generation_config.json's max_new_tokens set to `cap`."""
    import shutil

    from infer.models.tiny import ensure_builtin
    folder = tmp_path / "capped"
    shutil.copytree(ensure_builtin("tiny-llama"), folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": cap}))
    return folder


@pytest.mark.parametrize("chat, body, expected", [
    (True, {}, 5), (True, {"max_tokens": 50}, 5), (True, {"max_completion_tokens": 3}, 3),
    (False, {}, 5), (False, {"max_tokens": 50}, 5), (False, {"max_tokens": 2}, 2)])
def test_generation_configs_max_new_tokens_caps_every_server_request_as_vllm(tmp_path, chat, body, expected):
    """vLLM reads generation_config.json's max_new_tokens as a cap on every OpenAI request (the least of it, the
    request's max_tokens and the context's room); infer's server let a request run to its own max_tokens."""
    pytest.importorskip("fastapi")
    from transformers import AutoTokenizer

    import infer.serve.protocol as p
    from infer.engine.inputs import openai_sampling_defaults
    folder = _capped_model(tmp_path, 5)
    tok = AutoTokenizer.from_pretrained(folder)
    defaults = openai_sampling_defaults(folder)
    if chat:
        req = p.parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, tok, 4096, defaults)
    else:
        req = p.parse_completion({"prompt": "hi", **body}, tok, 4096, defaults)
    assert req.params.max_new_tokens == expected
    req = p.parse_completion({"prompt": "hi", "min_tokens": 8}, tok, 4096, defaults)
    with pytest.raises(p.ApiError) as e:  # after the context's checks (session 43), as vLLM's order
        p.check_context(req, 4096)
    assert e.value.param == "min_tokens" and "generation_config.json" in str(e.value)


def test_generation_configs_max_new_tokens_caps_batch_lines_not_plain_ones(tmp_path):
    """`infer run`'s OpenAI batch lines are answered as the server answers them (capped); plain lines, like
    LLM.generate, take their own max_new_tokens."""
    folder = _capped_model(tmp_path, 4)
    lines = [{"custom_id": "b", "url": "/v1/completions",
              "body": {"prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}},
             {"id": "p", "prompt": "hello", "max_new_tokens": 12, "ignore_eos": True}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(app, ["run", str(folder), str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}
    assert len(records["b"]["token_ids"]) == 4 and records["b"]["finish_reason"] == "length"
    assert len(records["p"]["token_ids"]) == 12


def test_vllm_programs_spelling_out_defaults_run_unchanged():
    """vLLM programs pass logits_processors=[] and LLM.chat's chat_template_content_format="auto" /
    mm_processor_kwargs=None at their defaults: a RequestError and bare TypeErrors here; other values are refused
    by name."""
    from infer import LLM
    from infer.engine.sampling_params import SamplingParams
    from infer.errors import RequestError
    params = SamplingParams(max_new_tokens=3, logits_processors=[])
    with pytest.raises(RequestError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with LLM("tiny-llama", max_model_len=64) as llm:
        msgs = [{"role": "user", "content": "hi"}]
        want = llm.chat(msgs, params)[0].token_ids
        got = llm.chat(msgs, params, chat_template_content_format="auto", mm_processor_kwargs=None)[0].token_ids
        assert got == want
        with pytest.raises(RequestError, match="chat_template_content_format='openai'"):
            llm.chat(msgs, params, chat_template_content_format="openai")
        with pytest.raises(RequestError, match="mm_processor_kwargs"):
            llm.chat(msgs, params, mm_processor_kwargs={"size": 3})


def test_a_request_whose_choices_the_free_slots_start_at_once_is_not_refused_for_the_queue():
    """--max-queue counts requests that cannot start at once; a body of n=8 at an idle server with 64 free slots and
    --max-queue 4 waits for nothing, but was a 400 "more than the 4 requests the server lets wait"."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=16))
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=4), "tiny-llama")) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "n": 8, "max_tokens": 2, "seed": 1},
                       timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"]) == 8, r.text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b"], "n": 11, "max_tokens": 2}, timeout=120)
        assert r.status_code == 400 and "22 choices" in r.json()["error"]["message"], r.text


def test_an_adapter_removed_while_in_use_is_freed_by_the_step_its_last_request_ends(tmp_path):
    """An unloaded adapter's memory was freed at the step after its last request ended; an idle server takes no
    such step, so it kept the weights (and the slot) until the next request came."""
    from pathlib import Path

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.engine.sampling_params import SamplingParams
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float, save_adapter
    adapter = save_adapter(hf_float(Path(ensure_builtin("tiny-llama"))), tmp_path / "a", seed=3, r=4)
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, enable_lora=True, max_loras=1, max_lora_rank=8))
    try:
        engine.add_lora("a", str(adapter))
        engine.add_request("r", list(range(5, 15)), SamplingParams(max_new_tokens=4, ignore_eos=True), lora="a")
        engine.step()
        assert engine.remove_lora("a") == 1 and engine.lora_manager.retired()
        finished = False
        while not finished:
            finished = any(out.finished for out in engine.step())
        assert engine.lora_manager.retired() == []  # no further step needed
    finally:
        engine.close()
