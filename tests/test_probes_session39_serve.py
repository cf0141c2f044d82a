"""Probes of `infer serve`, session 39: the client's request id (vLLM's X-Request-Id header and body field
`request_id`) was ignored: the response's id was always a fresh uuid, so a client or proxy could not match a reply
to its own id; a chat content part without a type was refused as "has None parts"; a field neither
OpenAI nor vLLM defines (a mistyped max_token) was ignored without a word, where vLLM names it in its log; an
empty `model` (which vLLM runs as the base) was a 404 "the model '' does not exist"; infer:prompt_tokens_total and
infer:generation_tokens_total counted a request only when it finished, so a stream whose client left counted 0
tokens and a long request's throughput showed only at its end (vLLM counts them step by step); the time to first
token was observed only for requests that finished."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_probes_session38_serve import base, engine  # noqa: E402,F401 (the tiny server, per module)

MESSAGES = [{"role": "user", "content": "hi"}]
ROUTES = [("/v1/chat/completions", {"messages": MESSAGES}, "chatcmpl-"), ("/v1/completions", {"prompt": "hi"}, "cmpl-")]


def _ids(r) -> set[str]:
    """The response ids of a whole reply or of every event of a stream."""
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        return {json.loads(e)["id"] for e in events}
    return {r.json()["id"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path, body, prefix", ROUTES, ids=["chat", "completions"])
def test_the_x_request_id_header_names_the_response_and_comes_back(base, path, body, prefix, stream):
    r = httpx.post(base + path, json={**body, "max_tokens": 2, "stream": stream}, headers={"X-Request-Id": "trace-7"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert _ids(r) == {prefix + "trace-7"}
    assert r.headers["x-request-id"] == "trace-7"


@pytest.mark.parametrize("path, body, prefix", ROUTES, ids=["chat", "completions"])
def test_the_body_request_id_names_the_response_and_the_header_wins(base, path, body, prefix):
    r = httpx.post(base + path, json={**body, "max_tokens": 2, "request_id": "mine"}, timeout=60)
    assert r.status_code == 200 and _ids(r) == {prefix + "mine"}
    r = httpx.post(base + path, json={**body, "max_tokens": 2, "request_id": "mine"}, headers={"X-Request-Id": "hdr"},
                   timeout=60)
    assert r.status_code == 200 and _ids(r) == {prefix + "hdr"}


def test_requests_that_send_the_same_id_at_once_all_succeed(base):
    def one(i):
        return httpx.post(base + "/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 8, "n": 2},
                          headers={"X-Request-Id": "same"}, timeout=60)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(one, range(4)))
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    assert all(r.json()["id"] == "cmpl-same" and len(r.json()["choices"]) == 2 for r in replies)


def test_a_request_id_that_is_not_a_string_is_named(base):
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "request_id": 5}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


@pytest.mark.parametrize("part", [{"text": "a"}, {"type": None, "text": "a"}, {"type": 5, "text": "a"}],
                         ids=["missing", "null", "number"])
def test_a_content_part_without_a_type_is_named_as_such(base, part):
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], "max_tokens": 2})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and "messages[0].content[1] has no string 'type'" in error["message"]
    assert "None parts" not in error["message"]


@pytest.mark.parametrize("path, body, prefix", ROUTES, ids=["chat", "completions"])
def test_a_field_neither_openai_nor_vllm_defines_is_named_in_the_log(base, path, body, prefix, caplog):
    known = {"user": "u", "metadata": {"a": "b"}, "priority": 0, "request_id": "r", "stream_options": None}
    with caplog.at_level("WARNING", logger="infer.serve"):
        r = httpx.post(base + path, json={**body, **known, "max_tokens": 2, "max_token": 9, "temprature": 0},
                       timeout=60)
    assert r.status_code == 200, r.text  # ignored, as vLLM ignores it
    lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert lines == ["the following fields were present in the request but ignored: max_token, temprature"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="infer.serve"):
        assert httpx.post(base + path, json={**body, **known, "max_tokens": 2}, timeout=60).status_code == 200
    assert not [rec for rec in caplog.records if "ignored" in rec.getMessage()]


@pytest.mark.parametrize("path, body, prefix", ROUTES, ids=["chat", "completions"])
def test_an_empty_model_name_runs_the_base_as_in_vllm(base, path, body, prefix):
    r = httpx.post(base + path, json={**body, "model": "", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"
    r = httpx.post(base + "/tokenize", json={"prompt": "hi", "model": ""}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 0


def test_retrieving_no_model_id_is_still_a_404(base):
    r = httpx.get(base + "/v1/models/", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "tiny" in r.json()["error"]["message"]


def _metric(base, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=60).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)


def _idle(base) -> None:
    for _ in range(400):  # the engine thread aborts an abandoned request at its next iteration
        engine = httpx.get(base + "/health", timeout=60).json()["engine"]
        if engine["num_in_flight"] == 0 and engine["num_running"] == 0 and engine["kv_blocks_used"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server did not go idle: {engine}")


def test_token_counters_count_what_a_stream_generated_before_its_client_left(base):
    _idle(base)
    prompt, gen = _metric(base, "infer:prompt_tokens_total"), _metric(base, "infer:generation_tokens_total")
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: {")
            if events == 6:
                break  # the client leaves mid-stream
    _idle(base)  # aborted, KV blocks freed
    made = _metric(base, "infer:generation_tokens_total") - gen
    assert 6 <= made <= 200  # was 0: only finished requests were counted
    assert _metric(base, "infer:prompt_tokens_total") - prompt == 4
    assert _metric(base, "infer:num_requests_running") == 0 and _metric(base, "infer:kv_cache_blocks_used") == 0


def test_token_counters_match_the_usage_of_finished_requests(base):
    _idle(base)
    prompt, gen = _metric(base, "infer:prompt_tokens_total"), _metric(base, "infer:generation_tokens_total")
    r = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 7,
                                                               "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 28
    assert _metric(base, "infer:generation_tokens_total") - gen == 28
    assert _metric(base, "infer:prompt_tokens_total") - prompt == 2 * (3 + 2)  # every choice's prefill, as vLLM


def test_the_time_to_first_token_of_a_stream_its_client_left_is_observed(base):
    _idle(base)
    before = _metric(base, "infer:time_to_first_token_seconds_count")
    body = {"messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first token came; the client leaves
    _idle(base)
    assert _metric(base, "infer:time_to_first_token_seconds_count") - before == 1  # was 0: observed at the end only


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "model": "nope"}, 404),
    ("GET", "/nowhere", None, 404),
    ("GET", "/health", None, 200),
    ("POST", "/tokenize", {"prompt": "hi"}, 200),
], ids=["bad-request", "unknown-model", "unknown-route", "health", "tokenize"])
def test_the_x_request_id_header_comes_back_on_every_answer(base, method, path, body, status):
    r = httpx.request(method, base + path, json=body, headers={"X-Request-Id": "err-1"}, timeout=60)
    assert r.status_code == status and r.headers.get("x-request-id") == "err-1"
    assert "x-request-id" not in httpx.request(method, base + path, json=body, timeout=60).headers
