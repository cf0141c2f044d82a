"""`infer run` and the Python API against inputs found by probing as a hostile user (session 8): chat content as
OpenAI's list of parts or images, OpenAI batch lines whose body.model names an adapter, whose url or prompt list
infer cannot answer or that ask for vLLM features infer does not do, and prompts so long that tokenizing them
cost seconds and gigabytes before they were refused. The server's probes are in test_serve_probes_session8.py."""

from __future__ import annotations

import json

import pytest

from infer.cli.batch_io import model_names, read_inputs
from infer.engine.inputs import ModelNames
from infer.engine.setup import load_tokenizer
from infer.models.resolve import resolve_model


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
    assert items["a"].request.prompt_token_ids == _chat(tokenizer, "hel\nlo")  # joined by newlines, as vLLM does
    assert items["b"].request.prompt_token_ids == _chat(tokenizer, "hel\nlo")
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


def _batch(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
    body.setdefault("messages" if url.endswith("chat/completions") else "prompt",
                    [{"role": "user", "content": "hi"}] if url.endswith("chat/completions") else "hi")
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"max_tokens": 2, **body}}


def test_a_batch_lines_model_picks_the_adapter_it_names_as_in_vllm(tmp_path, tokenizer):
    """`vllm run-batch` runs the adapter a line's body.model names; infer ignored body.model, so every line of a
    batch file written for adapters silently ran the base model."""
    names = ModelNames(frozenset({"tiny-llama"}), frozenset({"support", "legal"}))
    path = tmp_path / "in.jsonl"
    lines = [_batch("a", model="support"), _batch("b", model="tiny-llama"), _batch("c"),
             _batch("d", model="legal", lora="support"), _batch("typo", model="suport"), _batch("int", model=5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    items = {item.id: item for item in read_inputs(path, tokenizer, {"max_new_tokens": 4}, names)}
    assert [items[k].request.lora for k in "abcd"] == ["support", None, None, "support"]  # `lora` wins
    assert "body.model 'suport' is neither the base model nor a registered adapter" in items["typo"].error
    assert "tiny-llama, legal, support" in items["typo"].error
    assert "body.model must be a string" in items["int"].error
    names = ModelNames(frozenset({"tiny-llama"}))  # no adapters: a name of no model is still an error (vLLM's 404)
    items = {item.id: item for item in read_inputs(path, tokenizer, {"max_new_tokens": 4}, names)}
    assert all(items[k].request.lora is None for k in "bc") and items["d"].request.lora == "support"
    assert all("is neither the base model nor a registered adapter" in items[k].error for k in ("a", "typo"))


def test_model_names_of_a_run_are_its_model_as_given_and_its_adapters(tmp_path):
    from infer.engine.config import EngineConfig
    names = model_names(EngineConfig("tiny-llama", loras={"support": str(tmp_path)}))
    assert "tiny-llama" in names.base and names.adapters == {"support"}


def test_batch_lines_the_run_cannot_answer_say_so(tmp_path, tokenizer):
    """An embeddings line said 'no prompt' (it is read as one now: --runner pooling answers it, a generating run
    refuses it when it runs), another url names the ones infer run answers, top_logprobs "abc" gave a bare
    ValueError, and a completions prompt of token ids (which OpenAI and vLLM accept) was refused as 'prompt must
    be a string'."""
    items = _read(tmp_path, tokenizer,
                  _batch("emb", "/v1/embeddings", input="hi"),
                  _batch("aud", "/v1/audio/transcriptions", prompt="hi"),
                  _batch("top", logprobs=True, top_logprobs="abc"),
                  _batch("ids", "/v1/completions", prompt=[5, 6, 7]),
                  _batch("one", "/v1/completions", prompt=["hello"]),
                  _batch("one_ids", "/v1/completions", prompt=[[5, 6]]),
                  _batch("two", "/v1/completions", prompt=["a", "b"]),
                  _batch("none", "/v1/completions", prompt=[]))
    assert items["emb"].error is None and items["emb"].request.openai["embedding"]
    assert items["emb"].request.prompt_token_ids == list(tokenizer("hi")["input_ids"])
    assert "url '/v1/audio/transcriptions' is not supported" in items["aud"].error
    assert "/v1/embeddings with --runner pooling" in items["aud"].error
    assert "body.top_logprobs must be an integer in 0..20, got 'abc'" in items["top"].error
    assert items["ids"].request.prompt_token_ids == [5, 6, 7]
    assert items["one"].request.prompt_token_ids == list(tokenizer("hello")["input_ids"])
    assert items["one_ids"].request.prompt_token_ids == [5, 6]
    assert "body.prompt holds 2 prompts; a batch line answers one" in items["two"].error
    assert "body.prompt is an empty list" in items["none"].error


def test_batch_lines_asking_for_what_infer_does_not_do_get_error_records(tmp_path, tokenizer):
    """min_tokens, guided_json or top_logprobs without logprobs gave a record that ignored them (two structured
    outputs at once are refused now that one is supported)."""
    items = _read(tmp_path, tokenizer, _batch("min", use_beam_search=True, n=11),
                  _batch("guided", guided_json={"type": "object"}, guided_regex="a+"), _batch("top", top_logprobs=2),
                  _batch("ok", min_tokens=0, top_logprobs=2, logprobs=True))
    assert "body.n (the beam width of use_beam_search) must be an integer in 1..10" in items["min"].error
    assert "one structured output, got body.guided_json, body.guided_regex" in items["guided"].error
    assert "body.logprobs is not true" in items["top"].error
    assert items["ok"].error is None and items["ok"].request.params.logprobs == 2


def test_a_prompt_far_longer_than_the_context_is_refused_before_it_is_tokenized(tmp_path, tokenizer, monkeypatch):
    """A 24 MB line took 29 s and 4 GB of memory to tokenize, only to be refused as too long (and every such line
    of a file was held, tokenized, until all were read)."""
    from infer.engine.prompt_size import PromptTooLongError, longest_token_bytes
    longest = longest_token_bytes(tokenizer)
    assert longest >= max(len(t.encode()) for t in tokenizer.get_vocab())
    calls = []
    real = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, **k: calls.append(len(text)) or
                        real(self, text, **k))
    huge = "hello world " * 100_000
    items = _read_capped(tmp_path, tokenizer, 512, {"id": "huge", "prompt": huge},
                         {"id": "chat", "messages": [{"role": "user", "content": huge}]},
                         {"id": "edge", "prompt": "a" * (512 * longest * 2 - 1)}, {"id": "ok", "prompt": "hi"})
    assert "the prompt is 1,200,000 bytes long, at least" in items["huge"].error
    assert "which leaves no room under the context of 512 tokens" in items["huge"].error
    assert "no room under the context of 512 tokens" in items["chat"].error
    assert items["edge"].error is None and items["ok"].error is None  # below the bound: tokenized as before
    assert len(huge) not in calls
    with pytest.raises(PromptTooLongError):
        from infer.engine.inputs import encode_prompt
        encode_prompt(tokenizer, prompt=huge, max_tokens=512)


def _read_capped(tmp_path, tokenizer, max_tokens, *objs) -> dict:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(json.dumps(o).encode() + b"\n" for o in objs))
    return {item.id: item for item in read_inputs(path, tokenizer, {"max_new_tokens": 4}, max_tokens=max_tokens)}
