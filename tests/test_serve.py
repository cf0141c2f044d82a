"""`infer serve`: the official openai client against an in-process server, raw HTTP errors, auth, adapters by model
id, --max-queue, client disconnects, engine faults, and SIGTERM on a subprocess server."""

from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")  # the serve extra (the GPU machine has no server packages)
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from helpers import StepGate, hf_greedy, serve_process, wait_until

from infer.engine.llm_engine import LLMEngine
from infer.engine.config import EngineConfig
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine

MAX_LEN = 256


def make_adapter(base_path: Path, out: Path, seed: int = 3) -> Path:
    """A PEFT LoRA adapter with random non-zero weights for the built-in tiny-llama."""
    from lora_helpers import hf_float, save_adapter
    return save_adapter(hf_float(base_path), out, seed, scale=0.5, r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def model_path():
    from infer.models.tiny import ensure_builtin
    return Path(ensure_builtin("tiny-llama"))


@pytest.fixture(scope="module")
def adapter(model_path, tmp_path_factory):
    return make_adapter(model_path, tmp_path_factory.mktemp("lora") / "pirate")


@pytest.fixture(scope="module")
def engine(adapter):
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=MAX_LEN, max_lora_rank=8,
                                  loras={"pirate": str(adapter)}))


_wait = wait_until  # (helpers.py)


def _idle(url: str) -> dict:
    """Wait until the engine is idle; return /health's engine stats."""
    stats = {}

    def check():
        nonlocal stats
        stats = httpx.get(f"{url}/health").json()["engine"]
        return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_in_flight"] == 0
    assert _wait(check), stats
    return stats


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


# ---------------------------------------------------------------------------------------------- the openai client
@pytest.fixture(scope="module")
def llm():
    from infer.engine.llm import LLM
    return LLM("tiny-llama", max_model_len=MAX_LEN)


def test_completion_tokens_equal_transformers_and_llm(client, llm, model_path):
    from infer.engine.sampling_params import SamplingParams
    prompt = [5, 17, 99, 230, 41, 7]
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == hf_greedy(str(model_path), prompt, 12)
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 12 and r.usage.total_tokens == 18
    assert r.choices[0].finish_reason == "length" and r.model == "tiny-llama" and r.object == "text_completion"
    # the same request through LLM.generate (what `infer run` does) gives the same tokens and text
    want = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert ids == want.token_ids and r.choices[0].text == want.text


def test_chat_matches_llm_generate(client, llm):
    from infer.engine.sampling_params import SamplingParams
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the rain in spain"}]
    r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True})
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.object == "chat.completion"
    want = llm.generate([msgs], SamplingParams(max_new_tokens=10))[0]
    assert msg.content == want.text and r.choices[0].model_extra["token_ids"] == want.token_ids
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_sampling_left_out_is_openai_temperature_one(client, llm):
    """As OpenAI and vLLM: a request without temperature samples at 1 (tiny-llama's generation_config.json sets no
    sampling), it is not greedy: with a seed it equals LLM.generate at temperature 1 with that seed."""
    from infer.engine.sampling_params import SamplingParams
    prompt = [5, 17, 99, 230, 41, 7]
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=16, seed=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    sampled = llm.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=3))[0]
    greedy = llm.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    assert r.choices[0].model_extra["token_ids"] == sampled.token_ids != greedy.token_ids


def test_streaming_deltas_concatenate_to_the_full_text(client):
    kw = dict(model="tiny-llama", prompt="hello world, how", max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])

    msgs = [{"role": "user", "content": "tell me"}]
    kw = dict(model="tiny-llama", messages=msgs, max_tokens=15, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message
    events = list(client.chat.completions.create(stream=True, **kw))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == full.content
    assert events[-1].choices[0].finish_reason in ("stop", "length")


def test_raw_stream_ends_with_done(url):
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "a b", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] is not None


def test_a_streamed_event_with_a_unicode_line_separator_stays_one_line(url):
    """Text with U+2028, U+2029 or U+0085 (a random model's reply may hold them; here a structured output forces
    them): httpx's iter_lines, like str.splitlines, breaks a line there, so the server escapes them in its JSON; CI
    once failed reading a cut event."""
    reply = "a\u2028b\u2029c\x85d"
    body = {"prompt": "x", "max_tokens": 40, "stream": True, "structured_outputs": {"choice": [reply]}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]", lines
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text == reply, text

