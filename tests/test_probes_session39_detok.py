"""Probes of vLLM's sampling options, session 39: detokenize=False and spaces_between_special_tokens=False were
refused (SamplingParams, batch lines, the server); a token of generation_config.json's eos_token_id list that is not
the tokenizer's EOS ended a reply with stop_reason None where vLLM (which stops at it as a stop token id) reports
its id; an OpenAI batch line with "model": "" was refused as a typo when adapters were registered, where the server
(and vLLM) run the base model."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.batch_io import read_inputs
from infer.cli.main import app
from infer.engine.detokenizer import Detokenizer
from infer.engine.inputs import ModelNames
from infer.engine.sequence import Sequence
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin

runner = CliRunner()
PROMPT = "hello world"


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), block_size=4)


def _specials(tokenizer) -> list[int]:
    """A reply with special tokens between and beside ordinary ones."""
    words = tokenizer("hello world")["input_ids"]
    eos, other = tokenizer.all_special_ids[0], tokenizer.all_special_ids[-1]
    return [eos, *words, other, eos, *words]


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# ------------------------------------------------------------------------ generation_config's other eos_token_ids
@pytest.fixture(scope="module")
def two_eos(tmp_path_factory, llm, path):
    """tiny-llama with generation_config.json's eos_token_id [tokenizer's EOS, the first token its greedy reply
    to PROMPT has]: that reply stops at once on the second, not the tokenizer's EOS."""
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, ignore_eos=True))[0].token_ids[0]
    eos = llm.get_tokenizer().eos_token_id
    assert first != eos
    folder = tmp_path_factory.mktemp("two-eos") / "model"
    shutil.copytree(path, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos, first]}))
    return folder, first


def test_a_generation_config_eos_that_is_not_the_tokenizers_is_the_stop_reason(two_eos):
    """vLLM stops at generation_config's other eos ids as stop_token_ids: stop_reason is the id (None was given)."""
    folder, first = two_eos
    other = LLM(str(folder), block_size=4)
    out = other.generate([PROMPT], SamplingParams(max_tokens=5))[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first
    assert out.text == ""  # the stop token's text is left out, as vLLM's
    kept = other.generate([PROMPT], SamplingParams(max_tokens=5, include_stop_str_in_output=True))[0]
    assert kept.stop_reason == first
    assert kept.text == other.get_tokenizer().decode([first], skip_special_tokens=True)


def test_the_tokenizers_eos_keeps_stop_reason_none(two_eos):
    folder, first = two_eos
    other = LLM(str(folder), block_size=4)
    eos = other.get_tokenizer().eos_token_id
    out = other.generate([PROMPT], SamplingParams(max_tokens=5, logit_bias={eos: 100}))[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    # a stop_token_ids entry is its own id, even the EOS with ignore_eos (vLLM checks EOS first, unless ignored)
    out = other.generate([PROMPT], SamplingParams(max_tokens=5, logit_bias={eos: 100}, ignore_eos=True,
                                                  stop_token_ids=[eos]))[0]
    assert out.stop_reason == eos


def test_an_infer_run_record_carries_the_generation_config_eos_as_stop_reason(tmp_path, two_eos):
    folder, first = two_eos
    lines = [{"id": "a", "prompt": PROMPT, "max_new_tokens": 5},
             {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": PROMPT, "max_tokens": 5,
                                                                   "temperature": 0}}]
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", str(folder), str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["a"]["stop_reason"] == first and recs["a"]["finish_reason"] == "stop"
    assert recs["b"]["stop_reason"] == first and recs["b"]["finish_reason"] == "stop"


def test_the_servers_choice_carries_the_generation_config_eos_as_stop_reason(two_eos):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    folder, first = two_eos
    engine = LLMEngine(EngineConfig(str(folder), max_model_len=128, block_size=4, max_num_seqs=2))
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=8), "tiny")) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0},
                       timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == first


# ------------------------------------------------------------------------ an empty body.model with adapters
def test_a_batch_lines_empty_model_runs_the_base_with_adapters_registered(tmp_path, llm):
    """The server runs the base for "model": "" (as vLLM); `infer run` refused it as a typo when adapters were
    registered ("body.model '' is neither the base model nor a registered adapter")."""
    names = ModelNames(frozenset({"tiny-llama"}), frozenset({"support"}))
    assert names.lora_for("") is None and names.lora_for(None) is None and names.lora_for("support") == "support"
    line = {"custom_id": "e", "url": "/v1/completions", "body": {"prompt": PROMPT, "max_tokens": 2, "model": ""}}
    path = _write(tmp_path / "in.jsonl", [line])
    items = list(read_inputs(path, llm.get_tokenizer(), {"max_new_tokens": 4}, names))
    assert items[0].error is None and items[0].request.lora is None
