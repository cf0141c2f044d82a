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


# ------------------------------------------------------------------------------------------------ detokenize=False
def test_detokenize_false_gives_the_token_ids_without_text(llm):
    """vLLM: outputs carry token ids only. infer refused it ("infer does not support it")."""
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    ids_only = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False))[0]
    assert plain.text and ids_only.text == ""
    assert ids_only.token_ids == plain.token_ids and ids_only.finish_reason == "length"


def test_detokenize_false_skips_the_detokenizers_work(llm, monkeypatch):
    def no_decoding(*_):
        raise AssertionError("decoded a request that asked for no text")
    det = llm.engine.detokenizer
    monkeypatch.setattr(det, "_decode", no_decoding)
    monkeypatch.setattr(det, "_decode_all", no_decoding)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))[0]
    assert len(out.token_ids) == 4 and out.text == ""


def test_detokenize_false_refuses_stop_strings_as_vllm():
    with pytest.raises(RequestError, match="stop strings need the output text"):
        SamplingParams(stop=["x"], detokenize=False)
    assert SamplingParams(stop_token_ids=[5], detokenize=False).stop_token_ids == [5]
    with pytest.raises(RequestError, match="detokenize must be true or false"):
        SamplingParams(detokenize="no")


def test_a_batch_line_with_detokenize_false_gets_its_token_ids_and_no_text(tmp_path):
    lines = [{"id": "ids", "prompt": PROMPT, "max_new_tokens": 3, "ignore_eos": True, "detokenize": False},
             {"id": "text", "prompt": PROMPT, "max_new_tokens": 3, "ignore_eos": True},
             {"id": "stop", "prompt": PROMPT, "max_new_tokens": 3, "stop": ["x"], "detokenize": False}]
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q"])
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert res.exit_code == 1, res.output  # the stop line's error
    assert recs["ids"]["error"] is None and recs["ids"]["text"] == ""
    assert recs["ids"]["token_ids"] == recs["text"]["token_ids"] and len(recs["ids"]["token_ids"]) == 3
    assert "stop strings need the output text" in recs["stop"]["error"]


# ----------------------------------------------------------------------------- spaces_between_special_tokens=False
@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_gives_the_tokenizers_decode(llm, spaces):
    """The reply's text is `tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=...)`
    (what vLLM's text is); False was refused."""
    tok = llm.get_tokenizer()
    forced = _specials(tok)
    p = SamplingParams(max_tokens=3, ignore_eos=True, skip_special_tokens=False, prefix_token_ids=forced,
                       spaces_between_special_tokens=spaces)
    out = llm.generate([PROMPT], p)[0]
    assert out.token_ids[:len(forced)] == forced
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)


class _JoiningTokenizer:
    """A tokenizer whose decode honours spaces_between_special_tokens (transformers' slow tokenizers of version 4
    did: special tokens' text joined to the rest with a space, or not)."""

    def __init__(self, tok):
        self.tok, self.all_special_ids, self.eos_token_id = tok, tok.all_special_ids, tok.eos_token_id

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        parts, run = [], []
        for i in ids:
            if i in self.all_special_ids and skip_special_tokens:
                continue  # (as transformers 4's slow decode: a skipped token does not split the text)
            if i in self.all_special_ids:
                if run:
                    parts.append(self.tok.decode(run))
                run = []
                parts.append(self.tok.convert_ids_to_tokens(i))
            else:
                run.append(i)
        if run:
            parts.append(self.tok.decode(run))
        return (" " if spaces_between_special_tokens else "").join(parts)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_the_text_is_the_decode_of_a_tokenizer_that_honours_the_spaces(llm, skip, spaces):
    tok = _JoiningTokenizer(llm.get_tokenizer())
    det = Detokenizer(tok)
    ids = _specials(llm.get_tokenizer())
    seq = Sequence("r", [1], SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces))
    for i in ids:  # token by token, as the engine appends them
        seq.output_token_ids.append(i)
        det.update(seq, False)
        assert seq.text == tok.decode(seq.output_token_ids, skip_special_tokens=skip,
                                      spaces_between_special_tokens=spaces)
    assert ("<|endoftext|> <|im_end|>" in seq.text) == (spaces and not skip), seq.text


def test_a_batch_line_with_spaces_between_special_tokens_false_is_answered(tmp_path, llm):
    body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "skip_special_tokens": False,
            "spaces_between_special_tokens": False}
    lines = [{"custom_id": "b", "url": "/v1/completions", "body": body},
             {"id": "p", "prompt": PROMPT, "max_new_tokens": 3, "ignore_eos": True, "skip_special_tokens": False,
              "spaces_between_special_tokens": False}]
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 and all(r.get("error") is None for r in recs), recs


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": PROMPT}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})],
                         ids=["completions", "chat"])
def test_the_server_takes_spaces_between_special_tokens_false(llm, route, body):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    tok = llm.get_tokenizer()
    with serve_in_thread(Server(AsyncEngine(llm.engine, max_queue=8), "tiny")) as url:
        r = httpx.post(url + route, json={**body, "max_tokens": 4, "ignore_eos": True, "skip_special_tokens": False,
                                          "spaces_between_special_tokens": False, "return_token_ids": True},
                       timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert text == tok.decode(choice["token_ids"], skip_special_tokens=False, spaces_between_special_tokens=False)


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
