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
