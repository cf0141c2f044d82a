"""Probes of `infer serve`, session 35: a request's bad_words were tokenized again for every check and every choice
(n), on the event loop and the engine thread (a body of long words with n=16 held /health for over a minute);
with --data-parallel, bad_words, min_tokens with allowed_token_ids and a prompt over max_length were 500s (the
driver's checks called engine methods its view of the replicas lacked); an adapter path with a NUL byte, a name too
long or ~user of no user made /v1/load_lora_adapter a 500."""

from __future__ import annotations

import shutil
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
from infer.models.tiny import ensure_builtin  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probes_s35") / "tiny"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


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
