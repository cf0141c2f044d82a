"""Review probes of the nineteenth session's sampling extensions, n, prompt_logprobs and echo: a stop token id
outside the vocabulary under min_tokens (masked another row's token, or crashed the step), a logit_bias key that is
a Unicode digit (a 500), engine-refused fields named as `prompt`, and echo's prompt_logprobs, token_ids and
min_tokens with max_tokens 0."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.errors import RequestError

from helpers import served_tiny_llama


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", block_size=4) as llm:
        yield llm


def test_min_tokens_with_a_stop_token_id_outside_the_vocabulary_runs(llm):
    """vLLM's min_tokens masks the stop token ids; one the model cannot sample must not be masked as the flat index
    row * vocab + id, which is past the batch (IndexError: every request of the step failed) or another row's
    token (its reply changed)."""
    vocab = llm.engine.model_config.vocab_size
    alone = llm.generate(["hello world"], SamplingParams(max_new_tokens=4, min_tokens=2,
                                                         stop_token_ids=[vocab * 10]))[0]
    assert alone.finish_reason == "length" and len(alone.token_ids) == 4, alone.error
    plain = llm.generate(["the cat"], SamplingParams(max_new_tokens=3))[0].token_ids
    beside = llm.generate(["hello world", "the cat"],
                          [SamplingParams(max_new_tokens=3, min_tokens=3, stop_token_ids=[vocab + plain[0]]),
                           SamplingParams(max_new_tokens=3)])
    assert beside[1].token_ids == plain


def test_a_logit_bias_key_of_unicode_digits_is_a_request_error():
    """"²".isdigit() is true but int("²") raises a bare ValueError (a 500 in the server)."""
    with pytest.raises(RequestError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"\u00b2": 1.0})


@pytest.fixture(scope="module")
def base():
    pytest.importorskip("httpx")
    yield from served_tiny_llama()


def _post(base, **body):
    import httpx
    return httpx.post(f"{base}/v1/completions", json={"prompt": "hello world", "max_tokens": 2, **body}, timeout=60)


@pytest.mark.parametrize("body, param", [
    (dict(logit_bias={"100000": 5}), "logit_bias"),
    (dict(allowed_token_ids=[100000]), "allowed_token_ids"),
    (dict(logit_bias={"\u00b2": 5}), "logit_bias"),
])
def test_refused_extension_values_name_their_field(base, body, param):
    r = _post(base, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_min_tokens_with_an_out_of_vocabulary_stop_token_is_served(base):
    r = _post(base, min_tokens=2, stop_token_ids=[100000])
    assert r.status_code == 200, r.text


def test_echo_keeps_the_bodys_prompt_logprobs_count(base):
    """echo with logprobs 3 computes 3 alternatives per prompt token; the body's prompt_logprobs 1 still gets vLLM's
    at most 2 entries (the prompt's token and the most likely one)."""
    r = _post(base, echo=True, logprobs=3, prompt_logprobs=1, max_tokens=1)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(1 <= len(e) <= 2 for e in entries[1:]), entries


def test_echo_with_max_tokens_0_returns_no_token_ids(base):
    r = _post(base, echo=True, max_tokens=0, return_token_ids=True)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["token_ids"] == [] and r.json()["usage"]["completion_tokens"] == 0


def test_echo_with_max_tokens_0_and_min_tokens_names_what_the_client_sent(base):
    r = _post(base, echo=True, max_tokens=0, min_tokens=2)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "min_tokens" and "max_tokens (0)" in err["message"], err
