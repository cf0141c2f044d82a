"""`infer run` and the Python API against inputs found by probing as a hostile user (session 8): chat content as
OpenAI's list of parts, ... The server's probes are in test_serve_probes_session8.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.batch_io import read_inputs
from infer.cli.main import app
from infer.engine.setup import load_tokenizer
from infer.models.resolve import resolve_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("tiny-llama"))


def _read(tmp_path, tokenizer, *objs) -> dict:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(json.dumps(o).encode() + b"\n" for o in objs))
    return {item.id: item for item in read_inputs(path, tokenizer, {"max_new_tokens": 4})}


def _chat(tokenizer, text: str) -> list[int]:
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=True)
    return list(enc["input_ids"])


def test_chat_content_as_a_list_of_text_parts_is_the_text_not_its_python_repr(tmp_path, tokenizer):
    """OpenAI clients (and Batch API files) send content as [{"type": "text", "text": ...}]: the chat template
    rendered "[{'type': 'text', 'text': 'hi'}]" into the prompt, and the reply was to that."""
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    batch = {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "x", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}}
    items = _read(tmp_path, tokenizer, {"id": "a", "messages": [{"role": "user", "content": parts}]}, batch,
                  {"id": "none", "messages": [{"role": "user", "content": None}]})
    assert items["a"].request.prompt_token_ids == _chat(tokenizer, "hello")
    assert items["b"].request.prompt_token_ids == _chat(tokenizer, "hello")
    assert items["none"].request.prompt_token_ids == _chat(tokenizer, "")


@pytest.mark.parametrize("message,error", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]},
     "messages[0].content has image_url parts; only text parts are supported"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "every text part needs a string 'text'"),
    ({"role": "user", "content": 42}, "messages[0].content must be a string or a list of text parts, got int"),
    ({"role": 5, "content": "hi"}, "messages[0].role must be a string, got int"),
])
def test_chat_content_the_model_cannot_read_is_refused_not_rendered(tmp_path, tokenizer, message, error):
    items = _read(tmp_path, tokenizer, {"id": "a", "messages": [message]}, {"id": "ok", "prompt": "hi"})
    assert error in items["a"].error and items["a"].request is None
    assert items["ok"].error is None


def test_llm_chat_parts_are_joined(tokenizer):
    from infer.engine.inputs import encode_prompt
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert encode_prompt(tokenizer, messages=parts) == _chat(tokenizer, "hello")