def test_models_lists_base_and_adapters(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-llama", "pirate"]


def test_adapter_by_model_id(client, model_path, adapter):
    """`model` = an adapter's name runs that adapter (vLLM's rule); the oracle is peft on the same weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    prompt = [9, 8, 7, 6, 5, 4, 3]
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    peft_model.generation_config.eos_token_id = None
    with torch.no_grad():
        want = peft_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = want[0, len(prompt):].tolist()
    extra = {"ignore_eos": True, "return_token_ids": True}
    got = client.completions.create(model="pirate", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)
    assert got.choices[0].model_extra["token_ids"] == want and got.model == "pirate"
    base_ids = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body=extra)
    assert base_ids.choices[0].model_extra["token_ids"] == hf_greedy(str(model_path), prompt, 8) != want


def test_unknown_model_is_404(client, url):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user",
                                                                                      "content": "x"}]})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found" and err["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------------------------- raw bad requests
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "model": 3}, 400, "model"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * MAX_LEN}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * 100, "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "missing-adapter"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "f"}]}, 400,
     "tools"),
    ("/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests_get_openai_errors(url, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}{path}", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_logprobs(client):
    r = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=4, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 and max(t.values()) >= l - 1e-5 for t, l in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=True, top_logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)


def _errors_500(text: str) -> float:
    """/metrics' count of /v1/completions answered 500."""
    m = re.search(r'infer:http_requests_total\{route="/v1/completions",status="500"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_metrics_and_health(url, client):
    before = _errors_500(httpx.get(f"{url}/metrics").text)  # (the fault tests' 500s, if they ran first)
    client.completions.create(model="tiny-llama", prompt="count me", max_tokens=3)
    text = httpx.get(f"{url}/metrics").text
    for name in ("infer:http_requests_total", "infer:prompt_tokens_total", "infer:generation_tokens_total",
                 "infer:num_requests_waiting", "infer:num_requests_running", "infer:kv_cache_usage_perc",
                 "infer:time_to_first_token_seconds_bucket", "infer:e2e_request_latency_seconds_count"):
        assert name in text
    assert re.search(r'infer:http_requests_total\{route="/v1/completions",status="200"\} [1-9]', text)
    assert _errors_500(text) == before
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["engine"]["kv_blocks_total"] > 0


# ---------------------------------------------------------------------------------------------- auth, queue, faults
def test_api_key(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama", api_key="s3cret")) as base:
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny-llama", prompt="x", max_tokens=2).usage.completion_tokens >= 1


_Gate = StepGate  # (helpers.py)


def _send_held(base, gate, n: int) -> tuple[list, list]:
    """n requests sent while the engine's step is held; (threads, responses) once all are in flight."""
    body = {"prompt": "wait", "max_tokens": 3}
    results = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(f"{base}/v1/completions", json=body,
                                                                         timeout=30)))
               for _ in range(n)]
    for t in threads:
        t.start()
    assert _wait(lambda: httpx.get(f"{base}/health").json()["engine"]["num_in_flight"] == n)
    return threads, results


def test_max_queue_gives_503_with_retry_after():
    """One request runs (--max-num-seqs 1), two may wait (--max-queue 2): the fourth is a 503."""
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=MAX_LEN, max_num_seqs=1))
    body = {"prompt": "wait", "max_tokens": 3}
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=2), "tiny-llama")) as base, _Gate(engine) as gate:
        gate.open.clear()
        threads, results = _send_held(base, gate, 3)
        r = httpx.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        gate.open.set()
        for t in threads:
            t.join(30)
        assert [x.status_code for x in results] == [200, 200, 200]
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
    engine.close()


def test_a_burst_the_engine_can_start_at_once_is_not_a_queue(engine):
    """--max-queue 2 refused the third of three requests sent at once to an idle engine with 64 free slots: every
    request not yet admitted by the engine thread counted as waiting."""
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=2), "tiny-llama")) as base, _Gate(engine) as gate:
        gate.open.clear()
        threads, results = _send_held(base, gate, 6)
        gate.open.set()
        for t in threads:
            t.join(30)
        assert [x.status_code for x in results] == [200] * 6, [x.text for x in results]


def test_disconnect_aborts_and_frees_blocks(url, engine):
    body = {"prompt": "a long story", "max_tokens": 200, "ignore_eos": True}
    aborted, real = [], engine.abort_request

    def abort_request(rid):
        if rid in engine.requests:
            aborted.append(len(engine.requests[rid].output_token_ids))
        real(rid)
    engine.abort_request = abort_request
    with _Gate(engine, delay=0.02):
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if '"text"' in line:
                    break  # leave mid-stream
        stats = _idle(url)
        assert stats["kv_blocks_used"] == 0
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        stats = _idle(url)
    del engine.abort_request
    assert stats["kv_blocks_used"] == 0
    assert len(aborted) == 2 and max(aborted) < 200  # both were stopped in the engine before their end
    text = httpx.get(f"{url}/metrics").text
    assert re.search(r'infer:request_finished_total\{[^}]*finished_reason="abort"[^}]*\} 2\.0', text)


def test_engine_error_fails_the_request_and_the_loop_lives(url, engine, client):
    real = engine.runner.run
    calls = {"n": 0}

    def broken(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real(batch)

    engine.runner.run = broken
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "boom", "max_tokens": 4})
        assert r.status_code == 500 and "simulated kernel failure" in r.json()["error"]["message"]
        assert _idle(url)["kv_blocks_used"] == 0
        assert client.completions.create(model="tiny-llama", prompt="after", max_tokens=3).usage.completion_tokens
    finally:
        del engine.runner.run


# ---------------------------------------------------------------------------------------------- the CLI process
def test_sigterm_lets_in_flight_finish_and_exits_0(tmp_path):
    with serve_process("--max-model-len", str(MAX_LEN), "--api-key", "k") as (proc, base, _):
        body = {"prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer k"}) as r:
            for line in r.iter_lines():
                if line and not lines:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                lines.append(line)
        assert proc.wait(timeout=60) == 0
        assert [x for x in lines if x][-1] == "data: [DONE]"
        last = json.loads([x for x in lines if x][-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"


def test_cli_refuses_a_busy_port():
    import socket

    from typer.testing import CliRunner

    from infer.cli.main import app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", str(port)])
    assert res.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in res.output
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--max-queue", "0"])
    assert res.exit_code == 2 and "--max-queue" in res.output
