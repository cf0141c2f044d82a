"""Probes of `infer serve`, session 35: a request's bad_words were tokenized again for every check and every choice
(n), on the event loop and the engine thread (a body of long words with n=16 held /health for over a minute);
with --data-parallel, bad_words, min_tokens with allowed_token_ids and a prompt over max_length were 500s (the
driver's checks called engine methods its view of the replicas lacked); an adapter path with a NUL byte, a name too
long or ~user of no user made /v1/load_lora_adapter a 500."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.engine.sampling_params import SamplingParams  # noqa: E402
from infer.engine.setup import load_tokenizer  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from helpers import tiny_chat_model  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory, "probes_s35")


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(EngineConfig(str(model), block_size=4, max_num_seqs=4))


@pytest.fixture(scope="module")
def base(engine):
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=64), "tiny")) as url:
        yield url


def test_bad_words_are_tokenized_once_per_request_on_a_parse_thread(engine, base, monkeypatch):
    words = [f"w{uuid.uuid4().hex} x{i}" for i in range(3)]  # words no other request sent: not cached yet
    calls = []
    encode = engine.tokenizer.encode

    def counting(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return encode(*args, **kwargs)
    monkeypatch.setattr(engine.tokenizer, "encode", counting)
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 4, "bad_words": words},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    assert len(calls) == 2 * len(words)  # each word alone and after a space, once (was 2 x 3 x n)
    assert all(name.startswith("infer-parse") for name in calls), calls  # never the event loop or the engine


def _view(model: Path, **info):
    from infer.parallel.serve_engine import ReplicaView
    cfg = EngineConfig(str(model), block_size=4)
    return ReplicaView(cfg, model, load_tokenizer(model), {"max_model_len": 64, "vocab_size": 512,
                                                          "num_blocks": 100, "adapters": [], **info})


@pytest.mark.parametrize("params, says", [
    (SamplingParams(max_length=2), "max_length"),
    (SamplingParams(min_tokens=1, allowed_token_ids=[2]), "min_tokens"),
])
def test_the_data_parallel_driver_refuses_what_an_engine_refuses(model, engine, params, says):
    """ReplicaView.validate is LLMEngine.validate: every method it reaches is there, so a request an engine refuses
    with a RequestError (a 400) is refused so by the driver too, not with an AttributeError (a 500)."""
    view = _view(model, eos_token_ids=sorted(engine.eos_token_ids), model_limit=engine.model_limit)
    assert 2 in engine.eos_token_ids
    for target in (engine, view):
        with pytest.raises(RequestError) as e:
            target.validate([1, 2, 3], params)
        assert says in str(e.value)
    view.validate([1, 2, 3], SamplingParams(bad_words=["hello world"]))  # tokenized as the engine does
    assert view.bad_word_ids(["hello world"]) == engine.bad_word_ids(["hello world"])


@pytest.mark.parametrize("path", ["adapters/a\x00b", "x" * 5000, "~no-such-user-s35/adapter"])
def test_an_adapter_path_the_file_system_refuses_is_a_400_naming_lora_path(model, path):
    """A NUL byte (ValueError), a name too long (OSError ENAMETOOLONG) or ~user of no user (RuntimeError) escaped
    the adapter's checks: the load was a 500."""
    engine = LLMEngine(EngineConfig(str(model), block_size=4, max_num_seqs=2, enable_lora=True, max_lora_rank=8))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", runtime_lora=True)) as url:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "s35", "lora_path": path}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "lora_path"
        assert "cannot be read" in r.json()["error"]["message"]
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]] == ["tiny"]


def test_more_prompts_than_the_queue_lets_wait_are_refused_before_they_are_read(engine, base, monkeypatch):
    """An 8 MB body of 1.9 million one-token prompts was walked value by value and read prompt by prompt (a parse
    thread held for a minute) before the 400 for more prompts than the server can hold (its 4 running slots and
    --max-queue 64, since the forty-first session): now the count decides first."""
    from infer.serve import body as body_mod, protocol

    def unread(*args, **kwargs):
        raise AssertionError("the prompts were read")
    monkeypatch.setattr(protocol, "_completion_prompts", unread)
    monkeypatch.setattr(body_mod, "_check_finite", unread)
    for prompt, n, says in (([[1]] * 69, None, "69 prompts"), (["a", "b"], 35, "70 choices (prompts x n)")):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": n}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert says in err["message"] and "--max-queue" in err["message"], err
        assert err["param"] == ("n" if n else "prompt")
    monkeypatch.undo()
    r = httpx.post(f"{base}/v1/completions", json={"prompt": [[1]] * 68, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 68, r.text  # at the limit: served


def test_a_choice_checks_its_token_lists_without_an_abc_check_per_token(monkeypatch):
    """Every choice's params are checked on the event loop and twice on the engine thread: 16,384 allowed_token_ids
    took 28 ms a check, an ABC isinstance per token (n = 64: seconds of a stalled event loop and engine). Plain ints
    take the fast path; numpy integers are still turned into ints and bools still refused."""
    import numbers
    from types import SimpleNamespace

    import numpy as np
    from infer.engine import sampling_params as sp
    calls = []

    class CountingMeta(type):
        def __instancecheck__(cls, obj):
            calls.append(obj)
            return isinstance(obj, numbers.Integral)
    monkeypatch.setattr(sp, "numbers", SimpleNamespace(Integral=CountingMeta("Integral", (), {}), Real=numbers.Real))
    params = SamplingParams(allowed_token_ids=list(range(4096)), n=2, seed=3)
    calls.clear()
    params.checked()
    params.sample(1)
    assert len(calls) < 100, len(calls)
    assert SamplingParams(allowed_token_ids=[np.int64(5), 6]).allowed_token_ids == [5, 6]
    assert all(type(t) is int for t in SamplingParams(allowed_token_ids=[np.int32(5)]).allowed_token_ids)
    for bad in ([True, 4], [4.0], ["4"]):
        with pytest.raises(RequestError, match="allowed_token_ids must be a list of token ids"):
            SamplingParams(allowed_token_ids=bad)
